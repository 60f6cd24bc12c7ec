"""x.at[..., t, ...].set(v) / .add(v) with a traced position t on an axis the forward knows is sharded (a KV cache
sharded over its sequence axis, written at the decoding position): a where over each device's own rows,
so nothing is gathered, the result keeps the cache's sharding and a donated cache is written in place.
The box form (a dynamic_update_slice) gathers the whole axis on every device and returns it replicated.
Values and gradients are the box form's (JAX's: a position outside the axis writes nothing)."""
from __future__ import annotations

import numpy as np

from shardfuse.autodiff_layouts import known_layout
from shardfuse.traced import Traced, cast


def sharded_position(x, desc, values):
    """(axis, t) where the key is whole slices and one traced 0-d int t on an axis x's known layout shards;
    else None (where the axis is whole the box form is the cheaper)."""
    if not isinstance(x, Traced) or len(values) != 1 or not isinstance(values[0], Traced) or values[0].ndim:
        return None
    if any(d[0] == "s" and (d[1], d[2]) != (0, x.shape[j]) for j, d in enumerate(desc)):
        return None
    ax = next(j for j, d in enumerate(desc) if d[0] == "i")
    lay = known_layout(x.builder, x.value)
    return (ax, values[0]) if lay is not None and lay.axes[ax] is not None else None


def along_rows(x, ax, t, v, broadcast_to, where, add=False):
    """x.at[..., t, ...].set(v) (.add(v): add=True): where(iota == t, v, x) (x + v) along axis ax, iota a constant np.arange of the axis (sliced
    with it on every device), v broadcast along it: one elementwise step over each device's own rows, which a
    donated x takes in place (a scatter or a box would gather or copy); t counts from the end where negative and
    writes nothing outside [-n, n), as JAX's .at."""
    n = x.shape[ax]
    if isinstance(v, (Traced, np.ndarray)):
        v = broadcast_to(cast(x.builder.constant(v), x.dtype_name), x.shape[:ax] + x.shape[ax + 1:])
    else:  # (a Python or NumPy scalar, in x's dtype, as the box form's)
        v = x.builder.constant(np.full((), v, dtype=x.dtype))
    v = v.reshape(x.shape[:ax] + (1,) + x.shape[ax + 1:]) if v.ndim else v
    iota = x.builder.constant(np.arange(n).reshape(tuple(n if k == ax else 1 for k in range(x.ndim))))
    return where(iota == where(t < 0, t + n, t), x + v if add else v, x)
