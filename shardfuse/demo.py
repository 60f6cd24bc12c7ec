"""`shardfuse demo`: the seed's pipelined AllGather+GEMM, checked and timed."""
from __future__ import annotations

import argparse
import time

import numpy as np

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from shardfuse.runtime import backend_of

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


def _seeded_rng(args, mesh):
    """Every process draws the same global inputs (same seed), as a replicated program would;
    the seed is printed, so a run can be repeated with --seed."""
    seed = args.seed if args.seed is not None else int(time.time_ns() % 2**31)
    if mesh.nprocs > 1:
        from mpi4py import MPI

        seed = MPI.COMM_WORLD.bcast(seed)
    if mesh.rank == 0:
        print(f"inputs from seed {seed} (repeat with --seed {seed})")
    return np.random.default_rng(seed)


def _timing_note(mesh) -> str:
    """What the times mean on this mesh: virtual devices share one machine's resources."""
    local = len(mesh.local_devices)
    if local <= 1:
        return ""
    if mesh.backend_name == "numpy":
        return (f" ({local} NumPy devices of one process run one after another, so nothing overlaps and the "
                "pipelined plan only adds steps here; on GPUs chunks overlap)")
    return f" ({local} virtual devices share the GPU(s) of this process)"


def mlp_demo(args):
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    d = args.devices or default_devices(args.backend)
    mesh = sf.DeviceMesh(d, backend=args.backend)
    lead = mesh.rank == 0
    tokens = args.chunks * d * args.m
    inputs = [a.astype(np_dtype(args.dtype)) for a in mlp_inputs(_seeded_rng(args, mesh), tokens, args.hidden)]
    specs = [sf.TensorSpec(a.shape, args.dtype) for a in inputs]
    pipelined = mlp_block(mesh, args.mlp, chunks=args.chunks, streams=args.streams)
    flat = mlp_block(mesh, args.mlp, chunks=1, streams=args.streams)
    plan = pipelined.lower(*specs)
    if lead:
        print(f"{mesh}, MLP block ({args.mlp}), x[{tokens}, {args.hidden}], {args.dtype}\n")
        print(plan, "\n")
    err = relative_error(pipelined(*inputs).gather(), mlp_reference(*inputs))
    ok = err <= TOLERANCE[args.dtype]
    t_pipe = median_ms(lambda: pipelined(*inputs), mesh, args.repeat)
    t_flat = median_ms(lambda: flat(*inputs), mesh, args.repeat)
    if lead:
        print(f"check against the single-device block: relative error {err:.2e} -> {'OK' if ok else 'FAILED'}")
        print(f"collectives per call: chunks={args.chunks} {plan.collectives()}, "
              f"chunks=1 {flat.lower(*specs).collectives()}")
        print(f"time (median of {args.repeat}): pipelined {t_pipe:.3f} ms, one chunk {t_flat:.3f} ms"
              + _timing_note(mesh))
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(prog="shardfuse demo", description=__doc__)
    p.add_argument("--devices", type=int, default=None, help="mesh size (default: all GPUs, else 4 CPU devices; "
                   "under mpiexec, one per process)")
    p.add_argument("--backend", choices=["numpy", "cupy"], default=None)
    p.add_argument("--chunks", type=int, default=8, help="S: chunks along the stream axis")
    p.add_argument("--m", type=int, default=64, help="rows per device per chunk")
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    p.add_argument("--mlp", choices=["tp", "sp"], default=None,
                   help="run the tensor-parallel MLP block instead (tp: x replicated; sp: sequence parallel)")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden size h (the block is h -> 4h -> h)")
    args = p.parse_args(argv)
    for name in ("devices", "chunks", "m", "k", "n", "streams", "repeat", "hidden"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be a positive int, got {value}")
    if args.mlp:
        return mlp_demo(args)

    d = args.devices or default_devices(args.backend)
    mesh = sf.DeviceMesh(d, backend=args.backend)
    lead = mesh.rank == 0
    shape_a, shape_b = (args.chunks, d, args.m, args.k), (args.k, args.n)
    pipelined, unpipelined = seed_functions(mesh, args.streams)
    plan = pipelined.lower(sf.TensorSpec(shape_a, args.dtype), sf.TensorSpec(shape_b, args.dtype))
    if lead:
        print(f"{mesh}, {mesh.nprocs} process(es), a{shape_a} @ b{shape_b} {args.dtype}\n")
        print(plan, "\n")

    rng = _seeded_rng(args, mesh)
    dt = np_dtype(args.dtype)
    a = rng.standard_normal(shape_a).astype(dt)
    b = rng.standard_normal(shape_b).astype(dt)
    ref = a.astype(np.float64) @ b.astype(np.float64)

    a_sharded = sf.shard(a, axis=1, over=mesh.axis_names[-1], mesh=mesh)
    c = pipelined(a_sharded, b)
    err = relative_error(c.gather(), ref)
    ok = err <= TOLERANCE[args.dtype]
    t_pipe = median_ms(lambda: pipelined(a_sharded, b), mesh, args.repeat)
    t_flat = median_ms(lambda: unpipelined(a_sharded, b), mesh, args.repeat)
    if lead:
        print(f"check against the single-device product: relative error {err:.2e} "
              f"(tolerance {TOLERANCE[args.dtype]:.0e}) -> {'OK' if ok else 'FAILED'}")
        print(f"collectives per call: pipelined {plan.collectives()}, "
              f"unpipelined {unpipelined.lower(a_sharded.spec, sf.TensorSpec(shape_b, args.dtype)).collectives()}")
        print(f"time (median of {args.repeat}): pipelined {t_pipe:.3f} ms, unpipelined {t_flat:.3f} ms"
              + _timing_note(mesh))
    return 0 if ok else 1
