"""reuse_buffers: buffers whose lifetimes do not overlap share storage (a slab), decided here and
printed (`c = Allocate f32[8, 4]  (once, in slab 3)`), so that a plan holds about its largest live
set, not the sum of all its intermediates (a training step's activations and gradients).

Liveness is taken over the plan's top-level instructions as they run, streams included
(so this pass runs after assign_streams):
- a buffer lives from the first instruction that touches it (or a view of it) to the last one;
- a collective (or a move between meshes) reads its send buffer and writes its receive buffer
  until its Wait: the Wait touches both;
- a loop counts as one instruction touching everything its body touches: a stream loop's workers
  wait for an event the main stream records just before it, and the loop ends by joining them
  back to the main stream (checked below), so outside loops all work runs on the main stream, in
  order, and a later step on it never overtakes an earlier one;
- but for a gradient bucket's region (or a lone Allreduce's) on its side stream (passes/bucket.py), of one shape only
  (`side_regions`): `e = RecordEvent main`, `SetCurrentStream S`, `WaitEvent e`, then only
  communication and Waits, `SetCurrentStream main`; each collective left running there is waited
  for on main by a Wait right followed by `Synchronize S`.  A buffer touched in the region lives
  from its RecordEvent to the last such Wait (a chained bucket's first Allreduce, waited for on the
  side stream, is not known done on the device before main's join).  So a slab-mate of such a
  buffer either dies before the RecordEvent, and the side stream waits for `e`, which main records
  after that last touch; or it is first touched after the Wait, so on main after the join: either
  way its steps and the side stream's never overlap.  (The main
  stream's steps between the region and the Wait run beside the side stream, but everything
  they touch is live beside the region's buffers, so shares no slab with them.)
- two buffers share a slab only if one's last touch is strictly before the other's first, or the
  one instruction where they meet writes the second in place of the first (`in_place_pairs`): an
  elementwise or fused step whose operand is that buffer itself (no view of it among its operands),
  of the result's dtype, local shape and storage order, dying there; every backend reads element k
  of such an operand before writing element k of the result (NumPy's ufuncs and a fused step's
  last op with `out=`, CuPy's kernels), as XLA's buffer assignment shares an elementwise op's
  operand.  A GEMM is never in place, nor where's halves (NumPy fills the result first).
Only top-level buffers made once are shared: per-call buffers (the outputs) go to the caller, and
pools and double buffers are already shared by design.  Nothing a buffer holds at the end of a call
is read by the next (outputs are per call), so sharing across calls is safe too.

A slab holds one dtype (each member is a view of it from element 0, with the member's own shape:
backends view a slab as any buffer, NumPy and CuPy alike, bfloat16's uint16 storage included);
members are placed largest first, each into the smallest slab of its dtype whose members' lives
it does not overlap (greedy by size).  SHARDFUSE_REUSE=0 turns the pass off (measuring).
"""
from __future__ import annotations

import bisect
import math
import os
from dataclasses import replace

from shardfuse.dtypes import TABLE
from shardfuse.ir import local_shape, walk
from shardfuse.ops import COMMUNICATION, IN_PLACE, Op
from shardfuse.passes.allocate import output_roots, view_bases
from shardfuse.streams import MAIN


def shareable(i) -> bool:
    """A top-level Allocate this pass may place in a slab: made once, not a pool or double buffer."""
    a = i.attrs
    return i.op == Op.ALLOCATE and not (a.get("per_call") or a.get("pool") or a.get("ring"))


def side_regions(instrs):
    """[(first, last, joined)]: the top-level positions of each side-stream region (module doc), its
    RecordEvent, its switch back to main and the last Wait main joins the side stream after; None
    where a top-level stream switch has another shape."""
    out, k = [], 0
    while k < len(instrs):
        if instrs[k].op != Op.SET_STREAM:
            k += 1
            continue
        side, rec = instrs[k].attrs["stream"], instrs[k - 1] if k else None
        end = next((j for j in range(k + 1, len(instrs)) if instrs[j].op == Op.SET_STREAM), None)
        body = instrs[k + 1:end] if end else ()
        if (not isinstance(side.index, int) or rec is None or rec.op != Op.RECORD_EVENT or rec.attrs["stream"] != MAIN
                or not body or instrs[end].attrs["stream"] != MAIN or body[0].op != Op.WAIT_EVENT or body[0].ins != rec.outs
                or any(b.op not in COMMUNICATION and b.op != Op.WAIT or "when" in b.attrs for b in body[1:])):
            return None
        running = {b.outs[0] for b in body if b.op in COMMUNICATION} - {h for b in body if b.op == Op.WAIT for h in b.ins}
        joined = end
        for h in running:  # waited for on main, and main joins the side stream right there
            w = next((j for j in range(end, len(instrs)) if instrs[j].op == Op.WAIT and h in instrs[j].ins), -1)
            if not 0 < w < len(instrs) - 1 or instrs[w + 1].op != Op.SYNCHRONIZE or instrs[w + 1].attrs["stream"] != side:
                return None
            joined = max(joined, w)
        out.append((k - 1, end, joined))
        k = end + 1
    return out


def _streams_rejoin(prog) -> bool:
    """Whether all top-level work runs on the main stream but side-stream regions of the one shape
    known (side_regions), and every loop that switches ends by switching back to main and joining
    every stream it used."""
    if side_regions(prog.instrs) is None:
        return False
    for i in prog.instrs:
        sets = [k for k, b in enumerate(i.body) if b.op == Op.SET_STREAM]
        if i.op != Op.FOR or not sets:
            continue
        last, tail = i.body[sets[-1]], i.body[sets[-1] + 1:]
        used = {i.body[k].attrs["stream"] for k in sets} - {MAIN}
        if (last.attrs.get("stream") != MAIN or any(b.op != Op.SYNCHRONIZE for b in tail)
                or not used <= {b.attrs["stream"] for b in tail}):
            return False
    return True


def live_ranges(prog) -> dict:
    """buffer -> (first, last): the top-level positions that touch it or a view of it, a
    communication's buffers until its Wait, a side-stream region's from its RecordEvent to its join."""
    base = view_bases(prog)
    region = {k: (first, joined) for first, last, joined in side_regions(prog.instrs) or () for k in range(first, last + 1)}
    comm = {}  # communication handle -> the buffers it reads and writes
    for i in walk(prog.instrs):
        if i.op in COMMUNICATION:
            comm[i.outs[0]] = {base.get(v, v) for v in i.values()}
    ranges = {}
    for k, top in enumerate(prog.instrs):
        touched = set()
        for i in walk([top]):
            if i.op == Op.WAIT:
                touched.update(b for h in i.ins for b in comm.get(h, ()))
            elif i.op != Op.ALLOCATE:
                touched.update(base.get(v, v) for v in (*i.values(), *i.outs))
        lo, hi = region.get(k, (k, k))
        for b in touched:
            first, last = ranges.get(b, (lo, hi))
            ranges[b] = (first, max(last, hi))
    return ranges


def in_place_pairs(prog, ranges) -> set:
    """{(operand, result)}: top-level buffers made once where instruction k, the operand's last
    touch and the result's first, may write the result over the operand (module doc)."""
    base = view_bases(prog)
    made = {i.outs[0]: i.attrs for i in prog.instrs if shareable(i)}
    pairs = set()
    for k, i in enumerate(prog.instrs):
        op = i.attrs["expr"].op if i.op == Op.FUSED else i.op
        out = i.into
        if op not in IN_PLACE or out not in made or ranges.get(out, (-1,))[0] != k:
            continue
        for v in set(i.ins):
            if (v in made and ranges[v][1] == k and v.type.dtype == out.type.dtype
                    and local_shape(v, prog.mesh) == local_shape(out, prog.mesh)
                    and made[v].get("order") == made[out].get("order") and not (made[v].get("blocks") or made[out].get("blocks"))
                    and all(u is v for u in i.ins if base.get(u, u) is v)):
                pairs.add((v, out))
    return pairs


def nbytes(v, mesh) -> int:
    """Bytes of v's piece on one device."""
    return math.prod(local_shape(v, mesh)) * TABLE[v.type.dtype].itemsize


class _Lives:
    """The live ranges of a slab's members, by start, with the latest end up to each: the members
    whose range meets another's are found by bisection, not by asking every member (a deep model's
    thousand buffers against every slab was quadratic)."""

    def __init__(self, v, life):
        self.starts, self.items, self.latest = [life[0]], [(life, v)], [life[1]]

    def apart(self, v, life, pairs) -> bool:
        """Whether v's life meets no member's, but where they are an in-place pair."""
        k = bisect.bisect_right(self.starts, life[1]) - 1
        while k >= 0 and self.latest[k] >= life[0]:  # (members from k down whose range may reach v's start)
            (s, e), m = self.items[k]
            if e >= life[0] and (m, v) not in pairs and (v, m) not in pairs:
                return False
            k -= 1
        return True

    def add(self, v, life):
        k = bisect.bisect_right(self.starts, life[0])
        self.starts.insert(k, life[0])
        self.items.insert(k, (life, v))
        self.latest.insert(k, life[1])
        for j in range(k, len(self.latest)):  # (the latest end up to each member, from v's place on)
            end = self.items[j][0][1]
            self.latest[j] = max(self.latest[j - 1], end) if j else end


def assign_slabs(prog) -> dict:
    """buffer -> slab number, for buffers that share a slab with at least one other."""
    ranges = live_ranges(prog)
    outs = output_roots(prog)
    cands = [i.outs[0] for i in prog.instrs if shareable(i) and i.outs[0] in ranges and i.outs[0] not in outs]
    order = {v: k for k, v in enumerate(cands)}
    pairs = in_place_pairs(prog, ranges)

    slabs = []  # ((dtype, devices), size in bytes, members, their live ranges)
    for v in sorted(cands, key=lambda v: (-nbytes(v, prog.mesh), order[v])):
        kind = (v.type.dtype, devices_of_value(v))  # (a pipeline stage's buffers share only with its own)
        fits = [sl for sl in slabs if sl[0] == kind and sl[3].apart(v, ranges[v], pairs)]
        if fits:
            sl = min(fits, key=lambda sl: sl[1])
            sl[2].append(v)
            sl[3].add(v, ranges[v])
        else:
            slabs.append((kind, nbytes(v, prog.mesh), [v], _Lives(v, ranges[v])))
    shared = [sl[2] for sl in slabs if len(sl[2]) > 1]
    shared.sort(key=lambda members: min(order[m] for m in members))  # numbered as the plan first uses them
    return {m: n for n, members in enumerate(shared) for m in members}


def reuse_buffers(prog):
    if os.environ.get("SHARDFUSE_REUSE", "1") == "0" or not _streams_rejoin(prog):
        return prog.with_instrs(prog.instrs, "reuse_buffers")
    slab = assign_slabs(prog)
    # printed: `d_2 = Allocate f32[8, 4]  (once, in slab 3, in place of d)`
    over = {r: v.name for v, r in in_place_pairs(prog, live_ranges(prog)) if r in slab and slab.get(v) == slab[r]}
    out = [replace(i, attrs={**i.attrs, "slab": slab[i.outs[0]], **({"in_place_of": over[i.outs[0]]}
                                                                     if i.outs[0] in over else {})})
           if i.op == Op.ALLOCATE and i.outs[0] in slab else i for i in prog.instrs]
    return prog.with_instrs(out, "reuse_buffers")


def devices_of_value(v) -> tuple:
    """The global ids of the devices value v's buffer is made on: its mesh's (a stage's, or the program's)."""
    return tuple(v.type.layout.mesh.devices)


def memory(prog) -> dict:
    """Bytes of a plan's buffers on its most loaded device (a pipeline stage's buffers are made on
    that stage's devices only): `persistent`, made once (pools and double buffers counted in full,
    a slab once at its largest member), and `unshared`, what they would be with no slab shared;
    `per_call`: the outputs' buffers, made at every call, on that device; `device`: its id (the
    largest persistent + per_call, the lowest id of equals).  Every Allocate counts, also one no step uses."""
    figs = {d: {"persistent": 0, "unshared": 0, "per_call": 0} for d in prog.mesh.devices}
    slab_size = {}  # slab -> (bytes, devices)
    for i in walk(prog.instrs):
        if i.op != Op.ALLOCATE:
            continue
        a, n, devices = i.attrs, nbytes(i.outs[0], prog.mesh) * i.attrs.get("pool", 1), devices_of_value(i.outs[0])
        for d in devices:
            figs[d]["per_call" if a.get("per_call") else "unshared"] += n
            if not a.get("per_call") and "slab" not in a:
                figs[d]["persistent"] += n
        if "slab" in a:
            slab_size[a["slab"]] = (max(slab_size.get(a["slab"], (0, ()))[0], n), devices)
    for n, devices in slab_size.values():
        for d in devices:
            figs[d]["persistent"] += n
    device = max(figs, key=lambda d: (figs[d]["persistent"] + figs[d]["per_call"], -d))
    return {**figs[device], "device": device}
