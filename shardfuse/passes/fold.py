"""fold_collectives: decisions about buffers that used to be made while binding, made here so
that `print(plan)` shows them and `plan.collectives()` counts only what runs.

- A collective over a team of one device is the identity: its destination becomes a view of
  its source (`y = View x, folded=allgather`), and the collective and its Wait go.  Not when
  the destination is a plan output's buffer (a result must not alias an argument), when the
  local shapes differ, or when its buffer is also read another way than through such
  destinations (a whole output whose chunks were all-reduced would stay unwritten).
  Buffers nothing uses any more are dropped.  Where the destination cannot be a view (a chunk of a
  buffer read whole after a stream loop, an output's buffer), the collective becomes a Copy.
- A buffer that an Allgather fills along an inner axis whose local extent is 1 is stored
  rank-major (that axis first), so NCCL writes it in place with no staging copy: its
  Allocate gets `order=` (printed as "rank-major").
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Instr, Namer, Value, local_shape, substitute, walk
from shardfuse.layout import shard_count
from shardfuse.ops import COLLECTIVES, Op, VIEWS
from shardfuse.passes.allocate import output_roots, view_bases


def fold_collectives(prog):
    ctx = (_foldable(prog), output_roots(prog), view_bases(prog), {}, set(), Namer.for_program(prog))
    instrs = _fold(prog.instrs, prog, ctx)
    instrs = _drop_unused(instrs, set(prog.outputs))
    instrs = _rank_major(instrs, prog)
    return prog.with_instrs(instrs, "fold_collectives")


def _team_size(i, prog):
    return shard_count(i.attrs["team"], i.ins[0].type.layout.mesh)


def _fold(instrs, prog, ctx):
    foldable, roots, base, alias, handles, namer = ctx
    out = []
    for i in instrs:
        if i.op == Op.FOR:
            out.append(replace(i, body=tuple(_fold(i.body, prog, ctx))))
            continue
        i = substitute([i], alias)[0]
        if i.op == Op.WAIT and i.ins[0] in handles:
            continue
        identity = (i.op in COLLECTIVES and i.op != Op.SENDRECV and "when" not in i.attrs and _team_size(i, prog) == 1
                    and local_shape(i.ins[0], prog.mesh) == local_shape(i.into, prog.mesh))
        if identity and i.into in foldable and base.get(i.into, i.into) not in roots:
            y = i.into
            view = Value(namer(y.name + "_folded"), y.type)
            out.append(Instr(Op.VIEW, (view,), (i.ins[0],), {"shape": y.type.shape, "folded": f"{i.op} over "
                                                                f"{i.attrs['team']} (1 device)"}))
            alias[y] = view
            handles.add(i.outs[0])
            continue
        if identity:  # (a destination that cannot be a view, a chunk of a buffer read whole after a stream
            # loop, an output: a copy on the device, no communication; a probe counted a dp x tp(1) layer's
            # ReduceScatters over tp)
            out.append(Instr(Op.COPY, (), (i.ins[0],), {}, into=i.into))
            handles.add(i.outs[0])
            continue
        out.append(i)
    return out


def _foldable(prog):
    """Destinations of one-device collectives all of whose buffer's reads go through such a
    destination (or a view of one)."""
    parent, candidates, reads = {}, set(), list(prog.outputs)
    for i in walk(prog.instrs):
        if i.op in VIEWS:
            parent[i.outs[0]] = i.ins[0]
            continue
        reads.extend(i.ins)
        if i.op in COLLECTIVES and i.op != Op.SENDRECV and _team_size(i, prog) == 1:
            candidates.add(i.into)

    def chain(v):
        out = [v]
        while out[-1] in parent:
            out.append(parent[out[-1]])
        return out

    root = {c: chain(c)[-1] for c in candidates}
    blocked = set()
    for v in reads:
        vs = chain(v)
        if vs[-1] in root.values() and not candidates.intersection(vs):
            blocked.add(vs[-1])
    return {c for c in candidates if root[c] not in blocked}


def _drop_unused(instrs, outputs):
    """Allocates and views whose values nothing reads or writes any more (a folded destination,
    its pool), innermost first."""
    while True:
        used = set(outputs)
        for i in walk(instrs):
            used.update(i.values())
        dead = {o for i in walk(instrs) if i.op in VIEWS | {Op.ALLOCATE} for o in i.outs if o not in used}
        if not dead:
            return instrs
        instrs = _without(instrs, dead)


def _without(instrs, dead):
    out = []
    for i in instrs:
        if i.outs and set(i.outs) <= dead and (i.op in VIEWS or i.op == Op.ALLOCATE):
            continue
        out.append(replace(i, body=tuple(_without(i.body, dead))) if i.op == Op.FOR else i)
    return out


def _rank_major(instrs, prog):
    order = {}
    for i in walk(instrs):
        if i.op == Op.ALLGATHER and i.attrs["axis"] > 0 and local_shape(i.ins[0], prog.mesh)[i.attrs["axis"]] == 1:
            k, nd = i.attrs["axis"], i.into.type.ndim
            order[i.into] = (k,) + tuple(j for j in range(nd) if j != k)
    return _set_order(instrs, order)


def _set_order(instrs, order):
    out = []
    for i in instrs:
        if i.op == Op.ALLOCATE and i.outs[0] in order and not i.attrs.get("pool"):
            i = replace(i, attrs={**i.attrs, "order": order[i.outs[0]]})
        elif i.op == Op.FOR:
            i = replace(i, body=tuple(_set_order(i.body, order)))
        out.append(i)
    return out
