"""A write at one position of an axis the forward knows is sharded (a KV cache sharded over its sequence
axis, written at the decoding position): x.at[..., t, ...].set(v) / .add(v), and sf.dynamic_update_slice
of a box one position wide on that axis and whole on the others, as one where(iota == t, v, x) over each
device's own positions: nothing is gathered, the result keeps x's sharding, and a donated x is written in
place.  The box form (a dynamic_update_slice) gathers the whole axis on every device and returns it
replicated.  Values and gradients are the box form's: .at's position counts from the end where negative
and writes nothing outside [-n, n) (JAX's .at); dynamic_update_slice's start is clamped into the axis
(jax.lax's)."""
from __future__ import annotations

import numpy as np

from shardfuse.at_keys import static_int
from shardfuse.autodiff_layouts import known_layout
from shardfuse.traced import NUMPY, Traced, cast


def _sharded(x, ax) -> bool:
    lay = known_layout(x.builder, x.value)
    return lay is not None and lay.axes[ax] is not None


def sharded_position(x, desc, values):
    """(axis, t) of an .at key that is whole slices and one int (a Python int, or a traced 0-d int) t on an axis
    x's known layout shards; else None (where the axis is whole the box form is the cheaper)."""
    if not isinstance(x, Traced) or len(values) != 1:
        return None
    t = values[0]
    if not (isinstance(t, Traced) and t.ndim == 0 and t.dtype_name in ("int32", "int64") or static_int(t) is not None):
        return None
    if any(d[0] == "s" and (d[1], d[2]) != (0, x.shape[j]) for j, d in enumerate(desc)):
        return None
    ax = next(j for j, d in enumerate(desc) if d[0] == "i")
    return (ax, t if isinstance(t, Traced) else static_int(t)) if _sharded(x, ax) else None


def sharded_box(x, box, starts):
    """(axis, start) where a dynamic_update_slice's box is one position wide on a sharded axis and whole on the
    others; else None."""
    cut = [j for j, (b, n) in enumerate(zip(box, x.shape)) if b != n]
    if len(cut) != 1 or box[cut[0]] != 1 or not isinstance(x, Traced) or not _sharded(x, cut[0]):
        return None
    return cut[0], starts[cut[0]]


def along_rows(x, ax, t, v, broadcast_to, where, add=False, clamp=False):
    """x with v written (added, add=True) at position t of axis ax: where(iota == t, v, x), iota a constant
    np.arange of the axis (sliced with it on every device); v x's shape without axis ax (an .at update), or
    with it of extent 1 (a box), broadcast along it; t from the end where negative, clamped into the axis
    where clamp (a box's start)."""
    n = x.shape[ax]
    if isinstance(v, (Traced, np.ndarray)):
        v = cast(x.builder.constant(v), x.dtype_name)
        v = broadcast_to(v, x.shape[:ax] + x.shape[ax + 1:]) if v.ndim != x.ndim else v
    else:  # (a Python or NumPy scalar, in x's dtype, as the box form's)
        v = x.builder.constant(np.full((), v, dtype=x.dtype))
    v = v.reshape(x.shape[:ax] + (1,) + x.shape[ax + 1:]) if 0 < v.ndim < x.ndim else v
    if isinstance(t, Traced):
        pos = where(t < 0, t + n, t)
        pos = NUMPY[np.clip](pos, 0, n - 1) if clamp else pos
    else:
        pos = t + n if t < 0 else t
        pos = min(max(pos, 0), n - 1) if clamp else pos
    iota = x.builder.constant(np.arange(n).reshape(tuple(n if k == ax else 1 for k in range(x.ndim))))
    return where(iota == pos, x + v if add else v, x)
