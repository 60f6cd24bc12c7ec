"""The user path's host time in graph mode, stage by stage, beside the floor of the CuPy calls any
such path makes (issue 29, item 2: the target of 40 us per call at D = 1).

`shardfuse bench --host`'s user path is `cupy.from_dlpack(f(sf.shard(a, axis=1, mesh=mesh), b))`
on tiny shapes (the GPU idles; the host's issue time is all that is timed), on CuPy arrays and,
where torch sees the GPU, on torch tensors (torch.from_dlpack out).  This times it built
up one stage at a time, each the wall time per call of calls issued back to back (median of
rounds), so the difference between two rows is what that stage adds:

  plan alone         f(placed_a, placed_b): both placed once, before the loop
  + sf.shard(a)      the activation placed on every call
  + plain weight     b passed as the caller's array (the plan adopts it each call)
  + export           cupy.from_dlpack of the result (the user path of bench --host)

then sf.shard(a) and the export each alone (on a result made once),
and, measured in the same run, the bare CuPy calls under it (a captured graph's launch, the
four event calls that order the plan with the caller's stream, one cupy.from_dlpack), whose sum
is the floor of any graph-mode call made through CuPy's Python API.

    python benchmarks/user_path_floor.py [D] [S] [--calls 200] [--rounds 7]
"""
from __future__ import annotations

import argparse

import numpy as np

import shardfuse as sf
from shardfuse.bench import host


def stages(mesh, s, calls, rounds, sync, torch_arrays=False):
    """{stage: us per call} for the graph-mode user path of `shardfuse bench --host` at (D, S),
    on CuPy arrays (exported with cupy.from_dlpack) or torch tensors (torch.from_dlpack)."""
    import cupy

    f, a, b = host.seed(mesh, s, graph=True)
    export = cupy.from_dlpack
    if torch_arrays:
        import torch

        a, b, export = torch.from_dlpack(a), torch.from_dlpack(b), torch.from_dlpack
    placed_a, placed_b = sf.shard(a, axis=1, mesh=mesh), sf.replicate(b, mesh=mesh)
    fns = {
        "plan alone": lambda: f(placed_a, placed_b),
        "+ sf.shard(a)": lambda: f(sf.shard(a, axis=1, mesh=mesh), placed_b),
        "+ plain weight": lambda: f(sf.shard(a, axis=1, mesh=mesh), b),
        "+ export (the user path)": lambda: export(f(sf.shard(a, axis=1, mesh=mesh), b)),
    }
    out = {name: host.per_call_us(fn, sync, calls, rounds) for name, fn in fns.items()}
    result = f(placed_a, placed_b)
    alone = {"sf.shard(a)": lambda: sf.shard(a, axis=1, mesh=mesh),
             f"{export.__module__.split('.')[0]}.from_dlpack(result)": lambda: export(result)}
    return out, {name: host.per_call_us(fn, sync, calls, rounds) for name, fn in alone.items()}


def floor(calls, rounds, sync):
    """{bare CuPy call: us per call}: what a graph-mode call through CuPy's Python API cannot skip."""
    import cupy
    from cupy_backends.cuda.api import runtime

    x = cupy.asarray(np.random.default_rng(0).standard_normal((host.K, host.N)).astype(np.float16))
    # (cupy.matmul refuses a capture, FIELD-NOTES.md: a one-kernel graph; a launch costs about
    # the same whatever the graph holds)
    nop = cupy.RawKernel(r'extern "C" __global__ void nop(float* x) {}', "nop")
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        side.begin_capture()
        nop((1,), (1,), (x,), stream=side)
        graph = side.end_capture()
    ev = cupy.cuda.Event(disable_timing=True)
    caller, plan = cupy.cuda.get_current_stream().ptr, side.ptr

    def fences():  # the plan's stream waits for the caller's, then the caller's for the plan's
        runtime.eventRecord(ev.ptr, caller)
        runtime.streamWaitEvent(plan, ev.ptr, 0)
        runtime.eventRecord(ev.ptr, plan)
        runtime.streamWaitEvent(caller, ev.ptr, 0)

    return {"Graph.launch": host.per_call_us(lambda: graph.launch(side), sync, calls, rounds),
            "four event calls (fence in and out)": host.per_call_us(fences, sync, calls, rounds),
            "cupy.from_dlpack(cupy array)": host.per_call_us(lambda: cupy.from_dlpack(x), sync, calls, rounds)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("d", nargs="?", type=int, default=1)
    ap.add_argument("s", nargs="?", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    mesh = sf.DeviceMesh(args.d, backend="cupy")
    sync = host.sync_of("cupy")
    kinds = [False] + ([True] if host.torch_on_gpu() else [])
    for torch_arrays in kinds:
        print(f"graph-mode user path on {'torch tensors' if torch_arrays else 'CuPy arrays'}, D={args.d} S={args.s}, "
              f"us per call (median of {args.rounds} x {args.calls} calls)")
        prev = None
        built, alone = stages(mesh, args.s, args.calls, args.rounds, sync, torch_arrays)
        for name, us in built.items():
            print(f"  {name:32s} {us:8.1f}" + ("" if prev is None else f"   (+{us - prev:.1f})"))
            prev = us
        print("each alone:")
        for name, us in alone.items():
            print(f"  {name:32s} {us:8.1f}")
    parts = floor(args.calls, args.rounds, sync)
    print("bare CuPy calls under it:")
    for name, us in parts.items():
        print(f"  {name:36s} {us:8.1f}")
    print(f"  {'floor (their sum)':36s} {sum(parts.values()):8.1f}")
    for name, us in host.baselines("cupy", sync, args.calls, args.rounds).items():
        print(f"{name}: {us:.1f} us per call")


if __name__ == "__main__":
    main()
