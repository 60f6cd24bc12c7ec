"""sf.nn.initializers (shardfuse/nn_init.py), jax.nn.initializers' API: each initializer's samples have
JAX's variance (scale / fan, fan by JAX's rule with in_axis, out_axis and batch_axis) and distribution
(uniform within sqrt(3 var), a truncated normal within two of its standard deviations), in the dtype asked,
the same numbers inside sf.jit as outside, and the refusals JAX makes."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf

ini = sf.nn.initializers
KEY = sf.random.key(11)
# name -> (scale, mode, distribution)
NAMED = {"glorot_uniform": (1.0, "fan_avg", "uniform"), "xavier_normal": (1.0, "fan_avg", "truncated_normal"),
         "glorot_normal": (1.0, "fan_avg", "truncated_normal"), "he_uniform": (2.0, "fan_in", "uniform"),
         "kaiming_normal": (2.0, "fan_in", "truncated_normal"), "he_normal": (2.0, "fan_in", "truncated_normal"),
         "lecun_uniform": (1.0, "fan_in", "uniform"), "lecun_normal": (1.0, "fan_in", "truncated_normal")}


def jax_fans(shape, in_axis=-2, out_axis=-1, batch_axis=()):
    """jax.nn.initializers' _compute_fans, written out."""
    batch = [b % len(shape) for b in np.atleast_1d(batch_axis)]
    ins, outs = in_axis % len(shape), out_axis % len(shape)
    receptive = np.prod([n for k, n in enumerate(shape) if k not in (ins, outs, *batch)])
    return shape[ins] * receptive, shape[outs] * receptive


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_initializers_have_jaxs_variance_and_support(name):
    scale, mode, dist = NAMED[name]
    shape = (384, 256)
    w = getattr(ini, name)()(KEY, shape)
    fan_in, fan_out = jax_fans(shape)
    var = scale / {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    assert w.dtype == np.float32 and w.shape == shape
    np.testing.assert_allclose(w.var(), var, rtol=0.03)
    assert abs(w.mean()) < 0.05 * np.sqrt(var)
    bound = np.sqrt(3 * var) if dist == "uniform" else 2 * np.sqrt(var) / 0.87962566103423978
    assert np.abs(w).max() <= bound * (1 + 1e-6), (np.abs(w).max(), bound)
    assert np.abs(w).max() > 0.95 * bound  # (the support is reached: not a narrower distribution)


@pytest.mark.parametrize("shape, axes", [((3, 3, 64, 128), {}), ((64, 128, 3, 3), {"in_axis": 1, "out_axis": 0}),
                                         ((4, 32, 48), {"batch_axis": 0}), ((8, 16, 24), {"in_axis": 0, "out_axis": 2})])
@pytest.mark.parametrize("mode", ["fan_in", "fan_out", "fan_avg"])
def test_variance_scaling_fans_as_jax(shape, axes, mode):
    w = ini.variance_scaling(2.0, mode, "normal", **axes)(KEY, shape, "float64")
    fan_in, fan_out = jax_fans(shape, **axes)
    fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    np.testing.assert_allclose(w.var(), 2.0 / fan, rtol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_inside_jit_the_same_numbers_in_the_dtype_asked(dtype):
    mesh = sf.DeviceMesh(2, backend="numpy")
    init = ini.glorot_normal(dtype=dtype)
    got = sf.jit(lambda k: sf.shard(init(k, (8, 4)), axis=0), mesh=mesh)(KEY)
    want = init(KEY, (8, 4))
    assert got.dtype == want.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype), got.dtype
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64))


def test_the_plain_ones():
    w = ini.normal(0.02)(KEY, (200, 300))
    np.testing.assert_allclose(w.std(), 0.02, rtol=0.02)
    u = ini.uniform(0.5)(KEY, (1000,))
    assert u.min() >= 0 and u.max() < 0.5 and abs(u.mean() - 0.25) < 0.02
    t = ini.truncated_normal(1.0, lower=-1.0, upper=1.0)(KEY, (2000,))
    assert np.abs(t).max() <= 1.0 and t.std() < 0.6
    np.testing.assert_array_equal(ini.zeros(KEY, (2, 3), "bfloat16").astype(np.float32), np.zeros((2, 3)))
    np.testing.assert_array_equal(ini.ones(KEY, (2,)), np.ones(2, np.float32))
    np.testing.assert_array_equal(ini.constant(-3.5)(KEY, (2,)), np.full(2, -3.5, np.float32))


def test_refusals_as_jax():
    with pytest.raises(ValueError, match="must be at least 2-D"):
        ini.he_normal()(KEY, (5,))
    with pytest.raises(ValueError, match="mode must be"):
        ini.variance_scaling(1.0, "fan_max", "normal")
    with pytest.raises(ValueError, match="distribution must be"):
        ini.variance_scaling(1.0, "fan_in", "cauchy")
