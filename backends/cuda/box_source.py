"""The C++ body of backends/cuda/boxes.py's box-copy kernel, generated here without CuPy (so that a
machine without a GPU can compile and check it: tests/test_update_slice_kernel.py).  The kernel is a
cupy.ElementwiseKernel over the box's elements i, with raw arrays `src`, `dst` and the 0-d starts viewed
as (1,) arrays `s0_`, `s1_`, ...; CuPy's CArray indexes a raw array with a multi-index, strides honoured."""
from __future__ import annotations


def source(box, outer, inner, update) -> str:
    """The kernel's body: `box` per axis a static start or None (read from s{k}_[0], in order); outer and
    inner the extents of the array holding the box and of the box; update: dst[box] = src, else
    dst = src[box]."""
    nd, lines, k = len(box), ["long long k = i;"], 0
    for d in reversed(range(nd)):  # the element's place in the box, C order
        lines.append(f"long long a{d} = k % {inner[d]}LL; k /= {inner[d]}LL;")
    for d, s in enumerate(box):
        if s is None:
            hi = outer[d] - inner[d]
            lines.append(f"long long s{d} = (long long)s{k}_[0]; if (s{d} < 0) s{d} += {outer[d]}LL;"
                         f" s{d} = s{d} < 0 ? 0 : (s{d} > {hi}LL ? {hi}LL : s{d});")
            k += 1
        else:  # (static: wrapped and clamped when traced)
            lines.append(f"long long s{d} = {int(s)}LL;")
    at = ", ".join(f"(ptrdiff_t)a{d}" for d in range(nd))
    moved = ", ".join(f"(ptrdiff_t)(a{d} + s{d})" for d in range(nd))
    lines.append(f"ptrdiff_t in_box[{nd}] = {{{at}}}; ptrdiff_t in_outer[{nd}] = {{{moved}}};")
    lines.append("dst[in_outer] = src[in_box];" if update else "dst[in_box] = src[in_outer];")
    return " ".join(lines)
