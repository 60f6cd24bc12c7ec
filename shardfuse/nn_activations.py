"""jax.nn's activation functions beyond softmax and GELU, written as JAX writes them (so their values and
gradients at kinks are JAX's): relu, sigmoid, log_sigmoid, softplus, silu / swish, leaky_relu, elu, celu,
selu, glu, hard_tanh, soft_sign and standardize.  Each is a composition of shardfuse's ops on traced
values: their shardings, communication and gradients follow; sf.nn wraps each for sf.Arrays too (one
plan)."""
from __future__ import annotations

import numpy as np

from shardfuse.numpy_math import expm1
from shardfuse.traced_numpy import relu, rsqrt, sigmoid, silu, where

# jax.nn.selu's constants
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def softplus(x):
    """log(1 + e**x), without overflow: np.logaddexp(x, 0) (jax.nn.softplus)."""
    return np.logaddexp(x, 0.0)


def log_sigmoid(x):
    """log(sigmoid(x)) = -softplus(-x) (jax.nn.log_sigmoid)."""
    return -softplus(-x)


def leaky_relu(x, negative_slope=0.01):
    """x where x >= 0, else negative_slope * x (jax.nn.leaky_relu: the gradient at 0 is 1)."""
    return where(x >= 0, x, negative_slope * x)


def elu(x, alpha=1.0):
    """x where x > 0, else alpha * (e**x - 1) (jax.nn.elu; the exponential of the positive side is never taken)."""
    safe = where(x > 0, 0.0, x)
    return where(x > 0, x, alpha * expm1(safe))


def celu(x, alpha=1.0):
    """max(x, 0) + alpha * (e**(min(x, 0) / alpha) - 1) (jax.nn.celu)."""
    return np.maximum(x, 0.0) + alpha * expm1(np.minimum(x, 0.0) / alpha)


def selu(x):
    """scale * elu(x, alpha) with the self-normalising constants (jax.nn.selu)."""
    return _SELU_SCALE * elu(x, _SELU_ALPHA)


def glu(x, axis=-1):
    """The gated linear unit: x's halves a and b along `axis`, a * sigmoid(b) (jax.nn.glu)."""
    if x.shape[axis] % 2:
        raise ValueError(f"sf.nn.glu: axis {axis} of {x.shape} must have an even extent (two halves)")
    a, b = np.split(x, 2, axis=axis)
    return a * sigmoid(b)


def hard_tanh(x):
    """x clipped to [-1, 1] (jax.nn.hard_tanh: the gradient is 0 beyond the bounds and 1 on them)."""
    return where(x > 1, 1.0, where(x < -1, -1.0, x))


def soft_sign(x):
    """x / (|x| + 1) (jax.nn.soft_sign)."""
    return x / (abs(x) + 1.0)


def standardize(x, axis=-1, mean=None, variance=None, epsilon=1e-5):
    """(x - mean) * rsqrt(variance + epsilon) over `axis`, mean and variance computed where not given
    (jax.nn.standardize: variance as mean(x**2) - mean**2)."""
    if mean is None:
        mean = x.mean(axis, keepdims=True)
    if variance is None:
        variance = (x * x).mean(axis, keepdims=True) - mean * mean
    return (x - mean) * rsqrt(variance + epsilon)


ACTIVATIONS = (relu, sigmoid, log_sigmoid, softplus, silu, leaky_relu, elu, celu, selu, glu, hard_tanh, soft_sign,
               standardize)
