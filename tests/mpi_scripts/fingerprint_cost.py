"""The cost of the plan check (faults.agree: hash + one 16-byte Iallgather): per plan (a new
text, hashed) and per call (a plan's text again: its hash is kept, only the Iallgather runs).

`mpiexec -n P python tests/mpi_scripts/fingerprint_cost.py [N]` prints, on rank 0, the mean and
median time of N checks of distinct real plan texts and of N checks of one, beside the time to
compile one such plan.
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


def timed(texts):
    times = []
    for k, t in enumerate(texts):
        MPI.COMM_WORLD.Barrier()  # start together: time the exchange, not the skew between ranks
        t0 = time.perf_counter()
        faults.agree(t, f"plan {k % 2}")
        times.append((time.perf_counter() - t0) * 1e6)
    return f"{statistics.mean(times):.1f} us (median {statistics.median(times):.1f}, max {max(times):.1f})"


per_plan = timed([f"{text}\n# {k}" for k in range(n)])  # a distinct text each time, as distinct plans have
per_call = timed([text] * n)
if mesh.rank == 0:
    print(f"{mesh.nprocs} processes, plan text {len(text)} bytes: plan check: {per_plan} per plan, {per_call} per "
          f"call; compiling the plan took {compile_ms:.1f} ms", flush=True)
