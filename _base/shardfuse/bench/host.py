"""`shardfuse bench --host`: the host's issue time per call (issue 14's table).

The seed AllGather+GEMM on tiny shapes ([S, D, 16, 64] @ [64, 64]; beside it the same work in
the natural layout, [S * D * 16, 64] sharded on rows and streamed in S chunks), so the GPU finishes long
before the host issues the next call: each figure is the wall time per call of --host-calls
calls issued back to back with no synchronisation in between, the median of --host-rounds
runs.  For D = 1, 2, 4, 8 (virtual devices beyond the GPUs there are) and S = 1, 4, 8, eager and
(on GPUs) graph replay, twice: the plan alone (called on sf.Arrays placed once) and the user
path (the user's array placed with sf.shard on every call, a plain weight, the result exported
as a device array: what a training loop does).  Beside them, in the same run, one bare
cupy.matmul (numpy.matmul on NumPy devices) and torch.matmul where torch has a GPU.
"""
from __future__ import annotations

import time

import numpy as np

import shardfuse as sf

DEVICES, CHUNKS = (1, 2, 4, 8), (1, 4, 8)
ROWS, K, N = 16, 64, 64  # a device's rows per chunk, and the GEMM's K and N: tiny on purpose


def seed(mesh, s, graph):
    """The seed's jitted function on `mesh`, and a global A and weight B of its tiny shapes."""
    xp, dt = _array_module(mesh)
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=min(s, 4), graph=graph)
    rng = np.random.default_rng(0)
    a = xp.asarray(rng.standard_normal((s, mesh.size, ROWS, K)).astype(dt))
    b = xp.asarray(rng.standard_normal((K, N)).astype(dt))
    return f, a, b


def natural(mesh, s, graph):
    """The same work in the natural layout (the README's first example): A [S * D * 16, 64]
    sharded on its rows, the product streamed over them in S chunks."""
    f, a, b = seed(mesh, s, graph)
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=s), mesh=mesh, streams=min(s, 4),
               graph=graph)
    return f, a.reshape(-1, K), b


def plan_call(mesh, s, graph, layout=seed):
    """The plan alone: called on sf.Arrays placed once (the seed layout's A sharded on axis 1,
    the natural layout's on axis 0)."""
    f, a, b = layout(mesh, s, graph)
    placed_a, placed_b = sf.shard(a, axis=1 if layout is seed else 0, mesh=mesh), sf.replicate(b, mesh=mesh)
    plan = f.lower(placed_a.spec, placed_b.spec)
    return lambda: plan(placed_a, placed_b), plan


def user_call(mesh, s, graph, torch_arrays=False):
    """The user path: sf.shard of the user's array each call, a plain weight, a device array out
    (CuPy arrays, NumPy on NumPy devices; torch CUDA tensors with torch_arrays)."""
    xp, _ = _array_module(mesh)
    f, a, b = seed(mesh, s, graph)
    out = xp.from_dlpack
    if torch_arrays:
        import torch

        a, b, out = torch.from_dlpack(a), torch.from_dlpack(b), torch.from_dlpack
    return lambda: out(f(sf.shard(a, axis=1, mesh=mesh), b))


def torch_on_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _array_module(mesh):
    if mesh.backend_name == "cupy":
        import cupy

        return cupy, np.float16
    return np, np.float32


def per_call_us(fn, sync, calls, rounds):
    """Median over `rounds` runs of the wall time per call, `calls` calls back to back (no
    synchronisation between them; one before and after each run)."""
    fn()
    sync()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return float(np.median(out))


def baselines(backend, sync, calls, rounds):
    """One bare library GEMM of the same tiny size, host time per call: {name: us}."""
    rng = np.random.default_rng(0)
    if backend != "cupy":
        x = rng.standard_normal((K, N)).astype(np.float32)
        return {"numpy.matmul": per_call_us(lambda: np.matmul(x, x), sync, calls, rounds)}
    import cupy

    x = cupy.asarray(rng.standard_normal((K, N)).astype(np.float16))
    out = {"cupy.matmul": per_call_us(lambda: cupy.matmul(x, x), sync, calls, rounds)}
    try:
        import torch
    except ImportError:
        return out
    if torch.cuda.is_available():
        t = torch.from_dlpack(x)
        out["torch.matmul"] = per_call_us(lambda: torch.matmul(t, t), sync, calls, rounds)
    return out


def suite(backend, calls=50, rounds=5, devices=DEVICES, chunks=CHUNKS, log=None):
    """{"baselines": {name: us}, "rows": [{D, S, eager, eager_natural, eager_user, graph, graph_natural,
    graph_user, steps}]} (and eager_user_torch, graph_user_torch where torch has a GPU)."""
    sync = sync_of(backend)
    rows = []
    modes = (False, True) if backend == "cupy" else (False,)
    torch_too = backend == "cupy" and torch_on_gpu()
    for d in devices:
        mesh = sf.DeviceMesh(d, backend=backend)
        for s in chunks:
            row = {"D": d, "S": s}
            for graph in modes:
                name = "graph" if graph else "eager"
                call, plan = plan_call(mesh, s, graph)
                row[name] = per_call_us(call, sync, calls, rounds)
                row[f"{name}_natural"] = per_call_us(plan_call(mesh, s, graph, natural)[0], sync, calls, rounds)
                row[f"{name}_user"] = per_call_us(user_call(mesh, s, graph), sync, calls, rounds)
                if torch_too:
                    row[f"{name}_user_torch"] = per_call_us(user_call(mesh, s, graph, True), sync, calls, rounds)
                if not graph:
                    row["steps"] = len(plan.executable.steps)
            rows.append(row)
            if log is not None:
                log(f"  D={d} S={s}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items() if isinstance(v, float)))
    return {"baselines": baselines(backend, sync, calls, rounds), "rows": rows}


def sync_of(backend):
    if backend != "cupy":
        return lambda: None
    import cupy

    return lambda: cupy.cuda.Device().synchronize()


def table(result) -> str:
    """The host table: a line per (D, S), eager and graph, plan alone and user path, in us per call;
    eager's per device-step cost beside it; the bare GEMMs last."""
    cols = [c for c in ("eager", "eager_natural", "eager_user", "eager_user_torch", "graph", "graph_natural",
                        "graph_user", "graph_user_torch") if c in result["rows"][0]]
    head = " ".join([f"{'D':>2} {'S':>2}"] + [f"{c:>16}" for c in cols] + [f"{'eager/dev-step':>14}"])
    out = ["host issue time, us per call (calls back to back); natural: the same work with A [rows, K] sharded "
           "on rows (the plan alone); user: the user path (sf.shard in, a device array out), torch: with torch "
           "tensors", head, "-" * len(head)]
    for r in result["rows"]:
        out.append(" ".join([f"{r['D']:>2} {r['S']:>2}"] + [f"{r[c]:16.1f}" for c in cols]
                            + [f"{r['eager'] / (r['D'] * r['S']):14.1f}"]))
    out += [f"{name}: {us:.1f} us per call" for name, us in result["baselines"].items()]
    return "\n".join(out)
