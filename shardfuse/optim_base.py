"""optax's GradientTransformation, the pair every sf.optim optimizer is (its own module: shardfuse/optim.py and
shardfuse/optim_inject.py and shardfuse/optim_extra.py make them), and EmptyState, the state of one that keeps none."""
from __future__ import annotations

from typing import Callable, NamedTuple


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


class GradientTransformation(NamedTuple):
    """optax's pair: init(params) -> state; update(updates, state, params=None) -> (updates, state)."""
    init: Callable
    update: Callable
