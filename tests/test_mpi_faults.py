"""A rank that fails, leaves or stalls must end the whole MPI job fast, with its story visible.

Each test launches plain `mpiexec -n P python tests/mpi_scripts/faulty.py MODE` (no
`python -m mpi4py`: shardfuse's own hooks must do it) as a subprocess with a hard timeout, its
process group killed if it runs over, so a regression fails here instead of hanging the run.
Rank 1 misbehaves in each mode while the others go on into a collective that needs it (see the
script).  In-rank checks (the plan check raising the same error on every rank, results against
NumPy) are tests/mpi/test_faults_in_rank.py, launched by tests/test_mpi.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_mpi import tail, mpirun  # skips this module too where there is no MPI

SCRIPT = str(Path(__file__).resolve().parent / "mpi_scripts" / "faulty.py")
LIMIT = 30  # seconds: every fault must end the job within this (the brief's bound)
ENV = {"SHARDFUSE_TIMEOUT": "20", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

# mode -> what the output must show (regular expressions)
FAULTS = {
    "raise_between": [r"RuntimeError: faulty: rank 1 raises between two calls",
                      r"\[shardfuse rank 1/\d\] uncaught RuntimeError on this rank"],
    "raise_in_step": [r"RuntimeError: faulty: rank 1 raises inside a plan step",
                      r"\[shardfuse rank 1/\d\] uncaught RuntimeError on this rank"],
    "raise_tracing": [r"ValueError: faulty: rank 1 raises while tracing",
                      r"\[shardfuse rank 1/\d\] uncaught ValueError on this rank"],
    "sys_exit0": [r"rank 1: calling sys\.exit\(0\)",
                  r"RankLeftError: \[shardfuse rank \d/\d\] rank\(s\) 1 left the job .* while this rank waited "
                  r"for them in the check of plan '<lambda>'"],  # (every call checks that all ranks run it)
    "exit_in_gather": [r"rank 1: calling sys\.exit\(0\) while the others gather",
                       r"RankLeftError: .*rank\(s\) 1 left the job .* while this rank "
                       r"waited for them in the check of gather\(\) of an sf\.Array float64\[8, 3\]"],
    "sys_exit3": [r"rank 1: calling sys\.exit\(3\)", r"RankLeftError: .*rank\(s\) 1 left the job"],
    "os_exit3": [r"rank 1: calling os\._exit\(3\)"],
    "sleep": [r"rank 1: sleeping past the timeout",
              r"CollectiveTimeoutError: \[shardfuse rank \d/\d\] the check of plan '<lambda>' \(a call\) did not complete "
              r"within 2 s \(SHARDFUSE_TIMEOUT\)",
              r"not arrived: rank\(s\) 1\n +rank 1: no answer"],
    "sleep_in_step": [r"rank 1: sleeping inside a plan step",
                      r"CollectiveTimeoutError: \[shardfuse rank \d/\d\] allgather #\d of plan 'g' over DIDx "
                      r"\(f64\[.*\] per device\) did not complete within 2 s \(SHARDFUSE_TIMEOUT\)",
                      r"not arrived: rank\(s\) 1\n +rank 1: no answer"],
    "mismatch": [r"RankMismatchError: the ranks compiled different versions of plan '<lambda>'",
                 r"first difference between rank 0 and rank 1, line 2:\n  rank 0: plan <lambda>\(x: f64\[8:DIDx, 3\]\)"
                 r".*\n  rank 1: plan <lambda>\(x: f64\[8:DIDx, 2\]\)"],
}


def _run(n, mode, env=None):
    rc, out, secs = mpirun(n, [SCRIPT, mode], timeout=60, env={**ENV, **(env or {})})
    what = f"mpiexec -n {n} python faulty.py {mode}"
    assert rc is not None, f"{what} hung (killed after {secs:.0f} s):\n{tail(out)}"
    return rc, out, secs, what


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_a_fault_on_one_rank_ends_the_job(mode, nprocs):
    rc, out, secs, what = _run(nprocs, mode, {"SHARDFUSE_TIMEOUT": "2"} if mode.startswith("sleep") else None)
    assert rc != 0, f"{what} exited 0 although rank 1 failed:\n{tail(out)}"
    assert secs < LIMIT, f"{what} took {secs:.1f} s to end:\n{tail(out)}"
    assert len(re.findall(r"rank \d: first call ok", out)) == nprocs, tail(out)  # it got going first
    for pattern in FAULTS[mode]:
        assert re.search(pattern, out), f"{what}: no {pattern!r} in the output:\n{tail(out)}"
    assert "UNEXPECTED" not in out, tail(out)


def test_an_exception_in_a_thread_ends_the_job():
    rc, out, secs, what = _run(2, "raise_in_thread")
    assert rc != 0 and secs < LIMIT, (rc, secs, tail(out))
    assert "RuntimeError: faulty: rank 1 raises in a worker thread" in out, tail(out)
    assert "[shardfuse rank 1/2] uncaught RuntimeError in thread 'worker'" in out, tail(out)


def test_ranks_that_finish_at_different_times_exit_cleanly():
    """Rank 1 works on for 3 s after the last collective: the others wait at exit, nobody aborts."""
    rc, out, secs, what = _run(2, "ok_late")
    assert rc == 0, f"{what} failed (exit {rc}):\n{tail(out)}"
    assert len(re.findall(r"rank \d: done", out)) == 2 and secs >= 3, (secs, tail(out))
    assert "shardfuse rank" not in out, tail(out)  # no fault report


def test_fingerprint_cost_script_runs():
    """The measurement script of the plan check's cost works (its figures are in the README; no
    timing is asserted here)."""
    bench = str(Path(SCRIPT).with_name("fingerprint_cost.py"))
    rc, out, secs = mpirun(2, [bench, "200"], timeout=60, env=ENV)
    assert rc == 0, tail(out)
    m = re.search(r"plan check: ([\d.]+) us .* per plan, ([\d.]+) us .* per call", out)
    assert m and "compiling the plan took" in out, tail(out)

