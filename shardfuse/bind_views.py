"""The executor's binder of views (entries of executor.BIND for ops.VIEWS): a view instruction binds
to no step, only to a Ref of its source's slot (the same buffers, other offsets, shape or strides):
a pool's entry, a transpose, a box, a chunk, a device's shard, a reshape that needs no copy."""
from __future__ import annotations

from dataclasses import replace

from shardfuse.strides import reshape_strides
from shardfuse.ir import local_shape
from shardfuse.ops import Op
from shardfuse.steps import index_of, mesh_of


def bind_view(exe, i, env, stream, devices):
    exe.refs[i.outs[0]] = view_ref(i, env, exe.refs[i.ins[0]], exe.mesh, exe.backend.local_devices)
    if i.ins[0] in exe.blocked:  # (a pool's slot)
        exe.blocked[i.outs[0]] = exe.blocked[i.ins[0]]


def view_ref(i, env, src, mesh, local_devices):
    """The Ref of view instruction i's result, of its source's Ref `src` (a tuple of them: a pool)."""
    op, a = i.op, i.attrs
    if op == Op.SELECT:  # an entry of a pool (Executable._bind_allocate)
        return src[index_of(a["index"], env)]
    if op == Op.TRANSPOSE:
        perm = a["perm"]
        return replace(src, shape=tuple(src.shape[p] for p in perm), strides=tuple(src.strides[p] for p in perm))
    out_shape = local_shape(i.outs[0], mesh)
    if op == Op.SLICE_ARRAY:  # the box's axes are whole on every device: its begin is local too
        st = a.get("step", (1,) * len(src.shape))
        offs = sum(b * s for b, s in zip(a["begin"], src.strides))
        return replace(src, offsets=tuple(o + offs for o in src.offsets), shape=out_shape,
                       strides=tuple(s * k for s, k in zip(src.strides, st)))
    if op == Op.SLICE:
        ax, idx = a["axis"], a["index"]  # (a ring's index is (rank - i) % D: each device's rank along it)
        ranks = ranks_along(i.outs[0], idx.ring, local_devices) if idx.ring else [0] * len(local_devices)
        offs = tuple(o + idx.eval(env, r) * out_shape[ax] * src.strides[ax] for o, r in zip(src.offsets, ranks))
        return replace(src, offsets=offs, shape=out_shape)
    if op == Op.SHARD_SLICE:
        ax = a["axis"]
        offs = tuple(o + r * out_shape[ax] * src.strides[ax]
                     for o, r in zip(src.offsets, ranks_along(i.outs[0], a["team"], local_devices)))
        return replace(src, offsets=offs, shape=out_shape)
    strides = reshape_strides(src.shape, src.strides, out_shape)
    if strides is None:
        raise NotImplementedError(f"View {i.outs[0].name}: {src.shape} -> {out_shape} needs a copy")
    return replace(src, shape=out_shape, strides=strides)


def ranks_along(v, team, local_devices):
    """Each local device's position along mesh axis `team` of the mesh v lives on (0 outside it)."""
    mesh = mesh_of(v)
    mi = mesh.axis_index(team)
    return [mesh.coords(d)[mi] if d in mesh.devices else 0 for d in local_devices]
