"""The sharding rules of take (an embedding lookup) and of scatter_add (its transpose, the
embedding's gradient), entries of rules.RULES.

take(table, ids, rows) -> out[*ids.shape, *table.shape[1:]]: row ids[...] of the table.  `rows` is
np.arange(vocabulary) (a constant the tracer adds), laid out as the table's axis 0, so each device
knows which rows it holds without a per-device attribute.  The table's other axes and the ids'
axes map to the output's.  A table sharded over the vocabulary (axis 0) is Megatron's
vocab-parallel embedding: each device looks the ids up in its own rows and writes zeros for the
others, so the output is a pending sum over those mesh axes, made whole by one Allreduce (or a
ReduceScatter where the output is sharded) -- never a gather of the table.

scatter_add(values, ids, rows) -> out[vocab, *values.shape[ids.ndim:]]: each position's values
added into row ids[...].  `rows` is laid out as the output's axis 0.  Each device scatters the
positions it holds: values' position axes sharded (data or sequence parallel) make the output a
pending sum over those mesh axes, resolved as any (an Allreduce, or a ReduceScatter into a
sharded gradient).  An output sharded over the vocabulary (the table's gradient where the table
is vocab-parallel) has each device scatter only the ids in its own rows, with no communication for
that axis; the positions are then gathered over those mesh axes first (the gradient's sharding
wins: Megatron's sequence-parallel embedding gathers its output's gradient the same way).  The
values' own pending sums are made whole first: they are a positions-sized value, the output a
vocabulary-sized one.
"""
from __future__ import annotations

from shardfuse.schedule import axis_of
from shardfuse.layout import Layout, axis_entry, mesh_axes


def _pending(lay, out_mesh) -> tuple:
    """The mesh axes the table's vocabulary axis is sharded over (none where the table moves to
    another mesh: it arrives whole there)."""
    return mesh_axes(lay.axes[0]) if lay.mesh == out_mesh else ()


def _free(axes, taken, stream=None):
    """axes with every entry that names a mesh axis in `taken` made replicated (the stream axis kept)."""
    return [a if j == stream or not set(mesh_axes(a)) & set(taken) else None for j, a in enumerate(axes)]


def take_axis_map(ins, j):
    """(table axis, ids axis, rows axis) that output axis j comes from."""
    nid = ins.ins[1].type.ndim
    return (None, j, None) if j < nid else (j - nid + 1, None, None)


def take_infer(ins, lays):
    table, ids, _ = lays
    pending = mesh_axes(table.axes[0])
    axes, used = [], set(pending)
    for a in tuple(ids.axes) + tuple(table.axes[1:]):  # (the ids' sharding first: tokens stay where they are)
        names = set(mesh_axes(a))
        axes.append(a if a is not None and not names & used else None)
        used |= names if axes[-1] is not None else set()
    return Layout(tuple(axes), tuple(pending))


def take_require(ins, out, lays):
    table = lays[0]
    pending = _pending(table, out.mesh)
    nid = ins.ins[1].type.ndim
    out_axes = _free(out.axes, pending, axis_of(ins))
    asked = [None if j == axis_of(ins) else a for j, a in enumerate(out_axes)]  # (chunks of the stream axis)
    vocab = table.axes[0] if pending else None
    req = (Layout((vocab,) + tuple(asked[nid:])), Layout(tuple(asked[:nid])), Layout((vocab,)))
    partial = tuple(sorted(set(out.partial) | set(pending)))
    return req, Layout(tuple(out_axes), partial)


TAKE = dict(infer=take_infer, require=take_require, axis_map=take_axis_map)


def _names(entries) -> set:
    return {n for a in entries for n in mesh_axes(a)}


def _positions(axes, used) -> tuple:
    """The positions' axes with the mesh axes in `used` taken out (those positions are gathered)."""
    return tuple(axis_entry(n for n in mesh_axes(a) if n not in used) for a in axes)


def scatter_axis_map(ins, j):
    """(values axis, ids axis, rows axis) that output axis j comes from."""
    return (None, None, 0) if j == 0 else (ins.ins[1].type.ndim + j - 1, None, None)


def scatter_infer(ins, lays):
    values, _, rows = lays
    nid = ins.ins[1].type.ndim
    axes, used = [rows.axes[0]], set(mesh_axes(rows.axes[0]))
    for a in values.axes[nid:]:
        names = set(mesh_axes(a))
        axes.append(a if a is not None and not names & used else None)
        used |= names if axes[-1] is not None else set()
    return Layout(tuple(axes), tuple(sorted(_names(_positions(values.axes[:nid], used)))))


def scatter_require(ins, out, lays):
    values = lays[0]
    nid = ins.ins[1].type.ndim
    asked = [None if j == axis_of(ins) else a for j, a in enumerate(out.axes)]  # (chunks of the stream axis)
    # positions stay where they are, but for the mesh axes the output uses; arriving from another
    # mesh they come whole
    pos = _positions(values.axes[:nid], _names(out.axes)) if values.mesh == out.mesh else (None,) * nid
    req = (Layout(pos + tuple(asked[1:])), Layout(pos), Layout((asked[0],)))
    return req, Layout(tuple(out.axes), tuple(sorted(_names(pos))))


SCATTER_ADD = dict(infer=scatter_infer, require=scatter_require, axis_map=scatter_axis_map)
