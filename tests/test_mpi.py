"""The MPI tier, from the one normal test command (`python -m pytest`).

Each test launches `mpiexec -n P` as a subprocess with a timeout (its whole process group
is killed if it runs over), so a hang fails the test instead of the run:

* tests/mpi/ (the shared case bodies on the MPI backend, and the in-rank fault tests marked
  @pytest.mark.mpi) as plain `mpiexec -n P python -m pytest --with-mpi tests/mpi` (no
  `-m mpi4py`: shardfuse's own hooks abort the job when a rank fails) under -n 2 and -n 4,
  checking the job passed and ran > 0 tests on every rank;
* a job where rank 1 fails before a collective that rank 0 has entered must end fast, with a
  non-zero status and rank 1's message (tests/mpi/fail_one_rank.py, and the pytest Abort hook);
  so must a job where rank 0 waits alone in a collective (the per-test hang guard).  These
  keep `python -m mpi4py`, the old way, which must go on working beside shardfuse's hooks
  (tests/test_mpi_faults.py launches plain scripts);
* `mpiexec -n 2 python -m shardfuse demo --repeat 1` and `mpiexec -n 4 shardfuse demo --repeat 1`
  print OK, with one device per process; so does `mpiexec -n 2 python -m shardfuse demo --train`.

mpiexec is looked for next to sys.executable first (the `mpich` wheel puts it in the venv),
then on PATH.  Skipped, with the reason, only when there is no mpiexec or no mpi4py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPI_TESTS = ROOT / "tests" / "mpi"


def _find_mpiexec():
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


MPIEXEC = _find_mpiexec()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None

if MPIEXEC is None or not HAVE_MPI4PY:
    pytest.skip("MPI tier skipped: " + ("no mpiexec next to sys.executable or on PATH" if MPIEXEC is None
                                        else "mpi4py is not installed") + " (pip install -e '.[mpi,test]')",
                allow_module_level=True)
if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
    pytest.skip("MPI tier skipped: this pytest itself runs under mpiexec (no nested launches)",
                allow_module_level=True)


def _launcher_flags():
    """Open MPI wants --oversubscribe for 4 ranks on 2 cores, and --allow-run-as-root as root."""
    try:
        version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=20,
                                 stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    if "Open MPI" not in version and "OpenRTE" not in version:
        return []
    flags = ["--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return flags


FLAGS = _launcher_flags()


def mpirun(n, args, timeout, env=None, program=None):
    """Run `mpiexec -n n python ARGS` (or `mpiexec -n n PROGRAM ARGS`) from the repo root:
    (returncode or None on timeout, combined output, seconds)."""
    cmd = [MPIEXEC, "-n", str(n), *FLAGS, program or sys.executable, *args]
    # The MPI tier is the NumPy-over-MPI backend: hide GPUs, or the mesh would pick CuPy+NCCL
    # (which also refuses several ranks on one GPU).
    full_env = {**os.environ, "SHARDFUSE_POISON": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
                **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        out, _ = proc.communicate()
        rc = None
    return rc, out, time.monotonic() - t0


def tail(out, n=6000):
    return out if len(out) <= n else "...\n" + out[-n:]


# ---- the shared case bodies on the MPI backend --------------------------------------------
@pytest.mark.parametrize("nprocs", [2, 4])
def test_mpi_cases(nprocs, tmp_path):
    # BLAS threads of P ranks on 2 cores only fight each other (and the test matrices are tiny).
    env = {"SHARDFUSE_MPI_REPORT": str(tmp_path),
           "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # --with-mpi: pytest-mpi runs the @pytest.mark.mpi tests, and skips them without it.  It takes
    # every test under a folder named `mpi` (a node keyword) for one, so each launch of tests/mpi/
    # here passes --with-mpi.
    rc, out, secs = mpirun(nprocs, ["-m", "pytest", "--with-mpi", str(MPI_TESTS), "-q", "-p", "no:cacheprovider"],
                           timeout=240, env=env)
    assert rc is not None, f"mpiexec -n {nprocs} pytest tests/mpi/ hung (killed after {secs:.0f} s):\n{tail(out)}"
    assert rc == 0, f"mpiexec -n {nprocs} pytest tests/mpi/ failed (exit {rc}):\n{tail(out)}"
    # pytest's own summary line(s): "N passed[, M skipped] in Xs", one per rank (may interleave)
    passed = [int(m) for m in re.findall(r"(\d+) passed", out)]
    assert passed and max(passed) > 0, f"no tests ran under mpiexec -n {nprocs}:\n{tail(out)}"
    assert not re.search(r"\d+ (failed|error)", out), tail(out)
    # and every rank's own count (written by tests/mpi/conftest.py)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(nprocs)), f"missing rank reports:\n{tail(out)}"
    counts = {r["passed"] for r in reports}
    assert len(counts) == 1 and counts.pop() > 0, reports
    assert all(r["failed"] == 0 and r["exitstatus"] == 0 and r["size"] == nprocs for r in reports), reports


# ---- a rank that fails before a collective ends the job, fast --------------------------------
FAST = 20  # seconds: a failure must end the job well before any hang detector would


def test_one_rank_failing_before_a_collective_ends_the_job():
    rc, out, secs = mpirun(2, ["-m", "mpi4py", str(MPI_TESTS / "fail_one_rank.py")], timeout=60)
    assert rc is not None, f"the job hung after rank 1 failed (killed after {secs:.0f} s):\n{tail(out)}"
    assert rc != 0, f"the job exited 0 although rank 1 failed:\n{tail(out)}"
    assert secs < FAST, f"the job took {secs:.1f} s to end after rank 1 failed:\n{tail(out)}"
    assert "rank 1 fails on purpose before the collective" in out, tail(out)
    assert "rank 0: bound, entering the allgather" in out, tail(out)
    assert "UNEXPECTED" not in out, tail(out)


def test_pytest_abort_hook_ends_the_job_when_one_rank_fails():
    rc, out, secs = mpirun(2, ["-m", "mpi4py", "-m", "pytest", "--with-mpi", str(MPI_TESTS / "hook_failure_check.py"),
                               "-q", "-p", "no:cacheprovider"], timeout=60)
    assert rc is not None, f"the job hung after a test failed on rank 1 (killed after {secs:.0f} s):\n{tail(out)}"
    assert rc != 0 and secs < FAST, (rc, secs, tail(out))
    assert "[rank 1/2] test (call) FAILED" in out and "injected failure on rank 1" in out, tail(out)


def test_hang_guard_ends_a_job_stuck_in_a_collective():
    rc, out, secs = mpirun(2, ["-m", "mpi4py", "-m", "pytest", "--with-mpi", str(MPI_TESTS / "hang_check.py"),
                               "-q", "-p", "no:cacheprovider"], timeout=60, env={"SHARDFUSE_MPI_TEST_TIMEOUT": "3"})
    assert rc is not None, f"the hang guard did not fire (killed after {secs:.0f} s):\n{tail(out)}"
    assert rc != 0 and secs < FAST, (rc, secs, tail(out))
    assert "Timeout (0:00:03)!" in out and "test_rank_0_waits_alone" in out, tail(out)


# ---- the demo, one device per process -----------------------------------------------------
def _check_demo(what, n, rc, out, secs):
    assert rc == 0, f"{what} failed (exit {rc}, {secs:.0f} s):\n{tail(out)}"
    assert f"{n} process(es)" in out and f"DIDx={n}," in out, tail(out)  # one device per process
    assert re.search(r"relative error \S+ \(tolerance \S+\) -> OK", out), tail(out)
    assert "FAILED" not in out, tail(out)


def test_demo_under_mpiexec():
    rc, out, secs = mpirun(2, ["-m", "shardfuse", "demo", "--repeat", "1"], timeout=120)
    _check_demo("mpiexec -n 2 python -m shardfuse demo --repeat 1", 2, rc, out, secs)


def test_demo_console_script_under_mpiexec_4():
    script = Path(sys.executable).parent / "shardfuse"
    if not script.is_file():
        pytest.skip(f"no shardfuse console script next to {sys.executable} (pip install -e .)")
    rc, out, secs = mpirun(4, ["demo", "--repeat", "1"], timeout=120, program=str(script))
    _check_demo("mpiexec -n 4 shardfuse demo --repeat 1", 4, rc, out, secs)


def test_demo_train_under_mpiexec():
    """`shardfuse demo --train` with one device per process: rank 0 prints the float64 gradient check
    and the losses of the Adam steps, falling."""
    rc, out, secs = mpirun(2, ["-m", "shardfuse", "demo", "--train", "--hidden", "16", "--chunks", "2", "--steps", "3"],
                           timeout=120)
    assert rc == 0, f"mpiexec -n 2 python -m shardfuse demo --train failed (exit {rc}, {secs:.0f} s):\n{tail(out)}"
    assert out.count("a 2-layer GPT") == 1 and "DeviceMesh(tp=2" in out, tail(out)  # rank 0 prints
    assert re.search(r"central difference \S+ -> OK", out) and "FAILED" not in out, tail(out)
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], tail(out)
