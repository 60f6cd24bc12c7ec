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
A chain of sums carries its reductions to its end: (x + reduced(p)) + y is (x + y) + reduced(p),
and (x + reduced(p)) + reduced(q) is x + reduced(p + q) where p and q pend the same sums (else
x + reduced(p) + reduced(q), each kind summed apart), so optax's global norm, the sum of every
leaf's squares, reduces the tp-sharded leaves' squares once, not once a leaf, and the dp-pending
ones once more.
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
from shardfuse.layout import Layout, mesh_axes
from shardfuse.ops import ELEMENTWISE, Op, Reduce

# ops linear in one operand, whose pending sum they may carry (_Sums._linear)
_LINEAR = {Op.MUL, Op.DIV, Op.SCALE, Op.NEG, Op.DIV_SCALAR, Op.ADD}

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
        self.tails = {}  # t -> (x or None, [v, ...], ids of the sums making t = x + v + ...): each v reduced, read only there
        self.producer = {i.outs[0]: i for i in prog.instrs if len(i.outs) == 1}
        self.zeros = {i.outs[0] for i in prog.instrs if i.op == Op.FULL_LIKE and i.attrs.get("value") == 0}
        self.memo = {}  # v -> its pieces, made once (a linear value read by several sums)

    def pieces(self, v, top=True):
        """(instructions making v's pieces, the pieces, the instructions v's pieces replace) where v
        is a reshard of pending pieces read only once, an exact widening cast (or Python's sum()'s
        0 + x) read once of such a reshard, or linear in one such value (_linear: made on its pieces,
        once however often it is read); else None."""
        if top and self.uses[v] != 1:
            return None
        if v in self.made and self.uses[v] == 1:
            return [], self.made[v].ins[0], [self.made[v]]
        if v in self.memo:
            return [], self.memo[v], []
        lin = self._linear(v)
        if lin is not None:
            i, us = lin
            made, swap = [], {}
            for u in us:
                more, swap[u], _ = self.pieces(u, top=False)
                made += more
            wide = Value(self.namer(f"{v.name}_pieces"), self._wide_type(v, swap[us[0]].type))
            self.memo[v] = wide
            # (nothing dropped here: v may have readers no sum folds, which still read the reduced u;
            # where none is left, _without_unread drops v's chain)
            return made + [Instr(i.op, (wide,), tuple(swap.get(x, x) for x in i.ins), dict(i.attrs))], wide, []
        cast = self.casts.get(v)
        if cast is None or cast.ins[0] not in self.made or self.uses[cast.ins[0]] != 1 or self.uses[v] != 1:
            return None
        reshard = self.made[cast.ins[0]]
        p = reshard.ins[0]
        wide = Value(self.namer(f"{v.name}_pieces"), TensorType(p.type.shape, v.type.dtype, p.type.layout))
        return [Instr(cast.op, (wide,), (p,), dict(cast.attrs))], wide, [reshard, cast]

    def piece_type(self, v, top=True):
        """The type of v's pieces where pieces(v) would give them (made no instruction), else None."""
        if top and self.uses[v] != 1:
            return None
        if v in self.made and self.uses[v] == 1:
            return self.made[v].ins[0].type
        if v in self.memo:
            return self.memo[v].type
        lin = self._linear(v)
        if lin is not None:
            return self._wide_type(v, self.piece_type(lin[1][0], top=False))
        cast = self.casts.get(v)
        if cast is None or cast.ins[0] not in self.made or self.uses[cast.ins[0]] != 1 or self.uses[v] != 1:
            return None
        p = self.made[cast.ins[0]].ins[0]
        return TensorType(p.type.shape, v.type.dtype, p.type.layout)

    def _linear(self, v):
        """(the instruction making v, its operands with pieces) where v is linear in them and their
        pending sums may be carried through it: v = u * y or y * u, u / y, a scale or negation of u,
        0 + u where 0 is a full_like (autodiff's broadcast of a cotangent), or u1 + u2 / u1 - u2 whose
        pieces are alike; y and v whole, of u's dtype, and placed over none of the mesh axes the
        pieces pend (a row split over tp cannot hold pieces pending over tp: a review).  The pieces
        of v are the op of those of u: the rms-norm backward's x * reduced(s) summed with reduced(g)
        is reduced(x * s + g), one Allreduce where Megatron makes one (a probe: two)."""
        i = self.producer.get(v)
        if i is None or v.type.layout is None or v.type.layout.partial or i.op not in _LINEAR:
            return None
        if set(i.attrs) - {"value"} or (i.attrs and i.op not in (Op.SCALE, Op.DIV_SCALAR)):
            return None
        zeros = [y for y in i.ins if y in self.zeros]
        if i.op in (Op.ADD, Op.SUB) and len(i.ins) == 2 and i.ins[0] is not i.ins[1] and not zeros:
            pts = [self.piece_type(u, top=False) for u in i.ins]
            ok = pts[0] is not None and pts[0] == pts[1] and all(u.type == v.type for u in i.ins)
            return (i, tuple(i.ins)) if ok and self._holds(v, pts[0], ()) else None
        if i.op in (Op.ADD, Op.SUB):  # (0 + u; a whole y added to pieces would be counted once per device)
            candidates = [y for y in i.ins if y not in self.zeros] if i.op == Op.ADD and len(zeros) == 1 else []
        else:
            candidates = list(i.ins) if i.op == Op.MUL else [i.ins[0]]
        for u in candidates:
            others = [y for y in i.ins if y is not u]
            pt = self.piece_type(u, top=False) if u.type.dtype == v.type.dtype and u not in others else None
            if pt is not None and self._holds(v, pt, others):
                return i, (u,)
        return None

    @staticmethod
    def _holds(v, pt, others) -> bool:
        """Whether v's placement and the other operands' (whole) can hold pieces pending pt's sums."""
        pending = set(pt.layout.partial)
        for y in (v, *others):
            lay = y.type.layout
            if lay is None or lay.partial or pending & {n for a in lay.axes for n in mesh_axes(a)}:
                return False
        return True

    def roots(self, v) -> frozenset:
        """The reshards (reductions) v's pieces come from: a sum of two values from one of them merges
        no reduction (x * s + y * s: one of s, [rows, 1], made one of [rows, cols]: a review)."""
        if v in self.made:
            return frozenset([v])
        lin = self._linear(v)
        if lin is not None:
            return frozenset().union(*(self.roots(u) for u in lin[1]))
        cast = self.casts.get(v)
        return frozenset([cast.ins[0]]) if cast is not None else frozenset()

    @staticmethod
    def _wide_type(v, pt):
        """The type of v's pieces: v's placement, pending the sums u's pieces (of type pt) pend."""
        lay = v.type.layout
        return TensorType(v.type.shape, v.type.dtype, Layout(lay.axes, partial=pt.layout.partial, mesh=lay.mesh,
                                                               partial_op=pt.layout.partial_op))

    def fold(self, i) -> list | None:
        """The instructions of sum i made on the pieces and reduced once, or None (i as it is)."""
        if i.op not in (Op.ADD, Op.SUB) or i.attrs or len(i.ins) != 2 or i.ins[0] is i.ins[1]:
            return None
        o, (u, w) = i.outs[0], i.ins
        if not u.type == w.type == o.type:
            return None
        tu, tw = self.piece_type(u), self.piece_type(w)
        if tu is not None and tu == tw and self.roots(u) & self.roots(w):  # (a sum linear in one reduction:
            return None  # left whole; a later sum may carry it as _linear's u1 + u2)
        if tu is not None and tu == tw:
            return self._summed(i.op, o, self.pieces(u), self.pieces(w))
        if i.op != Op.ADD:
            return None
        for t, other, other_type in ((u, w, tw), (w, u, tu)):
            if t in self.tails and self.uses[t] == 1:
                return self._onto_tail(t, other, other_type, o)
        if tu is not None or tw is not None:  # (a tail the next sums may reach: x + reduced(p), or two kinds)
            self.tails[o] = (None, [u, w], [id(i)]) if tu is not None and tw is not None else \
                (u, [w], [id(i)]) if tw is not None else (w, [u], [id(i)])
        return None

    def _summed(self, op, o, a, b) -> list:
        """o = op(a's pieces, b's pieces), reduced once."""
        summed = Value(self.namer(f"{o.name}_partial"), o.type.with_layout(a[1].type.layout))
        reshard = Instr(Op.SET, (o,), (summed,))
        self.made[o] = reshard
        self.dropped.update(id(d) for d in a[2] + b[2])
        return a[0] + b[0] + [Instr(op, (summed,), (a[1], b[1])), reshard]

    def _onto_tail(self, t, w, w_type, o) -> list:
        """o = t + w where t = x + v1 + v2 + ... (each v a reduced value of its own kind, t read only
        here): the reductions moved past this sum, w's pieces summed into those of the v of its kind
        (one reduction for both), else w one more v, or, w whole, added to x."""
        x, vs, made_t = self.tails.pop(t)
        self.dropped.update(made_t)
        out = []
        k = next((k for k, v in enumerate(vs) if w_type is not None and self.piece_type(v) == w_type
                  and not self.roots(v) & self.roots(w)), None)
        if k is not None:
            r = Value(self.namer(f"{o.name}_summed"), o.type)
            out += self._summed(Op.ADD, r, self.pieces(vs[k]), self.pieces(w))
            self.uses[r] = 1
            vs = vs[:k] + [r] + vs[k + 1:]
        elif w_type is not None:
            vs = vs + [w]
        elif x is None:
            x = w
        else:
            rest = Value(self.namer(f"{o.name}_rest"), o.type)
            out.append(Instr(Op.ADD, (rest,), (x, w)))
            x = rest
        terms, acc, chain = (vs if x is not None else vs[1:]), (x if x is not None else vs[0]), []
        for n, v in enumerate(terms):  # (acc + each reduced value, the last sum writing o)
            dst = o if n == len(terms) - 1 else Value(self.namer(f"{o.name}_acc"), o.type)
            chain.append(Instr(Op.ADD, (dst,), (acc, v)))
            acc = dst
        self.tails[o] = (x, vs, [id(c) for c in chain])
        return out + chain


def sum_before_reducing(prog):
    sums, out = _Sums(prog), []
    for i in prog.instrs:
        folded = sums.fold(i)
        out.extend([i] if folded is None else folded)
    out = [i for i in out if id(i) not in sums.dropped]
    return prog.with_instrs(_without_unread(out, prog.outputs, sums.uses), "sum_before_reducing")


def _without_unread(instrs, outputs, before) -> list:
    """instrs less those whose results folding left unread (read before, by nothing now): a linear
    value's reshard and ops, where every sum reading them now reads their pieces.  Only
    instructions of no effect but their results (elementwise ops, reshards); the program's own
    unread values stay as they were."""
    reads = Counter(v for i in instrs for v in i.ins)
    reads.update(outputs)
    keep = []
    for i in reversed(instrs):
        pure = i.op in ELEMENTWISE or i.op == Op.SET and not i.attrs
        if pure and i.outs and not i.body and all(before[o] and not reads[o] for o in i.outs):
            reads.subtract(i.ins)
            continue
        keep.append(i)
    return keep[::-1]
