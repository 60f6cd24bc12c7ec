"""fold_annotations: turn annotation `set`s into the layouts of the values they annotate.

- An input whose spec has no layout takes its first annotation's placement (nvFuser's
  inputs carry their DID layout), also one on the view sf.grad makes of it as a primal inside a
  traced function (transforms._fresh: a training step's value_and_grad states its parameters'
  layouts so), or on a cast of either (a float32 weight's bfloat16 copy), or on one layer w[k] of a
  stacked weight (its leading axis then whole); an input with no annotation is replicated.
- An annotation on the output of an op (used only there) becomes that output's layout, and
  its schedule the op's: `sf.stream(a @ b, axis=0)` makes the matmul itself stream-parallel.
- An annotation that changes nothing is dropped.
What stays is a `set` that really moves data: a resharding for the later passes.
"""
from __future__ import annotations

from collections import Counter

from shardfuse.ir import Value, substitute
from shardfuse.layout import Layout
from shardfuse.ops import Op
from shardfuse import schedule
from shardfuse.schedule import scheduled


def _is_annotation(ins):
    return ins.op == Op.SET and ins.attrs.get("annotation")


def _drop_dead(instrs, outputs):
    """All array-level ops are pure: drop those whose results nobody uses (e.g. an annotation
    that a later one on the same value replaced)."""
    live, out = set(outputs), []
    for i in reversed(instrs):
        if any(o in live for o in i.outs):
            out.append(i)
            live.update(i.ins)
    return out[::-1]


def _layers(instrs) -> dict:
    """w[k] -> (w, 1) for each layer of a stacked weight read as w[k] (a slice of one along axis 0, that
    axis then dropped: sf.lax.scan's and a loop's reads): its annotation places the stacked input,
    the leading axis whole (a JAX-port probe: per-layer sf.shard of w[l] left the stack replicated,
    its gradient gathered)."""
    sliced = {i.outs[0]: i.ins[0] for i in instrs if i.op == Op.SLICE_ARRAY and i.outs[0].type.shape[:1] == (1,)
              and i.outs[0].type.shape[1:] == i.ins[0].type.shape[1:]}
    return {i.outs[0]: (sliced[i.ins[0]], 1) for i in instrs
            if i.op == Op.RESHAPE and i.ins[0] in sliced and i.outs[0].type.shape == i.ins[0].type.shape[1:]}


def _read_as_layers(v, readers, lifts) -> bool:
    """Every read of v (through its primal's view and casts) is a layer w[k] read only by annotations:
    then, and only then, the layers' one placement is the stack's (autodiff gives its gradient the
    same, transforms._layout_of; layers placed apart, or the stack also read whole, leave it
    replicated, as they leave its gradient: a review)."""
    todo = list(readers.get(v, ()))
    while todo:
        i = todo.pop()
        o = i.outs[0] if len(i.outs) == 1 else None
        if o in lifts and lifts[o][1] == 0:  # (a primal's view or a cast: its readers instead)
            todo += readers.get(o, ())
        elif i.op == Op.FULL_LIKE or i.op == Op.SLICE_ARRAY and all(  # (full_like: read for its shape alone)
                r.op == Op.FULL_LIKE or r.outs[0] in lifts and lifts[r.outs[0]][1] == 1 and
                all(_is_annotation(a) for a in readers.get(r.outs[0], ())) for r in readers.get(o, ())):
            continue
        else:
            return False
    return True


def fold_annotations(prog):
    live = _drop_dead(prog.instrs, prog.outputs)
    mapping = {}
    # (an annotation of a primal's view, or of a cast of the input: a float32 master weight's bfloat16
    # copy sharded over tp places the weight so, as JAX's propagation carries a constraint through a cast)
    primal = {i.outs[0]: (i.ins[0], 0) for i in live
              if i.op == Op.RESHAPE and i.attrs.get("primal") or i.op == Op.ASTYPE}
    primal.update(_layers(live))

    def root(x):
        lead = 0
        while x in primal:
            x, k = primal[x]
            lead += k
        return x, lead
    readers, stated = {}, {}  # (each annotation's root input, found once: not once per input)
    for i in live:
        for x in i.ins:
            readers.setdefault(x, []).append(i)
        if _is_annotation(i):
            r, k = root(i.ins[0])
            stated.setdefault(r, []).append((i.outs[0].type.layout, k))
    for v in prog.inputs:
        if v.type.layout is None:
            rooted = stated.get(v, [])
            direct = [lay for lay, k in rooted if k == 0]
            layered = {Layout((None,) * k + lay.axes, lay.partial, lay.mesh, lay.partial_op) for lay, k in rooted if k}
            lay = Layout.replicated(v.type.ndim).on(prog.mesh)
            if direct:  # (its own annotation, or its primal's or cast's, first)
                lay = direct[0]
            elif len(layered) == 1 and _read_as_layers(v, readers, primal):
                lay = layered.pop()
            mapping[v] = Value(v.name, v.type.with_layout(lay))
    inputs = tuple(mapping.get(v, v) for v in prog.inputs)
    instrs = substitute(live, mapping)

    uses = Counter(v for i in instrs for v in i.ins)
    uses.update(prog.outputs)
    producer = {o: i for i in instrs for o in i.outs}
    folded = {}  # producing instr -> annotation set folded into it
    for i in instrs:
        if _is_annotation(i):
            p = producer.get(i.ins[0])
            if p is not None and not _is_annotation(p) and p.outs[0].type.layout is None and uses[i.ins[0]] == 1:
                folded[p] = i

    out, alias = [], {}
    skip = set(folded.values())
    for i in instrs:
        if i in skip:
            continue
        if i in folded:  # the op's own value, with the annotated layout
            ann = folded[i].outs[0]
            o = Value(i.outs[0].name, ann.type)
            alias[ann] = o
            i = type(i)(i.op, (o,), i.ins, scheduled(i.attrs, schedule.of(folded[i])))
        i = substitute([i], alias)[0]
        if _is_annotation(i) and i.ins[0].type.layout == i.outs[0].type.layout and schedule.of(i) is None:
            alias[i.outs[0]] = i.ins[0]
            continue
        out.append(i)
    outputs = tuple(alias.get(mapping.get(v, v), mapping.get(v, v)) for v in prog.outputs)
    return prog.with_instrs(out, "fold_annotations", inputs=inputs, outputs=outputs)
