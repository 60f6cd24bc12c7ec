"""The user path's host time split into its parts, each timed alone with no profiler (issue 29,
item 2): what `cupy.from_dlpack(f(sf.shard(a, axis=1, mesh=mesh), b))` of `shardfuse bench
--host` does per call, one internal stage at a time, each the median wall time per call of
`calls` calls back to back.  A profiler inflates small Python functions about 3x; these do not.
On NumPy devices (no GPU) the same parts run eagerly, without the stream fences and the export.

    python benchmarks/user_path_parts.py [D] [S] [--graph/--eager] [--calls 2000] [--rounds 7]
"""
from __future__ import annotations

import argparse

import numpy as np

import shardfuse as sf
from shardfuse.bench import host
from shardfuse.interop import Fence, array_info, stream_identity, stream_ptr
from shardfuse.pieces import global_placement, local_pieces


def parts(mesh, s, graph, torch_arrays=False):
    """{part: a zero-argument callable doing that part once} for the user path at (D, S)."""
    f, a, b = host.seed(mesh, s, graph)
    gpu = mesh.backend_name == "cupy"
    if torch_arrays:
        import torch

        a, b = torch.from_dlpack(a), torch.from_dlpack(b)
    placed = sf.shard(a, axis=1, mesh=mesh)
    args = (placed, b)
    infos, key = f._dispatch_key(args)
    spec, plan = f._first_call(key, args, infos)
    exe = plan.executable
    caller = stream_ptr(None) if gpu else None
    out = plan.run_flat(args, None, infos, checked=True)
    info_a = array_info(a)
    layout, where = global_placement(info_a.shape, mesh, 1, None)
    k_b = 1
    run_parts = {
        "the whole user path": lambda: _export(gpu, torch_arrays)(f(sf.shard(a, axis=1, mesh=mesh), b)),
        # (pairs: what a part costs when its input is made fresh each call, as on the user path)
        "sf.shard(a) then f": lambda: f(sf.shard(a, axis=1, mesh=mesh), b),
        "f(placed, b) then export": lambda: _export(gpu, torch_arrays)(f(placed, b)),
        "sf.shard(a)": lambda: sf.shard(a, axis=1, mesh=mesh),
        "  array_info(a)": lambda: array_info(a),
        "  global_placement (memo)": lambda: global_placement(info_a.shape, mesh, 1, None),
        "  local_pieces(a)": lambda: local_pieces(a, info_a.dtype, layout, mesh, info_a, where=where),
        "f(placed, b)": lambda: f(placed, b),
        "  _dispatch_key": lambda: f._dispatch_key(args),
        "  plan.run_flat": lambda: plan.run_flat(args, None, infos, checked=True),
        "    exe.call_checked": lambda: exe.call_checked(args, infos, None),
        "      exe.run": lambda: exe.run(args, infos, caller),
        "        local_pieces(b)": lambda: local_pieces(b, infos[k_b].dtype, plan.program.inputs[k_b].type.layout,
                                                        mesh, infos[k_b], fenced=caller,
                                                        where=exe._input_pieces[k_b]),
    }
    if gpu:
        be = exe.backend
        import cupy

        d = mesh.size
        blocks = a.reshape(a.shape[:1] + (d, a.shape[1] // d) + a.shape[2:])
        outer = blocks.transpose((1, 0) + tuple(range(2, blocks.ndim)))
        run_parts.update({
            "    a.reshape + transpose": lambda: a.reshape(blocks.shape).transpose((1, 0) + tuple(range(2, blocks.ndim))),
            "    be.piece(outer, 0)": lambda: be.piece(outer, 0),
            "      cupy.empty(outer.shape)": lambda: cupy.empty(outer.shape, outer.dtype),
            "      with Device(0), main": lambda: _entered(cupy.cuda.Device(0), be.dev.main_of[0]),
            "      stream_ptr(None)": lambda: stream_ptr(None),
            "      fence_in + fence_out": lambda: (be.fence_in(caller), be.fence_out(caller)),
            "      Fence(...)": lambda: Fence(stream_identity(caller), exe.calls, exe.graph and exe),
            "export": lambda: _export(gpu, torch_arrays)(out),
            "  out.__dlpack__(stream=)": lambda: out.__dlpack__(stream=caller or 1, max_version=(1, 0)),
            "  cupy.from_dlpack(piece)": lambda: cupy.from_dlpack(out.shards[0]),
        })
        if graph:
            bufs = [placed.shards, run_parts["        local_pieces(b)"]()] + list(exe.slot_templates[2:])
            run_parts["        graph(bufs)"] = lambda: exe.graph(bufs)
    return run_parts


def _entered(device, stream):
    with device, stream:
        pass


def _export(gpu, torch_arrays):
    if not gpu:
        return lambda x: x
    if torch_arrays:
        import torch

        return torch.from_dlpack
    import cupy

    return cupy.from_dlpack


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("d", nargs="?", type=int, default=1)
    ap.add_argument("s", nargs="?", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="eager (graph mode is the default on GPUs)")
    ap.add_argument("--numpy", action="store_true", help="NumPy devices (no GPU): the generic parts")
    ap.add_argument("--torch", action="store_true", help="torch tensors in and out")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    backend = "numpy" if args.numpy else "cupy"
    mesh = sf.DeviceMesh(args.d, backend=backend)
    graph = backend == "cupy" and not args.eager
    sync = host.sync_of(backend)
    print(f"user path parts, {backend} D={args.d} S={args.s} graph={graph} torch={args.torch}: us per call, "
          f"median of {args.rounds} x {args.calls} calls")
    for name, fn in parts(mesh, args.s, graph, args.torch).items():
        print(f"  {name:36s} {host.per_call_us(fn, sync, args.calls, args.rounds):8.2f}", flush=True)
    print({k: round(v, 2) for k, v in host.baselines(backend, sync, 200, args.rounds).items()})


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
