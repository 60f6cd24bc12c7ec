"""sf.optim's learning-rate schedules, optax's (functions of the step count, a 0-d int32 value or a NumPy
int, giving the rate: traced where the count is): constant, linear, cosine decay, warmup then cosine
decay, piecewise constant, exponential decay.  Re-exported by sf.optim."""
from __future__ import annotations

from typing import Callable

import numpy as np


def constant_schedule(value: float) -> Callable:
    """optax.constant_schedule."""
    return lambda count: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Callable:
    """optax.linear_schedule: init_value to end_value over transition_steps after transition_begin, then held."""
    transition_begin = max(transition_begin, 0)  # (optax's: a negative start counts as 0)
    if transition_steps <= 0:
        return lambda count: init_value
    return lambda count: init_value + (end_value - init_value) * np.clip(
        (count - transition_begin) / transition_steps, 0.0, 1.0)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Callable:
    """optax.cosine_decay_schedule: init_value * ((1 - alpha) * (1 + cos(pi * t)) / 2 + alpha), t = count /
    decay_steps clipped to 1."""
    if decay_steps <= 0:
        raise ValueError(f"sf.optim.cosine_decay_schedule: decay_steps must be positive, got {decay_steps}")
    return lambda count: init_value * ((1 - alpha) * 0.5 * (1 + np.cos(np.pi * np.minimum(count / decay_steps, 1.0)))
                                       + alpha)


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0) -> Callable:
    """optax.warmup_cosine_decay_schedule: linear from init_value to peak_value over warmup_steps, then a
    cosine decay to end_value at decay_steps (counted from the start, as optax's)."""
    if decay_steps <= warmup_steps:
        raise ValueError(f"sf.optim.warmup_cosine_decay_schedule: decay_steps ({decay_steps}) must pass warmup_steps "
                         f"({warmup_steps}): both count from the start, as optax's")
    warm = linear_schedule(init_value, peak_value, warmup_steps)
    alpha = 0.0 if peak_value == 0 else end_value / peak_value  # (optax's: a zero peak decays to zero)
    cosine = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha)

    def schedule(count):
        return np.where(count < warmup_steps, warm(count), cosine(count - warmup_steps))
    return schedule


def piecewise_constant_schedule(init_value: float, boundaries_and_scales: dict | None = None) -> Callable:
    """optax.piecewise_constant_schedule: init_value, multiplied by scale from each boundary (a step count) on."""
    items = sorted((boundaries_and_scales or {}).items())

    def schedule(count):
        value = init_value
        for boundary, scale in items:
            value = np.where(count < boundary, value, value * scale)
        return value
    return schedule


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float, transition_begin: int = 0,
                      staircase: bool = False, end_value: float | None = None) -> Callable:
    """optax.exponential_decay: init_value * decay_rate ** ((count - transition_begin) / transition_steps)
    after transition_begin (the exponent floored with staircase), bounded by end_value where given."""
    if transition_steps <= 0 or decay_rate == 0:  # (optax's: a constant, for either)
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)  # (optax's: a negative start counts as 0)

    def schedule(count):
        steps = count - transition_begin
        p = np.floor(steps / transition_steps) if staircase else steps / transition_steps
        decayed = np.where(steps <= 0, init_value, init_value * decay_rate ** p)
        if end_value is None:
            return decayed
        return np.maximum(decayed, end_value) if decay_rate < 1 else np.minimum(decayed, end_value)
    return schedule


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Callable:
    """optax.polynomial_schedule: (init_value - end_value) * (1 - t) ** power + end_value, t the count past
    transition_begin over transition_steps, clipped to [0, 1] (BERT's linear decay is power 1)."""
    if transition_steps <= 0:
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)
    return lambda count: (init_value - end_value) * (1 - np.clip(count - transition_begin, 0, transition_steps)
                                                     / transition_steps) ** power + end_value


def join_schedules(schedules, boundaries) -> Callable:
    """optax.join_schedules: schedules[0] before boundaries[0], then schedules[k + 1] of (count - boundaries[k])."""
    def schedule(count):
        out = schedules[0](count)
        for boundary, s in zip(boundaries, schedules[1:]):
            out = np.where(count < boundary, out, s(count - boundary))
        return out
    return schedule
