"""NumPy's unary math (shardfuse/numpy_math.py): np.sin / cos / log1p / expm1, sf.erf, np.sign /
floor / ceil / trunc / round / around / rint / x.round(), np.isnan / isinf / isfinite, np.reciprocal and
sf.gelu(approximate=False), inside sf.jit and on sf.Arrays outside it, on a 1-D mesh of 4 and a 2x2
mesh with sharded axes, against NumPy in float64 (math.erf / math.erfc for erf and the exact GELU)
on fresh random inputs, with NumPy's result dtypes for float16, bfloat16, float32, float64, int32,
int64 and bool inputs; round half to even, sign of -0.0 and NaN, the tests of NaN and infinities;
fused chains bit for bit the unfused steps on NumPy devices; the refusals.  np.round(x, decimals)
with decimals != 0 bit for bit NumPy's in the same dtype; np.cumsum / x.cumsum along every axis (and
flattened) of every layout, NumPy's dtypes, the sharded axis gathered and nothing else moved.

The case bodies (MATH, check_math, check_dtype, CHAIN, check_round, check_cumsum) are shared:
tests/mpi/test_math_mpi.py runs them under mpiexec and tests/test_gpu_math_ops.py on the CuPy
backend.  Gradients: tests/test_grad.py.
"""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
import test_elementwise_ops as ew
from test_fused_sum import fused_and_unfused
from shardfuse.dtypes import np_dtype

_ERF, _ERFC = np.vectorize(math.erf, otypes=[np.float64]), np.vectorize(math.erfc, otypes=[np.float64])


def np_erf(x):
    """erf in float64 (NumPy has none), in the dtype NumPy's exp would give x (erf's dtype rule)."""
    return _ERF(np.asarray(x, np.float64)).astype(np.exp(np.asarray(x)[:0]).dtype)


def np_gelu_exact(x):
    """x * Phi(x) = 0.5 x erfc(-x / sqrt 2): torch.nn.GELU()'s, jax.nn.gelu(approximate=False)'s."""
    x64 = np.asarray(x, np.float64)
    return (0.5 * x64 * _ERFC(-x64 / np.sqrt(2.0))).astype(np.exp(np.asarray(x)[:0]).dtype)


# name -> (the op on traced values or sf.Arrays, its NumPy reference, inputs positive?, int inputs accepted?)
MATH = {
    "np.sin": (np.sin, np.sin, False, True),
    "sf.sin": (sf.sin, np.sin, False, True),
    "np.cos": (np.cos, np.cos, False, True),
    "sf.cos": (sf.cos, np.cos, False, True),
    "np.log1p": (np.log1p, np.log1p, True, True),
    "np.expm1": (np.expm1, np.expm1, False, True),
    "sf.erf": (sf.erf, np_erf, False, True),
    "gelu exact": (lambda x: sf.gelu(x, approximate=False), np_gelu_exact, False, True),
    "sf.nn.gelu 'none'": (lambda x: sf.nn.gelu(x, approximate="none"), np_gelu_exact, False, True),
    "np.sign": (np.sign, np.sign, False, True),
    "np.floor": (np.floor, np.floor, False, True),
    "np.ceil": (np.ceil, np.ceil, False, True),
    "np.trunc": (np.trunc, np.trunc, False, True),
    "np.round": (np.round, np.round, False, True),
    "np.around": (np.around, np.around, False, True),
    "x.round()": (lambda x: x.round(), lambda x: x.round(), False, True),
    "np.rint": (np.rint, np.rint, False, True),
    "np.isnan": (np.isnan, np.isnan, False, True),
    "np.isinf": (np.isinf, np.isinf, False, True),
    "np.isfinite": (np.isfinite, np.isfinite, False, True),
    "np.reciprocal": (np.reciprocal, np.reciprocal, False, False),
}
# NumPy's further float functions (ops.MORE_MATH), each on inputs inside its domain: |x| / 2.5 < 1 for
# arcsin, arccos, arctanh; x + 1 >= 1 for arccosh; x / 2 away from tan's poles (integers may leave the
# domain: NaN where NumPy's is NaN)
_DOMAIN = {"arcsin": (lambda x: x / 2.5, False), "arccos": (lambda x: x / 2.5, False),
           "arctanh": (lambda x: x / 2.5, False), "arccosh": (lambda x: x + 1.0, True), "tan": (lambda x: x / 2, False),
           "log2": (lambda x: x, True), "log10": (lambda x: x, True)}


def _in_domain(f, name):
    into, positive = _DOMAIN.get(name, (lambda x: x, False))
    return (lambda x: f(into(x))), positive


for _name in ("tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "arcsinh", "arccosh", "arctanh", "log2", "log10",
              "exp2", "cbrt", "asin", "acosh"):
    _long = {"asin": "arcsin", "acosh": "arccosh"}.get(_name, _name)
    _fn, _positive = _in_domain(getattr(np, _name), _long)
    MATH[f"np.{_name}"] = (_fn, _in_domain(getattr(np, _long), _long)[0], _positive, True)
INT_DTYPES = ("int32", "int64", "bool")
TOL = {**ew.TOL, "bool": 0, "int32": 0, "int64": 0}


def inputs(positive, dtype, rng, shape=ew.SHAPE):
    """x in dtype, never zero (positive where asked); integers in [-5, 5] ([1, 5]), booleans both ways."""
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in INT_DTYPES:
        v = rng.integers(1, 6, shape)
        return (v if positive else v * rng.choice([-1, 1], shape)).astype(dtype)
    return ew.inputs(positive, dtype, rng, shape)[0]


def numpy_dtype(ref, x):
    """NumPy's result dtype (bfloat16 as float16 stands in for it, as in test_elementwise_ops)."""
    if x.dtype == ml_dtypes.bfloat16:
        d = ref(x[:1].astype(np.float16)).dtype
        return np.dtype(ml_dtypes.bfloat16) if d == np.float16 else d
    return ref(x[:1]).dtype


def compare(got, want, what):
    """got (any dtype) against want (float64, or exact for integer and boolean results)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = TOL[got.dtype.name]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol, err_msg=what)


def check_math(name, mesh, spec, dtype, jit, rng, graph=False):
    """MATH[name] on x placed with spec, in sf.jit (as a CUDA graph) or outside: NumPy's dtype, its
    values in float64."""
    fn, ref, positive, _ = MATH[name]
    x = inputs(positive, dtype, rng)
    xa = sf.distribute(x, mesh, spec)
    got = (sf.jit(fn, mesh=mesh, graph=True) if graph else sf.jit(fn, mesh=mesh))(xa) if jit else fn(xa)
    assert got.dtype == numpy_dtype(ref, x), (name, dtype, got.dtype, numpy_dtype(ref, x))
    assert got.sharding == xa.sharding, (name, got.sharding, xa.sharding)  # every layout passes through
    compare(got.gather(), ref(x.astype(np.float64)), f"{name} {dtype}")


_MESHES: dict = {}


def mesh_of(shape):
    if shape not in _MESHES:
        _MESHES[shape] = sf.DeviceMesh(shape, backend="numpy")
    return _MESHES[shape]


LAYOUTS = ["1d R", "1d S0", "1d S1", "2d S0 S1", "2d S1 S0 x R", "2d S(0,1)"]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(MATH))
def test_op_on_every_layout(name, layout, jit):
    shape, spec, _ = ew.LAYOUTS[layout]
    check_math(name, mesh_of(shape), spec, "float64", jit, np.random.default_rng(11))


@pytest.mark.parametrize("dtype", ew.DTYPES + INT_DTYPES)
@pytest.mark.parametrize("name", sorted(MATH))
def test_op_in_every_dtype(name, dtype):
    if dtype in INT_DTYPES and not MATH[name][3] or (dtype == "bool" and name == "np.sign"):
        with pytest.raises(TypeError, match="reciprocal of|sign of the boolean"):
            check_math(name, mesh_of(4), ("DIDx", None), dtype, True, np.random.default_rng(12))
        return
    check_math(name, mesh_of(4), ("DIDx", None), dtype, True, np.random.default_rng(12))
    check_math(name, mesh_of((2, 2)), ("DIDy", "DIDx"), dtype, False, np.random.default_rng(13))


SPECIAL = np.array([-3.5, -2.5, -1.5, -0.5, -0.0, 0.0, 0.5, 1.5, 2.5, 3.5, 0.25, -0.75, np.nan, np.inf, -np.inf,
                    1e4, -6e4, 0.4999, 2.5001, -1.0])  # (each exact in every float dtype but 0.4999 and 2.5001)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ew.DTYPES)
def test_halves_to_even_signed_zeros_nans_and_infinities_as_numpy(dtype, jit):
    """Round half to even (np.round's decimals=0), floor / ceil / sign of -0.0, NaN and infinities, and
    the tests of NaN and infinities: exactly NumPy's, bit for bit, sharded over 4 devices."""
    mesh = mesh_of(4)
    x = SPECIAL.astype(np_dtype(dtype))
    xa = sf.shard(x, axis=0, mesh=mesh)
    for fn in (np.round, np.rint, np.floor, np.ceil, np.trunc, np.sign, np.isnan, np.isinf, np.isfinite,
               lambda v: v.round()):
        # (replicated, then read; gather() of the sharded value keeps -0.0 too, tests/test_numpy.py)
        got = np.asarray(sf.replicate((sf.jit(fn, mesh=mesh) if jit else fn)(xa)).gather())
        want = fn(x.astype(np.float32)).astype(got.dtype) if dtype == "bfloat16" else fn(x)  # (ml_dtypes' sign: -0)
        assert got.dtype == want.dtype, (fn, got.dtype, want.dtype)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"{fn} {dtype}")


def test_erf_and_the_exact_gelu_against_math_in_float64_far_out():
    """erf and the exact GELU over [-12, 12] (tails included: 0.5 x erfc(-x / sqrt 2) loses nothing
    where 1 + erf(x / sqrt 2) cancels) and at +-inf, NaN; the tanh form stays the default."""
    mesh = mesh_of(4)
    x = np.concatenate([np.random.default_rng(14).uniform(-12, 12, 36), [np.inf, -np.inf, np.nan, 0.0]])
    xa = sf.shard(x, axis=0, mesh=mesh)
    np.testing.assert_allclose(sf.erf(xa).gather(), _ERF(x), rtol=1e-15, atol=0)
    gelu = sf.jit(lambda v: sf.nn.gelu(v, approximate=False), mesh=mesh)(xa).gather()
    with np.errstate(invalid="ignore"):
        want = 0.5 * x * _ERFC(-x / np.sqrt(2.0))  # (NaN at -inf: -inf * 0, as torch's and JAX's)
    # (rtol: erfc's condition number out at -12 is x**2 = 144; 1 / sqrt 2 rounded twice ways)
    np.testing.assert_allclose(gelu, want, rtol=1e-13, atol=0)
    tail = gelu[:36][x[:36] < -8]
    assert tail.size and tail.max() < 0 and tail.min() > -1e-14  # the tail, not 0 from a cancelled 1 + erf
    tanh = 0.5 * x[:36] * (1 + np.tanh(np.sqrt(2 / np.pi) * (x[:36] + 0.044715 * x[:36] ** 3)))
    np.testing.assert_allclose(sf.gelu(xa).gather()[:36], tanh, rtol=1e-12, atol=1e-15)  # default: tanh (JAX's)
    np.testing.assert_array_equal(sf.gelu(xa, approximate="tanh").gather(), sf.gelu(xa, approximate=True).gather())


def test_the_exact_gelu_is_torchs_default_and_the_tanh_form_its_approximation():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(15).standard_normal((8, 12)) * 3
    xa = sf.shard(x, axis=1, mesh=mesh_of(4))
    t = torch.from_numpy(x)
    # (atol: torch's 1 + erf(x / sqrt 2) cancels to 0 in the far negative tail, where erfc does not)
    np.testing.assert_allclose(sf.nn.gelu(xa, approximate=False).gather(), torch.nn.GELU()(t).numpy(),
                               rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(sf.nn.gelu(xa).gather(), torch.nn.functional.gelu(t, approximate="tanh").numpy(),
                               rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(sf.erf(xa).gather(), torch.special.erf(t).numpy(), rtol=1e-15, atol=1e-300)


def chain(x, b):
    """Every new float op in one elementwise chain (bias, scale, sums between: nothing stops fusion)."""
    y = sf.gelu(np.sin(x) * 2.0 + b, approximate=False) - sf.erf(np.expm1(x * 0.5))
    z = np.log1p(abs(x)) * np.floor(x * 4.0) + np.cos(np.round(x * 4.0)) - np.ceil(x) * np.sign(x)
    return y * np.reciprocal(z * z + 1.0)  # (x * 4.0 is exact in every dtype: floor and round see x's own value)


def chain_ref(x, b):
    y = np_gelu_exact(np.sin(x) * 2.0 + b) - np_erf(np.expm1(x * 0.5))
    z = np.log1p(abs(x)) * np.floor(x * 4.0) + np.cos(np.round(x * 4.0)) - np.ceil(x) * np.sign(x)
    return y / (z * z + 1.0)


def fused_sum(x, b):
    """FusedSums: the sums of chains of the new ops, never written."""
    return (np.sin(x) * sf.erf(x * 0.5) * b).sum(-1), (np.expm1(x) * 0.5).sum(0)


def more_chain(x, b):
    """NumPy's further float functions in one chain (ops.MORE_MATH), each inside its domain."""
    t = np.tanh(x) * 0.5  # (in (-0.5, 0.5))
    y = np.arcsin(t) + np.arccos(t) * np.arctan(x) - np.arctanh(t) + np.tan(t) * np.sinh(t + b)
    return y + np.cosh(t) * np.arcsinh(x) + np.arccosh(abs(x) + 1.0) + np.log2(abs(x) + 1.0) - np.log10(
        np.exp2(t) + b * b) + np.cbrt(x)


def more_chain_ref(x, b):
    return more_chain(x, b)  # (NumPy's own functions on float64 arrays)


CHAIN_TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 8e-2}  # (a chain of 20 steps)
MORE_CHAIN_OPS = {"tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "arcsinh", "arccosh", "arctanh", "log2",
                  "log10", "exp2", "cbrt"}
CHAIN_OPS = {"gelu_erf", "sin", "erf", "expm1", "log1p", "floor", "cos", "round", "ceil", "sign", "rdiv"}


def chain_inputs(rng, dtype):
    return (rng.standard_normal((8, 16)).astype(np_dtype(dtype)), rng.standard_normal(16).astype(np_dtype(dtype)))


@pytest.mark.parametrize("dtype", ew.DTYPES)
@pytest.mark.parametrize("fn", [chain, fused_sum, more_chain], ids=["chain", "fused sum", "more math"])
def test_fused_chains_of_the_new_ops_equal_the_unfused_steps_bit_for_bit(fn, dtype, monkeypatch):
    mesh = mesh_of(4)
    x, b = chain_inputs(np.random.default_rng(16), dtype)
    args = (sf.shard(x, axis=0, mesh=mesh), b)
    got, plan, want, plain = fused_and_unfused(fn, args, monkeypatch, mesh)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    steps = lambda p: sum(1 for i in p.program.instrs if i.into is not None)  # noqa: E731
    assert steps(plan) < steps(plain), (steps(plan), steps(plain))
    exprs = " ".join(str(i.attrs["expr"]) for i in plan.program.instrs if "expr" in i.attrs)
    named = {chain: CHAIN_OPS, fused_sum: {"sin", "erf", "expm1"}, more_chain: MORE_CHAIN_OPS}[fn]
    missing = sorted(o for o in named if not re.search(rf"\b{o}\(", exprs))  # (whole names: tan( is in arctan()
    assert not missing, (missing, exprs)
    if fn is not fused_sum:
        g = got[0].astype(np.float64)
        want = (chain_ref if fn is chain else more_chain_ref)(x.astype(np.float64), b.astype(np.float64))
        np.testing.assert_allclose(g, want, rtol=CHAIN_TOL[dtype], atol=CHAIN_TOL[dtype])


def test_plans_print_the_new_ops(monkeypatch):
    mesh = mesh_of(4)
    f = sf.jit(lambda v: sf.gelu(np.sin(v) + 1.0, approximate=False) * 2.0, mesh=mesh)
    spec = sf.TensorSpec((8, 12), "float32")
    assert "  Fused s_1 <- v, expr=scale(gelu_erf(add_scalar(sin(#0), 1.0)), 2.0)\n" in str(f.lower(spec)), f.lower(spec)
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    text = str(sf.jit(lambda v: (sf.erf(v), np.isnan(v), np.round(v)), mesh=mesh).lower(spec))
    for line in ("  Erf e <- v\n", "  Isnan i <- v\n", "  Round r <- v\n"):
        assert line in text, text
    traced = str(sf.jit(lambda v: np.floor(v) + np.isfinite(v), mesh=mesh).trace(spec))
    assert "f: f32[8, 12] ? = floor(v)\n" in traced and "i: bool[8, 12] ? = isfinite(v)\n" in traced, traced


def test_a_pending_sum_is_made_whole_before_the_new_ops():
    mesh = mesh_of(4)
    rng = np.random.default_rng(17)
    x, w = rng.standard_normal((8, 16)), rng.standard_normal((16, 12))

    @sf.jit(mesh=mesh)
    def f(x, w):
        p = sf.shard(x, axis=1) @ sf.shard(w, axis=0)  # pending sums over DIDx
        return np.sin(p), sf.erf(p), np.floor(p), np.isfinite(p)

    plan = f.lower(x, w)
    text = str(plan)
    assert plan.collectives() == {"allreduce": 1} and text.index("Allreduce") < text.index("Sin"), text
    got = f(x, w)
    for g, ref in zip(got, (np.sin, _ERF, np.floor, np.isfinite)):
        np.testing.assert_allclose(np.asarray(g.gather(), np.float64), ref(x @ w), rtol=1e-13, atol=1e-15)


def test_refusals_say_what_to_write():
    mesh = mesh_of(4)
    xa = sf.shard(np.ones((8, 4)), axis=0, mesh=mesh)
    ia = sf.shard(np.ones((8, 4), np.int32), axis=0, mesh=mesh)
    with pytest.raises(TypeError, match=r"np.round with out= is not supported .* write y = np.round\(x, decimals\)"):
        np.round(xa, 2, out=xa)
    with pytest.raises(TypeError, match=r"np.round of the boolean array .* decimals=1: NumPy refuses it too"):
        sf.jit(lambda v: (v > 0).round(1), mesh=mesh)(xa)
    with pytest.raises(TypeError, match=r"np.round: decimals must be an integer, got float 1.5"):
        np.round(xa, 1.5)
    with pytest.raises(TypeError, match=r"np.reciprocal of .*int32.*write 1 / x"):
        np.reciprocal(ia)
    with pytest.raises(TypeError, match=r"np.sign of the boolean array"):
        sf.jit(lambda v: np.sign(v), mesh=mesh)(xa > 0)
    with pytest.raises(ValueError, match=r"approximate='exact'.*False / 'none'"):
        sf.gelu(xa, approximate="exact")
    with pytest.raises(TypeError, match=r"np.fmod on an sf.Array is not supported; shardfuse has .*np.sin"):
        np.fmod(xa, 2.0)


# ---- np.round(x, decimals) ------------------------------------------------------------------------------
def check_round(mesh, spec, dtype, decimals, jit, rng, graph=False):
    """np.round(x, decimals) (and x.round(decimals)) placed with spec, in sf.jit (as a CUDA graph) or
    outside: NumPy's dtype and NumPy's values in the same dtype, bit for bit (the same steps: x * 10**d,
    rint, / 10**d; integers through float64)."""
    x = inputs(False, dtype, rng) * (np_dtype(dtype).type(7) if dtype in INT_DTYPES else 1)
    xa = sf.distribute(x, mesh, spec)
    fns = (lambda v: np.round(v, decimals), lambda v: v.round(decimals))
    for fn in fns:
        got = sf.jit(fn, mesh=mesh, graph=graph)(xa) if jit else fn(xa)
        want = np.round(x, decimals)
        assert got.dtype == want.dtype and got.sharding == xa.sharding, (dtype, got.dtype, got.sharding)
        g = np.asarray(got.gather())
        np.testing.assert_array_equal(g.view(np.uint8), want.view(np.uint8), err_msg=f"{dtype} {decimals}")


ROUND_DTYPES = ew.DTYPES + ("int32", "int64")


@pytest.mark.parametrize("decimals", [2, 1, -1])
@pytest.mark.parametrize("dtype", ROUND_DTYPES)
def test_round_with_decimals_is_numpys_bit_for_bit(dtype, decimals):
    check_round(mesh_of(4), ("DIDx", None), dtype, decimals, True, np.random.default_rng(41))
    check_round(mesh_of((2, 2)), ("DIDy", "DIDx"), dtype, decimals, False, np.random.default_rng(42))


def test_round_with_decimals_of_halves_and_large_decimals():
    """Values whose scaled form is a half (2.675 * 100 is 267.5 in float64: NumPy's 2.68) and decimals past
    1e8, where NumPy's power of ten is multiplied up, on sharded and replicated layouts."""
    mesh = mesh_of(4)
    x = np.array([2.675, 0.125, 0.375, -0.125, -2.5, 1.005, 123.456, -0.05, 1250.0, 1350.0, 25.0, -35.0])
    for d in (2, 1, 3, 10, -1, -2, -3):
        for spec in (("DIDx",), (None,)):
            got = sf.jit(lambda v, d=d: np.round(v, d), mesh=mesh)(sf.distribute(x, mesh, spec))
            np.testing.assert_array_equal(np.asarray(got.gather()).view(np.uint8), np.round(x, d).view(np.uint8))


# ---- np.cumsum ------------------------------------------------------------------------------------------
def check_cumsum(mesh, spec, dtype, axis, jit, rng, shape=ew.SHAPE, method=False, graph=False):
    """np.cumsum(x, axis) (x.cumsum(axis)) placed with spec, in sf.jit (as a CUDA graph) or outside:
    NumPy's dtype and values (against float64; integers exactly), the summed axis whole in the result
    and every other axis sharded as it was."""
    x = inputs(False, dtype, rng, shape)
    xa = sf.distribute(x, mesh, spec)
    fn = (lambda v: v.cumsum(axis)) if method else (lambda v: np.cumsum(v, axis))
    got = sf.jit(fn, mesh=mesh, graph=graph)(xa) if jit else fn(xa)
    want_dtype = np.dtype(np.int64) if dtype in INT_DTYPES else np_dtype(dtype)
    assert got.dtype == want_dtype == np.cumsum(x[:1]).dtype, (dtype, got.dtype)
    want = np.cumsum(x.astype(np.float64), axis)
    if axis is not None:
        ax = axis % x.ndim
        assert got.sharding.axes == tuple(None if k == ax else a for k, a in enumerate(xa.sharding.axes)), got.sharding
    g = np.asarray(got.gather())
    if g.dtype.kind in "biu":
        np.testing.assert_array_equal(g, want)
    else:  # (the error of a running sum grows with its length: the tolerance times the count)
        n = x.size if axis is None else x.shape[axis]
        np.testing.assert_allclose(g.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * n)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("axis", [0, 1, -1, None])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cumsum_on_every_layout(layout, axis, jit):
    shape, spec, _ = ew.LAYOUTS[layout]
    check_cumsum(mesh_of(shape), spec, "float64", axis, jit, np.random.default_rng(43))


@pytest.mark.parametrize("dtype", ew.DTYPES + INT_DTYPES)
def test_cumsum_in_every_dtype(dtype):
    check_cumsum(mesh_of(4), ("DIDx", None), dtype, 1, True, np.random.default_rng(44))
    check_cumsum(mesh_of((2, 2)), ("DIDy", "DIDx"), dtype, 0, False, np.random.default_rng(45), method=True)


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("spec", [("DIDy", "DIDx", None), (None, "DIDy", "DIDx"), (("DIDy", "DIDx"), None, None)])
def test_cumsum_of_a_3d_value(spec, axis):
    check_cumsum(mesh_of((2, 2)), spec, "float64", axis, True, np.random.default_rng(46), shape=(4, 4, 6))


def test_cumsum_gathers_only_its_own_axis_where_sharded():
    """Along an axis no device splits: one local step, no communication; along a sharded one: one
    Allgather of it, printed, before the Cumsum step; the other axes keep their sharding."""
    mesh = mesh_of((2, 2))
    x = np.random.default_rng(47).standard_normal((8, 12))
    xa = sf.distribute(x, mesh, ("DIDy", "DIDx"))
    along_rows = sf.jit(lambda v: np.cumsum(v, 1), mesh=mesh)
    plan = along_rows.lower(sf.distribute(x, mesh, ("DIDy", None)))
    assert plan.collectives() == {} and "  Cumsum " in str(plan), plan
    plan = along_rows.lower(xa)
    text = str(plan)
    assert plan.collectives() == {"allgather": 1} and text.index("Allgather") < text.index("Cumsum"), text
    assert along_rows(xa).sharding.axes == ("DIDy", None)
    assert sf.jit(lambda v: np.cumsum(v, 0), mesh=mesh)(xa).sharding.axes == (None, "DIDx")


def test_cumsum_dtype_argument_and_a_pending_sum():
    mesh = mesh_of(4)
    rng = np.random.default_rng(48)
    x, w = rng.standard_normal((8, 16)), rng.standard_normal((16, 12))
    i = rng.integers(-9, 9, (8, 12)).astype(np.int32)
    ia = sf.shard(i, axis=0, mesh=mesh)
    for dt in (np.int32, np.int64, np.float32, "float64"):
        got = np.cumsum(ia, 1, dtype=dt)
        assert got.dtype == np.cumsum(i, 1, dtype=dt).dtype
        np.testing.assert_array_equal(np.asarray(got.gather()), np.cumsum(i, 1, dtype=dt))
    # a contraction over a sharded axis pends sums: the running sum passes them through (it is linear)
    f = sf.jit(lambda x, w: np.cumsum(sf.shard(x, axis=1) @ sf.shard(w, axis=0), 1), mesh=mesh)
    assert f.lower(x, w).collectives() == {"allreduce": 1}
    np.testing.assert_allclose(np.asarray(f(x, w)), np.cumsum(x @ w, 1), rtol=1e-12, atol=1e-12)


def test_cumsum_is_never_streamed_along_its_axis():
    """A stream schedule along the summed axis would sum each chunk alone: the compiler refuses it where
    it is stated with chunks, and makes the running sum whole before the loop where an epilogue's
    schedule would reach it; streamed along another axis it runs chunk by chunk."""
    mesh = mesh_of(4)
    x = np.random.default_rng(49).standard_normal((8, 12))
    with pytest.raises(ValueError, match=r"sf.stream\(..., chunks=\) of \w+ along the axis its cumsum sums along"):
        sf.jit(lambda v: sf.stream(np.cumsum(v * 2.0, 1), axis=1, chunks=2), mesh=mesh)(x)
    scaled, plain = np.cumsum(x * 2.0, 1) * 3.0, np.cumsum(x * 2.0, 1)
    for f, want in ((lambda v: sf.stream(np.cumsum(v * 2.0, 1) * 3.0, axis=1, chunks=2), scaled),
                    (lambda v: sf.stream(np.cumsum(v * 2.0, 1) * 3.0, axis=0, chunks=2), scaled),
                    (lambda v: sf.stream(np.cumsum(v * 2.0, 1), axis=0, chunks=4), plain),
                    (lambda v: sf.stream(np.cumsum(v * 2.0, 1), axis=1), plain)):
        np.testing.assert_allclose(np.asarray(sf.jit(f, mesh=mesh)(x)), want, rtol=1e-13, atol=1e-13)


def test_cumsum_refusals():
    mesh = mesh_of(4)
    xa = sf.shard(np.ones((8, 4)), axis=0, mesh=mesh)
    with pytest.raises(TypeError, match=r"np.cumsum with out= is not supported .* write y = np.cumsum\(x, axis\)"):
        np.cumsum(xa, 0, out=xa)
    with pytest.raises(TypeError, match=r"dtype=bool\) \(a running logical or\) is not supported"):
        sf.jit(lambda v: np.cumsum(v, 0, dtype=bool), mesh=mesh)(xa)
    with pytest.raises(ValueError, match=r"axis 2 out of range for a 2-D value"):
        xa.cumsum(2)
    with pytest.raises(TypeError, match=r"axis"):
        np.cumsum(xa, (0, 1))
