"""Reverse mode: the backward of a traced function, appended to the same program.

`backward` walks the instructions a function recorded, last first, and emits for each the ops
of its vector-Jacobian product (one rule per op, `VJP`, as JAX keeps one per primitive and
tinygrad's gradient.py does) through the same `Traced` methods a user's code calls.  So the
backward is an ordinary part of the program: propagation, resharding, verification and printing
treat it as they treat the forward, and the communication of the backward is what the planner
derives from the layouts (a replicated gradient of a sharded contraction is an Allreduce, a
gradient pinned sharded a ReduceScatter).

Annotations transpose to themselves (as JAX's sharding_constraint): the cotangent of an
annotated value is pinned to its placement.  A schedule moves across a matmul: the input
gradient of a streamed GEMM is streamed over the same axis and chunks (an AllGather+GEMM's
backward is a GEMM+ReduceScatter pipelined as the forward was; TransformerEngine's and
Megatron's sequence-parallel backward).

The weight gradient of a matmul whose input the forward gathered needs that input gathered again
(`autodiff_layouts.regathered`).  `remat="regather"` (the default, Megatron's and TransformerEngine's) gathers it
again in the backward; `remat="keep"` marks that re-gather `keep=True`, and the compiler
(passes/keep.py) has the stream loop that gathered it first (the forward's) keep each chunk, so
the weight gradient reads that instead of gathering again (what a `jax.checkpoint` policy that
saves the gathered input does).
"""
from __future__ import annotations

import math

from shardfuse import dtypes
from shardfuse.autodiff_padded import merged
from shardfuse.autodiff_layouts import at_home, gathered_from, known_layout, moved_back, pin, regathered, rows_merge
from shardfuse.custom_rules import rules_at
from shardfuse.custom_vjp import propagate_active
from shardfuse.ir import TensorType
from shardfuse.layout import Layout, mesh_axes
from shardfuse.numpy_broadcast import VJP as BROADCAST_VJP, unbroadcast
from shardfuse.numpy_math import VJP as MATH_VJP
from shardfuse.ops import Op
from shardfuse import schedule, tree
from shardfuse.schedule import Schedule, scheduled
from shardfuse.take import scatter_rows
from shardfuse.traced import Traced
from shardfuse.traced_numpy import where
from shardfuse.update_slice import VJP as UPDATE_SLICE_VJP

# ops whose output carries no gradient to their inputs (boolean or constant results; floor division's
# is piecewise constant: zero almost everywhere, as JAX's)


def full_like(x: Traced, value, dtype=None) -> Traced:
    """An array of x's shape (and layout, as propagation places it) holding `value`."""
    return x.unary_op(Op.FULL_LIKE, dtype or x.dtype_name, value=value)


def stop_gradient(x):
    """x as a value sf.grad holds constant (jax.lax.stop_gradient): a view of x (no copy) through which
    no gradient flows, while x's other uses keep theirs (grad of w -> stop_gradient(w) * w is w);
    a pytree's leaves each; outside a traced function x itself.  softmax's max shift: its true
    gradient is zero, and differentiating it would keep the [.., n] scores alive into the backward
    (for the ties of the max) and add three passes over them."""
    if not isinstance(x, Traced):
        return tree.tree_map(stop_gradient, x) if tree.is_container(x) else x
    held = x.builder.emit(Op.RESHAPE, (x,), TensorType(x.shape, x.dtype_name), x.value.name + "_sg", shape=x.shape)
    x.builder.no_gradient.add(held.value)
    return held


def differentiable(dtype: str) -> bool:
    return dtypes.is_float(dtype)


REMAT = ("regather", "keep")  # what a weight gradient does with a gathered input: gather it again, keep it


def check_remat(remat, what: str):
    if remat not in REMAT:
        raise ValueError(f"{what}(remat=...) must be 'regather' (the backward gathers a streamed matmul's input "
                         f"again for its weight gradient: less memory) or 'keep' (it reads the gathered input "
                         f"the forward kept: one Allgather fewer, the gathered input held), got {remat!r}")


def backward(builder, instrs, wrt, outs, cts, remat="regather") -> list:
    """The cotangents of the values `wrt` (None where no path leads from them to `outs`), given
    the cotangents `cts` (Traced) of `outs`, through `instrs` (the forward, as recorded); `remat`:
    whether a weight gradient gathers the forward's input again or reads the one it kept (REMAT)."""
    custom = rules_at(builder, instrs)  # (sf.custom_vjp / sf.checkpoint calls: their backward where each ended)
    active = propagate_active(builder, instrs, {v for v in wrt if differentiable(v.type.dtype)}, custom)
    grads: dict = {}
    for o, c in zip(outs, cts):
        if o in active:
            _accumulate(grads, o, c)
    for ins in reversed(instrs):
        for r in custom.get(id(ins), ()):
            _custom(r, grads, active)
        ct = grads.pop(ins.outs[0], None) if ins.outs and ins.outs[0] not in wrt else None
        if ct is None:
            continue
        rule = VJP.get(ins.op)
        if rule is None:
            raise NotImplementedError(f"sf.grad: no differentiation rule for {ins.op} (in {ins.outs[0].name} = "
                                      f"{ins.op}({', '.join(v.name for v in ins.ins)})); shardfuse differentiates "
                                      f"{', '.join(sorted(map(str, VJP)))}")
        ins_t = [Traced(builder, v) for v in ins.ins]
        opts = {"keep": remat == "keep"} if ins.op == Op.MATMUL else {}  # (the one rule with a choice)
        for v, g in zip(ins.ins, rule(ins, ins_t, Traced(builder, ins.outs[0]), ct, instrs, **opts)):
            if g is not None and v in active:
                _accumulate(grads, v, g)
    return [grads.get(v) for v in wrt]


def _custom(rule, grads, active):
    """An sf.custom_vjp (or sf.checkpoint) call: its outputs' cotangents (zeros where none arrived)
    through its own backward."""
    cts = [grads.pop(o.value, None) for o in rule.outs]
    if all(c is None for c in cts):
        return
    cts = [full_like(o, 0.0) if c is None else c for o, c in zip(rule.outs, cts)]
    for x, g in zip(rule.args, rule.cotangents(cts)):
        if g is not None and isinstance(x, Traced) and x.value in active:
            _accumulate(grads, x.value, g)


def _accumulate(grads, v, g: Traced):
    if g.shape != v.type.shape:
        raise AssertionError(f"autodiff: cotangent of {v.name}{v.type.shape} has shape {g.shape}")
    g = g.astype(v.type.dtype)
    if v not in grads:
        grads[v] = g
        return
    a, g = at_home(grads[v], g, v)  # (parts from two stages meet where v lives)
    joined = merged(a, g, Traced(g.builder, v))  # (slices' padded cotangents: one concatenate, no L x-sized sums)
    grads[v] = a + g if joined is None else joined


def _stream_of(out, instrs):
    """(stream axis, chunks) of the annotation that streams `out` in the forward, else None."""
    for i in instrs:
        sched = schedule.of(i) if i.op == Op.SET and i.ins and i.ins[0] is out else None
        if sched is not None:
            return (sched.axis, sched.chunks) if sched.chunks is not None else None
    return None


# ---- the rules: rule(instr, inputs, output, ct, forward instrs) -> a cotangent (or None) per input -----

def _home(x: Traced):
    """The mesh x lives on: a sub-mesh, or the program's."""
    return x.builder.homes.get(x.value) or x.builder.mesh


def _set(ins, xs, out, ct, instrs):
    """An annotation transposes to itself (the cotangent lives where the value does), but for one
    that gathers its operand (sf.replicate of an FSDP-sharded weight): its transpose scatters, so
    the cotangent goes straight to the operand's placement (a ReduceScatter of the pending sums,
    as JAX transposes all_gather and FSDP reduces gradients; pinned whole first it was an
    Allreduce and a slice: twice the traffic, and every device holding the whole gradient).  A
    move between meshes (sf.to_mesh, or an annotation with mesh=) moves the cotangent back."""
    (x,) = xs
    lay = out.value.type.layout
    if ins.attrs.get("annotation"):
        ct = pin(ct, gathered_from(x, lay) or lay)
    if lay.mesh != _home(x) or not ins.attrs.get("annotation"):
        ct = moved_back(ct, x, _home(x), lay)
    return [ct]


def _matmul(ins, xs, out, ct, instrs, keep=False):
    a, b = xs
    da = unbroadcast(ct @ b.swapaxes(-1, -2), a.shape)
    a_, ct_ = regathered(a, ct, keep)
    if rows_merge(a_, ct_, b):  # every batch of a met the one b: one GEMM over all rows
        db = a_.reshape(-1, a.shape[-1]).swapaxes(-1, -2) @ ct_.reshape(-1, ct.shape[-1])
    else:  # a batched product summed over the batch axes
        db = unbroadcast(a_.swapaxes(-1, -2) @ ct_, b.shape)
    return [_streamed_like(ins, a, b, da, out, instrs), db]


def _streamed_like(ins, a, b, da, out, instrs):
    """da produced chunk by chunk as the forward's product was (the dgrad GEMM of an AllGather+GEMM
    is a GEMM+ReduceScatter over the same chunks), where the forward states a's layout and the
    split is one the compiler takes; a schedule hint (passes drop it rather than refuse)."""
    streamed = _stream_of(ins.outs[0], instrs)
    users = sum(i.ins.count(a.value) for i in instrs)  # (a's cotangent sums several terms: made whole once)
    if streamed is None or users > 1 or b.ndim != 2 or a.ndim != out.ndim or da.builder.producer[da.value].op != Op.MATMUL:
        return da
    axis, chunks = streamed
    lay = known_layout(a.builder, a.value)
    if axis >= out.ndim - 1 or lay is None or lay.mesh != a.builder.mesh or lay.partial:
        return da
    shards = math.prod(a.builder.mesh.axis_size(n) for n in mesh_axes(lay.axes[axis]))
    if chunks == "auto" and shards > 1 or isinstance(chunks, int) and a.shape[axis] % (chunks * shards):
        return da
    return a.builder.emit(Op.SET, (da,), TensorType(da.shape, da.dtype_name, lay), da.value.name,
                          annotation=True, hint=True, **scheduled({}, Schedule(axis, chunks)))


def _sum(ins, xs, out, ct, instrs):
    (x,) = xs
    ax = ins.attrs["axis"]
    factor = ins.attrs.get("factor")
    g = ct * factor if factor is not None else ct
    g = g.reshape(x.shape[:ax] + (1,) + x.shape[ax + 1:])
    return [full_like(x, 0.0, g.dtype_name) + g]


def _reduce_extremum(ins, xs, out, ct, instrs):
    """Ties share the cotangent equally (JAX's rule for max and min)."""
    (x,) = xs
    keep = x.shape[:-1] + (1,)
    hit = (x == out.reshape(keep)).astype(x.dtype_name)
    share = (ct / hit.sum(axis=-1)).reshape(keep)
    return [hit * share]


def _binary_extremum(first_wins):
    def rule(ins, xs, out, ct, instrs):
        a, b = xs
        wins = (a > b) if first_wins else (a < b)
        w = wins.astype(ct.dtype_name) + (a == b).astype(ct.dtype_name) * 0.5
        return [unbroadcast(ct * w, a.shape), unbroadcast(ct * (1.0 - w), b.shape)]
    return rule


def _scalar_extremum(first_wins):
    def rule(ins, xs, out, ct, instrs):
        (x,) = xs
        c = ins.attrs["value"]
        wins = (x > c) if first_wins else (x < c)
        return [ct * (wins.astype(ct.dtype_name) + (x == c).astype(ct.dtype_name) * 0.5)]
    return rule


def _gelu(ins, xs, out, ct, instrs):
    """d/dx of the tanh form 0.5 x (1 + tanh(u)), u = k (x + 0.044715 x^3)."""
    (x,) = xs
    k = math.sqrt(2 / math.pi)
    t = ((x + x * x * x * 0.044715) * k).unary_op(Op.TANH)
    du = (x * x * (3 * 0.044715) + 1.0) * k
    return [ct * ((t + 1.0) * 0.5 + x * 0.5 * (1.0 - t * t) * du)]


def _silu(ins, xs, out, ct, instrs):
    (x,) = xs
    s = x.unary_op(Op.SIGMOID)
    return [ct * (s * (x * (1.0 - s) + 1.0))]


def _pow(ins, xs, out, ct, instrs):
    (x,) = xs
    c = ins.attrs["value"]
    return [full_like(x, 0.0, ct.dtype_name) if c == 0 else ct * (x ** (c - 1) * c)]


def _where_half(op):
    def rule(ins, xs, out, ct, instrs):
        c, x = xs
        return [None, unbroadcast(c.elementwise_op(op, (c, ct), ct.dtype_name), x.shape)]
    return rule


def _binary(da, db):
    def rule(ins, xs, out, ct, instrs):
        a, b = xs
        return [unbroadcast(da(ct, a, b, out), a.shape), unbroadcast(db(ct, a, b, out), b.shape)]
    return rule


def _unary(d):
    return lambda ins, xs, out, ct, instrs: [d(ct, xs[0], out, ins.attrs.get("value"))]


def _take(ins, xs, out, ct, instrs):
    """The table's cotangent: each row the sum of the cotangents of the positions that took it, a
    scatter-add (JAX's transpose of gather, PyTorch's embedding_dense_backward), no one-hot
    [tokens, vocab] matrix.  Where the forward shards the table over its vocabulary, the rows are
    pinned so: each device adds only the ids in its own rows (the vocab-parallel gradient)."""
    table, ids, rows = xs
    lay = known_layout(table.builder, table.value)
    if lay is not None and lay.mesh == table.builder.mesh and lay.axes[0] is not None:
        rows = pin(rows, Layout((lay.axes[0],), mesh=lay.mesh))
    return [scatter_rows(ct, ids, rows, ins.attrs["vocab"]), None, None]


def _scatter_add(ins, xs, out, ct, instrs):
    """The values' cotangent: each position reads its id's row of ct (a lookup, take's rule)."""
    _, ids, rows = xs
    shape = ids.shape + ct.shape[1:]
    return [ct.builder.emit(Op.TAKE, (ct, ids, rows), TensorType(shape, ct.dtype_name), "e", vocab=ins.attrs["vocab"]),
            None, None]


def _concat(ins, xs, out, ct, instrs):
    """Each input's cotangent is its box of ct."""
    from shardfuse.shape_ops import getitem

    ax, at, res = ins.attrs["axis"], 0, []
    for x in xs:
        res.append(getitem(ct, (slice(None),) * ax + (slice(at, at + x.shape[ax]),)))
        at += x.shape[ax]
    return res


def _slice_array(ins, xs, out, ct, instrs):
    """x's cotangent: ct in its box, zeros around it (and between the elements a step skipped),
    joined with concatenate axis by axis (no pad or scatter op)."""
    from shardfuse.shape_ops import concatenate, getitem

    (x,) = xs
    begin, box = ins.attrs["begin"], out.shape
    step = ins.attrs.get("step", (1,) * x.ndim)
    cur, begin, step = _forward_steps(ct, begin, box, step)
    for j in range(x.ndim):
        n, b, s, k = x.shape[j], box[j], step[j], begin[j]
        if s > 1:  # each element, then s - 1 zeros: positions k, k + s, ... once shifted by k
            col = cur.reshape(cur.shape[:j + 1] + (1,) + cur.shape[j + 1:])
            cur = concatenate([col] + [full_like(col, 0.0)] * (s - 1), j + 1)
            cur = cur.reshape(cur.shape[:j] + (b * s,) + cur.shape[j + 2:])
            b = min(b * s, n - k)
            cur = getitem(cur, (slice(None),) * j + (slice(0, b),))
        parts = [cur]
        for lo, hi, where_ in ((0, k, 0), (k + b, n, 1)):
            if hi > lo:  # zeros shaped as x's box on the axes not yet done, [lo, hi) on axis j
                box_of = tuple(slice(None) if i < j else slice(lo, hi) if i == j else
                               slice(begin[i], begin[i] + box[i] * step[i], step[i]) for i in range(x.ndim))
                zeros = full_like(getitem(x, box_of), 0.0, ct.dtype_name)
                parts.insert(0 if where_ == 0 else len(parts), zeros)
        cur = concatenate(parts, j) if len(parts) > 1 else cur
    return [cur]


def _forward_steps(ct, begin, box, step):
    """(ct, begin, step) of a slice with negative steps as the same elements read forwards: a
    reversed axis's cotangent reversed back, from its lowest index (x[7::-2] is x[1:8:2] reversed)."""
    from shardfuse.shape_ops import getitem

    rev = [j for j, s in enumerate(step) if s < 0 and box[j] > 1]
    if rev:
        ct = getitem(ct, tuple(slice(None, None, -1) if j in rev else slice(None) for j in range(len(step))))
    begin = tuple(k + (b - 1) * s if s < 0 and b else k for k, b, s in zip(begin, box, step))
    return ct, begin, tuple(abs(s) for s in step)


VJP = {
    Op.CONCAT: _concat,
    Op.SLICE_ARRAY: _slice_array,
    Op.TAKE: _take,
    Op.SCATTER_ADD: _scatter_add,
    Op.SET: _set,
    Op.MATMUL: _matmul,
    Op.SUM: _sum,
    Op.REDUCE_MAX: _reduce_extremum,
    Op.REDUCE_MIN: _reduce_extremum,
    Op.RESHAPE: lambda ins, xs, out, ct, instrs: [ct.reshape(xs[0].shape)],
    Op.TRANSPOSE: lambda ins, xs, out, ct, instrs: [ct.transpose(_inverse(ins.attrs["perm"]))],
    Op.ADD: _binary(lambda ct, a, b, y: ct, lambda ct, a, b, y: ct),
    Op.SUB: _binary(lambda ct, a, b, y: ct, lambda ct, a, b, y: -ct),
    Op.MUL: _binary(lambda ct, a, b, y: ct * b, lambda ct, a, b, y: ct * a),
    Op.DIV: _binary(lambda ct, a, b, y: ct / b, lambda ct, a, b, y: -(ct * y) / b),
    # x % y = x - floor(x / y) * y, floor's derivative zero (JAX's rem: dx = ct, dy = -ct * (x // y))
    Op.MOD: _binary(lambda ct, a, b, y: ct, lambda ct, a, b, y: -(ct * (a // b))),
    Op.MAXIMUM: _binary_extremum(True),
    Op.MINIMUM: _binary_extremum(False),
    Op.MAXIMUM_SCALAR: _scalar_extremum(True),
    Op.MINIMUM_SCALAR: _scalar_extremum(False),
    Op.WHERE_THEN: _where_half(Op.WHERE_THEN),
    Op.WHERE_ELSE: _where_half(Op.WHERE_ELSE),
    Op.NEG: _unary(lambda ct, x, y, c: -ct),
    Op.SCALE: _unary(lambda ct, x, y, c: ct * c),
    Op.DIV_SCALAR: _unary(lambda ct, x, y, c: ct / c),
    Op.ADD_SCALAR: _unary(lambda ct, x, y, c: ct),
    Op.RDIV: _unary(lambda ct, x, y, c: -(ct * y) / x),
    Op.EXP: _unary(lambda ct, x, y, c: ct * y),
    Op.TANH: _unary(lambda ct, x, y, c: ct * (1.0 - y * y)),
    Op.RELU: _unary(lambda ct, x, y, c: where(x > 0, ct, 0.0)),
    Op.GELU: _gelu,
    Op.SQRT: _unary(lambda ct, x, y, c: ct * 0.5 / y),
    Op.RSQRT: _unary(lambda ct, x, y, c: ct * (y * y * y) * -0.5),
    Op.LOG: _unary(lambda ct, x, y, c: ct / x),
    Op.SIGMOID: _unary(lambda ct, x, y, c: ct * (y * (1.0 - y))),
    Op.SILU: _silu,
    Op.POW: _pow,
    # (d/dx c^x = log(c) c^x; 0 for c == 0, as JAX's log of the base taken as 1 there, a review: NaN was 0 * NaN)
    Op.RPOW: _unary(lambda ct, x, y, c: ct * y * (math.log(c) if c > 0 else 0.0 if c == 0 else math.nan)),
    Op.ASTYPE: lambda ins, xs, out, ct, instrs: [ct.astype(xs[0].dtype_name) if differentiable(xs[0].dtype_name)
                                                 else None],
    **BROADCAST_VJP,  # x ** y of two arrays (shardfuse/numpy_broadcast.py)
    **MATH_VJP,  # sin, cos, log1p, expm1, erf, the exact GELU (shardfuse/numpy_math.py)
    **UPDATE_SLICE_VJP,  # dynamic_update_slice, dynamic_slice (shardfuse/update_slice.py)
}


def _inverse(perm) -> tuple:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)
