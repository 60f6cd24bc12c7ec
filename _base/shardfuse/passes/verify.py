"""verify: check a host program before anything runs it.

Every value is defined before use and in scope; every instruction is host-level; every
collective is waited for, in the loop body that started it; every loop body returns to
the main stream; compute shapes and copies agree with their destinations; every value's local shape
follows from its layout (each sharded extent divides evenly) and no Slice cuts a sharded axis.
"""
from __future__ import annotations

from shardfuse.ir import local_shape
from shardfuse.layout import axis_entry
from shardfuse.ops import COMMUNICATION, HOST, Op
from shardfuse.streams import MAIN

class PlanError(AssertionError):
    pass


def _check(cond, msg):
    if not cond:
        raise PlanError(msg)


def verify(prog):
    _check_block(prog.instrs, set(prog.inputs), prog, top=True)
    return prog.with_instrs(prog.instrs, "verify")


def _check_local_shape(v, prog):
    """Each sharded extent is a whole number of shards, so local shapes follow from the layout."""
    t = v.type
    if not hasattr(t, "layout") or t.layout is None:
        return
    _check(t.layout.mesh is not None, f"{v.name}: {t}: a layout in the plan names no mesh")
    sh = t.layout.sharding(prog.mesh)
    both = {n for d in sh.dims for n in d} & set(sh.partial)
    _check(not both, f"{v.name}: {t}: mesh axis {sorted(both)} both shards it and pends a sum")
    for ax, over in enumerate(sh.dims):
        d = sh.count(ax)
        _check(t.shape[ax] % d == 0, f"{v.name}{t.shape}: axis {ax} of extent {t.shape[ax]} is sharded over "
                                     f"{axis_entry(over)} ({d} devices), which does not divide it")


def _check_block(instrs, defined, prog, top):
    pending = set()
    defined = set(defined)
    for i in instrs:
        _check(isinstance(i.op, Op), f"{i.op!r} is not an ops.Op: every instruction names one")
        _check(i.op in HOST, f"{i.op!r} is not a host-level instruction: lowering left it behind")
        for v in i.values():
            _check(v in defined, f"{v.name} is used by {i.op} before it is defined (or outside its loop)")
        for v in (*i.values(), *i.outs):
            _check_local_shape(v, prog)
        if i.op == Op.ALLOCATE:
            _check(top, f"Allocate {i.outs[0].name} inside a stream loop: every buffer is allocated before it (a "
                        "pool per stream, passes/allocate.py), else none is bound")
        if i.op == Op.SLICE:
            src = i.ins[0].type.layout
            _check(src.axes[i.attrs["axis"]] is None,
                   f"Slice {i.outs[0].name} <- {i.ins[0].name}: axis {i.attrs['axis']} is sharded over "
                   f"{src.axes[i.attrs['axis']]}; a chunk of it would cut across shards (reshard first)")
        if i.op == Op.WAIT:
            _check(i.ins[0] in pending, f"Wait {i.ins[0].name} has no collective to wait for")
            pending.discard(i.ins[0])
        if i.op in COMMUNICATION:
            pending.add(i.outs[0])
        if i.op == Op.MATMUL:
            a, b = (v.type.shape for v in i.ins)
            want = a[:-1] + (b[-1],)
            _check(len(b) == 2 or a[:-2] == b[:-2], f"Matmul {i.into.name} <- {a} @ {b}: the batch axes differ")
            _check(i.into.type.shape == want, f"Matmul {i.into.name}{i.into.type.shape} <- {a} @ {b}: expected {want}")
            la, lb = (local_shape(v, prog.mesh) for v in i.ins)
            _check(la[-1] == lb[-2], f"Matmul {i.into.name} <- {i.ins[0].name} @ {i.ins[1].name}: local K differs "
                                     f"({la} @ {lb}): one operand's K is sharded and the other's is not")
        if i.op == Op.COPY:
            src, dst = (local_shape(v, prog.mesh) for v in (i.ins[0], i.into))
            _check(src == dst, f"Copy {i.into.name}{dst} <- {i.ins[0].name}{src}: the local shapes differ")
        if i.op == Op.FOR:
            body = i.body
            _check(body and body[0].op == Op.SET_STREAM, "a stream loop must start by picking its stream")
            last_set = [b for b in body if b.op == Op.SET_STREAM][-1]
            _check(last_set.attrs["stream"] == MAIN, "a stream loop body must return to the main stream")
            carried = {e for b in body if b.op == Op.RECORD_EVENT and "index" in b.attrs for e in b.outs}
            _check_block(body, defined | carried, prog, top=False)  # events of step i - 1 are in scope
        defined.update(i.outs)
    _check(not pending, f"collectives never waited for: {sorted(v.name for v in pending)}")
    if top:
        sets = [i for i in instrs if i.op == Op.SET_STREAM]
        _check(not sets or sets[-1].attrs["stream"] == MAIN, "a plan that switches streams must end on the main stream")
        for v in prog.outputs:
            _check(v in defined, f"output {v.name} is never defined")
