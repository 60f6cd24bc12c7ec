"""The Python part of the virtual devices' batched GEMM step (backends/cuda/gemm_shared.py), on
any machine: stand-in buffers with data pointers and a no-op matmul, so only the per-call
pointer reading and spacing checks are timed.  Usage: python benchmarks/batched_step_cpu.py"""
import ctypes
import timeit
from types import SimpleNamespace

from shardfuse.backends.cuda.gemm_shared import one_gpu_step


def buf(ptr):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


for d in (2, 4, 8):
    pa, pb, pc = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    args = (ctypes.c_void_p(1),) * 16
    step = one_gpu_step(lambda bufs: None, lambda s: (args, pa, pb, pc, None), lambda *a: 0, (0, 1, 2),
                        [(0, 0, 0)] * d, 2, 64, "x", 256)
    bufs = [[buf((1 << 20) + 4096 * j) for j in range(d)], [buf(1 << 22)] * d,
            [buf((1 << 24) + 4096 * j) for j in range(d)]]
    step(bufs)
    n = 100_000
    best = min(timeit.repeat(lambda: step(bufs), number=n, repeat=5)) / n * 1e6
    print(f"D={d}: {best:.2f} us per step (Python part)")
