"""fuse_elementwise: a chain of elementwise steps as one step (Op.FUSED), so an intermediate that
only feeds the next op is never written to memory: softmax's scale, mask and cast, or a norm's
arithmetic, one pass over the data instead of one per op (issue 31 item 9).

A step I joins the step J that reads its result t when: both are top-level elementwise steps of
the ops backends fuse (FUSABLE), t is a buffer made once for I alone (no view of it, no output,
nothing else reads it), J reads t once, and J's result has t's shape (so element k of t feeds
element k of J's result: no broadcast of t).  The fused step reads the chain's other operands
(which may broadcast) and writes J's buffer; its `expr` keeps each op's own result dtype, so every
intermediate is rounded as the unfused step rounded it.  The plan prints it:
`Fused a_8 <- c_3, const, f, expr=astype(add(where_then(#1, scale(#0, 0.088)), #2))`.

An exact widening cast (bfloat16 or float16 to float32, ...) read by several such steps joins each
of them (its operand read twice instead of a float32 copy written and held between its readers: a
backward's cast of 16-bit attention gradients, read by two steps, held 2 GiB in the layer's step).
"""
from __future__ import annotations

import os
from collections import Counter

from shardfuse.ir import walk
from shardfuse.ops import ELEMENTWISE, LOCAL_REDUCTIONS, Expr, Op, VIEWS

# every elementwise op but the reductions of the last axis (an element of theirs reads a row) and
# the order keys of max / min Allreduces (they come with their collective), and floor division and
# remainder: NumPy's float forms (fmod, then a correction of the quotient) have no C expression in
# CuPy's fused kernels here, so they stay their backends' own ufuncs (floor_divide, remainder)
FUSABLE = ELEMENTWISE - LOCAL_REDUCTIONS - {Op.ORDER_KEYS, Op.FROM_ORDER_KEYS, Op.FLOOR_DIVIDE, Op.MOD}


def _leaf_exprs(ins):
    """(the Expr of each operand of a one-op step, its operand list)."""
    return tuple(Expr(None, v.type.dtype, arg=k) for k, v in enumerate(ins)), list(ins)


def _expr_of(i):
    """(Expr, operands) of a step: its own fused expression, or one op of its operands."""
    if i.op == Op.FUSED:
        return i.attrs["expr"], list(i.ins)
    leaves, ins = _leaf_exprs(i.ins)
    return Expr(i.op, i.into.type.dtype, leaves, i.attrs.get("value")), ins


def _substitute(expr, k, inner, offset):
    """expr with operand k replaced by `inner` (whose operands are numbered from `offset`), the
    operands after k renumbered."""
    if expr.op is None:
        if expr.arg == k:
            return _shift(inner, offset)
        return expr if expr.arg < k else Expr(None, expr.dtype, arg=expr.arg - 1)
    return Expr(expr.op, expr.dtype, tuple(_substitute(a, k, inner, offset) for a in expr.args), expr.value)


def _shift(expr, offset):
    if expr.op is None:
        return Expr(None, expr.dtype, arg=expr.arg + offset)
    return Expr(expr.op, expr.dtype, tuple(_shift(a, offset) for a in expr.args), expr.value)


def _dedupe(expr, ins):
    """(expr, ins) with each operand once (a mask read by both halves of a where is one operand)."""
    first = {}
    for k, v in enumerate(ins):
        first.setdefault(v, len(first))
    renumber = [first[v] for v in ins]

    def remap(e):
        if e.op is None:
            return Expr(None, e.dtype, arg=renumber[e.arg])
        return Expr(e.op, e.dtype, tuple(remap(a) for a in e.args), e.value)
    return remap(expr), list(first)


_FLOATS = {"float16", "bfloat16", "float32", "float64"}
_EXACT_CASTS = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"), ("float16", "float64"),
                ("float32", "float64")}


def _widening(i) -> bool:
    return i.op == Op.ASTYPE and (i.ins[0].type.dtype, i.into.type.dtype) in _EXACT_CASTS


def _fusable(i) -> bool:
    """A step of the ops fused, on floats (and boolean conditions): integer chains stay op by op
    (their arithmetic is exact in their own type; a fused kernel computes in floating point)."""
    return (i.into is not None and (i.op in FUSABLE or i.op == Op.FUSED) and i.into.type.dtype in _FLOATS
            and all(v.type.dtype in _FLOATS | {"bool"} for v in i.ins))


def _keeps_float16(v, i) -> bool:
    """Whether operand v of i may be folded into i's kernel: a float16 value only into a kernel that
    writes float16.  CuPy defines its float16 type in a kernel only where a parameter is float16
    (an H200 run: "incomplete type float16" for a float64 -> float16 -> float64 round trip), so a
    float16 value inside a chain must be one the kernel also stores."""
    return v.type.dtype != "float16" or i.into.type.dtype == "float16"


def enabled(mesh) -> bool:
    """On unless SHARDFUSE_FUSE=0 (one step per op: to compare, or to read).  On GPUs since the GPU
    test suite passed with it (BENCHMARKS.md, seventh session of 2026-12-05); before, GPUs ran one
    step per op by default."""
    return os.environ.get("SHARDFUSE_FUSE") != "0"


def fuse_elementwise(prog):
    if not enabled(prog.mesh):  # (one step per op: to compare, or to read)
        return prog.with_instrs(prog.instrs, "fuse_elementwise")
    reads = Counter(v for i in walk(prog.instrs) for v in i.values() if v is not i.into)
    viewed = {i.ins[0] for i in walk(prog.instrs) if i.op in VIEWS}
    once = {i.outs[0] for i in prog.instrs if i.op == Op.ALLOCATE and not i.attrs.get("per_call")
            and not i.attrs.get("pool") and not i.attrs.get("blocks") and not i.attrs.get("order")}
    outputs = set(prog.outputs)
    instrs = list(prog.instrs)
    producer = {}  # buffer -> index in instrs of the fusable step that writes it
    dropped = set()
    for n, i in enumerate(instrs):
        if _fusable(i):
            while True:  # each operand a single-use chain produced: folded in (the operands renumber)
                k = next((k for k, v in enumerate(i.ins) if v in producer and i.ins.count(v) == 1
                          and (reads[v] == 1 or _widening(instrs[producer[v]])) and v.type.shape == i.into.type.shape
                          and _keeps_float16(v, i)), None)
                if k is None:
                    break
                v, p = i.ins[k], producer[i.ins[k]]
                inner, inner_ins = _expr_of(instrs[p])
                outer, outer_ins = _expr_of(i)
                ins = outer_ins[:k] + outer_ins[k + 1:]
                expr = _substitute(outer, k, inner, len(ins))
                expr, ins = _dedupe(expr, ins + inner_ins)
                i = instrs[n] = i.__class__(Op.FUSED, (), tuple(ins), {"expr": expr}, into=i.into)
                # (a cast read by several steps: dropped once the last has taken it in)
                if reads[v] == 1 or not any(v in j.ins for j in walk([j for j in instrs if j is not None])
                                            if j is not instrs[p]):
                    del producer[v]
                    instrs[p] = None
                    dropped.add(v)
            v = i.into
            if v in once and v not in viewed and v not in outputs:
                producer[v] = n
    out = [i for i in instrs if i is not None and not (i.op == Op.ALLOCATE and i.outs[0] in dropped)]
    return prog.with_instrs(out, "fuse_elementwise")
