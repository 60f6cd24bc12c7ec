"""The cost of the plan check (faults.agree: hash + one 16-byte Iallgather), per plan.

`mpiexec -n P python tests/mpi_scripts/fingerprint_cost.py [N]` prints, on rank 0, the mean and
median time of N checks of distinct real plan texts, beside the time to compile one such plan.
"""
import statistics
import sys
import time

from mpi4py import MPI

import shardfuse as sf
from shardfuse import faults

n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
mesh = sf.DeviceMesh(4)


@sf.jit(mesh=mesh, streams=4)
def ag_matmul(a, b):
    return sf.stream(sf.shard(a, axis=1, over="DIDx") @ b, axis=0)


t0 = time.perf_counter()
plan = ag_matmul.lower(sf.TensorSpec((8, 4, 16, 32), "float32"), sf.TensorSpec((32, 24), "float32"))
compile_ms = (time.perf_counter() - t0) * 1e3
text = f"mesh {mesh!r}\n{plan}"
faults.agree(text, "warm-up")  # the first check also waits for the control communicator
times = []
for k in range(n):
    MPI.COMM_WORLD.Barrier()  # start together: time the exchange, not the skew between ranks
    t0 = time.perf_counter()
    faults.agree(f"{text}\n# {k}", f"plan {k}")  # a distinct text each time, as distinct plans have
    times.append((time.perf_counter() - t0) * 1e6)
if mesh.rank == 0:
    print(f"{mesh.nprocs} processes, plan text {len(text)} bytes: plan check: {statistics.mean(times):.1f} us per plan "
          f"(median {statistics.median(times):.1f}, max {max(times):.1f}); compiling the plan took {compile_ms:.1f} ms",
          flush=True)
