"""donate_buffers: outputs written into the buffers of donated inputs (sf.jit's donate_argnums,
JAX's), so that an update step `w - lr * g` holds one copy of the weights, not two.

An output takes a donated input's buffer only where that is safe in the plan as it runs: the
same type and layout (so the same pieces on the same devices), and every step that reads the
input (a collective until its Wait) issued before the first step that writes the output, or
that step itself when it is elementwise on the input's very elements (in place).  The plan then
prints the output written into the input (`Sub w <- w, s`, or fused: `Fused w <- w, g, ...`): the donation is visible, and an
output that could take no buffer stays in its own (JAX's donation is a hint too).
"""
from __future__ import annotations

from shardfuse.ir import substitute
from shardfuse.ops import COLLECTIVES, ELEMENTWISE, LOCAL_REDUCTIONS, LOCAL_SCANS, Op
from shardfuse.passes.allocate import view_bases

IN_PLACE = ELEMENTWISE - LOCAL_REDUCTIONS - LOCAL_SCANS | {Op.FUSED}  # each output element from the same element of each input


def _touches(ins, values) -> bool:
    """Whether ins (or its loop body) reads or writes one of `values`."""
    if any(v in values for v in ins.values()) or any(v in values for v in ins.outs):
        return True
    return any(_touches(b, values) for b in ins.body)


def _reads(ins, values) -> bool:
    return any(v in values for v in ins.ins) or any(_touches(b, values) for b in ins.body)


def _writes(ins, values) -> bool:
    return (ins.into is not None and ins.into in values) or any(_writes(b, values) for b in ins.body)


def _safe(prog, inp, root, base) -> bool:
    read_as = {inp} | {v for v, b in base.items() if b == inp}
    written_as = {root} | {v for v, b in base.items() if b == root}
    waits = {}  # a collective's handle -> where its Wait is (the collective reads until then)
    for k, i in enumerate(prog.instrs):
        if i.op == Op.WAIT:
            waits.update({h: k for h in i.ins})
    first_write = next((k for k, i in enumerate(prog.instrs) if _writes(i, written_as)), None)
    if first_write is None:
        return False
    for k, i in enumerate(prog.instrs):
        if not _reads(i, read_as) or i.op in (Op.SLICE, Op.VIEW, Op.TRANSPOSE, Op.SHARD_SLICE, Op.SELECT):
            continue
        last = max([k] + [waits.get(o, k) for o in i.outs if i.op in COLLECTIVES])
        if last < first_write:
            continue
        in_place = (k == first_write and i.op in IN_PLACE and i.into is root and inp in i.ins
                    and not (set(i.ins) - {inp}) & read_as)
        if not in_place:
            return False
    return True


def donate_buffers(prog):
    if not prog.donated:
        return prog.with_instrs(prog.instrs, "donate_buffers")
    base = view_bases(prog)
    allocs = {i.outs[0]: i for i in prog.instrs if i.op == Op.ALLOCATE and i.attrs.get("per_call")}
    mapping, taken = {}, set()
    for out in prog.outputs:
        root = base.get(out, out)
        a = allocs.get(root)
        if a is None or root in mapping or a.attrs.get("order") or a.attrs.get("blocks"):
            continue
        for k in prog.donated:
            inp = prog.inputs[k]
            if inp in taken or inp.type != root.type:
                continue
            if _safe(prog, inp, root, base):
                mapping[root] = inp
                taken.add(inp)
                break
    if not mapping:
        return prog.with_instrs(prog.instrs, "donate_buffers")
    instrs = substitute([i for i in prog.instrs if not (i.op == Op.ALLOCATE and i.outs[0] in mapping)], mapping)
    outputs = tuple(mapping.get(v, v) for v in prog.outputs)
    return prog.with_instrs(instrs, "donate_buffers", outputs=outputs)
