"""insert_resharding: put a `set` wherever a value's layout is not the one its consumer needs.

Each op's rule (shardfuse.rules) says which input layouts it needs to produce its output
layout; a mismatch becomes `set(x) -> x'` with the needed layout.  An op that produces
pending sums (a contraction over a sharded axis) gets a `set` after it that resolves them
to the annotated layout.  Program outputs never stay partial.
"""
from __future__ import annotations

from dataclasses import replace

from shardfuse.ir import Instr, Namer, Value, substitute
from shardfuse.layout import Layout
from shardfuse.rules import require
from shardfuse.ops import Op
from shardfuse import schedule
from shardfuse.schedule import scheduled


def _tag(src: Layout, dst: Layout) -> str:
    if set(src.partial) - set(dst.partial):
        return "reduced"
    if len(dst.sharded_axes()) > len(src.sharded_axes()):
        return "sliced"
    return "gathered" if len(dst.sharded_axes()) < len(src.sharded_axes()) else "moved"


def insert_resharding(prog):
    namer = Namer.for_program(prog)
    out, memo, alias = [], {}, {}

    def reshard(v, target: Layout):
        if v.type.layout == target:
            return v
        key = (v, target)
        if key not in memo:
            nv = Value(namer(f"{v.name}_{_tag(v.type.layout, target)}"), v.type.with_layout(target))
            out.append(Instr(Op.SET, (nv,), (v,)))
            memo[key] = nv
        return memo[key]

    for i in prog.instrs:
        i = substitute([i], alias)[0]
        if i.op in (Op.SET, Op.VIEW):
            out.append(i)
            continue
        o = i.outs[0]
        where = o.type.layout.mesh  # an op runs on the mesh its output lives on (rules speak of axes only)
        # pending sums are reduced where they are, before a move to another mesh: a sum is never moved
        i = replace(i, ins=tuple(reshard(v, Layout(v.type.layout.axes, mesh=v.type.layout.mesh))
                                 if v.type.layout.mesh != where and v.type.layout.partial else v for v in i.ins))
        req, produced = require(i, o.type.layout, [v.type.layout for v in i.ins])
        req, produced = [r.on(where) for r in req], produced.on(where)
        ins = tuple(reshard(v, r) for v, r in zip(i.ins, req))
        if produced == o.type.layout:
            out.append(Instr(i.op, i.outs, ins, i.attrs))
        else:
            tmp = Value(namer(o.name + ("_partial" if produced.partial else "_local")), o.type.with_layout(produced))
            out.append(Instr(i.op, (tmp,), ins, i.attrs))
            out.append(Instr(Op.SET, (o,), (tmp,), scheduled({}, schedule.of(i))))  # (resolved chunk by chunk too)

    outputs = []
    for v in prog.outputs:
        v = alias.get(v, v)
        lay = v.type.layout
        outputs.append(reshard(v, Layout(lay.axes, mesh=lay.mesh)) if lay.partial else v)
    return prog.with_instrs(out, "insert_resharding", outputs=tuple(outputs))
