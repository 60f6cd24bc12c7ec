"""Cotangents of slices, summed without their zeros: the cotangent of x[k] is x-shaped, ct in its box and zeros
around it (autodiff._slice_array joins them with concatenate), and where x is read slice by slice (a stack of
layer weights read as w[k] by sf.lax.scan or a loop) adding those L padded cotangents made L x-sized buffers,
memory quadratic in L (a pipeline probe: 17 MB of buffers for a 0.5 MB gradient at L = 16).  Two such sums
whose pieces do not overlap are one concatenate of the pieces instead, zeros only in the gaps (the padded ones
are then dead, and dropped).
"""
from __future__ import annotations

from shardfuse.ops import Op
from shardfuse.traced import Traced


def merged(a: Traced, b: Traced, primal: Traced):
    """a + b as one concatenate, where both are joined along one axis from pieces and zeros and their pieces lie
    in disjoint ranges of it, or in the same range (those pieces added); else None (the caller adds them)."""
    from shardfuse.shape_ops import concatenate, getitem

    sa, sb = _segments(a), _segments(b)
    if sa is None or sb is None or sa[0] != sb[0]:
        return None
    axis, pieces = sa[0], []
    for lo, hi, piece in sorted(sa[1] + sb[1], key=lambda s: s[:2]):
        if pieces and pieces[-1][:2] == (lo, hi):  # (one range in both: its pieces added, a small sum)
            pieces[-1] = (lo, hi, pieces[-1][2] + piece)
        elif pieces and pieces[-1][1] > lo:  # (ranges that overlap otherwise: a real sum)
            return None
        else:
            pieces.append((lo, hi, piece))
    parts, at = [], 0
    for lo, hi, piece in pieces + [(primal.shape[axis], None, None)]:
        if lo > at:  # (zeros in the gap, shaped as the primal's slice there)
            gap = getitem(primal, (slice(None),) * axis + (slice(at, lo),))
            parts.append(gap.unary_op(Op.FULL_LIKE, a.dtype_name, value=0.0))  # (autodiff.full_like's)
        if piece is not None:
            parts.append(piece)
            at = hi
    return concatenate(parts, axis)


def _segments(t: Traced):
    """(axis, [(lo, hi, piece)] of its nonzero pieces) where t is a concatenate of pieces and zeros (full_like 0)
    along one axis; else None."""
    made = t.builder.producer.get(t.value)
    if made is None or made.op != Op.CONCAT:
        return None
    axis, at, out = made.attrs["axis"], 0, []
    for v in made.ins:
        n = v.type.shape[axis]
        p = t.builder.producer.get(v)
        if not (p is not None and p.op == Op.FULL_LIKE and p.attrs.get("value") == 0.0):
            out.append((at, at + n, Traced(t.builder, v)))
        at += n
    return axis, out
