"""`shardfuse bench`: time AllGather+GEMM plans against their parts and against bare library calls.

Inputs are placed only through the public API (`sf.shard`, `sf.replicate`, plain arguments).
For each dtype it times, on fresh random inputs (several input sets, rotated; never zeros),
after a warm-up, as the median of many runs:

* unpipelined: demo.seed_functions' ag_then_matmul (one Allgather, then one GEMM);
* pipelined: ag_matmul for every chunk count S and stream count (eager, and with --graph
  also as one CUDA graph replay), called on sf.Arrays placed once: the plan alone;
* user path: the same jitted function called as a user calls it, beside each pipelined row:
  the user's own arrays (torch CUDA tensors when torch imports, else CuPy arrays; NumPy on
  the numpy backend) passed through `sf.shard` (A) and as a plain argument (B) on every call,
  the result taken out as a device array (torch.from_dlpack, or to_local()); "/plan" is its
  time over the plan alone's;
* the GEMM alone (one plan-issued GEMM of the gathered shape) and the Allgather alone;
* on the cupy backend: the same S chunk GEMMs issued bare (cupy.matmul, and the backend's
  cuBLAS call without any plan), and one bare cupy.matmul.

A is the seed's global [S, D, M/(S*D), K], a view of one global [M, K] (so every S multiplies
the same numbers); every result is checked against a float64 product.

GPU time comes from CUDA events on the caller's stream (a non-blocking CuPy stream made
current for the whole run, and torch's current stream too): every call waits for it and makes
it wait for the outputs, so the events fence the call.  Host issue time is the wall time of the
call without synchronising, twice: in the timed rounds (one call on an idle GPU after other
variants ran, so host caches are cold) and "steady" (calls issued back to back, the median);
those back-to-back calls (--steady-rounds runs of --steady-calls, round robin over the
variants) also give "b2b ms", the median GPU time per call in a run of calls (throughput: host
work the GPU hides behind earlier calls does not count), and the user path's ratio to the plan
alone there, from the two called alternately back to back (an event between calls, so
both see the same clocks and power); likewise each pipelined row against one bare cuBLAS GEMM
(fenced with the caller's stream as a plan call is).  Overlap efficiency is max(T_allgather, T_gemm) /
T_pipelined.  Memory: per plan, device memory it added (the pool after its first calls, plus
anything cuBLAS or NCCL took) against inputs + outputs + one gathered A + cuBLAS workspaces,
and pool growth over --growth-calls calls.

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
from shardfuse.demo import default_devices, seed_functions
from shardfuse.trace import np_dtype

TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


def _ints(s):
    return [int(x) for x in s.split(",") if x]


# ---- clocks ----------------------------------------------------------------------------------
class HostClock:
    """NumPy backend: the host runs the steps, so wall time is both GPU and host time."""

    def __init__(self, backend):
        self.backend = backend

    def time(self, fn, before=None, stream=None):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self.backend.synchronize()
        dt = (time.perf_counter() - t0) * 1e3
        return dt, (t1 - t0) * 1e6

    def stamps(self, n):
        return [None] * n

    def stamp(self, stamps, k, stream=None):
        """Stamp k once everything issued so far has finished (the host runs the steps)."""
        self.backend.synchronize()
        stamps[k] = time.perf_counter()

    def between(self, a, b):
        return (b - a) * 1e3

    def memory(self):
        return None


class CudaClock:
    """CUDA events around each call on the caller's stream (CuPy's current stream), or on the
    stream a bare baseline issues on."""

    def __init__(self, backend):
        import cupy

        self.cupy, self.backend = cupy, backend
        self.e0 = cupy.cuda.Event()
        self.e1 = cupy.cuda.Event()

    def time(self, fn, before=None, stream=None):
        cp = self.cupy
        caller = cp.cuda.get_current_stream()
        stream = stream or caller
        if before is not None:
            before()
        self.backend.synchronize()  # an idle GPU: the plans' streams, the caller's, the variant's
        caller.synchronize()
        stream.synchronize()
        self.e0.record(stream)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self.e1.record(stream)
        self.e1.synchronize()
        self.backend.synchronize()
        return cp.cuda.get_elapsed_time(self.e0, self.e1), (t1 - t0) * 1e6

    def stamps(self, n):
        """n events, made before a timed run (no allocation between its calls)."""
        return [self.cupy.cuda.Event() for _ in range(n)]

    def stamp(self, stamps, k, stream=None):
        """Event k on the stream (default: the caller's), where the calls before it are fenced."""
        stamps[k].record(stream or self.cupy.cuda.get_current_stream())

    def between(self, a, b):
        b.synchronize()
        return self.cupy.cuda.get_elapsed_time(a, b)

    def memory(self):
        """(pool bytes held, device bytes in use)."""
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return self.cupy.get_default_memory_pool().total_bytes(), total - free


# ---- inputs --------------------------------------------------------------------------------
def _xp(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def _f64(x):
    """x as float64, NumPy or CuPy; bfloat16 (ml_dtypes, or its 16-bit pattern as CuPy holds it)
    through its bits, since CuPy has no bfloat16 arithmetic."""
    if x.dtype.itemsize == 2 and x.dtype.kind != "f":
        bits = x.view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


class Inputs:
    """Input sets, rotated over runs: global A [M, K] and B [K, N], the same on every process.

    `raw` holds them as the backend keeps values (NumPy; or CuPy, made on the device on the
    caller's stream, bfloat16 as its uint16 bits); `user` holds the same memory as a user would
    hand it over: NumPy arrays, torch CUDA tensors when torch imports, else CuPy arrays (bfloat16
    as an ml_dtypes.bfloat16 view).  Their sf.Arrays are placed from `user` through the public
    API on first use and reused (the plan alone)."""

    def __init__(self, mesh, m, k, n, dtype, sets, seed, torch=None):
        self.mesh, self.dtype, self.torch = mesh, dtype, torch
        self.gpu = mesh.backend.name == "cupy"
        self.m, self.k, self.n, self.d = m, k, n, mesh.size
        self.over = mesh.axis_names[-1]
        self.one_piece = len(mesh.local_devices) == 1  # a replicated result is then this process' one piece
        rng = np.random.default_rng(seed)  # global arrays: the same seed on every process
        self.raw = [(self._rand(rng, (m, k)), self._rand(rng, (k, n))) for _ in range(sets)]
        self.user = [(self._user(a), self._user(b)) for a, b in self.raw]
        self._placed = {}

    def _rand(self, rng, shape):
        if not self.gpu:
            return rng.standard_normal(shape).astype(np_dtype(self.dtype))
        import cupy

        cupy.random.seed(int(rng.integers(2**31)))
        r = cupy.random.standard_normal(shape, dtype=np.float32)
        if self.dtype == "bfloat16":
            return (r.view(np.uint32) >> 16).astype(np.uint16)
        return r.astype(self.dtype)

    def _user(self, x):
        if not self.gpu:
            return x
        bf16 = self.dtype == "bfloat16"
        if self.torch is None:
            return x.view(np_dtype("bfloat16")) if bf16 else x
        t = self.torch
        return t.from_dlpack(x.view(np.int16)).view(t.bfloat16) if bf16 else t.from_dlpack(x)

    def a_seed(self, r, chunks):
        """Set r's A as the user's [S, D, M/(S*D), K] (the seed's global shape; a view, rows in
        A's order)."""
        a = self.user[r % len(self.user)][0]
        return a.reshape(chunks, self.d, self.m // (chunks * self.d), self.k)

    def b(self, r):
        return self.user[r % len(self.user)][1]

    def _place(self, key, make):
        if key not in self._placed:
            self._placed[key] = make()
        return self._placed[key]

    def a_array(self, r, chunks):
        """Set r's seed A, sharded on axis 1 (placed on the first use, then reused)."""
        r %= len(self.user)
        return self._place(("a", r, chunks), lambda: sf.shard(self.a_seed(r, chunks), axis=1, over=self.over,
                                                              mesh=self.mesh))

    def b_array(self, r):
        r %= len(self.user)
        return self._place(("b", r), lambda: sf.replicate(self.b(r), mesh=self.mesh))

    def a_full(self, r):
        """Set r's whole A [M, K], replicated (the GEMM alone's operand)."""
        r %= len(self.user)
        return self._place(("A", r), lambda: sf.replicate(self.user[r][0], mesh=self.mesh))

    def reference(self):
        """float64 C = A @ B of set 0, [M, N] (on the GPU on the cupy backend)."""
        a, b = self.raw[0]
        return _xp(a).matmul(_f64(a), _f64(b))

    def out(self, c):
        """A replicated result taken out as a user takes it, as a device array and without a copy:
        torch.from_dlpack where this process holds it whole in one piece (else its first local
        piece: each is all of it), or to_local() / that piece as the backend's own array."""
        if self.torch is None:
            return c.to_local() if self.one_piece else _whole(c)
        t = self.torch
        if self.one_piece:
            return t.from_dlpack(c)
        piece = _whole(c)
        if piece.dtype == np.uint16:  # bfloat16 bits (CuPy has no bfloat16)
            return t.from_dlpack(piece.view(np.int16)).view(t.bfloat16)
        return t.from_dlpack(piece)

    def as_raw(self, x):
        """A user-side result as NumPy or CuPy, for the check."""
        if self.torch is None:
            return x
        import cupy

        return cupy.from_dlpack(x.view(self.torch.int16) if x.dtype == self.torch.bfloat16 else x)


def _nbytes(shape, dtype):
    return int(np.prod(shape)) * np_dtype(dtype).itemsize


def _plan_bytes(exe):
    """Bytes of the plan's persistent buffers (on local device 0)."""
    total = 0
    for t in exe.slot_templates:
        if t is not None:
            total += int(t[0].nbytes)
    return total


def _whole(c):
    """A replicated result's value as this process holds it (any local piece is all of it)."""
    return c.addressable_shards[0].data


def _rel_err(got, ref):
    """Relative Frobenius error of a result (any shape holding M*N values in A's row order)."""
    if got is None or ref is None:
        return None
    xp = _xp(ref)
    g = _f64(xp.asarray(got)).reshape(ref.shape)
    return float(xp.linalg.norm(g - ref) / xp.linalg.norm(ref))


# ---- the benchmark -----------------------------------------------------------------------------
class Variant:
    """One thing to time: fn() runs it; before(r) prepares run r (outside the timed region);
    check() runs it on input set 0 and returns the result (A's row order), or is None."""

    def __init__(self, name, fn, before=None, s=None, streams=None, check=None, kind="plan", flops=True):
        self.name, self.fn, self.before, self.s, self.streams = name, fn, before, s, streams
        self.check, self.kind, self.flops = check, kind, flops
        self.fenced_fn = None  # a bare baseline fenced with the caller's stream, as plan calls are
        self.stream = None  # the stream the clock's events go on (None: the caller's)
        self.plan_alone = None  # user path: the variant timing the same plan alone
        self.exe = self.state = None  # a plan's variant: its executable and call state
        self.gpu, self.host = [], []


def run_interleaved(clock, variants, warmup, repeat, mpi=None):
    """Round robin: every repetition runs each variant once, so slow drifts (clocks, power,
    temperature) hit all of them alike; medians per variant."""
    for rep in range(warmup + repeat):
        for v in variants:
            if mpi is not None:
                mpi.Barrier()
            g, h = clock.time(v.fn, (lambda v=v, rep=rep: v.before(rep)) if v.before else None, v.stream)
            if rep >= warmup:
                v.gpu.append(g)
                v.host.append(h)


def bench_dtype(args, mesh, dtype, log, torch_stream=None):
    be = mesh.backend
    gpu = be.name == "cupy"
    clock = CudaClock(be) if gpu else HostClock(be)
    mpi = None
    if mesh.nprocs > 1:
        from mpi4py import MPI

        mpi = MPI.COMM_WORLD
    M, K, N, D = args.m, args.k, args.n, mesh.size
    flops = 2.0 * M * N * K
    torch = None
    if torch_stream is not None:
        import torch
    inputs = Inputs(mesh, M, K, N, dtype, args.sets, args.seed, torch)
    ref = inputs.reference()
    variants = []
    a_bytes = _nbytes((M // D, K), dtype)
    ga_bytes = _nbytes((M, K), dtype)

    def plan_variant(name, plan, chunks, s=None, streams=None, a_fn=None, kind="plan"):
        """A plan called on input set r's sf.Arrays."""
        st = {"r": 0}
        a_fn = a_fn or (lambda r: inputs.a_array(r, chunks))

        def fn():
            st["c"] = plan(a_fn(st["r"]), inputs.b_array(st["r"]))

        def before(r):
            st["r"] = r

        def check():
            st["r"] = 0
            fn()
            return _whole(st["c"])
        v = Variant(name, fn, before, s, streams, check, kind=kind)
        v.exe, v.state = plan.executable, st
        return v

    def user_variant(name, f, alone):
        """The jitted function f called as a user calls it, on the user's arrays of set r (with
        torch: on torch's current stream, passed as stream=)."""
        st = {"r": 0}
        s = alone.s
        kw = {} if torch_stream is None else {"stream": torch_stream}

        def fn():
            r = st["r"]
            c = f(sf.shard(inputs.a_seed(r, s), axis=1, over=inputs.over, mesh=mesh), inputs.b(r), **kw)
            st["c"] = inputs.out(c)

        def before(r):
            st["r"] = r

        def check():
            st["r"] = 0
            fn()
            return inputs.as_raw(st["c"])
        v = Variant(name, fn, before, s, alone.streams, check, kind="user")
        v.exe, v.state, v.plan_alone = alone.exe, st, alone
        return v

    # the Allgather alone
    @sf.jit(mesh=mesh)
    def allgather(a):
        return sf.replicate(sf.shard(a, axis=1, over=inputs.over))

    ag_plan = allgather.lower(inputs.a_array(0, 1).spec)
    v_ag = Variant("allgather alone", lambda: ag_plan(inputs.a_array(0, 1)), kind="allgather", flops=False)
    variants.append(v_ag)

    # the GEMM alone (plan-issued): the whole A [M, K], replicated, times B on every device
    @sf.jit(mesh=mesh)
    def gemm(a, b):
        return a @ b

    g_plan = gemm.lower(inputs.a_full(0).spec, inputs.b_array(0).spec)
    v_gemm = plan_variant("gemm alone (plan)", g_plan, 1, a_fn=inputs.a_full, kind="gemm")
    variants.append(v_gemm)

    # unpipelined: Allgather, then one GEMM
    _, unpipelined = seed_functions(mesh, max(args.streams))
    u_plan = unpipelined.lower(inputs.a_array(0, 1).spec, inputs.b_array(0).spec)
    variants.append(plan_variant("unpipelined", u_plan, 1, s=1))

    # bare library calls (cupy, one device): one cupy.matmul, and the S chunk GEMMs
    if gpu and D == 1:
        variants += bare_variants(args, be, inputs, log)

    # pipelined, for every S and stream count; eager, and graph replay; each with its user path
    for nstreams in args.streams:
        pipelined, _ = seed_functions(mesh, nstreams)
        graphed = sf.jit(mesh=mesh, streams=nstreams, graph=True)(pipelined.fn) if args.graph and gpu else None
        for s in args.chunks:
            if M % (s * D):
                log(f"  skip S={s}: M={M} not divisible by S*D={s * D}")
                continue
            spec = (inputs.a_array(0, s).spec, inputs.b_array(0).spec)
            v = plan_variant("pipelined (eager)", pipelined.lower(*spec), s, s=s, streams=nstreams, kind="pipelined")
            variants += [v, user_variant("user path (eager)", pipelined, v)]
            if graphed is not None:
                try:  # binding captures the graph
                    vg = plan_variant("pipelined (graph)", graphed.lower(*spec), s, s=s, streams=nstreams,
                                      kind="pipelined_graph")
                except NotImplementedError as e:
                    log(f"  skip graph S={s}: {e}")
                    continue
                variants += [vg, user_variant("user path (graph)", graphed, vg)]

    log(f"  timing {len(variants)} variants, interleaved: {args.warmup} warm-up + {args.repeat} rounds")
    run_interleaved(clock, variants, args.warmup, args.repeat, mpi)

    # steady state: calls back to back, no synchronisation between them; the median host issue
    # time, and the GPU time per call over each run of calls (throughput: host work that the GPU
    # hides behind earlier calls does not count, unlike in the one-call-on-an-idle-GPU rounds).
    # --steady-rounds runs of --steady-calls calls, the variants in round robin as above, so that
    # clock and power drift under sustained load hit all variants alike; medians over the runs.
    hosts = {id(v): [] for v in variants}
    per_call = {id(v): [] for v in variants}
    ends = clock.stamps(2)
    for _ in range(args.steady_rounds if args.steady_calls else 0):
        for v in variants:
            if mpi is not None:
                mpi.Barrier()
            be.synchronize()
            clock.stamp(ends, 0, v.stream)
            for r in range(args.steady_calls):
                if v.before:
                    v.before(r)
                t0 = time.perf_counter()
                v.fn()
                hosts[id(v)].append((time.perf_counter() - t0) * 1e6)
            clock.stamp(ends, 1, v.stream)
            per_call[id(v)].append(clock.between(*ends) / args.steady_calls)
            be.synchronize()
    steady = {k: float(np.median(h)) if h else None for k, h in hosts.items()}
    steady_ms = {k: float(np.median(t)) if t else None for k, t in per_call.items()}

    # the user path against the plan alone, back to back and alternating (plan, user, plan, ...)
    # with an event on the caller's stream between calls: each call's GPU time beside its
    # pair's under the same clocks and power, so the ratio of medians is free of drift
    # (and each pipelined row against one bare cuBLAS GEMM, fenced with the caller's stream as
    # the plans are)
    alternating, against_bare = {}, {}
    pairs = args.steady_calls * args.steady_rounds
    bare_one = next((v for v in variants if v.kind == "bare_cublas" and v.s == 1), None)
    for v in variants:
        if v.plan_alone is not None and pairs:
            alternating[id(v)] = alternate(clock, be, v.plan_alone, v, pairs, mpi)
        if bare_one is not None and v.kind.startswith("pipelined") and pairs:
            against_bare[id(v)] = alternate(clock, be, bare_one, v, pairs, mpi)

    # results
    med = {id(v): float(np.median(v.gpu)) for v in variants}
    t_ag, t_gemm = med[id(v_ag)], med[id(v_gemm)]
    bare = {(v.kind, v.s): med[id(v)] for v in variants if v.kind.startswith("bare")}
    rows = []
    for v in variants:
        ms, host = med[id(v)], float(np.median(v.host))
        err = _rel_err(v.check(), ref) if v.check else None
        r = {"name": v.name, "dtype": dtype, "S": v.s, "streams": v.streams, "ms": ms,
             "ms_min": float(np.min(v.gpu)), "ms_max": float(np.max(v.gpu)),
             "tflops": flops / (ms * 1e-3) / 1e12 if v.flops else None, "host_us": host, "host_frac": host * 1e-3 / ms,
             "host_us_steady": steady[id(v)], "ms_steady": steady_ms[id(v)], "rel_err": err}
        if steady[id(v)] is not None:
            r["host_frac_steady"] = steady[id(v)] * 1e-3 / ms
        if v.kind == "allgather":
            r["gb_s"] = (ga_bytes + a_bytes) / (ms * 1e-3) / 1e9  # bytes written + read
        if v.kind.startswith("pipelined") or v.kind == "user":
            r["overlap_eff"] = max(t_ag, t_gemm) / ms
            for key in ("bare_cupy", "bare_cublas"):
                if (key, v.s) in bare:
                    r[f"vs_{key}_chunks"] = ms / bare[(key, v.s)]
                if (key, 1) in bare:
                    r[f"vs_{key}_one"] = ms / bare[(key, 1)]
        if v.plan_alone is not None:
            r["vs_plan_alone"] = ms / med[id(v.plan_alone)]
            if id(v) in alternating:
                r["vs_plan_alone_steady"] = alternating[id(v)]
        if id(v) in against_bare:
            r["vs_bare_cublas_one_steady"] = against_bare[id(v)]
        graph = v.exe.graph if v.exe is not None else None
        if graph is not None:
            r["graph_captures"] = graph.captures  # the plan's (shared with its user path), all calls so far
        if v.kind == "plan" and v.name == "unpipelined":
            for key in ("bare_cupy", "bare_cublas"):
                if (key, 1) in bare:
                    r[f"vs_{key}_one"] = ms / bare[(key, 1)]
        rows.append(r)
        log(f"  {v.name:<28} S={str(v.s):>3} streams={str(v.streams):>4} {ms:9.3f} ms  host {host:8.1f} us"
            + (f"  err {err:.2e}" if err is not None else "")
            + (f"  x{r['vs_plan_alone']:.3f} vs plan alone" if "vs_plan_alone" in r else ""))

    # memory: growth over many calls (every plan and user path), and each plan's footprint
    mem = []
    for v in variants:
        if v.kind in ("pipelined", "pipelined_graph", "plan", "user"):
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


def alternate(clock, be, first, second, pairs, mpi=None):
    """second's median GPU time per call over first's, the two called alternately back to back
    (no synchronisation) with a stamp on the caller's stream after each call.  Calls are fenced
    with that stream, so the time between two stamps is the call between them; the host is
    ahead of the GPU, so host work is hidden as in a user's loop."""
    stamps = clock.stamps(2 * pairs + 1)
    if mpi is not None:
        mpi.Barrier()
    be.synchronize()
    clock.stamp(stamps, 0)
    calls = [v.fenced_fn or v.fn for v in (first, second)]
    for r in range(pairs):
        for j, v in enumerate((first, second)):
            if v.before:
                v.before(r)
            calls[j]()
            clock.stamp(stamps, 2 * r + j + 1)
    times = [clock.between(a, b) for a, b in zip(stamps, stamps[1:])]
    be.synchronize()
    return float(np.median(times[1::2]) / np.median(times[0::2]))


def bare_variants(args, be, inputs, log):
    """One device, cupy backend: one cupy.matmul, and the S chunk GEMMs as cupy.matmul calls on
    the caller's stream and as the backend's own cuBLAS call (bind_matmul, no plan around it: a
    baseline, so it reaches into the backend) on the backend's main stream."""
    import cupy

    from shardfuse.backends.protocol import Ref

    M, K, N, dtype = args.m, args.k, args.n, inputs.dtype
    sets = inputs.raw
    c0 = cupy.empty((M, N), sets[0][0].dtype)
    # bfloat16 is held as uint16: CuPy's matmul reads it through an ml_dtypes.bfloat16 view
    as_cp = (lambda x: x.view(np_dtype("bfloat16"))) if dtype == "bfloat16" else (lambda x: x)
    out = []
    try:
        cupy.matmul(as_cp(sets[0][0][:8]), as_cp(sets[0][1]), out=as_cp(c0[:8]))
        cupy_ok = True
    except Exception as e:  # an old CuPy without bfloat16 matmul: say so, time the rest
        log(f"  (bare cupy.matmul skipped: {type(e).__name__}: {e})")
        cupy_ok = False
    for s in sorted(set(args.chunks)):
        rows_s = M // s
        st = {"r": 0}
        if cupy_ok:
            def chunks_cupy(s=s, rows_s=rows_s, st=st):
                a, b = (as_cp(x) for x in sets[st["r"] % len(sets)])
                c = as_cp(c0)
                for i in range(s):
                    cupy.matmul(a[i * rows_s:(i + 1) * rows_s], b, out=c[i * rows_s:(i + 1) * rows_s])
            out.append(Variant("bare cupy.matmul chunks" if s > 1 else "bare cupy.matmul (one)", chunks_cupy,
                               lambda r, st=st: st.update(r=r), s=s, kind="bare_cupy"))
        steps = []  # the backend's own cuBLAS call, no plan: S GEMMs on its main stream
        for i in range(s):
            ra = Ref(0, (i * rows_s * K,), (rows_s, K), (K, 1), dtype)
            rb = Ref(1, (0,), (K, N), (N, 1), dtype)
            rc = Ref(2, (i * rows_s * N,), (rows_s, N), (N, 1), dtype)
            steps.append(be.bind_matmul(ra, rb, rc, "main"))

        def chunks_cublas(steps=steps, st=st):
            a, b = sets[st["r"] % len(sets)]
            bufs = [[a], [b], [c0]]
            for step in steps:
                step(bufs)
        v = Variant("bare cuBLAS chunks" if s > 1 else "bare cuBLAS (one)", chunks_cublas,
                    lambda r, st=st: st.update(r=r), s=s, kind="bare_cublas")
        v.stream = be.stream(0)

        def fenced(run=chunks_cublas):
            # as a plan call is: main waits for the caller's stream, which waits for main after
            caller = cupy.cuda.get_current_stream().ptr
            be.fence_in(caller)
            run()
            be.fence_out(caller)
        v.fenced_fn = fenced
        out.append(v)
    return out


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

    def variant(name, plan, args_of, s=None, kind="plan", flops=True):
        st = {"r": 0}
        v = Variant(name, lambda: st.__setitem__("c", plan(*args_of(st["r"] % len(sets)))),
                    lambda r: st.__setitem__("r", r), s, max(args.streams) if s else None, kind=kind, flops=flops)
        v.state = st
        return v

    variants = []
    # the local GEMM, [M, K/D] @ [K/D, N] on every device: device 0's blocks, replicated
    local = sf.jit(lambda x, w: x @ w, mesh=mesh)
    xl = [sf.replicate(np.ascontiguousarray(s[2][:, :K // D]), mesh=mesh) for s in sets]
    wl = [sf.replicate(s[3][:K // D], mesh=mesh) for s in sets]
    g_plan = local.lower(xl[0].spec, wl[0].spec)
    variants.append(variant("gemm alone (local)", g_plan, lambda r: (xl[r], wl[r]), kind="gemm"))
    partial = sf.jit(lambda c: sf.shard(sf.shard(c, axis=1, over=tp).sum(1), axis=0, over=tp), mesh=mesh)
    cl = [sf.shard(rng.standard_normal((M, D, N), dtype=np.float32).astype(dt), axis=1, over=tp, mesh=mesh)
          for _ in sets]
    rs_plan = partial.lower(cl[0].spec)
    variants.append(variant("reduce-scatter alone", rs_plan, lambda r: (cl[r],), kind="rs", flops=False))
    plans = {None: row_parallel(None)}
    plans.update({s: row_parallel(s) for s in args.chunks if M % (s * D) == 0})
    for s, f in plans.items():
        plan = f.lower(sets[0][0].spec, sets[0][1].spec)
        variants.append(variant("gemm then reduce-scatter" if s is None else "gemm+rs pipelined", plan,
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
        v.before(r)
        v.fn()
    be.synchronize()
    m1 = clock.memory()
    if m0 is None:
        return None
    return {"growth_calls": args.growth_calls, "pool_growth_bytes": m1[0] - m0[0], "device_growth_bytes": m1[1] - m0[1]}


def footprint(args, mesh, dtype, inputs, s, nstreams):
    """Peak device bytes of a fresh pipelined plan over 3 calls (the caller drops each output
    before the next call), against inputs + outputs + one gathered A per local device (virtual
    devices on one GPU add up) + its cuBLAS workspaces (one per GPU and stream).  Live bytes come from a CuPy memory
    hook (pool mallocs minus frees); library allocations outside CuPy's pool show in the device
    delta."""
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
    placed = [(inputs.a_array(r, s), inputs.b_array(r)) for r in range(3)]  # inputs exist before the hook
    be.synchronize()
    ws0, h0 = be.workspace_bytes, len(be._handles)
    free0, total = cupy.cuda.runtime.memGetInfo()
    hook = Live()
    with hook:
        exe = pipelined.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable
        for a, b in placed:
            c = exe(a, b)
            be.synchronize()
            del c
    free1, _ = cupy.cuda.runtime.memGetInfo()
    M, K, N = args.m, args.k, args.n
    D, L = mesh.size, len(mesh.local_devices)
    in_b = L * (_nbytes((M // D, K), dtype) + _nbytes((K, N), dtype))
    out_b = L * _nbytes((M, N), dtype)
    ga = L * _nbytes((M, K), dtype)
    gpus = len({sh.data.device.id for sh in placed[0][0].addressable_shards})  # virtual devices share a GPU's
    per_handle = be.workspace_bytes // max(1, len(be._handles))
    ws_used = gpus * per_handle * min(1 + nstreams, 1 + s)  # per GPU: main + the worker streams this plan uses
    rec = {"name": "footprint (eager)", "dtype": dtype, "S": s, "streams": nstreams,
           "plan_peak_live_bytes": hook.peak, "plan_persistent_bytes": _plan_bytes(exe),
           "new_workspace_bytes": be.workspace_bytes - ws0, "device_delta_bytes": free0 - free1,
           "inputs_bytes": in_b, "outputs_bytes": out_b, "gathered_a_bytes": ga,
           "cublas_workspace_bytes": ws_used, "bound_bytes": in_b + out_b + ga + ws_used}
    rec["peak_bytes"] = in_b + hook.peak + ws_used
    rec["within_bound"] = rec["peak_bytes"] <= rec["bound_bytes"]
    del exe, h0
    return rec


def caller_streams(mesh):
    """The caller's stream for the whole run: on the cupy backend a non-blocking CuPy stream
    (a context that makes it current) and, when torch imports, the same stream as torch's
    current stream (returned: the user path passes it as stream=); elsewhere nothing."""
    import contextlib

    if mesh.backend.name != "cupy":
        return contextlib.nullcontext(), None
    import cupy

    caller = cupy.cuda.Stream(non_blocking=True)
    try:
        import torch
    except ImportError:
        return caller, None
    dev = torch.device("cuda", cupy.cuda.Device().id)
    torch.cuda.set_device(dev)
    ts = torch.cuda.ExternalStream(caller.ptr, device=dev)
    torch.cuda.set_stream(ts)
    return caller, ts


def environment(mesh):
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "numpy": np.__version__, "backend": mesh.backend.name,
           "mesh": repr(mesh), "nprocs": mesh.nprocs, "host": platform.node()}
    if mesh.backend.name == "cupy":
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(cupy.cuda.Device().id)
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
            f"{'overlap':>7} {'/cupy S':>7} {'/cuBLAS S':>9} {'/cupy 1':>7} {'/cuBLAS 1':>9} {'/plan':>6} {'b2b ms':>7} "
            f"{'/cuBLAS 1':>9} {'/plan':>6} "
            f"{'rel err':>8}")
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['name']:<27} {r['dtype']:<8} {f(r['S'], '%d'):>3} {f(r['streams'], '%d'):>3} "
                   f"{r['ms']:8.3f} {f(r['tflops'], '%.0f'):>7} {r['host_us']:8.1f} {100 * r['host_frac']:5.1f}% "
                   f"{f(r.get('host_us_steady'), '%.1f'):>7} {f(100 * r['host_frac_steady'] if r.get('host_frac_steady') else None, '%.1f'):>5} "
                   f"{f(r.get('overlap_eff'), '%.3f'):>7} {f(r.get('vs_bare_cupy_chunks'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_chunks'), '%.3f'):>9} {f(r.get('vs_bare_cupy_one'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_one'), '%.3f'):>9} "
                   f"{f(r.get('vs_plan_alone'), '%.3f'):>6} {f(r.get('ms_steady'), '%.3f'):>7} "
                   f"{f(r.get('vs_bare_cublas_one_steady'), '%.3f'):>9} "
                   f"{f(r.get('vs_plan_alone_steady'), '%.3f'):>6} {f(r.get('rel_err'), '%.1e'):>8}")
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
                   help="calls issued back to back (no synchronisation) per run, for the steady-state host "
                        "issue time and the back-to-back GPU time per call")
    p.add_argument("--steady-rounds", type=int, default=5,
                   help="runs of --steady-calls per variant, round robin over the variants (medians)")
    p.add_argument("--graph", action="store_true", help="also time graph replay (cupy backend)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--pattern", choices=["ag", "rs", "both"], default="ag",
                   help="ag: AllGather+GEMM (the seed); rs: GEMM+ReduceScatter (the row-parallel linear)")
    args = p.parse_args(argv)

    d = args.devices or default_devices(args.backend)
    mesh = sf.DeviceMesh(d, backend=args.backend)
    if args.seed is None:
        args.seed = int(time.time_ns() % 2**31)
    if mesh.nprocs > 1:  # the inputs are global arrays: the same on every process
        from mpi4py import MPI

        args.seed = MPI.COMM_WORLD.bcast(args.seed)
    lead = mesh.rank == 0
    quiet = args.json or not lead

    def log(msg):
        if not quiet:
            print(msg, flush=True)

    env = environment(mesh)
    caller, torch_stream = caller_streams(mesh)
    env["user_arrays"] = "numpy" if mesh.backend.name != "cupy" else "torch" if torch_stream is not None else "cupy"
    log(f"shardfuse bench: {mesh}, M={args.m} K={args.k} N={args.n}, S={args.chunks}, streams={args.streams}")
    log(f"  {env}")
    rows, mem = [], []
    with caller:
        for dtype in args.dtype.split(","):
            if args.pattern in ("ag", "both"):
                log(f"-- {dtype}: AllGather+GEMM")
                r, m = bench_dtype(args, mesh, dtype, log, torch_stream)
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
