"""Runs inside every rank of `mpiexec -n P python -m mpi4py -m pytest tests/mpi/` (launched by
tests/test_mpi.py; the outer run never collects this folder, see tests/conftest.py).

A test that fails on one rank would leave the other ranks waiting in its collectives, or
pair them with the next test's.  So a failure (or a collection error) on any rank prints its
report, tagged with the rank, and calls MPI.COMM_WORLD.Abort(1): the whole job ends at once
with a non-zero exit status.  At the end each rank writes its counts to
$SHARDFUSE_MPI_REPORT/rank<r>.json (when set), which the outer test checks.

A test that hangs (a collective nobody else joined) dumps every thread's stack after
$SHARDFUSE_MPI_TEST_TIMEOUT seconds (default 60) and exits that rank, which ends the job:
the outer test then shows where each rank was stuck instead of only timing out.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys

import pytest

os.environ.setdefault("SHARDFUSE_POISON", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: cases.py

from mpi4py import MPI  # noqa: E402

from shardfuse import faults  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
_counts = {"passed": 0, "failed": 0, "skipped": 0}
TEST_TIMEOUT = float(os.environ.get("SHARDFUSE_MPI_TEST_TIMEOUT", "60"))
_stderr_fd = None  # a copy of the real stderr, taken while pytest's capture is suspended


def pytest_configure(config):
    global _stderr_fd
    _stderr_fd = os.dup(2)


def _abort(what, report):
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    msg = (f"\n[rank {RANK}/{SIZE}] {what} FAILED: {report.nodeid}\n{text}\n"
           f"[rank {RANK}/{SIZE}] aborting the MPI job\n")
    sys.stdout.flush()
    if _stderr_fd is not None:  # the real stderr, whatever pytest is capturing now
        os.write(_stderr_fd, msg.encode("utf-8", "replace"))
    else:
        sys.stderr.write(msg)
        sys.stderr.flush()
    # Not COMM.Abort(1) straight away: MPICH's launcher drops output still in the pipe when the
    # Abort arrives (the whole report, about 1 run in 30: the flaky empty-output failure of
    # test_pytest_abort_hook_ends_the_job_when_one_rank_fails).  faults.abort waits (2 s at
    # most) until the launcher has read our stdout and stderr, then aborts.
    faults.abort("", 1, drain=[_stderr_fd] if _stderr_fd is not None else [])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        _abort(f"test ({rep.when})", rep)
    if rep.when == "call" and rep.passed:
        _counts["passed"] += 1
    elif rep.skipped:
        _counts["skipped"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TEST_TIMEOUT > 0:
        faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True, file=_stderr_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    if SIZE == 1:  # run directly, not under mpiexec: these tests need P > 1 processes
        skip = pytest.mark.skip(reason="tests/mpi/ runs under mpiexec -n P (P > 1); "
                                       "python -m pytest tests/test_mpi.py launches it")
        for item in items:
            item.add_marker(skip)


def pytest_collectreport(report):
    if report.failed:
        _abort("collection", report)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("SHARDFUSE_MPI_REPORT")
    if out:
        with open(os.path.join(out, f"rank{RANK}.json"), "w") as f:
            json.dump({"rank": RANK, "size": SIZE, "exitstatus": int(exitstatus), **_counts}, f)
