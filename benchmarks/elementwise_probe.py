"""How close the layer's elementwise steps come to the GPU's memory bandwidth: each case one
sf.jit step on one GPU (plan.profile's CUDA-event time of its kernel) beside torch doing the same
on the same tensors (CUDA events), with the bytes each must move and the rate that makes; and
each Fused step's kernel both ways, as CuPy's ElementwiseKernel (before flat_source) and as
flat_source's RawKernel, on the same arrays.  The
cases are the MLP's of benchmarks/layer_profile.py at the layer's sizes (tokens 8192, ffn 16384):
the bias add (a broadcast operand), a same-shape add, the tanh GELU chain, and a row of the
forward's fused bias + GELU.

    python benchmarks/elementwise_probe.py [--tokens 8192] [--width 16384]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import shardfuse as sf


def gelu_tanh(a):
    return a * 0.5 * (1.0 + np.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))


CASES = {  # name: (shardfuse fn, torch fn, operands: "x" [tokens, width], "b" [width])
    "bias add x + b": (lambda x, b: x + b, lambda x, b: x + b, "xb"),
    "same-shape add x + y": (lambda x, y: x + y, lambda x, y: x + y, "xy"),
    "tanh GELU chain": (lambda x: sf.nn.gelu(x), lambda x: torch.nn.functional.gelu(x, approximate="tanh"), "x"),
    "bias + GELU": (lambda x, b: sf.nn.gelu(x + b), lambda x, b: torch.nn.functional.gelu(x + b, approximate="tanh"),
                    "xb"),
    "GELU formula op by op": (gelu_tanh, lambda x: x * 0.5 * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))),
                              "x"),
}


def torch_ms(fn, args, repeat=20):
    fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def kernel_ms(run, repeat=20):
    """Median CUDA-event time of run() on CuPy's current stream."""
    import cupy

    run()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def old_and_new(step):
    """(ms of the Fused step as CuPy's ElementwiseKernel of fused.fused_source, as flat_source's
    RawKernel) on fresh operands of its shapes and dtypes, the same arrays for both."""
    import cupy

    from shardfuse.backends.cuda import csource, flat_source, fused
    from shardfuse.dtypes import np_dtype

    expr, dtypes = step.attrs["expr"], tuple(v.type.dtype for v in step.ins)
    def operand(v):  # (bfloat16 as its bits: CuPy has no bfloat16)
        a = cupy.random.standard_normal(v.type.shape, dtype=cupy.float32)
        if v.type.dtype == "bfloat16":
            return (a.view(cupy.uint32) >> 16).astype(cupy.uint16)
        return a < 0.5 if v.type.dtype == "bool" else a.astype(np_dtype(v.type.dtype))
    ins = [operand(v) for v in step.ins]
    out_dt = step.into.type.dtype
    out = cupy.empty(step.into.type.shape, cupy.uint16 if out_dt in ("bfloat16",) else np_dtype(out_dt))
    params, outp, body = fused.fused_source(expr, dtypes, out_dt)
    old = cupy.ElementwiseKernel(params, outp, body, "sf_fused", preamble=csource.BF16_PREAMBLE)
    src, name, threads, blocks, count = flat_source.source(
        expr, dtypes, tuple((a.shape, tuple(s // a.itemsize for s in a.strides)) for a in ins),
        (out_dt, out.shape, tuple(s // out.itemsize for s in out.strides)))
    new = cupy.RawKernel(src, name)
    return kernel_ms(lambda: old(*ins, out)), kernel_ms(lambda: new((blocks,), (threads,), (*ins, out, np.int64(count))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--width", type=int, default=16384)
    args = ap.parse_args()
    mesh = sf.DeviceMesh(1, backend="cupy")
    t, w = args.tokens, args.width
    tensors = {"x": torch.randn(t, w, device="cuda", dtype=torch.bfloat16),
               "y": torch.randn(t, w, device="cuda", dtype=torch.bfloat16),
               "b": torch.randn(w, device="cuda", dtype=torch.bfloat16)}
    print(f"{torch.cuda.get_device_name()}  bfloat16 [{t}, {w}]")
    for name, (sf_fn, torch_fn, operands) in CASES.items():
        ins = [tensors[k] for k in operands]
        moved = sum(a.numel() * 2 for a in ins) + t * w * 2
        fn = sf.jit(sf_fn, mesh=mesh)
        plan = fn.lower(*ins)
        fn(*ins)
        tl = plan.profile(*ins, repeat=20)
        steps = [e for e in tl.events if e.text.split()[0] not in ("Allocate", "Free")]
        per_call = sorted(sum(e.duration for e in steps if e.call == c) for c in {e.call for e in steps})
        ms = per_call[len(per_call) // 2] * 1e3
        tm = torch_ms(torch_fn, ins)
        print(f"  {name:22s} shardfuse {ms:7.3f} ms ({moved / ms / 1e9:5.2f} TB/s)   torch {tm:7.3f} ms "
              f"({moved / tm / 1e9:5.2f} TB/s)   {' | '.join(sorted({e.text[:70] for e in steps}))}")
        for step in (i for i in plan.program.walk() if i.op == sf.ops.Op.FUSED):
            old, new = old_and_new(step)
            print(f"      Fused step: ElementwiseKernel {old:7.3f} ms, flat RawKernel {new:7.3f} ms")


if __name__ == "__main__":
    main()
