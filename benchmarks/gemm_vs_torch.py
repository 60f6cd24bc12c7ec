"""One GEMM, three ways, on the same GPU tensors: torch.mm, and shardfuse's plan-issued GEMM with
the cuBLASLt heuristic's first algorithm and with bind-time tuning (SHARDFUSE_GEMM_TUNE).
The torch tensors go to shardfuse through the public API (sf.replicate, zero copy), every call
runs on torch's current stream.  Interleaved rounds, CUDA events, medians, random inputs.
Usage: python3 benchmarks/gemm_vs_torch.py [M N K]   (default 8192 8192 8192; float16 and bfloat16)"""
import statistics
import sys

import torch

import shardfuse as sf
import shardfuse.backends.cupy_nccl as cn


def main():
    m, n, k = (int(x) for x in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 8192, 8192)
    mesh = sf.DeviceMesh(1, backend="cupy")
    stream = torch.cuda.current_stream()  # shardfuse calls wait for it, and it for their outputs
    for dtype, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        a = torch.randn(m, k, device="cuda").to(tdt)
        b = torch.randn(k, n, device="cuda").to(tdt)
        c = torch.empty(m, n, device="cuda", dtype=tdt)
        A, B = sf.replicate(a, mesh=mesh), sf.replicate(b, mesh=mesh)
        torch.cuda.synchronize()
        calls = {"torch.mm": lambda: torch.mm(a, b, out=c)}
        for label, tune in (("shardfuse, first heuristic", 0), ("shardfuse, tuned", 8)):
            cn.GEMM_TUNE = tune  # read when a plan binds (the SHARDFUSE_GEMM_TUNE setting)
            plan = sf.jit(lambda x, y: x @ y, mesh=mesh).lower(A.spec, B.spec)
            plan(A, B, stream=stream)  # binds (and tunes) now, outside the timed rounds
            calls[label] = lambda plan=plan: plan(A, B, stream=stream)
        ref = (a.double() @ b.double())
        for name, fn in calls.items():
            got = torch.from_dlpack(fn())  # torch.mm's own tensor, or the plan's result
            err = float((got.double() - ref).norm() / ref.norm())
            assert err < 2e-2, f"{name}: relative error {err:.1e}"
        times = {name: [] for name in calls}
        ev = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
        for rnd in range(35):
            for name, fn in calls.items():
                torch.cuda.synchronize()
                ev[0].record(stream)
                fn()
                ev[1].record(stream)
                ev[1].synchronize()
                if rnd >= 5:
                    times[name].append(ev[0].elapsed_time(ev[1]))
        flops = 2.0 * m * n * k
        for name, ts in times.items():
            ms = statistics.median(ts)
            print(f"{dtype:<9} {name:<28} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
