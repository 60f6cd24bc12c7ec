"""The AllGather+GEMM suite (the seed): its variants, their timing, then a row per variant.

Variants: the Allgather alone, the GEMM alone (a plan-issued GEMM of the gathered shape), the
unpipelined plan, on CUDA with one device the bare library calls, and for every stream count
and S the pipelined plan (eager, and with --graph as a graph replay) beside its user path.
"""
from __future__ import annotations

import numpy as np

import shardfuse as sf
from shardfuse.bench import report, runner
from shardfuse.bench.baselines import bare_variants
from shardfuse.bench.inputs import Inputs, nbytes, rel_err, whole
from shardfuse.bench.memory import footprint, growth
from shardfuse.bench.runner import Variant
from shardfuse.demo import seed_functions
from shardfuse.ops import Op
from shardfuse.runtime import backend_of


def suite(ctx, dtype):
    """(rows, memory records) of one dtype."""
    args = ctx.args
    torch = None
    if ctx.torch_stream is not None:
        import torch
    inputs = Inputs(ctx.mesh, args.m, args.k, args.n, dtype, args.sets, args.seed, torch, ctx.cuda)
    ref = inputs.reference()
    variants = build(ctx, inputs)
    rows = measure(ctx, dtype, variants, ref)
    return rows, memory(ctx, dtype, inputs, variants)


def plan_variant(inputs, name, plan, chunks, s=None, streams=None, a_fn=None, kind="plan"):
    """A plan called on input set r's sf.Arrays (placed once: the plan alone)."""
    st = {"r": 0}
    a_fn = a_fn or (lambda r: inputs.a_array(r, chunks))

    def fn():
        st["c"] = plan(a_fn(st["r"]), inputs.b_array(st["r"]))

    def before(r):
        st["r"] = r

    def check():
        st["r"] = 0
        fn()
        return whole(st["c"])
    return Variant(name, fn, before, s, streams, check, kind=kind, exe=plan.executable, state=st)


def user_variant(ctx, inputs, name, f, alone):
    """The jitted function f called as a user calls it, on the user's arrays of set r (with
    torch: on torch's current stream, passed as stream=), the result taken out as a device array."""
    st = {"r": 0}
    s = alone.s
    kw = {} if ctx.torch_stream is None else {"stream": ctx.torch_stream}

    def fn():
        r = st["r"]
        c = f(sf.shard(inputs.a_seed(r, s), axis=1, over=inputs.over, mesh=ctx.mesh), inputs.b(r), **kw)
        st["c"] = inputs.out(c)

    def before(r):
        st["r"] = r

    def check():
        st["r"] = 0
        fn()
        return inputs.as_raw(st["c"])
    return Variant(name, fn, before, s, alone.streams, check, kind="user", exe=alone.exe, state=st, plan_alone=alone)


def build(ctx, inputs):
    """Every variant, in the order of the table: the Allgather alone, the GEMM alone, the
    unpipelined plan, the bare calls, then the pipelined plans."""
    mesh, args = ctx.mesh, ctx.args

    @sf.jit(mesh=mesh)
    def allgather(a):
        return sf.replicate(sf.shard(a, axis=1, over=inputs.over))

    ag_plan = allgather.lower(inputs.a_array(0, 1).spec)
    variants = [Variant("allgather alone", lambda: ag_plan(inputs.a_array(0, 1)), kind=Op.ALLGATHER, flops=False)]

    @sf.jit(mesh=mesh)
    def gemm(a, b):  # the whole A [M, K], replicated, times B on every device
        return a @ b

    g_plan = gemm.lower(inputs.a_full(0).spec, inputs.b_array(0).spec)
    variants.append(plan_variant(inputs, "gemm alone (plan)", g_plan, 1, a_fn=inputs.a_full, kind="gemm"))
    _, unpipelined = seed_functions(mesh, max(args.streams))  # Allgather, then one GEMM
    u_plan = unpipelined.lower(inputs.a_array(0, 1).spec, inputs.b_array(0).spec)
    variants.append(plan_variant(inputs, "unpipelined", u_plan, 1, s=1))
    if ctx.cuda and mesh.size == 1:
        variants += bare_variants(args, backend_of(mesh), inputs, ctx.log)
    for nstreams in args.streams:
        variants += pipelined_variants(ctx, inputs, nstreams)
    return variants


def pipelined_variants(ctx, inputs, nstreams):
    """For every S: the pipelined plan and its user path; eager, and with --graph graph replay."""
    mesh, args = ctx.mesh, ctx.args
    pipelined, _ = seed_functions(mesh, nstreams)
    graphed = sf.jit(mesh=mesh, streams=nstreams, graph=True)(pipelined.fn) if args.graph and ctx.cuda else None
    out = []
    for s in args.chunks:
        if args.m % (s * mesh.size):
            ctx.log(f"  skip S={s}: M={args.m} not divisible by S*D={s * mesh.size}")
            continue
        spec = (inputs.a_array(0, s).spec, inputs.b_array(0).spec)
        v = plan_variant(inputs, "pipelined (eager)", pipelined.lower(*spec), s, s=s, streams=nstreams,
                         kind="pipelined")
        out += [v, user_variant(ctx, inputs, "user path (eager)", pipelined, v)]
        if graphed is not None:
            try:  # binding captures the graph
                vg = plan_variant(inputs, "pipelined (graph)", graphed.lower(*spec), s, s=s, streams=nstreams,
                                  kind="pipelined_graph")
            except NotImplementedError as e:
                ctx.log(f"  skip graph S={s}: {e}")
                continue
            out += [vg, user_variant(ctx, inputs, "user path (graph)", graphed, vg)]
    return out


def measure(ctx, dtype, variants, ref):
    """Time every variant, then its row (the ratios keep no variant alive past this)."""
    ratios = time_all(ctx, variants)
    return [row(ctx, dtype, v, variants, ref, ratios) for v in variants]


def time_all(ctx, variants):
    """Idle rounds, back-to-back runs, then alternating pairs: each user path against its plan
    alone and each pipelined plan against one bare cuBLAS GEMM.  Returns those pairs' ratios,
    {variant: ratio} each."""
    args, clock, mpi = ctx.args, ctx.clock, ctx.mpi
    ctx.log(f"  timing {len(variants)} variants, interleaved: {args.warmup} warm-up + {args.repeat} rounds")
    runner.idle_rounds(clock, variants, args.warmup, args.repeat, mpi, ctx.progress)
    runner.back_to_back(clock, variants, args.steady_calls, args.steady_rounds, mpi, ctx.progress)
    pairs = args.steady_calls * args.steady_rounds
    bare_one = next((v for v in variants if v.kind == "bare_cublas" and v.s == 1), None)
    vs_alone, vs_bare = {}, {}
    for v in variants if pairs else ():
        if v.plan_alone is not None:
            vs_alone[v] = runner.alternating(clock, v.plan_alone, v, pairs, mpi)
        if bare_one is not None and v.kind.startswith("pipelined"):
            vs_bare[v] = runner.alternating(clock, bare_one, v, pairs, mpi)
    return vs_alone, vs_bare


def _median(xs):
    return float(np.median(xs)) if xs else None


def row(ctx, dtype, v, variants, ref, ratios):
    """v's row: the common columns, back to back, the check, and its ratios to the other rows."""
    args, vs_alone, vs_bare = ctx.args, *ratios
    r = report.row(v, dtype, 2.0 * args.m * args.n * args.k)
    ms = r["ms"]
    steady = _median(v.host_b2b)
    r.update(host_us_steady=steady, ms_steady=_median(v.gpu_b2b), rel_err=rel_err(v.check(), ref) if v.check else None)
    if steady is not None:
        r["host_frac_steady"] = steady * 1e-3 / ms
    t = {w.kind: _median(w.gpu) for w in variants if w.kind in (Op.ALLGATHER, "gemm")}
    bare = {(w.kind, w.s): _median(w.gpu) for w in variants if w.kind.startswith("bare")}
    if v.kind == Op.ALLGATHER:  # bytes written + read
        r["gb_s"] = (nbytes((args.m, args.k), dtype) + nbytes((args.m // ctx.mesh.size, args.k), dtype)) / (ms * 1e-3) / 1e9
    if v.kind.startswith("pipelined") or v.kind == "user":
        r["overlap_eff"] = max(t[Op.ALLGATHER], t["gemm"]) / ms
        for key in ("bare_cupy", "bare_cublas"):
            if (key, v.s) in bare:
                r[f"vs_{key}_chunks"] = ms / bare[(key, v.s)]
            if (key, 1) in bare:
                r[f"vs_{key}_one"] = ms / bare[(key, 1)]
    if v.plan_alone is not None:
        r["vs_plan_alone"] = ms / _median(v.plan_alone.gpu)
        if v in vs_alone:
            r["vs_plan_alone_steady"] = vs_alone[v]
    if v in vs_bare:
        r["vs_bare_cublas_one_steady"] = vs_bare[v]
    graph = v.exe.graph if v.exe is not None else None
    if graph is not None:
        r["graph_captures"] = graph.captures  # the plan's (shared with its user path), all calls so far
    if v.kind == "plan" and v.name == "unpipelined":
        for key in ("bare_cupy", "bare_cublas"):
            if (key, 1) in bare:
                r[f"vs_{key}_one"] = ms / bare[(key, 1)]
    err = r["rel_err"]
    ctx.log(f"  {v.name:<28} S={str(v.s):>3} streams={str(v.streams):>4} {ms:9.3f} ms  host {r['host_us']:8.1f} us"
            + (f"  err {err:.2e}" if err is not None else "")
            + (f"  x{r['vs_plan_alone']:.3f} vs plan alone" if "vs_plan_alone" in r else ""))
    return r


def memory(ctx, dtype, inputs, variants):
    """Growth over --growth-calls calls of every plan and user path; on CUDA then each S's
    footprint, with the variants (and their last outputs) dropped first."""
    args, mesh = ctx.args, ctx.mesh
    mem = []
    for v in variants:
        if v.kind in ("pipelined", "pipelined_graph", "plan", "user"):
            rec = growth(ctx.clock, v, args.growth_calls)
            if rec:
                rec.update(name=v.name, dtype=dtype, S=v.s, streams=v.streams)
                mem.append(rec)
    for v in variants:
        v.state = None
        v.exe = None
    variants.clear()
    if ctx.cuda:
        backend_of(mesh).synchronize()
        for s in args.chunks:
            if args.m % (s * mesh.size) == 0:
                mem.append(footprint(args, mesh, dtype, inputs, s, max(args.streams)))
    return mem
