"""Programs a gradient fuzzer (random compositions of ops, sf.grad against central differences in
float64, eager, jitted and sharded) found refused or wrong, each checked against NumPy on fresh random
inputs.  (Its silently wrong one, a cond branch reading a value twice, is in tests/test_lax.py.)"""
from __future__ import annotations

import math

import numpy as np
import pytest

import shardfuse as sf


def meshes():
    return [sf.DeviceMesh(1, backend="numpy"), sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")]


@pytest.mark.parametrize("mesh", meshes(), ids=["1", "2x2"])
def test_the_gradient_through_a_product_with_a_closed_over_vector(mesh):
    """grad of (a @ v).sum() with v a closed-over 1-D NumPy array raised AttributeError (a constant's
    replicated layout had no mesh when its reshape's rule read the axes' sizes)."""
    r = np.random.default_rng()
    a, v, c, w = r.standard_normal((4, 6)), r.standard_normal(6), r.standard_normal(4), r.standard_normal((4, 4))
    g = sf.jit(sf.grad(lambda a: ((sf.shard(a, axis=1, over=mesh.axis_names[-1]) @ v) ** 2).sum()), mesh=mesh)(a)
    np.testing.assert_allclose(np.asarray(g), 2 * (a @ v)[:, None] * v[None], rtol=1e-12)
    g = sf.jit(sf.grad(lambda w: c @ (w @ a) @ v), mesh=mesh)(w)
    np.testing.assert_allclose(np.asarray(g), np.outer(c, a @ v), rtol=1e-12)
    g = sf.jit(sf.grad(lambda u: np.dot(u, v)), mesh=mesh)(r.standard_normal(6))
    np.testing.assert_allclose(np.asarray(g), v, rtol=1e-15)


def test_erf_and_the_exact_gelu_of_a_0_d_value():
    """sf.erf and gelu(approximate=False) of a 0-d value raised on NumPy devices (np.frompyfunc's 0-d
    result is a Python float)."""
    mesh, r = sf.DeviceMesh(2, backend="numpy"), np.random.default_rng()
    x = r.standard_normal(4)
    got = sf.jit(lambda x: (sf.erf(x.sum()), sf.nn.gelu(x.mean(), approximate=False)), mesh=mesh)(x)
    m = x.mean()
    np.testing.assert_allclose(np.asarray(got[0]), math.erf(x.sum()), rtol=1e-15)
    np.testing.assert_allclose(np.asarray(got[1]), 0.5 * m * math.erfc(-m / math.sqrt(2)), rtol=1e-15)


def test_a_vjp_cotangent_closed_over_inside_jit():
    """vjp_fn(c) inside sf.jit with c a NumPy array the function closes over was refused ("must be an
    array ... got ndarray"); JAX takes it, and outside jit it was taken.  A wrong dtype is still refused."""
    mesh, r = sf.DeviceMesh(2, backend="numpy"), np.random.default_rng()
    x, c = r.standard_normal(4), r.standard_normal(4)
    (g,) = sf.jit(lambda x: sf.vjp(np.sin, x)[1](c), mesh=mesh)(x)
    np.testing.assert_allclose(np.asarray(g), np.cos(x) * c, rtol=1e-15)
    with pytest.raises(ValueError, match=r"must be an array of shape \(4,\) and dtype float64, got .*float32"):
        sf.jit(lambda x: sf.vjp(np.sin, x)[1](c.astype(np.float32)), mesh=mesh)(x)
