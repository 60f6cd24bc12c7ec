"""Issue 31, items 1 and 2: the elementwise ops (sqrt, rsqrt, log, powers, maximum / minimum, silu,
sigmoid, comparisons, where, astype) and the reductions (sum, mean, max, min with axis and
keepdims), inside sf.jit and on sf.Arrays outside it, on a 1-D mesh of 4 and a 2x2 mesh, inputs
sharded and replicated, against NumPy in float64 on random inputs (never zeros; positive where
the op needs it), with NumPy's result dtypes.

The case bodies (OPS, REDUCTIONS, check_op, check_reduction) are shared: tests/mpi/
runs them under mpiexec and tests/test_gpu.py on the CuPy backend.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype

BF16 = ml_dtypes.bfloat16
DTYPES = ("float16", "bfloat16", "float32", "float64")
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}


def _silu(x):
    return x / (1 + np.exp(-x))


# name -> (the op on traced values or sf.Arrays, its NumPy reference, inputs positive?)
OPS = {
    "np.sqrt": (lambda x, y: np.sqrt(x), lambda x, y: np.sqrt(x), True),
    "sf.sqrt": (lambda x, y: sf.sqrt(x), lambda x, y: np.sqrt(x), True),
    "sf.rsqrt": (lambda x, y: sf.rsqrt(x), lambda x, y: 1 / np.sqrt(x), True),
    "np.log": (lambda x, y: np.log(x), lambda x, y: np.log(x), True),
    "sf.log": (lambda x, y: sf.log(x) * y, lambda x, y: np.log(x) * y, True),
    "x ** 3": (lambda x, y: x ** 3, lambda x, y: x ** 3, False),
    "x ** 0.5": (lambda x, y: x ** 0.5, lambda x, y: x ** 0.5, True),
    "x ** -1": (lambda x, y: x ** -1, lambda x, y: x ** -1, False),
    "2.0 ** x": (lambda x, y: 2.0 ** x, lambda x, y: 2.0 ** x, False),
    "np.power": (lambda x, y: np.power(x, 2), lambda x, y: np.power(x, 2), False),
    "np.square": (lambda x, y: np.square(x), lambda x, y: np.square(x), False),
    "np.maximum": (lambda x, y: np.maximum(x, y), lambda x, y: np.maximum(x, y), False),
    "np.minimum": (lambda x, y: np.minimum(x, y), lambda x, y: np.minimum(x, y), False),
    "sf.maximum scalar": (lambda x, y: sf.maximum(x, 0.25), lambda x, y: np.maximum(x, 0.25), False),
    "np.minimum scalar left": (lambda x, y: np.minimum(-0.5, x), lambda x, y: np.minimum(-0.5, x), False),
    "sf.silu": (lambda x, y: sf.silu(x), lambda x, y: _silu(x), False),
    "sf.sigmoid": (lambda x, y: sf.sigmoid(x * 30.0), lambda x, y: 1 / (1 + np.exp(-(x * 30.0))), False),
    "x < y": (lambda x, y: x < y, lambda x, y: x < y, False),
    "x <= 0.5": (lambda x, y: x <= 0.5, lambda x, y: x <= 0.5, False),
    "0.5 > x": (lambda x, y: 0.5 > x, lambda x, y: 0.5 > x, False),
    "x >= y": (lambda x, y: x >= y, lambda x, y: x >= y, False),
    "x == y (elementwise)": (lambda x, y: (x * 0 + y) == y, lambda x, y: (x * 0 + y) == y, False),
    "x != y": (lambda x, y: x != y, lambda x, y: x != y, False),
    "~(x < y)": (lambda x, y: ~(x < y), lambda x, y: ~(x < y), False),
    "sf.where": (lambda x, y: sf.where(x > y, x, y), lambda x, y: np.where(x > y, x, y), False),
    "np.where scalar": (lambda x, y: np.where(x > 0, x, -1.0), lambda x, y: np.where(x > 0, x, -1.0), False),
    "np.where scalar left": (lambda x, y: np.where(x > 0, 2.0, y), lambda x, y: np.where(x > 0, 2.0, y), False),
    "sf.where scalars (float64)": (lambda x, y: sf.where(x > y, 1.0, -1.0), lambda x, y: np.where(x > y, 1.0, -1.0),
                                   False),
    "where -inf, then max": (lambda x, y: sf.where(x > 0, x, -np.inf).max(-1),
                             lambda x, y: np.where(x > 0, x, -np.inf).max(-1), True),
    "astype int32": (lambda x, y: (x * 8.0).astype("int32"), lambda x, y: (x * 8.0).astype(np.int32), False),
    "astype bool": (lambda x, y: (x * 2.0).astype(bool), lambda x, y: (x * 2.0).astype(bool), False),
    "astype float64 and back": (lambda x, y: x.astype(np.float64).astype(x.dtype) + y,
                                lambda x, y: x + y, False),
}

# name -> (the reduction, its NumPy reference): axis int, negative, tuple, None; keepdims
REDUCTIONS = {
    f"{what} {axis} keepdims={keep}": (
        (lambda what, axis, keep: lambda x: getattr(x, what)(axis, keepdims=keep))(what, axis, keep),
        (lambda what, axis, keep: lambda x: getattr(x, what)(axis, keepdims=keep))(what, axis, keep))
    for what in ("sum", "mean", "max", "min") for axis in (0, -1, (0, 1), None) for keep in (False, True)}
REDUCTIONS.update({
    "np.amax": (lambda x: np.amax(x, axis=1), lambda x: np.amax(x, axis=1)),
    "np.min keepdims": (lambda x: np.min(x, axis=-1, keepdims=True), lambda x: np.min(x, axis=-1, keepdims=True)),
    "np.sum keepdims": (lambda x: np.sum(x, axis=(0, 1), keepdims=True),
                        lambda x: np.sum(x, axis=(0, 1), keepdims=True)),
})

# layouts: name -> (mesh shape, spec of x per tensor axis, spec of y); y may broadcast (a row)
LAYOUTS = {
    "1d R": (4, (None, None), (None, None)),
    "1d S0": (4, ("DIDx", None), ("DIDx", None)),
    "1d S1": (4, (None, "DIDx"), (None, "DIDx")),
    "1d S0 x R": (4, ("DIDx", None), (None, None)),
    "1d S0 row": (4, ("DIDx", None), "row"),
    "2d S0 S1": ((2, 2), ("DIDy", "DIDx"), ("DIDy", "DIDx")),
    "2d S1 S0 x R": ((2, 2), ("DIDx", "DIDy"), (None, None)),
    "2d S(0,1)": ((2, 2), (("DIDy", "DIDx"), None), (None, "DIDx")),
}
SHAPE = (8, 12)


def inputs(positive, dtype, rng, shape=SHAPE, row=False):
    """x, y in dtype (never zero; positive where asked); y a row where it broadcasts."""
    def one(s):
        v = rng.uniform(0.25, 2.0, s) if positive else rng.uniform(0.25, 2.0, s) * rng.choice([-1.0, 1.0], s)
        return v.astype(np_dtype(dtype))
    return one(shape), one(shape[1:] if row else shape)


def expected_dtype(ref, x, y):
    """NumPy's result dtype (bfloat16 as float16 stands in for it: ml_dtypes promotes scalars its own way)."""
    if x.dtype == BF16:
        d = ref(x.astype(np.float16), y.astype(np.float16)).dtype
        return np.dtype(BF16) if d == np.float16 else d
    return ref(x, y).dtype


def compare(got, want, dtype, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = TOL[dtype] if np.dtype(np_dtype(dtype)) == got.dtype or got.dtype == np.float64 and dtype == "float64" \
        else max(TOL[dtype], TOL.get(got.dtype.name, 0))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol, err_msg=what)


def place(v, mesh, spec):
    if spec == "row":
        return sf.replicate(v, mesh=mesh)
    return sf.distribute(v, mesh, spec)


def check_op(name, mesh, layout_x, layout_y, dtype, jit, rng, row=False):
    """OPS[name] on x, y placed with the layouts, in sf.jit or outside: values and dtype as NumPy's."""
    fn, ref, positive = OPS[name]
    x, y = inputs(positive, dtype, rng, row=row)
    xa, ya = place(x, mesh, layout_x), place(y, mesh, "row" if row else layout_y)
    got = sf.jit(fn, mesh=mesh)(xa, ya) if jit else fn(xa, ya)
    assert got.dtype == expected_dtype(ref, x, y), (name, got.dtype, expected_dtype(ref, x, y))
    compare(got.gather(), ref(x.astype(np.float64), y.astype(np.float64)), dtype, name)


def check_reduction(name, mesh, layout_x, dtype, jit, rng):
    fn, ref = REDUCTIONS[name]
    x, _ = inputs(False, dtype, rng)
    xa = place(x, mesh, layout_x)
    got = sf.jit(fn, mesh=mesh)(xa) if jit else fn(xa)
    assert got.dtype == (ref(x).dtype if dtype != "bfloat16" or "mean" not in name and "sum" not in name
                         else np.dtype(BF16)), (name, got.dtype)
    compare(got.gather(), ref(x.astype(np.float64)), dtype, name)


_MESHES: dict = {}


def mesh_of(shape, backend="numpy"):
    """One mesh per shape and backend, made once (the GPU tests' CuPy meshes too)."""
    if (shape, backend) not in _MESHES:
        _MESHES[shape, backend] = sf.DeviceMesh(shape, backend=backend)
    return _MESHES[shape, backend]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_on_every_layout(name, layout, jit):
    shape, lx, ly = LAYOUTS[layout]
    check_op(name, mesh_of(shape), lx, ly, "float64", jit, np.random.default_rng(0), row=ly == "row")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_in_every_dtype(name, dtype):
    check_op(name, mesh_of(4), ("DIDx", None), ("DIDx", None), dtype, True, np.random.default_rng(1))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["1d R", "1d S0", "1d S1", "2d S0 S1", "2d S(0,1)"])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction(name, layout, jit):
    shape, lx, _ = LAYOUTS[layout]
    check_reduction(name, mesh_of(shape), lx, "float64", jit, np.random.default_rng(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["max -1 keepdims=True", "min (0, 1) keepdims=False", "sum 0 keepdims=True",
                                  "mean None keepdims=True"])
def test_reduction_in_every_dtype(name, dtype):
    check_reduction(name, mesh_of(4), ("DIDx", None), dtype, True, np.random.default_rng(3))


def test_mixed_float_dtypes_promote_as_jax():
    mesh = mesh_of(4)
    rng = np.random.default_rng(4)
    pairs = {("float16", "bfloat16"): "float32", ("bfloat16", "float32"): "float32", ("float16", "float64"): "float64",
             ("float32", "float64"): "float64", ("int32", "float32"): "float64", ("bool", "float16"): "float16",
             ("int32", "int64"): "int64"}
    for (a, b), want in pairs.items():
        x, y = (rng.uniform(1, 3, SHAPE).astype(np_dtype(t)) for t in (a, b))
        for fn in (lambda u, v: u + v, lambda u, v: u * v, lambda u, v: np.maximum(u, v), lambda u, v: u < v):
            got = sf.jit(fn, mesh=mesh)(sf.shard(x, axis=0, mesh=mesh), y)
            assert got.dtype_name == ("bool" if fn(x[:1], y[:1]).dtype == bool else want), (a, b, got.dtype)
            ref = fn(x.astype(np.float64), y.astype(np.float64))
            compare(got.gather(), ref, "float32" if want != "float64" else "float64", f"{a} {b}")


def test_python_scalars_are_weak():
    mesh = mesh_of(4)
    x = sf.shard(np.full(SHAPE, 1.5, np.float16), axis=0, mesh=mesh)
    assert (x * 2.0).dtype == np.float16 and (x + 1).dtype == np.float16 and (x ** 2).dtype == np.float16
    assert (x < 1e5).dtype == bool and np.asarray(x < 1e5).all()  # 1e5 is inf in float16: NumPy 2 says True too
    i = sf.shard(np.arange(96, dtype=np.int32).reshape(SHAPE) + 1, axis=0, mesh=mesh)
    assert (i + 1).dtype == np.int32 and (i * 2).dtype == np.int32 and (i * 0.5).dtype == np.float64
    assert (i / 2).dtype == np.float64 and np.sqrt(i).dtype == np.float64
    np.testing.assert_array_equal(np.asarray(i * 0.5), np.asarray(i).astype(np.float64) * 0.5)


def test_pending_sum_is_made_whole_before_a_nonlinear_op():
    """(x @ w) with K sharded pends a sum per device; sqrt of it must be the sqrt of the sum:
    one Allreduce before the Sqrt, and the result exact in float64."""
    mesh = mesh_of(4)
    rng = np.random.default_rng(5)
    x, w = rng.uniform(0.5, 1.0, (8, 16)), rng.uniform(0.5, 1.0, (16, 12))

    @sf.jit(mesh=mesh)
    def f(x, w):
        p = sf.shard(x, axis=1) @ sf.shard(w, axis=0)  # pending sums over DIDx
        return np.sqrt(p), p.max(-1), p.astype("float32")

    plan = f.lower(sf.TensorSpec(x.shape, "float64"), sf.TensorSpec(w.shape, "float64"))
    text = str(plan)
    assert text.index("Allreduce") < text.index("Sqrt"), text
    assert plan.collectives() == {"allreduce": 1}, text  # one reduction feeds sqrt, max and the cast
    s, m, c = f(x, w)
    np.testing.assert_allclose(s.gather(), np.sqrt(x @ w), rtol=1e-14)
    np.testing.assert_allclose(m.gather(), (x @ w).max(-1), rtol=1e-14)
    np.testing.assert_allclose(c.gather(), (x @ w).astype(np.float32), rtol=1e-6)
    xs = sf.shard(x, axis=1, mesh=mesh)  # outside jit too
    np.testing.assert_allclose(np.sqrt(xs @ sf.shard(w, axis=0, mesh=mesh)).gather(), np.sqrt(x @ w), rtol=1e-14)


def test_max_over_a_sharded_axis_is_one_allreduce_max():
    mesh = mesh_of(4)
    x = np.random.default_rng(6).standard_normal(SHAPE)
    plan = sf.jit(lambda x: sf.shard(x, axis=1).max(1), mesh=mesh).lower(sf.TensorSpec(SHAPE, "float64"))
    assert plan.collectives() == {"allreduce": 1} and "op=max" in str(plan), plan
    assert sf.jit(lambda x: sf.shard(x, axis=0).max(1), mesh=mesh).lower(
        sf.TensorSpec(SHAPE, "float64")).collectives() == {}  # an unsharded axis: local
    np.testing.assert_array_equal(sf.shard(x, axis=1, mesh=mesh).max(1).gather(), x.max(1))
    np.testing.assert_array_equal(sf.shard(x, axis=0, mesh=mesh).min(0).gather(), x.min(0))


def test_causal_mask_softmax():
    """A causal mask (np.tril) with where and comparisons, and a softmax with the max subtracted
    (keepdims, broadcasting): outside jit the mask is a plain array closed over; inside jit an
    argument or closed over (a constant of the program)."""
    mesh = mesh_of(4)
    rng = np.random.default_rng(7)
    scores = rng.standard_normal((4, 8, 8)) * 4
    mask = np.tril(np.ones((8, 8), bool))

    def softmax(s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    want = softmax(np.where(mask, scores, -np.inf))
    s = sf.shard(scores, axis=0, mesh=mesh)
    np.testing.assert_allclose(softmax(sf.where(mask, s, -np.inf)).gather(), want, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(softmax(np.where(mask, s, -np.inf)).gather(), want, rtol=1e-12, atol=1e-300)
    f = sf.jit(lambda s, m: softmax(sf.where(m, s, -np.inf)), mesh=mesh)
    np.testing.assert_allclose(f(s, mask).gather(), want, rtol=1e-12, atol=1e-300)
    g = sf.jit(lambda s, i, j: softmax(sf.where(i >= j, s, -np.inf)), mesh=mesh)  # the mask from comparisons
    rows, cols = np.arange(8.0)[:, None], np.arange(8.0)[None, :]
    np.testing.assert_allclose(g(s, rows, cols).gather(), want, rtol=1e-12, atol=1e-300)
    h = sf.jit(lambda s: softmax(sf.where(mask, s, -np.inf)), mesh=mesh)  # the mask closed over: a constant
    np.testing.assert_allclose(h(s).gather(), want, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_astype_round_trips(dtype):
    mesh = mesh_of((2, 2))
    x = np.random.default_rng(8).standard_normal(SHAPE) * 3
    xs = sf.distribute(x, mesh, ("DIDy", "DIDx"))
    for fn in (lambda v: v.astype(dtype), lambda v: v.astype(dtype).astype(np.float64),
               lambda v: v.astype(dtype).astype(np.int32), lambda v: v.astype(dtype).astype(bool),
               lambda v: v.astype(np.int64).astype(dtype), lambda v: (v > 0).astype(dtype)):
        want = fn(x)  # (NumPy casts through the same chain of dtypes)
        for got in (fn(xs), sf.jit(fn, mesh=mesh)(xs)):
            assert got.dtype == want.dtype, (dtype, got.dtype, want.dtype)
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_integer_and_bool_arrays_flow_through():
    mesh = mesh_of(4)
    ids = np.random.default_rng(9).integers(1, 1000, SHAPE).astype(np.int32)
    a = sf.shard(ids, axis=1, mesh=mesh)
    np.testing.assert_array_equal(a.gather(), ids)
    np.testing.assert_array_equal(sf.replicate(a).gather(), ids)  # resharded: an Allgather of int32
    for fn in (lambda v: v + 1, lambda v: v * 2 - 3, lambda v: v == 7, lambda v: v.max(1), lambda v: v.min(),
               lambda v: v.sum(0), lambda v: v.mean(), lambda v: np.maximum(v, 500), lambda v: (v > 500).sum(1),
               lambda v: np.where(v > 500, v, 0), lambda v: v.astype(np.float32)):
        want = fn(ids)
        for got in (fn(a), sf.jit(fn, mesh=mesh)(a)):
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            compare(got.gather(), want, "float64")


def test_bool_of_a_comparison_is_refused_inside_jit():
    with pytest.raises(sf.ConcretizationError, match=r"bool\(\) of the traced value"):
        sf.jit(lambda x: x if (x == x) else -x, mesh=mesh_of(4)).lower(sf.TensorSpec((4,)))


def test_refusals_say_what_to_write():
    mesh = mesh_of(4)
    spec = sf.TensorSpec(SHAPE, "float64")
    for fn, error, msg in [
        (lambda x: x.astype("int32") ** x.astype("int32"), TypeError,
         r"power of two arrays is of floats .*write"),
        (lambda x: ~x, TypeError, r"~x \(np.invert\) of x .*: & \| \^ ~ are NumPy's bitwise ops, of booleans \(logical\) "
                                  r"and integers only"),
        (lambda x: x.astype("int32") @ x.T.astype("int32"), TypeError, r"of int32 values: .*astype"),
        (lambda x: x.astype("complex64"), TypeError, r"unsupported dtype 'complex64'"),
        (lambda x: x.max(axis=3), ValueError, r"axis 3"),
    ]:
        with pytest.raises(error, match=msg):
            sf.jit(fn, mesh=mesh).lower(spec)


def test_numpy_scalars_are_strong_python_scalars_weak():
    """From a new-user probe: NumPy 2 and JAX promote with a NumPy scalar's dtype (float32 x *
    np.float64(3) is float64) but keep the array's for a Python scalar (x * 3.0 is float32)."""
    mesh, x = sf.DeviceMesh(2), np.random.default_rng(0).standard_normal(4).astype(np.float32)
    cases = [(lambda x: x * np.float64(3), x * np.float64(3)), (lambda x: x * 3.0, x * 3.0),
             (lambda x: x.astype("float16") + np.float32(2), x.astype(np.float16) + np.float32(2)),
             (lambda x: x.astype("int32") + np.int64(1), x.astype(np.int32) + np.int64(1)),
             (lambda x: x < np.float64(0.5), x < np.float64(0.5))]
    for fn, want in cases:
        got = sf.jit(fn, mesh=mesh)(x)
        assert got.dtype_name == want.dtype.name, (got.dtype_name, want.dtype)
        np.testing.assert_array_equal(got.gather(), want)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "bool"])
def test_python_scalar_arguments_are_weak_as_constants(dtype):
    """A Python scalar passed to sf.jit is weakly typed (JAX's weak type): x op c gives the dtype
    of x op a Python constant, NumPy 2's (float32 x * 2.5 is float32, int32 x + 3 is int32, int32 x
    * 2.5 float64 as the constant's rule); a NumPy scalar stays strong.  One plan serves every value."""
    mesh, rng = sf.DeviceMesh(2), np.random.default_rng(7)
    x = (rng.uniform(0.5, 4.0, (4, 6)) * rng.choice([-1, 1], (4, 6))).astype(dtype)
    f = sf.jit(lambda x, c: (x * c, x + c, x < c), mesh=mesh)
    for c in (2.5, 3, True, -1.75, np.float64(2.5), np.float32(2.5), np.int64(3)):
        const = sf.jit(lambda x: (x * c, x + c, x < c), mesh=mesh)(x)
        for got, want_const, want in zip(f(x, c), const, (x * c, x + c, x < c)):
            assert got.dtype_name == want_const.dtype_name == want.dtype.name, (dtype, repr(c), got.dtype_name)
            np.testing.assert_array_equal(got.gather(), want)
    assert len(f.cached_plans()) == 6  # float, int, bool (weak) and the three NumPy scalars (strong): their keys


def test_weak_arguments_stay_weak_through_their_own_ops():
    """Ops of weak values only are weak (c * 2.0, np.sqrt(n), c / (n + 1)); astype states a dtype
    (strong, as JAX's), and so does a weak value meeting an array."""
    mesh, x = sf.DeviceMesh(2), np.random.default_rng(8).standard_normal((4, 6)).astype(np.float32)
    f = sf.jit(lambda x, c, n: x * (c * 2.0) - np.sqrt(n) / (c + n) + -c, mesh=mesh)
    got = f(x, 1.5, 3)
    assert got.dtype_name == "float32"
    want = x.astype(np.float64) * 3.0 - np.sqrt(3.0) / 4.5 - 1.5
    np.testing.assert_allclose(got.gather(), want, rtol=1e-6)
    strong = sf.jit(lambda x, c: x * c.astype("float64"), mesh=mesh)
    assert strong(x, 1.5).dtype_name == "float64"
    plan = str(sf.jit(lambda x, c: x * c, mesh=mesh).lower(x, 1.5))
    assert "(x: f32[4, 6], c: f64[])" in plan and "Astype" in plan, plan  # the cast of c is printed
    with pytest.raises(TypeError, match=r"weak= is True only for a Python scalar's 0-d spec \(shape \(\)\)"):
        sf.TensorSpec((2,), "float64", weak=True)
