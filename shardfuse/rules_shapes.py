"""Sharding rules of the shape ops (slice_array, concatenate) and of the scan (cumsum of the last
axis), registered in rules.RULES, the one rule table; the same three questions as every entry
there (infer, require, axis_map).

A sliced axis, the axis of a concatenation and the axis a cumsum runs along must be whole on
every device: the box starts at a global index, the pieces of a concatenation land at global
offsets, and a running sum carries over from the shards before.  Every other axis keeps its
sharding, so `x[..., 0:H]` of row-sharded x is local, and `x[:, 0:H]` of column-sharded x gathers
the columns first (the Allgather a `set` before the op lowers to, printed in the plan).  The
three ops are linear: pending sums flow through them (a concatenation's only where every input
pends the same ones), and are reduced where a consumer needs them whole.
"""
from __future__ import annotations

from shardfuse.schedule import axis_of
from shardfuse.layout import Layout, mesh_axes


def sliced_axes(ins) -> set:
    """The axes a slice_array cuts (a box that does not cover the whole axis)."""
    x, y = ins.ins[0].type.shape, ins.outs[0].type.shape
    return {a for a, (b, n, m) in enumerate(zip(ins.attrs["begin"], x, y)) if b or n != m}


def _whole(axes, cut, pending, stream=None):
    """axes with the cut ones replicated, and none over a mesh axis that pends a sum (such a
    mesh axis cannot also shard); an uncut stream axis keeps its own entry."""
    return tuple(None if j in cut else a if j == stream or not set(mesh_axes(a)) & pending else None
                 for j, a in enumerate(axes))


def _produced(out, axes, pending):
    return Layout(axes, tuple(sorted(set(out.partial) | pending)))


def _chunked(ins, axes):
    """What the inputs must hold: the stream axis of the op's schedule is made chunk by chunk
    (rules._chunked)."""
    return tuple(None if j == axis_of(ins) else a for j, a in enumerate(axes))


def scanned_axes(ins) -> set:
    """The axis a cumsum runs along: its last."""
    return {ins.outs[0].type.ndim - 1}


def _cut_rule(cut):
    """The rule of a unary op whose axes cut(ins) must be whole (gathered where sharded), the others
    kept as they are, pending sums flowing through: slice_array's and cumsum's."""
    def infer(ins, lays):
        (la,) = lays
        return Layout(_whole(la.axes, cut(ins), set()), la.partial)

    def require(ins, out, lays):
        pending = set(lays[0].partial)
        axes = _whole(out.axes, cut(ins), pending, axis_of(ins))
        return (Layout(_chunked(ins, axes), lays[0].partial),), _produced(out, axes, pending)

    def axis_map(ins, j):
        return (None if j in cut(ins) else j,)
    return dict(infer=infer, require=require, axis_map=axis_map)


def _concat_pending(lays) -> tuple:
    """Pending sums that flow through a concatenation: only those every input pends alike."""
    parts = {tuple(lay.partial) for lay in lays}
    return parts.pop() if len(parts) == 1 else ()


def concat_infer(ins, lays):
    axis, axes, used = ins.attrs["axis"], [], set()
    for j in range(ins.outs[0].type.ndim):
        pick = next((lay.axes[j] for lay in lays if j != axis and lay.axes[j] is not None
                     and not set(mesh_axes(lay.axes[j])) & used), None)
        axes.append(pick)
        used |= set(mesh_axes(pick))
    pending = _concat_pending(lays)
    return Layout(_whole(axes, set(), set(pending)), pending)


def concat_require(ins, out, lays):
    pending = _concat_pending(lays)
    axes = _whole(out.axes, {ins.attrs["axis"]}, set(pending), axis_of(ins))
    return tuple(Layout(_chunked(ins, axes), pending) for _ in lays), _produced(out, axes, set(pending))


def concat_axis_map(ins, j):
    return (None if j == ins.attrs["axis"] else j,) * len(ins.ins)


SLICE = _cut_rule(sliced_axes)
SCAN = _cut_rule(scanned_axes)
CONCAT = dict(infer=concat_infer, require=concat_require, axis_map=concat_axis_map)
