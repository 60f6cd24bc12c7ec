"""Checks the per-test hang guard of tests/mpi/conftest.py (run explicitly by tests/test_mpi.py
with SHARDFUSE_MPI_TEST_TIMEOUT=3, never collected by the normal MPI run): rank 0 enters a
collective that rank 1 never joins.  Rank 0 must dump its stack and exit, ending the job."""
from mpi4py import MPI


def test_rank_0_waits_alone():
    if MPI.COMM_WORLD.Get_rank() == 0:
        MPI.COMM_WORLD.Barrier()  # rank 1 never comes
