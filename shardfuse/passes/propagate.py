"""propagate_sharding: give every unannotated value a layout, forward through the rule table.

Annotated values keep exactly their annotation; the rest take the layout that needs no
communication (see shardfuse.rules for each op's choice).
"""
from __future__ import annotations

from shardfuse.ir import Instr, Value
from shardfuse.rules import rule


def propagate_sharding(prog):
    env = {v: v for v in prog.inputs}
    out = []
    for i in prog.instrs:
        ins = tuple(env[v] for v in i.ins)
        outs = []
        for o in i.outs:
            if o.type.layout is None:
                lay = rule(i.op, "infer")(Instr(i.op, i.outs, ins, i.attrs), [v.type.layout for v in ins])
                o2 = Value(o.name, o.type.with_layout(lay))
            else:
                o2 = o
            env[o] = o2
            outs.append(o2)
        out.append(Instr(i.op, tuple(outs), ins, i.attrs))
    return prog.with_instrs(out, "propagate_sharding", outputs=tuple(env[v] for v in prog.outputs))
