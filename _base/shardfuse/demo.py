"""`shardfuse demo`: the seed's pipelined AllGather+GEMM (or with --mlp the MLP block), checked and
timed; its options (shardfuse/demo_model.py, the command's entry, runs --layer and --train)."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from shardfuse.runtime import backend_of

DESCRIPTION = ("Run a case on the default mesh, print its plan and collectives and check it against float64 NumPy: "
               "the seed's pipelined AllGather+GEMM (timed beside the unpipelined one), --mlp the MLP block, --layer "
               "the transformer layer, --train a 2-layer GPT's gradients and a few Adam steps.")
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


def seed_functions(mesh, streams):
    """The seed case, pipelined (sf.stream) and unpipelined (Allgather, then one GEMM)."""
    @sf.jit(mesh=mesh, streams=streams)
    def ag_matmul(a, b):
        a = sf.shard(a, axis=1, over=mesh.axis_names[-1])
        return sf.stream(a @ b, axis=0)

    @sf.jit(mesh=mesh, streams=streams)
    def ag_then_matmul(a, b):
        a = sf.shard(a, axis=1, over=mesh.axis_names[-1])
        return sf.replicate(a @ b)

    return ag_matmul, ag_then_matmul


def default_devices(backend):
    from shardfuse.mesh import world, gpu_count

    _, _, nprocs = world()
    if nprocs > 1:
        return nprocs
    if backend in (None, "cupy") and gpu_count() > 0:
        return gpu_count()
    return 4


def median_ms(fn, mesh, repeat):
    fn()  # warm-up: binds the plan, allocates its buffers
    backend_of(mesh).synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        backend_of(mesh).synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def relative_error(got, ref):
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def seeded_rng(args, mesh, say):
    """Every process draws the same global inputs (same seed), as a replicated program would;
    the seed is printed, so a run can be repeated with --seed.  Returns (rng, seed)."""
    seed = args.seed if args.seed is not None else int(time.time_ns() % 2**31)
    if seed < 0:
        raise ValueError(f"--seed must be an int >= 0, got {seed}")
    if mesh.nprocs > 1:
        from mpi4py import MPI

        seed = MPI.COMM_WORLD.bcast(seed)
    say(f"inputs from seed {seed} (repeat with --seed {seed})")
    return np.random.default_rng(seed), seed


def is_virtual(mesh) -> bool:
    """Whether several devices of this process share one CPU (NumPy) or one GPU (CuPy)."""
    ordinals = backend_of(mesh).ordinals
    return len(mesh.local_devices) > 1 if ordinals is None else len(set(ordinals)) < len(ordinals)


def _timing_note(mesh) -> str:
    """What the times mean on this mesh: virtual devices share one machine's resources."""
    local = len(mesh.local_devices)
    if not is_virtual(mesh):
        return ""
    if mesh.backend_name == "numpy":
        return (f" ({local} NumPy devices of one process run one after another, so nothing overlaps and the "
                "pipelined plan only adds steps here; on GPUs chunks overlap)")
    return f" ({local} virtual devices share the GPU(s) of this process)"


def rows_per_block(args, d) -> int:
    """m = M / (S x D): the rows of each [m, K] block of A in the seed layout [S, D, m, K] (--m is M,
    all of A's rows, as in `shardfuse bench` and `simulate`; the MLP block's tokens)."""
    if args.m is None:
        return 64
    if args.m % (args.chunks * d):
        raise ValueError(f"--m is M, all of A's rows (as in shardfuse bench and simulate; demo's and profile's --m "
                         f"once meant rows per device per chunk): {args.m} must be a multiple of --chunks x devices = "
                         f"{args.chunks} x {d} = {args.chunks * d}")
    return args.m // (args.chunks * d)


def speaker(args, mesh):
    """print on rank 0, unless --json (then one JSON object at the end instead)."""
    return print if mesh.rank == 0 and not args.json else (lambda *a, **k: None)


def _result(args, mesh, plan, seed, err, collectives, times) -> dict:
    """What --json prints: one object with the plan, its checks and its times."""
    return {"case": f"mlp {args.mlp}" if args.mlp else "seed", "backend": mesh.backend_name, "devices": len(mesh.devices), "processes": mesh.nprocs,
            "virtual": is_virtual(mesh), "dtype": args.dtype, "seed": seed, "plan": str(plan),
            "collectives": dict(zip(("pipelined", "unpipelined"), collectives)),
            "timings_ms": dict(zip(("pipelined", "unpipelined"), times)), "repeat": args.repeat,
            "relative_error": err, "tolerance": TOLERANCE[args.dtype], "passed": err <= TOLERANCE[args.dtype]}


def _emit(args, mesh, result) -> int:
    if args.json and mesh.rank == 0:
        print(json.dumps(result))
    return 0 if result["passed"] else 1


def mlp_demo(args):
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    d = args.devices or default_devices(args.backend)
    mesh = sf.DeviceMesh(d, backend=args.backend)
    say = speaker(args, mesh)
    tokens = args.chunks * d * rows_per_block(args, d)
    rng, seed = seeded_rng(args, mesh, say)
    inputs = [a.astype(np_dtype(args.dtype)) for a in mlp_inputs(rng, tokens, args.hidden)]
    specs = [sf.TensorSpec(a.shape, args.dtype) for a in inputs]
    pipelined = mlp_block(mesh, args.mlp, chunks=args.chunks, streams=args.streams)
    flat = mlp_block(mesh, args.mlp, chunks=1, streams=args.streams)
    plan = pipelined.lower(*specs)
    say(f"{mesh}, MLP block ({args.mlp}), x[{tokens}, {args.hidden}], {args.dtype}\n")
    say(plan, "\n")
    err = relative_error(pipelined(*inputs).gather(), mlp_reference(*inputs))
    ok = err <= TOLERANCE[args.dtype]
    times = median_ms(lambda: pipelined(*inputs), mesh, args.repeat), median_ms(lambda: flat(*inputs), mesh, args.repeat)
    collectives = plan.collectives(), flat.lower(*specs).collectives()
    say(f"check against the single-device block: relative error {err:.2e} -> {'OK' if ok else 'FAILED'}")
    say(f"collectives per call: chunks={args.chunks} {collectives[0]}, chunks=1 {collectives[1]}")
    say(f"time (median of {args.repeat}): pipelined {times[0]:.3f} ms, one chunk {times[1]:.3f} ms" + _timing_note(mesh))
    return _emit(args, mesh, _result(args, mesh, plan, seed, err, collectives, times))


def seed_demo(args):
    d = args.devices or default_devices(args.backend)
    mesh = sf.DeviceMesh(d, backend=args.backend)
    say = speaker(args, mesh)
    shape_a, shape_b = (args.chunks, d, rows_per_block(args, d), args.k), (args.k, args.n)
    pipelined, unpipelined = seed_functions(mesh, args.streams)
    plan = pipelined.lower(sf.TensorSpec(shape_a, args.dtype), sf.TensorSpec(shape_b, args.dtype))
    say(f"{mesh}, {mesh.nprocs} process(es), a{shape_a} @ b{shape_b} {args.dtype} (M={np.prod(shape_a[:3])} rows "
        "of A in the seed layout [S, D, m, K])\n")
    say(plan, "\n")

    rng, seed = seeded_rng(args, mesh, say)
    dt = np_dtype(args.dtype)
    a = rng.standard_normal(shape_a).astype(dt)
    b = rng.standard_normal(shape_b).astype(dt)
    ref = a.astype(np.float64) @ b.astype(np.float64)

    a_sharded = sf.shard(a, axis=1, over=mesh.axis_names[-1], mesh=mesh)
    err = relative_error(pipelined(a_sharded, b).gather(), ref)
    ok = err <= TOLERANCE[args.dtype]
    times = (median_ms(lambda: pipelined(a_sharded, b), mesh, args.repeat),
             median_ms(lambda: unpipelined(a_sharded, b), mesh, args.repeat))
    collectives = plan.collectives(), unpipelined.lower(a_sharded.spec, sf.TensorSpec(shape_b, args.dtype)).collectives()
    say(f"check against the single-device product: relative error {err:.2e} "
        f"(tolerance {TOLERANCE[args.dtype]:.0e}) -> {'OK' if ok else 'FAILED'}")
    say(f"collectives per call: pipelined {collectives[0]}, unpipelined {collectives[1]}")
    say(f"time (median of {args.repeat}): pipelined {times[0]:.3f} ms, unpipelined {times[1]:.3f} ms"
        + _timing_note(mesh))
    return _emit(args, mesh, _result(args, mesh, plan, seed, err, collectives, times))


def parse_args(argv=None):
    """`shardfuse demo`'s options, checked (a mistake exits 2 with one line)."""
    p = argparse.ArgumentParser(prog="shardfuse demo", description=DESCRIPTION)
    p.add_argument("--devices", type=int, default=None, help="mesh size (default: all GPUs, else 4 CPU devices; "
                   "under mpiexec, one per process)")
    p.add_argument("--backend", choices=["numpy", "cupy"], default=None)
    p.add_argument("--chunks", type=int, default=8, help="S: chunks along the stream axis")
    p.add_argument("--m", type=int, default=None, help="M, all of A's rows (with --mlp: tokens; --layer: tokens, batch 2 x seq), as in shardfuse "
                   "bench and simulate: a multiple of chunks x devices (default 64 x chunks x devices)")
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    p.add_argument("--mlp", choices=["tp", "sp"], default=None,
                   help="run the tensor-parallel MLP block instead (tp: x replicated; sp: sequence parallel)")
    p.add_argument("--layer", choices=["tp", "sp", "dp"], default=None,
                   help="run sf.nn.transformer_layer instead (tp; sp: sequence parallel; dp: a 2 x D/2 dp x tp mesh "
                   "with sp), checked against its float64 NumPy reference")
    p.add_argument("--train", action="store_true", help="a 2-layer GPT: its float64 gradients against central "
                   "differences, then --steps Adam steps in one jitted step with donated parameters")
    p.add_argument("--hidden", type=int, default=64, help="hidden size h (MLP: h -> 4h -> h; --layer, --train)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (--layer, --train)")
    p.add_argument("--steps", type=int, default=5, help="Adam steps (--train)")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (--train)")
    p.add_argument("--json", action="store_true", help="print one JSON object (plan, collectives, seed, times, "
                   "error, passed, backend, devices) instead of the text")
    args = p.parse_args(argv)
    for name in ("devices", "chunks", "m", "k", "n", "streams", "repeat", "hidden", "heads", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be a positive int, got {value}")
    if sum((args.mlp is not None, args.layer is not None, args.train)) > 1:
        p.error("--mlp, --layer and --train each choose a demo: give one of them")
    if (args.layer or args.train) and args.json:
        p.error("--json is for the seed and --mlp demos (--layer and --train print text)")
    if args.train and args.m is not None:
        p.error("--train sizes its token task itself (vocabulary 8 x tp, a sequence of 16 or more tokens): drop --m")
    if args.train and args.dtype == "float16":
        p.error("--train trains in float32, bfloat16 or float64: float16's range needs loss scaling (Adam's second "
                "moment and eps underflow to 0), which --train does not do")
    if not args.lr > 0:
        p.error(f"--lr must be a positive float, got {args.lr}")
    return args


def run(args) -> int:
    """The seed demo, or with --mlp the MLP block's (demo_model.main runs --layer and --train)."""
    return mlp_demo(args) if args.mlp else seed_demo(args)
