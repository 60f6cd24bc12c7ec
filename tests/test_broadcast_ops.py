"""np.broadcast_to, np.repeat / x.repeat, np.tile, np.outer, np.logaddexp, x ** y of two arrays (np.power;
a traced 0-d exponent), x.mT / np.matrix_transpose and np.take_along_axis (shardfuse/numpy_broadcast.py,
shardfuse/numpy_shapes.py), inside sf.jit and on sf.Arrays outside it, against NumPy in float64 on
fresh random inputs (never zero), on a 1-D mesh of 4 and a 2x2 mesh with the operands sharded on their
first, last or both axes; NumPy's result dtypes; GQA's repeat_kv and the cross-entropy's target gather
moving nothing but what they must (no collective; one Allreduce of the vocab-sharded gather); fused
chains with the power of two arrays bit for bit the unfused steps; NumPy's special values; the
refusals.  Gradients: tests/test_grad.py; under mpiexec: tests/mpi/test_user_port_mpi.py (the cases of
tests/test_user_port.py) and tests/mpi/test_math_mpi.py (gradients)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op
from test_einsum import LAYOUTS, placed
from test_fused_sum import fused_and_unfused
from test_math_ops import TOL, compare, mesh_of


def _real(rng, shape, dtype="float64", positive=False):
    """Never zero: |x| in [0.25, 2], either sign unless positive."""
    v = rng.uniform(0.25, 2.0, shape) * (1.0 if positive else rng.choice([-1.0, 1.0], shape))
    return v.astype(np_dtype(dtype))


def _ints(lo, hi):
    return lambda rng, shape, dtype="float64": rng.integers(lo, hi, shape).astype(np.int64)


def _pos(rng, shape, dtype="float64"):
    return _real(rng, shape, dtype, positive=True)


def _whole(rng, shape, dtype="float64"):  # integral exponents as floats (a negative base is then NumPy's)
    return rng.integers(-3, 4, shape).astype(np_dtype(dtype))


# name -> (fn on traced values / sf.Arrays, NumPy reference, [(shape, maker)]); extents divide by 4 where sharded
CASES = {
    "broadcast_to leading axes": (lambda x: np.broadcast_to(x, (4, 8, 6, 12)), None, [((8, 1, 12), _real)]),
    "broadcast_to its own shape": (lambda x: np.broadcast_to(x, x.shape) * 2.0, None, [((8, 12), _real)]),
    "broadcast_to an int shape": (lambda x: np.broadcast_to(x, 12), None, [((1,), _real)]),
    "repeat_kv axis=1": (lambda k: np.repeat(k, 3, axis=1), None, [((2, 4, 8, 4), _real)]),
    "repeat last axis": (lambda x: np.repeat(x, 2, axis=-1), None, [((8, 12), _real)]),
    "repeat flattened": (lambda x: np.repeat(x, 2), None, [((8, 12), _real)]),
    "x.repeat axis=0": (lambda x: x.repeat(3, axis=0), lambda x: x.repeat(3, axis=0), [((8, 12), _real)]),
    "repeat [2]": (lambda x: np.repeat(x, [2], axis=0), None, [((8, 12), _real)]),
    "repeat a count each": (lambda x: np.repeat(x, [1, 0, 2, 3, 1, 1, 4, 0], axis=0) + 1.0, None, [((8, 12), _real)]),
    "repeat counts flattened": (lambda x: np.repeat(x, np.arange(96) % 3), None, [((8, 12), _real)]),
    "tile (2, 3)": (lambda x: np.tile(x, (2, 3)), None, [((8, 12), _real)]),
    "tile int": (lambda x: np.tile(x, 2), None, [((8, 12), _real)]),
    "tile more reps than axes": (lambda x: np.tile(x, (2, 1, 1)), None, [((8, 12), _real)]),
    "tile fewer reps than axes": (lambda x: np.tile(x, [3]), None, [((2, 8, 4), _real)]),
    "outer": (np.outer, None, [((8,), _real), ((12,), _real)]),
    "outer of matrices": (np.outer, None, [((4, 2), _real), ((3, 4), _real)]),
    "logaddexp": (np.logaddexp, None, [((8, 12), _real), ((8, 12), _real)]),
    "logaddexp of a row": (np.logaddexp, None, [((8, 12), _real), ((12,), _real)]),
    "logaddexp with scalars": (lambda x: np.logaddexp(x, -0.5) + np.logaddexp(1.5, x), None, [((8, 12), _real)]),
    "power of arrays": (lambda x, y: x ** y, None, [((8, 12), _pos), ((8, 12), _real)]),
    "np.power of a row": (np.power, None, [((8, 12), _pos), ((12,), _real)]),
    "power by a 0-d array": (lambda x, t: x ** t, None, [((8, 12), _pos), ((), _real)]),
    "power of a negative base": (lambda x, y: x ** y, None, [((8, 12), _real), ((8, 12), _whole)]),
    "power of a 0-d base": (lambda t, y: t ** y, None, [((), _pos), ((8, 12), _real)]),
    "scalar powers still": (lambda x: x ** 2 + 2.0 ** x + np.power(x, 3) + np.square(x), None, [((8, 12), _real)]),
    "arctan2": (np.arctan2, None, [((8, 12), _real), ((8, 12), _real)]),
    "atan2 of a row and scalars": (lambda y, x: np.atan2(y, x) + np.arctan2(y, -1.5) + np.arctan2(2, x), None,
                                   [((8, 12), _real), ((12,), _real)]),
    "hypot": (lambda x, y: np.hypot(x, y) + np.hypot(x, 0.5), None, [((8, 12), _real), ((12,), _real)]),
    "copysign signbit": (lambda x, y: np.copysign(x, y) + np.copysign(1.5, x) * np.signbit(y), None,
                         [((8, 12), _real), ((8, 12), _real)]),
    "x.mT": (lambda x: x.mT, lambda x: x.mT, [((2, 8, 12), _real)]),
    "matrix_transpose": (np.matrix_transpose, None, [((8, 12), _real)]),
    "take_along_axis one per row": (lambda x, i: np.take_along_axis(x, i, -1), None,
                                    [((8, 12), _real), ((8, 1), _ints(0, 12))]),
    "take_along_axis several per row": (lambda x, i: np.take_along_axis(x, i, axis=1), None,
                                        [((8, 12), _real), ((8, 4), _ints(0, 12))]),
    "take_along_axis axis 0": (lambda x, i: np.take_along_axis(x, i, 0), None,
                               [((8, 12), _real), ((3, 12), _ints(0, 8))]),
    "take_along_axis broadcast": (lambda x, i: np.take_along_axis(x, i, -1), None,
                                  [((8, 1, 12), _real), ((8, 4, 1), _ints(0, 12))]),
    "take_along_axis negative": (lambda x, i: np.take_along_axis(x, i, 1), None,
                                 [((8, 12), _real), ((8, 2), _ints(-12, 12))]),
    "take_along_axis flattened": (lambda x, i: np.take_along_axis(x, i, None), None,
                                  [((8, 12), _real), ((5,), _ints(0, 96))]),
}


def check(name, mesh, spec_of, jit, rng):
    """CASES[name] on operands placed by spec_of: NumPy's shape and dtype, its values in float64."""
    fn, ref, makers = CASES[name]
    xs = [make(rng, shape) for shape, make in makers]
    args = [placed(x, mesh, spec_of) if x.ndim else sf.replicate(x, mesh=mesh) for x in xs]
    got = (sf.jit(fn, mesh=mesh) if jit else fn)(*args)
    want = (ref or fn)(*xs)
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    np.testing.assert_allclose(np.asarray(got.gather()), want, rtol=1e-13, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_numpy_on_every_layout(name, layout, jit):
    shape, spec_of = LAYOUTS[layout]
    check(name, mesh_of(shape), spec_of, jit, np.random.default_rng())


# name -> (fn, makers) for NumPy's result dtypes: each in float16, bfloat16, float32, int32, bool where NumPy has it
DTYPE_CASES = {
    "broadcast_to": (lambda x: np.broadcast_to(x, (3, 8, 12)), [(8, 12)]),
    "repeat": (lambda x: np.repeat(x, 2, 1), [(8, 12)]),
    "tile": (lambda x: np.tile(x, (1, 2)), [(8, 12)]),
    "outer": (np.outer, [(8,), (12,)]),
    "logaddexp": (np.logaddexp, [(8, 12), (12,)]),
    "power": (np.power, [(8, 12), (12,)]),
    "take_along_axis": (lambda x: np.take_along_axis(x, (np.arange(8) % 5)[:, None], 1), [(8, 12)]),
    "mT": (lambda x: x.mT, [(8, 12)]),
    "arctan2": (np.arctan2, [(8, 12), (12,)]),
    "hypot": (np.hypot, [(8, 12), (12,)]),
    "copysign": (lambda x, y: np.copysign(x, y * -1), [(8, 12), (12,)]),
    "signbit": (lambda x: np.signbit(x * -1), [(8, 12)]),
}


def _of(rng, shape, dtype):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "int32":
        return (rng.integers(1, 6, shape) * rng.choice([-1, 1], shape)).astype(np.int32)
    return _real(rng, shape, dtype, positive=True)


def check_dtype(name, dtype, mesh):
    """DTYPE_CASES[name] in dtype, its first axis sharded: NumPy's result dtype, its values in float64."""
    fn, shapes = DTYPE_CASES[name]
    rng = np.random.default_rng()
    xs = [_of(rng, s, dtype) for s in shapes]
    got = sf.jit(fn, mesh=mesh)(*(sf.shard(x, axis=0, mesh=mesh) if x.shape[0] % 4 == 0 else x for x in xs))
    stand_in = [x.astype(np.float16) if x.dtype == ml_dtypes.bfloat16 else x for x in xs]
    want = fn(*stand_in)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" and want.dtype == np.float16 else want.dtype
    assert got.dtype == dt, (name, dtype, got.dtype, dt)
    want = fn(*(x.astype(np.float64) if x.dtype.kind == "f" or x.dtype == ml_dtypes.bfloat16 else x for x in xs))
    compare(got.gather(), np.asarray(want, np.float64) if got.dtype.kind not in "biu" else want, f"{name} {dtype}")


DTYPES = ["float16", "bfloat16", "float32", "int32", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(DTYPE_CASES))
def test_numpys_result_dtypes(name, dtype):
    check_dtype_or_refusal(name, dtype, mesh_of(4))


def check_dtype_or_refusal(name, dtype, mesh):
    """check_dtype; for the power of two integer (or boolean) arrays, which NumPy raises for at run
    time on negative exponents and a compiled plan cannot, the refusal before any work."""
    if name == "power" and dtype in ("int32", "bool"):
        with pytest.raises(TypeError, match="power of two arrays is of floats"):
            check_dtype(name, dtype, mesh)
        return
    check_dtype(name, dtype, mesh)


def test_repeat_kv_and_tile_move_nothing_where_the_axes_fit():
    """GQA's repeat_kv of heads sharded over tp (batch over dp): a view per device, heads stay S over tp."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    k = _real(np.random.default_rng(), (2, 4, 8, 4))
    ka = sf.distribute(k, mesh, ("dp", "tp", None, None))
    f = sf.jit(lambda k: np.repeat(k, 3, axis=1), mesh=mesh)
    assert f.lower(ka).collectives() == {}
    out = f(ka)
    assert out.sharding.placements(mesh) == ("S(0)", "S(1)")
    np.testing.assert_array_equal(np.asarray(out), np.repeat(k, 3, axis=1))
    g = sf.jit(lambda k: np.tile(k[:, :, :4], (1, 1, 2, 1)) + np.broadcast_to(k[:, :, :1], k.shape), mesh=mesh)
    assert g.lower(ka).collectives() == {}
    want = np.tile(k[:, :, :4], (1, 1, 2, 1)) + np.broadcast_to(k[:, :, :1], k.shape)
    np.testing.assert_array_equal(np.asarray(g(ka)), want)


def test_take_along_axis_of_vocab_sharded_logits_is_one_allreduce_and_the_cross_entropy():
    """The cross-entropy as a port writes it: np.take_along_axis(log_softmax, labels[..., None], -1) with
    the vocabulary sharded over tp is each device's part and one Allreduce, never a gather; its mean
    and gradient are sf.nn.cross_entropy's."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng()
    logits, labels = _real(rng, (4, 6, 16)), rng.integers(0, 16, (4, 6))
    x = sf.distribute(logits, mesh, ("dp", None, "tp"))
    gather = sf.jit(lambda lp, l: np.take_along_axis(lp, l[..., None], -1), mesh=mesh)
    assert gather.lower(x, labels).collectives() == {"allreduce": 1}
    np.testing.assert_array_equal(np.asarray(gather(x, labels)), np.take_along_axis(logits, labels[..., None], -1))

    def ported(lg, l):
        return -np.take_along_axis(sf.nn.log_softmax(lg), l[..., None], -1).mean()
    value, grad = sf.jit(sf.value_and_grad(ported), mesh=mesh)(x, labels)
    want, want_grad = sf.jit(sf.value_and_grad(sf.nn.cross_entropy), mesh=mesh)(x, labels)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-12, atol=1e-15)


def test_special_values_as_numpy():
    """logaddexp of equal infinities, of -inf, NaN; powers of 0, of negative bases, NaN where NumPy's is."""
    mesh = mesh_of(4)
    a = np.array([np.inf, -np.inf, -np.inf, np.nan, 1.0, 710.0, -710.0, 3.0])
    b = np.array([np.inf, -np.inf, 2.0, 1.0, np.inf, 710.0, 1.0, 3.0])
    with np.errstate(all="ignore"):
        for fn in (np.logaddexp, np.power, np.arctan2, np.hypot, np.copysign):
            got = np.asarray(fn(sf.shard(a, axis=0, mesh=mesh), sf.shard(b, axis=0, mesh=mesh)))
            np.testing.assert_array_equal(got, fn(a, b), err_msg=str(fn))
        # NumPy's quadrants of signed zeros and infinities, and sign bits of -0.0 and -NaN
        y = np.array([0.0, -0.0, 0.0, -0.0, np.inf, -np.inf, np.inf, 1.0, -np.nan, np.nan, 3.0, -2.0])
        x = np.array([0.0, 0.0, -0.0, -0.0, np.inf, np.inf, -np.inf, -np.inf, 1.0, -0.0, np.nan, -0.0])
        ya, xa = sf.shard(y, axis=0, mesh=mesh), sf.shard(x, axis=0, mesh=mesh)
        for fn in (np.arctan2, np.hypot, np.copysign):
            got = np.asarray(sf.jit(fn, mesh=mesh)(ya, xa))
            np.testing.assert_array_equal(got.view(np.uint64), fn(y, x).view(np.uint64), err_msg=str(fn))
        np.testing.assert_array_equal(np.asarray(np.signbit(ya)), np.signbit(y))
        x = np.array([-2.0, -2.0, 0.0, 0.0, -0.5, 2.0, -8.0, 1.0])
        y = np.array([3.0, 0.5, -1.0, 0.0, 2.0, -2.0, 1 / 3, np.nan])
        got = np.asarray(sf.jit(lambda x, y: x ** y, mesh=mesh)(x, sf.shard(y, axis=0, mesh=mesh)))
        np.testing.assert_array_equal(got, x ** y)


def check_fused(dtype, mesh, monkeypatch):
    """A chain with x ** y and np.logaddexp fused (one step) and unfused: the same bits, NumPy's values."""
    rng = np.random.default_rng()
    x, y = _real(rng, (8, 12), dtype, positive=True), _real(rng, (12,), dtype)

    def chain(x, y):
        return (np.logaddexp(x * 0.5, y) * (x ** y + 1.0) - x ** (y * 2.0) + np.arctan2(y, x) * np.hypot(x, y)
                - np.copysign(x, y))
    got, plan, want, plain = fused_and_unfused(chain, (sf.shard(x, axis=0, mesh=mesh), y), monkeypatch, mesh)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    assert any(i.op == Op.FUSED and "power(" in str(i.attrs["expr"]) for i in plan.program.instrs), plan
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    ref = chain(x64, y64)
    tol = {"float64": 1e-13, "float32": 1e-5, **{k: 10 * TOL[k] for k in ("float16", "bfloat16")}}[dtype]
    np.testing.assert_allclose(got[0].astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_fused_power_and_logaddexp_equal_the_unfused_steps_bit_for_bit(dtype, monkeypatch):
    check_fused(dtype, mesh_of(4), monkeypatch)


def test_a_learning_rate_schedule_with_a_traced_step():
    """lr * decay ** step inside the jitted step, step a traced 0-d argument (a Python float: weak, so a
    float32 update stays float32, as JAX's)."""
    mesh = mesh_of(4)
    w = _real(np.random.default_rng(), (8, 12), "float32")
    step = sf.jit(lambda w, t: w - 0.1 * 0.9 ** t * w, mesh=mesh)
    for t in (0.0, 3.0, 7.5):
        got = step(sf.shard(w, axis=0, mesh=mesh), t)
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), w - 0.1 * 0.9 ** t * w, rtol=1e-6)
    text = str(step.lower(w, 1.0))
    assert "rpow(" in text and "power(" not in text, text  # (a scalar base: the scalar op, fused)


@pytest.mark.parametrize("fn, error, match", [
    (lambda x: np.repeat(x, np.array([1, 2, 3]), axis=0), ValueError, r"3 counts for axis 0 of extent 8"),
    (lambda x: np.repeat(x, [1, -2] * 4, axis=0), ValueError, r"repeats must be an int or a 1-D sequence of non-neg"),
    (lambda x: np.repeat(x, 2.0), TypeError, "repeats must be an int"),
    (lambda x: np.repeat(x, -1), ValueError, "negative"),
    (lambda x: np.broadcast_to(x, (8, 6)), ValueError, "cannot be broadcast to"),
    (lambda x: np.broadcast_to(x, (12,)), ValueError, "cannot be broadcast to"),
    (lambda x: np.broadcast_to(x, (8, 0)), ValueError, "cannot be broadcast to"),
    (lambda x: np.outer(x, x, out=x), TypeError, "out="),
    (lambda x: np.outer(x, 2.0), TypeError, "both operands must be arrays"),
    (lambda x: np.take_along_axis(x, np.zeros((8, 1)), -1), TypeError, "integer array"),
    (lambda x: np.take_along_axis(x, np.zeros(8, np.int64), -1), ValueError, "same number of dimensions"),
    (lambda x: np.take_along_axis(x, np.zeros((8, 1), np.int64), None), ValueError, "must be 1-D"),
    (lambda x: np.take_along_axis(x, np.zeros((3, 1), np.int64), -1), ValueError, "do not broadcast"),
    (lambda x: x.astype("int32") ** x.astype("int32"), TypeError, "power of two arrays is of floats"),
    (lambda x: x[0].mT, ValueError, "at least 2 dimensions"),
])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_refusals(fn, error, match, jit):
    mesh = mesh_of(4)
    x = sf.shard(_real(np.random.default_rng(), (8, 12)), axis=0, mesh=mesh)
    with pytest.raises(error, match=match):
        (sf.jit(fn, mesh=mesh) if jit else fn)(x)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_boolean_powers_as_numpy_or_refused(jit):
    """NumPy 2's x ** 2 of booleans is np.square's, int8 (a dtype shardfuse lacks): refused, as x // x
    is; it was int64, silently (a probe).  Other scalar exponents are NumPy's dtypes and values."""
    mesh = sf.DeviceMesh(2)
    b = np.array([True, False, True, True])
    x = sf.distribute(b, mesh, ("DIDx",))
    run = (lambda f: sf.jit(f, mesh=mesh)(x)) if jit else (lambda f: f(x))
    for f in (lambda v: v ** 2, np.square):
        with pytest.raises(TypeError, match="int8"):
            run(f)
    assert run(lambda v: np.power(v, 2)).dtype == np.power(b, 2).dtype.name == "int64"
    for e in (3, 1, 0, 2.0, 0.5):
        got, want = run(lambda v: v ** e), b ** e
        assert got.dtype == want.dtype.name and np.array_equal(np.asarray(got.gather()), want), (e, got.dtype)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_empty_results_as_numpy(jit):
    """np.broadcast_to to a shape with 0, np.repeat by 0, np.tile by 0 (refused before) and x.at[an empty
    box].add(c), which reached broadcast_to (a probe): NumPy's empty values, gradients zero."""
    mesh = sf.DeviceMesh(2)
    x64 = np.random.default_rng(12).standard_normal((4, 6))
    x = sf.distribute(x64, mesh, (None, "DIDx"))
    cases = [(lambda v: np.broadcast_to(v[:1], (0, 6)), lambda v: np.broadcast_to(v[:1], (0, 6))),
             (lambda v: np.broadcast_to(v[4:], (3, 0, 6)), lambda v: np.broadcast_to(v[4:], (3, 0, 6))),
             (lambda v: np.repeat(v, 0, axis=1), lambda v: np.repeat(v, 0, axis=1)),
             (lambda v: np.tile(v, (0, 2)), lambda v: np.tile(v, (0, 2))),
             (lambda v: np.tile(v, (2, 1, 0)), lambda v: np.tile(v, (2, 1, 0)))]
    for f, ref in cases:
        got = (sf.jit(f, mesh=mesh) if jit else f)(x)
        assert got.shape == ref(x64).shape and got.dtype == "float64"
    for f, want in ((lambda v: v.at[4:].add(2.5) * 3.0, x64 * 3.0), (lambda v: v.at[:, 6:].add(1.0) - v, 0.0 * x64)):
        np.testing.assert_array_equal(np.asarray((sf.jit(f, mesh=mesh) if jit else f)(x).gather()), want)
    g = sf.grad(lambda v: (np.broadcast_to(v[:1], (0, 6)).sum() + (v.at[4:].add(2.5) * 2.0).sum()))
    np.testing.assert_array_equal(np.asarray((sf.jit(g, mesh=mesh) if jit else g)(x).gather()), np.full((4, 6), 2.0))
