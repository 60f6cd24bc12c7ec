"""NumPy's functions built as compositions (shardfuse/numpy_compose.py, shardfuse/numpy_stats.py):
np.prod / cumprod, np.pad (every mode), np.diff, np.fmax / fmin / heaviside / fabs / positive /
degrees / radians / logaddexp2, np.count_nonzero / average / ptp / nan_to_num, the NaN reductions,
np.median / quantile / percentile and np.nanmedian / nanquantile / nanpercentile (every method),
np.diagonal / trace, the joins (hstack, vstack,
dstack, column_stack, atleast_nd, unstack, broadcast_arrays) and the searches (shardfuse/numpy_search.py:
np.searchsorted, digitize, isin, interp), inside sf.jit and on sf.Arrays outside
it, on a 1-D mesh of 4 and a 2x2 mesh with the operands sharded on their first, last or both axes,
against NumPy on fresh random inputs (NaN among them where the function ignores or propagates it);
NumPy's result dtypes in float16, bfloat16, float32, int32 and bool; gradients against central
finite differences in float64 (a product with zeros among its factors too); the refusals.

The case bodies (CASES, check, DTYPE_CASES, check_dtype, GRADIENTS, check_gradient) are shared:
tests/test_gpu_numpy_compose.py runs them on the CuPy backend, tests/mpi/test_compose_mpi.py under mpiexec.
"""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
from cases import central_differences
from test_einsum import LAYOUTS, placed
from test_math_ops import compare, mesh_of


def _real(rng, shape):
    return rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)


def _nans(rng, shape):
    """Real values with a NaN here and there, and one slice all NaN (NumPy's NaN / ignored cases)."""
    x = _real(rng, shape)
    x[rng.random(shape) < 0.15] = np.nan
    x[(0,) * (len(shape) - 1)] = np.nan
    return x


def _zeros_among(rng, shape):
    x = _real(rng, shape)
    x[rng.random(shape) < 0.2] = 0.0
    return x


def _w(x, *pairs):
    """np.pad's widths: these pairs for the first axes, none for the rest."""
    return pairs + ((0, 0),) * (x.ndim - len(pairs))


W6 = np.random.default_rng(7).uniform(0.5, 1.0, 8)
BINS = np.sort(np.random.default_rng(8).uniform(-1.5, 1.5, 8))
XP, FP = np.sort(np.random.default_rng(9).uniform(-1.2, 1.2, 6)), np.random.default_rng(10).standard_normal(6)

# name -> (fn on traced values / sf.Arrays, maker of its operand [8, 8] or [8, 8, 4]); extents divide by 4
CASES = {
    "prod": (np.prod, _real),
    "prod axis 0": (lambda x: np.prod(x, axis=0), _real),
    "prod axis -1 keepdims": (lambda x: np.prod(x, axis=-1, keepdims=True), _real),
    "prod axes (0, -1) initial": (lambda x: np.prod(x, axis=(0, -1), initial=2.0), _real),
    "x.prod() where": (lambda x: x.prod(axis=1, where=x > 0), _real),
    "prod with zeros": (lambda x: np.prod(x, axis=1), _zeros_among),
    "cumprod": (np.cumprod, _real),
    "cumprod axis 0": (lambda x: np.cumprod(x, axis=0), _real),
    "x.cumprod axis 1": (lambda x: x.cumprod(axis=1), _real),
    "diff": (np.diff, _real),
    "diff n=2 axis 0": (lambda x: np.diff(x, 2, axis=0), _real),
    "diff prepend append": (lambda x: np.diff(x, axis=1, prepend=0.5, append=x[:, :1]), _real),
    "pad constant": (lambda x: np.pad(x, _w(x, (1, 2), (0, 3)), constant_values=_w(x, (1.5, -2.0), (0.0, 3.0))),
                     _real),
    "pad int width": (lambda x: np.pad(x, 2), _real),
    "pad edge": (lambda x: np.pad(x, _w(x, (2, 1), (3, 0)), mode="edge"), _real),
    "pad wrap": (lambda x: np.pad(x, _w(x, (2, 1), (3, 5)), mode="wrap"), _real),
    "pad reflect": (lambda x: np.pad(x, _w(x, (2, 7), (7, 1)), mode="reflect"), _real),
    "pad symmetric": (lambda x: np.pad(x, _w(x, (8, 1), (3, 8)), mode="symmetric"), _real),
    "pad the sequence axis": (lambda x: np.pad(x, _w(x, (0, 0), (0, 4))), _real),
    "fmax fmin": (lambda x: np.fmax(x, x[::-1]) - np.fmin(x, 0.25) + np.fmax(x, np.nan), _nans),
    "heaviside": (lambda x: np.heaviside(x, 0.5) + np.heaviside(x * 0, x), _nans),
    "fabs positive": (lambda x: np.fabs(x) + np.positive(x), _real),
    "degrees radians": (lambda x: np.degrees(x) + np.rad2deg(x) * np.radians(x) - np.deg2rad(x), _real),
    "logaddexp2": (lambda x: np.logaddexp2(x, x[::-1] * 2.0) + np.logaddexp2(x, 1.0), _real),
    "count_nonzero": (lambda x: np.count_nonzero(x > 0, axis=0), _real),
    "count_nonzero all": (lambda x: np.count_nonzero(x > 0.5), _real),
    "average": (np.average, _real),
    "average weights": (lambda x: np.average(x, axis=1, weights=W6), _real),
    "average returned": (lambda x: np.average(x, axis=0, weights=abs(x), returned=True), _real),
    "ptp": (lambda x: np.ptp(x, axis=-1), _real),
    "nan_to_num": (lambda x: np.nan_to_num(x / (x > 0)), _nans),
    "nan_to_num given": (lambda x: np.nan_to_num(-x / (x > 0), nan=-1.0, posinf=9.0, neginf=-9.0), _nans),
    "nansum": (lambda x: np.nansum(x, axis=1), _nans),
    "nanmean": (lambda x: np.nanmean(x, axis=0, keepdims=True), _nans),
    "nanmean all": (np.nanmean, _nans),
    "nanmax": (lambda x: np.nanmax(x, axis=-1), _nans),
    "nanmin": (lambda x: np.nanmin(x, axis=0), _nans),
    "nanprod": (lambda x: np.nanprod(x, axis=1), _nans),
    "nanargmax nanargmin": (lambda x: np.nanargmax(x[1:], axis=0) * 100 + np.nanargmin(x[1:], axis=0, keepdims=True), _nans),
    "nancumsum": (lambda x: np.nancumsum(x, axis=1), _nans),
    "nancumprod": (lambda x: np.nancumprod(x, axis=0), _nans),
    "nanvar ddof": (lambda x: np.nanvar(x, axis=1, ddof=1), _nans),
    "nanstd": (lambda x: np.nanstd(x, axis=0), _nans),
    "median": (np.median, _real),
    "median axis 1": (lambda x: np.median(x, axis=1), _real),
    "median of NaN rows": (lambda x: np.median(x, axis=-1, keepdims=True), _nans),
    "quantile linear": (lambda x: np.quantile(x, [0.1, 0.5, 0.93], axis=0), _real),
    "quantile lower": (lambda x: np.quantile(x, 0.3, axis=1, method="lower"), _real),
    "quantile higher": (lambda x: np.quantile(x, 0.3, axis=(0, 1), method="higher"), _real),
    "quantile nearest": (lambda x: np.quantile(x, [0.5, 0.25], axis=1, method="nearest"), _real),
    "quantile midpoint": (lambda x: np.quantile(x, 0.3, method="midpoint", keepdims=True), _real),
    "percentile": (lambda x: np.percentile(x, [12.5, 99.0], axis=-1), _real),
    "nanmedian": (lambda x: np.nanmedian(x, axis=-1), _nans),
    "nanquantile linear": (lambda x: np.nanquantile(x, [0.1, 0.5, 0.93], axis=0), _nans),
    "nanpercentile nearest lower": (lambda x: np.nanpercentile(x, 37.5, axis=1, method="nearest")
                                    + np.nanquantile(x, 0.6, axis=1, method="lower"), _nans),
    "nanquantile higher midpoint": (lambda x: np.nanquantile(x, 0.3, method="higher", keepdims=True)
                                    + np.nanquantile(x, 0.3, axis=-1, method="midpoint", keepdims=True), _nans),
    "diagonal": (np.diagonal, _real),
    "diagonal offset axes": (lambda x: np.diagonal(x, -2, 1, 0), _real),
    "x.diagonal 3-d": (lambda x: np.diagonal(x, 1, 0, 2) if x.ndim == 3 else x.diagonal(1), _real),
    "trace": (np.trace, _real),
    "x.trace offset": (lambda x: x.trace(2), _real),
    "hstack vstack": (lambda x: np.hstack([x[:, :4], x[:, 4:] * 2]) + np.vstack([x[:4], x[4:]]), _real),
    "dstack": (lambda x: np.dstack([x, x[::-1]]), _real),
    "column_stack": (lambda x: np.column_stack([x[0], x[1] * 2.0, x.reshape(8, -1)[:, :2]]), _real),
    "atleast_nd": (lambda x: np.atleast_3d(x[0, 0]) + np.atleast_2d(x[0]).sum() + np.atleast_1d(x.sum()), _real),
    "unstack": (lambda x: np.unstack(x, axis=1), _real),
    "searchsorted of its own sorted row": (lambda x: np.searchsorted(np.sort(x.reshape(-1)[:8]), x), _real),
    "searchsorted right, NaN": (lambda x: np.searchsorted(np.append(BINS, np.nan), x, side="right"), _nans),
    "searchsorted sorter": (lambda x: np.searchsorted(BINS[::-1], x, sorter=np.arange(8)[::-1]), _real),
    "digitize both ways": (lambda x: np.digitize(x, BINS) * 10 + np.digitize(x, BINS[::-1], right=True), _real),
    "isin": (lambda x: np.isin(np.round(x * 2), [1.0, -1.0, 2.0]) ^ np.isin(x > 0, [True], invert=True), _real),
    "interp": (lambda x: np.interp(x, XP, FP) + np.interp(x, XP, FP, left=-5.0, right=5.0), _nans),
    "broadcast_arrays": (lambda x: np.broadcast_arrays(x[:, :1], x[0]), _real),
}
SHAPES = ((8, 8), (8, 8, 4))


def check(name, mesh, spec_of, jit, rng, shape=(8, 8)):
    """CASES[name] on its operand placed by spec_of: NumPy's shape and dtype, its values in float64."""
    fn, make = CASES[name]
    x = make(rng, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (NumPy's all-NaN slices and 0 / 0)
        want = fn(x)
        got = (sf.jit(fn, mesh=mesh) if jit else fn)(placed(x, mesh, spec_of))
    for g, w in zip(*((got, want) if isinstance(want, tuple) else ((got,), (want,)))):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_allclose(np.asarray(g.gather()), w, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("shape", SHAPES, ids=["2-d", "3-d"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_numpy_on_every_layout(name, layout, shape, jit):
    mesh_shape, spec_of = LAYOUTS[layout]
    check(name, mesh_of(mesh_shape), spec_of, jit, np.random.default_rng(), shape)


# name -> fn, for NumPy's result dtypes in float16, bfloat16, float32, int32 and bool where NumPy has them
DTYPE_CASES = {
    "prod": lambda x: np.prod(x, axis=1),
    "cumprod": lambda x: np.cumprod(x, axis=0),
    "diff": lambda x: np.diff(x, axis=1),
    "pad": lambda x: np.pad(x, 1, constant_values=1),
    "pad reflect": lambda x: np.pad(x, 2, mode="reflect"),
    "fmax": lambda x: np.fmax(x, x[::-1]),
    "heaviside": lambda x: np.heaviside(x, x[::-1]),
    "fabs": np.fabs,
    "degrees": np.degrees,
    "count_nonzero": lambda x: np.count_nonzero(x, axis=0),
    "average": lambda x: np.average(x, axis=0),
    "nansum": lambda x: np.nansum(x, axis=0),
    "nanmean": lambda x: np.nanmean(x, axis=1),
    "nanmax": lambda x: np.nanmax(x, axis=1),
    "nanstd": lambda x: np.nanstd(x, axis=0),
    "nan_to_num": np.nan_to_num,
    "median": lambda x: np.median(x, axis=0),
    "quantile": lambda x: np.quantile(x, [0.25, 0.75], axis=1),
    "trace": np.trace,
    "hstack": lambda x: np.hstack([x, x]),
}
DTYPES = ["float16", "bfloat16", "float32", "int32", "bool"]
REFUSED = {("quantile", "bool"): r"np.quantile\(method='linear'\) of the boolean array .* NumPy refuses it"}


def _of(rng, dtype):
    if dtype == "bool":
        return rng.random((8, 8)) < 0.5
    if dtype == "int32":
        return (rng.integers(1, 4, (8, 8)) * rng.choice([-1, 1], (8, 8))).astype(np.int32)
    return _real(rng, (8, 8)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def check_dtype(name, dtype, mesh, rng=None):
    """DTYPE_CASES[name] in dtype, its first axis sharded: NumPy's result dtype (bfloat16 where NumPy's
    float16 stand-in gives float16), NumPy's values in float64 (16-bit floats: their tolerance)."""
    fn = DTYPE_CASES[name]
    x = _of(rng or np.random.default_rng(), dtype)
    got = sf.jit(fn, mesh=mesh)(sf.shard(x, axis=0, mesh=mesh))
    stand_in = x.astype(np.float16) if dtype == "bfloat16" else x
    want = fn(stand_in)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" and want.dtype == np.float16 else want.dtype
    assert got.dtype == dt, (name, dtype, got.dtype, dt)
    exact = fn(x.astype(np.float64) if x.dtype.kind == "f" or dtype == "bfloat16" else x)
    if dtype == "float32" and got.dtype == np.float64:  # (NumPy's own steps in float32 first: its values)
        np.testing.assert_allclose(np.asarray(got.gather()), want, rtol=1e-12, atol=1e-12, err_msg=f"{name} {dtype}")
        return
    compare(got.gather(), np.asarray(exact, np.float64) if got.dtype.kind not in "biu" else exact, f"{name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(DTYPE_CASES))
def test_numpys_result_dtypes(name, dtype):
    check_dtype_or_refusal(name, dtype, mesh_of(4))


def check_dtype_or_refusal(name, dtype, mesh):
    if (name, dtype) in REFUSED:  # (NumPy raises too)
        with pytest.raises(TypeError, match=REFUSED[name, dtype]):
            check_dtype(name, dtype, mesh)
        return
    check_dtype(name, dtype, mesh)


# name -> (loss of x, maker): gradients against central finite differences
GRADIENTS = {
    "prod with zeros": (lambda x: (np.prod(x, axis=1) * np.arange(1, 9)).sum(), _zeros_among),
    "prod all": (lambda x: np.prod(x[:3]), _real),
    "cumprod": (lambda x: (np.cumprod(x, axis=1) * np.arange(8)).sum(), _zeros_among),
    "pad modes": (lambda x: sum((np.pad(x, ((2, 1), (1, 3)), mode=m) ** 2).sum() * (k + 1)
                                for k, m in enumerate(("constant", "edge", "wrap", "reflect", "symmetric"))), _real),
    "diff": (lambda x: (np.diff(x, 2, axis=0) ** 2).sum(), _real),
    "median quantile": (lambda x: np.median(x, axis=1).sum() + np.quantile(x, [0.3, 0.8], axis=0).sum(), _real),
    "nanmedian nanquantile": (lambda x: np.nanmedian(x, axis=1).sum() + np.nanquantile(x, [0.3, 0.8], axis=0).sum(),
                              _real),
    "nan reductions": (lambda x: np.nanmean(x) + np.nanstd(x, axis=0).sum() + np.nanmax(x, axis=1).sum(), _real),
    "average trace": (lambda x: np.average(x, axis=1, weights=W6).sum() + np.trace(x, 1), _real),
    "fmax logaddexp2": (lambda x: (np.fmax(x, 0.1) + np.logaddexp2(x, 0.5)).sum(), _real),
    "interp": (lambda x: (np.interp(x, XP, FP) * np.arange(8)).sum() + np.interp(0.3, XP, x[0, :6]), _real),
}


@pytest.mark.parametrize("name", sorted(GRADIENTS))
def test_gradients_against_finite_differences(name):
    check_gradient(name, mesh_of(4), np.random.default_rng())


def check_gradient(name, mesh, rng):
    loss, make = GRADIENTS[name]
    x = make(rng, (8, 8))
    g = np.asarray(sf.jit(sf.grad(loss), mesh=mesh)(sf.shard(x, axis=1, mesh=mesh)))
    np.testing.assert_allclose(g, central_differences(loss, x), rtol=1e-6, atol=1e-7)


def test_an_integer_product_wraps_as_numpys():
    mesh = mesh_of(4)
    x = np.random.default_rng().integers(50, 3000, (4, 16)).astype(np.int32)
    got = np.asarray(np.prod(sf.shard(x, axis=1, mesh=mesh), axis=1))
    np.testing.assert_array_equal(got, np.prod(x, axis=1))  # (int64, wrapped: the same modulo 2**64)
    np.testing.assert_array_equal(np.asarray(np.cumprod(sf.shard(x, axis=0, mesh=mesh), axis=1)), np.cumprod(x, axis=1))


def test_the_methods_numpy_has():
    mesh = mesh_of(4)
    x = _real(np.random.default_rng(), (8, 8))
    xa = sf.shard(x, axis=0, mesh=mesh)
    for got, want in ((xa.prod(0), x.prod(0)), (xa.cumprod(1), x.cumprod(1)), (xa.trace(), x.trace()),
                      (xa.diagonal(-1), x.diagonal(-1))):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13)


@pytest.mark.parametrize("call, error, match", [
    (lambda x: np.pad(x, 9, mode="reflect"), ValueError, r"pads \(9, 9\) on axis 0 of extent 8 are wider than the axis "
                                                         r"less one; shardfuse pads once \(NumPy repeats\)"),
    (lambda x: np.pad(x, 1, mode="mean"), ValueError, r"np.pad\(mode='mean'\) is not supported .* modes constant, edge"),
    (lambda x: np.pad(x, -1), ValueError, "negative values"),
    (lambda x: np.pad(x, ((1, 2, 3),)), ValueError, r"must broadcast to \(2, 2\)"),
    (lambda x: np.quantile(x, 1.5), ValueError, r"q must be numbers in \[0, 1\]"),
    (lambda x: np.quantile(x, x[0, 0]), TypeError, r"q must be known when the plan is built .* got a traced value"),
    (lambda x: np.percentile(x, 50, method="weibull"), ValueError, r"method='weibull'\) is not supported"),
    (lambda x: np.diff(x, -1), ValueError, "order n must be a non-negative int"),
    (lambda x: np.average(x, axis=0, weights=np.ones(3)), ValueError, r"weights of shape \(3,\) differ"),
    (lambda x: np.ptp(x > 0), TypeError, "np.ptp of the boolean array"),
    (lambda x: np.prod(x, out=x), TypeError, "np.prod with out= is not supported"),
])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_refusals_say_what_was_expected(call, error, match, jit):
    mesh = mesh_of(4)
    xa = sf.shard(_real(np.random.default_rng(), (8, 8)), axis=0, mesh=mesh)
    with pytest.raises(error, match=match):
        (sf.jit(call, mesh=mesh) if jit else call)(xa)


def test_a_fuzzers_findings():
    """A fuzzer of these functions: np.median of infinities was NaN (a lerp where NumPy takes the mean of the
    middle two); an integer prod's float initial= was not cast first; np.average summed float16 weights in
    float16 and its count of an inf average was NaN (inf * 0); midpoint quantiles overflowed; np.positive
    lost -0.0; np.nanvar's NaN for a slice with dof <= 0 reached the others' gradient; q's dtype; dtype= as
    a type, np.diff's prepend= as a NumPy scalar or a list, joins of sf.Arrays with NumPy arrays, a list of
    weights, axis=(k,) raised; a NaN or 2**40 padding of int32, a float offset, a list axis= were accepted."""
    mesh = mesh_of(4)
    S = lambda x: sf.shard(np.asarray(x), axis=0, mesh=mesh)  # noqa: E731
    f32, b = np.float32([1, 2, 3, 4]), np.array([True, False, True, True])
    a16, w16 = np.int32([1, 2, 3, 1000]), np.float16([.1, .3, .7, 1.1])
    x1 = np.array([1e308, 1.5e308, 1.6e308, 1.7e308])
    cases = [(np.median, [1., np.inf, np.inf, 2.]), (np.median, [np.inf] * 4),
             (lambda v: np.prod(v, initial=1.5), [1, 2, 3, 4]), (lambda v: np.average(v, weights=w16), a16),
             (lambda v: np.average(v, returned=True)[1], [np.inf, 1., 2., 3.]),
             (lambda v: np.quantile(v, 0.5, method="midpoint"), x1),
             (lambda v: np.signbit(np.positive(v)), [-0., 0., 1., -1.]),
             (lambda v: np.quantile(v, np.float64(.3)), f32), (lambda v: np.quantile(v, np.float32(.3)), f32),
             (lambda v: np.quantile(v, np.array([.3], np.float32)), f32.astype(np.float16)),
             (lambda v: np.average(v, weights=np.float32([1, 2, 3, 4])), b),
             (lambda v: np.prod(v, dtype=np.float32), f32), (lambda v: np.nanvar(v, dtype=np.float64), f32),
             (lambda v: np.diff(v, prepend=np.float64(.5)), f32), (lambda v: np.diff(v, prepend=[1., 2.]), f32),
             (lambda v: np.hstack([v, np.ones(3)]), f32), (lambda v: np.column_stack([v, np.ones(4)]), f32),
             (lambda v: np.broadcast_arrays(v, np.ones((2, 1)))[1], f32),
             (lambda v: np.average(v, weights=[1, 2, 3, 4]), f32),
             (lambda v: np.average(v, axis=(0,), weights=np.arange(1., 5)), np.arange(8.).reshape(4, 2))]
    for fn, x in cases:
        want, got = fn(np.asarray(x)), np.asarray(fn(S(x)))
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    x = np.array([[1., np.nan, np.nan, np.nan], [1., 2, 3, 4], [2., 5, 2, 7], [.5, 1, 1.5, 3]])
    all_nan = np.where(np.arange(4)[:, None] == 0, np.nan, x)
    np.testing.assert_array_equal(np.asarray(np.nanargmax(S(all_nan), axis=1)), [-1, 3, 3, 3])  # (-1: jnp.nanargmax's)
    g = np.asarray(sf.jit(sf.grad(lambda a: np.nanvar(a, axis=1, ddof=1)[1:].sum()), mesh=mesh)(S(x)))
    assert np.isfinite(g).all() and not g[0].any(), g
    ints = S(np.int32([1, 2, 3, 4]))
    for call, error in ((lambda: np.pad(ints, 1, constant_values=np.nan), ValueError),
                        (lambda: np.pad(ints, 1, constant_values=2 ** 40), OverflowError),
                        (lambda: np.diagonal(S(np.ones((4, 4))), 1.5), TypeError),
                        (lambda: np.prod(S(np.ones((4, 4))), axis=[0, 1]), TypeError)):
        with pytest.raises(error):
            call()


def test_a_reviews_findings():
    """A review: np.sum's initial= of an integer sum was added as a float (12.5 where NumPy's is 12); np.nan_to_num's
    NumPy-scalar replacements widened the result; np.percentile's integer q kept float32 (NumPy divides it: float64);
    np.degrees was a few ulp from NumPy's (its float constant 180f / pi_f); arctan2's gradient was inf or NaN in
    float16 (x^2 + y^2 out of range), arcsinh's 0 at 300; a linear quantile at an integral rank beside inf is
    NumPy's lerp (NaN)."""
    mesh = mesh_of(4)
    S = lambda x: sf.shard(np.asarray(x), axis=0, mesh=mesh)  # noqa: E731
    xi = np.arange(1, 17, dtype=np.int32).reshape(4, 4)
    x32 = np.random.default_rng().standard_normal((4, 4)).astype(np.float32)
    for fn, x in ((lambda v: np.sum(v, axis=1, initial=2.5), xi), (lambda v: np.sum(v, 1, np.int32, initial=2.7), xi * 10),
                  (lambda v: np.sum(v, 1, initial=np.float64(.1)), x32), (lambda v: v.sum(1, None, None, False, 2.5), xi),
                  (lambda v: np.nan_to_num(v / 0.0, posinf=np.float64(1e300)), x32),
                  (lambda v: np.percentile(v, [30, 50], axis=1), x32), (np.degrees, x32), (np.radians, x32),
                  (np.degrees, x32.astype(np.float16)),
                  (lambda v: np.quantile(v, 1 / 3, axis=1), np.array([[1, np.inf, np.inf, 3]] * 4))):
        with np.errstate(all="ignore"):
            want, got = fn(x), np.asarray(fn(S(x)))
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want)
    for grad, x, want in (
            (sf.grad(lambda y: np.arctan2(y, np.float16(1e-4)).sum()), np.full(4, 1e-4, np.float16), 5000.0),
            (sf.grad(lambda y: np.arcsinh(y).sum()), np.full(4, 300.0, np.float16), 1 / np.hypot(300.0, 1.0)),
            (sf.grad(lambda y: np.arctan2(y, y).sum()), np.full(4, 0.5, np.float16), 0.0)):
        np.testing.assert_allclose(np.asarray(sf.jit(grad, mesh=mesh)(S(x)), np.float64), want, rtol=2e-3, atol=1e-3)
