"""sf.from_local: an sf.Array made SPMD-style, each process passing its own piece of the global
value (JAX's make_array_from_process_local_data, DTensor's DTensor.from_local), cut on one or
several tensor axes (a per-rank checkpoint of a weight sharded on two axes)."""
from __future__ import annotations

import math

from shardfuse import faults
from shardfuse.fault_messages import CHECK_ENV, input_prints, ranks_text
from shardfuse.array import Array, check_mesh
from shardfuse.interop import array_info, check_input, host_view
from shardfuse.layout import Layout, layout_of, mesh_axes
from shardfuse.pieces import local_indices
from shardfuse.mesh import DeviceMesh
from shardfuse.placements import Partial
from shardfuse.runtime import backend_of
from shardfuse.spec import check_divides, normalize_axis, normalize_over


def from_local(local_piece, axis=None, over=None, mesh=None, placements=None, *, device_mesh=None):
    """SPMD construction (JAX's make_array_from_process_local_data, DTensor's from_local): each
    process passes its own piece of the global array.  Where it is cut: `axis` over mesh axis
    `over` (default the last); a tuple of axes, each over its own entry of `over`
    (``axis=(0, 1), over=("dp", "tp")``; an entry may itself be a tuple of mesh axes, the first
    outermost); or `placements=`, one sf.Shard(dim) / sf.Replicate() per mesh axis or a JAX-style
    spec per tensor axis, as sf.distribute takes them (DTensor's ``sf.from_local(t, mesh,
    [sf.Shard(0), sf.Shard(1)])`` too).  Along each sharded axis the piece holds, in order, the
    blocks that the process' devices hold (on a dp x tp mesh with over="dp", one rank's batch;
    processes holding the same blocks pass the same data), and each device takes its own: the
    value is sharded so and replicated over the other mesh axes.  A device array stays on the
    device (zero-copy views where it can)."""
    if device_mesh is not None:  # (DTensor's keyword)
        if mesh is not None:
            raise TypeError("sf.from_local: mesh= and device_mesh= given both")
        mesh = device_mesh
    if isinstance(axis, DeviceMesh):  # DTensor's order: from_local(local_tensor, device_mesh, placements)
        if mesh is not None or placements is not None:
            raise TypeError("sf.from_local(piece, mesh, placements): mesh and placements given twice")
        axis, over, mesh, placements = None, None, axis, over
    if mesh is None:
        raise ValueError("sf.from_local needs mesh=")
    check_mesh(mesh, "sf.from_local")
    info = array_info(local_piece)
    check_input(info, backend_of(mesh), "sf.from_local")
    layout = _local_layout(axis, over, placements, info.shape, mesh)
    sh = layout.sharding(mesh)
    axes = [i for i, d in enumerate(sh.dims) if d]
    blocks = [tuple(sh.block(i, d) for i in axes) for d in mesh.local_devices]  # each local device's, per sharded axis
    held = [sorted({b[j] for b in blocks}) for j in range(len(axes))]
    counts = tuple(len(h) for h in held)
    box = len(set(blocks)) == math.prod(counts)  # (the blocks of this process' devices: all of a box of them)
    if mesh.nprocs > 1:  # every rank's piece, layout and count of blocks must agree: else each builds another
        # array (a mesh axis that process boundaries cut unevenly gives ranks different counts)
        seen = faults.allgather_object((info.shape, info.dtype, layout.axes, counts, box), "sf.from_local")
        if len(set(seen)) != 1:  # (the same message on every rank: from what all of them sent)
            along = ", ".join(repr(n) for a in seen[0][2] for n in mesh_axes(a))
            raise ValueError("sf.from_local: processes passed pieces of different shapes/dtypes or different axis=/over=, "
                             f"or hold different numbers of positions along {along}: " + ", ".join(
                                 f"rank {r}: {s} {d} {_cut(a)} positions={n[0] if len(n) == 1 else n}"
                                 + ("" if b else " (not a box)") for r, (s, d, a, n, b) in enumerate(seen)))
    if not blocks:
        raise ValueError(f"sf.from_local: this process holds no device of {mesh}")
    if not box:
        raise ValueError(f"sf.from_local: this process' devices {mesh.local_devices} hold blocks "
                         f"{sorted(set(blocks))} of axes {axes}, not a box of them: its part of the value is no one "
                         "array; use sf.distribute on the global value, or a layout whose blocks each process holds "
                         "as a box")
    size = {}
    for j, i in enumerate(axes):
        if info.shape[i] % counts[j]:
            along = f"mesh axis {sh.dims[i][0]!r}" if len(sh.dims[i]) == 1 else f"mesh axes {sh.dims[i]}"
            raise ValueError(f"sf.from_local: local piece axis {i} of extent {info.shape[i]} cannot be cut into the "
                             f"{counts[j]} block(s) of this process' positions {held[j]} along {along}")
        size[i] = info.shape[i] // counts[j]
    shape = tuple(size[i] * sh.count(i) if i in size else n for i, n in enumerate(info.shape))
    be = backend_of(mesh)
    x = be.adopt(local_piece, info)
    views = []
    for b in blocks:
        idx = [slice(None)] * len(shape)
        for k, i in enumerate(axes):
            p = held[k].index(b[k])
            idx[i] = slice(p * size[i], (p + 1) * size[i])
        views.append(x[tuple(idx)])
    if mesh.nprocs > 1 and faults.checking_inputs() and info.device is None:  # (device arrays: not read)
        _same_replicas(blocks, views, info)
    return Array(mesh, shape, info.dtype, layout, [be.piece(v, j) for j, v in enumerate(views)], True)


def _same_replicas(blocks, views, info) -> None:
    """Processes holding the same block (replicas: ranks along a mesh axis the value is not cut
    over) passed the same data, compared on a sample of each block's elements as a call compares its
    arguments (fault_messages.input_prints; with SHARDFUSE_CHECK_INPUTS=0 or device arrays, not
    compared, and nothing communicated for it).  Replicas holding different data would each compute with their own (a probe: each
    rank drew its own batch, seeded by rank, and the replicated loss differed between ranks)."""
    prints = dict(input_prints(blocks, views, [info] * len(views), host_view))
    seen = faults.allgather_object(prints, "sf.from_local's check of replicated blocks")
    for b in sorted({b for mine in seen for b in mine}):
        groups: dict = {}
        for r, mine in enumerate(seen):
            if mine.get(b):
                groups.setdefault(mine[b], []).append(r)
        if len(groups) > 1:
            held = "; ".join(f"rank(s) {ranks_text(rs)} one" if n == 0 else f"rank(s) {ranks_text(rs)} another"
                             for n, rs in enumerate(groups.values()))
            raise ValueError(
                f"sf.from_local: processes holding the same block {b} of the value passed different data for it "
                f"({held}).  The value is replicated over the mesh axes it is not cut over, so the processes along "
                "them must pass the same piece: seed a data loader by the process' position along the cut axis "
                "(mesh.coords(mesh.local_devices[0])[mesh.axis_index('dp')]), not by its rank.  (Checked on a "
                f"sample of each block's elements; {CHECK_ENV}=0 turns the check off.)")


def _cut(axes: tuple) -> str:
    """A layout's sharded axes as from_local's arguments state them: axis=0 over='dp'."""
    cut = [(i, a) for i, a in enumerate(axes) if a is not None]
    if len(cut) == 1:
        return f"axis={cut[0][0]} over={cut[0][1]!r}"
    return f"axis={tuple(i for i, _ in cut)} over={tuple(a for _, a in cut)}"


def _local_layout(axis, over, placements, shape, mesh) -> Layout:
    """The layout sf.from_local's arguments state: axis= and over=, or placements=."""
    if placements is not None:
        if axis is not None or over is not None:
            raise TypeError("sf.from_local: give placements= or axis= (with over=), not both")
        if isinstance(placements, (tuple, list)) and any(isinstance(p, Partial) for p in placements):
            raise ValueError("sf.from_local: Partial() placements (pieces that are partial sums) are not supported: "
                             "stack the partial sums on a new leading axis sharded over that mesh axis and sum it "
                             "(where each process holds one position along it: sf.from_local(piece[None], axis=0, "
                             "over=<mesh axis>, mesh=mesh).sum(0), an all-reduce), or sum them before placing them")
        return layout_of(placements, len(shape), mesh)
    if axis is None:
        raise TypeError("sf.from_local needs axis= (and over=), or placements=")
    several = isinstance(axis, (tuple, list))
    if several and not (isinstance(over, (tuple, list)) and len(over) == len(axis)):
        raise TypeError(f"sf.from_local(axis={axis!r}): over= must name mesh axes for each of those axes (a tuple "
                        f"of {len(axis)} entries, each a mesh axis name or a tuple of them), got {over!r}")
    pairs = zip(axis, over) if several else [(axis, over)]
    axes = [(normalize_axis(a, len(shape), shape), normalize_over(o, mesh)) for a, o in pairs]
    if len({a for a, _ in axes}) != len(axes):
        raise ValueError(f"sf.from_local: axis={axis!r} names a tensor axis twice")
    used = [n for _, entry in axes for n in mesh_axes(entry)]
    if len(used) != len(set(used)):
        raise ValueError(f"sf.from_local(over={over!r}): a mesh axis shards at most one tensor axis")
    layout = Layout.replicated(len(shape))
    for a, entry in axes:
        layout = layout.with_axis(a, entry)
    return layout


def make_array_from_single_device_arrays(shape, sharding, arrays, mesh=None):
    """jax.make_array_from_single_device_arrays: an sf.Array of global `shape` from this process'
    pieces, one per local device that holds one, in the order of `x.addressable_shards` (whose
    `.data` they may be): what takes a per-rank checkpoint back where to_local() refuses (a bias
    sharded over (tp, dp) whose pieces on one process tile no box).  `sharding`: an sf.Array's
    `.sharding` (a Layout), or placements / a spec as sf.distribute takes them; `mesh`: where the
    Layout names none (the whole mesh).  Each piece's shape and dtype are checked against its box."""
    mesh = mesh if mesh is not None else getattr(sharding, "mesh", None)
    if mesh is None:
        raise ValueError("sf.make_array_from_single_device_arrays needs mesh= (the Layout names none)")
    check_mesh(mesh, "sf.make_array_from_single_device_arrays")
    shape = tuple(int(n) for n in shape)
    layout = sharding if isinstance(sharding, Layout) else layout_of(sharding, len(shape), mesh)
    for a, over in layout.sharded_axes().items():
        check_divides(shape, a, over, mesh)
    indices = local_indices(shape, layout, mesh)
    if any(idx is None for idx in indices):
        raise ValueError(f"sf.make_array_from_single_device_arrays: {layout} lives on a sub-mesh; place the value on "
                         f"the whole mesh {mesh} and move it inside sf.jit (sf.to_mesh)")
    arrays = list(arrays)
    if len(arrays) != len(indices):
        raise ValueError(f"sf.make_array_from_single_device_arrays: this process' {len(indices)} devices "
                         f"{list(mesh.local_devices)} each hold a piece; {len(arrays)} arrays were given")
    be, parts, dtype = backend_of(mesh), [], None
    for j, (idx, a) in enumerate(zip(indices, arrays)):
        info = array_info(a)
        check_input(info, be, "sf.make_array_from_single_device_arrays")
        box = tuple(s.stop - s.start for s in idx)
        if tuple(info.shape) != box or dtype not in (None, info.dtype):
            raise ValueError(f"sf.make_array_from_single_device_arrays: the piece for device {mesh.local_devices[j]} "
                             f"is {info.dtype}{list(info.shape)}; its box of {shape} is {list(box)}"
                             + (f" of {dtype}" if dtype else ""))
        dtype = info.dtype
        parts.append(be.piece(be.adopt(a, info), j).reshape(box))  # (a 0-d piece stays 0-d: contiguous copies are 1-d)
    return Array(mesh, shape, dtype, layout, parts, True)
