"""optax's GradientTransformation, the pair every sf.optim optimizer is (its own module: shardfuse/optim.py and
shardfuse/optim_inject.py both make them)."""
from __future__ import annotations

from typing import Callable, NamedTuple


class GradientTransformation(NamedTuple):
    """optax's pair: init(params) -> state; update(updates, state, params=None) -> (updates, state)."""
    init: Callable
    update: Callable
