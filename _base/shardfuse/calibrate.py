"""`shardfuse calibrate`: measure this machine's rates for the cost model, and cache them.

Short runs of real plans through the mesh's backend (NumPy devices, or CuPy on GPUs), each the
least of --repeat calls after a warm-up: host issue costs, memory bandwidth, GEMMs of a few sizes
per dtype, an Allgather, Allreduce and ReduceScatter of a few sizes, and on GPUs with D > 1 a
pipelined AllGather+GEMM (the GEMM slowdown that makes the model match it; on devices sharing a
GPU, the collectives' latency and the chunk GEMMs' operand bandwidth).  Each figure is what
remains of a measured time once the model has accounted for the rest with the figures measured
before it.  Rates are per device (NumPy devices and virtual devices of one GPU run one after
another: the model multiplies back).  The cache (shardfuse/rates.py) is keyed by the machine: a
driver, NCCL or CuPy update makes it stale, and calibrate rebuilds it (--force: always).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
from dataclasses import replace

import numpy as np

import shardfuse as sf
from shardfuse import rates as cache
from shardfuse.cost import BUS_FACTOR, ROOFLINE_P, Rates, communication_of, predict, steps_of
from shardfuse.dtypes import np_dtype
from shardfuse.mesh import as_int
from shardfuse.ops import COMMUNICATION, Op
from shardfuse.runtime import backend_of

# (GEMM sizes n for n x n x n, dtypes, elements of the collectives, elements of the bandwidth test)
SIZES = {"cupy": ((1024, 2048, 4096, 8192), ("bfloat16", "float16", "float32"), (2**18, 2**22, 2**26), 2**26),
         "numpy": ((96, 192, 384), ("float32", "float64"), (2**12, 2**15, 2**18), 2**21)}
SKINNY = ((16, 32, 64), 8192)  # GPUs: GEMMs of m rows x n x n, bound by streaming B (the model's gemm_bw)
# devices sharing a GPU: the pipelined runs' M, B's (N, K) and S (the sweep's two B shapes: fitted
# to square B alone, the D = 2 fit ran gemm_bw to its bound in 2 of 4 H200 calibrations)
SHARED_RUNS = ((1024, 4096), ((8192, 8192), (4096, 16384)), (1, 4, 16))
FREE = 1e30  # a rate so high that what it times costs nothing


def make_timer(mesh, repeat: int) -> tuple:
    """(time_s, host_s): time_s(fn) the least seconds a call of fn takes on the device (CUDA events
    on the caller's stream; host time on NumPy devices), host_s(fn) the least wall time its issue
    takes (the host returns once it has issued the steps); `repeat` calls each on an idle device,
    after a warm-up (the bench's clocks)."""
    import time

    from shardfuse.bench.clocks import device_streams, make_clock

    clock = make_clock(backend_of(mesh), device_streams(backend_of(mesh)))

    def time_s(fn) -> float:
        fn()
        runs = []
        for _ in range(repeat):
            clock.idle()
            st = clock.stamps(2)
            clock.stamp(st, 0)
            fn()
            clock.stamp(st, 1)
            runs.append(clock.between(*st) / 1e3)
        return min(runs)

    def host_s(fn) -> float:
        fn()
        runs = []
        for _ in range(repeat):
            clock.idle()
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        clock.idle()
        return min(runs)
    return time_s, host_s


def _fit(xs, secs, rate: float) -> tuple:
    """(fixed seconds, rate) of the least-squares line secs = fixed + xs / rate, over the points
    left a positive time once the rest was accounted for; too few of them, or a line that does
    not rise: (None, the given rate), the figure kept."""
    pts = [(x, t) for x, t in zip(xs, secs) if t > 0]
    if len(pts) < 2:
        return None, rate
    slope, intercept = np.polyfit(*np.asarray(pts, float).T, 1)
    if not slope > 0:
        return None, max(x / t for x, t in pts)
    return max(float(intercept), 0.0), 1.0 / float(slope)


def _random(shape, dtype, mesh, axis=None):
    """Random inputs, never constants: a GEMM of constant operands runs ~15% faster on an H200
    (less power drawn, higher clocks), which made the first calibration optimistic."""
    x = np.random.default_rng(0).uniform(-1.0, 1.0, shape).astype(np_dtype(dtype))
    return sf.replicate(x, mesh=mesh) if axis is None else sf.shard(x, axis, mesh=mesh)


def _rest(prog, rates, local, share) -> float:
    """The model's time for everything in prog but what `rates` makes free."""
    return predict(prog, rates, local, share).total_s


def _scaled_weight(k: int, dtype: str, mesh, n: int | None = None):
    """A replicated random [k, n] (n: k) scaled by 1 / sqrt(k), so a chain x @ w @ w ... stays near 1."""
    w = np.random.default_rng(1).uniform(-1, 1, (k, n or k)) / np.sqrt(k)
    return sf.replicate(w.astype(np_dtype(dtype)), mesh=mesh)


def _chain(mesh, n: int):
    """A plan of n GEMMs one after another: x @ w @ w ... (x [m, k], w [k, k])."""
    def f(x, w):
        for _ in range(n):
            x = x @ w
        return x
    return sf.jit(f, mesh=mesh)


def measure_host(mesh, time_s, host_s, rates, local) -> Rates:
    """Host issue costs: step_s and call_s from a line through the issue times of chains of 1 to 33
    tiny GEMMs (the compute step plans issue most), comm_step_s (one tiny Allgather) and event_s (a
    stream loop of tiny GEMMs in 1 and in 16 chunks).  On GPUs call_s is instead the intercept of
    device-timed chains of large GEMMs: the host's work before the GPU can start; the rest of a
    call's fixed work (its result's wrapping) runs while the GPU computes."""
    x, w = _random((64, 16), "float32", mesh), _random((16, 16), "float32", mesh)
    ns = (1, 9, 17, 33)
    times = [host_s(lambda f=_chain(mesh, n): f(x, w)) for n in ns]
    fixed, per_step = _fit(ns, times, 1.0 / max(rates.step_s * local, 1e-9))
    step = 1.0 / per_step
    rates = replace(rates, step_s=step / local, call_s=max(times[0] - step, 0.0) if fixed is None else fixed)
    if mesh.size > 1:
        y = _random((16 * mesh.size,), "float32", mesh, 0)  # (any D divides it)
        ag = sf.jit(lambda v: sf.replicate(v), mesh=mesh)
        rates = replace(rates, comm_step_s=max(host_s(lambda: ag(y)) - rates.call_s, 0.0) / local)
    loops = [sf.jit(lambda v, u, s=s: sf.stream(v @ u, axis=0, chunks=s), mesh=mesh) for s in (1, 16)]
    t = [host_s(lambda g=g: g(x, w)) for g in loops]
    steps = [steps_of(g.lower(x, w).program, rates) for g in loops]
    gemms, events = ([sum(st.engine == e for st in ss) for ss in steps] for e in ("compute", None))
    per_event = max(t[1] - t[0] - (gemms[1] - gemms[0]) * step, 0.0) / max(events[1] - events[0], 1)
    rates = replace(rates, event_s=per_event / local)
    if not rates.serial:  # last: the figures above are of wall times, with the whole call_s
        big, wb = _random((2048, 4096), "bfloat16", mesh), _scaled_weight(4096, "bfloat16", mesh)
        ns = (1, 2, 4, 8)
        pre, _ = _fit(ns, [time_s(lambda f=_chain(mesh, n): f(big, wb)) for n in ns], 1.0)
        rates = replace(rates, call_s=rates.call_s if pre is None else pre)
    return rates


def measure_compute(mesh, time_s, rates, local, share, gemm_sizes, dtypes, bw_elements) -> Rates:
    """mem_bw from one large scaling; per dtype, GEMM peak and half-rate size fitted over sizes."""
    x = _random((bw_elements,), "float32", mesh)
    f = sf.jit(lambda v: v * 1.0, mesh=mesh)
    t = time_s(lambda: f(x)) - _rest(f.lower(x).program, replace(rates, mem_bw=FREE), local, share)
    rates = replace(rates, mem_bw=share * 8 * bw_elements / t) if t > 0 else rates
    mm = sf.jit(lambda a, b: a @ b, mesh=mesh)
    gemm, half = dict(rates.gemm_flops), []
    for dtype in dtypes:
        flops, secs = [], []
        for n in gemm_sizes:
            a, b = _random((n, n), dtype, mesh), _random((n, n), dtype, mesh)
            free = replace(rates, gemm_flops={dtype: FREE}, gemm_half_flops=0.0, gemm_bw=FREE)
            secs.append((time_s(lambda: mm(a, b)) - _rest(mm.lower(a, b).program, free, local, share)) / share)
            flops.append(2.0 * n ** 3)
        if rates.serial:  # NumPy: its fixed cost per GEMM is the host's, in step_s already
            gemm[dtype] = sum(flops) / sum(secs) if sum(secs) > 0 else gemm.get(dtype, min(gemm.values()))
            continue
        t0, gemm[dtype] = _fit(flops, secs, gemm.get(dtype, min(gemm.values())))
        if t0 is not None:
            half.append(t0)
    # (a GEMM's fixed time, the same for every dtype: cost.gemm_time reads it at the fastest peak)
    half_flops = float(np.median(half)) * max(gemm.values()) if half else 0.0 if rates.serial else rates.gemm_half_flops
    rates = replace(rates, gemm_flops=gemm, gemm_half_flops=half_flops)
    return rates if rates.serial else measure_gemm_bw(mesh, time_s, rates, local, share, dtypes[0])


def measure_gemm_bw(mesh, time_s, rates, local, share, dtype) -> Rates:
    """gemm_bw: how fast a GEMM of few rows streams its operands, from the slope of chains of 1
    and 17 such GEMMs (the time of one GEMM on a busy GPU: a single short call is mostly its
    fixed host and launch costs), less its FLOPs' share of the smoothed roofline."""
    (ms, n), best = SKINNY, 0.0
    itemsize = np.dtype(np_dtype(dtype)).itemsize
    w = _scaled_weight(n, dtype, mesh)
    short, long = _chain(mesh, 1), _chain(mesh, 17)
    peak = rates.gemm_flops.get(dtype, min(rates.gemm_flops.values()))
    for m in ms:
        x = _random((m, n), dtype, mesh)
        per_gemm = (time_s(lambda: long(x, w)) - time_s(lambda: short(x, w))) / 16 / share
        fixed = rates.gemm_half_flops / max(rates.gemm_flops.values())  # (cost.gemm_time's)
        by = per_gemm ** ROOFLINE_P - (2 * m * n * n / peak + fixed) ** ROOFLINE_P
        if by > 0:
            best = max(best, (2 * m * n + n * n) * itemsize / by ** (1 / ROOFLINE_P))
    return replace(rates, gemm_bw=best or rates.gemm_bw)


COLLECTIVE_CASES = {  # communication Op -> a function of an input sharded on axis 0: that one collective
    Op.ALLGATHER: lambda x: sf.replicate(x),
    Op.ALLREDUCE: lambda x: sf.replicate(x.sum(0)),
    Op.REDUCE_SCATTER: lambda x: sf.shard(x.sum(0), 0),
}


def measure_comm(mesh, time_s, rates, local, share, sizes) -> Rates:
    """Per collective: latency and bus bandwidth fitted over sizes; point-to-point and AllToAll
    take the Allgather's bandwidth."""
    d, bw, lats = mesh.size, dict(rates.comm_bw), []
    free = replace(rates, comm_bw={op: FREE for op in rates.comm_bw}, comm_latency_s=0.0, comm_step_latency_s=0.0)
    for op, fn in COLLECTIVE_CASES.items():
        f = sf.jit(fn, mesh=mesh)
        moved, secs = [], []
        for n in (n // d * d for n in sizes):  # (any D divides them)
            x = _random((d, n) if op != Op.ALLGATHER else (n,), "float32", mesh, 0)
            prog = f.lower(x).program
            i = next(i for i in prog.walk() if i.op in COMMUNICATION)
            nbytes, team = communication_of(i, mesh)
            moved.append(nbytes * BUS_FACTOR[op](team))
            secs.append(time_s(lambda: f(x)) - _rest(prog, free, local, share))
        lat, bw[op] = _fit(moved, secs, bw[op])
        if lat is not None:
            lats.append(lat)
    for op in (Op.ALLTOALL, Op.SENDRECV, Op.TRANSFER):
        bw[op] = bw[Op.ALLGATHER]
    return replace(rates, comm_bw=bw, comm_latency_s=float(np.median(lats)) if lats else rates.comm_latency_s,
                   comm_step_latency_s=0.0 if lats else rates.comm_step_latency_s)


def fit_to(prog, seconds: float, rates, field: str, lo: float, hi: float, local: int, share: int) -> Rates:
    """rates with `field` set by bisection in [lo, hi] so that the model's time of prog is `seconds`
    (the prediction may grow or shrink with it; a time outside the range ends at a bound)."""
    def pred(x):
        return predict(prog, replace(rates, **{field: x}), local, share).total_s
    grows = pred(hi) > pred(lo)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (pred(mid) < seconds) == grows else (lo, mid)
    return replace(rates, **{field: (lo + hi) / 2})


def fit_least_squares(runs, rates, bounds: dict, local: int, share: int, rounds: int = 8, k: int = 9) -> Rates:
    """rates with the fields of `bounds` ({field: (lo, hi)}) that minimise the sum over `runs`
    [(program, measured seconds)] of log(predicted / measured) squared: a k-point grid per field
    (geometric where lo > 0), narrowed each round to the best point and two neighbours either side
    (one would lose a minimum along a diagonal valley).  Every run weighs on every figure: figures
    that trade off settle where the runs agree, not at a bound."""
    names, box = list(bounds), [tuple(bounds[f]) for f in bounds]

    def sse(values):
        r = replace(rates, **dict(zip(names, values)))
        return sum(math.log(predict(p, r, local, share).total_s / t) ** 2 for p, t in runs)
    for _ in range(rounds):
        axes = [np.geomspace(lo, hi, k) if lo > 0 else np.linspace(lo, hi, k) for lo, hi in box]
        best = min(itertools.product(range(k), repeat=len(names)), key=lambda ix: sse([a[i] for a, i in zip(axes, ix)]))
        box = [(a[max(i - 2, 0)], a[min(i + 2, k - 1)]) for a, i in zip(axes, best)]
    return replace(rates, **{f: float(a[i]) for f, a, i in zip(names, axes, best)})


def pipelined_run(mesh, time_s, m: int, n: int, k: int, chunks: int) -> tuple:
    """(program, least seconds) of the AllGather+GEMM A [m, k] sharded on rows @ B [k, n], bf16."""
    a, b = _random((m, k), "bfloat16", mesh, 0), _scaled_weight(k, "bfloat16", mesh, n)
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=chunks), mesh=mesh)
    return f.lower(a, b).program, time_s(lambda: f(a, b))


def measure_pipeline(mesh, time_s, rates, local, share) -> Rates:
    """The figures fitted to measured pipelined AllGather+GEMMs.  One device per GPU: gemm_slowdown
    in [1, 2], what a GEMM loses beside a collective (4 chunks).  Devices sharing a GPU (no overlap
    there, cost.work_of): comm_latency_s, as collectives run between GEMMs (a lone collective's
    fixed cost, measure_comm's, is mostly the host's issue of a short plan: 80-150 us at D = 2, 4
    on an H200, against 0-40 us in the sweeps), and gemm_bw, how fast the devices' chunk GEMMs
    stream B (per device ~3.2 TB/s at D = 2, ~2.5 at D = 4 on an H200 with a cuBLAS call per device,
    not the 3.6-3.9 of one device's chain), together by least squares over SHARED_RUNS (S = 1, 4,
    16 at two M and the sweep's two B shapes): the two figures trade off, and exact fits to one run
    each ran gemm_bw to its bound.  Not B = 4096 x 4096: there an H200 ran 17-45% slower than the
    figures that fit the sweeps predict, a miss that the latency absorbed."""
    if share == 1:
        prog, t = pipelined_run(mesh, time_s, 2048 * mesh.size, 4096, 4096, 4)
        return fit_to(prog, t, rates, "gemm_slowdown", 1.0, 2.0, local, share)
    ms, bs, ss = SHARED_RUNS
    rows = mesh.size * max(ss)  # (M a multiple of D x S for any D)
    runs = [pipelined_run(mesh, time_s, m // rows * rows, n, k, s) for m in ms for n, k in bs for s in ss]
    return fit_shared(runs, rates, local, share)


def fit_shared(runs, rates, local, share) -> Rates:
    """comm_latency_s and gemm_bw of devices sharing a GPU, from SHARED_RUNS' [(program, seconds)]."""
    bounds = {"comm_latency_s": (0.0, 300e-6), "gemm_bw": (rates.gemm_bw / 8, rates.gemm_bw * 2)}
    return fit_least_squares(runs, rates, bounds, local, share)


def calibrate(mesh, repeat: int = 10, log=print) -> Rates:
    """This machine's rates on `mesh`, measured (a few seconds on NumPy devices, less on a GPU)."""
    key = cache.machine_key(mesh)
    backend = key["backend"]
    gemm_sizes, dtypes, comm_sizes, bw_elements = SIZES[mesh.backend_name]
    local, share = cache.engines(mesh)
    time_s, host_s = make_timer(mesh, repeat)
    base = cache.defaults_for(key)
    rates = replace(base, name=f"calibrated {key.get('gpu', backend)} x{mesh.size}")
    log(f"calibrating {mesh} on {backend} ({local} local device(s), {share} per engine), from {base.name} defaults")
    rates = measure_host(mesh, time_s, host_s, rates, local)
    log(f"  host: {rates.call_s * 1e6:.1f} us per call; per device {rates.step_s * 1e6:.2f} us per compute step, "
        f"{rates.comm_step_s * 1e6:.2f} per communication step, {rates.event_s * 1e6:.2f} per stream step")
    rates = measure_compute(mesh, time_s, rates, local, share, gemm_sizes, dtypes, bw_elements)
    log(f"  memory {rates.mem_bw / 1e9:.1f} GB/s; GEMMs " + ", ".join(f"{d} {rates.gemm_flops[d] / 1e12:.3f} TFLOP/s"
                                                                   for d in dtypes)
        + f" (half rate at {rates.gemm_half_flops / 1e9:.3f} GFLOP; operands at {rates.gemm_bw / 1e9:.0f} GB/s)")
    if mesh.size > 1:
        before, rates = rates, measure_comm(mesh, time_s, rates, local, share, comm_sizes)
        kept = " (the default: too little time was left to measure once compute was accounted for)"
        log(f"  collectives: {rates.comm_latency_s * 1e6:.1f} us"
            f"{kept if rates.comm_latency_s == before.comm_latency_s else ''} + bytes / busbw " + ", ".join(
                f"{op} {rates.comm_bw[op] / 1e9:.2f} GB/s{kept if rates.comm_bw[op] == before.comm_bw[op] else ''}"
                for op in COLLECTIVE_CASES))
        if not rates.serial:
            rates = measure_pipeline(mesh, time_s, rates, local, share)
            log(f"  GEMM slowdown beside a collective: {rates.gemm_slowdown:.2f}x" if share == 1 else
                f"  on the shared GPU: collective latency between GEMMs {rates.comm_latency_s * 1e6:.1f} us, "
                f"chunk GEMMs stream their operands at {rates.gemm_bw / 1e9:.0f} GB/s")
    return rates


def ensure(mesh, force: bool = False, repeat: int = 10, log=print) -> tuple:
    """(rates, cache path, measured now?): the cached rates when their key is this machine's,
    else measured and written (a key change, a corrupt file or force: rebuilt)."""
    key = cache.machine_key(mesh)
    cached = None if force else cache.load(key)
    if cached is not None:
        return cached, cache.cache_path(key), False
    where = cache.cache_dir()  # (checked before measuring: a cache that cannot be written fails fast)
    if where.exists() and not (where.is_dir() and os.access(where, os.W_OK)):
        raise OSError(f"the rates cache {where} is not a writable directory (set SHARDFUSE_CACHE_DIR to one)")
    rates = calibrate(mesh, repeat, log)
    path = cache.save(key, rates) if mesh.rank == 0 else cache.cache_path(key)
    return rates, path, True


def main(argv=None) -> int:
    from shardfuse.bench.clocks import caller_streams, device_streams
    from shardfuse.demo import default_devices

    p = argparse.ArgumentParser(prog="shardfuse calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["numpy", "cupy"], default=None)
    p.add_argument("--devices", type=int, default=None, help="D (default: all GPUs, else 4 CPU devices)")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per measurement (the least is kept)")
    p.add_argument("--force", action="store_true", help="measure even when the cache is up to date")
    args = p.parse_args(argv)
    repeat = as_int(args.repeat, "--repeat", minimum=1)
    devices = default_devices(args.backend) if args.devices is None else as_int(args.devices, "--devices", minimum=1)
    mesh = sf.DeviceMesh(devices, backend=args.backend)
    quiet = mesh.rank != 0

    def log(msg):
        if not quiet:
            print(msg, flush=True)
    caller, _ = caller_streams(device_streams(backend_of(mesh)))
    with caller:
        rates, path, measured = ensure(mesh, args.force, repeat, log)
    log(f"{'wrote' if measured else 'up to date (--force measures again)'}: {path}")
    if not measured:
        log(f"  {rates.to_json()}")
    return 0

