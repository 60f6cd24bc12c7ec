"""Binding the buffers that share a slab (passes/reuse.py): each is a view of its slab's slot from
element 0, with its own shape and strides; the slab is one buffer per device, made once binding is
done, as large as its largest member.  A call then costs nothing more than with a buffer each.

With SHARDFUSE_POISON=1 (tests) a member starts poisoned as a buffer of its own would: a fresh
buffer is NaN, but a slab holds what its previous member left, which would hide an element a step
never writes.  So the first step this process issues from where the member's life starts (see
poison_slabs) first fills the member with poison, on the main stream.  Debugging only: without
SHARDFUSE_POISON the steps are the plan's, as bound.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from shardfuse.backends.protocol import MAIN, Ref
from shardfuse.dtypes import poison_value
from shardfuse.ir import walk
from shardfuse.ops import Op
from shardfuse.passes.reuse import live_ranges
from shardfuse.strides import ordered_strides


def slab_ref(exe, k, shape, dtype, order=None) -> Ref:
    """Executable exe's Ref of a buffer (local shape `shape`, stored in `order`) in slab k."""
    n = math.prod(shape)
    slot = exe.slabs.get(k)
    if slot is None:
        slot = exe.slabs[k] = exe._new_slot((n,), dtype, None).slot
    size = exe._deferred.get(slot, ((0,), dtype))[0][0]
    exe._deferred[slot] = ((max(n, size),), dtype)  # made in _allocate_used, if a step uses it
    return Ref(slot, (0,) * exe.ndev, tuple(shape), ordered_strides(tuple(shape), order), dtype)


def poison_slabs(exe, prog):
    """With SHARDFUSE_POISON=1: each slab member poisoned just before its life starts (module doc)."""
    if os.environ.get("SHARDFUSE_POISON") != "1" or not exe.slabs:
        return
    ranges = live_ranges(prog)
    top = {i: k for k, t in enumerate(prog.instrs) for i in walk([t])}
    fills = {}  # index into exe.steps -> the fills to run before it
    for i in prog.instrs:
        v = i.outs[0] if i.op == Op.ALLOCATE and "slab" in i.attrs else None
        if v is None or v not in ranges:
            continue
        start = ranges[v][0]
        # a stream loop's workers wait for an event the main stream records just before it: fill before that
        while start > 0 and prog.instrs[start - 1].op == Op.RECORD_EVENT:
            start -= 1
        at = next((n for n, s in enumerate(exe.steps) if top[s.instr] >= start), None)
        if at is not None:
            ref = exe.refs[v]
            fill = exe.backend.bind_elementwise(Op.FULL_LIKE, ref, None, ref, MAIN, scalar=poison_value(ref.dtype))
            fills.setdefault(at, []).append(fill)
    for n, before in fills.items():
        exe.steps[n] = replace(exe.steps[n], run=_after(before, exe.steps[n].run))


def _after(before, run):
    def step(bufs):
        for f in before:
            f(bufs)
        run(bufs)
    return step
