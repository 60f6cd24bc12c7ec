"""The names a JAX user reaches for (a new user's probe, 2026-12-06): sf.stop_gradient (a value of
its own: the input's other uses keep their gradient, as jax.lax.stop_gradient), sf.nn.logsumexp
and sf.nn.one_hot (jax.nn's), and jax.tree_util's names in sf.tree; against float64 NumPy on
fresh random inputs, sharded over a dp x tp mesh."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

MESH = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def rng():
    return np.random.default_rng()


def grad_of(fn, *args):
    return np.asarray(sf.jit(sf.grad(fn), mesh=MESH)(*args))


def test_stop_gradient_holds_only_the_value_it_returns():
    w = rng().standard_normal((4, 6))
    np.testing.assert_allclose(grad_of(lambda w: (sf.stop_gradient(w) * w).sum(), w), w, rtol=1e-14)
    np.testing.assert_allclose(grad_of(lambda w: (sf.stop_gradient(w * 2) * (w * 2)).sum(), w), 4 * w, rtol=1e-14)
    np.testing.assert_array_equal(grad_of(lambda w: (sf.stop_gradient(w) ** 2).sum() + 0 * w.sum(), w), 0 * w)
    tree = sf.jit(lambda d: sf.stop_gradient(d), mesh=MESH)({"a": w, "b": [w * 3]})
    np.testing.assert_array_equal(np.asarray(tree["b"][0]), w * 3)
    assert sf.stop_gradient(w) is w  # (outside a traced function: x itself)


@pytest.mark.parametrize("axis, keepdims", [(None, False), (-1, False), (0, True), ((0, 1), False)])
def test_logsumexp_values_and_gradient(axis, keepdims):
    x = 30 * rng().standard_normal((4, 6))  # (exp of it overflows float64 without the shift)
    x[1] = -np.inf  # (a row of -inf: -inf, not NaN, where the axis is the rows')

    def ref(x):
        m = np.max(x, axis=axis, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            out = np.log(np.exp(x - m).sum(axis=axis, keepdims=True)) + m
        return out if keepdims else np.squeeze(out, axis=axis) if axis is not None else out.reshape(())

    def placed(x):
        return sf.shard(sf.shard(x, axis=0, over="dp"), axis=1, over="tp")
    got = np.asarray(sf.jit(lambda x: sf.nn.logsumexp(placed(x), axis, keepdims), mesh=MESH)(x))
    np.testing.assert_allclose(got, ref(x), rtol=1e-13)
    y = rng().standard_normal((4, 6))  # (finite: the gradient is softmax over the axis)
    g = grad_of(lambda y: sf.nn.logsumexp(placed(y), axis, keepdims).sum(), y)
    e = np.exp(y - np.max(y, axis=axis, keepdims=True))
    np.testing.assert_allclose(g, e / e.sum(axis=axis, keepdims=True), rtol=1e-12)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_as_jax(axis):
    ids = rng().integers(-2, 7, (4, 6)).astype(np.int32)  # (some outside [0, 5): rows of zeros)
    want = np.moveaxis((ids[..., None] == np.arange(5)).astype(np.float32), -1, axis)
    got = sf.jit(lambda i: sf.nn.one_hot(sf.shard(i, axis=0, over="dp"), 5, axis=axis), mesh=MESH)(ids)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(sf.nn.one_hot(sf.distribute(ids, MESH, ("dp", None)), 5, "bfloat16",
                                                           axis=axis)).astype(np.float32), want)
    with pytest.raises(TypeError, match="integer class ids"):
        sf.jit(lambda x: sf.nn.one_hot(x, 5), mesh=MESH)(ids.astype(np.float32))
    with pytest.raises(ValueError, match="positive int"):
        sf.jit(lambda i: sf.nn.one_hot(i, 0), mesh=MESH)(ids)


def test_tree_util_names():
    params = {"w": [1, 2], "b": (3, {"c": 4})}
    leaves, td = sf.tree.tree_flatten(params)
    assert leaves == sf.tree.tree_leaves(params) == [3, 4, 1, 2]
    assert sf.tree.tree_structure(params) == td and sf.tree.tree_unflatten(td, leaves) == params
    assert sf.tree.tree_reduce(lambda a, b: a + b, params) == 10
    assert sf.tree.tree_reduce(lambda a, b: a + b, params, 100) == 110
    pairs = {"a": (1, 2), "b": (3, 4)}
    leaf = lambda x: isinstance(x, tuple)  # noqa: E731
    assert sf.tree.tree_map(lambda t: t[0] * t[1], pairs, is_leaf=leaf) == {"a": 2, "b": 12}
    assert sf.tree.tree_leaves(pairs, is_leaf=leaf) == [(1, 2), (3, 4)]


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32"])
def test_numpy_sum_and_mean_take_dtype_and_where(dtype):
    """np.sum / np.mean with dtype= (the accumulator and result) and where= (a masked token mean:
    NaN where a row keeps nothing), as NumPy's, x sharded; max takes where= with initial= (NumPy's needs it), initial= alone too."""
    r = rng()
    x = (4 * r.standard_normal((4, 6))).astype(dtype)
    m = r.random((4, 6)) < 0.5
    m[2] = False
    fns = {"sum where": lambda x, m: np.sum(x, where=m, axis=1), "mean where": lambda x, m: np.mean(x, where=m, axis=1),
           "mean where row": lambda x, m: np.mean(x, where=m[0]), "sum dtype": lambda x, m: np.sum(x, dtype=np.float32),
           "mean dtype": lambda x, m: np.mean(x, axis=0, dtype="float64")}
    for name, fn in fns.items():
        got = sf.jit(lambda x, m: fn(sf.shard(x, axis=0, over="dp"), m), mesh=MESH)(x, m)
        with np.errstate(invalid="ignore", divide="ignore"):
            want = np.asarray(fn(x, m))
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        rtol = {"float16": 1e-3, "float32": 1e-5}.get(want.dtype.name, 1e-12)  # (sums in another order)
        scale = rtol * float(np.abs(x.astype(np.float64)).sum())  # (a float32 sum of 24 terms of ~4 near 0: absolute)
        np.testing.assert_allclose(np.asarray(got).astype(np.float64), want.astype(np.float64), rtol=rtol, atol=scale,
                                   err_msg=name)
    with pytest.raises(ValueError, match="np.max with where=: NumPy's needs initial= too"):
        sf.jit(lambda x, m: np.max(x, where=m), mesh=MESH)(x, m)


def test_var_with_ddof_in_float16_as_numpy():
    """The n / (n - ddof) factor is applied as it is, not rounded to float16 as a user's Python float
    beside a float16 array is (rounded twice it gave 1.498 where NumPy gives 1.497)."""
    x = np.random.default_rng(1).standard_normal((4, 10)).astype(np.float16)
    got = sf.jit(lambda x: np.var(sf.shard(x, axis=0, over="dp"), axis=1, ddof=1), mesh=MESH)(x)
    np.testing.assert_array_equal(np.asarray(got), np.var(x, axis=1, ddof=1))


def test_sum_and_mean_methods_take_dtype_and_where_inside_jit_and_on_sf_arrays():
    x = rng().standard_normal((4, 6))
    m = rng().random((4, 6)) < 0.5
    m[1] = False
    xa = sf.distribute(x, MESH, ("dp", "tp"))
    cases = {"mean where": lambda x, m: x.mean(where=m), "sum where axis": lambda x, m: x.sum(1, where=m),
             "mean where keepdims": lambda x, m: x.mean(axis=1, keepdims=True, where=m),
             "sum dtype": lambda x, m: x.sum(dtype=np.float32), "np.mean where": lambda x, m: np.mean(x, 0, where=m)}
    for name, fn in cases.items():
        with np.errstate(invalid="ignore"):
            want = np.asarray(fn(x, m))
        for got in (sf.jit(fn, mesh=MESH)(x, m), fn(xa, m)):
            assert got.dtype == want.dtype, name
            f32 = want.dtype == np.float32  # (a float32 sum of either sign cancels: held in absolute terms)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-5 if f32 else 0, err_msg=name)
    with pytest.raises(ValueError, match="needs initial= too"):  # (NumPy's ValueError too)
        xa.max(where=m)
    empty = sf.jit(lambda x: np.max(np.repeat(x, 0, axis=0), axis=0, initial=-1.0), mesh=MESH)(x)  # (a review)
    np.testing.assert_array_equal(np.asarray(empty), np.full(x.shape[1], -1.0))
    for fn in (lambda x, m: np.max(x, 1, where=m, initial=-0.5), lambda x, m: x.min(initial=0.25),
               lambda x, m: np.min(x, axis=0, keepdims=True, where=m, initial=np.nan)):
        want = fn(x, m)
        for got in (sf.jit(fn, mesh=MESH)(x, m), fn(xa, m)):
            np.testing.assert_array_equal(np.asarray(got), want)


def test_tree_paths_as_jax_tree_util_with_the_keys_themselves():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    params = {"layers": [{"w": 1, "b": 2}], "head": Pair(3, None)}
    pairs, td = sf.tree.tree_flatten_with_path(params)
    assert pairs == [(("head", "a"), 3), (("layers", 0, "b"), 2), (("layers", 0, "w"), 1)]
    assert td == sf.tree.tree_structure(params)
    decayed = sf.tree.tree_map_with_path(lambda p, w, g: w if p[-1] == "b" else w - g, params, params)
    assert decayed == {"layers": [{"w": 0, "b": 2}], "head": Pair(0, None)}


def test_logsumexp_and_a_masked_mean_against_central_differences():
    """Their gradients (written with the ops: the max held constant, the mask's where) against
    float64 central differences, x sharded over dp x tp."""
    from cases import central_differences

    x = rng().standard_normal((4, 6))
    m = rng().random((4, 6)) < 0.6
    m[:, 0] = True

    def placed(x):
        return sf.shard(sf.shard(x, axis=0, over="dp"), axis=1, over="tp")
    cases = {"logsumexp": (lambda x: (sf.nn.logsumexp(placed(x), axis=1) ** 2).sum(),
                           lambda x: float((np.log(np.exp(x).sum(1)) ** 2).sum())),
             "masked mean": (lambda x: (placed(x) ** 3).mean(axis=1, where=m).sum(),
                             lambda x: float(np.mean(x ** 3, axis=1, where=m).sum()))}
    for name, (fn, ref) in cases.items():
        np.testing.assert_allclose(grad_of(fn, x), central_differences(ref, x), rtol=1e-6, atol=1e-8, err_msg=name)


def test_tree_all_is_jax_s():
    assert sf.tree.tree_all({"a": True, "b": [1, np.True_]}) and not sf.tree.tree_all({"a": True, "b": (0,)})
    assert sf.tree.tree_all([]) and sf.tree.tree_all({"x": [2, 3]}, is_leaf=lambda v: isinstance(v, list))


def test_a_plan_takes_its_arguments_by_keyword_as_the_jitted_function():
    """f.lower(x, w)(x, w=w), as JAX's compiled functions take them (a probe: TypeError)."""
    f = sf.jit(lambda x, w: x @ w, mesh=sf.DeviceMesh(2, backend="numpy"))
    r = np.random.default_rng()
    x, w = r.standard_normal((4, 3)), r.standard_normal((3, 2))
    plan = f.lower(x, w)
    np.testing.assert_allclose(np.asarray(plan(x, w=w)), x @ w, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(plan(w=w, x=x)), x @ w, rtol=1e-12)
    with pytest.raises(TypeError, match="unexpected keyword argument 'v'"):
        plan(x, v=w)


def test_a_plan_of_pytree_arguments_takes_them_by_keyword():
    """A review: plan(params, x=x) bound against the flattened leaves' signature (TypeError)."""
    f = sf.jit(lambda p, x: x @ p["w"] + p["b"], mesh=sf.DeviceMesh(2, backend="numpy"))
    r = np.random.default_rng()
    params, x = {"w": r.standard_normal((3, 2)), "b": r.standard_normal(2)}, r.standard_normal((4, 3))
    plan = f.lower(params, x)
    want = x @ params["w"] + params["b"]
    np.testing.assert_allclose(np.asarray(plan(params, x=x)), want, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(plan(p=params, x=x)), want, rtol=1e-12)


@pytest.mark.parametrize("axis", [None, 0, -2, (0, 2)])
def test_flip_as_numpy_with_its_gradient(axis):
    """np.flip / flipud / fliplr (a MoE probe reached for np.flip): values of sharded axes too, and the
    gradient flipped back, inside jit and on an sf.Array."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng()
    x, r = rng.standard_normal((2, 4, 6, 4))
    f = sf.jit(lambda v: np.flip(sf.distribute(v, mesh, ("dp", "tp", None)), axis), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(f(x)), np.flip(x, axis))
    g = sf.jit(sf.grad(lambda v: (np.flip(v, axis) * r).sum()), mesh=mesh)(x)
    np.testing.assert_array_equal(np.asarray(g), np.flip(r, axis))
    np.testing.assert_array_equal(np.asarray(np.flip(sf.distribute(x, mesh, ("dp", None, "tp")), axis)), np.flip(x, axis))
    np.testing.assert_array_equal(np.asarray(sf.jit(np.flipud, mesh=mesh)(x)), np.flipud(x))
    np.testing.assert_array_equal(np.asarray(sf.jit(np.fliplr, mesh=mesh)(x)), np.fliplr(x))
    with pytest.raises(ValueError, match="repeated axis"):
        sf.jit(lambda v: np.flip(v, (0, -3)), mesh=mesh)(x)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_sums_do_not_hang_on_the_sharding(dtype):
    """A probe: each device's part of a 16-bit sum over a sharded axis was rounded to 16 bits before the
    Allreduce (a float16 part of 80000 overflowed: NaN at D = 2, 0 at D = 1), and a sum over two axes
    rounded after each: summed in float32 and rounded once now, so every D gives the one-device result."""
    import ml_dtypes  # noqa: F401 (bfloat16)

    rng = np.random.default_rng()
    x = np.array([40000, 40000, -40000, -40000] * 2, dtype=dtype) if dtype == "float16" else \
        np.array([256, 1, 1, 1] * 2, dtype=ml_dtypes.bfloat16)
    y = (rng.standard_normal((4, 8)) * 100).astype(x.dtype)
    for d in (1, 2, 4):
        mesh = sf.DeviceMesh(d, backend="numpy")
        for got, want in ((sf.jit(lambda a: sf.shard(a, axis=0).sum(), mesh=mesh)(x), x.astype(np.float32).sum()),
                          (sf.distribute(x, mesh, ("DIDx",)).mean(), x.astype(np.float32).mean()),
                          (sf.jit(lambda a: sf.shard(a, axis=1).sum(), mesh=mesh)(y), y.astype(np.float32).sum()),
                          (sf.jit(lambda a: sf.shard(a, axis=1).sum(0), mesh=mesh)(y), y.astype(np.float32).sum(0))):
            assert got.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(got).astype(np.float32), np.asarray(want.astype(x.dtype), np.float32))


def test_statistics_of_booleans_are_float64():
    """A probe: np.linalg.norm, np.var and np.std of a boolean array were float16 (sqrt's dtype of booleans):
    the norm of 100,000 True was inf.  float64, as NumPy's, against NumPy."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    mask = np.random.default_rng().random(4096) < 0.25
    for f in (np.linalg.norm, np.var, np.std, lambda a: np.var(a, ddof=1)):
        got = sf.jit(f, mesh=mesh)(mask)
        assert got.dtype == np.float64
        np.testing.assert_allclose(np.asarray(got), f(mask), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(np.linalg.norm(sf.distribute(np.ones(100_000, bool), mesh, ("DIDx",)))),
                               np.sqrt(100_000), rtol=1e-14)


def test_clip_takes_array_bounds_and_at_refuses_ints_out_of_range():
    """Two probes' findings: np.clip with a NumPy array bound raised "the truth value of an array ... is
    ambiguous" (inside jit and on sf.Arrays); x.at[...].set / .add of a Python int beyond an int32
    sf.Array's range wrapped (2**40 set as 0), where inside jit it raised OverflowError, as NumPy 2."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.random.default_rng().standard_normal((2, 3)) * 3
    lo, hi = np.array([-1.0, 0.0, 1.0]), np.array([[0.5], [2.0]])
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda a: np.clip(a, lo, hi), mesh=mesh)(x)), np.clip(x, lo, hi))
    a = sf.distribute(x, mesh, (None, None))
    np.testing.assert_array_equal(np.asarray(np.clip(a, lo, 3.0)), np.clip(x, lo, 3.0))
    np.testing.assert_array_equal(np.asarray(a.clip(min=lo)), np.clip(x, lo, None))
    with pytest.raises(TypeError, match="np.clip takes both bounds"):
        np.clip(a, lo)
    ints = sf.distribute(np.arange(8, dtype=np.int32).reshape(2, 4), mesh, (None, None))
    for write in (lambda: ints.at[:, 1].set(2**40), lambda: ints.at[0].add(2**32 + 5),
                  lambda: ints.at[np.array([0])].add(2**40), lambda: ints.at[np.array([1]), :].set(-2**31 - 1)):
        with pytest.raises(OverflowError, match="out of bounds for int32"):
            write()
    np.testing.assert_array_equal(np.asarray(ints.at[:, 1].set(-2**31)), [[0, -2**31, 2, 3], [4, -2**31, 6, 7]])


def test_numpy_scalars_and_lists_as_static_arguments_of_sf_array_ops():
    """A probe: outside jit, np.prod(x.shape) as an extent, np.int64 axes, a list of extents or axes, an
    np.int64 ddof and an np.float32 fill were taken as traced operands (or keyed unhashably); they are
    static there as inside jit.  Values against NumPy."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.random.default_rng().standard_normal((2, 4))
    a = sf.distribute(x, mesh, (None, "DIDx"))
    cases = [(a.reshape(np.prod(a.shape)), x.reshape(8)), (a.reshape([4, 2]), x.reshape(4, 2)), (a.transpose([1, 0]), x.T),
             (np.cumsum(a, axis=np.int64(1)), np.cumsum(x, 1)), (a.argmax(axis=np.int64(1)), x.argmax(1)),
             (a.var(ddof=np.int64(1)), x.var(ddof=1)), (np.full_like(a, np.float32(2)), np.full_like(x, 2)),
             (np.concatenate([a, a], axis=np.int64(0)), np.concatenate([x, x])), (np.swapaxes(a, np.int64(0), 1), x.T)]
    for got, want in cases:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-14)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_abs_of_the_least_integer_wraps_as_numpy(dtype):
    """A probe: abs was relu(x) + relu(-x), and -INT_MIN wraps to INT_MIN, so |INT_MIN| came out 0."""
    x = np.array([np.iinfo(dtype).min, -5, 5, 0, np.iinfo(dtype).max], dtype)
    for f in (abs, np.abs):
        got = sf.jit(f, mesh=sf.DeviceMesh(2, backend="numpy"))(x)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(got), np.abs(x))


def test_empty_values_reshape_and_gain_axes():
    """A probe: x[2:] of a [2, 4] value is empty, (0, 4), and its sum runs, but x[2:][None], np.stack of it,
    a reshape to a shape with 0 and a gradient through it raised (an IndexError inside the reshape rule).
    Against NumPy; an empty reshape is an empty constant (no elements to move)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.random.default_rng().standard_normal((2, 4))
    for f in (lambda a: a[2:][None], lambda a: np.stack([a[2:], a[2:]]), lambda a: a[2:].reshape(-1),
              lambda a: a[2:].reshape(-1, 4, 1), lambda a: a[2:].sum(1, keepdims=True),
              lambda a: np.concatenate([a[2:], a]), lambda a: np.tile(a[2:], 2)):
        got = sf.jit(f, mesh=mesh)(x)
        assert got.shape == f(x).shape
        np.testing.assert_array_equal(np.asarray(got), f(x))
    g = sf.jit(sf.grad(lambda a: (np.concatenate([a[2:], a]) ** 2).sum() + a[2:].sum()), mesh=mesh)(x)
    np.testing.assert_allclose(np.asarray(g), 2 * x, rtol=1e-14)
    with pytest.raises(ValueError, match="-1 is ambiguous beside an extent 0"):
        sf.jit(lambda a: a[2:].reshape(0, -1), mesh=mesh)(x)


def test_flip_and_16_bit_sum_gradients_against_finite_differences():
    """np.flip inside a nonlinear loss, its gradient against float64 central differences on a 2-D mesh; a
    16-bit sum's gradient (float32 until rounded once) is ones in the primal's dtype."""
    import ml_dtypes

    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng()
    x, w = rng.standard_normal((2, 4, 6))

    def loss(v):
        return (np.tanh(np.flip(sf.distribute(v, mesh, ("dp", "tp")), (0, 1))) * w).sum()
    g = np.asarray(sf.jit(sf.grad(loss), mesh=mesh)(x))
    f = sf.jit(loss, mesh=mesh)
    for k in [(0, 0), (1, 3), (3, 5)]:
        e = np.zeros_like(x)
        e[k] = 1e-6
        np.testing.assert_allclose(g[k], (float(f(x + e)) - float(f(x - e))) / 2e-6, rtol=1e-6, atol=1e-9)
    b = x.astype(ml_dtypes.bfloat16)
    gb = sf.jit(sf.grad(lambda v: sf.shard(v, axis=0, over="dp").sum().astype(np.float32)), mesh=mesh)(b)
    assert gb.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(gb).astype(np.float32), np.ones(b.shape, np.float32))
