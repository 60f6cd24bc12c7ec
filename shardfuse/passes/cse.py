"""share_resharding: identical `set`s of one value to one layout are issued once (issue 31, item 7).

Common-subexpression elimination of the array-level instructions that move or view data: a
`set` (a resharding: a collective once lowered) or a `view` whose op, input, attributes and
result type (shape, dtype, layout, stream schedule included) equal an earlier one's is dropped,
and its consumers read the earlier result.  Views count because split_stream_axes gives each
streamed consumer a view of its own (`x_split`, `x_split_1`, ... of one x): once those are one,
so are the `set`s that gather them, and mark_stream_intermediates streams the one gathered
value for every consumer whose chunks line up.

Elementwise ops of small results (at most SMALL elements: an optimizer's bias correction
1 - b1 ** count, made once per parameter by a hand-written Adam) are shared too: each is a kernel
launch on a GPU (a probe counted one per parameter).  Not larger ones: sf.checkpoint's
recomputed forward begins with ops of the forward's own inputs, and sharing those would keep the
forward's result alive until the backward, what the recomputation is there to avoid.

Not shared: a `set` feeding a ring matmul (lower_ring replaces that set by its ring, so no
other consumer could read it), and a value the program returns (each output keeps a buffer of
its own).
"""
from __future__ import annotations

import math

from shardfuse.ir import substitute
from shardfuse.ops import ELEMENTWISE, Op
from shardfuse.schedule import is_ring

SHARED_OPS = (Op.SET, Op.VIEW)
SMALL = 4096  # elements of an elementwise op's result shared as a common subexpression


def _shared(i) -> bool:
    if len(i.outs) != 1 or i.body:
        return False
    return i.op in SHARED_OPS or i.op in ELEMENTWISE and math.prod(i.outs[0].type.shape) <= SMALL


def _exact(v):
    """An attribute as a key that tells 0.0 from -0.0 (equal, and equally hashed, as floats: a
    scale by -0.0 is not one by 0.0, a review)."""
    if isinstance(v, float):
        return float, repr(v)
    return tuple(_exact(x) for x in v) if isinstance(v, tuple) else v


def _key(i):
    try:
        attrs = tuple(sorted((k, _exact(v)) for k, v in i.attrs.items()))
        hash(attrs)
    except TypeError:  # (an unhashable attribute: never shared)
        return None
    return (i.op, i.ins, attrs, tuple(o.type for o in i.outs))


def share_resharding(prog):
    ring_inputs = {v for i in prog.instrs if is_ring(i) for v in i.ins}
    outputs = set(prog.outputs)
    first, alias, out = {}, {}, []
    for i in prog.instrs:
        i = substitute([i], alias)[0]
        key = _key(i) if _shared(i) else None
        o = i.outs[0] if i.outs else None
        if key is None or o in ring_inputs or o in outputs:
            out.append(i)
            continue
        if key in first:
            alias[o] = first[key]
            continue
        first[key] = o
        out.append(i)
    return prog.with_instrs(out, "share_resharding", outputs=tuple(alias.get(v, v) for v in prog.outputs))
