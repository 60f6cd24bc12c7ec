"""fuse_elementwise: a chain of elementwise steps as one step (Op.FUSED), so an intermediate that
only feeds the next op is never written to memory: softmax's scale, mask and cast, or a norm's
arithmetic, one pass over the data instead of one per op (issue 31 item 9).

A step I joins the step J that reads its result t when: both are top-level elementwise steps of
the ops backends fuse (FUSABLE), t is a buffer made once for I alone (no view of it, no output,
no other step reads it: J may read it at several places of its expression, t * t, each then
holding I's chain, up to MAX_NODES nodes in all), and J's result has t's shape (so element k of t
feeds element k of J's result: no broadcast of t).  The fused step reads the chain's other operands
(which may broadcast) and writes J's buffer; its `expr` keeps each op's own result dtype, so every
intermediate is rounded as the unfused step rounded it.  The plan prints it:
`Fused a_8 <- c_3, const, f, expr=astype(add(where_then(#1, scale(#0, 0.088)), #2))`.

An exact widening cast (bfloat16 or float16 to float32, ...) read by several such steps joins each
of them (its operand read twice instead of a float32 copy written and held between its readers: a
backward's cast of 16-bit attention gradients, read by two steps, held 2 GiB in the layer's step).

A Sum of floats joins the chain that writes its operand t on the same conditions (t made once for
that step alone, read once, by the Sum): one FusedSum step (Op.FUSED_SUM) that evaluates the
chain per element and sums it as the Sum did (its axis and factor; 16-bit values summed in
float32), so t is never written.  softmax's backward wrote g * y, a float32 [batch, heads, seq,
seq] buffer (2 GiB in the layer's step), only to sum it; a norm wrote x.astype(float32) and
(x - mean)^2 for its means.  The chain's operands broadcast to t's shape (backends make the
chain's values of that shape from them).  The plan prints it:
`FusedSum s_38 <- d, c_14, axis=3, expr=mul(astype(#1), #0)`.
"""
from __future__ import annotations

import os
from collections import Counter

import numpy as np

from shardfuse.ir import walk
from shardfuse.ops import ELEMENTWISE, LOCAL_REDUCTIONS, LOCAL_SCANS, Expr, Op, VIEWS

# every elementwise op but the reductions and scans of the last axis (an element of theirs reads a row) and
# the order keys of max / min Allreduces (they come with their collective), and floor division and
# remainder: NumPy's float forms (fmod, then a correction of the quotient) have no C expression in
# CuPy's fused kernels here, so they stay their backends' own ufuncs (floor_divide, remainder).  NumPy's
# unary math (sin, erf, gelu_erf, floor, round, sign, ...) fuses as exp does; the boolean ones (isnan,
# isinf, isfinite), as comparisons, never join a chain: fusable takes steps with float results only
FUSABLE = ELEMENTWISE - LOCAL_REDUCTIONS - LOCAL_SCANS - {Op.ORDER_KEYS, Op.FROM_ORDER_KEYS, Op.FLOOR_DIVIDE, Op.MOD}


def _leaf_exprs(ins):
    """(the Expr of each operand of a one-op step, its operand list)."""
    return tuple(Expr(None, v.type.dtype, arg=k) for k, v in enumerate(ins)), list(ins)


def expr_of(i):
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


FLOATS = {"float16", "bfloat16", "float32", "float64"}
# A chain read at several places of its reader's expression is pasted in at each (tanh(u) * tanh(u)):
# the expression is a tree, so t = t * t repeated would double it per step.  Backends compute equal
# nodes once; the tree itself (printed, hashed, compiled) is held to this many nodes.
MAX_NODES = 128


def expr_nodes(expr, sizes: dict) -> int:
    """The nodes of expr's tree (sizes: a memo shared by the pass; equal subtrees hash in O(1))."""
    if expr not in sizes:
        sizes[expr] = 1 + sum(expr_nodes(a, sizes) for a in expr.args)
    return sizes[expr]
_EXACT_CASTS = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"), ("float16", "float64"),
                ("float32", "float64")}


def _widening(i) -> bool:
    return i.op == Op.ASTYPE and (i.ins[0].type.dtype, i.into.type.dtype) in _EXACT_CASTS


def fusable(i) -> bool:
    """A step of the ops fused, on floats (and boolean conditions): integer chains stay op by op
    (their arithmetic is exact in their own type; a fused kernel computes in floating point)."""
    return (i.into is not None and (i.op in FUSABLE or i.op == Op.FUSED) and i.into.type.dtype in FLOATS
            and all(v.type.dtype in FLOATS | {"bool"} for v in i.ins))


def _keeps_float16(v, i) -> bool:
    """Whether operand v of i may be folded into i's kernel: a float16 value only into a kernel that
    writes float16.  CuPy defines its float16 type in a kernel only where a parameter is float16
    (an H200 run: "incomplete type float16" for a float64 -> float16 -> float64 round trip), so a
    float16 value inside a chain must be one the kernel also stores.  (That holds for the kernels
    CuPy still writes, a 0-d Fused step's and a FusedSum's; flat_source's convert by PTX.)"""
    return v.type.dtype != "float16" or i.into.type.dtype == "float16"


def enabled(mesh) -> bool:
    """On unless SHARDFUSE_FUSE=0 (one step per op: to compare, or to read).  On GPUs since the GPU
    test suite passed with it (BENCHMARKS.md, seventh session of 2026-12-05); before, GPUs ran one
    step per op by default."""
    return os.environ.get("SHARDFUSE_FUSE") != "0"


def _joined(i, v, made):
    """Step i with its operand v (each read of it: i's operands are deduplicated first, so x * x of a
    chain's x takes the chain in once) replaced by the chain of `made`, the step that wrote it: one
    Fused step."""
    inner, inner_ins = expr_of(made)
    outer, outer_ins = _dedupe(*expr_of(i))
    k = outer_ins.index(v)
    ins = outer_ins[:k] + outer_ins[k + 1:]
    expr, ins = _dedupe(_substitute(outer, k, inner, len(ins)), ins + inner_ins)
    return i.__class__(Op.FUSED, (), tuple(ins), {"expr": expr}, into=i.into)


def _summed(i, _, made):
    """Sum i of the result of `made` as one FusedSum step: made's chain, summed as i sums (its attrs)."""
    expr, ins = _dedupe(*expr_of(made))
    return i.__class__(Op.FUSED_SUM, i.outs, tuple(ins), {**i.attrs, "expr": expr}, into=i.into)


def _sums_whole(i, made) -> bool:
    """Whether i is a Sum of floats that may take in the chain of `made`: the chain's operands broadcast
    to the summed shape (backends make the chain's result of that shape, from the operands alone)."""
    src, dst = i.ins[0].type.dtype, i.into.type.dtype  # (a 16-bit chain summed into float32: traced._reduce's)
    return (i.op == Op.SUM and dst in FLOATS and (src == dst or (src in ("float16", "bfloat16") and dst == "float32"))
            and tuple(np.broadcast_shapes(*(v.type.shape for v in made.ins))) == i.ins[0].type.shape)


def fuse_elementwise(prog):
    if not enabled(prog.mesh):  # (one step per op: to compare, or to read)
        return prog.with_instrs(prog.instrs, "fuse_elementwise")
    # the steps that read each value (a step reading it twice, x * x, counts once), kept as steps join
    reads = Counter(v for i in walk(prog.instrs) for v in set(i.ins) if v is not i.into)
    viewed = {i.ins[0] for i in walk(prog.instrs) if i.op in VIEWS}
    once = {i.outs[0] for i in prog.instrs if i.op == Op.ALLOCATE and not i.attrs.get("per_call")
            and not i.attrs.get("pool") and not i.attrs.get("blocks") and not i.attrs.get("order")}
    outputs = set(prog.outputs)
    instrs = list(prog.instrs)
    producer = {}  # buffer -> index in instrs of the fusable step that writes it
    dropped, sizes = set(), {}

    def takes(v, i) -> bool:
        """Whether step i may take in the chain that wrote its operand v (the module doc's conditions; a
        float16 chain summed into float32 where a float16 operand is the kernel's: _keeps_float16's reason)."""
        return v in producer and (reads[v] == 1 or _widening(instrs[producer[v]])) and (_keeps_float16(v, i) or (
            i.op == Op.SUM and any(w.type.dtype == "float16" for w in instrs[producer[v]].ins)))

    def taken(v):
        """v's chain was taken in by a reader: its step is dropped (True) once no other step reads v
        (a cast read by several steps: once the last has taken it).  While it stays, the reader reads
        the chain's operands beside it: join counts them, so no later step takes them in and drops
        them (a float16 product cast to float32 for two readers was taken into a float16 result and
        dropped while the other reader still read it: a plan that read an unwritten value)."""
        p = producer[v]
        if reads[v] == 1 or not any(v in j.ins for j in walk([j for j in instrs if j is not None]) if j is not instrs[p]):
            del producer[v]
            instrs[p] = None
            dropped.add(v)
            return True
        return False

    def join(n, i, v, make=_joined):
        """instrs[n] = make(i, v, the step that wrote i's operand v): the chain taken in, each value's
        readers recounted (the new step reads once what i and a dropped producer read; a producer
        that stays still reads its operands, so they count for both).  None where the joined
        expression would pass MAX_NODES (nothing changed)."""
        made = instrs[producer[v]]
        new = make(i, v, made)
        if expr_nodes(new.attrs["expr"], sizes) > MAX_NODES:
            return None
        instrs[n] = new
        gone = taken(v)
        for w in (set(i.ins) | set(made.ins) | set(new.ins)) - {v}:
            reads[w] += (w in new.ins) - (w in i.ins) - (gone and w in made.ins)
        reads[v] -= 1
        return new

    for n, i in enumerate(instrs):
        if fusable(i):
            while True:  # each operand a single-use chain produced: folded in (the operands renumber)
                joined = next((j for v in dict.fromkeys(i.ins) if takes(v, i) and v.type.shape == i.into.type.shape
                               and (j := join(n, i, v)) is not None), None)
                if joined is None:
                    break
                i = joined
            v = i.into
            if v in once and v not in viewed and v not in outputs:
                producer[v] = n
        elif i.op == Op.SUM and takes(i.ins[0], i) and _sums_whole(i, instrs[producer[i.ins[0]]]):
            join(n, i, i.ins[0], _summed)
    out = [i for i in instrs if i is not None and not (i.op == Op.ALLOCATE and i.outs[0] in dropped)]
    return prog.with_instrs(out, "fuse_elementwise")
