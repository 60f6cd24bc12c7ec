"""sf.vmap (jax.vmap's in_axes / out_axes, unrolled): against NumPy loops over the mapped axis on fresh
random inputs, inside sf.jit (sharded inputs, a gradient through it checked by central differences, nested
maps, pytrees), on sf.Arrays and on NumPy arrays; and its refusals."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from cases import directional


def mesh():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def test_in_axes_out_axes_and_a_weight_not_mapped():
    r = np.random.default_rng()
    x, w = r.standard_normal((3, 4, 6)), r.standard_normal((6, 8))
    f = lambda a, w: np.tanh(a @ w).sum(0)  # noqa: E731
    want = np.stack([f(x[i], w) for i in range(3)])
    got = sf.jit(lambda x, w: sf.vmap(f, in_axes=(0, None))(x, sf.shard(w, axis=1, over="tp")), mesh=mesh())(x, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12)
    moved = sf.jit(lambda x, w: sf.vmap(f, in_axes=(2, None), out_axes=-1)(x, w), mesh=mesh())(x.transpose(1, 2, 0), w)
    np.testing.assert_allclose(np.asarray(moved), want.T, rtol=1e-12)
    placed = sf.shard(x, axis=2, over="tp", mesh=mesh())
    np.testing.assert_allclose(np.asarray(sf.vmap(lambda a: a * a)(placed)), x * x, rtol=1e-15)  # (eager)
    np.testing.assert_allclose(sf.vmap(lambda a: a.sum(), in_axes=1)(x), x.sum(axis=(0, 2)), rtol=1e-12)  # (NumPy)


def test_per_example_losses_nested_maps_pytrees_and_the_gradient():
    r = np.random.default_rng()
    x, w = r.standard_normal((4, 5)), r.standard_normal((5, 3))
    per_example = sf.vmap(lambda a, w: ((a @ w) ** 2).sum(), in_axes=(0, None))
    g = sf.jit(sf.grad(lambda w, x: per_example(x, w).mean()), mesh=mesh())(w, x)
    want, got = directional(lambda w: ((x @ w) ** 2).sum(1).mean(), w, np.asarray(g), r)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    outer = sf.vmap(sf.vmap(lambda a, b: a * b, in_axes=(0, None)), in_axes=(None, 0))  # (an outer product)
    u, v = r.standard_normal(3), r.standard_normal(2)
    np.testing.assert_allclose(np.asarray(sf.jit(outer, mesh=mesh())(u, v)), np.outer(v, u), rtol=1e-15)
    d = {"h": r.standard_normal((2, 3)), "s": r.standard_normal(2)}
    out = sf.jit(lambda d: sf.vmap(lambda d: {"y": d["h"] * d["s"], "c": 1.5}, out_axes={"y": 1, "c": None})(d),
                 mesh=mesh())(d)
    np.testing.assert_allclose(np.asarray(out["y"]), (d["h"] * d["s"][:, None]).T, rtol=1e-15)
    assert float(np.asarray(out["c"])) == 1.5


def test_refusals_say_what_was_expected():
    x, w = np.ones((3, 4)), np.ones((4, 2))
    with pytest.raises(ValueError, match=r"the mapped axes must have one size, got \[3, 4\]"):
        sf.vmap(lambda a, b: a @ b)(x, w)
    with pytest.raises(ValueError, match=r"in_axes \(0,\) is not a prefix"):
        sf.vmap(lambda a, b: a @ b, in_axes=(0,))(x, w)
    with pytest.raises(ValueError, match="in_axes 2 is out of range for a value of 2 axes"):
        sf.vmap(lambda a: a, in_axes=2)(x)
    with pytest.raises(ValueError, match="no argument is mapped"):
        sf.vmap(lambda a: a, in_axes=None)(x)
    with pytest.raises(TypeError, match="axis_name= .* not supported"):
        sf.vmap(lambda a: a, axis_name="batch")(x)


def test_keyword_arguments_are_mapped_over_their_first_axis_and_scans_of_numpy_carries():
    """jax.vmap maps keyword arguments over axis 0 (a review: refused with a bare TypeError); an eager
    sf.lax.scan whose NumPy carry makes a NumPy first output stacks it beside sf.Arrays (an MPI probe)."""
    r = np.random.default_rng()
    x, w = r.standard_normal((3, 4)), r.standard_normal((3, 4))
    got = sf.jit(lambda x, w: sf.vmap(lambda a, b: (a * b).sum())(x, b=w), mesh=mesh())(x, w)
    np.testing.assert_allclose(np.asarray(got), (x * w).sum(1), rtol=1e-14)
    xs = sf.shard(np.arange(24.).reshape(8, 3), axis=0, over="dp", mesh=mesh())
    c, ys = sf.lax.scan(lambda c, r: (c + r, c.sum()), np.zeros(3), xs)
    cums = np.cumsum(np.arange(24.).reshape(8, 3), 0)
    np.testing.assert_array_equal(np.asarray(c), cums[-1])
    np.testing.assert_array_equal(np.asarray(ys), np.concatenate([[0.0], cums[:-1].sum(1)]))
    _, ys = sf.lax.scan(lambda c, r: (c + r, c.sum()), np.zeros(3), np.arange(24.).reshape(8, 3))  # (NumPy only)
    np.testing.assert_array_equal(ys, np.concatenate([[0.0], cums[:-1].sum(1)]))


def test_python_numbers_stacked_beside_arrays_take_their_dtype():
    """A review: a scan whose carry starts as the Python number 0.0 stacked float32 steps as float64 (the first
    step's number made a strong float64 array); numbers are weak, as JAX's."""
    xs = np.arange(1, 5, dtype=np.float32)
    f = lambda c, x: (c + x, c)  # noqa: E731
    assert sf.lax.scan(f, 0.0, xs)[1].dtype == np.float32
    assert np.asarray(sf.jit(lambda xs: sf.lax.scan(f, 0.0, xs)[1], mesh=mesh())(xs)).dtype == np.float32
    assert sf.stack([np.float32(1), 2.0]).dtype == np.float32
