"""NumPy's joins on traced values and sf.Arrays: np.hstack / vstack / dstack / column_stack, np.atleast_1d /
2d / 3d, np.unstack and np.broadcast_arrays, as reshapes, slices, broadcasts and np.concatenate (which makes
the joined axis whole); NumPy arrays and scalars among sf.Arrays join as NumPy's do (replicated); their
entries of the NUMPY table."""
from __future__ import annotations

import numpy as np

from shardfuse.numpy_broadcast import broadcast_to
from shardfuse.spec import normalize_axis
from shardfuse.traced import NUMPY, Traced
from shardfuse.traced_numpy import apply_op


def _at_least(n):
    def traced(v):
        if v.ndim >= n:
            return v
        if v.ndim == 0:
            return v.reshape((1,) * n)
        if n == 2:  # (NumPy's: (n,) -> (1, n); atleast_3d's (n,) -> (1, n, 1) and (m, n) -> (m, n, 1))
            return v.reshape((1,) + v.shape)
        return v.reshape((1,) + v.shape + (1,) if v.ndim == 1 else v.shape + (1,))
    return traced


_atleast = {n: _at_least(n) for n in (1, 2, 3)}


def _each(fn, what, host, x):
    """fn of a traced value or an sf.Array (a one-op plan); a NumPy array or a scalar beside them (a join of
    mixed items, as NumPy's) by NumPy's host(np.asarray(x))."""
    if isinstance(x, Traced) or hasattr(type(x), "one_op"):
        return apply_op(fn, what, x)
    return host(np.asarray(x))


def _atleast_fn(n):
    host = getattr(np, f"atleast_{n}d")

    def fn(*arys):
        out = [_each(_atleast[n], f"atleast_{n}d", host, x) for x in arys]
        return out[0] if len(out) == 1 else tuple(out)
    fn.__name__ = f"atleast_{n}d"
    fn.__doc__ = f"np.atleast_{n}d: each array viewed with at least {n} axes, as NumPy's."
    return fn


atleast_1d, atleast_2d, atleast_3d = (_atleast_fn(n) for n in (1, 2, 3))


def _join(n, axis_of):
    def fn(tup, **kwargs):
        xs = [_each(_atleast[n], "stack", getattr(np, f"atleast_{n}d"), x) for x in tup]
        return NUMPY[np.concatenate](xs, axis=axis_of(xs), **kwargs)
    return fn


hstack = _join(1, lambda xs: 0 if xs[0].ndim == 1 else 1)
vstack = _join(2, lambda xs: 0)
dstack = _join(3, lambda xs: 2)
for _f, _name in ((hstack, "hstack"), (vstack, "vstack"), (dstack, "dstack")):
    _f.__name__, _f.__doc__ = _name, f"np.{_name}: the arrays joined, as NumPy's (np.concatenate of atleast_nd)."


def _column(v):
    return v.reshape(v.shape + (1,)) if v.ndim == 1 else _atleast[2](v)


def column_stack(tup):
    """np.column_stack: 1-D arrays as columns, joined along axis 1."""
    return NUMPY[np.concatenate]([_each(_column, "column_stack", lambda a: a[:, None] if a.ndim == 1 else
                                        np.atleast_2d(a), x) for x in tup], axis=1)


def unstack(x, /, *, axis=0):
    """np.unstack: the slices along `axis`, a tuple."""
    ax = normalize_axis(axis, np.ndim(x), np.shape(x))
    return tuple(x[(slice(None),) * ax + (k,)] for k in range(np.shape(x)[ax]))


def broadcast_arrays(*args):
    """np.broadcast_arrays: each array broadcast to their common shape (a tuple)."""
    shape = np.broadcast_shapes(*(np.shape(a) for a in args))
    return tuple(broadcast_to(a, shape) if isinstance(a, Traced) or hasattr(type(a), "one_op") else
                 np.broadcast_to(np.asarray(a), shape) for a in args)


NUMPY.update({
    np.atleast_1d: atleast_1d, np.atleast_2d: atleast_2d, np.atleast_3d: atleast_3d, np.hstack: hstack,
    np.vstack: vstack, np.dstack: dstack, np.column_stack: column_stack, np.unstack: unstack,
    np.broadcast_arrays: broadcast_arrays,
})
