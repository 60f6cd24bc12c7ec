"""The GEMM+ReduceScatter suite: the row-parallel linear.

x [M, K] column-sharded, w [K, N] row-sharded, the output reduce-scattered on rows.  Times the
pipelined GEMM+ReduceScatter for each S (each chunk's partial sums reduce-scattered on its
stream while the next chunk multiplies), the unpipelined plan (one GEMM, then one
ReduceScatter), the local GEMM alone and the ReduceScatter alone (of a partial [M, N]: a plan
that sums an axis of extent 1 over the team first, a copy, then reduce-scatters).
"""
from __future__ import annotations

import numpy as np

import shardfuse as sf
from shardfuse.bench import report, runner
from shardfuse.bench.inputs import rel_err
from shardfuse.bench.runner import Variant
from shardfuse.dtypes import np_dtype

CHECK_ROWS = 256  # the rows of each result checked against float64


def suite(ctx, dtype):
    """The rows of one dtype (idle rounds only)."""
    args, mesh = ctx.args, ctx.mesh
    sets, partials = input_sets(args, mesh, dtype)
    variants = build(args, mesh, sets, partials)
    runner.idle_rounds(ctx.clock, variants, args.warmup, args.repeat, ctx.mpi, ctx.progress)
    x, w = sets[0][2], sets[0][3]
    rows_ = min(args.m, CHECK_ROWS)
    ref = x[:rows_].astype(np.float64) @ w.astype(np.float64)
    t_gemm, t_rs, t_flat = (float(np.median(v.gpu)) for v in variants[:3])
    rows = []
    for v in variants:
        r = report.row(v, dtype, 2.0 * args.m * args.n * args.k / mesh.size)
        ms = r["ms"]
        r["rel_err"] = rel_err(v.check(), ref) if v.check else None
        if v.check:
            r["overlap_eff"] = max(t_gemm, t_rs) / ms
            r["speedup_vs_unpipelined"] = t_flat / ms
        rows.append(r)
        ctx.log(f"  {v.name:<28} S={str(v.s):>3} {ms:9.3f} ms  host {r['host_us']:8.1f} us"
                + (f"  err {r['rel_err']:.2e}  overlap {r['overlap_eff']:.3f}  x{r['speedup_vs_unpipelined']:.3f} vs "
                   "unpipelined" if r["rel_err"] is not None else ""))
    return rows


def input_sets(args, mesh, dtype):
    """Two input sets, rotated; fresh random values, never zeros: (x placed, w placed, x, w)
    each; and for the ReduceScatter alone two partial sums [M, D, N], sharded on axis 1."""
    tp = mesh.axis_names[-1]
    rng = np.random.default_rng(args.seed + 7)
    dt = np_dtype(dtype)
    sets = []
    for _ in range(2):
        x = rng.standard_normal((args.m, args.k), dtype=np.float32).astype(dt)
        w = rng.standard_normal((args.k, args.n), dtype=np.float32).astype(dt)
        sets.append((sf.shard(x, axis=1, over=tp, mesh=mesh), sf.shard(w, axis=0, over=tp, mesh=mesh), x, w))
    partials = [sf.shard(rng.standard_normal((args.m, mesh.size, args.n), dtype=np.float32).astype(dt), axis=1,
                         over=tp, mesh=mesh) for _ in sets]
    return sets, partials


def row_parallel(mesh, chunks, streams):
    tp = mesh.axis_names[-1]

    def f(x, w):
        y = sf.shard(x, axis=1, over=tp) @ sf.shard(w, axis=0, over=tp)
        y = sf.shard(y, axis=0, over=tp)
        return sf.stream(y, axis=0, chunks=chunks) if chunks else y
    f.__name__ = f"gemm_rs_S{chunks}" if chunks else "gemm_then_rs"
    return sf.jit(f, mesh=mesh, streams=streams)


def build(args, mesh, sets, partials):
    """The local GEMM alone, the ReduceScatter alone, the unpipelined plan, then for every S
    the pipelined plan (the first three are the others' references, in that order)."""
    m, k, d = args.m, args.k, mesh.size
    tp, streams = mesh.axis_names[-1], max(args.streams)

    def variant(name, plan, args_of, s=None, kind="plan", flops=True, checked=False):
        st = {"r": 0}

        def fn():
            st["c"] = plan(*args_of(st["r"] % len(sets)))

        def before(r):
            st["r"] = r

        def check():  # the first rows of set 0's result
            st["r"] = 0
            fn()
            return st["c"].gather()[:min(m, CHECK_ROWS)]
        return Variant(name, fn, before, s, streams if s else None, check if checked else None, kind=kind,
                       flops=flops, state=st)

    # the local GEMM, [M, K/D] @ [K/D, N] on every device: device 0's blocks, replicated
    local = sf.jit(lambda x, w: x @ w, mesh=mesh)
    xl = [sf.replicate(np.ascontiguousarray(s[2][:, :k // d]), mesh=mesh) for s in sets]
    wl = [sf.replicate(s[3][:k // d], mesh=mesh) for s in sets]
    variants = [variant("gemm alone (local)", local.lower(xl[0].spec, wl[0].spec), lambda r: (xl[r], wl[r]),
                        kind="gemm")]
    partial = sf.jit(lambda c: sf.shard(sf.shard(c, axis=1, over=tp).sum(1), axis=0, over=tp), mesh=mesh)
    variants.append(variant("reduce-scatter alone", partial.lower(partials[0].spec), lambda r: (partials[r],), kind="rs",
                            flops=False))
    plans = {None: row_parallel(mesh, None, streams)}
    plans.update({s: row_parallel(mesh, s, streams) for s in args.chunks if m % (s * d) == 0})
    for s, f in plans.items():
        plan = f.lower(sets[0][0].spec, sets[0][1].spec)
        variants.append(variant("gemm then reduce-scatter" if s is None else "gemm+rs pipelined", plan,
                                lambda r: sets[r][:2], s=s or 1, kind="plan" if s is None else "pipelined",
                                checked=True))
    return variants
