"""x.at[...] with integer arrays on several axes (shardfuse/at_arrays.py): a per-sequence KV-cache write
(each sequence's token at its own position) and its .add / .get, against NumPy's advanced indexing on
fresh random values, inside sf.jit (positions traced: one plan for every step) and on sf.Arrays,
sharded over dp and tp with no collective, with JAX's rules for negative and outside ids, and
gradients against central differences."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from cases import directional

B, H, T, D = 4, 2, 8, 3


def mesh():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def placed(c):
    return sf.shard(sf.shard(c, axis=0, over="dp"), axis=1, over="tp")


@pytest.mark.parametrize("pos", [[1, 5, 2, 7], [0, -1, 3, -8], [1, 9, 2, -9]])  # (in range; negative; outside)
def test_a_per_sequence_cache_write_and_read(pos):
    r = np.random.default_rng()
    cache, new, pos = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, D)), np.array(pos)
    rows = np.arange(B)
    inside = (pos >= -T) & (pos < T)
    want = cache.copy()
    want[rows[inside], :, pos[inside]] = new[inside]  # (JAX drops an update outside the axis)
    write = sf.jit(lambda c, n, p: placed(c).at[rows, :, p].set(n), mesh=mesh())
    assert write.lower(cache, new, pos).collectives() == {}
    np.testing.assert_array_equal(np.asarray(write(cache, new, pos)), want)
    added = cache.copy()
    np.add.at(added, (rows[inside], slice(None), pos[inside]), new[inside])
    got = sf.jit(lambda c, n, p: placed(c).at[rows, :, p].add(n), mesh=mesh())(cache, new, pos)
    np.testing.assert_allclose(np.asarray(got), added, rtol=1e-13)
    read = sf.jit(lambda c, p: c.at[rows, :, p].get(), mesh=mesh())(cache, pos)
    np.testing.assert_array_equal(np.asarray(read), cache[rows, :, np.clip(np.where(pos < 0, pos + T, pos), 0, T - 1)])


def test_adjacent_index_arrays_keep_their_place_and_sf_arrays_work_outside_jit():
    r = np.random.default_rng()
    x = r.standard_normal((5, 6, 3))
    i, j = np.array([[0, 2], [4, 1]]), np.array([2, 0])  # (broadcast to [2, 2]: x[:, i, j] is [5, 2, 2])
    v = r.standard_normal((5, 2, 2))
    want = x.copy()
    want[np.arange(5)[:, None, None], i[None], j[None, None]] = v  # (x[:, i, j] = v in NumPy's order)
    got = sf.jit(lambda x, v: x.at[:, i, j].set(v), mesh=mesh())(x, v)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda x: x.at[:, i, j].get(), mesh=mesh())(x)), x[:, i, j])
    xs = sf.shard(x, axis=1, over="dp", mesh=mesh())
    np.testing.assert_array_equal(np.asarray(xs.at[:, i, j].set(v)), want)
    rows = np.array([4, 0, 2])
    w = x.copy()
    w[rows] = 7.0
    np.testing.assert_array_equal(np.asarray(xs.at[rows].set(7.0)), w)  # (ids on the first axis: .set too now)


def test_the_gradient_of_a_cache_write():
    r = np.random.default_rng()
    cache, new, pos = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, D)), np.array([1, 5, 2, 7])
    c = r.standard_normal((B, H, T, D))
    rows = np.arange(B)

    def ref(p):
        out = p["cache"].copy()
        out[rows, :, pos] = p["new"]
        return float((out * c).sum())
    g = sf.jit(sf.grad(lambda p: (placed(p["cache"]).at[rows, :, pos].set(p["new"]) * c).sum()),
               mesh=mesh())({"cache": cache, "new": new})
    numeric, analytic = directional(ref, {"cache": cache, "new": new}, g, r)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)


def test_a_cache_write_with_the_batch_over_dp_is_local_and_in_place():
    """A JAX-port probe: with the batch (and positions) over dp, the merged [batch * len] rows were
    scattered whole on every device and summed over dp (2 Allreduces of the cache); the rows' form
    (np.arange of the batch first) writes each row where it lies: no collective, the donated cache
    taken by the result without a warning."""
    import warnings
    r = np.random.default_rng()
    cache, new, pos = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, D)), np.array([1, -1, 9, 0], np.int32)
    f = sf.jit(lambda c, k, p: c.at[np.arange(B), :, p].set(k), mesh=mesh(), donate_argnums=0,
               in_shardings=(("dp", "tp", None, None), ("dp", "tp", None), ("dp",)))
    assert f.lower(cache, new, pos).collectives() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = f(cache.copy(), new, pos)
    want = cache.copy()
    inside = (pos >= -T) & (pos < T)
    want[np.arange(B)[inside], :, pos[inside]] = new[inside]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_an_ellipsis_after_index_arrays():
    """x.at[np.arange(B), p, ...] (a review: the Ellipsis was looked up with ==, elementwise on the arrays)."""
    r = np.random.default_rng()
    x, v, p = r.standard_normal((B, T, D)), r.standard_normal((B, D)), np.array([0, 3, 7, 1])
    want = x.copy()
    want[np.arange(B), p] = v
    got = sf.jit(lambda x, v, p: x.at[np.arange(B), p, ...].set(v), mesh=mesh())(x, v, p)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("t", [3, -2, 11])  # (in range; from the end; outside: dropped / clamped)
def test_one_position_for_every_row_is_in_place_and_local(t):
    """A serving probe: cache.at[:, :, t] with a traced 0-d t went the index arrays' way (a scatter and a
    where over the whole cache, the donated cache unused), and cache.at[np.arange(B), :, t] summed a
    cache-sized buffer over dp.  A 0-d t is a scalar index: the first is a DynamicUpdateSlice in place,
    the second the rows' form (t broadcast to every row, NumPy's rule); .add and .get too."""
    import warnings
    r = np.random.default_rng()
    cache, new = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, D))
    rows, inside = np.arange(B), -T <= t < T
    want = cache.copy()
    if inside:
        want[:, :, t] = new
    specs = (("dp", "tp", None, None), ("dp", "tp", None), None)
    whole = sf.jit(lambda c, k, t: c.at[:, :, t].set(k), mesh=mesh(), donate_argnums=0, in_shardings=specs)
    by_rows = sf.jit(lambda c, k, t: c.at[rows, :, t].set(k), mesh=mesh(), donate_argnums=0, in_shardings=specs)
    assert "DynamicUpdateSlice" in str(whole.lower(cache, new, t))
    assert by_rows.lower(cache, new, t).collectives() == {} and "ScatterAdd" not in str(by_rows.lower(cache, new, t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "donated buffers were not usable")
        np.testing.assert_array_equal(np.asarray(by_rows(cache.copy(), new, t)), want)
        np.testing.assert_array_equal(np.asarray(whole(cache.copy(), new, t)), want)
    added = cache.copy()
    if inside:
        added[rows, :, t] += new
    got = sf.jit(lambda c, k, t: c.at[rows, :, t].add(k), mesh=mesh())(cache, new, t)
    np.testing.assert_allclose(np.asarray(got), added, rtol=1e-13)
    read = sf.jit(lambda c, t: c.at[rows, :, t].get(), mesh=mesh())(cache, t)
    np.testing.assert_array_equal(np.asarray(read), cache[rows, :, min(max(t + T if t < 0 else t, 0), T - 1)])
    ids = np.array([[2, 0], [1, 3]])  # (a Python int beside an index array: NumPy puts the index axes first)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda c: c.at[ids, 1, :, 2].get(), mesh=mesh())(cache)),
                                  cache[ids, 1, :, 2])


def test_index_errors_name_the_index_at_fault():
    """A serving probe: float positions were blamed on the np.arange of axis 0 ("takes ints ..."), and
    positions of the wrong length met NumPy's bare broadcast error."""
    x = np.zeros((B, H, T, D))
    f = sf.jit(lambda c, p: c.at[np.arange(B), :, p].set(1.0), mesh=mesh())
    with pytest.raises(TypeError, match=r"an index must be an integer \(JAX's\), got the value p of dtype float64 on axis 2"):
        f(x, np.arange(B, dtype=np.float64))
    with pytest.raises(ValueError, match=r"index arrays' shapes \(4,\), \(3,\) do not broadcast together"):
        f(x, np.arange(3))
    # (a mask: casting it to int32 would write rows 0 and 1, so the advice is sf.where or np.nonzero, a review)
    with pytest.raises(TypeError, match=r"a boolean mask .* sf.where\(mask\[:, None\], value, x\)"):
        sf.jit(lambda c: c.at[np.array([True, False, True, False])].set(0.0), mesh=mesh())(x)


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_integer_and_boolean_arrays_at_index_arrays(dtype):
    """A probe: x.at[ids].add(v) of an int32 array raised "sf.scatter_add: values must be floats"; int32
    and bool rows are written through a float64 scatter (exact), int64 refused clearly.  Against NumPy."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = (np.random.default_rng().integers(-9, 9, (4, 6)) % (2 if dtype == "bool" else 99)).astype(dtype)
    v = np.ones((), dtype) * 3 if dtype != "bool" else np.bool_(True)
    ids, cols = np.array([1, 3, 1, 7]), np.array([0, 5, 2, 2])

    def numpy_add(x, *key):
        out = x.copy()
        keep = key[0] < x.shape[0]
        np.add.at(out, tuple(k[keep] for k in key), v) if dtype != "bool" else np.logical_or.at(out, tuple(k[keep] for k in key), v)
        return out
    got = sf.jit(lambda a: a.at[ids].add(v), mesh=mesh)(x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got), numpy_add(x, ids))
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda a: a.at[ids, cols].add(v), mesh=mesh)(x)), numpy_add(x, ids, cols))
    want = x.copy()
    want[ids[:2], cols[:2]] = v
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda a: a.at[ids[:2], cols[:2]].set(v), mesh=mesh)(x)), want)
    with pytest.raises(TypeError, match=r"x.at\[...\] at index arrays of the int64 array"):
        sf.jit(lambda a: a.at[ids].add(1), mesh=mesh)(x.astype(np.int64))


def test_int32_sums_at_repeated_ids_wrap_as_numpy():
    """A review: int32 values summed at repeated ids beyond int32's range came back saturated (the float64
    scatter's exact sum cast); they wrap as np.add.at's int32 sums.  Also np.take of one NumPy int id."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    x = r.integers(-2**31, 2**31, (3, 2)).astype(np.int32)
    ids, cols = r.integers(0, 3, 6), r.integers(0, 2, 6)
    v = r.integers(-2**31, 2**31, (6, 2)).astype(np.int32)
    want = x.copy()
    np.add.at(want, ids, v)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda a: a.at[ids].add(v), mesh=mesh)(x)), want)
    want = x.copy()
    np.add.at(want, (ids, cols), v[:, 0])
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda a: a.at[ids, cols].add(v[:, 0]), mesh=mesh)(x)), want)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda a: a.at[np.array([0, 0])].add(2**30), mesh=mesh)(
        np.zeros(2, np.int32))), [-2**31, 0])
    a = sf.distribute(np.array([0.5, -1.25, 3.0, 2.0]), mesh, ("DIDx",))
    assert float(np.asarray(np.take(a, np.int64(2)))) == 3.0 and float(np.asarray(np.take(a, -1))) == 2.0


def _numpy_set(x, index, v):
    """NumPy's x[index] = v with JAX's drop of ids outside their axis: the last write wins."""
    want = x.copy()
    ids = np.broadcast_arrays(*index)
    inside = np.logical_and.reduce([(i >= -n) & (i < n) for i, n in zip(ids, x.shape)])
    v = np.broadcast_to(v, ids[0].shape + x.shape[len(ids):])
    for pos in zip(*np.nonzero(inside)):
        want[tuple(i[pos] for i in ids)] = v[pos]
    return want


@pytest.mark.parametrize("traced", [False, True])  # (ids known when traced, or operands of the plan)
def test_set_at_repeated_ids_keeps_the_last_value(traced):
    """A serving probe: .set at repeated ids summed their values (a repetition penalty's
    lg.at[rows, history].set(penalised) came out 3x for a token seen 3 times; setting a value's own
    gathered values changed it).  The last write wins, as NumPy's x[ids] = v (JAX: one of them, so equal
    values give that value), on one and two index arrays, negative and outside ids, sharded rows."""
    r = np.random.default_rng()
    x = r.standard_normal((8, 6))
    ids, cols = np.array([5, 2, 5, -3, 11, 2, 0]), np.array([1, 4, 1, 1, 0, 4, -1])
    v = r.standard_normal(7)
    mesh2 = sf.DeviceMesh(2, backend="numpy")
    if traced:
        one = sf.jit(lambda a, i, u: sf.shard(a, axis=0).at[i].set(u[:, None]), mesh=mesh2)(x, ids, v)
        two = sf.jit(lambda a, i, j, u: sf.shard(a, axis=1).at[i, j].set(u), mesh=mesh2)(x, ids, cols, v)
    else:
        one = sf.jit(lambda a, u: sf.shard(a, axis=0).at[ids].set(u[:, None]), mesh=mesh2)(x, v)
        two = sf.jit(lambda a, u: sf.shard(a, axis=1).at[ids, cols].set(u), mesh=mesh2)(x, v)
    np.testing.assert_array_equal(np.asarray(one), _numpy_set(x, (ids,), v[:, None]))
    np.testing.assert_array_equal(np.asarray(two), _numpy_set(x, (ids, cols), v))
    same = sf.jit(lambda a, i: a.at[np.arange(8)[:, None], i].set(np.take_along_axis(a, i, 1)), mesh=mesh2)
    hist = r.integers(0, 6, (8, 5))
    np.testing.assert_array_equal(np.asarray(same(x, hist)), x)  # (its own values: unchanged)
    placed_x = sf.shard(x, axis=0, mesh=mesh2)  # (on an sf.Array: the ids operands of a one-op plan)
    np.testing.assert_array_equal(np.asarray(placed_x.at[ids].set(v[:, None])), _numpy_set(x, (ids,), v[:, None]))


def test_set_at_repeated_ids_differentiates_the_value_written():
    """The values overwritten by a later id get no gradient; the one kept gets it (checked against
    central differences), and a plan whose NumPy ids do not repeat sorts nothing."""
    r = np.random.default_rng()
    x, u, ids = r.standard_normal((6, 3)), r.standard_normal((4, 3)), np.array([4, 1, 4, 0])
    mesh2 = sf.DeviceMesh(2, backend="numpy")
    loss = lambda u, x: (np.sin(x.at[ids].set(u)) * x).sum()  # noqa: E731
    g = np.asarray(sf.jit(sf.grad(loss), mesh=mesh2)(u, x))
    want = np.zeros_like(u)
    for j in (1, 2, 3):
        want[j] = np.cos(u[j]) * x[ids[j]]
    np.testing.assert_allclose(g, want, rtol=1e-12)
    direction = r.standard_normal(u.shape)
    ref = lambda u: (np.sin(_numpy_set(x, (ids,), u)) * x).sum()  # noqa: E731
    fd = (ref(u + 1e-6 * direction) - ref(u - 1e-6 * direction)) / 2e-6
    np.testing.assert_allclose((g * direction).sum(), fd, rtol=1e-6)
    distinct = sf.jit(lambda a, w: a.at[np.array([3, 0, 5])].set(w), mesh=mesh2).lower(x, u[:3])
    assert "Argsort" not in str(distinct) and "Argsort" in str(sf.jit(lambda a, w, i: a.at[i].set(w), mesh=mesh2).lower(
        x, u[:3], ids[:3]))
    # (a review: NumPy ids that alone make the positions distinct need no sort beside traced ones, nor on sf.Arrays)
    cols = sf.jit(lambda a, w, j: a.at[np.array([1, 4]), j].set(w), mesh=mesh2).lower(x, u[:2, 0], ids[:2] % 3)
    assert "Argsort" not in str(cols)
    from shardfuse import array_ops
    placed = sf.replicate(x, mesh=mesh2)
    placed.at[np.array([5, 0, 2])].set(u[:3])
    assert "Argsort" not in str(sf.Plan(array_ops.cached_programs(mesh2)[-1]))
