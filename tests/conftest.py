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
