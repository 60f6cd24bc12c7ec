"""A decode step's KV-cache update on the GPU: sf.dynamic_update_slice into a donated cache (writes
the new position's box, in place) against the where() idiom (reads and rewrites the whole cache),
per call, on a serving-size cache [8, 32, 4096, 128] float32 (512 MiB) with heads over tp.

    python benchmarks/kv_cache_update.py [--devices 2] [--calls 20]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import shardfuse as sf


def per_call_s(fn, mesh, spec, shape, calls):
    """Seconds per call of the jitted, donated cache update fn(cache, k, t), after three warm-up calls."""
    import cupy

    b, nh, m, hd = shape
    f = sf.jit(fn, mesh=mesh, donate_argnums=0)
    cache = sf.distribute(np.zeros(shape, np.float32), mesh, spec)
    k = sf.distribute(np.ones((b, nh, 1, hd), np.float32), mesh, spec)
    for t in range(3):  # (compile, bind, first copy of the caller's array)
        cache = f(cache, k, t)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for t in range(3, 3 + calls):
        cache = f(cache, k, t)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    mesh = sf.DeviceMesh((args.devices,), ("tp",), backend="cupy")
    spec = (None, "tp", None, None)  # heads over tp
    shape = (8, 32, 4096, 128)
    pos = np.arange(shape[2])[:, None]
    ways = {"dynamic_update_slice": lambda c, k, t: sf.dynamic_update_slice(c, k, (0, 0, t, 0)),
            "where(pos == t, k, cache)": lambda c, k, t: sf.where(pos == t, k, c)}
    print(f"KV-cache update, cache {shape} float32, heads over tp on {args.devices} devices, donated:")
    for name, fn in ways.items():
        print(f"  {name:28s} {per_call_s(fn, mesh, spec, shape, args.calls) * 1e6:10.1f} us per call")


if __name__ == "__main__":
    main()
