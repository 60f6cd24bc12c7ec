"""Per-op sharding behaviour, one table entry per op (JAX-style rule tables).

Each rule answers three questions about an array-level instruction:
  infer(ins, in_layouts)            -> the output layout when nothing is annotated (propagation)
  require(ins, out_layout, in_lay)  -> (layouts the inputs must have, layout the op produces)
                                       (produced differs from out_layout only by pending sums,
                                       which a `set` after the op resolves)
  axis_map(ins, out_axis)           -> for each input, the axis that maps to out_axis, or None
"""
from __future__ import annotations

from shardfuse.layout import Layout
from shardfuse.mesh import STREAM


def _placed(a):
    return None if a == STREAM else a


# ---- matmul: a[..., M, K] @ b[K, N] or b[..., K, N] ---------------------------------------

def _mm_dims(ins):
    a, b = ins.ins
    na, nb = a.type.ndim, b.type.ndim
    return na, nb, na  # output ndim equals a's


def matmul_axis_map(ins, j):
    na, nb, no = _mm_dims(ins)
    if j < no - 2:
        return (j, j if nb == na else None)
    if j == no - 2:
        return (na - 2, None)
    return (None, nb - 1)


def matmul_infer(ins, lays):
    la, lb = lays
    na, nb, no = _mm_dims(ins)
    axes = [_placed(la.axes[j]) for j in range(no - 1)] + [_placed(lb.axes[nb - 1])]
    if nb == na:  # batched b: a replicated batch axis takes b's sharding
        for j in range(no - 2):
            axes[j] = axes[j] or _placed(lb.axes[j])
    # One mesh axis can shard only one output axis: keep the weight's (b's) choice, as nvFuser does.
    n_axis = axes[-1]
    if n_axis is not None:
        axes = [None if (a == n_axis and j != no - 1) else a for j, a in enumerate(axes)]
    k = _placed(la.axes[na - 1]) or _placed(lb.axes[nb - 2])
    partial = (k,) if k is not None and k not in axes else ()
    return Layout(tuple(axes), partial)


def _keep_contraction_local(k, out):
    """Placement a contracting op produces when its contraction axis is sharded over k:
    local partial sums (resolved by a `set` after the op), never a reshard of the inputs'
    other axes.  Returns (output axes without k, produced layout)."""
    axes = [None if a == k else a for a in out.axes] if k is not None else list(out.axes)
    partial = tuple(sorted(set(out.partial) | ({k} if k else set())))
    return [_placed(a) for a in axes], Layout(tuple(axes), partial, out.chunks)


def matmul_require(ins, out, lays):
    la, lb = lays
    na, nb, no = _mm_dims(ins)
    k = _placed(la.axes[na - 1]) or _placed(lb.axes[nb - 2])
    placed, produced = _keep_contraction_local(k, out)
    a_axes = placed[:no - 1] + [k]
    b_axes = (placed[:no - 2] if nb == na else []) + [k, placed[-1]]
    return (Layout(tuple(a_axes)), Layout(tuple(b_axes))), produced


# ---- elementwise: same shapes ------------------------------------------------------------

def elementwise_axis_map(ins, j):
    return (j, j)


def elementwise_infer(ins, lays):
    la, lb = lays
    axes = []
    for x, y in zip(la.axes, lb.axes):
        x, y = _placed(x), _placed(y)
        axes.append(x if x is not None else (y if y not in axes else None))
    return Layout(tuple(axes))


def elementwise_require(ins, out, lays):
    req = Layout(out.placement().axes)
    return (req, req), Layout(out.axes, (), out.chunks)


# ---- sum over one axis -------------------------------------------------------------------

def sum_axis_map(ins, j):
    ax = ins.attrs["axis"]
    return (j if j < ax else j + 1,)


def sum_infer(ins, lays):
    (la,) = lays
    ax = ins.attrs["axis"]
    axes = [_placed(a) for i, a in enumerate(la.axes) if i != ax]
    k = _placed(la.axes[ax])
    return Layout(tuple(axes), tuple(sorted(set(la.partial) | ({k} if k else set()))))


def sum_require(ins, out, lays):
    (la,) = lays
    ax = ins.attrs["axis"]
    k = _placed(la.axes[ax])
    placed, produced = _keep_contraction_local(k, out)
    return (Layout(tuple(placed[:ax] + [k] + placed[ax:])),), produced


# ---- set and view: layouts are given, nothing is required of the input ---------------------

def identity_axis_map(ins, j):
    return (j,)


def _given(ins, lays):
    return ins.outs[0].type.layout


def _as_is(ins, out, lays):
    return tuple(lays), out


RULES = {
    "matmul": dict(infer=matmul_infer, require=matmul_require, axis_map=matmul_axis_map),
    "add": dict(infer=elementwise_infer, require=elementwise_require, axis_map=elementwise_axis_map),
    "mul": dict(infer=elementwise_infer, require=elementwise_require, axis_map=elementwise_axis_map),
    "sum": dict(infer=sum_infer, require=sum_require, axis_map=sum_axis_map),
    "set": dict(infer=_given, require=_as_is, axis_map=identity_axis_map),
    "view": dict(infer=_given, require=_as_is, axis_map=None),
}


def rule(op: str, what: str):
    return RULES[op][what]
