"""sf.nn's activations beyond softmax and GELU (shardfuse/nn_activations.py), as jax.nn defines them:
values against float64 NumPy references written from JAX's formulas, on a dp x tp mesh with the input
sharded on both axes, inside sf.jit and on sf.Arrays; gradients against float64 central differences
away from kinks, and JAX's gradients at them."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

ALPHA, SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def _elu(x, alpha=1.0):
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))


REFERENCE = {  # name -> (call, float64 reference)
    "relu": (sf.nn.relu, lambda x: np.maximum(x, 0)),
    "sigmoid": (sf.nn.sigmoid, _sigmoid),
    "log_sigmoid": (sf.nn.log_sigmoid, lambda x: -np.logaddexp(-x, 0)),
    "softplus": (sf.nn.softplus, lambda x: np.logaddexp(x, 0)),
    "silu": (sf.nn.silu, lambda x: x * _sigmoid(x)),
    "swish": (sf.nn.swish, lambda x: x * _sigmoid(x)),
    "leaky_relu": (sf.nn.leaky_relu, lambda x: np.where(x >= 0, x, 0.01 * x)),
    "leaky_relu 0.2": (lambda x: sf.nn.leaky_relu(x, 0.2), lambda x: np.where(x >= 0, x, 0.2 * x)),
    "elu": (sf.nn.elu, _elu),
    "elu 0.5": (lambda x: sf.nn.elu(x, alpha=0.5), lambda x: _elu(x, 0.5)),
    "celu": (lambda x: sf.nn.celu(x, 2.0), lambda x: np.maximum(x, 0) + 2.0 * np.expm1(np.minimum(x, 0) / 2.0)),
    "selu": (sf.nn.selu, lambda x: SCALE * _elu(x, ALPHA)),
    "glu": (sf.nn.glu, lambda x: x[:, :4] * _sigmoid(x[:, 4:])),
    "glu axis 0": (lambda x: sf.nn.glu(x, axis=0), lambda x: x[:2] * _sigmoid(x[2:])),
    "hard_tanh": (sf.nn.hard_tanh, lambda x: np.clip(x, -1, 1)),
    "soft_sign": (sf.nn.soft_sign, lambda x: x / (np.abs(x) + 1)),
    "standardize": (sf.nn.standardize, lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(
        (x * x).mean(-1, keepdims=True) - x.mean(-1, keepdims=True) ** 2 + 1e-5)),
}
MESH = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def _input(seed):
    return np.random.default_rng(seed).standard_normal((4, 8)) * 3


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_values_as_jax_defines_them(name, jit):
    call, ref = REFERENCE[name]
    x64 = _input(1)
    x64[0, :3] = [0.0, 1.0, -1.0]  # (the kinks)
    x = sf.distribute(x64, MESH, ("dp", "tp"))
    got = (sf.jit(call, mesh=MESH) if jit else call)(x)
    np.testing.assert_allclose(np.asarray(got.gather()), ref(x64), rtol=1e-13, atol=1e-15)
    y = sf.jit(call, mesh=MESH)(x64.astype(np.float32))
    assert y.dtype == "float32"
    np.testing.assert_allclose(np.asarray(y.gather()), ref(x64.astype(np.float32).astype(np.float64)), rtol=2e-6,
                               atol=2e-6)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_gradients_against_central_differences(name):
    call, ref = REFERENCE[name]
    x64 = _input(2)
    x64[np.abs(np.abs(x64) - 1) < 1e-3] += 0.01  # (away from the kinks at 0 and +-1)
    w = np.random.default_rng(3).standard_normal(ref(x64).shape)
    g = sf.jit(sf.grad(lambda v: (call(v) * w).sum()), mesh=MESH)(sf.distribute(x64, MESH, ("dp", "tp")))
    h, want = 1e-6, np.zeros_like(x64)
    for idx in np.ndindex(x64.shape):
        e = np.zeros_like(x64)
        e[idx] = h
        want[idx] = ((ref(x64 + e) * w).sum() - (ref(x64 - e) * w).sum()) / (2 * h)
    np.testing.assert_allclose(np.asarray(g.gather()), want, rtol=1e-6, atol=1e-7)


def test_gradients_at_the_kinks_are_jaxs():
    """jax.nn's: relu 0 at 0, leaky_relu 1 at 0, elu alpha at 0, hard_tanh 1 at -1 and 1, celu 1 at 0."""
    x = sf.distribute(np.array([0.0, -1.0, 1.0, 0.0]), sf.DeviceMesh(2), ("DIDx",))

    def grad(f):
        return np.asarray(sf.jit(sf.grad(lambda v: f(v).sum()), mesh=sf.DeviceMesh(2))(x).gather())
    assert grad(sf.nn.relu)[0] == 0.0 and grad(sf.nn.leaky_relu)[0] == 1.0
    assert grad(lambda v: sf.nn.elu(v, 0.5))[0] == 0.5 and grad(sf.nn.celu)[0] == 1.0
    np.testing.assert_array_equal(grad(sf.nn.hard_tanh), [1.0, 1.0, 1.0, 1.0])


def test_glu_refuses_an_odd_axis():
    with pytest.raises(ValueError, match="even extent"):
        sf.jit(lambda v: sf.nn.glu(v, axis=0), mesh=MESH)(np.ones((3, 8)))
