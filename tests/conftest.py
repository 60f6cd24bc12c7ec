import os

# Poison every buffer a backend allocates (NaN), so an element a plan fails to write fails the test.
os.environ.setdefault("SHARDFUSE_POISON", "1")

# tests/mpi/ runs inside mpiexec ranks, launched by tests/test_mpi.py; never collect it directly.
collect_ignore = ["mpi"]
