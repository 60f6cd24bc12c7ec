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
one, where its step was (every other step of the group came before it, reading what was ready
there).  Where values would join two such groups into one that writes two values (a residual that
a norm reads and a later add too), the earliest value read by several of its steps joins nothing
and the groups are made again (the residual is then an operand of the norm's group).  R's last axis
is whole on every device: over a sharded axis the reduction's result goes to an Allreduce, which
reads it outside any group, so such a softmax stays as it was (and stays right).

A group's step also writes the results of the elementwise steps after it, of the rows' shape or one
value per row, that read a value the step computes (its result, or such a step's) and otherwise only
what is ready where the group runs, or what a step of theirs alone writes from such values (a
weight's cast): `more`, their Exprs, and the step's `outs`, their buffers (made before it).  In a
training step a 16-bit softmax keeps its float32 y for the backward and casts y for the next GEMM:
one pass writes both; a norm's rsqrt and x-hat, both kept for the backward, likewise.  Printed:
`FusedRows d, a_8 <- mask, scores, expr=div(...), more=(astype(div(...)))`.

The step's `expr` is the group as one ops.Expr over the group's operands: each node keeps its own
dtype (rounded as the unfused step rounded it), a reduction node is one value per row (16-bit sums
accumulated in float32, as Sum does; max / min exact).  Equal sub-expressions are one value: the
plan prints the tree, backends compute each once per element.  Printed:
`FusedRows a_2 <- x, expr=astype(div(exp(sub(#0, reduce_max(#0))), sum(exp(sub(#0, reduce_max(#0))))))`.
SHARDFUSE_FUSE=0 turns it off with fuse_elementwise.
"""
from __future__ import annotations

import os
from collections import Counter, defaultdict

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
            self.parent[k] = k = self.parent.get(self.parent[k], self.parent[k])  # (path halving)
        return k

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


class _Facts:
    """Who reads, writes and views each value of the top-level program (the pass's questions)."""

    def __init__(self, prog, instrs):
        self.readers, self.writers = defaultdict(list), defaultdict(list)  # value -> [(position, top-level?)], [position]
        for k, top in enumerate(instrs):
            for i in walk([top]):
                for v in i.ins:
                    self.readers[v].append((k, i is top))
                if i.into is not None:
                    self.writers[i.into].append(k)
        self.once = {i.outs[0] for i in instrs if i.op == Op.ALLOCATE and not any(i.attrs.get(a) for a in (
            "per_call", "pool", "blocks", "order", "ring"))}
        self.allocs = {i.outs[0]: k for k, i in enumerate(instrs) if i.op == Op.ALLOCATE}
        self.defined = {v: k for k, i in enumerate(instrs) for v in i.outs}  # (buffers, views: the instruction)
        self.views = defaultdict(list)
        for k, i in enumerate(instrs):
            if i.op in VIEWS:
                self.views[i.ins[0]].append((k, i))
        self.outputs = set(prog.outputs)
        self.base = view_bases(prog)

    def same_elements(self, u, instrs) -> bool:
        """Whether u holds its buffer's elements in the buffer's own order: the buffer itself, or views
        of it that are all reshapes (Op.VIEW).  A transpose of square rows has the buffer's shape too,
        but not its elements where they are (the review of 2026-12-06: softmax(x).T * 2 read as y * 2)."""
        while u in self.base:
            k = self.defined.get(u)
            if k is None or instrs[k].op != Op.VIEW:
                return False
            u = instrs[k].ins[0]
        return True

    def ready(self, v, at) -> bool:
        """Whether v holds its value before position `at`: an input, or defined (a view made) before it
        and every write of its buffer before it."""
        return self.defined.get(v, -1) < at and all(k < at for k in self.writers.get(self.base.get(v, v), []))

    def members(self, v, role):
        """The positions of v's readers when all are top-level steps of a group's kinds, else None."""
        got = self.readers.get(v, [])
        if not got or v in self.outputs or self.views.get(v) or not all(top and k in role for k, top in got):
            return None
        return [k for k, _ in got]


def _internal(facts, instrs, role):
    """{value: (writer, readers)}: the values that join their writer to their readers (module doc),
    and {keepdims view: the reduction's value} for the views read in place of a reduction's result."""
    inner, kept = {}, {}
    for k, i in enumerate(instrs):
        v = i.into
        if k not in role or v not in facts.once or len(facts.writers[v]) != 1 or v in facts.outputs:
            continue
        if role[k] == _MAP:
            got = facts.members(v, role)
        else:  # a reduction's result: read only through keepdims views, each read only by group steps
            vs = [j for _, j in facts.views.get(v, [])]
            keepdims = len(facts.readers[v]) == len(vs) and all(
                j.op == Op.VIEW and j.outs[0].type.shape == v.type.shape + (1,) for j in vs)
            found = [facts.members(j.outs[0], role) for j in vs] if keepdims else [None]
            got = None if not vs or None in found else [m for f in found for m in f]
            if got:
                kept.update({j.outs[0]: v for j in vs})
        if got:
            inner[v] = (k, got)
    return inner, kept


def _absorbable(facts, instrs, role, u, reader, root, used):
    """The position of the map step that writes u for `reader` alone, its operands ready at root, else None."""
    w = facts.writers.get(u, [])
    ok = (len(w) == 1 and role.get(w[0]) == _MAP and root < w[0] and w[0] not in used and u in facts.once
          and facts.readers[u] == [(reader, True)] and not facts.views.get(u) and u not in facts.outputs
          and all(facts.ready(x, root) for x in instrs[w[0]].ins))
    return w[0] if ok else None


def _trailing(prog, facts, instrs, role, root, exprs, used, row) -> list:
    """[(position, its value, its Expr, absorbed positions)]: the elementwise steps after the group that
    read a value the group's step computes (its result y, a step taken before, or a view of one of its
    shape) and otherwise what is ready where the group runs (or what a step of theirs alone writes
    from such values), each of the rows' shape or one value per row: the group writes them too.
    softmax's float32 y that the backward keeps and its cast for the next GEMM; a norm's rsqrt, x-hat
    and its affine output: one step."""
    y, out = instrs[root].into, []
    if len(facts.writers[y]) != 1:
        return out
    known = {y: exprs.node(root)}  # the values the step computes, as Exprs
    local_row = tuple(np.broadcast_shapes(*(local_shape(v, prog.mesh) for v in exprs.operands)))
    for p in range(root + 1, len(instrs)):
        z = instrs[p]
        if role.get(p) != _MAP or p in used:
            continue
        reads = {u: known[facts.base.get(u, u)] for u in z.ins
                 if facts.base.get(u, u) in known and u.type.shape == facts.base.get(u, u).type.shape
                 and facts.same_elements(u, instrs)}
        absorbed = {u: _absorbable(facts, instrs, role, u, p, root, used) for u in z.ins
                    if u not in reads and not facts.ready(u, root)}
        v = z.into
        if (not reads or None in absorbed.values() or len(facts.writers[v]) != 1 or v not in facts.allocs
                or v.type.shape not in (row, row[:-1] + (1,)) or v.type.layout is None or v.type.layout.partial
                or local_shape(v, prog.mesh) not in (local_row, local_row[:-1] + (1,))):
            continue
        exprs.alias = dict(reads)
        exprs.alias.update({u: exprs.remap(*expr_of(instrs[k])) for u, k in absorbed.items()})
        known[v] = exprs.remap(*expr_of(z))
        out.append((p, v, known[v], set(absorbed.values())))
        used |= {p, *absorbed.values()}
    exprs.alias = {}
    return out


class _Exprs:
    """A group's Exprs over its operands (numbered in the order first read): each member a node, once."""

    def __init__(self, instrs, members, inner, kept):
        self.instrs, self.members, self.inner, self.kept = instrs, members, inner, kept
        self.operands, self.memo, self.alias = [], {}, {}  # alias: a value read as an Expr (a trailing step's)

    def leaf(self, v):
        if v in self.alias:
            return self.alias[v]
        src = self.kept.get(v, v)
        if src in self.inner and self.inner[src][0] in self.members:
            return self.node(self.inner[src][0])
        if v not in self.operands:
            self.operands.append(v)
        return Expr(None, v.type.dtype, arg=self.operands.index(v))

    def remap(self, e, ins):
        if e.op is None:
            return self.leaf(ins[e.arg])
        return Expr(e.op, e.dtype, tuple(self.remap(a, ins) for a in e.args), e.value)

    def node(self, k):
        if k not in self.memo:
            i = self.instrs[k]
            dt = i.into.type.dtype
            factor = i.attrs.get("factor", 1.0)
            if i.op in LOCAL_REDUCTIONS:
                self.memo[k] = Expr(i.op, dt, (self.leaf(i.ins[0]),))
            elif i.op in (Op.SUM, Op.FUSED_SUM):
                arg = self.leaf(i.ins[0]) if i.op == Op.SUM else self.remap(i.attrs["expr"], i.ins)
                self.memo[k] = Expr(Op.SUM, dt, (arg,), None if factor == 1.0 else factor)
            else:
                self.memo[k] = self.remap(*expr_of(i))
        return self.memo[k]


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
    try:
        local_row = tuple(np.broadcast_shapes(*local))
    except ValueError:  # (operands sharded unlike each other: a whole row beside its shard, as log_softmax's
        return False    # cotangent beside its sharded logits)
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
        writes = Counter(groups.find(k) for k in role if instrs[k].into not in inner)
        # (each such group's cut at once: the groups are apart, so cutting one leaves the others as they
        # are, and a deep model's dozens of norms cost one round, not one round each)
        cuts = {}
        for v, (k, readers) in inner.items():
            root = groups.find(k)
            if writes[root] > 1 and len(set(readers)) > 1 and (root not in cuts or k < cuts[root][0]):
                cuts[root] = (k, v)
        if not cuts:
            return list(by_root.values()), inner
        cut = {id(v) for _, v in cuts.values()}
        inner = {v: e for v, e in inner.items() if id(v) not in cut}


def fuse_rows(prog):
    # (SHARDFUSE_FUSE=0: one step per op; SHARDFUSE_FUSE_ROWS=0: chains fused, no row groups: to compare)
    if not enabled(prog.mesh) or os.environ.get("SHARDFUSE_FUSE_ROWS") == "0":
        return prog.with_instrs(prog.instrs, "fuse_rows")
    instrs = list(prog.instrs)
    facts = _Facts(prog, instrs)
    role = {k: r for k, i in enumerate(instrs) if (r := _role(i)) is not None}
    inner, kept = _internal(facts, instrs, role)
    found, inner = _components(instrs, role, inner)
    groups = []
    for members in found:
        outs = [k for k in members if instrs[k].into not in inner]
        if len(members) < 2 or len(outs) != 1 or not any(role[k] == _REDUCE for k in members):
            continue
        exprs = _Exprs(instrs, members, inner, kept)
        expr = exprs.node(outs[0])
        if _valid(prog, instrs, members, outs[0], exprs.operands, role):
            groups.append((members, outs[0], exprs, expr))
    used = {k for members, *_ in groups for k in members}
    drop, place = set(), {}
    for members, root, exprs, expr in groups:
        row = next(reduced_shape(instrs[k]) for k in members if role[k] == _REDUCE)
        more = _trailing(prog, facts, instrs, role, root, exprs, used, row)
        i = instrs[root]
        attrs = {"expr": expr, **({"more": tuple(e for _, _, e, _ in more)} if more else {})}
        moved = [facts.allocs[v] for p, v, _, _ in more if facts.allocs[v] > root]  # (made before the step writes them)
        place[root] = [instrs[k] for k in moved] + [i.__class__(
            Op.FUSED_ROWS, tuple(v for _, v, _, _ in more), tuple(exprs.operands), attrs, into=i.into)]
        gone = ({k for k in members if k != root} | {p for p, *_ in more}
                | {k for *_, absorbed in more for k in absorbed})
        dead = {instrs[k].into for k in gone} - {v for _, v, _, _ in more}
        drop |= gone | set(moved) | {k for k, j in enumerate(instrs) if (j.op == Op.ALLOCATE and j.outs[0] in dead)
                                     or (j.op == Op.VIEW and kept.get(j.outs[0]) in dead)}
    out = [j for k, i in enumerate(instrs) if k not in drop or k in place for j in place.get(k, [i])]
    return prog.with_instrs(out, "fuse_rows")
