"""NumPy 2's result dtypes and values of every binary operator with a scalar or a 0-d array on either
side (probe 11: `0.5 - int_array` kept int64, `1.0 - mask` stayed bool and HF's additive mask masked
everything, `3 / int_array` crashed at run time, `np.float64(0.5) - f32` stayed float32, `-mask` ran).

A table over operators (and their np.ufunc forms) x scalars (Python int / float / bool: weak, NEP 50;
np.float64 / np.float32 / np.int64 and 0-d arrays: strong) x array dtypes x the scalar's side, inside
sf.jit and on sf.Arrays outside it, the array sharded over a 2-device NumPy mesh, against NumPy on the
same fresh random inputs: the same dtype and the same values.  Where NumPy raises, shardfuse raises a
TypeError / ValueError while tracing (sf.jit(...).lower, nothing compiled or run).  Two refusals of
shardfuse's own where NumPy may answer: an integer power with an array exponent (NumPy raises for a
negative one at run time, which a compiled plan cannot: test_broadcast_ops pins the two-array form),
and NumPy's int8 results (`mask // mask`), a dtype shardfuse lacks.  Python floats here are exact in
every dtype, so 16-bit results are bit for bit too (shardfuse computes 16-bit ops with a Python scalar
in float32 with the scalar as given: test_regressions.test_dividing_by_a_small_scalar_divides).

tests/mpi/test_scalar_promotion_mpi.py runs a slice of the same table under mpiexec."""
from __future__ import annotations

import operator
import traceback

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
from shardfuse import array_ops

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
       "%": operator.mod, "**": operator.pow, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "&": operator.and_, "|": operator.or_,
       "^": operator.xor}
UFUNCS = {u.__name__: u for u in (np.add, np.subtract, np.multiply, np.true_divide, np.floor_divide, np.remainder,
                                   np.power, np.less, np.greater_equal, np.equal, np.not_equal, np.bitwise_and,
                                   np.bitwise_or, np.bitwise_xor, np.maximum, np.minimum)}
SCALARS = {"int": 3, "float": 2.5, "float 0.1": 0.1, "bool": True, "np.float64": np.float64(0.5), "np.float32": np.float32(1.5),
           "np.int64": np.int64(3), "0-d float64": np.array(2.5), "0-d int32": np.array(3, np.int32),
           "bfloat16": ml_dtypes.bfloat16(1.5)}
DTYPES = ["int32", "int64", "bool", "float16", "float32", "bfloat16", "float64"]
SHARDFUSE_DTYPES = {"float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"}


def mesh2():
    return sf.DeviceMesh(2, backend="numpy")


def values(rng, dtype, divisor=False):
    """Fresh random nonzero values of `dtype`, shape (4, 3), either sign; booleans all True as a divisor."""
    if dtype == "bool":
        return np.ones((4, 3), bool) if divisor else rng.random((4, 3)) < 0.5
    sign = rng.choice([-1, 1], (4, 3))
    if dtype in ("int32", "int64"):
        return (rng.integers(1, 6, (4, 3)) * sign).astype(dtype)
    return (rng.uniform(0.5, 4.0, (4, 3)) * sign).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def numpy_result(fn, s, a, left):
    """NumPy's fn(s, a) (left) or fn(a, s): (the result, None) or (None, NumPy's exception)."""
    try:
        with np.errstate(all="ignore"):
            return np.asarray(fn(s, a) if left else fn(a, s)), None
    except (TypeError, ValueError, ArithmeticError) as e:
        return None, e


def refused_by_shardfuse(name, s, dtype, left, want) -> bool:
    """shardfuse's own refusals (the module docstring): int8 results, integer powers of array exponents."""
    if want is not None and want.dtype.name not in SHARDFUSE_DTYPES:
        return True
    if name not in ("**", "power"):
        return False
    integral = (want is None or want.dtype.kind in "biu") and dtype not in ("float16", "float32", "bfloat16", "float64")
    return integral and (isinstance(s, np.ndarray) or (left and dtype != "bool"))


def check(name, fn, s, dtype, left, rng, mesh=None):
    """fn with the scalar s on the left or the right of an array of `dtype`, inside sf.jit and on an
    sf.Array, the array sharded on axis 0 of a 2-device mesh (or `mesh`): NumPy's dtype and values, or
    its refusal."""
    a = values(rng, dtype, divisor=left and name in ("/", "//", "%", "divide", "floor_divide", "remainder"))
    mesh = mesh or mesh2()
    want, error = numpy_result(fn, s, a, left)
    traced = sf.jit((lambda x: fn(s, x)) if left else (lambda x: fn(x, s)), mesh=mesh)
    placed = sf.shard(a, axis=0, mesh=mesh)
    if error is not None or refused_by_shardfuse(name, s, dtype, left, want):
        compiled = array_ops.cache_info()["compiled"]
        with pytest.raises((TypeError, ValueError)) as got:
            traced.lower(placed)  # (traced, never run)
        assert not any("executor" in f.filename for f in traceback.extract_tb(got.tb)), got.value
        with pytest.raises(type(got.value)):
            fn(s, placed) if left else fn(placed, s)
        assert array_ops.cache_info()["compiled"] == compiled  # (refused before a plan was made)
        return
    for where, got in (("jit", traced(placed)), ("sf.Array", fn(s, placed) if left else fn(placed, s))):
        assert isinstance(got, sf.Array) and got.dtype == want.dtype, (where, got.dtype, want.dtype)
        out = got.gather()
        assert out.dtype == want.dtype and out.shape == want.shape, (where, out.dtype, out.shape)
        np.testing.assert_array_equal(out.astype(np.float64), want.astype(np.float64), err_msg=where)


CASES = [(op, s, dt, left) for op in OPS for s in SCALARS for dt in DTYPES for left in (True, False)]


@pytest.mark.parametrize("op, scalar, dtype, left", CASES,
                         ids=[f"{'s' if left else 'x'}{op}{'x' if left else 's'}-{s}-{dt}" for op, s, dt, left in CASES])
def test_operator_with_a_scalar_on_either_side(op, scalar, dtype, left):
    check(op, OPS[op], SCALARS[scalar], dtype, left, np.random.default_rng())


UFUNC_CASES = [(u, s, dt, left) for u in UFUNCS for s in SCALARS for dt in DTYPES for left in (True, False)]


@pytest.mark.parametrize("ufunc, scalar, dtype, left", UFUNC_CASES,
                         ids=[f"np.{u}({'s, x' if left else 'x, s'})-{s}-{dt}" for u, s, dt, left in UFUNC_CASES])
def test_ufunc_with_a_scalar_on_either_side(ufunc, scalar, dtype, left):
    check(ufunc, UFUNCS[ufunc], SCALARS[scalar], dtype, left, np.random.default_rng())


WEAK_CASES = [(op, s, dt, left) for op in OPS for s in ("int", "float", "bool") for dt in DTYPES for left in (True, False)]


@pytest.mark.parametrize("op, scalar, dtype, left", WEAK_CASES,
                         ids=[f"{'s' if left else 'x'}{op}{'x' if left else 's'}-{s}-{dt}" for op, s, dt, left in WEAK_CASES])
def test_a_python_scalar_argument_of_jit_is_weak_on_either_side(op, scalar, dtype, left):
    """A Python scalar passed to sf.jit (a weak traced value, as JAX's) gives what the constant gives."""
    fn, s, rng = OPS[op], SCALARS[scalar], np.random.default_rng()
    a = values(rng, dtype, divisor=left and op in ("/", "//", "%"))
    want, error = numpy_result(fn, s, a, left)
    mesh = mesh2()
    f = sf.jit((lambda x, c: fn(c, x)) if left else (lambda x, c: fn(x, c)), mesh=mesh)
    if error is not None or refused_by_shardfuse(op, np.asarray(s), dtype, left, want):  # (s traced: an array)
        with pytest.raises((TypeError, ValueError)):
            f.lower(sf.shard(a, axis=0, mesh=mesh), s)
        return
    got = f(sf.shard(a, axis=0, mesh=mesh), s)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.gather().astype(np.float64), want.astype(np.float64))


# ---- the probe's reproducers (probe11/mine: rsub_int.py, reflected_ops.py, hf_mask_idiom.py) ----------

def test_a_float_minus_an_integer_array_is_float64():
    mesh, a = mesh2(), np.array([0, 1, 2, 3], np.int64)
    for got in (sf.jit(lambda a: 0.5 - a, mesh=mesh)(a), 0.5 - sf.shard(a, axis=0, mesh=mesh)):
        assert got.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(got), [0.5, -0.5, -1.5, -2.5])
    m = np.array([True, False])
    got = sf.jit(lambda m: 1.0 - m, mesh=mesh)(m)
    assert got.dtype == np.float64 and np.asarray(got).tolist() == [0.0, 1.0]


def test_reflected_operators_of_int_bool_and_float32_arrays():
    mesh = mesh2()
    arrays = [np.array([1, 2, 3, 4], np.int64), np.array([1, 2, 3, 4], np.int32),
              np.array([True, False, True, True]), np.array([1, 2, 3, 4], np.float32)]
    ops = [lambda s, a: s - a, lambda s, a: s / a, lambda s, a: s + a, lambda s, a: s * a, lambda s, a: a - s,
           lambda s, a: a / s]
    for a in arrays:
        for s in (0.5, 3, np.float64(0.5), np.float32(0.5)):
            for fn in ops:
                with np.errstate(divide="ignore"):
                    want = fn(s, a)
                    got = np.asarray(sf.jit(lambda a, fn=fn, s=s: fn(s, a), mesh=mesh)(a))
                assert got.dtype == want.dtype, (a.dtype, s, got.dtype, want.dtype)
                np.testing.assert_array_equal(got, want)


def test_the_hugging_face_additive_mask():
    mesh = mesh2()
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], bool)  # row 0 left-padded
    got = sf.jit(lambda m: (1.0 - m) * -1e9, mesh=mesh)(mask)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(np.asarray(got), (1.0 - mask) * -1e9)  # only the padded position masked
    with pytest.raises(TypeError, match="boolean"):
        sf.jit(lambda m: -m, mesh=mesh).lower(mask)
    with pytest.raises(TypeError, match="boolean"):
        -sf.shard(mask, axis=0, mesh=mesh)
    with pytest.raises(TypeError, match="boolean"):
        np.negative(sf.shard(mask, axis=0, mesh=mesh))


def test_the_refusals_say_what_numpy_says_and_what_to_write():
    mesh = mesh2()
    a = sf.shard(np.array([1, 2, 3, 4], np.int32), axis=0, mesh=mesh)
    m = sf.shard(np.array([True, False, True, True]), axis=0, mesh=mesh)
    with pytest.raises(TypeError, match=r"np.subtract\(the Python scalar True, .*bool.*NumPy 2 refuses it"):
        True - m
    with pytest.raises(TypeError, match=r"giving int8 .*boolean operands.*a dtype shardfuse lacks"):
        m // m
    with pytest.raises(TypeError, match=r"np.bitwise_and.*bitwise ops, of booleans .logical. and integers only"):
        a & 1.5
    with pytest.raises(ValueError, match="negative integer powers"):
        a ** -1
    with pytest.raises(OverflowError, match="out of bounds for int32"):  # (NumPy 2's error: NEP 50)
        a + 2 ** 40
    assert np.asarray(a < 2 ** 40).all() and not np.asarray(a == 2 ** 40).any()  # (NumPy 2 compares these)
    x = np.array([0.5, 1.0], np.float32)
    got = sf.jit(lambda x: np.float64(0.5) - x, mesh=mesh)(x)
    assert got.dtype == np.float64  # (a NumPy scalar is strong, as NumPy 2's)
    got = sf.jit(lambda x: 3 / x, mesh=mesh)(np.array([1, 2], np.int32))
    assert got.dtype == np.float64 and np.asarray(got).tolist() == [3.0, 1.5]
    assert abs(m).dtype == bool and np.asarray(abs(m)).tolist() == [True, False, True, True]


# ---- plans stay as cheap; gradients stay right ---------------------------------------------------------

def _steps(plan) -> list:
    """The steps of a printed plan (its lines `name <- operands`), by kind."""
    return [line.split()[0] for line in str(plan).splitlines() if " <- " in line]


def test_a_reflected_scalar_op_is_still_one_step():
    mesh = mesh2()
    x = sf.shard(np.ones((4, 2), np.float32), axis=0, mesh=mesh)
    for fn in (lambda x: 1.0 - x, lambda x: 2.0 / x, lambda x: 1.5 + x, lambda x: np.subtract(0.5, x)):
        plan = sf.jit(fn, mesh=mesh).lower(x)
        assert len(_steps(plan)) == 1 and "Astype" not in _steps(plan), plan  # (neg and add_scalar fused)
        assert "f32" in str(plan) and "f64" not in str(plan), plan
    i = sf.shard(np.ones((4, 2), np.int64), axis=0, mesh=mesh)
    plan = sf.jit(lambda i: 0.5 - i, mesh=mesh).lower(i)
    assert _steps(plan) == ["Astype", "Fused"], plan


def test_gradients_of_reflected_scalar_ops():
    mesh, rng = mesh2(), np.random.default_rng(7)
    x, r = rng.uniform(0.5, 2.0, (8, 6)), rng.standard_normal((8, 6))
    mask = rng.random((8, 6)) < 0.5

    def loss(x, r):  # d/dx = r (-1 - 2.5 / x**2 - 3 - 1 + (1 - mask))
        y = (1.0 - x) + 2.5 / x + np.subtract(0.5, x) * 3.0 + (np.float64(2.0) - x) + x * (1.0 - mask)
        return (y * r).sum()
    want = r * (-5.0 - 2.5 / x ** 2 + (1.0 - mask))
    for placed in (x, sf.shard(x, axis=0, mesh=mesh)):
        g = sf.jit(sf.grad(loss), mesh=mesh)(placed, r)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-13)
    g32 = sf.grad(lambda x: ((np.float64(1.0) - x) * r).sum())(sf.shard(x.astype(np.float32), axis=0, mesh=mesh))
    assert g32.dtype == np.float32  # (through float64, as NumPy promotes; the cotangent cast back)
    np.testing.assert_allclose(np.asarray(g32), -r.astype(np.float32), rtol=1e-6)


def test_the_gradient_of_a_scalar_base_power_follows_jax_at_zero():
    """c ** y: d/dy = log(c) c^y, 0 where c == 0 (JAX's: the log of the base taken as 1 there; a review
    found NaN, 0 * NaN, while an array base of zeros gave 0)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    y = np.array([0.5, 1.0, 2.0, 3.0])
    grad = lambda f: np.asarray(sf.jit(sf.grad(f), mesh=mesh)(y))  # noqa: E731
    np.testing.assert_array_equal(grad(lambda y: (0.0 ** y).sum()), np.zeros(4))
    np.testing.assert_array_equal(grad(lambda y: np.power(np.zeros(4), y).sum()), np.zeros(4))
    np.testing.assert_allclose(grad(lambda y: (3.0 ** y).sum()), np.log(3.0) * 3.0 ** y, rtol=1e-14)
    assert np.isnan(grad(lambda y: ((-2.0) ** y).sum())).all()  # (a negative base: NaN, as JAX's log)


def test_a_weak_scalar_takes_the_arrays_dtype_whatever_numpy_and_ml_dtypes_resolve():
    # NEP 50 applied before asking NumPy: ml_dtypes 0.6 with NumPy 2.5 resolves bfloat16 * 0.5 in
    # float32 (a GPU machine's versions, 2026-12-06: the transformer layer's GEMMs went float32)
    import ml_dtypes

    from shardfuse import promotion

    bf16, f16, i32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.int32)
    assert promotion.strong_operands(bf16, float) == (bf16, bf16)
    assert promotion.strong_operands(float, bf16) == (bf16, bf16)
    assert promotion.strong_operands(f16, int) == (f16, f16)
    assert promotion.strong_operands(i32, int) == (i32, i32)
    assert promotion.strong_operands(i32, float) == (i32, np.dtype(np.float64))
    assert promotion.strong_operands(np.dtype(bool), int) == (np.dtype(bool), np.dtype(np.int64))
    assert promotion.strong_operands(int, float) == (np.dtype(np.int64), np.dtype(np.float64))
    assert promotion.strong_operands(bf16, np.dtype(np.float32)) == (bf16, np.dtype(np.float32))


def test_a_narrow_float_widened_by_a_float64_constant_warns_once_at_the_users_line():
    """NumPy 2's rule stands (float64), but a bfloat16 model whose RoPE tables came from np.cos ran
    its GEMMs in float64 silently (a probe): one warning per trace, at the user's line, naming the
    value; a constant cast to the value's dtype, a Python float or a float64 value warn nothing."""
    import warnings
    import ml_dtypes
    mesh = sf.DeviceMesh(1, backend="numpy")
    table = np.cos(np.arange(8.0))
    x = np.ones((4, 8), ml_dtypes.bfloat16)
    with pytest.warns(UserWarning, match=r"bfloat16 value x \(4, 8\) computes in float64 with a NumPy float64 array") as rec:
        out = sf.jit(lambda x: (x * table) / np.float64(3.0) + table, mesh=mesh)(x)
    assert out.dtype == np.float64 and len(rec) == 1 and rec[0].filename == __file__
    with pytest.warns(UserWarning, match=r"float32 value x .* with the NumPy scalar np.float64\(3.0\)"):
        sf.jit(lambda x: x / np.float64(3.0), mesh=mesh)(x.astype(np.float32))
    with pytest.warns(UserWarning, match=r"float32 value x .* with a NumPy int64 array \(8,\)"):  # (RoPE's positions)
        assert sf.jit(lambda x: x * np.arange(8), mesh=mesh)(x.astype(np.float32)).dtype == np.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sf.jit(lambda x: x * table.astype(x.dtype) * 0.5, mesh=mesh)(x).dtype == ml_dtypes.bfloat16
        sf.jit(lambda x: x * table, mesh=mesh)(x.astype(np.float64))
        assert sf.jit(lambda x: x < table, mesh=mesh)(x).dtype == np.bool_  # (a comparison: nothing in float64 follows)


def test_a_float64_table_read_at_traced_positions_warns_too():
    """A decoder's RoPE rows at each sequence's position, sf.take(COS, pos): the table's rows are as
    much the closed-over float64 constant as the table (a serving probe: no warning, float64 out);
    a float64 program input read the same way warns nothing."""
    import warnings
    import ml_dtypes
    mesh = sf.DeviceMesh(2, backend="numpy")
    cos = np.cos(np.arange(16)[:, None] * np.ones(4))
    q, pos = np.ones((4, 2, 4), ml_dtypes.bfloat16), np.arange(4)
    with pytest.warns(UserWarning, match=r"bfloat16 value q \(4, 2, 4\) computes in float64"):
        assert sf.jit(lambda q, pos: q * sf.take(cos, pos, axis=0)[:, None] * 2.0, mesh=mesh)(q, pos).dtype == np.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf.jit(lambda q, table, pos: q * sf.take(table, pos, axis=0)[:, None], mesh=mesh)(q, cos, pos)


def test_a_weak_result_stays_weak_in_ops_outside_jit():
    """A returned step count is weak (JAX's weak type), and so is its op with a Python scalar outside
    sf.jit, as inside: 0.1 / (step + 1) * w stays float32 (a README probe: it was float64 outside)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    step = sf.jit(lambda s: s + 1, mesh=mesh)(0)
    w = sf.shard(np.ones((4, 2), np.float32), axis=0, mesh=mesh)
    assert step.weak and (step + 1).weak and (step * 2.5).weak
    assert (0.1 / (step + 1) * w).dtype == np.float32
    assert sf.jit(lambda s, w: 0.1 / (s + 1) * w, mesh=mesh)(step, w).dtype == np.float32
    assert not (w * 2.0).weak


def test_a_weak_value_with_a_numpy_scalar_of_a_lower_kind_stays_weak():
    """JAX's rule (a review): weak float * np.int32 stays a weak float (float32 beside a float32 array),
    weak int + np.bool_ stays weak; weak int + np.int64 is strong."""
    m = sf.DeviceMesh(2, backend="numpy")
    assert sf.jit(lambda lr, w: (lr * np.int32(2)) * w, mesh=m)(0.1, np.ones(4, np.float32)).dtype == np.float32
    assert sf.jit(lambda s: s + np.bool_(True), mesh=m)(0).weak
    assert not sf.jit(lambda s: s + np.int64(1), mesh=m)(0).weak
