"""NumPy arrays a jitted function closes over or makes while traced, combined with traced values:
replicated constants of the program (shardfuse/constants.py), as JAX's.  Printed among the plan's
inputs, bound by the plan at each call, captured (copied) at trace time: part of the trace.  The
case bodies run on NumPy devices here and under mpiexec (tests/mpi/test_gather_mpi.py)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

RNG = np.random.default_rng


def check_closed_over(mesh, rng):
    """Constants on both sides of every kind of op, beside a value sharded on rows."""
    x = rng.standard_normal((8, 6))
    c, row, w = rng.standard_normal((8, 6)), rng.standard_normal(6), rng.standard_normal((6, 4))
    zero_d = np.array(1.5)

    def f(x):
        x = sf.shard(x, axis=0, over=mesh.axis_names[0])
        y = (x + c) * row - (c - x) / (np.abs(row) + 1) + zero_d
        y = np.maximum(y, c) + np.where(c > 0, y, -row) + (x < c) * 1.0
        return y @ w, (c @ w) * 2 - x @ w, w.T @ x.T
    got = sf.jit(f, mesh=mesh)(x)
    y = (x + c) * row - (c - x) / (np.abs(row) + 1) + zero_d
    y = np.maximum(y, c) + np.where(c > 0, y, -row) + (x < c) * 1.0
    for g, want in zip(got, (y @ w, (c @ w) * 2 - x @ w, w.T @ x.T)):
        np.testing.assert_allclose(g.gather(), want, rtol=1e-12, atol=1e-12)
    return got


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_closed_over_arrays_on_both_sides(shape):
    mesh = sf.DeviceMesh(shape, ("DIDx",) if len(shape) == 1 else ("dp", "tp"))
    check_closed_over(mesh, RNG(0))


def test_the_plan_prints_them_and_communicates_nothing_for_them():
    c = RNG(1).standard_normal((8, 6)).astype(np.float32)
    f = sf.jit(lambda x: sf.shard(x, axis=0) * c + c, mesh=sf.DeviceMesh(4))
    plan = f.lower(sf.TensorSpec((8, 6), "float32"))
    text = str(plan)
    assert "plan <lambda>(x: f32[8:DIDx, 6], const: f32[8, 6])" in text, text  # one array, one input
    assert "  # constants: const (NumPy arrays captured when traced; the plan binds them at each call)" in text
    assert "ShardSlice const" in text and plan.collectives() == {}, text  # replicated: each device its rows


def test_dtypes_promote_as_numpy():
    x = RNG(2).standard_normal((4, 4)).astype(np.float32)
    c64, c32, ints = RNG(3).standard_normal(4), RNG(4).standard_normal(4).astype(np.float32), np.arange(4)
    f = sf.jit(lambda x: (x + c64, x * c32, x - ints, ints + (x > 0)), mesh=sf.DeviceMesh(2))
    got = f(x)
    for g, want in zip(got, (x + c64, x * c32, x - ints, ints + (x > 0))):
        assert g.dtype == want.dtype.name, (g.dtype, want.dtype)
        np.testing.assert_allclose(g.gather(), want, rtol=1e-6)


def test_captured_at_trace_time_and_retraced_with_the_new_value():
    """A global rebound between two traces (other input shapes): each plan keeps its own trace's
    constant; writing into the array after the trace changes nothing (a copy was captured)."""
    mesh = sf.DeviceMesh(2)
    state = {"c": RNG(5).standard_normal(4)}
    f = sf.jit(lambda x: x + state["c"], mesh=mesh)
    first_c = state["c"].copy()
    x4, x24 = RNG(6).standard_normal(4), RNG(7).standard_normal((2, 4))
    np.testing.assert_array_equal(f(x4).gather(), x4 + first_c)
    state["c"][...] = 100.0  # written after the trace
    np.testing.assert_array_equal(f(x4).gather(), x4 + first_c)
    state["c"] = RNG(8).standard_normal(4)  # rebound: the next trace (new shape) captures it
    np.testing.assert_array_equal(f(x24).gather(), x24 + state["c"])
    np.testing.assert_array_equal(f(x4).gather(), x4 + first_c)  # the first plan, still its own
    assert len(f.cached_plans()) == 2


def test_same_text_other_constants_do_not_share_values():
    """Two functions whose plans print alike, with different constants, on one mesh."""
    mesh = sf.DeviceMesh(4)
    a, b = RNG(9).standard_normal((8, 2)), RNG(10).standard_normal((8, 2))
    fa = sf.jit(lambda x: sf.shard(x, axis=0) - a, mesh=mesh)
    fb = sf.jit(lambda x: sf.shard(x, axis=0) - b, mesh=mesh)
    x = RNG(11).standard_normal((8, 2))
    assert str(fa.lower(x)) == str(fb.lower(x))
    np.testing.assert_array_equal(fa(x).gather(), x - a)
    np.testing.assert_array_equal(fb(x).gather(), x - b)


def test_inlined_function_given_a_numpy_array():
    mesh = sf.DeviceMesh(2)
    inner = sf.jit(lambda p, q: p * q, mesh=mesh)
    c = RNG(12).standard_normal((4, 4))
    x = RNG(13).standard_normal((4, 4))
    np.testing.assert_allclose(sf.jit(lambda x: inner(x, c) + inner(c, x), mesh=mesh)(x).gather(), 2 * x * c)


def test_unsupported_dtype_is_refused_naming_it():
    f = sf.jit(lambda x: x + np.ones(4, np.complex64), mesh=sf.DeviceMesh(2))
    with pytest.raises(TypeError, match=r"NumPy array of dtype complex64 \(shape \(4,\)\) met a traced value"):
        f.lower(sf.TensorSpec((4,), "float32"))


def test_mismatched_shapes_are_refused_at_trace_time():
    f = sf.jit(lambda x: x + np.ones(3), mesh=sf.DeviceMesh(2))
    with pytest.raises(ValueError, match=r"add of \w+ and const: shapes \(4,\) and \(3,\) do not broadcast"):
        f.lower(sf.TensorSpec((4,), "float32"))


def test_profile_and_predict_of_a_plan_with_constants():
    mesh = sf.DeviceMesh(2)
    c = RNG(14).standard_normal((4, 4))
    plan = sf.jit(lambda x: x @ c, mesh=mesh).lower(sf.TensorSpec((4, 4), "float64"))
    x = RNG(15).standard_normal((4, 4))
    np.testing.assert_allclose(plan(x).gather(), x @ c, rtol=1e-12)
    assert plan.profile(x, repeat=2).summary() is not None
    assert plan.predict().total_s >= 0
