"""`shardfuse bench`: time AllGather+GEMM plans against their parts and against bare library calls.

For each dtype it times, on fresh random inputs (several input sets, rotated; never zeros),
after a warm-up, as the median of many runs:

* unpipelined: demo.seed_functions' ag_then_matmul (one Allgather, then one GEMM);
* pipelined: ag_matmul for every chunk count S and stream count (eager, and with --graph
  also as one CUDA graph replay);
* the GEMM alone (one plan-issued GEMM of the gathered shape) and the Allgather alone;
* on the cupy backend: the same S chunk GEMMs issued bare (cupy.matmul, and the backend's
  cuBLAS call without any plan), and one bare cupy.matmul.

GPU time comes from CUDA events on the plan's main stream (which fences every call); host
issue time is the wall time of the call without synchronising, twice: in the timed rounds (one
call on an idle GPU after other variants ran, so host caches are cold) and "steady" (calls
issued back to back, --steady-calls of them, the median).  Overlap efficiency is
max(T_allgather, T_gemm) / T_pipelined.  Memory: per plan, device memory it added (the pool
after its first calls, plus anything cuBLAS or NCCL took) against inputs + outputs + one
gathered A + cuBLAS workspaces, and pool growth over --growth-calls calls.

On the numpy backend it runs too (slowly, small sizes): host clocks stand in for events.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import numpy as np

import shardfuse as sf
from shardfuse.array import Array
from shardfuse.demo import default_devices, seed_functions
from shardfuse.layout import Layout
from shardfuse.trace import np_dtype

TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


def _ints(s):
    return [int(x) for x in s.split(",") if x]


# ---- clocks ----------------------------------------------------------------------------------
class HostClock:
    """NumPy backend: the host runs the steps, so wall time is both GPU and host time."""

    def __init__(self, backend):
        self.backend = backend

    def time(self, fn, before=None):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self.backend.synchronize()
        dt = (time.perf_counter() - t0) * 1e3
        return dt, (t1 - t0) * 1e6

    def memory(self):
        return None


class CudaClock:
    """CUDA events on the backend's main stream (device 0), around each call."""

    def __init__(self, backend):
        import cupy

        self.cupy, self.backend = cupy, backend
        self.stream = backend.stream(0)
        self.e0 = cupy.cuda.Event()
        self.e1 = cupy.cuda.Event()

    def time(self, fn, before=None):
        cp = self.cupy
        if before is not None:
            before()
        self.backend.synchronize()
        self.e0.record(self.stream)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self.e1.record(self.stream)
        self.e1.synchronize()
        self.backend.synchronize()
        return cp.cuda.get_elapsed_time(self.e0, self.e1), (t1 - t0) * 1e6

    def memory(self):
        """(pool bytes held, device bytes in use)."""
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return self.cupy.get_default_memory_pool().total_bytes(), total - free


# ---- inputs --------------------------------------------------------------------------------
class Inputs:
    """Input sets of local pieces, rotated over runs: A local rows [M/D, K], B [K, N]."""

    def __init__(self, mesh, m, k, n, dtype, sets, seed):
        self.mesh, self.be = mesh, mesh.backend
        self.dtype = dtype
        self.gpu = self.be.name == "cupy"
        d = mesh.size
        self.m, self.k, self.n, self.d = m, k, n, d
        L = len(mesh.local_devices)
        self.sets = []
        rng = np.random.default_rng(seed + 1000 * mesh.rank)
        for s in range(sets):
            a = [self._rand(rng, (m // d, k)) for _ in range(L)]
            b = [self._rand(rng, (k, n), shared=seed + s) for _ in range(L)]  # replicated: same on all
            self.sets.append((a, b))

    def _rand(self, rng, shape, shared=None):
        if shared is not None:
            rng = np.random.default_rng(shared)
        if not self.gpu:
            return rng.standard_normal(shape).astype(np_dtype(self.dtype))
        import cupy

        # values from the host generator when small, else on the device (on the plan's main stream)
        with self.be.stream(0):
            cupy.random.seed(int(rng.integers(2**31)))
            r = cupy.random.standard_normal(shape, dtype=np.float32)
            if self.dtype == "bfloat16":
                return (r.view(np.uint32) >> 16).astype(np.uint16)
            return r.astype(np_dtype(self.dtype))

    def a_array(self, r, chunks):
        """Set r's A as the seed's global [S, D, M/(S*D), K], sharded on axis 1."""
        m, k, d = self.m, self.k, self.d
        shards = [x.reshape(chunks, 1, m // (chunks * d), k) for x in self.sets[r % len(self.sets)][0]]
        lay = Layout.replicated(4).with_axis(1, self.mesh.axis_names[-1])
        return Array(self.mesh, (chunks, d, m // (chunks * d), k), self.dtype, lay, shards)

    def b_array(self, r):
        return Array(self.mesh, (self.k, self.n), self.dtype, Layout.replicated(2), self.sets[r % len(self.sets)][1])

    def a_full(self, r):
        """Set r's gathered A [M, K] (single device: the local piece itself)."""
        return Array(self.mesh, (self.m, self.k), self.dtype, Layout.replicated(2), self.sets[r % len(self.sets)][0]) \
            if self.d == 1 else None


def _nbytes(shape, dtype):
    return int(np.prod(shape)) * np_dtype(dtype).itemsize


def _plan_bytes(exe):
    """Bytes of the plan's persistent buffers (on local device 0)."""
    total = 0
    for t in exe.slot_templates:
        if t is not None:
            total += int(t[0].nbytes)
    return total


def _reference(inputs, r):
    """float64 C = A_gathered @ B on the host, or None when the global A is not local."""
    if inputs.d != 1:
        return None
    a, b = inputs.sets[r % len(inputs.sets)]
    if inputs.gpu:
        import cupy

        with inputs.be.stream(0):
            af, bf = _f64(a[0], inputs.dtype), _f64(b[0], inputs.dtype)
            return cupy.matmul(af, bf)
    return a[0].astype(np.float64) @ b[0].astype(np.float64)


def _f64(x, dtype):
    import cupy

    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _rel_err(inputs, got_shards, ref):
    if ref is None:
        return None
    g = got_shards[0]
    if inputs.gpu:
        import cupy

        with inputs.be.stream(0):
            g = _f64(cupy.ascontiguousarray(g).reshape(ref.shape), inputs.dtype)
            return float(cupy.linalg.norm(g - ref) / cupy.linalg.norm(ref))
    g = np.asarray(g, dtype=np.float64).reshape(ref.shape)
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


# ---- the benchmark -----------------------------------------------------------------------------
class Variant:
    """One thing to time: fn() runs it; before(r) prepares run r (outside the timed region)."""

    def __init__(self, name, fn, before=None, s=None, streams=None, check=None, kind="plan", flops=True):
        self.name, self.fn, self.before, self.s, self.streams = name, fn, before, s, streams
        self.check, self.kind, self.flops = check, kind, flops
        self.gpu, self.host = [], []


def run_interleaved(clock, variants, warmup, repeat, mpi=None):
    """Round robin: every repetition runs each variant once, so slow drifts (clocks, power,
    temperature) hit all of them alike; medians per variant."""
    for rep in range(warmup + repeat):
        for v in variants:
            if mpi is not None:
                mpi.Barrier()
            g, h = clock.time(v.fn, (lambda v=v, rep=rep: v.before(rep)) if v.before else None)
            if rep >= warmup:
                v.gpu.append(g)
                v.host.append(h)


def bench_dtype(args, mesh, dtype, log):
    be = mesh.backend
    gpu = be.name == "cupy"
    clock = CudaClock(be) if gpu else HostClock(be)
    mpi = None
    if mesh.nprocs > 1:
        from mpi4py import MPI

        mpi = MPI.COMM_WORLD
    M, K, N, D = args.m, args.k, args.n, mesh.size
    flops = 2.0 * M * N * K
    inputs = Inputs(mesh, M, K, N, dtype, args.sets, args.seed)
    ref = _reference(inputs, 0)
    variants, keep = [], []
    a_bytes, b_bytes = _nbytes((M // D, K), dtype), _nbytes((K, N), dtype)
    ga_bytes = _nbytes((M, K), dtype)

    def plan_variant(name, exe, chunks, s=None, streams=None, a_fn=None):
        """A plan called on input set r; check() runs it on set 0 and returns the result's shards."""
        st = {"r": 0}
        a_fn = a_fn or (lambda r: inputs.a_array(r, chunks))

        def fn():
            st["c"] = exe(a_fn(st["r"]), inputs.b_array(st["r"]))

        def before(r):
            st["r"] = r

        def check():
            st["r"] = 0
            fn()
            return st["c"].shards
        v = Variant(name, fn, before, s, streams, check)
        v.exe, v.state = exe, st
        return v

    # the Allgather alone
    @sf.jit(mesh=mesh)
    def allgather(a):
        return sf.replicate(sf.shard(a, axis=1, over=mesh.axis_names[-1]))

    ag_exe = allgather.lower(inputs.a_array(0, 1).spec).executable
    v_ag = Variant("allgather alone", lambda: ag_exe(inputs.a_array(0, 1)), kind="allgather", flops=False)
    variants.append(v_ag)

    # the GEMM alone (plan-issued, gathered shape); single device: A's local piece is the gathered A
    @sf.jit(mesh=mesh)
    def gemm(a, b):
        return a @ b

    if D == 1:
        g_exe = gemm.lower(inputs.a_full(0).spec, inputs.b_array(0).spec).executable
        v_gemm = plan_variant("gemm alone (plan)", g_exe, 1, a_fn=inputs.a_full)
    else:  # a local GEMM of the gathered shape on replicated inputs
        rng = np.random.default_rng(args.seed)
        ga = rng.standard_normal((M, K)).astype(np_dtype(dtype))
        arr = sf.Array(mesh, (M, K), dtype, Layout.replicated(2), be.to_device([ga] * len(mesh.local_devices)))
        g_exe = gemm.lower(arr.spec, inputs.b_array(0).spec).executable
        v_gemm = plan_variant("gemm alone (plan)", g_exe, 1, a_fn=lambda r: arr)
        v_gemm.check = None
    v_gemm.kind = "gemm"
    variants.append(v_gemm)

    # unpipelined: Allgather, then one GEMM
    _, unpipelined = seed_functions(mesh, max(args.streams))
    u_exe = unpipelined.lower(inputs.a_array(0, 1).spec, inputs.b_array(0).spec).executable
    variants.append(plan_variant("unpipelined", u_exe, 1, s=1))

    # bare library calls (cupy, one device): one cupy.matmul, and the S chunk GEMMs
    why = None
    if gpu and D == 1:
        import cupy

        from shardfuse.executor import Ref

        c0 = cupy.empty((M, N), inputs.sets[0][0][0].dtype)
        keep.append(c0)
        main = be.stream(0)
        sets = inputs.sets
        # bfloat16 is stored as uint16: CuPy sees it through an ml_dtypes.bfloat16 view
        as_cp = (lambda x: x.view(np_dtype("bfloat16"))) if dtype == "bfloat16" else (lambda x: x)
        try:
            with main:
                cupy.matmul(as_cp(sets[0][0][0][:8]), as_cp(sets[0][1][0]), out=as_cp(c0[:8]))
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        for s in sorted(set(args.chunks)):
            rows_s = M // s
            st = {"r": 0}
            if why is None:
                def chunks_cupy(s=s, rows_s=rows_s, st=st):
                    a, b = as_cp(sets[st["r"] % len(sets)][0][0]), as_cp(sets[st["r"] % len(sets)][1][0])
                    c = as_cp(c0)
                    with main:
                        for i in range(s):
                            cupy.matmul(a[i * rows_s:(i + 1) * rows_s], b, out=c[i * rows_s:(i + 1) * rows_s])
                variants.append(Variant("bare cupy.matmul chunks" if s > 1 else "bare cupy.matmul (one)",
                                        chunks_cupy, lambda r, st=st: st.update(r=r), s=s, kind="bare_cupy"))
            steps = []  # the backend's own cuBLAS call, no plan: S GEMMs on main
            for i in range(s):
                ra = Ref(0, (i * rows_s * K,), (rows_s, K), (K, 1), dtype)
                rb = Ref(1, (0,), (K, N), (N, 1), dtype)
                rc = Ref(2, (i * rows_s * N,), (rows_s, N), (N, 1), dtype)
                steps.append(be.bind_matmul(ra, rb, rc, "main"))

            def chunks_cublas(steps=steps, st=st):
                a, b = sets[st["r"] % len(sets)]
                bufs = [a, b, [c0]]
                for step in steps:
                    step(bufs)
            variants.append(Variant("bare cuBLAS chunks" if s > 1 else "bare cuBLAS (one)", chunks_cublas,
                                    lambda r, st=st: st.update(r=r), s=s, kind="bare_cublas"))

    # pipelined, for every S and stream count; eager, and graph replay
    graphs = []
    for nstreams in args.streams:
        pipelined, _ = seed_functions(mesh, nstreams)
        for s in args.chunks:
            if M % (s * D):
                log(f"  skip S={s}: M={M} not divisible by S*D={s * D}")
                continue
            exe = pipelined.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable
            v = plan_variant("pipelined (eager)", exe, s, s=s, streams=nstreams)
            v.kind = "pipelined"
            variants.append(v)
            if args.graph and gpu and len(mesh.local_devices) == 1:
                gjit = sf.jit(mesh=mesh, streams=nstreams, graph=True)(pipelined.fn)
                gexe = gjit.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable
                static = gexe.graph.inputs  # the plan's own input buffers: fill them, call on them
                a_st = Array(mesh, inputs.a_array(0, s).shape, dtype, inputs.a_array(0, s).sharding, [static[0][0]])
                b_st = Array(mesh, (K, N), dtype, Layout.replicated(2), [static[1][0]])
                st = {}

                def fill(r, static=static):
                    a, b = inputs.sets[r % len(inputs.sets)]
                    with be.stream(0):
                        static[0][0][...] = a[0].reshape(static[0][0].shape)
                        static[1][0][...] = b[0]

                def g_call(gexe=gexe, a_st=a_st, b_st=b_st, st=st):
                    st["c"] = gexe(a_st, b_st)

                def g_check(fill=fill, g_call=g_call, st=st):
                    fill(0)
                    g_call()
                    return st["c"].shards
                vg = Variant("pipelined (graph)", g_call, fill, s, nstreams, g_check, kind="pipelined_graph")
                vg.exe, vg.state = gexe, st
                variants.append(vg)
                vc = plan_variant("pipelined (graph, copy-in)", gexe, s, s=s, streams=nstreams)
                vc.kind, vc.check = "pipelined_graph_copy", None
                variants.append(vc)
                graphs.append(vg)

    log(f"  timing {len(variants)} variants, interleaved: {args.warmup} warm-up + {args.repeat} rounds")
    run_interleaved(clock, variants, args.warmup, args.repeat, mpi)

    # steady-state host issue time: calls back to back, no synchronisation between them
    steady = {}
    for v in variants:
        be.synchronize()
        hs = []
        for r in range(args.steady_calls):
            if v.before:
                v.before(r)
            t0 = time.perf_counter()
            v.fn()
            hs.append((time.perf_counter() - t0) * 1e6)
        be.synchronize()
        steady[id(v)] = float(np.median(hs)) if hs else None

    # results
    med = {id(v): float(np.median(v.gpu)) for v in variants}
    t_ag, t_gemm = med[id(v_ag)], med[id(v_gemm)]
    bare = {(v.kind, v.s): med[id(v)] for v in variants if v.kind.startswith("bare")}
    rows = []
    for v in variants:
        ms, host = med[id(v)], float(np.median(v.host))
        err = _rel_err(inputs, v.check(), ref) if v.check else None
        r = {"name": v.name, "dtype": dtype, "S": v.s, "streams": v.streams, "ms": ms,
             "ms_min": float(np.min(v.gpu)), "ms_max": float(np.max(v.gpu)),
             "tflops": flops / (ms * 1e-3) / 1e12 if v.flops else None, "host_us": host, "host_frac": host * 1e-3 / ms,
             "host_us_steady": steady[id(v)], "rel_err": err}
        if steady[id(v)] is not None:
            r["host_frac_steady"] = steady[id(v)] * 1e-3 / ms
        if v.kind == "allgather":
            r["gb_s"] = (ga_bytes + a_bytes) / (ms * 1e-3) / 1e9  # bytes written + read
        if v.kind.startswith("pipelined"):
            r["overlap_eff"] = max(t_ag, t_gemm) / ms
            for key in ("bare_cupy", "bare_cublas"):
                if (key, v.s) in bare:
                    r[f"vs_{key}_chunks"] = ms / bare[(key, v.s)]
                if (key, 1) in bare:
                    r[f"vs_{key}_one"] = ms / bare[(key, 1)]
        if v.kind == "plan" and v.name == "unpipelined":
            for key in ("bare_cupy", "bare_cublas"):
                if (key, 1) in bare:
                    r[f"vs_{key}_one"] = ms / bare[(key, 1)]
        rows.append(r)
        log(f"  {v.name:<28} S={str(v.s):>3} streams={str(v.streams):>4} {ms:9.3f} ms  host {host:8.1f} us"
            + (f"  err {err:.2e}" if err is not None else ""))
    if why:
        log(f"  (bare cupy.matmul skipped: {why})")

    # memory: growth over many calls (every pipelined plan), and each plan's footprint
    mem = []
    for v in variants:
        if v.kind in ("pipelined", "pipelined_graph", "plan") and v.check is not None:
            rec = growth(args, be, clock, v)
            if rec:
                rec.update(name=v.name, dtype=dtype, S=v.s, streams=v.streams)
                mem.append(rec)
    for v in variants:
        v.state = None
        v.exe = None
    variants.clear()
    if gpu:
        be.synchronize()
        for s in args.chunks:
            if M % (s * D) == 0:
                mem.append(footprint(args, mesh, dtype, inputs, s, max(args.streams)))
    return rows, mem


def bench_gemm_rs(args, mesh, dtype, log):
    """The row-parallel linear: x [M, K] column-sharded, w [K, N] row-sharded, the output
    reduce-scattered on rows.  Times the pipelined GEMM+ReduceScatter for each S (each chunk's
    partial sums reduce-scattered on its stream while the next chunk multiplies), the
    unpipelined plan (one GEMM, then one ReduceScatter), the local GEMM alone and the
    ReduceScatter alone (of a partial [M, N]: a plan that sums an axis of extent 1 over the team
    first, a copy, then reduce-scatters)."""
    be = mesh.backend
    clock = CudaClock(be) if be.name == "cupy" else HostClock(be)
    M, K, N, D = args.m, args.k, args.n, mesh.size
    tp = mesh.axis_names[-1]
    rng = np.random.default_rng(args.seed + 7)
    dt = np_dtype(dtype)
    sets = []
    for _ in range(2):  # two input sets, rotated; fresh random values, never zeros
        x = rng.standard_normal((M, K), dtype=np.float32).astype(dt)
        w = rng.standard_normal((K, N), dtype=np.float32).astype(dt)
        sets.append((sf.shard(x, axis=1, over=tp, mesh=mesh), sf.shard(w, axis=0, over=tp, mesh=mesh), x, w))

    def row_parallel(chunks):
        def f(x, w):
            y = sf.shard(x, axis=1, over=tp) @ sf.shard(w, axis=0, over=tp)
            y = sf.shard(y, axis=0, over=tp)
            return sf.stream(y, axis=0, chunks=chunks) if chunks else y
        f.__name__ = f"gemm_rs_S{chunks}" if chunks else "gemm_then_rs"
        return sf.jit(f, mesh=mesh, streams=max(args.streams))

    def variant(name, exe, args_of, s=None, kind="plan", flops=True):
        st = {"r": 0}
        v = Variant(name, lambda: st.__setitem__("c", exe(*args_of(st["r"] % len(sets)))),
                    lambda r: st.__setitem__("r", r), s, max(args.streams) if s else None, kind=kind, flops=flops)
        v.state = st
        return v

    variants = []
    local = sf.jit(lambda x, w: x @ w, mesh=mesh)  # the local GEMM: [M, K/D] @ [K/D, N] on every device
    xl = [sf.Array(mesh, (M, K // D), dtype, Layout.replicated(2), s[0].shards) for s in sets]
    wl = [sf.Array(mesh, (K // D, N), dtype, Layout.replicated(2), s[1].shards) for s in sets]
    g_exe = local.lower(xl[0].spec, wl[0].spec).executable
    variants.append(variant("gemm alone (local)", g_exe, lambda r: (xl[r], wl[r]), kind="gemm"))
    partial = sf.jit(lambda c: sf.shard(sf.shard(c, axis=1, over=tp).sum(1), axis=0, over=tp), mesh=mesh)
    cl = [sf.Array(mesh, (M, D, N), dtype, Layout((None, tp, None)),
                   be.to_device([rng.standard_normal((M, 1, N), dtype=np.float32).astype(dt)
                                 for _ in mesh.local_devices])) for _ in sets]
    rs_exe = partial.lower(cl[0].spec).executable
    variants.append(variant("reduce-scatter alone", rs_exe, lambda r: (cl[r],), kind="rs", flops=False))
    plans = {None: row_parallel(None)}
    plans.update({s: row_parallel(s) for s in args.chunks if M % (s * D) == 0})
    for s, f in plans.items():
        exe = f.lower(sets[0][0].spec, sets[0][1].spec).executable
        variants.append(variant("gemm then reduce-scatter" if s is None else "gemm+rs pipelined", exe,
                                lambda r: sets[r][:2], s=s or 1, kind="plan" if s is None else "pipelined"))
    run_interleaved(clock, variants, args.warmup, args.repeat)
    med = {id(v): float(np.median(v.gpu)) for v in variants}
    t_gemm, t_rs = med[id(variants[0])], med[id(variants[1])]
    t_flat = med[id(variants[2])]
    rows = []
    for v in variants:
        ms = med[id(v)]
        r = {"name": v.name, "dtype": dtype, "S": v.s, "streams": v.streams, "ms": ms,
             "ms_min": float(np.min(v.gpu)), "ms_max": float(np.max(v.gpu)), "host_us": float(np.median(v.host)),
             "host_frac": float(np.median(v.host)) * 1e-3 / ms,
             "tflops": 2.0 * M * N * K / D / (ms * 1e-3) / 1e12 if v.flops else None, "rel_err": None}
        if v.kind in ("plan", "pipelined"):  # check the first rows of the result against float64
            v.state["r"] = 0
            v.fn()
            x, w = sets[0][2], sets[0][3]
            rows_ = min(M, 256)
            got = np.asarray(v.state["c"].gather()[:rows_], np.float64)
            ref = x[:rows_].astype(np.float64) @ w.astype(np.float64)
            r["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            r["overlap_eff"] = max(t_gemm, t_rs) / ms
            r["speedup_vs_unpipelined"] = t_flat / ms
        rows.append(r)
        log(f"  {v.name:<28} S={str(v.s):>3} {ms:9.3f} ms  host {r['host_us']:8.1f} us"
            + (f"  err {r['rel_err']:.2e}  overlap {r['overlap_eff']:.3f}  x{r['speedup_vs_unpipelined']:.3f} vs "
               "unpipelined" if r["rel_err"] is not None else ""))
    return rows


def growth(args, be, clock, v):
    """Pool and device memory growth over args.growth_calls calls (fresh inputs each call)."""
    for r in range(min(3, args.growth_calls)):
        v.before and v.before(r)
        v.fn()
    be.synchronize()
    m0 = clock.memory()
    for r in range(args.growth_calls):
        if v.kind == "pipelined_graph":
            v.fn()  # the plan's own inputs (refilling them each call would time the fill)
        else:
            v.before(r)
            v.fn()
    be.synchronize()
    m1 = clock.memory()
    if m0 is None:
        return None
    return {"growth_calls": args.growth_calls, "pool_growth_bytes": m1[0] - m0[0], "device_growth_bytes": m1[1] - m0[1]}


def footprint(args, mesh, dtype, inputs, s, nstreams):
    """Peak device bytes of a fresh pipelined plan over 3 calls (the caller drops each output
    before the next call), against inputs + outputs + one gathered A + its cuBLAS workspaces.
    Live bytes come from a CuPy memory hook (pool mallocs minus frees); library allocations
    outside CuPy's pool show in the device delta."""
    import cupy

    be = mesh.backend

    class Live(cupy.cuda.MemoryHook):
        name = "shardfuse_live"

        def __init__(self):
            self.live = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.live += kw["mem_size"]
            self.peak = max(self.peak, self.live)

        def free_postprocess(self, **kw):
            self.live -= kw["mem_size"]

    pipelined, _ = seed_functions(mesh, nstreams)
    be.synchronize()
    ws0, h0 = be.workspace_bytes, len(be._handles)
    free0, total = cupy.cuda.runtime.memGetInfo()
    hook = Live()
    with hook:
        exe = pipelined.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable
        for r in range(3):
            c = exe(inputs.a_array(r, s), inputs.b_array(r))
            be.synchronize()
            del c
    free1, _ = cupy.cuda.runtime.memGetInfo()
    M, K, N = args.m, args.k, args.n
    D = mesh.size
    in_b = _nbytes((M // D, K), dtype) + _nbytes((K, N), dtype)
    out_b = _nbytes((M, N), dtype)
    ga = _nbytes((M, K), dtype)
    per_handle = be.workspace_bytes // max(1, len(be._handles))
    ws_used = per_handle * min(1 + nstreams, 1 + s)  # main + the worker streams this plan uses
    rec = {"name": "footprint (eager)", "dtype": dtype, "S": s, "streams": nstreams,
           "plan_peak_live_bytes": hook.peak, "plan_persistent_bytes": _plan_bytes(exe),
           "new_workspace_bytes": be.workspace_bytes - ws0, "device_delta_bytes": free0 - free1,
           "inputs_bytes": in_b, "outputs_bytes": out_b, "gathered_a_bytes": ga,
           "cublas_workspace_bytes": ws_used, "bound_bytes": in_b + out_b + ga + ws_used}
    rec["peak_bytes"] = in_b + hook.peak + ws_used
    rec["within_bound"] = rec["peak_bytes"] <= rec["bound_bytes"]
    del exe, h0
    return rec


def environment(mesh):
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "numpy": np.__version__, "backend": mesh.backend.name,
           "mesh": repr(mesh), "nprocs": mesh.nprocs, "host": platform.node()}
    if mesh.backend.name == "cupy":
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(mesh.backend.ordinals[0])
        env.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                   cupy=cupy.__version__, cuda_runtime=rt.runtimeGetVersion(), driver=rt.driverGetVersion())
        try:
            from cupy.cuda import nccl

            env["nccl"] = nccl.get_version()
        except Exception:
            pass
        try:
            from cupy_backends.cuda.libs import cublas

            env["cublas"] = cublas.getVersion(cupy.cuda.device.get_cublas_handle())
        except Exception:
            pass
    return env


def table(rows):
    def f(x, fmt):
        return fmt % x if x is not None else ""

    head = (f"{'plan':<27} {'dtype':<8} {'S':>3} {'str':>3} {'ms':>8} {'TFLOP/s':>7} {'host us':>8} {'host%':>6} {'steady':>7} {'st%':>5} "
            f"{'overlap':>7} {'/cupy S':>7} {'/cuBLAS S':>9} {'/cupy 1':>7} {'rel err':>8}")
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['name']:<27} {r['dtype']:<8} {f(r['S'], '%d'):>3} {f(r['streams'], '%d'):>3} "
                   f"{r['ms']:8.3f} {f(r['tflops'], '%.0f'):>7} {r['host_us']:8.1f} {100 * r['host_frac']:5.1f}% "
                   f"{f(r.get('host_us_steady'), '%.1f'):>7} {f(100 * r['host_frac_steady'] if r.get('host_frac_steady') else None, '%.1f'):>5} "
                   f"{f(r.get('overlap_eff'), '%.3f'):>7} {f(r.get('vs_bare_cupy_chunks'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_chunks'), '%.3f'):>9} {f(r.get('vs_bare_cupy_one'), '%.3f'):>7} "
                   f"{f(r.get('rel_err'), '%.1e'):>8}")
    return "\n".join(out)


def memory_table(mem):
    out = []
    for m in mem:
        if "pool_growth_bytes" in m:
            out.append(f"growth  {m['name']:<27} {m['dtype']:<8} S={m['S']} over {m['growth_calls']} calls: "
                       f"pool {m['pool_growth_bytes']} B, device {m['device_growth_bytes']} B")
        else:
            mib = 1 << 20
            out.append(f"peak    {m['name']:<27} {m['dtype']:<8} S={m['S']}: {m['peak_bytes'] / mib:.0f} MiB "
                       f"(inputs {m['inputs_bytes'] / mib:.0f} + plan live peak {m['plan_peak_live_bytes'] / mib:.0f}"
                       f" + cuBLAS workspaces {m['cublas_workspace_bytes'] / mib:.0f}) vs bound "
                       f"{m['bound_bytes'] / mib:.0f} MiB -> {'within' if m['within_bound'] else 'OVER'}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="shardfuse bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["numpy", "cupy"], default=None)
    p.add_argument("--devices", type=int, default=None, help="D (default: all GPUs, else 4 CPU devices)")
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--dtype", default="float16", help="comma-separated: float16,bfloat16,float32,float64")
    p.add_argument("--chunks", type=_ints, default=[1, 2, 4, 8, 16], help="S values, comma-separated")
    p.add_argument("--streams", type=_ints, default=[4], help="stream counts, comma-separated")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--sets", type=int, default=3, help="input sets rotated over runs")
    p.add_argument("--growth-calls", type=int, default=1000, help="calls for the memory-growth check")
    p.add_argument("--steady-calls", type=int, default=20,
                   help="calls issued back to back (no synchronisation) for the steady-state host issue time")
    p.add_argument("--graph", action="store_true", help="also time graph replay (cupy backend)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--pattern", choices=["ag", "rs", "both"], default="ag",
                   help="ag: AllGather+GEMM (the seed); rs: GEMM+ReduceScatter (the row-parallel linear)")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = int(time.time_ns() % 2**31)

    d = args.devices or default_devices(args.backend)
    mesh = sf.DeviceMesh(d, backend=args.backend)
    lead = mesh.rank == 0
    quiet = args.json or not lead

    def log(msg):
        if not quiet:
            print(msg, flush=True)

    env = environment(mesh)
    log(f"shardfuse bench: {mesh}, M={args.m} K={args.k} N={args.n}, S={args.chunks}, streams={args.streams}")
    log(f"  {env}")
    rows, mem = [], []
    for dtype in args.dtype.split(","):
        if args.pattern in ("ag", "both"):
            log(f"-- {dtype}: AllGather+GEMM")
            r, m = bench_dtype(args, mesh, dtype, log)
            rows += r
            mem += m
        if args.pattern in ("rs", "both"):
            log(f"-- {dtype}: GEMM+ReduceScatter")
            rows += bench_gemm_rs(args, mesh, dtype, log)
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"env": env, "args": {k: v for k, v in vars(args).items()}, "rows": rows, "memory": mem}))
    else:
        print()
        print(table(rows))
        print(memory_table(mem))
    bad = [r for r in rows if r.get("rel_err") is not None and not r["rel_err"] <= TOLERANCE[r["dtype"]]]
    if bad:
        print(f"shardfuse bench: {len(bad)} result(s) over tolerance", file=sys.stderr)
        return 1
    return 0
