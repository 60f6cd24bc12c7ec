"""More of optax's transformations for sf.optim: scale, clip (each update within [-max_delta, max_delta]),
zero_nans, and Adagrad's scale_by_rss (sf.optim.adagrad chains it); re-exported by sf.optim.  Written with NumPy's functions on
the updates (traced values inside sf.jit, sf.Arrays or NumPy arrays outside it), so each keeps its
parameter's dtype and sharding and communicates nothing."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from shardfuse import tree
from shardfuse.optim_base import EmptyState, GradientTransformation


class ZeroNansState(NamedTuple):
    """optax's: per leaf, whether the last update held a NaN (a 0-d bool)."""
    found_nan: Any


class ScaleByRssState(NamedTuple):
    """optax's: the running sum of squared gradients, per parameter."""
    sum_of_squares: Any


def scale(step_size: float) -> GradientTransformation:
    """optax.scale: every update times step_size."""
    return GradientTransformation(lambda params: EmptyState(),
                                  lambda u, s, params=None: (tree.tree_map(lambda x: x * step_size, u), s))


def clip(max_delta: float) -> GradientTransformation:
    """optax.clip: every update element within [-max_delta, max_delta]."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, params=None: (
        tree.tree_map(lambda x: np.clip(x, -max_delta, max_delta), u), s))


def zero_nans() -> GradientTransformation:
    """optax.zero_nans: NaN updates replaced by 0; the state says, per leaf, whether there was one."""
    def update(updates, state, params=None):
        found = tree.tree_map(lambda x: np.isnan(x).any(), updates)
        return tree.tree_map(lambda x: np.where(np.isnan(x), 0.0, x), updates), ZeroNansState(found)
    return GradientTransformation(lambda params: ZeroNansState(tree.tree_map(lambda p: np.zeros((), bool), params)),
                                  update)


def scale_by_rss(initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """optax.scale_by_rss (Adagrad's): s += g^2 from initial_accumulator_value; g / sqrt(s + eps) where s > 0."""
    def init(params):
        return ScaleByRssState(tree.tree_map(lambda p: np.zeros_like(p) + initial_accumulator_value, params))

    def update(updates, state, params=None):
        s = tree.tree_map(lambda g, a: a + g * g, updates, state.sum_of_squares)
        out = tree.tree_map(lambda g, a: np.where(a > 0, g / np.sqrt(a + eps), 0.0), updates, s)
        return out, ScaleByRssState(s)
    return GradientTransformation(init, update)

