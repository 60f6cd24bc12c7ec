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
issue time is the wall time of the call without synchronising.  Overlap efficiency is
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


def measure(clock, fn, warmup, repeat, before=None, mpi=None):
    """Median GPU ms and median host issue us of fn() over `repeat` runs after `warmup`."""
    for r in range(warmup):
        clock.time(fn, (lambda r=r: before(r)) if before else None)
    gpu, host = [], []
    for r in range(repeat):
        if mpi is not None:
            mpi.Barrier()
        g, h = clock.time(fn, (lambda r=r: before(r)) if before else None)
        gpu.append(g)
        host.append(h)
    return float(np.median(gpu)), float(np.median(host)), float(np.min(gpu)), float(np.max(gpu))


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
    rows, mem = [], []
    W, R = args.warmup, args.repeat

    def row(name, ms, host_us, s=None, streams=None, err=None, extra=None, spread=None):
        r = {"name": name, "dtype": dtype, "S": s, "streams": streams, "ms": ms,
             "tflops": flops / (ms * 1e-3) / 1e12 if ms else None, "host_us": host_us,
             "host_frac": (host_us * 1e-3 / ms) if ms else None, "rel_err": err}
        if spread:
            r["ms_min"], r["ms_max"] = spread
        if extra:
            r.update(extra)
        rows.append(r)
        log(f"  {name:<28} S={str(s):>3} streams={str(streams):>2}  {ms:9.3f} ms  {r['tflops'] or 0:8.1f} TFLOP/s  "
            f"host {host_us:8.1f} us" + (f"  err {err:.2e}" if err is not None else ""))
        return r

    def mem_check(name, call, exe, per_call_bytes, input_bytes, gathered_bytes, graph=False):
        """Pool growth over many calls and the plan's footprint against its bound."""
        if not gpu:
            for r in range(args.growth_calls):
                call(r)
            return
        be.synchronize()
        pool0, dev0 = clock.memory()
        for r in range(args.growth_calls):
            call(r)
        be.synchronize()
        pool1, dev1 = clock.memory()
        ws = be.workspace_bytes
        bound = input_bytes + per_call_bytes + gathered_bytes + ws
        rec = {"name": name, "dtype": dtype, "graph": graph, "plan_persistent_bytes": _plan_bytes(exe),
               "per_call_bytes": per_call_bytes, "input_bytes": input_bytes, "gathered_a_bytes": gathered_bytes,
               "cublas_workspace_bytes": ws, "bound_bytes": bound,
               "growth_calls": args.growth_calls, "pool_growth_bytes": pool1 - pool0, "device_growth_bytes": dev1 - dev0}
        mem.append(rec)
        return rec

    a_bytes = _nbytes((M // D, K), dtype)
    b_bytes = _nbytes((K, N), dtype)
    c_bytes = _nbytes((M, N), dtype)
    ga_bytes = _nbytes((M, K), dtype)
    in_bytes = a_bytes + b_bytes

    # the Allgather alone
    @sf.jit(mesh=mesh)
    def allgather(a):
        return sf.replicate(sf.shard(a, axis=1, over=mesh.axis_names[-1]))

    ag_exe = allgather.lower(inputs.a_array(0, 1).spec).executable
    t_ag, h_ag, *sp = measure(clock, lambda: ag_exe(inputs.a_array(0, 1)), W, R, mpi=mpi)
    row("allgather alone", t_ag, h_ag, spread=sp)
    del ag_exe

    # the GEMM alone (plan-issued, gathered shape) -- single device: A's local piece is the gathered A
    @sf.jit(mesh=mesh)
    def gemm(a, b):
        return a @ b

    t_gemm = None
    if D == 1:
        g_exe = gemm.lower(inputs.a_full(0).spec, inputs.b_array(0).spec).executable
        state = {}

        def g_call():
            state["c"] = g_exe(inputs.a_full(state["r"]), inputs.b_array(state["r"]))

        t_gemm, h, *sp = measure(clock, g_call, W, R, before=lambda r: state.update(r=r), mpi=mpi)
        state["r"] = 0
        g_call()
        row("gemm alone (plan)", t_gemm, h, err=_rel_err(inputs, state["c"].shards, ref), spread=sp)
        state.clear()
        del g_exe
    else:  # local GEMM of the gathered shape on replicated inputs
        rng = np.random.default_rng(args.seed)
        ga = rng.standard_normal((M, K)).astype(np_dtype(dtype))
        arr = sf.Array(mesh, (M, K), dtype, Layout.replicated(2), be.to_device([ga] * len(mesh.local_devices)))
        g_exe = gemm.lower(arr.spec, inputs.b_array(0).spec).executable
        t_gemm, h, *sp = measure(clock, lambda: g_exe(arr, inputs.b_array(0)), W, R, mpi=mpi)
        row("gemm alone (plan)", t_gemm, h, spread=sp)
        del g_exe, arr

    # unpipelined: Allgather, then one GEMM
    state = {}
    _, unpipelined = seed_functions(mesh, max(args.streams))
    u_exe = unpipelined.lower(inputs.a_array(0, 1).spec, inputs.b_array(0).spec).executable

    def u_call():
        state["c"] = u_exe(inputs.a_array(state["r"], 1), inputs.b_array(state["r"]))

    t_u, h_u, *sp = measure(clock, u_call, W, R, before=lambda r: state.update(r=r), mpi=mpi)
    state["r"] = 0
    u_call()
    row("unpipelined", t_u, h_u, s=1, err=_rel_err(inputs, state["c"].shards, ref), spread=sp)
    state.clear()
    del u_exe

    # bare library calls (cupy only): one cupy.matmul, and S chunk GEMMs
    bare = {}
    if gpu and D == 1:
        import cupy

        from shardfuse.executor import Ref

        a0, b0 = inputs.sets[0][0][0], inputs.sets[0][1][0]
        c0 = cupy.empty((M, N), a0.dtype)
        main = be.stream(0)
        sets = inputs.sets

        def cupy_ok():
            try:
                with main:
                    cupy.matmul(a0[:8], b0, out=c0[:8])
                return None
            except Exception as e:  # bfloat16: CuPy has no such dtype (stored as uint16)
                return f"{type(e).__name__}: {e}"

        why = cupy_ok() if dtype != "bfloat16" else "CuPy has no bfloat16 matmul (stored as uint16)"
        for s in sorted(set(args.chunks)):
            rows_s = M // s
            if why is None:
                def chunks_cupy(s=s, rows_s=rows_s):
                    a, b = sets[state["r"] % len(sets)][0][0], sets[state["r"] % len(sets)][1][0]
                    with main:
                        for i in range(s):
                            cupy.matmul(a[i * rows_s:(i + 1) * rows_s], b, out=c0[i * rows_s:(i + 1) * rows_s])
                t, h, *sp = measure(clock, chunks_cupy, W, R, before=lambda r: state.update(r=r))
                bare[("cupy", s)] = t
                row("bare cupy.matmul chunks" if s > 1 else "bare cupy.matmul (one)", t, h, s=s, spread=sp)
            # the backend's own cuBLAS call, no plan: S GEMMs on main
            steps = []
            for i in range(s):
                ra = Ref(0, (i * rows_s * K,), (rows_s, K), (K, 1), dtype)
                rb = Ref(1, (0,), (K, N), (N, 1), dtype)
                rc = Ref(2, (i * rows_s * N,), (rows_s, N), (N, 1), dtype)
                steps.append(be.bind_matmul(ra, rb, rc, "main"))

            def chunks_cublas(steps=steps):
                a, b = sets[state["r"] % len(sets)]
                bufs = [a, b, [c0]]
                for st in steps:
                    st(bufs)
            t, h, *sp = measure(clock, chunks_cublas, W, R, before=lambda r: state.update(r=r))
            bare[("cublas", s)] = t
            row("bare cuBLAS chunks" if s > 1 else "bare cuBLAS (one)", t, h, s=s, spread=sp)
        if why is not None:
            log(f"  (bare cupy.matmul skipped: {why})")
        del c0

    # pipelined, for every S and stream count; eager then graph
    base = (t_gemm or 0)
    for nstreams in args.streams:
        pipelined, _ = seed_functions(mesh, nstreams)
        for s in args.chunks:
            if M % (s * D):
                log(f"  skip S={s}: M={M} not divisible by S*D={s * D}")
                continue
            if gpu:
                be.synchronize()
                import cupy

                cupy.get_default_memory_pool().free_all_blocks()
            exe = pipelined.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable

            def p_call(s=s, exe=exe):
                state["c"] = exe(inputs.a_array(state["r"], s), inputs.b_array(state["r"]))

            t, h, *sp = measure(clock, p_call, W, R, before=lambda r: state.update(r=r), mpi=mpi)
            state["r"] = 0
            p_call()
            err = _rel_err(inputs, state["c"].shards, ref)
            extra = {"overlap_eff": max(t_ag, base) / t}
            for key in ("cupy", "cublas"):
                if (key, s) in bare:
                    extra[f"vs_bare_{key}_chunks"] = t / bare[(key, s)]
                if (key, 1) in bare:
                    extra[f"vs_bare_{key}_one"] = t / bare[(key, 1)]
            row("pipelined (eager)", t, h, s=s, streams=nstreams, err=err, extra=extra, spread=sp)
            state.clear()
            m = mem_check("pipelined (eager)", lambda r: p_call() if state.update(r=r) is None else None, exe,
                          c_bytes // 1, in_bytes, ga_bytes)
            if m:
                m.update(S=s, streams=nstreams)
            state.clear()
            del exe
            if args.graph and gpu and len(mesh.local_devices) == 1:
                gjit = sf.jit(mesh=mesh, streams=nstreams, graph=True)(pipelined.fn)
                gexe = gjit.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable
                static = gexe.graph.inputs  # the plan's own input buffers: fill them, call on them
                a_st = Array(mesh, inputs.a_array(0, s).shape, dtype, inputs.a_array(0, s).sharding,
                             [static[0][0]])
                b_st = Array(mesh, (K, N), dtype, Layout.replicated(2), [static[1][0]])

                def fill(r):
                    a, b = inputs.sets[r % len(inputs.sets)]
                    with be.stream(0):
                        static[0][0][...] = a[0].reshape(static[0][0].shape)
                        static[1][0][...] = b[0]

                def g_call(gexe=gexe):
                    state["c"] = gexe(a_st, b_st)

                t, h, *sp = measure(clock, g_call, W, R, before=fill, mpi=mpi)
                fill(0)
                g_call()
                err = _rel_err(inputs, state["c"].shards, ref)
                extra = {"overlap_eff": max(t_ag, base) / t}
                for key in ("cupy", "cublas"):
                    if (key, s) in bare:
                        extra[f"vs_bare_{key}_chunks"] = t / bare[(key, s)]
                row("pipelined (graph)", t, h, s=s, streams=nstreams, err=err, extra=extra, spread=sp)
                # graph replay with inputs that are not the plan's buffers: copied in by the call
                t2, h2, *sp2 = measure(clock, lambda: gexe(inputs.a_array(state.get("r", 0), s),
                                                           inputs.b_array(state.get("r", 0))),
                                       W, R, before=lambda r: state.update(r=r), mpi=mpi)
                row("pipelined (graph, copy-in)", t2, h2, s=s, streams=nstreams, spread=sp2)
                m = mem_check("pipelined (graph)", lambda r: gexe(a_st, b_st), gexe, c_bytes, in_bytes, ga_bytes,
                              graph=True)
                if m:
                    m.update(S=s, streams=nstreams, graph_static_bytes=2 * in_bytes + c_bytes)
                state.clear()
                del gexe, gjit, a_st, b_st, static
    # footprint: device memory one plan adds from a clean pool, against the bound
    if gpu and D == 1:
        foot = footprint(args, mesh, dtype, inputs, clock, max(args.chunks), max(args.streams))
        mem.append(foot)
    return rows, mem


def footprint(args, mesh, dtype, inputs, clock, s, nstreams):
    """Device bytes a fresh pipelined plan adds (pool + library allocations), over 3 calls."""
    import cupy

    be = mesh.backend
    pipelined, _ = seed_functions(mesh, nstreams)
    pool = cupy.get_default_memory_pool()
    be.synchronize()
    pool.free_all_blocks()
    p0, d0 = clock.memory()
    exe = pipelined.lower(inputs.a_array(0, s).spec, inputs.b_array(0).spec).executable
    c = None
    for r in range(3):
        c = exe(inputs.a_array(r, s), inputs.b_array(r))
    be.synchronize()
    p1, d1 = clock.memory()
    M, K, N = args.m, args.k, args.n
    in_b = _nbytes((M, K), dtype) + _nbytes((K, N), dtype)
    out_b = _nbytes((M, N), dtype)
    ga = _nbytes((M, K), dtype)
    ws_one = be.workspace_bytes and (be.workspace_bytes // max(1, len(be._handles)))
    ws = ws_one * (1 + nstreams)
    rec = {"name": "footprint", "dtype": dtype, "S": s, "streams": nstreams,
           "plan_added_pool_bytes": p1 - p0, "plan_added_device_bytes": d1 - d0,
           "plan_persistent_bytes": _plan_bytes(exe), "inputs_bytes": in_b, "outputs_bytes": out_b,
           "gathered_a_bytes": ga, "cublas_workspace_bytes_per_handle": ws_one,
           "bound_bytes": in_b + out_b + ga + ws,
           "peak_bytes": in_b + (d1 - d0)}
    rec["within_bound"] = rec["peak_bytes"] <= rec["bound_bytes"]
    del c, exe
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
    head = f"{'plan':<28} {'dtype':<9} {'S':>3} {'str':>3} {'ms':>9} {'TFLOP/s':>8} {'host us':>9} " \
           f"{'host%':>6} {'overlap':>7} {'vs bare':>7} {'rel err':>8}"
    out = [head, "-" * len(head)]
    for r in rows:
        vs = r.get("vs_bare_cupy_chunks") or r.get("vs_bare_cublas_chunks")
        out.append(f"{r['name']:<28} {r['dtype']:<9} {str(r['S'] or ''):>3} {str(r['streams'] or ''):>3} "
                   f"{r['ms']:9.3f} {r['tflops'] or 0:8.1f} {r['host_us']:9.1f} {100 * (r['host_frac'] or 0):5.1f}% "
                   f"{(('%.3f' % r['overlap_eff']) if r.get('overlap_eff') else ''):>7} "
                   f"{(('%.3f' % vs) if vs else ''):>7} "
                   f"{(('%.1e' % r['rel_err']) if r.get('rel_err') is not None else ''):>8}")
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
    p.add_argument("--graph", action="store_true", help="also time graph replay (cupy backend)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
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
        log(f"-- {dtype}")
        r, m = bench_dtype(args, mesh, dtype, log)
        rows += r
        mem += m
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"env": env, "args": {k: v for k, v in vars(args).items()}, "rows": rows, "memory": mem}))
    else:
        print()
        print(table(rows))
        for m in mem:
            print(m)
    bad = [r for r in rows if r.get("rel_err") is not None and not r["rel_err"] <= TOLERANCE[r["dtype"]]]
    if bad:
        print(f"shardfuse bench: {len(bad)} result(s) over tolerance", file=sys.stderr)
        return 1
    return 0
