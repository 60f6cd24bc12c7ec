"""The sharding rules of dynamic_update_slice and dynamic_slice (shardfuse/update_slice.py), entries
of rules.RULES.

dynamic_update_slice(x, update, *starts) -> out of x's shape; dynamic_slice(x, *starts) -> the box.
An axis the box covers whole (the update's, or the box's, extent equal to x's) keeps its sharding,
the same on x, the update and the result: each device writes its piece of the update into its
piece of x (a KV cache with heads over tp and batch over dp: no communication).  An axis the box
cuts has a start known only at run time, a global index: it must be whole on every device, and
where it is sharded it is gathered first (the Allgather a `set` before the op lowers to, printed),
as a static slice's cut axis is (rules_shapes.SLICE).  The starts are 0-d: replicated.  Pending sums
are made whole first (the result's box and the rest of x come from different operands).

Neither op is chunked by a stream loop (axis_map maps no axis): a loop that would run through one
ends before it, and the op waits for the whole value; sf.stream of their result is refused.
"""
from __future__ import annotations

from shardfuse.layout import Layout
from shardfuse.ops import Op
from shardfuse.schedule import axis_of


def cut_axes(ins) -> set:
    """The axes the box does not cover whole."""
    x = ins.ins[0].type.shape
    box = ins.ins[1].type.shape if ins.op == Op.DYNAMIC_UPDATE_SLICE else ins.outs[0].type.shape
    return {j for j, (n, b) in enumerate(zip(x, box)) if n != b}


def _arrays(ins) -> int:
    """How many of the op's operands are arrays of x's rank (x, and the update), before the starts."""
    return 2 if ins.op == Op.DYNAMIC_UPDATE_SLICE else 1


def infer(ins, lays):
    """x's layout with the cut axes whole (no pending sums)."""
    cut = cut_axes(ins)
    return Layout(tuple(None if j in cut else a for j, a in enumerate(lays[0].axes)))


def require(ins, out, lays):
    """x and the update in the output's layout with the cut axes whole; the starts replicated."""
    cut, stream = cut_axes(ins), axis_of(ins)
    if stream is not None:
        raise ValueError(f"sf.stream(...) of {ins.outs[0].name}, a {ins.op}, is not supported: stream the values "
                         "it reads, or its consumer")
    axes = tuple(None if j in cut else a for j, a in enumerate(out.axes))
    asked = Layout(tuple(None if j == stream else a for j, a in enumerate(axes)))
    starts = len(ins.ins) - _arrays(ins)
    return (asked,) * _arrays(ins) + (Layout(()),) * starts, Layout(axes)


def axis_map(ins, j):
    """No axis: a stream loop never runs through the op (the module's docstring)."""
    return (None,) * len(ins.ins)


UPDATE_SLICE = dict(infer=infer, require=require, axis_map=axis_map)
