"""donate_buffers: outputs written into the buffers of donated inputs (sf.jit's donate_argnums,
JAX's), so that an update step `w - lr * g` holds one copy of the weights, not two.

An output takes a donated input's buffer only where that is safe in the plan as it runs: the
same type and layout (so the same pieces on the same devices), and every step that reads the
input (a collective until its Wait) issued before the first step that writes the output, or
that step itself when it is elementwise on the input's very elements (in place); a copy of the input
into the output that comes first (a dynamic_update_slice's) is dropped, not counted.  The plan then
prints the output written into the input (`Sub w <- w, s`, or fused: `Fused w <- w, g, ...`): the donation is visible, and an
output that could take no buffer stays in its own (JAX's donation is a hint too).
"""
from __future__ import annotations

import inspect
import os
import warnings
from collections import defaultdict

from shardfuse.ir import substitute
from shardfuse.ops import COLLECTIVES, COMMUNICATION, ELEMENTWISE, LOCAL_REDUCTIONS, LOCAL_SCANS, STREAM_OPS, Op
from shardfuse.passes.allocate import view_bases

IN_PLACE = ELEMENTWISE - LOCAL_REDUCTIONS - LOCAL_SCANS | {Op.FUSED}  # each output element from the same element of each input


def _touched(body) -> set:
    """The values a loop body reads or writes (its steps' operands, results and outputs), recursively."""
    return {v for b in body for v in (*b.values(), *b.outs)} | {v for b in body for v in _touched(b.body)}


def _written(body) -> set:
    return {b.into for b in body if b.into is not None} | {v for b in body for v in _written(b.body)}


class _Index:
    """Made once per program: the top-level steps that read each value (a step's operands, or anything
    its loop body touches) and that write it (`into`, in a body too), each in program order; where
    each collective's Wait is; the views of each buffer.  _safe then looks at those steps only (it
    scanned the whole program per output and donated input: a quarter of a training step's compile)."""

    def __init__(self, prog, base, taken_by=None):
        self.readers, self.writers = defaultdict(list), defaultdict(list)
        self.waits = {}  # a collective's handle -> where its Wait is (the collective reads until then)
        for k, i in enumerate(prog.instrs):
            if i.op == Op.WAIT:
                self.waits.update({h: k for h in i.ins})
            for v in set(i.ins) | _touched(i.body):
                self.readers[v].append(k)
            for v in ({i.into} if i.into is not None else set()) | _written(i.body):
                self.writers[v].append(k)
        self.views, self.base = defaultdict(set), base
        for v, b in base.items():
            self.views[b].add(v)
        for root, inp in (taken_by or {}).items():
            self.alias(root, inp)

    def alias(self, root, inp):
        """root takes inp's buffer: root's steps are that buffer's, so a later pair's checks see them (a probe's
        (x + v, v - x) read x after x + v was written into it)."""
        self.readers[inp] = sorted(set(self.readers[inp]) | set(self.readers[root]))
        self.writers[inp] = sorted(set(self.writers[inp]) | set(self.writers[root]))
        self.views[inp] |= {root} | self.views[root]

    def steps(self, table, values) -> list:
        return sorted({k for v in values for k in table.get(v, ())})


def _copies(i, inp, root) -> bool:
    """Whether i is `Copy root <- inp`: the copy of its operand a dynamic_update_slice's result starts
    from (passes/lower.py).  Where root takes inp's buffer, which holds those values already, it is
    dropped, and the update writes only its box into the donated buffer (XLA's in-place update)."""
    return i.op == Op.COPY and i.into is root and i.ins == (inp,)


def _safe(prog, inp, root, index) -> bool:
    read_as, written_as = {inp} | index.views[inp], {root} | index.views[root]
    writes = index.steps(index.writers, written_as)
    copied = writes[0] if writes and _copies(prog.instrs[writes[0]], inp, root) else None
    writes = writes[1:] if copied is not None else writes  # (that copy is dropped: donate_buffers)
    if not writes:  # (a result that is the input's copy, returned as it was, takes its buffer: no copy)
        return copied is not None
    first_write = writes[0]
    for k in index.steps(index.readers, read_as):
        i = prog.instrs[k]
        if k == copied or i.op in (Op.SLICE, Op.VIEW, Op.TRANSPOSE, Op.SHARD_SLICE, Op.SELECT):
            continue
        last = max([k] + [index.waits.get(o, k) for o in i.outs if i.op in COLLECTIVES])
        if last < first_write:
            continue
        in_place = (k == first_write and i.op in IN_PLACE and i.into is root and inp in i.ins
                    and not (set(i.ins) - {inp}) & read_as)
        if not in_place:
            return False
    return True


def _sunk(prog, inp, root, index):
    """prog's instructions with root's one write (a top-level elementwise step) moved to just after the last
    step that reads inp, where the steps between neither read root (or a view of it) nor write what the
    write reads, and are plain top-level steps (no loop, stream switch, event or communication): then
    root can take inp's buffer (a fused update that still reads the old momentum after the new one is
    computed, Lion's).  None where that is not so."""
    writes = index.steps(index.writers, {root} | index.views[root])
    reads = [k for k in index.steps(index.readers, {inp} | index.views[inp]) if writes and k > writes[0]]
    if len(writes) != 1 or not reads or prog.instrs[writes[0]].op not in IN_PLACE:
        return None
    w, last = writes[0], max(reads)
    moved = prog.instrs[w]
    between = prog.instrs[w + 1:last + 1]
    if any(i.body or i.op in STREAM_OPS or i.op in COMMUNICATION or i.op == Op.WAIT for i in between):
        return None
    later = set(range(w + 1, last + 1))
    read = set(moved.ins) | {index.base[v] for v in moved.ins if v in index.base}  # (x.T read: x's writes count)
    if later & set(index.steps(index.readers, {root} | index.views[root])) or \
            later & set(index.steps(index.writers, read)):
        return None
    return [*prog.instrs[:w], *between, moved, *prog.instrs[last + 1:]]


def donate_buffers(prog):
    if not prog.donated:
        return prog.with_instrs(prog.instrs, "donate_buffers")
    base = view_bases(prog)
    index = _Index(prog, base)
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
            safe = _safe(prog, inp, root, index)
            moved = None if safe else _sunk(prog, inp, root, index)
            if moved is not None:  # (root's one write moved after the input's last reader: Lion's momentum)
                prog = prog.with_instrs(moved, "donate_buffers")
                base = view_bases(prog)
                index, safe = _Index(prog, base, mapping), True
            if safe:
                mapping[root] = inp
                taken.add(inp)
                index.alias(root, inp)
                break
    _warn_unused(prog, taken)
    if not mapping:
        return prog.with_instrs(prog.instrs, "donate_buffers")
    instrs = substitute([i for i in prog.instrs if not (i.op == Op.ALLOCATE and i.outs[0] in mapping
                                                         or _copies(i, mapping.get(i.into), i.into))], mapping)
    outputs = tuple(mapping.get(v, v) for v in prog.outputs)
    return prog.with_instrs(instrs, "donate_buffers", outputs=outputs)


def _warn_unused(prog, taken):
    """JAX's "Some donated buffers were not usable", once per plan: each donated input no result
    took (one returned as it is needs none), grouped by why: no result of its dtype, shape and layout (a
    float32 weight minus a NumPy float64 learning rate is float64, as NumPy 2 promotes it), results
    of its dtype and shape only in another layout (a first call's replicated state, whose results come
    back sharded), every such result taking another donated input's buffer, or the input read after
    it is written."""
    unused = [prog.inputs[k] for k in prog.donated
              if prog.inputs[k] not in taken and prog.inputs[k] not in prog.outputs]
    if not unused:
        return
    results = [r for r in prog.outputs if r not in prog.inputs]
    groups = defaultdict(list)
    for v in unused:
        groups[_why(v, results, taken)].append(f"{v.name}: {v.type}")
    shown = lambda names: ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")  # noqa: E731
    said = "; ".join(f"{shown(names)} ({why})" for why, names in groups.items())
    warnings.warn(f"{prog.name}: some donated buffers were not usable: {said}.  Those inputs keep their buffers (and "
                  "stay usable); their results take new ones", UserWarning, stacklevel=_outside_shardfuse())


_SHOWN = 4  # donated inputs named per reason (a training state's moments are dozens)


def _why(v, results, taken) -> str:
    """Why no result took donated input v's buffer."""
    same = [r for r in results if r.type == v.type]
    other = sorted({r.type.dtype for r in results if r.type.shape == v.type.shape} - {v.type.dtype})
    # (a result of its shape in another dtype: most likely its own update, promoted)
    hint = (f"; results of its shape are {', '.join(other)} (NumPy 2 promotes {v.type.dtype} with a NumPy "
            f"{other[0]} scalar or array, or a strong integer's quotient, to {other[0]}: pass Python numbers, or "
            "cast)") if other else ""
    if same and len(same) <= sum(1 for t in taken if t.type == v.type):
        return f"each result of its type takes another donated input's buffer{hint}"
    if same:
        return f"read after the result of its type is written{hint}"
    if any(r.type.shape == v.type.shape and r.type.dtype == v.type.dtype for r in results):
        return ("its results come in another layout: fed the step's own results (as from the second call on), or "
                "placed by sf.distribute(state, mesh, plan.output_layouts), the buffers are reused")
    return f"no result of this dtype, shape and layout{hint}"


def _outside_shardfuse() -> int:
    """The stacklevel of the first frame outside the shardfuse package: the user's call that compiled."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = inspect.currentframe(), 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return max(level, 1)
