"""One GEMM, three ways, on the same GPU tensors: torch.mm, and shardfuse's plan-issued GEMM with
the cuBLASLt heuristic's first algorithm and with bind-time tuning (SHARDFUSE_GEMM_TUNE).
Interleaved rounds, CUDA events, medians, random inputs.
Usage: python3 benchmarks/gemm_vs_torch.py [M N K]   (default 8192 8192 8192; float16 and bfloat16)"""
import statistics
import sys

import cupy
import torch

import shardfuse as sf
import shardfuse.backends.cupy_nccl as cn
from shardfuse.layout import Layout


def main():
    m, n, k = (int(x) for x in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 8192, 8192)
    mesh = sf.DeviceMesh(1, backend="cupy")
    be = mesh.backend
    for dtype, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        a = torch.randn(m, k, device="cuda").to(tdt)
        b = torch.randn(k, n, device="cuda").to(tdt)
        c = torch.empty(m, n, device="cuda", dtype=tdt)
        bits = torch.uint16 if dtype == "bfloat16" else tdt
        A = sf.Array(mesh, (m, k), dtype, Layout.replicated(2), [cupy.from_dlpack(a.view(bits))])
        B = sf.Array(mesh, (k, n), dtype, Layout.replicated(2), [cupy.from_dlpack(b.view(bits))])
        torch.cuda.synchronize()
        calls = {"torch.mm": lambda: torch.mm(a, b, out=c)}
        for label, tune in (("shardfuse, first heuristic", 0), ("shardfuse, tuned", 8)):
            cn.GEMM_TUNE = tune
            exe = sf.jit(lambda x, y: x @ y, mesh=mesh).lower(A.spec, B.spec).executable  # binds (and tunes) now
            calls[label] = lambda exe=exe: exe(A, B)
        times = {name: [] for name in calls}
        ev = [cupy.cuda.Event(), cupy.cuda.Event()]
        for rnd in range(35):
            for name, fn in calls.items():
                torch.cuda.synchronize()
                be.synchronize()
                st = torch.cuda.current_stream().cuda_stream if name == "torch.mm" else be.stream(0).ptr
                stream = cupy.cuda.ExternalStream(st)
                ev[0].record(stream)
                fn()
                ev[1].record(stream)
                ev[1].synchronize()
                if rnd >= 5:
                    times[name].append(cupy.cuda.get_elapsed_time(ev[0], ev[1]))
        flops = 2.0 * m * n * k
        for name, ts in times.items():
            ms = statistics.median(ts)
            print(f"{dtype:<9} {name:<28} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
