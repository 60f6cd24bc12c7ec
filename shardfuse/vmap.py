"""sf.vmap: jax.vmap's API (in_axes, out_axes as pytree prefixes), computed by unrolling: fn called once
per index of the mapped axis on the slices there, the results stacked along out_axes.

A shardfuse plan is a flat host program, and its ops have no batching rules: as sf.lax.scan, a vmap runs
as its unrolled calls, inside sf.jit (each call's ops traced into the program), on sf.Arrays (each slice
one plan for every index: x[i] is a dynamic slice) or on NumPy arrays.  Values are jax.vmap's; the cost is
the batch size times fn's ops (compile time grows with it): vmap over heads, layers or a few ensemble
members, not over thousands of examples (write the batch axis into the ops for that: they broadcast).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from shardfuse import tree


def vmap(fn: Callable, in_axes: Any = 0, out_axes: Any = 0, axis_name=None, axis_size: int | None = None) -> Callable:
    """jax.vmap(fn, in_axes=0, out_axes=0, axis_size=None): fn mapped over an axis of its arguments.  in_axes:
    an int, None (not mapped) or a pytree prefix of the arguments (a tuple, one per positional argument);
    out_axes likewise for the results (None: the result of the first index, which must not depend on it)."""
    if axis_name is not None:
        raise TypeError("sf.vmap: axis_name= (collectives over the mapped axis) is not supported: the map is "
                        "unrolled, so reduce its stacked result instead (np.sum(out, axis=...))")

    def mapped(*args, **kwargs):  # (keyword arguments mapped over their axis 0, as jax.vmap's)
        leaves, treedef = tree.flatten((args, kwargs))
        axes = _axes_of(in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args), args, "in_axes")
        axes += _axes_of(0, kwargs, "in_axes")
        size = _size(leaves, axes, axis_size)
        calls = (treedef.unflatten([_slice(x, ax, i) for x, ax in zip(leaves, axes)]) for i in range(size))
        outs = [fn(*a, **k) for a, k in calls]
        out_leaves, out_tree = tree.flatten(outs[0])
        per_index = [tree.flatten(o)[0] for o in outs]
        if any(tree.flatten(o)[1] != out_tree for o in outs):
            raise ValueError(f"sf.vmap: {getattr(fn, '__name__', 'fn')} returned results of different structures")
        out_ax = _axes_of(out_axes, outs[0], "out_axes")
        stacked = [_stack([p[j] for p in per_index], ax) if ax is not None else out_leaves[j]
                   for j, ax in enumerate(out_ax)]
        return out_tree.unflatten(stacked)
    mapped.__name__ = f"vmap({getattr(fn, '__name__', 'fn')})"
    return mapped


def _axes_of(prefix, values, what) -> list:
    """Each leaf of `values`' mapped axis (None: not mapped), `prefix` broadcast over the leaves as JAX's."""
    if prefix is None or isinstance(prefix, (int, np.integer)) and not isinstance(prefix, bool):
        return [_checked(prefix, v, what) for v in tree.leaves(values)]
    if isinstance(prefix, dict) and isinstance(values, dict):
        if set(prefix) != set(values):
            raise ValueError(f"sf.vmap: {what} keys {sorted(prefix)} do not match the value's {sorted(values)}")
        return [a for k in sorted(values) for a in _axes_of(prefix[k], values[k], what)]
    if isinstance(prefix, (tuple, list)) and isinstance(values, (tuple, list)) and len(prefix) == len(values):
        return [a for p, v in zip(prefix, values) for a in _axes_of(p, v, what)]
    raise ValueError(f"sf.vmap: {what} {prefix!r} is not a prefix of the structure it maps ({tree.flatten(values)[1]}): "
                     "give an int, None, or a tuple with one entry per argument")


def _checked(ax, v, what):
    if ax is None or what == "out_axes":  # (an out axis is checked against the stacked result's axes)
        return None if ax is None else int(ax)
    ndim = np.ndim(v) if not hasattr(v, "ndim") else v.ndim
    if not -ndim <= ax < ndim:
        raise ValueError(f"sf.vmap: {what} {ax} is out of range for a value of {ndim} axes (shape {np.shape(v)})")
    return int(ax) % ndim


def _size(leaves, axes, axis_size) -> int:
    sizes = {x.shape[ax] for x, ax in zip(leaves, axes) if ax is not None}
    if axis_size is not None:
        sizes.add(int(axis_size))
    if len(sizes) != 1:
        raise ValueError(f"sf.vmap: the mapped axes must have one size, got {sorted(sizes)}" if sizes else
                         "sf.vmap: no argument is mapped (every in_axes None): give axis_size=")
    return sizes.pop()


def _slice(x, ax, i):
    return x if ax is None else x[(slice(None),) * ax + (i,)]


def _stack(values, ax):
    """The results of each index stacked on a new axis `ax` (negative from the end of the result's axes)."""
    from shardfuse.shape_ops import stack

    ndim = np.ndim(values[0]) if not hasattr(values[0], "ndim") else values[0].ndim
    if not -(ndim + 1) <= ax <= ndim:
        raise ValueError(f"sf.vmap: out_axes {ax} is out of range for a result of {ndim} axes")
    return stack(values, axis=ax % (ndim + 1))
