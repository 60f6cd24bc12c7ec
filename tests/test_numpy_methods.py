"""var / std, clip, argmax / argmin, floor_divide (//) and mod (%) inside sf.jit and on sf.Arrays
outside it, on a 1-D mesh of 4 and a 2x2 mesh with the reduced axis sharded and not, against NumPy
in float64 on random inputs (never zeros; ties and NaNs for argmax / argmin), with NumPy's result
dtypes; their communication (argmax over a sharded axis: an Allreduce-max of the values, then an
Allreduce-min of the indices), and a new user's probe (x // 2, x % 3 on traced values).

The case bodies (CASES, check) are shared: tests/mpi/test_numpy_methods_mpi.py runs them under
mpiexec; the gradients are tests/test_grad.py's CASES.
"""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
import test_elementwise_ops as ew
from shardfuse import array_ops


def nonzero(rng, shape):
    return rng.uniform(0.25, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


def ties(rng, shape):  # few distinct values: every row and column holds its max and min several times
    return rng.choice([-1.5, -0.25, 0.75, 2.0], shape)


def ints(rng, shape):  # never zero, both signs (floor division and remainder differ from C's there)
    return (rng.integers(1, 20, shape) * rng.choice([-1, 1], shape)).astype(np.int32)


# name -> (fn(x, y) on traced values or sf.Arrays, its NumPy reference, input generator)
CASES = {
    "x.var 1": (lambda x, y: x.var(1), lambda x, y: x.var(1), nonzero),
    "np.var 0 ddof=1": (lambda x, y: np.var(x, axis=0, ddof=1), lambda x, y: np.var(x, axis=0, ddof=1), nonzero),
    "x.var (0, 1) keepdims": (lambda x, y: x.var((0, 1), keepdims=True), lambda x, y: x.var((0, 1), keepdims=True),
                              nonzero),
    "np.var None": (lambda x, y: np.var(x), lambda x, y: np.var(x), nonzero),
    "np.var of ints": (lambda x, y: np.var(x, axis=1), lambda x, y: np.var(x, axis=1), ints),
    "x.std -1 ddof=1 keepdims": (lambda x, y: x.std(-1, ddof=1, keepdims=True),
                                 lambda x, y: x.std(-1, ddof=1, keepdims=True), nonzero),
    "np.std None": (lambda x, y: np.std(x), lambda x, y: np.std(x), nonzero),
    "layer norm by hand": (lambda x, y: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
                           lambda x, y: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
                           nonzero),
    "np.clip": (lambda x, y: np.clip(x, -0.5, 1.0), lambda x, y: np.clip(x, -0.5, 1.0), nonzero),
    "x.clip(min=)": (lambda x, y: x.clip(min=0.3), lambda x, y: x.clip(min=0.3), nonzero),
    "x.clip(None, hi)": (lambda x, y: x.clip(None, -0.3), lambda x, y: x.clip(None, -0.3), nonzero),
    "np.clip arrays": (lambda x, y: np.clip(x, -abs(y), abs(y)), lambda x, y: np.clip(x, -abs(y), abs(y)), nonzero),
    "np.clip of ints": (lambda x, y: np.clip(x, -5, 7), lambda x, y: np.clip(x, -5, 7), ints),
    "x.argmax 1": (lambda x, y: x.argmax(1), lambda x, y: x.argmax(1), nonzero),
    "np.argmax 0 keepdims": (lambda x, y: np.argmax(x, axis=0, keepdims=True),
                             lambda x, y: np.argmax(x, axis=0, keepdims=True), nonzero),
    "x.argmin -1": (lambda x, y: x.argmin(-1), lambda x, y: x.argmin(-1), nonzero),
    "np.argmin None": (lambda x, y: np.argmin(x), lambda x, y: np.argmin(x), nonzero),
    "x.argmax ties 1": (lambda x, y: x.argmax(1), lambda x, y: x.argmax(1), ties),
    "x.argmax ties 0": (lambda x, y: x.argmax(0), lambda x, y: x.argmax(0), ties),
    "np.argmin ties 0": (lambda x, y: np.argmin(x, 0), lambda x, y: np.argmin(x, 0), ties),
    "np.argmax ties None keepdims": (lambda x, y: np.argmax(x, keepdims=True), lambda x, y: np.argmax(x, keepdims=True),
                                     ties),
    "x.argmax of ints": (lambda x, y: x.argmax(1), lambda x, y: x.argmax(1), ints),
    "x // 0.3": (lambda x, y: x // 0.3, lambda x, y: x // 0.3, nonzero),
    "x % 0.7": (lambda x, y: x % 0.7, lambda x, y: x % 0.7, nonzero),
    "2.0 // x": (lambda x, y: 2.0 // x, lambda x, y: 2.0 // x, nonzero),
    "3.0 % x": (lambda x, y: 3.0 % x, lambda x, y: 3.0 % x, nonzero),
    "x // y": (lambda x, y: x // y, lambda x, y: x // y, nonzero),
    "np.mod": (lambda x, y: np.mod(x, y), lambda x, y: np.mod(x, y), nonzero),
    "np.floor_divide": (lambda x, y: np.floor_divide(x, y), lambda x, y: np.floor_divide(x, y), nonzero),
    "np.remainder of ints": (lambda x, y: np.remainder(x, y), lambda x, y: np.remainder(x, y), ints),
    "ints // 3": (lambda x, y: x // 3, lambda x, y: x // 3, ints),
    "ints % -3": (lambda x, y: x % -3, lambda x, y: x % -3, ints),
    "7 // ints": (lambda x, y: 7 // x, lambda x, y: 7 // x, ints),
    "ints // 2.5 (float64)": (lambda x, y: x // 2.5, lambda x, y: x // 2.5, ints),
}
LAYOUTS = ["1d R", "1d S0", "1d S1", "2d S0 S1", "2d S(0,1)"]


def check(name, mesh, layout, jit, rng):
    """CASES[name] on x, y placed with LAYOUTS[layout], in sf.jit or outside: values and dtype as NumPy's
    (integers and indices exactly)."""
    fn, ref, gen = CASES[name]
    _, lx, ly = ew.LAYOUTS[layout]
    x, y = gen(rng, ew.SHAPE), gen(rng, ew.SHAPE)
    xa, ya = ew.place(x, mesh, lx), ew.place(y, mesh, ly)
    got = sf.jit(fn, mesh=mesh)(xa, ya) if jit else fn(xa, ya)
    want = ref(x, y)
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    ew.compare(got.gather(), want, "float64", name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, layout, jit):
    check(name, ew.mesh_of(ew.LAYOUTS[layout][0]), layout, jit, np.random.default_rng(7))


@pytest.mark.parametrize("dtype", ew.DTYPES)
@pytest.mark.parametrize("name", ["x.var 1", "x.std -1 ddof=1 keepdims", "np.clip", "x.argmax 1", "np.argmin ties 0",
                                  "x // 0.3", "x % 0.7", "x // y"])
def test_in_every_float_dtype(name, dtype):
    fn, ref, gen = CASES[name]
    rng = np.random.default_rng(8)
    x, y = (gen(rng, ew.SHAPE).astype(ew.np_dtype(dtype)) for _ in range(2))
    mesh = ew.mesh_of(4)
    got = sf.jit(fn, mesh=mesh)(sf.shard(x, axis=1, mesh=mesh), sf.shard(y, axis=1, mesh=mesh))
    want = ref(x.astype(np.float64), y.astype(np.float64))
    assert got.dtype == (np.int64 if "arg" in name else x.dtype), (name, got.dtype)
    if "//" in name or "%" in name:  # (x rounded to 16 bits: compare with NumPy on the rounded values)
        np.testing.assert_allclose(np.asarray(got).astype(np.float64), ref(x, y).astype(np.float64), atol=1e-2)
    else:
        ew.compare(got.gather(), want, dtype, name)


def test_argmax_and_argmin_find_the_first_nan_as_numpy():
    x = nonzero(np.random.default_rng(9), ew.SHAPE)
    x[2, 7], x[2, 9], x[5, 1], x[6, 0] = np.nan, np.nan, np.nan, np.nan
    mesh = ew.mesh_of(4)
    for axis in (0, 1, None):
        for spec in (("DIDx", None), (None, "DIDx")):
            xa = sf.distribute(x, mesh, spec)
            np.testing.assert_array_equal(xa.argmax(axis).gather(), x.argmax(axis))
            np.testing.assert_array_equal(sf.jit(lambda v: np.argmin(v, axis), mesh=mesh)(xa).gather(), x.argmin(axis))


def _collectives(fn, spec, mesh=None, shape=ew.SHAPE, dtype="float64"):
    mesh = mesh or ew.mesh_of(4)
    return sf.jit(fn, mesh=mesh).lower(sf.TensorSpec(shape, dtype, sf.Layout(spec))).collectives()


def test_argmax_over_a_sharded_axis_is_an_allreduce_max_then_an_allreduce_min():
    mesh = ew.mesh_of(4)
    plan = sf.jit(lambda x: x.argmax(1), mesh=mesh).lower(sf.TensorSpec(ew.SHAPE, "float64", sf.Layout((None, "DIDx"))))
    assert plan.collectives() == {"allreduce": 2}, plan
    text = str(plan)
    assert "op=max" in text and "op=min" in text and text.index("op=max") < text.index("op=min"), text
    assert _collectives(lambda x: x.argmax(1), ("DIDx", None)) == {}  # the reduced axis whole: local
    assert _collectives(lambda x: x.argmin(0), (None, "DIDx")) == {}
    assert _collectives(lambda x: x.argmax(1), ("DIDy", "DIDx"), ew.mesh_of((2, 2))) == {"allreduce": 2}


def test_var_clip_and_floor_division_communicate_as_their_ops():
    assert _collectives(lambda x: x.var(1), ("DIDx", None)) == {}  # local
    assert _collectives(lambda x: x.var(1), (None, "DIDx")) == {"allreduce": 2}  # the mean, then the mean square
    for fn in (lambda x: np.clip(x, -1.0, 1.0), lambda x: x // 0.5, lambda x: x % 3.0, lambda x: x // (x + 3.0)):
        for spec in (("DIDx", None), (None, "DIDx")):
            assert _collectives(fn, spec) == {}


def test_the_probe_floor_division_and_remainder_on_traced_values():
    # a new user's probe: integer index arithmetic inside sf.jit (it raised Python's bare TypeError)
    mesh = ew.mesh_of(4)
    i = np.arange(-16, 16, dtype=np.int32).reshape(8, 4)
    f = sf.jit(lambda x: (x // 2, x % 3, x // 2 * 3 + x % 3), mesh=mesh)
    for got, want in zip(f(sf.shard(i, axis=0, mesh=mesh)), (i // 2, i % 3, i // 2 * 3 + i % 3)):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(got), want)
    x = np.linspace(-3.1, 3.3, 32).reshape(8, 4)
    got = sf.jit(lambda v: (v // 2, v % 3), mesh=mesh)(x)
    np.testing.assert_array_equal(np.asarray(got[0]), x // 2)
    np.testing.assert_allclose(np.asarray(got[1]), x % 3, rtol=1e-15)
    text = str(sf.jit(lambda v: v // 2, mesh=mesh).trace(sf.TensorSpec((8, 4), "int32")))
    assert "floor_divide(" in text, text


def test_dtypes_as_numpy():
    mesh = ew.mesh_of(4)
    specs = {dt: sf.TensorSpec(ew.SHAPE, dt) for dt in ("int32", "int64", "float32", "float16")}

    def out_dtype(fn, dt):
        return sf.jit(fn, mesh=mesh).lower(specs[dt]).program.outputs[0].type.dtype
    assert out_dtype(lambda x: x.var(0), "int32") == "float64"
    assert out_dtype(lambda x: x.std(0), "float16") == "float16"
    assert out_dtype(lambda x: x.argmax(0), "float32") == "int64"
    assert out_dtype(lambda x: x // 2, "int64") == "int64"
    assert out_dtype(lambda x: x // 2.5, "int32") == "float64"
    assert out_dtype(lambda x: x % 2, "float16") == "float16"
    assert out_dtype(lambda x: np.clip(x, 0, 3), "int32") == "int32"
    assert out_dtype(lambda x: np.clip(x, 0.5, 3), "int32") == "float64"


def check_integer_sums(mesh):
    """Integer sums across devices are exact and wrap as NumPy's (a DTensor probe: the NumPy backends
    added the devices' pieces in float64, 2**53 + 1 lost, an overflowing total an OverflowError), and
    dtype= is the result's dtype (sum(dtype=np.int32) was int64)."""
    d = mesh.size
    x = np.zeros(2 * d, np.int64)
    x[0], x[1], x[-1] = 2**53 + 1, 2, 3
    big = np.full((d, 3), 2**62, np.int64)  # (its total wraps, as NumPy's)
    with np.errstate(over="ignore"):
        for jit in (False, True):
            for v, axis in ((x, None), (big, 0)):
                f = (lambda a, axis=axis: a.sum(axis))
                got = (sf.jit(f, mesh=mesh) if jit else f)(sf.shard(v, axis=0, mesh=mesh))
                np.testing.assert_array_equal(np.asarray(got.gather() if hasattr(got, "gather") else got), v.sum(axis))
    m = np.random.default_rng(5).integers(-3, 9, (2 * d, 5))
    for dt in (np.int32, np.float32):
        got = sf.shard(m, axis=0, mesh=mesh).sum(0, dtype=dt)
        assert got.dtype == dt
        np.testing.assert_array_equal(got.gather(), m.sum(0, dtype=dt))
    got = sf.jit(lambda a: a.sum(1, dtype=np.int32, where=a > 0), mesh=mesh)(sf.shard(m > 2, axis=0, mesh=mesh))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got.gather(), (m > 2).sum(1, dtype=np.int32, where=m > 0))


def test_integer_sums_are_exact_and_take_their_dtype():
    check_integer_sums(ew.mesh_of(4))


def test_refusals_say_what_to_write():
    mesh = ew.mesh_of(4)
    spec = sf.TensorSpec(ew.SHAPE, "float64")
    with pytest.raises(TypeError, match="out="):
        sf.jit(lambda x: np.var(x, out=x), mesh=mesh).lower(spec)
    with pytest.raises(TypeError, match="where="):
        sf.jit(lambda x: np.std(x, where=x > 0), mesh=mesh).lower(spec)
    with pytest.raises(TypeError, match="boolean"):
        sf.jit(lambda x: (x > 0) // (x > 1), mesh=mesh).lower(spec)
    with pytest.raises(ValueError, match="extent 0"):
        sf.jit(lambda x: x.argmax(0), mesh=mesh).lower(sf.TensorSpec((0, 3), "float64"))
    with pytest.raises(TypeError):  # (NumPy's argmax takes one axis, not a tuple)
        sf.jit(lambda x: x.argmax((0, 1)), mesh=mesh).lower(spec)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (NumPy warns of 0 * inf and of ddof >= n, as asked)
def test_ddof_at_least_n_gives_numpys_inf_and_nan():
    mesh = ew.mesh_of(4)
    x = np.array([[1.0, 1.0], [1.0, 3.0]])
    with np.errstate(divide="ignore", invalid="ignore"):
        want = x.var(1, ddof=2)  # [nan, inf]
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda v: v.var(1, ddof=2), mesh=mesh)(x)), want)


def test_sf_array_methods_reuse_their_plans():
    mesh = ew.mesh_of(4)
    a = sf.shard(nonzero(np.random.default_rng(10), ew.SHAPE), axis=1, mesh=mesh)
    a.var(1, ddof=1), a.argmax(0), np.clip(a, -1, 1), a // 0.5, np.std(a, axis=[0, 1])
    before = array_ops.cache_info()["compiled"]
    a.var(1, ddof=1), a.argmax(0), np.clip(a, -1, 1), a // 0.5, np.std(a, axis=[0, 1])
    assert array_ops.cache_info()["compiled"] == before


def test_numpys_dtype_aliases_are_taken():
    """A review: sum(dtype="f4") / "float" / "int" / "i8" and astype("f4") raised "unsupported dtype"; NumPy's
    aliases of the dtypes shardfuse has are taken (one it lacks is still named)."""
    mesh = ew.mesh_of(2)
    m = np.arange(8).reshape(4, 2)
    for alias in ("f4", "float", "int", "i8", "int32"):
        got = sf.jit(lambda x, a=alias: x.sum(0, dtype=a), mesh=mesh)(m)
        assert got.dtype == m.sum(0, dtype=alias).dtype
        np.testing.assert_array_equal(np.asarray(got), m.sum(0, dtype=alias))
    assert sf.jit(lambda x: x.astype("f4"), mesh=mesh)(m).dtype == np.float32
    with pytest.raises(TypeError, match="unsupported dtype 'int16'"):
        sf.jit(lambda x: x.astype("i2"), mesh=mesh)(m)
