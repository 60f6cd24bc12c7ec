"""JAX's gradients where traced.py's ops are compositions whose own rules would give another one.
Each applies only where a gradient is traced (sf.grad's primals on the builder); plain forwards are
the compositions alone, and values are unchanged bit for bit.

Max and min over several axes: ties share the gradient equally over all of them.  traced.py reduces one axis at a time, and each reduction's rule (autodiff._reduce_extremum) shares
the cotangent among the ties along its own axis, so over two axes the shares compound: the max of
[[1, 0], [1, 1]] gave [[0.5, 0], [0.25, 0.25]] where JAX gives a third each (a probe).  Where a
gradient is traced, the result here is the reductions' value held constant, less a term that is
exactly +0 but whose gradient is the tie mask over their count:

    y = stop(m) - sum(where(tie, stop(x) - x, 0) * stop(tie / count))

Its value is m bit for bit (a +0 subtracted keeps -0.0, inf and NaN); the gradient reaches each
finite tie as 1 / count.  (An infinite extremum's ties get none: stop(x) - x would be NaN there.)

|x| at 0: relu(x) + relu(-x) has the gradient 0 there, JAX's is +1 (lax.abs: select(x >= 0, g, -g);
a probe).  A term that is +0 everywhere, x - stop(x) where x == 0, gives it: |x| keeps +0.0 at -0.0,
which where(x >= 0, x, -x) would not."""
from __future__ import annotations

import numpy as np

from shardfuse import dtypes
from shardfuse.ir import TensorType
from shardfuse.ops import Op
from shardfuse.spec import reduced_axes


def shared_ties(x, m, axis, keepdims):
    """m, x's max or min over `axis` (keepdims as given), with JAX's gradient where several axes tie."""
    axes = reduced_axes(axis, x.ndim, x.shape)
    if len(axes) < 2 or not x.builder.fresh or not dtypes.is_float(x.dtype_name):
        return m
    kept = m if keepdims else m.reshape(tuple(1 if a in axes else n for a, n in enumerate(x.shape)))
    tie = _held(x == _held(kept))
    share = _held(tie.astype(x.dtype_name) / tie.sum(axis=axes, keepdims=True).astype(x.dtype_name))
    zero = (np.where(tie & _held(np.isfinite(x)), _held(x) - x, 0.0) * share).sum(axis=axes, keepdims=keepdims)
    return _held(m) - zero.astype(m.dtype_name)


def abs_at_zero(x, y):
    """y = |x| (relu(x) + relu(-x)) with JAX's gradient +1 at x = 0."""
    if not x.builder.fresh:
        return y
    return y + np.where(_held(x == 0), x - _held(x), 0.0)


def _held(v):
    """v as a value no gradient flows through (autodiff.stop_gradient's view, without its import cycle)."""
    out = v.builder.emit(Op.RESHAPE, (v,), TensorType(v.shape, v.dtype_name), v.value.name + "_sg", shape=v.shape)
    v.builder.no_gradient.add(out.value)
    return out
