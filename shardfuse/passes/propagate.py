"""propagate_sharding: give every unannotated value a layout.

Forward: each op's rule infers the layout that needs no communication from its inputs
(shardfuse.rules; for matmul the weight's sharding wins ties, as in nvFuser).
Backward: an unannotated intermediate that every consumer needs *more* sharded (the rest
being equal) is produced that way from the start, provided its producer can do so with
local slices only: the work is split instead of done whole and sliced afterwards.
Annotated values keep exactly their annotation.  Both sweeps go in program order, so the
result is deterministic.
A value pending sums that one consumer needs reduced while another would carry the sums on is
reduced once, right after it is made, for all of them (a forward sweep again, until none is left).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from shardfuse.ir import Instr, Namer, Value, substitute
from shardfuse.layout import Layout
from shardfuse.mesh import meeting_mesh
from shardfuse.rules import infer, require
from shardfuse.ops import Op, Reduce
from shardfuse import schedule


def propagate_sharding(prog):
    instrs, outputs, namer = list(prog.instrs), prog.outputs, Namer.for_program(prog)
    moves = _Moves(namer)
    for _ in range(len(instrs) + 1):  # (each round reduces values no earlier round did: bounded)
        out, out_values, inferred = _forward(prog, instrs, outputs, moves)
        once = _reduced_once(out, out_values)
        if not once:
            break
        instrs, outputs = _with_reductions(instrs, outputs, once, namer)
    out, out_values = _without_idle_reductions(out, out_values)
    out, out_values = _backward(out, out_values, inferred)
    return prog.with_instrs(out, "propagate_sharding", outputs=out_values)


def _forward(prog, instrs, outputs, moves):
    """Each unannotated value gets the layout its op's rule infers from its inputs' layouts."""
    env = {v: v for v in prog.inputs}
    out, inferred, emitted = [], set(), set()
    for i in instrs:
        ins = tuple(env[v] for v in i.ins)
        if i.op not in (Op.SET, Op.VIEW) and len({v.type.layout.mesh for v in ins}) > 1:
            ins = moves.onto_stage(ins, out, emitted)
        outs = []
        for o in i.outs:
            if i.attrs.get("reduced_once"):  # (this pass' own set: its source, reduced, as inferred now)
                o2 = Value(o.name, o.type.with_layout(replace(ins[0].type.layout, partial=())))
            elif o.type.layout is None:
                lay = infer(Instr(i.op, i.outs, ins, i.attrs), [v.type.layout for v in ins])
                o2 = Value(o.name, o.type.with_layout(lay.on(_common_mesh(i, ins, prog.mesh))))
                inferred.add(o2)
            else:
                o2 = o
            env[o] = o2
            outs.append(o2)
        out.append(Instr(i.op, tuple(outs), ins, i.attrs))
    return out, tuple(env[v] for v in outputs), inferred


def _reduced_once(instrs, outputs) -> set:
    """The names of the values pending sums that one consumer (or the program's result) needs
    reduced where it is, while another would carry the sums on: every consumer then reads the one
    reduced copy (Megatron's single Allreduce after a vocab-parallel embedding, not a second one
    after the norm and every weight gathered for it)."""
    consumers = defaultdict(list)
    for i in instrs:
        for n, v in enumerate(i.ins):
            if i.op not in (Op.SET, Op.VIEW):  # (a reshard or a view states no requirement of its own)
                consumers[v].append((i, n))
    found = set()
    for i in instrs:
        for o in i.outs:
            lay = o.type.layout
            if not lay.partial or lay.partial_op != Reduce.SUM or not consumers[o]:
                continue
            wants = [_required(c, n) for c, n in consumers[o]]
            whole = [not w.partial and w.axes == lay.axes for w in wants]
            if (o in outputs or any(whole)) and not all(whole):
                found.add(o.name)
    return found


def _with_reductions(instrs, outputs, once, namer):
    """The program with `set(v) -> v_reduced` after each value named in `once`, read by all of
    v's consumers (and the program's results) instead of v.  Its layout is left to the next
    forward sweep: v's as inferred then, without pending sums (a value upstream reduced in the same
    round may leave v whole, and the set a plain copy of the name)."""
    out, mapping = [], {}
    for i in instrs:
        i = substitute([i], mapping)[0]
        out.append(i)
        for o in i.outs:
            if o.name in once:
                r = Value(namer(f"{o.name}_reduced"), o.type)
                out.append(Instr(Op.SET, (r,), (o,), {"reduced_once": True}))
                mapping[o] = r
    return out, tuple(mapping.get(v, v) for v in outputs)


def _without_idle_reductions(instrs, outputs):
    """This pass' sets whose source a later round left whole are dropped, their readers reading
    the source (lowered, such a set would be a copy)."""
    out, mapping = [], {}
    for i in instrs:
        i = substitute([i], mapping)[0]
        if i.attrs.get("reduced_once") and i.ins[0].type.layout == i.outs[0].type.layout:
            mapping[i.outs[0]] = i.ins[0]
        else:
            out.append(i)
    return out, tuple(mapping.get(v, v) for v in outputs)


class _Moves:
    """An op reading values of a sub-mesh (a pipeline stage) beside values replicated on a mesh holding
    all its devices (a NumPy constant, a learning rate, an optimizer's step count: the program's whole
    mesh) reads the replicated ones moved onto the sub-mesh first, each device's copy of its own (a
    pipeline probe: sf.optim's adam, causal attention and np.arange(8.0) * x were refused on a stage).
    Sharded values or sums on two meshes still need the user's move.  The moved values are named once
    (propagation's rounds meet the same ops again)."""

    def __init__(self, namer):
        self.namer, self.made = namer, {}

    def onto_stage(self, ins, out, emitted):
        """ins with the replicated ones moved onto the stage, each move appended to out once (`emitted`)."""
        target = _stage_of([v.type.layout for v in ins])
        if target is None:
            return ins  # (_common_mesh refuses, naming the operands)
        moved = []
        for v in ins:
            if v.type.layout.mesh != target:
                key = (v.name, target)
                if key not in self.made:
                    lay = Layout((None,) * v.type.ndim, mesh=target)
                    self.made[key] = Value(self.namer(f"{v.name}_on_stage"), v.type.with_layout(lay))
                if key not in emitted:
                    emitted.add(key)
                    out.append(Instr(Op.SET, (self.made[key],), (v,), {"annotation": True}))
                v = self.made[key]
            moved.append(v)
        return tuple(moved)


def _stage_of(lays):
    """The one sub-mesh the operands' sharded or pending values live on, where every other operand is
    replicated on a mesh holding all its devices; None where the operands share a mesh or no such one is."""
    meshes = {lay.mesh for lay in lays}
    if len(meshes) < 2:
        return None
    whole = [lay for lay in lays if not lay.partial and not lay.sharded_axes()]
    m = meeting_mesh(meshes)  # (ties broken alike on every rank)
    return m if m is not None and all(lay.mesh == m or lay in whole for lay in lays) else None


def _common_mesh(i, ins, mesh):
    """An unannotated result lives where its operands live; operands on different sub-meshes
    need an explicit move (sf.shard / sf.replicate with mesh=)."""
    meshes = {v.type.layout.mesh for v in ins}
    if len(meshes) > 1:
        names = ", ".join(f"{v.name} on {v.type.layout.mesh}" for v in ins)
        raise ValueError(f"{i.op}: operands live on different meshes ({names}); move one with "
                         f"sf.replicate(x, mesh=...) or sf.shard(x, ..., mesh=...)")
    return meshes.pop() if meshes else mesh


def _refines(want, have) -> bool:
    """want only adds shardings to have (R -> S on some axes: a local slice, no communication)."""
    if want.partial != have.partial or len(want.axes) != len(have.axes):
        return False
    return all(h is None or h == w for w, h in zip(want.axes, have.axes)) and want.axes != have.axes


def _required(instr, n):
    lays = [v.type.layout for v in instr.ins]
    return require(instr, instr.outs[0].type.layout, lays)[0][n]


def _backward(instrs, outputs, inferred):
    """Refinements one at a time, always the last instruction's that has one (so the result is the
    same whatever the program's size), each check kept until a refinement nearby can change it:
    a value's new layout changes only the checks of its producer, its consumers and the producers
    of their operands (a training step's 99 rounds re-checked all ~800 steps each: 75% of its compile)."""
    instrs, outputs = list(instrs), list(outputs)
    producer = {o: k for k, i in enumerate(instrs) for o in i.outs}
    consumers = defaultdict(list)  # value -> [(position of a top-level step reading it, operand number)]
    for k, i in enumerate(instrs):
        for n, v in enumerate(i.ins):
            consumers[v].append((k, n))

    def check(k):
        return _refinement_at(instrs[k], instrs, outputs, inferred, consumers)
    found = {k: r for k in range(len(instrs)) if (r := check(k)) is not None}
    while found:
        k = max(found)
        old, new = found.pop(k)
        inferred.add(new)
        users = consumers.pop(old, [])
        for q in {k} | {c for c, _ in users}:
            instrs[q] = substitute([instrs[q]], {old: new})[0]
        consumers[new], producer[new] = users, producer.pop(old)
        outputs = [new if v is old else v for v in outputs]
        touched = {k} | {producer[v] for v in instrs[k].ins if v in producer}
        for c, _ in users:
            touched |= {c} | {producer[w] for w in instrs[c].ins if w in producer}
        for q in touched:
            r = check(q)
            if r is None:
                found.pop(q, None)
            else:
                found[q] = r
    return instrs, tuple(outputs)


def _refinement_at(p, instrs, outputs, inferred, consumers):
    """(o, o more sharded) for the first result o of step p that every consumer needs more sharded
    and p can make so with local slices at most, else None."""
    for o in p.outs:
        lay = o.type.layout
        readers = [(instrs[c], n) for c, n in consumers.get(o, ())]
        if o not in inferred or o in outputs or lay.partial or schedule.of(p) is not None or not readers:
            continue
        if any(c.op in (Op.SET, Op.VIEW) for c, _ in readers):
            continue  # a reshard or a view states no requirement of its own
        if any(c.outs and c.outs[0].type.layout.mesh != lay.mesh for c, _ in readers):
            continue  # a consumer on another mesh: o moves there, and its sharding there need not divide here
        wants = {_required(c, n) for c, n in readers}
        if len(wants) != 1:
            continue
        want = wants.pop()
        if not _refines(want, lay):
            continue
        want = want.on(lay.mesh)
        # the producer must make `want` from its inputs with local slices at most
        trial = Instr(p.op, (Value(o.name, o.type.with_layout(want)),), p.ins, p.attrs)
        req, produced = require(trial, want, [v.type.layout for v in p.ins])
        if produced.on(want.mesh) != want:  # (a rule's layouts name no mesh: the caller's is theirs)
            continue
        if all(r.on(v.type.layout.mesh) == v.type.layout or _refines(r, v.type.layout) for r, v in zip(req, p.ins)):
            return o, Value(o.name, o.type.with_layout(want))
    return None
