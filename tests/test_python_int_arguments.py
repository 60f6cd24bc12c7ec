"""A Python int passed to sf.jit is weakly typed (as JAX's, and as NumPy 2's scalars): beside an
int32 array it is promoted to int32.  One outside int32's range raised nowhere and wrapped
silently (a new-user probe: x + (2**31 + 5) gave wrapped values, x + 2**40 gave x), where NumPy 2
and JAX raise OverflowError, and where the same constant inside the function, or an op outside
jit, raises too.  Now the call raises OverflowError naming the argument, before the plan runs."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

RNG = np.random.default_rng


@pytest.fixture
def mesh():
    return sf.DeviceMesh(4, backend="numpy")


def ints(dtype=np.int32):
    x = RNG().integers(-1000, 1000, 8).astype(dtype)
    return np.where(x == 0, 7, x).astype(dtype)  # (non-zero: a result equal to x shows)


@pytest.mark.parametrize("s", [2**31 + 5, 2**40, -2**31 - 1, 2**62])
def test_an_int_out_of_int32_bounds_beside_int32_arrays_raises(mesh, s):
    x = ints()
    with pytest.raises(OverflowError, match="out of bounds for int32"):  # NumPy 2 on the same
        np.add(x, s)
    for name, fn in [("add", lambda x, s: x + s), ("reflected", lambda x, s: s * x),
                     ("maximum", lambda x, s: np.maximum(x, s)), ("where", lambda x, s: sf.where(x > 0, x, s)),
                     ("compare", lambda x, s: x < s)]:
        f = sf.jit(fn, mesh=mesh)
        with pytest.raises(OverflowError, match=rf"<lambda>\(\): argument s is the Python int {s}, out of bounds for "
                                                r"int32, the dtype it is promoted to .* pass np.int64\(s\)"):
            f(x, s)
    with pytest.raises(OverflowError):  # the same value as a constant inside the function
        sf.jit(lambda x: x + s, mesh=mesh)(x).gather()


@pytest.mark.parametrize("s", [2**31 - 1, -2**31, 5, -3])
def test_an_int_within_bounds_computes_as_numpy(mesh, s):
    x = ints()
    got = sf.jit(lambda x, s: x + s, mesh=mesh)(x, s)
    want = np.add(x, s)  # (NumPy 2: int32, wrapping in the addition itself as int32 arithmetic does)
    assert got.dtype == np.int32 and want.dtype == np.int32
    np.testing.assert_array_equal(got.gather(), want)


def test_wider_results_and_explicit_casts_are_not_refused(mesh):
    """An int64 array takes any int64 value; a NumPy int64 scalar is strong (an int64 result, as
    NumPy's); a float array takes a large int as a float; an explicit astype wraps, as NumPy's."""
    s = 2**31 + 5
    x32, x64 = ints(), ints(np.int64)
    f = sf.jit(lambda x, s: x + s, mesh=mesh)
    np.testing.assert_array_equal(f(x64, s).gather(), x64 + s)
    got = f(x32, np.int64(s))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got.gather(), x32.astype(np.int64) + s)
    xf = RNG().standard_normal(8).astype(np.float32)
    np.testing.assert_allclose(f(xf, 2**40).gather(), (xf + 2**40).astype(np.float64), rtol=1e-7)
    cast = sf.jit(lambda x, s: x + s.astype("int32"), mesh=mesh)(x32, s)
    np.testing.assert_array_equal(cast.gather(), x32 + np.int64(s).astype(np.int32))


def test_an_int_beyond_int64_is_refused_naming_the_argument(mesh):
    f = sf.jit(lambda x, s: x + s, mesh=mesh)
    for s in (2**63, -2**63 - 1, 2**70):
        with pytest.raises(OverflowError, match=rf"argument s \(position 1\): the Python int {s} is out of bounds "
                                                "for int64"):
            f(ints(np.int64), s)


def test_a_refused_call_leaves_the_plan_usable(mesh):
    f = sf.jit(lambda x, s: x * s, mesh=mesh)
    x = ints()
    with pytest.raises(OverflowError):
        f(x, 2**31)
    np.testing.assert_array_equal(f(x, 3).gather(), x * 3)
    assert len(f.cached_plans()) == 1  # (one plan for every Python int: the value is checked per call)
