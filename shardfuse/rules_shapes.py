"""Sharding rules of the shape ops (slice_array, concatenate, reshape) and of the scan (cumsum
of the last axis), registered in rules.RULES, the one rule table; the same three questions as
every entry there (infer, require, axis_map).

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
from shardfuse.layout import Layout, mesh_axes, unshard


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


def _cut_rule(cut, linear=True):
    """The rule of an op whose axes cut(ins) must be whole (gathered where sharded), the others kept
    as they are, pending sums flowing through where linear: slice_array's and cumsum's; argsort's and
    permute's reduce them first (an order is no sum of orders), their operands laid out alike."""
    def infer(ins, lays):
        la = lays[0]
        return Layout(_whole(la.axes, cut(ins), set()), la.partial if linear else ())

    def require(ins, out, lays):
        pending = set(lays[0].partial) if linear else set()
        axes = _whole(out.axes, cut(ins), pending, axis_of(ins))
        return tuple(Layout(_chunked(ins, axes), lay.partial if linear else ()) for lay in lays), \
            _produced(out, axes, pending)

    def axis_map(ins, j):
        return tuple(None if j in cut(ins) else j for _ in ins.ins)
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


# ---- reshape: a view, allowed where it does not cross a sharded axis boundary --------------

def reshape_groups(old, new):
    """Pairs (old axes, new axes) of runs whose extents multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj = [i] if i < len(old) else [], [j] if j < len(new) else []
        po = old[i] if i < len(old) else 1
        pn = new[j] if j < len(new) else 1
        i, j = i + bool(gi), j + bool(gj)
        while po != pn:
            if po < pn:
                gi.append(i)
                po *= old[i]
                i += 1
            else:
                gj.append(j)
                pn *= new[j]
                j += 1
        while i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):  # stray unit axes
            gi.append(i)
            i += 1
        groups.append((gi, gj))
    return groups


def _map_reshape(src_shape, src_axes, dst_shape, mesh_size, forward, gather_cut=False):
    out = [None] * len(dst_shape)
    pairs = reshape_groups(src_shape, dst_shape) if forward else \
        [(b, a) for a, b in reshape_groups(dst_shape, src_shape)]
    for gs, gd in pairs:
        sharded = [(k, src_axes[k]) for k in gs if src_axes[k] is not None]
        if not sharded:
            continue
        k, m = sharded[0]
        lead = next((k2 for k2 in gs if src_shape[k2] != 1), k)
        dst_lead = next((d for d in gd if dst_shape[d] != 1), gd[0] if gd else None)
        if len(sharded) > 1 or k != lead or dst_lead is None or dst_shape[dst_lead] % _count(m, mesh_size):
            if gather_cut:  # the group's result is whole: reshape_require then asks for its input gathered
                continue
            raise ValueError(f"reshape {tuple(src_shape)} -> {tuple(dst_shape)} crosses the boundary of axis {k}, "
                             f"sharded over {m}: only the outermost axis of a merged or split group may be sharded")
        out[dst_lead] = m
    return out


def _mesh_size(lay):
    """Mesh axis name -> its size on the mesh the value lives on (infer and require give every
    layout its mesh)."""
    return lay.mesh.axis_size


def _count(entry, mesh_size) -> int:
    n = 1
    for name in mesh_axes(entry):
        n *= mesh_size(name)
    return n


def reshape_infer(ins, lays):
    (la,) = lays
    src, dst = ins.ins[0].type.shape, ins.outs[0].type.shape
    try:
        return Layout(tuple(_map_reshape(src, la.axes, dst, _mesh_size(la), True)), la.partial)
    except ValueError:  # a sharded axis the reshape cuts across is gathered first (as reshape_require's
        if axis_of(ins) is not None:  # fallback; the README's rule), the other axes keep theirs, pending sums
            raise  # flow on (a reshape is linear); a stream split keeps the refusal, as there
        return Layout(tuple(_map_reshape(src, la.axes, dst, _mesh_size(la), True, gather_cut=True)), la.partial)


def reshape_require(ins, out, lays):
    src, dst = ins.ins[0].type.shape, ins.outs[0].type.shape
    out_axes = unshard(out.axes, set(lays[0].partial), axis_of(ins))
    try:
        axes = _map_reshape(dst, _chunked(ins, out_axes), src, _mesh_size(out), False)
    except ValueError:  # no sharding of the input gives this result's: the input whole (gathered where it is
        if axis_of(ins) is not None:  # sharded: printed), reshaped, the result sliced locally (R -> S); its
            raise  # pending sums kept (a gradient's, a review: refused); a stream split keeps the refusal
        whole = Layout((None,) * len(src), lays[0].partial, out.mesh, lays[0].partial_op)
        return (whole,), reshape_infer(ins, [whole])
    return (Layout(tuple(axes), lays[0].partial),), _produced(out, tuple(out_axes), set(lays[0].partial))


def reshape_axis_map(ins, j):
    for gs, gd in reshape_groups(ins.ins[0].type.shape, ins.outs[0].type.shape):
        if gd == [j] and len(gs) == 1:
            return (gs[0],)
    return (None,)


SLICE = _cut_rule(sliced_axes)
SCAN = _cut_rule(scanned_axes)
ORDER = _cut_rule(scanned_axes, linear=False)
CONCAT = dict(infer=concat_infer, require=concat_require, axis_map=concat_axis_map)
RESHAPE = dict(infer=reshape_infer, require=reshape_require, axis_map=reshape_axis_map)
