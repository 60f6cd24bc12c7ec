"""Host issue time per call of a bound plan (issue 14's table): the seed AllGather+GEMM on tiny fp16
shapes, D virtual devices on one GPU, S chunks, 50 calls back to back with no synchronisation in
between, so the figure is the host's issue time.  With --profile, the cProfile top entries of the
largest case (where the Python time goes).  The user path: a CuPy array placed with sf.shard each call,
a plain CuPy weight, the result exported with cupy.from_dlpack (what a training loop does).

    python benchmarks/host_cost.py [--profile "D=8 S=8 eager"] [--json out.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import cupy
import numpy as np

import shardfuse as sf
from shardfuse.runtime import backend_of

CALLS = 50


def per_call_us(fn, calls=CALLS, rounds=5):
    """Median over rounds of the wall time per call, calls issued back to back."""
    fn()
    cupy.cuda.Device().synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        cupy.cuda.Device().synchronize()
    return float(np.median(out))


def seed_plan(d, s, graph=False):
    mesh = sf.DeviceMesh(d, backend="cupy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=min(s, 4), graph=graph)
    a = cupy.random.standard_normal((s, d, 16, 64)).astype(cupy.float16)
    b = cupy.random.standard_normal((64, 64)).astype(cupy.float16)
    a_placed = sf.shard(a, axis=1, mesh=mesh)
    b_placed = sf.replicate(b, mesh=mesh)
    plan = f.lower(a_placed.spec, b_placed.spec)
    return mesh, plan, a_placed, b_placed


def user_path(d, s, graph):
    """One training-loop call: place a device array with sf.shard, pass a plain weight, export the result."""
    mesh = sf.DeviceMesh(d, backend="cupy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=min(s, 4), graph=graph)
    a = cupy.random.standard_normal((s, d, 16, 64)).astype(cupy.float16)
    b = cupy.random.standard_normal((64, 64)).astype(cupy.float16)
    return lambda: cupy.from_dlpack(f(sf.shard(a, axis=1, mesh=mesh), b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", nargs="?", const="D=8 S=8 eager", default=None,
                    help='cProfile one case, e.g. "D=1 S=8 eager" or "D=1 S=1 graph user"')
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    x = cupy.random.standard_normal((64, 64)).astype(cupy.float16)
    rows.append({"case": "cupy.matmul 64x64", "us": per_call_us(lambda: cupy.matmul(x, x))})
    for d, s in ((1, 1), (1, 8), (2, 8), (8, 1), (8, 8)):
        for graph in (False, True):
            mesh, plan, a, b = seed_plan(d, s, graph)
            us = per_call_us(lambda: plan(a, b))
            steps = len(plan.executable.steps)
            rows.append({"case": f"D={d} S={s} {'graph' if graph else 'eager'}", "us": us, "steps": steps,
                         "us_per_device_step": us / (d * s)})
            user = user_path(d, s, graph)
            rows.append({"case": f"D={d} S={s} {'graph' if graph else 'eager'} user", "us": per_call_us(user)})
    for r in rows:
        extra = f"  steps {r['steps']:4d}  per device-step {r['us_per_device_step']:.1f} us" if "steps" in r else ""
        print(f"{r['case']:28s} {r['us']:8.1f} us/call{extra}")
    if args.profile:
        words = args.profile.replace("=", " ").split()
        d, s, graph = int(words[1]), int(words[3]), "graph" in words
        if "user" in words:
            call = user_path(d, s, graph)
        else:
            mesh, plan, a, b = seed_plan(d, s, graph)
            call = lambda: plan(a, b)  # noqa: E731
        call()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            call()
        pr.disable()
        cupy.cuda.Device().synchronize()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[:6000])
    if args.json:
        env = backend_of(sf.DeviceMesh(1, backend="cupy")).describe()
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "env": env, "rows": rows},
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
