import os

# Poison every buffer a backend allocates (NaN), so an element a plan fails to write fails the test.
os.environ.setdefault("SHARDFUSE_POISON", "1")

# tests/mpi/ runs inside mpiexec ranks, launched by tests/test_mpi.py; never collect it directly.
collect_ignore = ["mpi"]

# Hypothesis profiles for tests/test_differential.py (which uses "ci" unless another profile is
# loaded; the other property tests keep their own settings):
#   "ci": deterministic (derandomized), sized for CI's two slow cores;
#   "long": random, many more examples: pytest tests/test_differential.py --hypothesis-profile=long
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True, database=None,
                          print_blob=True)
settings.register_profile("long", max_examples=5000, deadline=None, derandomize=False, print_blob=True)


def pytest_addoption(parser):
    parser.addoption("--part", default=None, metavar="K/N",
                     help="run the K-th of N parts of the collected tests (every N-th test from the "
                          "K-th, K from 1): benchmarks/gpu_first.sh splits the GPU suite over device "
                          "calls of 600 s so, each part a mix of every file")


def pytest_collection_modifyitems(config, items):
    part = config.getoption("--part")
    if part:
        import re

        import pytest
        m = re.fullmatch(r"(\d+)/(\d+)", part)
        if not m or not 1 <= int(m[1]) <= int(m[2]):
            raise pytest.UsageError(f"--part takes K/N with 1 <= K <= N (the K-th of N parts), got {part!r}")
        k, n = int(m[1]), int(m[2])
        keep = set(range(k - 1, len(items), n))
        config.hook.pytest_deselected(items=[t for j, t in enumerate(items) if j not in keep])
        items[:] = [t for j, t in enumerate(items) if j in keep]
