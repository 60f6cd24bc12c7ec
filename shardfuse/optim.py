"""sf.optim: optax's optimizers for shardfuse values (both probes of a training step wrote AdamW by hand;
optax's own functions call jax.numpy, which takes no shardfuse value).

The same API and formulas as optax: a GradientTransformation is (init, update); ``state = opt.init(params)``,
``updates, state = opt.update(grads, state, params)``, ``params = sf.optim.apply_updates(params, updates)``,
over pytrees of sf.Arrays (eager) or of traced values (inside sf.jit: the whole step one plan, its
state donated with donate_argnums).  Each moment takes its parameter's dtype and placement
(np.zeros_like of an sf.Array keeps both), so with weights sharded over tp or dp the state is
sharded alike and the update communicates nothing; clip_by_global_norm's norm is one Allreduce of
a scalar per kind of pending sum (passes/reassociate.py).  A learning rate is a number or a schedule
(a function of the step count, a 0-d int32 value, as optax's).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from shardfuse import lax, tree  # (lax.cond: apply_if_finite's choice, traced or not)
from shardfuse.optim_base import EmptyState, GradientTransformation
from shardfuse.optim_inject import InjectHyperparamsState, inject_hyperparams  # noqa: F401 (sf.optim's)
from shardfuse.optim_extra import ScaleByRssState, ZeroNansState, clip, scale, scale_by_rss, zero_nans  # noqa: F401
from shardfuse.optim_schedules import (constant_schedule, cosine_decay_schedule, exponential_decay,  # noqa: F401
                                       join_schedules, linear_schedule, piecewise_constant_schedule,
                                       polynomial_schedule, warmup_cosine_decay_schedule)
from shardfuse.trace import to_mesh
from shardfuse.traced import Traced
from shardfuse.traced_numpy import rsqrt


class ScaleByAdamState(NamedTuple):
    """Adam's state, as optax's: the step count (0-d int32) and the first and second moments."""
    count: Any
    mu: Any
    nu: Any


class ScaleByScheduleState(NamedTuple):
    """A schedule's step count (0-d int32), as optax's."""
    count: Any


class TraceState(NamedTuple):
    """SGD's momentum (optax's trace)."""
    trace: Any


class ScaleByLionState(NamedTuple):
    """Lion's state, as optax's: the step count (0-d int32) and the momentum."""
    count: Any
    mu: Any


class ScaleByRmsState(NamedTuple):
    """RMSProp's running mean of squared gradients (optax's)."""
    nu: Any


class ApplyIfFiniteState(NamedTuple):
    """optax's: non-finite steps in a row (int32), whether the last was finite, non-finite steps in all, and
    the wrapped transformation's state."""
    notfinite_count: Any
    last_finite: Any
    total_notfinite: Any
    inner_state: Any


class MultiStepsState(NamedTuple):
    """optax.MultiSteps': the mini-step within the current step, the steps applied, the wrapped
    transformation's state and the mean of the gradients accumulated so far."""
    mini_step: Any
    gradient_step: Any
    inner_opt_state: Any
    acc_grads: Any


class MaskedState(NamedTuple):
    """optax.masked's: the wrapped transformation's state, of the masked parameters only."""
    inner_state: Any


def global_norm(updates) -> Any:
    """sqrt of the sum of every leaf's squares (optax.global_norm), in float32 at least.  Outside jit, of
    sf.Arrays on several pipeline stages: one plan of their whole mesh, the norm replicated on it."""
    stages = {x.mesh for x in tree.leaves(updates) if hasattr(type(x), "one_op")}
    if len(stages) > 1 and len({m.root for m in stages}) == 1:
        from shardfuse.jit import jit  # (sf.jit is built above the optimizers: import it when it is needed)
        return jit(global_norm, mesh=next(iter(stages)).root)(updates)
    sums = [(_widened(x) * _widened(x)).sum() for x in tree.leaves(updates)]  # (widened: a float16 square overflows)
    homes = {s.builder.homes.get(s.value) for s in sums if isinstance(s, Traced)}
    if len(homes) > 1:  # (leaves on several pipeline stages: each stage's sum moved to the whole mesh, a probe)
        sums = [to_mesh(s, s.builder.mesh) if isinstance(s, Traced) and s.builder.homes.get(s.value) else s for s in sums]
    return np.sqrt(sum(sums))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale every update by max_norm / global_norm where the norm passes max_norm (optax's)."""
    def update(updates, state, params=None):
        norm = global_norm(updates)
        factor = np.minimum(1.0, max_norm / np.maximum(norm, max_norm))  # (1 where norm < max_norm, as optax's where)
        return tree.tree_map(lambda u: u * factor.astype(u.dtype), updates), state
    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0) -> GradientTransformation:
    """Adam's direction mu_hat / (sqrt(nu_hat + eps_root) + eps), bias-corrected by the count (optax's)."""
    def init(params):
        return ScaleByAdamState(np.zeros((), np.int32), tree.tree_map(np.zeros_like, params),
                                tree.tree_map(np.zeros_like, params))

    def update(updates, state, params=None):
        mu = tree.tree_map(lambda g, m: b1 * m + (1 - b1) * g, updates, state.mu)
        nu = tree.tree_map(lambda g, v: b2 * v + (1 - b2) * (g * g), updates, state.nu)
        count = state.count + 1
        c1, c2 = 1 - b1 ** count, 1 - b2 ** count  # (float64 scalars: cast to each moment's dtype, as optax)
        out = tree.tree_map(lambda m, v: (m / c1.astype(m.dtype)) / (np.sqrt(v / c2.astype(v.dtype) + eps_root) + eps),
                            mu, nu)
        return out, ScaleByAdamState(count, mu, nu)
    return GradientTransformation(init, update)


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction sign((1 - b1) g + b1 mu), then mu = b2 mu + (1 - b2) g (optax.scale_by_lion)."""
    def init(params):
        return ScaleByLionState(np.zeros((), np.int32), tree.tree_map(np.zeros_like, params))

    def update(updates, state, params=None):
        out = tree.tree_map(lambda g, m: np.sign((1 - b1) * g + b1 * m), updates, state.mu)
        mu = tree.tree_map(lambda g, m: b2 * m + (1 - b2) * g, updates, state.mu)
        return out, ScaleByLionState(state.count + 1, mu)
    return GradientTransformation(init, update)


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0) -> GradientTransformation:
    """RMSProp's g / sqrt(nu + eps), nu = decay nu + (1 - decay) g^2 from initial_scale (optax.scale_by_rms)."""
    def init(params):
        return ScaleByRmsState(tree.tree_map(lambda p: np.zeros_like(p) + initial_scale, params))

    def update(updates, state, params=None):
        nu = tree.tree_map(lambda g, v: decay * v + (1 - decay) * (g * g), updates, state.nu)
        return tree.tree_map(lambda g, v: g * _rsqrt(v + eps), updates, nu), ScaleByRmsState(nu)
    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float, mask=None) -> GradientTransformation:
    """updates + weight_decay * params (optax's; AdamW's decoupled decay); `mask`, a pytree of bools in the
    parameters' structure or a function of the parameters giving one, decays only where True (optax's:
    no decay of biases and norms)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError("sf.optim.add_decayed_weights needs params: opt.update(grads, state, params)")
        if mask is None:
            return tree.tree_map(lambda u, p: u + weight_decay * p, updates, params), state
        keep = mask(updates) if callable(mask) else mask  # (optax calls a mask function on the updates)
        return _masked(lambda u, p: u + weight_decay * p, updates, params, keep), state
    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_learning_rate(learning_rate) -> GradientTransformation:
    """updates * -learning_rate (a number, or a schedule of the step count: optax's)."""
    if not callable(learning_rate):
        return GradientTransformation(lambda params: EmptyState(),
                                      lambda u, s, params=None: (tree.tree_map(lambda x: x * -learning_rate, u), s))

    def update(updates, state, params=None):
        lr = learning_rate(state.count)
        # (a schedule's value in each update's dtype, as optax's: a float64 one would promote a float32 update)
        return tree.tree_map(lambda x: x * _in_dtype(-lr, x.dtype), updates), ScaleByScheduleState(state.count + 1)
    return GradientTransformation(lambda params: ScaleByScheduleState(np.zeros((), np.int32)), update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: t = g + decay * t (optax.trace); with nesterov, g + decay * t is the update."""
    def update(updates, state, params=None):
        t = tree.tree_map(lambda g, m: g + decay * m, updates, state.trace)
        out = tree.tree_map(lambda g, m: g + decay * m, updates, t) if nesterov else t
        return out, TraceState(t)
    return GradientTransformation(lambda params: TraceState(tree.tree_map(np.zeros_like, params)), update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """The transformations applied in turn; the state is the tuple of theirs (optax.chain)."""
    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        new = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new.append(s)
        return updates, tuple(new)
    return GradientTransformation(init, update)


def sgd(learning_rate, momentum: float | None = None, nesterov: bool = False) -> GradientTransformation:
    """optax.sgd: -learning_rate * g, with momentum (trace) where given."""
    return chain(*([trace(momentum, nesterov)] if momentum is not None else []), scale_by_learning_rate(learning_rate))


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0):
    """optax.adam."""
    return chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(learning_rate))


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          weight_decay: float = 1e-4, mask=None) -> GradientTransformation:
    """optax.adamw: Adam's direction plus weight_decay * params (where `mask` says), times -learning_rate."""
    return chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def lion(learning_rate, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 1e-3,
         mask=None) -> GradientTransformation:
    """optax.lion: Lion's sign direction plus weight_decay * params (where `mask` says), times -learning_rate."""
    return chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))


def rmsprop(learning_rate, decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
            momentum: float | None = None, nesterov: bool = False) -> GradientTransformation:
    """optax.rmsprop (not centered): scale_by_rms, times -learning_rate, then momentum (trace) where given."""
    return chain(scale_by_rms(decay, eps, initial_scale), scale_by_learning_rate(learning_rate),
                 *([trace(momentum, nesterov)] if momentum is not None else []))


def adagrad(learning_rate, initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """optax.adagrad: scale_by_rss, then -learning_rate (a number or a schedule)."""
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """optax.apply_if_finite: inner's update where every gradient is finite, else zero updates and inner's
    state kept (a float16 step that overflowed is skipped), unless more than max_consecutive_errors
    steps in a row were not (then applied anyway)."""
    def init(params):
        zero = np.zeros((), np.int32)
        return ApplyIfFiniteState(zero, np.ones((), bool), zero, inner.init(params))

    def update(updates, state, params=None):
        finite = functools.reduce(lambda a, b: a & b, [np.isfinite(u).all() for u in tree.leaves(updates)])
        notfinite = np.where(finite, 0, state.notfinite_count + 1).astype(np.int32)
        new, inner_state = lax.cond(finite | (notfinite > max_consecutive_errors),
                                    lambda: inner.update(updates, state.inner_state, params),
                                    lambda: (tree.tree_map(np.zeros_like, updates), state.inner_state))
        total = np.where(finite, state.total_notfinite, state.total_notfinite + 1).astype(np.int32)
        return new, ApplyIfFiniteState(notfinite, finite, total, inner_state)
    return GradientTransformation(init, update)


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """optax.masked: inner applied to the parameters `mask` selects (a pytree of bools, a prefix of the
    parameters', or a function of them giving one), the other updates passed through unchanged; inner's
    state holds the selected parameters' only."""
    def keep_of(params):
        return mask(params) if callable(mask) else mask

    def init(params):
        return MaskedState(inner.init(_chosen(params, keep_of(params))))

    def update(updates, state, params=None):
        keep = keep_of(updates if params is None else params)
        new, inner_state = inner.update(_chosen(updates, keep), state.inner_state,
                                        None if params is None else _chosen(params, keep))
        return _masked(lambda u, n: n, updates, new, keep), MaskedState(inner_state)
    return GradientTransformation(init, update)


class MultiSteps:
    """optax.MultiSteps: gradient accumulation, the mean of every_k_schedule (an int) calls' gradients given to
    `opt` on the last of them; the others give zero updates and keep opt's state.  `.init`, `.update` and
    `.gradient_transformation()` as optax's."""

    def __init__(self, opt: GradientTransformation, every_k_schedule: int):
        if isinstance(every_k_schedule, bool) or not isinstance(every_k_schedule, int) or every_k_schedule < 1:
            raise ValueError(f"sf.optim.MultiSteps: every_k_schedule must be a positive int, got {every_k_schedule!r}")
        self.opt, self.k = opt, every_k_schedule

    def init(self, params):
        zero = np.zeros((), np.int32)
        return MultiStepsState(zero, zero, self.opt.init(params), tree.tree_map(np.zeros_like, params))

    def update(self, updates, state, params=None):
        n = state.mini_step + 1  # (a running mean: acc + (g - acc) / n, as optax's)
        acc = tree.tree_map(lambda a, g: a + (g - a) / n.astype(a.dtype), state.acc_grads, updates)
        last = n >= self.k

        def apply():
            new, inner = self.opt.update(acc, state.inner_opt_state, params)
            return new, inner, tree.tree_map(np.zeros_like, acc)

        def wait():
            return tree.tree_map(np.zeros_like, updates), state.inner_opt_state, acc
        new, inner, acc = lax.cond(last, apply, wait)
        return new, MultiStepsState(np.where(last, 0, n).astype(np.int32),
                                    (state.gradient_step + last.astype(np.int32)).astype(np.int32), inner, acc)

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)


def apply_updates(params, updates):
    """params + updates, each in its parameter's dtype (optax.apply_updates)."""
    return tree.tree_map(lambda p, u: (p + u).astype(p.dtype), params, updates)


def _widened(x):
    """x in float32 where it is 16-bit (a norm of bfloat16 gradients summed in float32); a Python number as an array."""
    x = np.asarray(x) if isinstance(x, (int, float)) else x  # (a number leaf: jnp.asarray's, a review)
    return x.astype(np.float32) if np.dtype(x.dtype).itemsize < 4 and np.dtype(x.dtype).kind in "fV" else x


def _masked(fn, updates, params, keep):
    """fn(u, p) where keep (a bool, or a pytree of them that is a prefix of updates', as optax's masks)
    says True, u as it is elsewhere."""
    if isinstance(keep, (bool, np.bool_)):
        return tree.tree_map(fn, updates, params) if keep else updates
    if isinstance(keep, dict):
        return type(updates)({k: _masked(fn, updates[k], params[k], keep[k]) for k in updates})
    parts = [_masked(fn, u, p, m) for u, p, m in zip(updates, params, keep)]
    return type(updates)(*parts) if hasattr(type(updates), "_fields") else type(updates)(parts)


def _chosen(t, keep):
    """t's subtrees where keep (a bool, or a pytree of them that is a prefix of t's) says True, None (a node
    without leaves) elsewhere."""
    if isinstance(keep, (bool, np.bool_)):
        return t if keep else None
    if isinstance(keep, dict):
        return type(t)({k: _chosen(t[k], keep[k]) for k in t})
    parts = [_chosen(x, m) for x, m in zip(t, keep)]
    return type(t)(*parts) if hasattr(type(t), "_fields") else type(t)(parts)


def _rsqrt(v):
    """1 / sqrt(v) as optax's lax.rsqrt: sf.rsqrt of shardfuse values (one op), NumPy's of NumPy arrays."""
    return 1.0 / np.sqrt(v) if isinstance(v, (np.ndarray, np.generic)) else rsqrt(v)


def _in_dtype(v, dtype):
    """v (a schedule's value: an array, or a Python number, which is weak) in `dtype`."""
    return v if type(v) in (int, float) else np.asarray(v).astype(dtype) if isinstance(v, np.generic) else v.astype(dtype)
