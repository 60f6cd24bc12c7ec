"""JAX's gradients where traced.py's ops are compositions whose own rules would give another one, each a
rule of its own (custom_rules.record) where a gradient is traced: the forward is the composition alone (one
view more), its value unchanged bit for bit.

Max and min over several axes: ties share the gradient equally over all of them.  traced.py reduces one
axis at a time, and each reduction's rule (autodiff._reduce_extremum) shares the cotangent among the ties
along its own axis, so over two axes the shares compound: the max of [[1, 0], [1, 1]] gave [[0.5, 0],
[0.25, 0.25]] where JAX gives a third each (a probe).  The rule: ct * tie / (the ties' count over all the
axes), infinite extrema's ties included; NaN where the slice holds a NaN (no tie), as JAX's.

|x|: relu(x) + relu(-x) has the gradient 0 at 0, JAX's is +1 (lax.abs: select(x >= 0, g, -g); a probe);
the rule is JAX's select."""
from __future__ import annotations

import numpy as np

from shardfuse import dtypes
from shardfuse.custom_rules import record
from shardfuse.spec import reduced_axes


def shared_ties(x, m, axis, keepdims):
    """m, x's max or min over `axis` (keepdims as given), with JAX's gradient where several axes tie."""
    axes = tuple(reduced_axes(axis, x.ndim, x.shape))
    if len(axes) < 2 or not x.builder.fresh or not dtypes.is_float(x.dtype_name):
        return m
    kept = tuple(1 if a in axes else n for a, n in enumerate(x.shape))
    wide = "float64" if x.dtype_name == "float64" else "float32"  # (a 16-bit count of ties would round)

    def cotangents(cts):
        tie = (x == (m if keepdims else m.reshape(kept))).astype(wide)
        share = (cts[0] if keepdims else cts[0].reshape(kept)).astype(wide) / tie.sum(axis=axes, keepdims=True)
        return [(tie * share).astype(x.dtype_name)]
    return record(x.builder, "ties", [x], m, "max / min", lambda _: cotangents)


def abs_at_zero(x, y):
    """y = |x| (relu(x) + relu(-x)) with JAX's gradient, select(x >= 0, g, -g): +1 at 0."""
    if not x.builder.fresh:
        return y
    return record(x.builder, "abs", [x], y, "abs", lambda _: lambda cts: [np.where(x >= 0, cts[0], -cts[0])])
