"""sf.nn.initializers: jax.nn.initializers' (and flax's) weight initializers, each a function of the
initializer's settings returning init(key, shape, dtype="float32") -> array, drawn by sf.random (NumPy
arrays outside sf.jit, traced values inside it, the same numbers either way): variance_scaling and its
named forms glorot / xavier, he / kaiming and lecun (uniform, normal, truncated_normal), normal,
uniform, truncated_normal, zeros, ones and constant.  The numbers are shardfuse's generator's, not JAX's
(the same key gives other values); their distributions are JAX's: variance_scaling's variance is
scale / fan, fan by JAX's rule (the receptive field, the product of the axes other than in_axis,
out_axis and batch_axis, times the in or out extent), a truncated normal rescaled by JAX's constant
0.8796 so the variance stays scale / fan.  Place the result with sf.shard / sf.distribute as any array.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes, random

_TRUNCATED_STD = 0.87962566103423978  # (the std of a standard normal truncated to (-2, 2): JAX's constant)


def _fans(shape, in_axis, out_axis, batch_axis):
    """(fan_in, fan_out) of a weight shape, as jax.nn.initializers computes them."""
    if len(shape) < 2:
        raise ValueError(f"can't compute input and output sizes of a {len(shape)}-dimensional weights tensor {shape}: "
                         "it must be at least 2-D (as JAX's)")
    axes = [a % len(shape) for a in (in_axis, out_axis, *np.atleast_1d(batch_axis))]
    receptive = math.prod(n for k, n in enumerate(shape) if k not in axes)
    return shape[axes[0]] * receptive, shape[axes[1]] * receptive


def variance_scaling(scale, mode, distribution, in_axis=-2, out_axis=-1, batch_axis=(), dtype="float32"):
    """jax.nn.initializers.variance_scaling: samples of variance scale / fan, fan = fan_in, fan_out or
    their mean (mode "fan_in", "fan_out", "fan_avg"); distribution "truncated_normal" (within two
    standard deviations), "normal" or "uniform"."""
    if mode not in ("fan_in", "fan_out", "fan_avg"):
        raise ValueError(f"variance_scaling: mode must be 'fan_in', 'fan_out' or 'fan_avg', got {mode!r}")
    if distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError("variance_scaling: distribution must be 'truncated_normal', 'normal' or 'uniform', got "
                         f"{distribution!r}")

    def init(key, shape, dtype=dtype):
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        fan_in, fan_out = _fans(shape, in_axis, out_axis, batch_axis)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
        variance = scale / max(1.0, fan)
        if distribution == "uniform":
            limit = math.sqrt(3 * variance)
            return random.uniform(key, shape, dtype, -limit, limit)
        std = math.sqrt(variance)
        if distribution == "normal":  # (a Python float: weak, the draw keeps its dtype)
            return random.normal(key, shape, dtype) * std
        return random.truncated_normal(key, -2.0, 2.0, shape, dtype) * (std / _TRUNCATED_STD)
    return init


def _np(dtype):
    return dtypes.np_dtype(dtypes.normalize_dtype(dtype))


def _named(scale, mode, distribution):
    def make(in_axis=-2, out_axis=-1, batch_axis=(), dtype="float32"):
        return variance_scaling(scale, mode, distribution, in_axis, out_axis, batch_axis, dtype)
    make.__doc__ = f"jax.nn.initializers': variance_scaling({scale}, {mode!r}, {distribution!r})."
    return make


glorot_uniform = xavier_uniform = _named(1.0, "fan_avg", "uniform")
glorot_normal = xavier_normal = _named(1.0, "fan_avg", "truncated_normal")
he_uniform = kaiming_uniform = _named(2.0, "fan_in", "uniform")
he_normal = kaiming_normal = _named(2.0, "fan_in", "truncated_normal")
lecun_uniform = _named(1.0, "fan_in", "uniform")
lecun_normal = _named(1.0, "fan_in", "truncated_normal")


def normal(stddev=1e-2, dtype="float32"):
    """jax.nn.initializers.normal: N(0, stddev**2) samples."""
    return lambda key, shape, dtype=dtype: random.normal(key, shape, dtype) * float(stddev)


def uniform(scale=1e-2, dtype="float32"):
    """jax.nn.initializers.uniform: samples in [0, scale)."""
    return lambda key, shape, dtype=dtype: random.uniform(key, shape, dtype, 0.0, scale)


def truncated_normal(stddev=1e-2, dtype="float32", lower=-2.0, upper=2.0):
    """jax.nn.initializers.truncated_normal: stddev times a standard normal truncated to (lower, upper)."""
    return lambda key, shape, dtype=dtype: random.truncated_normal(key, lower, upper, shape, dtype) * float(stddev)


def constant(value, dtype="float32"):
    """jax.nn.initializers.constant: value everywhere (the key unused)."""
    return lambda key, shape, dtype=dtype: np.full(shape, value, _np(dtype))


def zeros(key, shape, dtype="float32"):
    """jax.nn.initializers.zeros: zeros (the key unused)."""
    return np.zeros(shape, _np(dtype))


def ones(key, shape, dtype="float32"):
    """jax.nn.initializers.ones: ones (the key unused)."""
    return np.ones(shape, _np(dtype))
