"""Inside sf.jit a traced value's `.dtype` is a NumPy dtype, as a JAX tracer's is and as an
sf.Array's is outside jit (bfloat16 as ml_dtypes'); the IR's name of it is `.dtype_name`, as on
sf.Array.  A new-user probe found it a str: `x.dtype == np.float32` was False inside jit (so a
branch on it took the wrong side silently) and `x.dtype.itemsize` raised."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import DTYPES, np_dtype

RNG = np.random.default_rng


@pytest.fixture
def mesh():
    return sf.DeviceMesh(4, backend="numpy")


def test_a_branch_on_the_dtype_takes_numpys_side(mesh):
    """The probe's repro: x * 2 for float32, x * 100 otherwise."""
    @sf.jit(mesh=mesh)
    def f(x):
        return x * 2 if x.dtype == np.float32 else x * 100

    x = RNG().standard_normal((8, 4))
    x32 = x.astype(np.float32)
    np.testing.assert_allclose(f(x32).gather(), x32.astype(np.float64) * 2, rtol=1e-6)
    np.testing.assert_allclose(f(x).gather(), x * 100, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_traced_dtype_is_the_numpy_dtype_the_array_has_outside(mesh, dtype):
    seen = {}

    def f(x):
        d = x.dtype
        seen.update(dtype=d, name=x.dtype_name, checks=(isinstance(d, np.dtype), d == dtype, d == np_dtype(dtype),
                                                        d.name, str(d), d.itemsize))
        return x

    arr = sf.shard(np.zeros((8, 4), np_dtype(dtype)), axis=0, mesh=mesh)
    sf.jit(f, mesh=mesh)(arr)
    assert seen["dtype"] == arr.dtype and type(seen["dtype"]) is type(arr.dtype), (seen["dtype"], arr.dtype)
    assert seen["name"] == arr.dtype_name == dtype
    # a string comparison users wrote before keeps working (np.dtype("float32") == "float32")
    assert seen["checks"] == (True, True, True, dtype, dtype, np_dtype(dtype).itemsize)


def test_dtype_driven_code_computes_as_numpy(mesh):
    """Code written for NumPy arrays, on a traced value: np.finfo(x.dtype), np.zeros(..., x.dtype)
    (a constant), x.astype(x.dtype), a membership test against NumPy types."""
    rng = RNG()
    x = rng.standard_normal((8, 6)).astype(np.float32)
    bias = rng.standard_normal(6)

    def f(x):
        eps = float(np.finfo(x.dtype).eps)
        y = x.astype(np.float64).astype(x.dtype) + np.zeros(x.shape, x.dtype) + bias.astype(x.dtype)
        scale = 2.0 if x.dtype in (np.float16, np.float32) and x.dtype.itemsize == 4 else 0.0
        return y * scale + eps

    got = sf.jit(f, mesh=mesh)(sf.shard(x, axis=0, mesh=mesh))
    assert got.dtype == np.float32
    ref = (x.astype(np.float64) + bias.astype(np.float32)) * 2.0 + float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(got.gather(), ref, rtol=1e-6, atol=1e-6)


def test_bfloat16_and_weak_scalars_and_gradients(mesh):
    """bfloat16 compares equal to ml_dtypes' type and to its name; a Python float argument is
    float64 (weakly typed); under sf.grad the primals and cotangents carry NumPy dtypes too."""
    import ml_dtypes

    seen = []

    def f(x, s):
        seen.append((x.dtype, s.dtype))
        return x.astype(np.float32) * s

    x = RNG().standard_normal((4, 4)).astype(ml_dtypes.bfloat16)
    got = sf.jit(f, mesh=mesh)(x, 3.0)
    assert seen[-1] == (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))
    assert seen[-1][0] == "bfloat16" and seen[-1][0] == ml_dtypes.bfloat16
    np.testing.assert_allclose(got.gather(), x.astype(np.float64) * 3.0, rtol=1e-6)

    dtypes_seen = []

    def loss(w):
        dtypes_seen.append(w.dtype)
        return ((w * w) * (2.0 if w.dtype == np.float64 else 0.0)).sum()

    w = RNG().standard_normal((4, 3))
    g = sf.jit(sf.grad(loss), mesh=mesh)(w)
    assert dtypes_seen and all(d == np.float64 and isinstance(d, np.dtype) for d in dtypes_seen)
    np.testing.assert_allclose(g.gather(), 4.0 * w, rtol=1e-12)


@pytest.mark.parametrize("call", ["astype", "zeros_like", "ones_like eager"])
def test_an_array_is_no_dtype(mesh, call):
    """np.dtype() reads any object's .dtype, so with .dtype a NumPy dtype an array passed where a dtype
    goes would pass as its dtype; NumPy refuses it ("Cannot construct a dtype from an array"), and so
    does shardfuse (the review found astype(b) and np.zeros_like(a, b) silently taking b's dtype)."""
    x = RNG().standard_normal((4, 3))
    y = RNG().integers(1, 9, (4, 3)).astype(np.int32)
    with pytest.raises(TypeError, match="dtype from an array"):
        if call == "astype":
            sf.jit(lambda a, b: a.astype(b), mesh=mesh)(x, y)
        elif call == "zeros_like":
            sf.jit(lambda a, b: np.zeros_like(a, b), mesh=mesh)(x, y)
        else:
            np.ones_like(sf.shard(x, axis=0, mesh=mesh), sf.shard(y, axis=0, mesh=mesh))
    assert sf.jit(lambda a: a.astype(np.int32), mesh=mesh)(x).dtype == np.int32
