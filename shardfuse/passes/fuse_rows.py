"""fuse_rows: a group of steps that all work row by row over the same last axis as one step
(Op.FUSED_ROWS), so that softmax, log_softmax, a norm and their backward chains are one pass over
each row instead of one pass over memory per reduction and per chain between them.

After fuse_elementwise, softmax over the scores still runs as four steps: the scale / mask / cast
chain written to x, a ReduceMax of x, a FusedSum of exp(x - m) and a Fused exp(x - m) / s.  Each
reads (and some write) the whole [batch, heads, seq, seq] array.  On a GPU a row of 2048 floats
stays in L1 / L2 while one thread block sweeps it once per reduction: one kernel.

A group is a connected set of top-level steps, each of them
- elementwise (a step fuse_elementwise could fuse, or a Fused one) on floats, its result and every
  operand broadcasting into the row shape R = [..., L] (a [1, 1, S, S] mask, a [L] weight, a
  [..., 1] value of one per row), or
- a reduction of the last axis of an R-shaped value (ReduceMax / ReduceMin, a Sum or FusedSum of
  axis -1 with its factor: a mean), read only through its keepdims View [..., 1];
joined through the values between them: a value joins its writer to its readers when it is a
buffer made once for that step (not an output, not viewed but for a reduction's keepdims View, the
same conditions fuse_elementwise uses) and every step that reads it is such a step.  A group holds
a reduction, and exactly one of its values is read outside it (or returned): the step writes that
one.  R's last axis is whole on every device: over a sharded axis the reduction's result goes to an
Allreduce, which reads it outside any group, so such a softmax stays as it was (and stays right).

The step's `expr` is the group as one ops.Expr over the group's operands: each node keeps its own
dtype (rounded as the unfused step rounded it), a reduction node is one value per row (16-bit sums
accumulated in float32, as Sum does; max / min exact).  Equal sub-expressions are one value: the
plan prints the tree, backends compute each once per element.  Printed:
`FusedRows a_2 <- x, expr=astype(div(exp(sub(#0, reduce_max(#0))), sum(exp(sub(#0, reduce_max(#0))))))`.
SHARDFUSE_FUSE=0 turns it off with fuse_elementwise.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from shardfuse.ir import local_shape, walk
from shardfuse.ops import LOCAL_REDUCTIONS, VIEWS, Expr, Op
from shardfuse.passes.allocate import view_bases
from shardfuse.passes.fuse import FLOATS, enabled, expr_of, fusable

_MAP, _REDUCE = "map", "reduce"


def reduced_shape(i):
    """The shape step i reduces over its last axis, or None where i is no such reduction of floats."""
    if i.into is None or i.into.type.dtype not in FLOATS:
        return None
    if i.op in LOCAL_REDUCTIONS or i.op == Op.SUM:
        shape = i.ins[0].type.shape
        whole = i.op != Op.SUM or i.attrs["axis"] == len(shape) - 1
        return shape if whole and shape and i.ins[0].type.dtype == i.into.type.dtype else None
    if i.op == Op.FUSED_SUM:
        shape = tuple(np.broadcast_shapes(*(v.type.shape for v in i.ins)))
        return shape if shape and i.attrs["axis"] == len(shape) - 1 else None
    return None


def _role(i):
    if reduced_shape(i) is not None:
        return _REDUCE
    return _MAP if fusable(i) else None


def _fits(shape, row) -> bool:
    """Whether shape broadcasts into the row shape without growing it."""
    return len(shape) <= len(row) and all(s in (1, r) for s, r in zip(shape[::-1], row[::-1]))


class _Groups:
    """Union-find over top-level step positions."""

    def __init__(self):
        self.parent = {}

    def find(self, k):
        while self.parent.get(k, k) != k:
            k = self.parent[k]
        return k

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def _internal(prog, instrs, role):
    """{value: (writer, readers)}: the values that join their writer to their readers (module doc),
    and {keepdims view: the reduction's value} for the views read in place of a reduction's result."""
    readers, writes = defaultdict(list), defaultdict(int)
    for k, top in enumerate(instrs):
        for i in walk([top]):
            for v in i.ins:
                readers[v].append((k, i is top))
            if i.into is not None:
                writes[i.into] += 1
    once = {i.outs[0] for i in instrs if i.op == Op.ALLOCATE and not any(i.attrs.get(a) for a in (
        "per_call", "pool", "blocks", "order", "ring"))}
    views = defaultdict(list)
    for k, i in enumerate(instrs):
        if i.op in VIEWS:
            views[i.ins[0]].append((k, i))
    outputs = set(prog.outputs)

    def members(v):
        """The positions of v's readers when all are top-level steps of a group's kinds, else None."""
        got = readers.get(v, [])
        if not got or v in outputs or views.get(v) or not all(top and k in role for k, top in got):
            return None
        return [k for k, _ in got]

    inner, kept = {}, {}
    for k, i in enumerate(instrs):
        v = i.into
        if k not in role or v not in once or writes[v] != 1 or v in outputs:
            continue
        if role[k] == _MAP:
            got = members(v)
        else:  # a reduction's result: read only through keepdims views, each read only by group steps
            vs = [j for _, j in views.get(v, [])]
            keepdims = len(readers[v]) == len(vs) and all(j.op == Op.VIEW and j.outs[0].type.shape == v.type.shape + (1,)
                                                          for j in vs)
            found = [members(j.outs[0]) for j in vs] if keepdims else [None]
            got = None if not vs or None in found else [m for f in found for m in f]
            if got:
                kept.update({j.outs[0]: v for j in vs})
        if got:
            inner[v] = (k, got)
    return inner, kept


def _group_expr(instrs, members, root, inner, kept):
    """(Expr of the root over the group's operands, the operands): each member a node, once."""
    operands, memo = [], {}

    def leaf(v):
        src = kept.get(v, v)
        if src in inner and inner[src][0] in members:
            return node(inner[src][0])
        if v not in operands:
            operands.append(v)
        return Expr(None, v.type.dtype, arg=operands.index(v))

    def remap(e, ins):
        if e.op is None:
            return leaf(ins[e.arg])
        return Expr(e.op, e.dtype, tuple(remap(a, ins) for a in e.args), e.value)

    def node(k):
        if k not in memo:
            i = instrs[k]
            dt = i.into.type.dtype
            factor = i.attrs.get("factor", 1.0)
            if i.op in LOCAL_REDUCTIONS:
                memo[k] = Expr(i.op, dt, (leaf(i.ins[0]),))
            elif i.op in (Op.SUM, Op.FUSED_SUM):
                arg = leaf(i.ins[0]) if i.op == Op.SUM else remap(i.attrs["expr"], i.ins)
                memo[k] = Expr(Op.SUM, dt, (arg,), None if factor == 1.0 else factor)
            else:
                memo[k] = remap(*expr_of(i))
        return memo[k]
    return node(root), operands


def _valid(prog, instrs, members, root, operands, role):
    """Whether the group may run as one step at its root's place (module doc)."""
    rows = {reduced_shape(instrs[k]) for k in members if role[k] == _REDUCE}
    if len(rows) != 1:
        return False
    row = rows.pop()
    out = instrs[root].into
    if out.type.shape not in ((row[:-1],) if role[root] == _REDUCE else (row, row[:-1] + (1,))):
        return False
    if any(v.type.layout is None or v.type.layout.partial for v in [*operands, *(instrs[k].into for k in members)]):
        return False
    if not all(_fits(v.type.shape, row) for v in [*operands, *(instrs[k].into for k in members if role[k] == _MAP)]):
        return False
    local = [local_shape(v, prog.mesh) for v in operands]
    local_row = tuple(np.broadcast_shapes(*local))
    wants = (local_row[:-1],) if role[root] == _REDUCE else (local_row, local_row[:-1] + (1,))
    if len(local_row) != len(row) or local_row[-1] != row[-1] or local_shape(out, prog.mesh) not in wants:
        return False  # (the last axis sharded, or a leading one sharded unlike the rows)
    first = min(members)
    base = view_bases(prog)
    read = {base.get(v, v) for v in operands}
    if base.get(out, out) in read:  # (a group step reads the value the step writes: two steps)
        return False
    for k in range(first, root):  # nothing else writes an operand before the step that now reads it
        if k not in members and any(j.into is not None and base.get(j.into, j.into) in read for j in walk([instrs[k]])):
            return False
    return True


def _components(instrs, role, inner) -> tuple:
    """(the groups, as sets of top-level positions; the values inside them).  Where one would write more than one value (a
    value read by steps that end up in two groups: a residual both normalised and added to later),
    the earliest value of it read by several of its steps joins nothing, and the groups are made
    again: the residual is then an operand of the norm's group."""
    while True:
        groups = _Groups()
        for k, readers in inner.values():
            for m in readers:
                groups.union(k, m)
        by_root = defaultdict(set)
        for k in role:
            by_root[groups.find(k)].add(k)
        cut = None
        for members in by_root.values():
            if sum(instrs[k].into not in inner for k in members) > 1:
                shared = sorted((k, v) for v, (k, readers) in inner.items() if k in members and len(set(readers)) > 1)
                cut = cut or (shared[0][1] if shared else None)
        if cut is None:
            return list(by_root.values()), inner
        inner = {v: e for v, e in inner.items() if v is not cut}


def fuse_rows(prog):
    if not enabled(prog.mesh):  # (one step per op: to compare, or to read)
        return prog.with_instrs(prog.instrs, "fuse_rows")
    instrs = list(prog.instrs)
    role = {k: r for k, i in enumerate(instrs) if (r := _role(i)) is not None}
    inner, kept = _internal(prog, instrs, role)
    by_root, inner = _components(instrs, role, inner)
    drop, replace_at = set(), {}
    for members in by_root:
        outs = [k for k in members if instrs[k].into not in inner]
        if len(members) < 2 or len(outs) != 1 or not any(role[k] == _REDUCE for k in members):
            continue
        root = outs[0]
        expr, operands = _group_expr(instrs, members, root, inner, kept)
        if not _valid(prog, instrs, members, root, operands, role):
            continue
        i = instrs[root]
        replace_at[root] = i.__class__(Op.FUSED_ROWS, i.outs, tuple(operands), {"expr": expr}, into=i.into)
        dead = {instrs[k].into for k in members if k != root}
        drop |= {k for k in members if k != root}
        drop |= {k for k, j in enumerate(instrs) if (j.op == Op.ALLOCATE and j.outs[0] in dead)
                 or (j.op == Op.VIEW and kept.get(j.outs[0]) in dead)}
    out = [replace_at.get(k, i) for k, i in enumerate(instrs) if k not in drop]
    return prog.with_instrs(out, "fuse_rows")
