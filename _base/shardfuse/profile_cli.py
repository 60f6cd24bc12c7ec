"""`shardfuse profile`: the seed's pipelined AllGather+GEMM, profiled: its timeline as a Chrome
trace (chrome://tracing, ui.perfetto.dev) and a PNG, and the summary figures.  --nvtx also names
each call and step in NVTX ranges, for `nsys profile shardfuse profile --backend cupy --nvtx`."""
from __future__ import annotations

import argparse

import numpy as np

import shardfuse as sf
from shardfuse.demo import default_devices, rows_per_block, seed_functions
from shardfuse.dtypes import np_dtype
from shardfuse.timeline import output_file

# what each backend profiles: NumPy has no fast 16-bit GEMM; on GPUs the 16-bit types are the ones tensor
# cores run (float32 too, for comparison)
DTYPES = {"numpy": ("float32", "float64"), "cupy": ("float16", "bfloat16", "float32")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="shardfuse profile", description=__doc__)
    p.add_argument("--backend", choices=sorted(DTYPES), default="numpy", help="numpy: host clocks around each "
                   "step; cupy: CUDA events on each step's stream, on GPUs")
    p.add_argument("--devices", type=int, default=None, help="mesh size (default: all GPUs on cupy, else 4 CPU "
                   "devices; under mpiexec, one per process)")
    p.add_argument("--chunks", type=int, default=4, help="S: chunks along the stream axis")
    p.add_argument("--m", type=int, default=None, help="M, all of A's rows, as in shardfuse demo, bench and "
                   "simulate: a multiple of chunks x devices (default 64 x chunks x devices)")
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=sorted({t for ts in DTYPES.values() for t in ts}),
                   help="numpy: " + ", ".join(DTYPES["numpy"]) + "; cupy: " + ", ".join(DTYPES["cupy"]))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--trace", type=output_file, default="shardfuse_trace.json",
                   help="Chrome trace / Perfetto JSON to write (default: %(default)s)")
    p.add_argument("--png", type=output_file, default=None, help="a Gantt chart to write (needs matplotlib)")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges named after the plan and its steps, for Nsight "
                   "Systems (needs the nvtx package)")
    args = p.parse_args(argv)
    for name in ("devices", "chunks", "m", "k", "n", "streams", "repeat"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be a positive int, got {getattr(args, name)}")
    if args.dtype not in DTYPES[args.backend]:
        p.error(f"--dtype {args.dtype} is not profiled on {args.backend}: choose from {', '.join(DTYPES[args.backend])}")
    if args.nvtx:  # (before any work, not after the warm-up)
        try:
            import nvtx  # noqa: F401
        except ImportError:
            p.error("--nvtx needs the nvtx package: pip install \"shardfuse[nvtx]\" (or pip install nvtx)")
    d = default_devices(args.backend) if args.devices is None else args.devices
    mesh = sf.DeviceMesh(d, backend=args.backend)
    pipelined, _ = seed_functions(mesh, args.streams)
    rng = np.random.default_rng(0)
    try:
        m = rows_per_block(args, d)
    except ValueError as e:
        p.error(str(e))
    a = rng.standard_normal((args.chunks, d, m, args.k)).astype(np_dtype(args.dtype))
    b = rng.standard_normal((args.k, args.n)).astype(np_dtype(args.dtype))
    a = sf.shard(a, axis=1, over=mesh.axis_names[-1], mesh=mesh)
    plan = pipelined.lower(a.spec, sf.TensorSpec(b.shape, args.dtype))
    plan(a, b)  # warm-up, not profiled: a first call binds the plan and, on GPUs, sets up NCCL (tens of ms)
    timeline = plan.profile(a, b, repeat=args.repeat, nvtx=args.nvtx)
    if mesh.rank == 0:
        timeline.to_chrome_trace(args.trace)
        if args.png:
            timeline.plot(path=args.png)
        s = timeline.summary()
        print(f"{mesh}: device {s['device']}: {s['steps']} steps over {args.repeat} call(s), "
              f"{s['total_s'] * 1e3:.3f} ms; communication "
              f"{s['communication_s'] * 1e3:.3f} ms (exposed {s['exposed_communication_s'] * 1e3:.3f}), GEMMs "
              f"{s['gemm_s'] * 1e3:.3f} ms, overlap efficiency {s['overlap_efficiency']:.2f}")
        print(f"trace: {args.trace}" + (f", chart: {args.png}" if args.png else ""))
        if mesh.nprocs > 1:
            print(f"{mesh.nprocs} processes: each one's times start at its own first step (their clocks are not "
                  "aligned), so overlap between processes is approximate")
        elif args.backend == "numpy":
            print("NumPy devices run one after another inside each step, so nothing overlaps here; "
                  "--backend cupy profiles GPUs (CUDA events on each step's stream)")
    return 0
