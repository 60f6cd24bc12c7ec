"""Checks the Abort hook of tests/mpi/conftest.py (run explicitly by tests/test_mpi.py, never
collected by the normal MPI run): the assertion fails on rank 1 only, while rank 0 goes on
into a collective that rank 1 will never join.  The hook must end the job at once."""
from mpi4py import MPI

import cases
import shardfuse as sf


def test_fails_on_rank_1_only():
    mesh = sf.DeviceMesh(MPI.COMM_WORLD.Get_size())
    assert mesh.rank != 1, "hook_failure_check: injected failure on rank 1"
    cases.allgather_case(mesh, 0)  # rank 0 waits here for rank 1


def test_never_reached():
    MPI.COMM_WORLD.Barrier()
