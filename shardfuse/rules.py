"""Per-op sharding behaviour, one table entry per op (JAX-style rule tables).

Each rule answers three questions about an array-level instruction:
  infer(ins, in_layouts)            -> the output layout when nothing is annotated (propagation)
  require(ins, out_layout, in_lay)  -> (layouts the inputs must have, layout the op produces)
  axis_map(ins, out_axis)           -> for each input, the axis that maps to out_axis, or None

Contractions (matmul) are driven by an einsum description ("...mk,kn->...mn"), elementwise ops
by NumPy broadcasting.  A contraction over a sharded axis is computed locally and produces
pending sums (Partial); ops that are linear in an input let its pending sums flow through, so
the reduction happens once, on the smallest tensor, where a consumer needs it (not into a
contraction whose output the other operand shards over the same mesh axis, where the input is the
smaller: reduced before it, so the other operand is not gathered).  A produced
layout that differs from the wanted one is resolved by a `set` after the op.
"""
from __future__ import annotations

import math

from shardfuse.layout import Layout, free_axes, mesh_axes, unshard
from shardfuse.ops import Op, Reduce
from shardfuse.schedule import axis_of
from shardfuse.rules_take import SCATTER_ADD, TAKE
from shardfuse.rules_update import UPDATE_SLICE
from shardfuse import ops, rules_shapes

LINEAR_UNARY = {Op.NEG, Op.SCALE, Op.DIV_SCALAR, Op.TRANSPOSE}
NONLINEAR_UNARY = set(ops.NONLINEAR_UNARY)
BINARY = {Op.ADD, Op.SUB, Op.MUL, Op.DIV}


def _chunked(ins, j, a):
    """What an output axis asks of the inputs: the stream axis of the instruction's schedule is
    made chunk by chunk, each chunk whole along it (the axis's own sharding is the schedule's,
    resolved when split_stream splits it)."""
    return None if j == axis_of(ins) else a


def _axes(lay):
    """Where each axis of an input lives (a stream axis that is also sharded counts as sharded)."""
    return lay.axes


def _names(entries) -> set:
    """The mesh axes named by some axis entries (an entry may be a tuple of mesh axes)."""
    return {n for a in entries for n in mesh_axes(a)}


def _union(*parts):
    return tuple(sorted(set().union(*map(set, parts))))


# ---- contractions from einsum subscripts ---------------------------------------------------

def einsum_labels(ins):
    """(labels of each input, labels of the output) for a matmul a[..., m, k] @ b([...,] k, n)."""
    a, b = ins.ins
    batch = tuple(f"b{j}" for j in range(a.type.ndim - 2))
    la = batch + ("m", "k")
    lb = (batch if b.type.ndim == a.type.ndim else ()) + ("k", "n")
    return (la, lb), batch + ("m", "n")


def _linear_partials(ins, lays):
    """Pending sums that may flow through this op, per input (the rest must be reduced first)."""
    op, parts = ins.op, [tuple(l.partial) for l in lays]
    if any(lay.partial_op != Reduce.SUM for lay in lays):  # (pending maxima flow through no op)
        return [()] * len(parts)
    if op in LINEAR_UNARY or op == Op.SUM or op == Op.RESHAPE:
        return parts
    if op == Op.ADD_SCALAR and ins.attrs.get("value") == 0:  # (Python's sum() starts at 0: x + 0 on every
        return parts  # device's piece sums to the sum + 0, signed zeros included)
    if op in (Op.ADD, Op.SUB):  # P + P stays P only when every operand pends the same sums
        return parts if len(set(parts)) == 1 else [()] * len(parts)
    if op in (Op.MUL, Op.MATMUL):  # linear in one operand while the others are whole
        carried = [p for p in parts if p]
        return parts if len(carried) == 1 else [()] * len(parts)
    if op == Op.DIV:
        return [parts[0]] + [()] * (len(parts) - 1) if not any(parts[1:]) else [()] * len(parts)
    return [()] * len(parts)


def contraction_infer(ins, lays, labels=None):
    in_labels, out_labels = labels or einsum_labels(ins)
    axes = {}
    used = set()
    # The weight (last operand) decides first: on a tie its sharding wins, as in nvFuser.
    for labs, lay in reversed(list(zip(in_labels, lays))):
        for lab, a in zip(labs, _axes(lay)):
            # an axis sharded over several mesh axes keeps those still free (tokens over (dp, tp) against a
            # weight's columns over tp stay over dp: no gather across dp, no GEMM repeated on every dp rank)
            keep = free_axes(a, used)
            if lab in out_labels and keep is not None and lab not in axes:
                axes[lab] = keep
                used |= _names([keep])
    # the contraction runs sharded the way `require` picks (the first operand's sharding of it;
    # an operand sharded otherwise is resharded to match), so only those mesh axes pend sums
    contracted = _names([_contraction_axis(in_labels, out_labels, lays)[1]])
    carried = _reduced_first(ins, _linear_partials(ins, lays), used)
    partial = _union(contracted - used, *carried)
    return Layout(tuple(unshard([axes.get(lab) for lab in out_labels], set(partial))), partial)


def _reduced_first(ins, carried, sharding):
    """Pending sums an input would carry into an output sharded over those mesh axes (`sharding`):
    the output could not be sharded there, so the other operand would be gathered and the whole
    product computed on every device and reduced after.  Reduced before the op instead where the
    input is no larger than the product and the other operands together (a column-parallel GEMM
    after a vocab-parallel embedding: one Allreduce of the activations, no weight gathered)."""
    def size(v):
        return math.prod(v.type.shape)
    total = size(ins.outs[0]) + sum(size(v) for v in ins.ins)
    # (only the sums over mesh axes that clash are reduced: a sum pending over dp and tp times a value
    # sharded over tp keeps dp pending, rather than an Allreduce over dp of the whole product)
    return [tuple(a for a in c if a not in sharding) if set(c) & sharding and 2 * size(v) <= total else c
            for c, v in zip(carried, ins.ins)]


def _contraction_axis(in_labels, out_labels, lays):
    for labs, lay in zip(in_labels, lays):
        for lab, a in zip(labs, _axes(lay)):
            if lab not in out_labels and a is not None:
                return lab, a
    return None, None


def contraction_require(ins, out, lays, labels=None):
    in_labels, out_labels = labels or einsum_labels(ins)
    klab, k = _contraction_axis(in_labels, out_labels, lays)
    if any(lay.mesh != out.mesh for lay in lays):  # inputs move to the output's mesh whole
        klab, k = None, None
    # Keep the contraction local (then reduce after) rather than reshard the inputs' other axes.
    carried = _linear_partials(ins, lays)
    # an input's sums pending over K's mesh axes are reduce-scattered into that sharding first, the others
    # carried on (pending over (DIDy, DIDx) against K over DIDx: P over DIDy and S over DIDx, a review's
    # layout that asked DIDx to do both)
    carried = [tuple(a for a in c if a not in _names([k])) for c in carried]
    # (reduced first only over a mesh axis an operand already shards an output axis by, as wanted:
    # carrying the sums on would gather that operand)
    wanted = dict(zip(out_labels, out.axes))
    held = set().union(*(set(mesh_axes(a)) & _names([wanted[lab]]) for labs, lay in zip(in_labels, lays)
                         for lab, a in zip(labs, lay.axes) if lab in wanted and a is not None))
    carried = _reduced_first(ins, carried, held)
    out_axes = unshard(out.axes, set(_union(*carried)) | _names([k]), axis_of(ins))
    placed = dict(zip(out_labels, (_chunked(ins, j, a) for j, a in enumerate(out_axes))))
    if klab is not None:
        placed[klab] = k
    req = tuple(Layout(tuple(placed.get(lab) for lab in labs), carried[j]) for j, labs in enumerate(in_labels))
    produced = Layout(tuple(out_axes), _union(out.partial, mesh_axes(k), *carried))
    return req, produced


def contraction_axis_map(ins, j, labels=None):
    in_labels, out_labels = labels or einsum_labels(ins)
    lab = out_labels[j]
    return tuple(labs.index(lab) if lab in labs else None for labs in in_labels)


# ---- sum over one axis: a contraction too ("ij->i") ------------------------------------------

def _sum_labels(ins):
    n, ax = ins.ins[0].type.ndim, ins.attrs["axis"]
    labs = tuple(f"a{j}" for j in range(n))
    return (labs,), labs[:ax] + labs[ax + 1:]


# ---- elementwise with broadcasting -------------------------------------------------------

def elementwise_axis_map(ins, j):
    out = ins.outs[0].type
    res = []
    for v in ins.ins:
        a = j - (out.ndim - v.type.ndim)
        res.append(a if a >= 0 and v.type.shape[a] == out.shape[j] else None)
    return tuple(res)


def elementwise_infer(ins, lays):
    out = ins.outs[0].type
    axes, used = [], set()
    for j in range(out.ndim):
        pick = None
        for v, lay, a in zip(ins.ins, lays, elementwise_axis_map(ins, j)):
            m = _axes(lay)[a] if a is not None else None
            if m is not None and not _names([m]) & used:
                pick = m
                break
        axes.append(pick)
        used |= _names([pick])
    # (a pending row sum times a sharded value: the small sum is reduced, not the value gathered)
    partial = _union(*_reduced_first(ins, _linear_partials(ins, lays), used))
    return Layout(tuple(unshard(axes, set(partial))), partial)


def elementwise_require(ins, out, lays):
    """Inputs in the output's layout -- except that an axis every operand already shards the
    same way stays sharded: the op runs where the data is and one gather of the result follows,
    instead of one gather per operand."""
    carried = _linear_partials(ins, lays)
    # (reduced first where an operand already shards an output axis over the mesh axis it pends, as
    # contraction_require does: log_softmax's backward, a row sum pending over tp times the
    # tp-sharded softmax, is one Allreduce of the sums, not a gather and a reduce-scatter of both)
    # (only the mesh axes it shares with the output's: an operand split over (y, x) where the output is
    # over x holds x alone; taking y too reduced a sum pending over y that elementwise_infer, which sees x
    # alone, left pending in the output: the product reduced twice, a README probe's 2x)
    held = set().union(*(set(mesh_axes(_axes(lay)[src])) & _names([want]) for j, want in enumerate(out.axes)
                         if want is not None for lay, src in zip(lays, elementwise_axis_map(ins, j))
                         if src is not None and lay.mesh == out.mesh and _axes(lay)[src] is not None))
    carried = _reduced_first(ins, carried, held)
    pending = set(_union(*carried))
    axes = unshard(out.axes, pending, axis_of(ins))
    for j, a in enumerate(axes):
        if a is not None or j == axis_of(ins):
            continue
        owners = {_axes(lay)[src] if lay.mesh == out.mesh else None
                  for lay, src in zip(lays, elementwise_axis_map(ins, j)) if src is not None}
        if len(owners) == 1 and None not in owners:
            m = owners.pop()
            # never a mesh axis that also pends a sum: P(y) * S(y) is no layout (the partial
            # operand's pieces are not pieces of the other's shards)
            if not _names([m]) & (_names(axes) | pending):
                axes[j] = m
    req = []
    for n, (v, lay) in enumerate(zip(ins.ins, lays)):
        in_axes = [None] * v.type.ndim
        for j, a in enumerate(axes):
            src = elementwise_axis_map(ins, j)[n]
            if src is not None:
                in_axes[src] = _chunked(ins, j, a)
        req.append(Layout(tuple(in_axes), carried[n]))
    produced = Layout(tuple(axes), _union(out.partial, *carried))
    if set(out.partial) - set(_union(*carried)):  # (its operands no longer pend them: a second reduction would
        # double the sums, silently; propagation inferred what this requires, so a mismatch is a rule's bug)
        raise RuntimeError(f"shardfuse: {ins.op} of {', '.join(v.name for v in ins.ins)} was placed pending sums over "
                           f"{out.partial} its operands, {', '.join(map(str, lays))}, do not all carry; this is a "
                           "bug in shardfuse's sharding rules (please report it with the function)")
    return tuple(req), produced


def shape_only_require(ins, out, lays):
    """full_like reads its input for the shape alone: an input pending sums is taken as it is (no
    Allreduce made only to be overwritten: autodiff's zeros and ones of a partial value), where
    its pieces have the shape the output's pieces need."""
    req, produced = elementwise_require(ins, out, lays)
    lay, want = lays[0], req[0]
    if lay.partial and not set(lay.partial) & _names(want.axes):  # (a partial input is on the output's mesh)
        want = Layout(want.axes, lay.partial, partial_op=lay.partial_op)
    return (want,), produced


# ---- max / min of the last axis: local; where that axis is sharded, each device's maximum of its
# shard is a pending max (Partial("max")), made whole by an Allreduce with that operator ----------

def last_axis_reduce_infer(ins, lays):
    return Layout(tuple(_axes(lays[0])[:-1]))


def last_axis_reduce_require(ins, out, lays):
    # (the input holds no pending sum: max and min do not commute with one)
    (lay,) = lays
    last = _axes(lay)[-1] if lay.mesh == out.mesh and axis_of(ins) is None else None
    if last is None:  # the last axis whole (gathered where it is sharded and streamed)
        return (Layout(tuple(out.axes) + (None,)),), Layout(tuple(out.axes), out.partial)
    pending = mesh_axes(last)
    out_axes = unshard(out.axes, set(pending))
    kind = Reduce.MAX if ins.op == Op.REDUCE_MAX else Reduce.MIN
    return (Layout(tuple(out_axes) + (last,)),), Layout(tuple(out_axes), tuple(pending), partial_op=kind)


# ---- transpose: a permuted view ------------------------------------------------------------

def transpose_axis_map(ins, j):
    return (ins.attrs["perm"][j],)


def transpose_infer(ins, lays):
    (la,) = lays
    return Layout(tuple(_axes(la)[p] for p in ins.attrs["perm"]), la.partial)


def transpose_require(ins, out, lays):
    perm = ins.attrs["perm"]
    out_axes = unshard(out.axes, set(lays[0].partial), axis_of(ins))
    axes = [None] * len(perm)
    for j, p in enumerate(perm):
        axes[p] = _chunked(ins, j, out_axes[j])
    return (Layout(tuple(axes), lays[0].partial),), Layout(tuple(out_axes), _union(out.partial, lays[0].partial))


# ---- set and view: layouts are given, nothing is required of the input ---------------------

def identity_axis_map(ins, j):
    return (j,)


def _given(ins, lays):
    return ins.outs[0].type.layout


def _as_is(ins, out, lays):
    return tuple(lays), out


def _no_stream_map(ins, j):
    return (None,) * len(ins.ins)


CONTRACTION = dict(infer=contraction_infer, require=contraction_require, axis_map=contraction_axis_map)
ELEMENTWISE = dict(infer=elementwise_infer, require=elementwise_require, axis_map=elementwise_axis_map)

RULES = {
    Op.MATMUL: CONTRACTION,
    Op.SUM: dict(infer=lambda i, l: contraction_infer(i, l, _sum_labels(i)),
                require=lambda i, o, l: contraction_require(i, o, l, _sum_labels(i)),
                axis_map=lambda i, j: contraction_axis_map(i, j, _sum_labels(i))),
    Op.TRANSPOSE: dict(infer=transpose_infer, require=transpose_require, axis_map=transpose_axis_map),
    Op.SET: dict(infer=_given, require=_as_is, axis_map=identity_axis_map),
    Op.VIEW: dict(infer=_given, require=_as_is, axis_map=_no_stream_map),
    Op.RESHAPE: rules_shapes.RESHAPE,
    Op.TAKE: TAKE,  # (shardfuse/rules_take.py: the vocab-parallel embedding)
    Op.SCATTER_ADD: SCATTER_ADD,  # (and its gradient)
    Op.SLICE_ARRAY: rules_shapes.SLICE,
    Op.CUMSUM: rules_shapes.SCAN,  # (its last axis whole, pending sums flow through)
    Op.ARGSORT: rules_shapes.ORDER,  # (its last axis whole, pending sums reduced first)
    Op.PERMUTE: rules_shapes.ORDER,
    Op.CONCAT: rules_shapes.CONCAT,
    Op.DYNAMIC_UPDATE_SLICE: UPDATE_SLICE,  # (shardfuse/rules_update.py: a cut axis whole, the others kept)
    Op.DYNAMIC_SLICE: UPDATE_SLICE,
    **{op: ELEMENTWISE for op in BINARY | LINEAR_UNARY - {Op.TRANSPOSE} | NONLINEAR_UNARY | ops.BINARY},
    Op.FULL_LIKE: dict(ELEMENTWISE, require=shape_only_require),
    **{op: dict(infer=last_axis_reduce_infer, require=last_axis_reduce_require, axis_map=identity_axis_map)
       for op in ops.LOCAL_REDUCTIONS},
}


def rule(op: str, what: str):
    return RULES[op][what]


def infer(instr, lays):
    """The layout instr's rule infers for its output from its inputs' layouts (each names the mesh
    it lives on)."""
    return RULES[instr.op]["infer"](instr, list(lays))


def require(instr, out, lays):
    """(the input layouts instr's rule needs, the layout it then produces) for output layout `out`."""
    return RULES[instr.op]["require"](instr, out, list(lays))
