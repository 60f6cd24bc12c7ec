"""Binding the buffers that share a slab (passes/reuse.py): each is a view of its slab's slot from
element 0, with its own shape and strides; the slab is one buffer per device, made once binding is
done, as large as its largest member.  A call then costs nothing more than with a buffer each.

With SHARDFUSE_POISON=1 (tests) a member starts poisoned as a buffer of its own would: a fresh
buffer is NaN, but a slab holds what its previous member left, which would hide an element a step
never writes.  So the first step this process issues from where the member's life starts (see
poison_slabs) first fills the member with poison, on the main stream; but not a member written in
place of a slab-mate (reuse.in_place_pairs, found again in the plan as bound: a plan that lost the
step writing it in place gets its poison): that step reads the mate there, and writes every element.
Debugging only: without SHARDFUSE_POISON the steps are the plan's, as bound.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from shardfuse.dtypes import poison_value
from shardfuse.ir import walk
from shardfuse.steps import mesh_of
from shardfuse.ops import Op
from shardfuse.passes.reuse import in_place_pairs, live_ranges
from shardfuse.streams import MAIN
from shardfuse.strides import ordered_strides


def member_ref(slabs, new_slot, deferred, k, shape, dtype, order=None):
    """The Ref of a buffer (local shape `shape`, stored in `order`) in slab k: slabs maps slab
    numbers to their Ref (made here by new_slot(shape, dtype, None) for the first member), deferred
    the executor's buffers to make once binding is done (the slab: as large as its largest member)."""
    n = math.prod(shape)
    if k not in slabs:
        slabs[k] = new_slot((n,), dtype, None)
    slot = slabs[k].slot
    size = deferred.get(slot, ((0,), dtype))[0][0]
    deferred[slot] = ((max(n, size),), dtype)  # (made only if a step uses it, as any buffer)
    return replace(slabs[k], shape=tuple(shape), strides=ordered_strides(tuple(shape), order))


def poison_slabs(exe, prog):
    """With SHARDFUSE_POISON=1: each slab member poisoned just before its life starts (module doc)."""
    if os.environ.get("SHARDFUSE_POISON") != "1" or not exe.slabs:
        return
    ranges = live_ranges(prog)
    slab = {i.outs[0]: i.attrs["slab"] for i in prog.instrs if i.op == Op.ALLOCATE and "slab" in i.attrs}
    over = {r for v, r in in_place_pairs(prog, ranges) if v in slab and slab.get(r) == slab[v]}
    top = {i: k for k, t in enumerate(prog.instrs) for i in walk([t])}
    fills = {}  # index into exe.steps -> the fills to run before it
    for v in slab:
        if v not in ranges or v in over:
            continue
        start = ranges[v][0]
        # a stream loop's workers wait for an event the main stream records just before it: fill before that
        # (a bucket's side stream waits for one too: live_ranges starts the buffers of its region there)
        while start > 0 and prog.instrs[start - 1].op == Op.RECORD_EVENT:
            start -= 1
        at = next((n for n, s in enumerate(exe.steps) if top[s.instr] >= start), None)
        mine = set(mesh_of(v).devices)
        here = tuple(j for j, d in enumerate(exe.backend.local_devices) if d in mine)
        if at is not None and here:
            ref = exe.refs[v]
            fill = exe.backend.bind_elementwise(Op.FULL_LIKE, ref, None, ref, MAIN, scalar=poison_value(ref.dtype),
                                                devices=here)
            fills.setdefault(at, []).append(fill)
    for n, before in fills.items():
        exe.steps[n] = replace(exe.steps[n], run=_after(before, exe.steps[n].run))


def _after(before, run):
    def step(bufs):
        for f in before:
            f(bufs)
        run(bufs)
    return step
