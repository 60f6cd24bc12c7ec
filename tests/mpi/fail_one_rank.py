"""A job in which one rank fails before a collective that the other ranks have entered.

Run as `mpiexec -n 2 python -m mpi4py tests/mpi/fail_one_rank.py`: rank 1 raises before
the allgather while rank 0 waits in it.  `-m mpi4py` turns rank 1's unhandled exception
into MPI_Abort, so the job must end at once with a non-zero status and rank 1's message
(tests/test_mpi.py checks that), instead of hanging.
"""
import time

import numpy as np

import shardfuse as sf

mesh = sf.DeviceMesh(4)
f = sf.jit(lambda x: sf.replicate(sf.shard(x, axis=0)), mesh=mesh)
x = np.arange(8.0 * 3).reshape(8, 3)
plan = f.lower(sf.TensorSpec(x.shape, "float64"))
print(f"rank {mesh.rank}: bound, entering the allgather", flush=True)
if mesh.rank == 1:
    time.sleep(1.0)  # let rank 0 get well into its Iallgather / Wait first
    raise RuntimeError("fail_one_rank: rank 1 fails on purpose before the collective")
out = plan(x)  # rank 0 posts the Iallgather and waits for rank 1, which never comes
print(f"rank {mesh.rank}: UNEXPECTED: the collective completed: {out.gather().sum()}", flush=True)
