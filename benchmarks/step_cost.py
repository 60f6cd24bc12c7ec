"""The host cost of each bound step of a plan, in isolation: every step of one case of
`shardfuse bench --host` called --calls times in a row (inside one run of the plan, with its
buffers), the wall time per call.  Says which steps the eager issue time is made of (GEMM,
collective, stream switch, event record/wait) and how far each is above the driver's floor,
which it measures too: an empty kernel launch (CuPy RawKernel) and an event record.

    python benchmarks/step_cost.py "D=1 S=8" [--backend cupy] [--calls 200] [--layout natural]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

import shardfuse as sf
from shardfuse.bench import host
from shardfuse.interop import stream_ptr
from shardfuse.pieces import check_args


def floors(calls):
    """Per-call host time of the cheapest things a step can do on this machine's GPU."""
    import cupy
    from cupy_backends.cuda.api import runtime

    from cupy.cuda import driver

    from shardfuse.backends.cuda.libs import Prebound

    k = cupy.RawKernel(r'extern "C" __global__ void nop(float* x) {}', "nop")
    x = cupy.zeros(1, dtype=cupy.float32)
    ev, sp = cupy.cuda.Event(disable_timing=True), cupy.cuda.Stream(non_blocking=True)
    sp_ptr, ev_ptr = sp.ptr, ev.ptr
    k17 = cupy.RawKernel(r'extern "C" __global__ void nop17(%s) {}' % ", ".join(
        f"unsigned long long a{i}" for i in range(17)), "nop17")
    pre17, args17 = Prebound(k17.kernel, 17, driver.launchKernel), [x.data.ptr] * 17
    out = {}
    for name, fn in (("empty RawKernel launch", lambda: k((1,), (1,), (x,), stream=sp)),
                     ("RawKernel launch, 17 arguments", lambda: k17((1,), (1,), tuple(args17), stream=sp)),
                     ("libs.Prebound launch, 17 arguments", lambda: pre17(1, 1, args17, sp_ptr)),
                     ("runtime.eventRecord", lambda: runtime.eventRecord(ev_ptr, sp_ptr)),
                     ("runtime.streamWaitEvent", lambda: runtime.streamWaitEvent(sp_ptr, ev_ptr, 0))):
        out[name] = host.per_call_us(fn, cupy.cuda.Device().synchronize, calls, 5)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", nargs="?", default="D=1 S=8")
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layout", choices=("seed", "natural"), default="seed",
                    help="seed: A [S, D, m, K] sharded on axis 1; natural: A [S * D * m, K] sharded on rows")
    args = ap.parse_args()
    layout = host.natural if args.layout == "natural" else host.seed
    words = args.case.replace("=", " ").split()
    d, s = int(words[words.index("D") + 1]), int(words[words.index("S") + 1])
    mesh = sf.DeviceMesh(d, backend=args.backend)
    call, plan = host.plan_call(mesh, s, False, layout)
    call()
    exe = plan.executable
    f, a, b = layout(mesh, s, False)
    placed = (sf.shard(a, axis=1 if layout is host.seed else 0, mesh=mesh), sf.replicate(b, mesh=mesh))
    infos = check_args(exe.prog, placed, exe.backend, exe.accepted)
    sync = host.sync_of(args.backend)
    per_kind = defaultdict(list)

    def timed(bufs):
        for step in (s.run for s in exe.steps):
            step(bufs)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                step(bufs)
            per_kind[step.__qualname__.replace(".<locals>", "")].append((time.perf_counter() - t0) / args.calls * 1e6)
            sync()

    with exe.lock:
        exe.run(placed, infos, stream_ptr(None) if args.backend == "cupy" else None, issue=timed)
    print(f"{args.case} ({args.layout} layout): {len(exe.steps)} steps; a whole eager call {host.per_call_us(call, sync, 50, 5):.1f} us")
    for kind, us in sorted(per_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kind:<48} x{len(us):<3} {np.median(us):6.1f} us each, {sum(us):7.1f} us in all")
    if args.backend == "cupy":
        for name, us in floors(args.calls).items():
            print(f"  floor: {name:<40} {us:6.1f} us")


if __name__ == "__main__":
    main()
