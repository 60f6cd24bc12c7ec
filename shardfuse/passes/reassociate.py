"""sum_before_reducing: a sum of values each reduced over the devices is reduced once, after it.

`set(a_partial) + set(b_partial)`, both pending the same sums in the same layout and both
reshards into one layout, is `set(a_partial + b_partial)`: the devices add their pieces, and one
collective reduces the total (XLA's AllReduceReassociate).  Gradient accumulation over
micro-batches (g = grad(x0); g = g + grad(x1); ...) pins each gradient to its parameter's layout,
so each was reduced on its own: N Allreduces of every gradient for N micro-batches, now one.
An exact widening cast between a reduction and the sum (a bfloat16 gradient added into a float32
one) is made before the reduction instead, on the pieces: the one reduction is then in the wider
type (Megatron's float32 main_grad), none in bfloat16; so is the 0 + x of Python's sum()
(the pieces' x + 0 summed is the sum + 0, as rules.py carries a pending sum through it).
A chain of sums carries a reduction to its end: (x + reduced(p)) + y is (x + y) + reduced(p),
and (x + reduced(p)) + reduced(q) is x + reduced(p + q), so optax's global norm, the sum of every
leaf's squares, reduces the tp-sharded leaves' squares once, not once a leaf.
The reshards and casts are read by nothing else, and the sum's operands and result are of one
shape and dtype (no broadcasting): nothing else sees the pieces, and the sum has the shape each
piece had.  Runs in program order, so a chain of sums folds into one (the reshard of a folded sum
is the next sum's operand).  Summation order changes as any reduction's does; no rounding cast
is crossed, but pieces widened before the one reduction skip the bfloat16 rounding each reduced
piece had (the result is nearer the exact sum than one device's bfloat16 result would be).  The
one Allreduce comes after the last micro-batch, so it no longer overlaps the next micro-batch's
work as the first ones could; N reductions of the gradient become one.
"""
from __future__ import annotations

from collections import Counter

from shardfuse.ir import Instr, Namer, TensorType, Value
from shardfuse.ops import Op, Reduce

# (from, to): casts that change no value, so a sum of the cast pieces is the cast sum, made wider
_WIDENING = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"), ("float16", "float64"),
             ("float32", "float64")}


def _pending_reshard(i) -> bool:
    """i is a reshard (an unannotated, unscheduled set) of a value pending sums that only reduces
    them (an Allreduce: its pieces as large as its result's; a ReduceScatter's target is left alone,
    so a sharded gradient's accumulator stays a shard, not the whole of a ZeRO / FSDP gradient)."""
    lay = i.ins[0].type.layout if i.op == Op.SET and i.ins else None
    return (lay is not None and bool(lay.partial) and lay.partial_op == Reduce.SUM and not i.attrs
            and i.outs[0].type.layout.axes == lay.axes)


def _exact_unary(i) -> bool:
    """i changes no value of its operand, so it may be made on the pieces instead: a widening
    cast, or the 0 + x that Python's sum() starts with."""
    if i.op == Op.ASTYPE:
        return (i.ins[0].type.dtype, i.outs[0].type.dtype) in _WIDENING
    return i.op == Op.ADD_SCALAR and i.attrs.get("value") == 0 and i.ins[0].type.dtype == i.outs[0].type.dtype


class _Sums:
    """The program's reshards of pending values and their widening casts, and what folding drops."""

    def __init__(self, prog):
        self.uses = Counter(v for i in prog.instrs for v in i.ins)
        self.uses.update(prog.outputs)
        self.made = {i.outs[0]: i for i in prog.instrs if len(i.outs) == 1 and _pending_reshard(i)}
        self.casts = {i.outs[0]: i for i in prog.instrs if len(i.outs) == 1 and _exact_unary(i)}
        self.namer, self.dropped = Namer.for_program(prog), set()  # (dropped: the instructions' ids)
        self.tails = {}  # t -> (x, v, the instruction t = x + v), v a reduced value read only there

    def pieces(self, v):
        """(instructions making v's pieces, the pieces, the instructions v's pieces replace) where v
        is a reshard of pending pieces read only once, or an exact widening cast (or Python's sum()'s
        0 + x) read once of such a reshard; else None."""
        if self.uses[v] != 1:
            return None
        if v in self.made:
            return [], self.made[v].ins[0], [self.made[v]]
        cast = self.casts.get(v)
        if cast is None or cast.ins[0] not in self.made or self.uses[cast.ins[0]] != 1:
            return None
        reshard = self.made[cast.ins[0]]
        p = reshard.ins[0]
        wide = Value(self.namer(f"{v.name}_pieces"), TensorType(p.type.shape, v.type.dtype, p.type.layout))
        return [Instr(cast.op, (wide,), (p,), dict(cast.attrs))], wide, [reshard, cast]

    def fold(self, i) -> list | None:
        """The instructions of sum i made on the pieces and reduced once, or None (i as it is)."""
        if i.op not in (Op.ADD, Op.SUB) or i.attrs or len(i.ins) != 2 or i.ins[0] is i.ins[1]:
            return None
        o = i.outs[0]
        if not i.ins[0].type == i.ins[1].type == o.type:
            return None
        a, b = self.pieces(i.ins[0]), self.pieces(i.ins[1])
        if a is not None and b is not None and a[1].type == b[1].type:
            return self._summed(i.op, o, a, b)
        if i.op != Op.ADD:
            return None
        for t, w, pw in ((i.ins[0], i.ins[1], b), (i.ins[1], i.ins[0], a)):
            if t in self.tails and self.uses[t] == 1:
                return self._onto_tail(t, w, pw, o)
        if (a is None) != (b is None):  # (x + reduced(p): a tail the next sums may reach)
            self.tails[o] = (i.ins[0], i.ins[1], i) if b is not None else (i.ins[1], i.ins[0], i)
        return None

    def _summed(self, op, o, a, b) -> list:
        """o = op(a's pieces, b's pieces), reduced once."""
        summed = Value(self.namer(f"{o.name}_partial"), o.type.with_layout(a[1].type.layout))
        reshard = Instr(Op.SET, (o,), (summed,))
        self.made[o] = reshard
        self.dropped.update(id(d) for d in a[2] + b[2])
        return a[0] + b[0] + [Instr(op, (summed,), (a[1], b[1])), reshard]

    def _onto_tail(self, t, w, pw, o) -> list:
        """o = t + w where t = x + v (v a reduced value, t read only here): the reduction moved past
        this sum, o = x + reduced(v's pieces + w's) where w is pending pieces too, else (x + w) + v."""
        x, v, made_t = self.tails.pop(t)
        self.dropped.add(id(made_t))
        pv = self.pieces(v)
        if pw is not None and pv is not None and pv[1].type == pw[1].type:
            r = Value(self.namer(f"{o.name}_summed"), o.type)
            self.uses[r] = 1
            out = self._summed(Op.ADD, r, pv, pw)
            add = Instr(Op.ADD, (o,), (x, r))
            self.tails[o] = (x, r, add)
            return out + [add]
        y = Value(self.namer(f"{o.name}_rest"), o.type)
        add = Instr(Op.ADD, (o,), (y, v))
        self.tails[o] = (y, v, add)
        return [Instr(Op.ADD, (y,), (x, w)), add]


def sum_before_reducing(prog):
    sums, out = _Sums(prog), []
    for i in prog.instrs:
        folded = sums.fold(i)
        out.extend([i] if folded is None else folded)
    return prog.with_instrs([i for i in out if id(i) not in sums.dropped], "sum_before_reducing")
