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
import json
import sys
import time

import shardfuse as sf
from shardfuse.bench import ag_gemm, gemm_rs, host, report
from shardfuse.bench.clocks import caller_streams, device_streams, make_clock
from shardfuse.bench.runner import Context, Progress
from shardfuse.bench.sweep import add_sweep_arguments, run_sweep
from shardfuse.demo import default_devices
from shardfuse.runtime import backend_of

TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


def _ints(s):
    return [int(x) for x in s.split(",") if x]


def parser():
    p = argparse.ArgumentParser(prog="shardfuse bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["numpy", "cupy"], default=None)
    p.add_argument("--devices", type=int, default=None, help="D (default: all GPUs, else 4 CPU devices)")
    p.add_argument("--m", type=int, default=None, help="M, all of A's rows, as in shardfuse demo and simulate "
                                                           "(default 8192 on GPUs, 512 on NumPy devices)")
    p.add_argument("--k", type=int, default=None, help="(default 8192 on GPUs, 512 on NumPy devices)")
    p.add_argument("--n", type=int, default=None, help="(default 8192 on GPUs, 512 on NumPy devices)")
    p.add_argument("--dtype", default=None, help="comma-separated: float16,bfloat16,float32,float64 "
                                                 "(default float16 on GPUs, float32 on NumPy devices)")
    p.add_argument("--chunks", type=_ints, default=None, help="S values, comma-separated (default 1,2,4,8,16 on "
                                                              "GPUs, 1,2,4 on NumPy devices)")
    p.add_argument("--streams", type=_ints, default=[4], help="stream counts, comma-separated")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--sets", type=int, default=3, help="input sets rotated over runs")
    p.add_argument("--growth-calls", type=int, default=None, help="calls for the memory-growth check (default "
                                                                  "1000 on GPUs, 20 on NumPy devices)")
    p.add_argument("--steady-calls", type=int, default=20,
                   help="calls issued back to back (no synchronisation) per run, for the steady-state host "
                        "issue time and the back-to-back GPU time per call")
    p.add_argument("--steady-rounds", type=int, default=5,
                   help="runs of --steady-calls per variant, round robin over the variants (medians)")
    p.add_argument("--graph", action="store_true", help="also time graph replay (cupy backend)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--host", action="store_true",
                   help="the host issue time table instead (bench/host.py): D = 1, 2, 4, 8 (or --devices), S = 1, 4, 8 "
                        "(or --chunks), eager and graph, plan alone and user path, --steady-calls calls back to back, "
                        "--steady-rounds runs")
    p.add_argument("--pattern", choices=["ag", "rs", "both"], default="ag",
                   help="ag: AllGather+GEMM (the seed); rs: GEMM+ReduceScatter (the row-parallel linear)")
    return add_sweep_arguments(p)


def over_tolerance(rows):
    """The rows whose checked result is further from float64 than its dtype allows (or NaN)."""
    return [r for r in rows if r.get("rel_err") is not None and not r["rel_err"] <= TOLERANCE[r["dtype"]]]


# Defaults sized to the backend: a GPU's are a large GEMM; NumPy devices compute on the host.
DEFAULTS = {"cupy": dict(m=8192, k=8192, n=8192, dtype="float16", chunks=[1, 2, 4, 8, 16], growth_calls=1000),
            "numpy": dict(m=512, k=512, n=512, dtype="float32", chunks=[1, 2, 4], growth_calls=20)}


def _resolve(p, args, mesh):
    """Defaults for the backend, and every argument checked before any work (each error names it)."""
    for name, value in DEFAULTS[mesh.backend_name].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("devices", "m", "k", "n", "repeat", "sets", "steady_calls", "steady_rounds", "warmup",
                 "growth_calls", "seed"):
        value, least = getattr(args, name), 0 if name in ("warmup", "growth_calls", "seed") else 1
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be {'a positive int' if least else 'an int >= 0'}, got {value}")
    for name in ("chunks", "streams"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            p.error(f"--{name} must be positive ints, comma-separated, got {getattr(args, name)}")
    unknown = [d for d in args.dtype.split(",") if d not in TOLERANCE]
    if unknown:
        p.error(f"--dtype takes {', '.join(TOLERANCE)} (comma-separated), got {', '.join(map(repr, unknown))}")
    d = mesh.size
    if args.m % d or (args.pattern != "ag" and args.k % d):
        what = "--m must be a multiple" if args.pattern == "ag" else "--m and --k must be multiples"
        p.error(f"{what} of D = {d} (the devices hold blocks of the rows, and of K in GEMM+ReduceScatter), got "
                f"M={args.m} K={args.k}")
    if args.graph and mesh.backend_name != "cupy":
        p.error("--graph times CUDA graph replay: it needs the cupy backend (GPUs)")


def _host_table(p, args, mesh):
    """`--host`: the issue-time table (one process: the plans' host work is what it measures)."""
    if mesh.nprocs > 1:
        p.error("--host measures one process' issue time: run it without mpiexec")
    if args.steady_calls < 1 or args.steady_rounds < 1 or (args.chunks and min(args.chunks) < 1):
        p.error("--steady-calls, --steady-rounds and --chunks must be positive ints")
    env = report.environment(mesh)
    result = host.suite(mesh.backend_name, args.steady_calls, args.steady_rounds,
                        (args.devices,) if args.devices else host.DEVICES, tuple(args.chunks or host.CHUNKS),
                        log=None if args.json or args.no_progress else lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({"env": env, "host": result}) if args.json else f"{env}\n{host.table(result)}")
    return 0


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices must be a positive int, got {args.devices}")
    if args.sweep:
        return run_sweep(args)
    mesh = sf.DeviceMesh(args.devices or default_devices(args.backend), backend=args.backend)
    if args.host:
        return _host_table(p, args, mesh)
    _resolve(p, args, mesh)
    mpi = None
    if args.seed is None:
        args.seed = int(time.time_ns() % 2**31)
    if mesh.nprocs > 1:  # the inputs are global arrays: the same on every process
        from mpi4py import MPI

        mpi = MPI.COMM_WORLD
        args.seed = mpi.bcast(args.seed)
    lead = mesh.rank == 0
    quiet = args.json or not lead

    def log(msg):
        if not quiet:
            print(msg, flush=True)

    cuda = device_streams(backend_of(mesh))
    env = report.environment(mesh)
    caller, torch_stream = caller_streams(cuda)
    env["user_arrays"] = "numpy" if not cuda else "torch" if torch_stream is not None else "cupy"
    log(f"shardfuse bench: {mesh}, M={args.m} K={args.k} N={args.n}, S={args.chunks}, streams={args.streams}")
    log(f"  {env}")
    ctx = Context(args, mesh, make_clock(backend_of(mesh), cuda), cuda, log, mpi, torch_stream,
                  Progress(lead and not args.no_progress))
    rows, mem = [], []
    with caller:
        for dtype in args.dtype.split(","):
            if args.pattern in ("ag", "both"):
                log(f"-- {dtype}: AllGather+GEMM")
                r, m = ag_gemm.suite(ctx, dtype)
                rows += r
                mem += m
            if args.pattern in ("rs", "both"):
                log(f"-- {dtype}: GEMM+ReduceScatter")
                rows += gemm_rs.suite(ctx, dtype)
    if not lead:
        return 0
    if args.json:
        print(report.to_json(env, args, rows, mem))
    else:
        print()
        print(report.table(rows))
        print(report.memory_table(mem))
    bad = over_tolerance(rows)
    if bad:
        print(f"shardfuse bench: {len(bad)} result(s) over tolerance", file=sys.stderr)
        return 1
    return 0
