"""sf.dynamic_update_slice, sf.dynamic_slice and x.at[idx].set / .add / .get (shardfuse/update_slice.py):
a serving KV cache [batch, heads, max_len, head_dim] written at a traced step t.

Values against NumPy in float64 on fresh random inputs (buffers poisoned: conftest), inside jit and
eager, on a 1-D tp mesh and a dp x tp mesh (batch over dp, heads over tp), t at the start, the middle,
the end and out of range (negative from the end, then clamped, as jax.lax's); int32 and int64 starts;
float32 / bfloat16 / float16 data (a copy: exact).  The plans: no communication where the cut axis is
unsharded, the operand copied then the box written, and with donation one step that writes the update
into the donated buffer, whose addresses stay the same call after call (a decode loop); the gradients
against central differences.  tests/mpi/test_update_slice_mpi.py runs the bodies under mpiexec,
tests/test_gpu_update_slice.py on a GPU.

The donated decode plan (heads over tp), as printed:

    plan step(cache: f64[2, 4:tp, 6, 3], k: f64[2, 4:tp, 1, 3], t: i64[]) -> (cache: f64[2, 4:tp, 6, 3])
      # mesh tp=2, streams=4
      DynamicUpdateSlice cache <- k, t, starts=(0, 0, None, 0)
      return cache
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op
from shardfuse.steps import plan_steps

B, NH, M, HD = 2, 4, 6, 3
# mesh shape, axis names, the cache's spec (one entry per tensor axis)
LAYOUTS = {"tp2": ((2,), ("tp",), (None, "tp", None, None)),
           "dp2xtp2": ((2, 2), ("dp", "tp"), ("dp", "tp", None, None))}
STARTS = [0, 3, M - 1, M + 5, -1, -M - 3]  # first, middle, last, past the end, from the end, before the start
_MESHES: dict = {}


def mesh_of(layout, backend="numpy"):
    """One mesh per layout and backend (None: the default one, MPI's under mpiexec)."""
    if (layout, backend) not in _MESHES:
        shape, names, _ = LAYOUTS[layout]
        _MESHES[layout, backend] = sf.DeviceMesh(shape, names, **({"backend": backend} if backend else {}))
    return _MESHES[layout, backend]


def ref_update(x, u, starts):
    """jax.lax.dynamic_update_slice in NumPy: a negative start from the end, then clamped to fit."""
    s = [min(max(k + n if k < 0 else k, 0), n - b) for k, n, b in zip(starts, x.shape, u.shape)]
    y = x.copy()
    y[tuple(slice(a, a + b) for a, b in zip(s, u.shape))] = u
    return y


def ref_slice(x, starts, sizes):
    s = [min(max(k + n if k < 0 else k, 0), n - b) for k, n, b in zip(starts, x.shape, sizes)]
    return x[tuple(slice(a, a + b) for a, b in zip(s, sizes))]


def data(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np_dtype(dtype))


def exact(got, want):
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64))


def check_update(layout, dtype, idx_dtype, t, jit, rng, backend="numpy"):
    """cache[:, :, t] = k (k [B, NH, 1, HD]) as dynamic_update_slice; the result keeps the cache's layout."""
    mesh, spec = mesh_of(layout, backend), LAYOUTS[layout][2]
    c, k = data(rng, (B, NH, M, HD), dtype), data(rng, (B, NH, 1, HD), dtype)
    cd, kd, tt = sf.distribute(c, mesh, spec), sf.distribute(k, mesh, spec), np.asarray(t, idx_dtype)
    if jit:
        f = sf.jit(lambda c, k, t: sf.dynamic_update_slice(c, k, (0, 0, t, 0)), mesh=mesh)
        assert f.lower(cd, kd, tt).collectives() == {}  # (each device writes its own piece)
        out = f(cd, kd, tt)
    else:
        out = sf.dynamic_update_slice(cd, kd, (0, 0, tt, 0))
    assert out.sharding.axes == spec and out.dtype == np_dtype(dtype)
    exact(out, ref_update(c, k, (0, 0, t, 0)))


def check_slice_and_at(layout, dtype, t, jit, rng, backend="numpy"):
    """dynamic_slice of two positions, and x.at[:, :, t].set / .add / .get (k [B, NH, HD], t's axis dropped)."""
    mesh, spec = mesh_of(layout, backend), LAYOUTS[layout][2]
    c, k = data(rng, (B, NH, M, HD), dtype), data(rng, (B, NH, HD), dtype)
    cd, kd, tt = sf.distribute(c, mesh, spec), sf.distribute(k, mesh, spec[:2] + (None,)), np.asarray(t)

    def fn(c, k, t):
        return (sf.dynamic_slice(c, (0, 0, t, 0), (B, NH, 2, HD)), c.at[:, :, t].set(k), c.at[:, :, t].add(k),
                c.at[:, :, t].get(), c.at[1, :, t].set(2.0))
    got = sf.jit(fn, mesh=mesh)(cd, kd, tt) if jit else fn(cd, kd, tt)
    w = min(max(t + M if t < 0 else t, 0), M - 1)  # (.get clamps, as JAX's)
    put, added, two = c.copy(), c.copy(), c.copy()
    if -M <= t < M:  # (JAX's .set / .add drop an update out of range: c unchanged)
        put[:, :, t] = k
        added[:, :, t] = (c[:, :, t].astype(np.float64) + k).astype(c.dtype)
        two[1, :, t] = 2.0
    for g, want in zip(got, (ref_slice(c, (0, 0, t, 0), (B, NH, 2, HD)), put, added, c[:, :, w], two)):
        exact(g, want)


def check_strided(layout, dtype, t, rng, backend="numpy"):
    """Strided operands: the update a slice of a fused QKV projection (a view, the last axis strided), the
    slice read from a transposed cache (a view with the cut axis last)."""
    mesh, spec = mesh_of(layout, backend), LAYOUTS[layout][2]
    c, y = data(rng, (B, NH, M, HD), dtype), data(rng, (B, NH, 1, 3 * HD), dtype)

    def fn(c, y, t):
        _, k, _ = sf.split(y, 3, axis=-1)
        c = sf.dynamic_update_slice(c, k, (0, 0, t, 0))
        return c, sf.dynamic_slice(c.transpose(0, 1, 3, 2), (0, 0, 0, t - 1), (B, NH, HD, 2))
    new, got = sf.jit(fn, mesh=mesh)(sf.distribute(c, mesh, spec), sf.distribute(y, mesh, spec), t)
    want = ref_update(c, y[..., HD:2 * HD], (0, 0, t, 0))
    exact(new, want)
    exact(got, ref_slice(want.transpose(0, 1, 3, 2), (0, 0, 0, t - 1), (B, NH, HD, 2)))


def decode(mesh, donate=True):
    """A decode step: write k at t, then read the cache (an attention-like contraction with q)."""
    def step(cache, k, q, t):
        cache = sf.dynamic_update_slice(cache, k, (0, 0, t, 0))
        return cache, (cache * q).sum(-1)
    return sf.jit(step, mesh=mesh, donate_argnums=0 if donate else ())


def addresses(a):
    return [s.__array_interface__["data"][0] if isinstance(s, np.ndarray) else s.data.ptr for s in a.shards]


def check_decode_loop(layout, rng, steps=5, backend="numpy", dtype="float64"):
    """Several donated steps against NumPy; from the second call on the cache stays in the same buffers
    (the first copies the caller's array, as any donated plain argument)."""
    mesh, spec = mesh_of(layout, backend), LAYOUTS[layout][2]
    c = np.zeros((B, NH, M, HD), np_dtype(dtype))
    f, cache, seen = decode(mesh), sf.distribute(c, mesh, spec), []
    for t in range(steps):
        k, q = data(rng, (B, NH, 1, HD), dtype), data(rng, (B, NH, 1, HD), dtype)
        cache, s = f(cache, sf.distribute(k, mesh, spec), sf.distribute(q, mesh, spec), 2 + t)
        c = ref_update(c, k, (0, 0, 2 + t, 0))
        exact(cache, c)
        np.testing.assert_allclose(np.asarray(s).astype(np.float64), (c.astype(np.float64) * q).sum(-1),
                                   rtol=1e-12 if dtype == "float64" else 2e-2, atol=0 if dtype == "float64" else 2e-2)
        seen.append(addresses(cache))
    assert all(a == seen[1] for a in seen[1:]), seen


def loss_of(w):
    def loss(c, k, t):
        y = sf.dynamic_update_slice(c, k * k, (0, 0, t, 0))
        z = sf.dynamic_slice(y, (0, 0, t - 1, 0), (B, NH, 2, HD))
        return (y * w).sum() + (z * z).sum() + (y.at[:, :, t + 1].get() ** 3).sum()
    return loss


def check_grad(layout, rng, t=3, backend="numpy"):
    """sf.grad through dynamic_update_slice, dynamic_slice and .at[].get against central differences."""
    mesh, spec = mesh_of(layout, backend), LAYOUTS[layout][2]
    c, k, w = (rng.standard_normal(s) for s in ((B, NH, M, HD), (B, NH, 1, HD), (B, NH, M, HD)))
    gc, gk = sf.jit(sf.grad(loss_of(w), argnums=(0, 1)), mesh=mesh)(sf.distribute(c, mesh, spec),
                                                                     sf.distribute(k, mesh, spec), t)

    def ref(c, k):
        y = ref_update(c, k * k, (0, 0, t, 0))
        return (y * w).sum() + (y[:, :, t - 1:t + 1] ** 2).sum() + (y[:, :, t + 1] ** 3).sum()
    for x, g, f in ((c, gc, lambda d: ref(c + d, k)), (k, gk, lambda d: ref(c, k + d))):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            d = np.zeros_like(x)
            d[idx] = 1e-6
            num[idx] = (f(d) - f(-d)) / 2e-6
        np.testing.assert_allclose(np.asarray(g), num, rtol=1e-6, atol=1e-6)


# ---- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("t", STARTS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_update(layout, t, idx_dtype, jit):
    check_update(layout, "float64", idx_dtype, t, jit, np.random.default_rng(t + 10))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_update_dtypes(layout, dtype):
    check_update(layout, dtype, "int32", 3, True, np.random.default_rng(1))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("t", [0, 3, M - 1, M, M + 2, -2, -M, -M - 1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_slice_and_at(layout, t, jit):
    check_slice_and_at(layout, "float64", t, jit, np.random.default_rng(2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_slice_and_at_dtypes(dtype):
    check_slice_and_at("dp2xtp2", dtype, 4, True, np.random.default_rng(3))


@pytest.mark.parametrize("t", [0, 3, M + 1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_strided_operands(layout, t):
    check_strided(layout, "float32", t, np.random.default_rng(t))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decode_loop_donated(layout):
    check_decode_loop(layout, np.random.default_rng(4))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grad(layout):
    check_grad(layout, np.random.default_rng(5))


def test_static_starts_and_whole_axes():
    """Python int starts (clamped when traced), an update covering whole axes, a 1-D array of starts."""
    mesh, rng = mesh_of("tp2"), np.random.default_rng(6)
    x, u = rng.standard_normal((5, 4, 6)), rng.standard_normal((2, 4, 3))
    f = sf.jit(lambda x, u, s: (sf.dynamic_update_slice(x, u, (4, 9, -2)), sf.dynamic_update_slice(x, u, s),
                                sf.dynamic_slice(x, (1, 0, -1), (3, 4, 2))), mesh=mesh)
    a, b, c = f(sf.shard(x, axis=1, mesh=mesh), u, np.array([-1, 0, 2], np.int32))
    exact(a, ref_update(x, u, (4, 9, -2)))
    exact(b, ref_update(x, u, (-1, 0, 2)))
    exact(c, ref_slice(x, (1, 0, -1), (3, 4, 2)))
    assert a.sharding.axes == (None, "tp", None)  # (axis 1 covered whole: it keeps its sharding)


# ---- plans -------------------------------------------------------------------------------

def cache_writes(plan, shape):
    """The steps that write a buffer of the cache's shape, as (op, text)."""
    return [(s.op, s.text) for s in plan_steps(plan.program) if s.instr.into is not None
            and s.instr.into.type.shape == shape]


def step(cache, k, t):
    return sf.dynamic_update_slice(cache, k, (0, 0, t, 0))


def test_donated_plan_writes_only_the_update():
    mesh, spec = mesh_of("tp2"), LAYOUTS["tp2"][2]
    args = (sf.distribute(np.zeros((B, NH, M, HD)), mesh, spec), sf.distribute(np.zeros((B, NH, 1, HD)), mesh, spec), 3)
    plan = sf.jit(step, mesh=mesh, donate_argnums=0).lower(*args)
    assert str(plan).splitlines() == [
        "plan step(cache: f64[2, 4:tp, 6, 3], k: f64[2, 4:tp, 1, 3], t: i64[]) -> (cache: f64[2, 4:tp, 6, 3])",
        "  # mesh tp=2, streams=4",
        "  DynamicUpdateSlice cache <- k, t, starts=(0, 0, None, 0)",
        "  return cache"]
    assert cache_writes(plan, (B, NH, M, HD)) == [(Op.DYNAMIC_UPDATE_SLICE,
                                                   "DynamicUpdateSlice cache <- k, t, starts=(0, 0, None, 0)")]
    # without donation: one copy of the cache, then the small write (XLA's)
    plain = sf.jit(step, mesh=mesh).lower(*args)
    assert str(plain).splitlines()[2:] == [
        "  cache_1 = Allocate f64[2, 4:tp, 6, 3]  (per call)",
        "  Copy cache_1 <- cache",
        "  DynamicUpdateSlice cache_1 <- k, t, starts=(0, 0, None, 0)",
        "  return cache_1"]
    # the cost model charges the update's bytes, not the cache's
    assert plan.predict().total_s < plain.predict().total_s


def test_decode_plan_has_no_whole_cache_elementwise_step():
    """The decode step of a model (the write, then a read of the cache): only the update step and the
    reading contraction touch the cache."""
    mesh = mesh_of("dp2xtp2")
    spec = LAYOUTS["dp2xtp2"][2]
    args = [sf.distribute(np.zeros(s), mesh, spec) for s in ((B, NH, M, HD), (B, NH, 1, HD), (B, NH, 1, HD))]
    plan = decode(mesh).lower(*args, 3)
    assert cache_writes(plan, (B, NH, M, HD)) == [(Op.DYNAMIC_UPDATE_SLICE,
                                                   "DynamicUpdateSlice cache <- k, t, starts=(0, 0, None, 0)")]
    assert plan.collectives() == {}
    assert not [s for s in plan_steps(plan.program) if s.op == Op.COPY]


def test_donation_refused_where_the_old_value_is_read_after():
    """The old cache read after the update: the result keeps a buffer of its own (and the values are right)."""
    mesh, rng = mesh_of("tp2"), np.random.default_rng(7)
    c, k = rng.standard_normal((B, NH, M, HD)), rng.standard_normal((B, NH, 1, HD))
    f = sf.jit(lambda c, k, t: (sf.dynamic_update_slice(c, k, (0, 0, t, 0)), c * 2.0), mesh=mesh, donate_argnums=0)
    new, old = f(sf.distribute(c, mesh, LAYOUTS["tp2"][2]), k, 1)
    exact(new, ref_update(c, k, (0, 0, 1, 0)))
    exact(old, c * 2.0)


def test_sharded_cut_axis_is_gathered_for_a_wider_box():
    """The sequence axis sharded: a box two positions wide gathers it first (an Allgather the plan prints),
    then writes; one position wide is a where over each device's own positions (no communication)."""
    mesh, rng = mesh_of("tp2"), np.random.default_rng(8)
    c, k = rng.standard_normal((B, NH, M, HD)), rng.standard_normal((B, NH, 2, HD))
    f = sf.jit(lambda c, k, t: sf.dynamic_update_slice(c, k, (0, 0, t, 0)), mesh=mesh)
    cs = sf.distribute(c, mesh, (None, None, "tp", None))
    assert f.lower(cs, k, 3).collectives() == {"allgather": 1}
    exact(f(cs, k, 3), ref_update(c, k, (0, 0, 3, 0)))
    assert f.lower(cs, k[:, :, :1], 3).collectives() == {}
    exact(f(cs, k[:, :, :1], 3), ref_update(c, k[:, :, :1], (0, 0, 3, 0)))


# ---- errors --------------------------------------------------------------------------------

def test_errors_say_what_to_write():
    mesh = mesh_of("tp2")
    x = np.zeros((4, 6))

    def fails(fn, *args, match):
        with pytest.raises((TypeError, ValueError, IndexError), match=match):
            sf.jit(fn, mesh=mesh)(*args)
    fails(lambda x, u: sf.dynamic_update_slice(x, u, (0, 0)), x, np.zeros(6), match="rank")
    fails(lambda x, t: sf.dynamic_update_slice(x, x[:1], (t, 0)), x, 1.5, match="0-d int32 / int64")
    fails(lambda x: sf.dynamic_update_slice(x, x[:1], (0,)), x, match="one per axis")
    fails(lambda x, t: sf.dynamic_slice(x, (t, 0), (5, 6)), x, 1, match="between 0 and 4")
    fails(lambda x: x.at[::2].set(1.0), x, match="step 2")
    fails(lambda x: x.at[::2].get(), x, match=r"step 2.*x\[::k\] reads a strided slice")
    fails(lambda x: x.at[None, 1, 0].set(1.0), x, match="got None on axis 0")  # (said "too many indices", a probe)
    fails(lambda x: x.at[np.array([0, 1]), 1:3].set(1.0), x, match="ints, 0-d int values, slices")  # (arrays with a slice)

    def assign(x, t):
        x[t] = 1.0
        return x
    fails(assign, x, 1, match=r"x.at\[idx\].set\(value\).*donate")
    with pytest.raises(TypeError, match="sf.dynamic_update_slice"):
        sf.shard(x, axis=0, mesh=mesh)[1] = 0.0
    with pytest.raises(TypeError, match="sf.Arrays"):
        sf.dynamic_update_slice(x, x[:1], (0, 0))
    fails(lambda c, t: sf.stream(sf.dynamic_update_slice(c, c[:, :1], (0, t)), axis=0, chunks=2), x, 1,
          match="stream the values it reads")


def test_eager_starts_share_one_plan():
    """Outside jit a Python int start is an operand of the one-op plan: every t runs the same plan."""
    from shardfuse import array_ops

    mesh, rng = mesh_of("tp2"), np.random.default_rng(9)
    x, k = rng.standard_normal((4, 6, 3)), rng.standard_normal((4, 1, 3))
    xs = sf.shard(x, axis=0, mesh=mesh)
    sf.dynamic_update_slice(xs, k, (0, 0, 0))
    compiled = array_ops.cache_info()["compiled"]
    for t in range(1, 5):
        exact(sf.dynamic_update_slice(xs, k, (0, t, 0)), ref_update(x, k, (0, t, 0)))
    assert array_ops.cache_info()["compiled"] == compiled


def test_at_add_casts_the_update_to_the_arrays_dtype_first():
    # JAX's .at[].add: int32 -3 plus 0.5 stays -3 (0.5 cast to int32 first), not trunc(-2.5) = -2
    mesh = sf.DeviceMesh(2, backend="numpy")
    a = np.array([[-3, 4], [5, -6]], np.int32)
    got = np.asarray(sf.jit(lambda a: a.at[0, 0].add(0.5), mesh=mesh)(a))
    assert got.dtype == np.int32 and got.tolist() == [[-3, 4], [5, -6]]
    got = np.asarray(sf.jit(lambda a: a.at[1, 1].add(2), mesh=mesh)(a))
    assert got.tolist() == [[-3, 4], [5, -4]]


def test_at_set_and_add_drop_an_update_out_of_range_as_jax():
    """JAX's .at: .set / .add at a Python int or a traced index outside [-n, n) leave x as it was
    (the update dropped); inside it a negative index counts from the end; .get clamps."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    a = np.random.default_rng(5).standard_normal((4, 3))
    for i in (4, 9, -5):
        exact(sf.jit(lambda a: a.at[i].set(7.0), mesh=mesh)(a), a)
        exact(sf.jit(lambda a: a.at[1, i].add(7.0), mesh=mesh)(a), a)
        exact(sf.jit(lambda a, t: a.at[t, 1].set(7.0), mesh=mesh)(a, np.int32(i)), a)
        exact(sf.distribute(a, mesh, ("DIDx", None)).at[i].add(1.0), a)
    want = a.copy()
    want[-4] = 7.0
    exact(sf.jit(lambda a, t: a.at[t].set(7.0), mesh=mesh)(a, np.int64(-4)), want)
    exact(sf.jit(lambda a, t: a.at[t].get(), mesh=mesh)(a, np.int32(9)), a[3])
    grad = sf.jit(sf.grad(lambda a, t: (a.at[t].set(a[0] * 2.0) ** 2).sum()), mesh=mesh)
    exact(grad(a, np.int32(6)), 2 * a)  # (dropped: a's cotangent is 2a, nothing from the update)


def test_an_update_out_of_range_is_still_checked_against_the_boxes_shape():
    mesh = sf.DeviceMesh(2, backend="numpy")
    for i in (1, 10):  # (JAX checks the update's shape whether or not the index is in range)
        with pytest.raises(ValueError, match="cannot be broadcast"):
            sf.jit(lambda a: a.at[i].set(np.ones(5)), mesh=mesh)(np.zeros((4, 3)))


def test_at_an_array_of_ids_adds_and_gets_as_jax():
    """x.at[ids].add(v) with an integer array (a probe's segment sum: it raised a dynamic_slice error):
    repeated ids accumulate, an id outside [-n, n) adds nothing (JAX's drop), a NumPy id array and a
    scalar v too; .get() takes the rows; gradients of v and x; .set refuses with what to write."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    x, v, w = r.standard_normal((5, 3)), r.standard_normal((5, 3)), r.standard_normal((5, 3))
    ids = np.array([0, 0, 2, -1, 7], np.int32)
    want = x.copy()
    for k, i in enumerate(ids):
        if -5 <= i < 5:
            want[i] += v[k]
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x, i, v: x.at[i].add(v), mesh=mesh)(x, ids, v)), want, rtol=1e-14)
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x: x.at[np.array([1, 1])].add(1.0), mesh=mesh)(x)),
                               x + np.array([[0], [2], [0], [0], [0]]), rtol=1e-14)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda x, i: x.at[i].get(), mesh=mesh)(x, ids[:4])), x[ids[:4]])
    dx, dv = sf.jit(sf.grad(lambda x, v: (w * x.at[ids].add(v)).sum(), argnums=(0, 1)), mesh=mesh)(x, v)
    np.testing.assert_allclose(np.asarray(dx), w, rtol=1e-14)
    inside = ((ids >= -5) & (ids < 5))[:, None]
    np.testing.assert_allclose(np.asarray(dv), np.where(inside, w[np.clip(ids, -5, 4)], 0.0), rtol=1e-14)
    distinct = np.array([3, -1, 0, 7])  # (at[ids].set: shardfuse/at_arrays.py, JAX's drop of the id outside)
    want = x.copy()
    want[[3, -1, 0]] = 0.0
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda x, i: x.at[i].set(0.0), mesh=mesh)(x, distinct)), want)


def test_an_update_of_another_dtype_and_an_array_index_on_a_later_axis_say_what_to_write():
    """A serving probe's: a float64 update into a bfloat16 cache was cast silently (JAX's
    dynamic_update_slice refuses it; .at[].set casts, as JAX's); cache.at[:, positions] named
    sf.dynamic_slice, which the user never called."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    cache = np.zeros((4, 6), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"differ in dtype.*astype\('bfloat16'\).*at\[\.\.\.\]\.set"):
        sf.jit(lambda c: sf.dynamic_update_slice(c, np.ones((4, 1)), (0, 2)), mesh=mesh)(cache)
    got = sf.jit(lambda c: c.at[:, 2:3].set(np.ones((4, 1))), mesh=mesh)(cache)
    assert np.asarray(got).dtype == ml_dtypes.bfloat16 and np.asarray(got)[:, 2].tolist() == [1.0] * 4
    got = sf.jit(lambda c, p: c.at[:, p].set(1.0), mesh=mesh)(cache, np.array([1, 4]))  # (shardfuse/at_arrays.py)
    assert np.asarray(got)[:, [1, 4]].tolist() == [[1.0, 1.0]] * 4 and not np.asarray(got)[:, [0, 2, 3, 5]].any()


@pytest.mark.parametrize("name, op", [("multiply", np.multiply), ("divide", np.divide), ("power", np.power),
                                      ("min", np.minimum), ("max", np.maximum)])
def test_jaxs_other_at_methods(name, op):
    """x.at[idx].multiply / divide / power / min / max / apply (JAX's), at a traced position, at distinct index
    arrays, on sf.Arrays; an int array keeps its dtype; ids that may repeat are refused (JAX applies op per id)."""
    mesh, r = sf.DeviceMesh(2, backend="numpy"), np.random.default_rng()
    x, v = r.random((2, 4)) + 0.5, 1.5
    want = x.copy()
    want[:, 1] = op(want[:, 1], v)
    got = sf.jit(lambda x, t: getattr(sf.shard(x, axis=1).at[:, t], name)(v), mesh=mesh)(x, np.int32(1))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-15)
    rows, cols = np.array([0, 1]), np.array([3, 0])
    want = x.copy()
    want[rows, cols] = op(want[rows, cols], v)
    np.testing.assert_allclose(np.asarray(getattr(sf.replicate(x, mesh=mesh).at[rows, cols], name)(v)), want, rtol=1e-15)
    with pytest.raises(TypeError, match=rf"x.at\[ids\].{name}: ids that may repeat"):
        sf.jit(lambda x, i: getattr(x.at[i], name)(v), mesh=mesh)(x, np.array([0, 0]))
    if name == "divide":  # (a review: an int32 quotient was truncated; JAX's is float, NumPy's /= raises)
        with pytest.raises(TypeError, match=r"x.at\[...\].divide of an int32 array: cast x to a float dtype first"):
            sf.jit(lambda a: a.at[0].divide(2), mesh=mesh)(np.arange(4, dtype=np.int32))
    if name == "multiply":
        ints = sf.jit(lambda a: a.at[2:4].multiply(3), mesh=mesh)(np.arange(8, dtype=np.int32))
        assert np.asarray(ints).dtype == np.int32 and np.asarray(ints).tolist() == [0, 1, 6, 9, 4, 5, 6, 7]
        applied = sf.jit(lambda x: x.at[1].apply(np.sin), mesh=mesh)(x)
        np.testing.assert_allclose(np.asarray(applied), np.vstack([x[0], np.sin(x[1])]), rtol=1e-15)


# ---- a cache sharded over its sequence axis (context parallel): .at[:, :, t].set / .add without a gather ----
SEQ_LAYOUTS = {"seq over tp2": ((2,), ("tp",), (None, None, "tp", None)),
               "dp2 x seq over tp2": ((2, 2), ("dp", "tp"), ("dp", None, "tp", None))}
SEQ_M = 8  # (a sequence axis divisible by the devices that shard it)


def check_sequence_sharded_writes(layout, dtype, rng, backend="numpy"):
    """x.at[:, :, t].set(k) / .add(k) with t traced on the sharded sequence axis: NumPy's values at every t
    (negative, past the end: dropped), the cache's sharding kept, no collective, and with the cache donated
    one elementwise step over it that writes the cache's own buffers, call after call (the box form gathered
    the axis on every device and returned it replicated); so for a static t, and sf.dynamic_update_slice
    of a box one position wide (its start clamped, as jax.lax's)."""
    shape, names, spec = SEQ_LAYOUTS[layout]
    mesh = sf.DeviceMesh(shape, names, **({"backend": backend} if backend else {}))
    c = data(rng, (B, NH, SEQ_M, HD), dtype)
    put = sf.jit(lambda cache, k, t: cache.at[:, :, t].set(k), mesh=mesh, donate_argnums=0)
    add = sf.jit(lambda cache, k, t: cache.at[:, :, t].add(k), mesh=mesh)
    cache, seen = sf.distribute(c, mesh, spec), []
    for t in [0, 3, SEQ_M - 1, SEQ_M + 5, -1, -SEQ_M - 3]:
        k = data(rng, (B, NH, HD), dtype)
        want_add = c.copy()
        if -SEQ_M <= t < SEQ_M:
            want_add[:, :, t] = (want_add[:, :, t].astype(np.float64) + k.astype(np.float64)).astype(c.dtype)
        exact(add(cache, k, t), want_add)
        cache = put(cache, k, t)
        if -SEQ_M <= t < SEQ_M:
            c[:, :, t] = k
        exact(cache, c)
        assert cache.sharding.axes == spec, cache.sharding
        seen.append(addresses(cache))
    assert all(a == seen[1] for a in seen[1:]), seen  # (written in place from the second call)
    box = sf.jit(lambda cache, k, t: sf.dynamic_update_slice(cache, k[:, :, None], (0, 0, t, 0)), mesh=mesh)
    for t in [2, SEQ_M + 5, -1, -SEQ_M - 3]:  # (jax.lax's: from the end, then clamped into the axis)
        k = data(rng, (B, NH, HD), dtype)
        want = c.copy()
        want[:, :, min(max(t + SEQ_M if t < 0 else t, 0), SEQ_M - 1)] = k
        exact(box(cache, k, t), want)
        at_static = sf.jit(lambda cache, k: cache.at[:, :, t].set(k), mesh=mesh)
        want = c.copy()
        if -SEQ_M <= t < SEQ_M:
            want[:, :, t] = k
        exact(at_static(cache, k), want)
        assert at_static.lower(cache, k).collectives() == {}
    for f in (put, add, box):
        plan = f.lower(cache, np.zeros((B, NH, HD), np_dtype(dtype)), 2)
        assert plan.collectives() == {}, plan.collectives()
    text = str(put.lower(cache, np.zeros((B, NH, HD), np_dtype(dtype)), 2))
    assert re.search(r"\n  \w+ cache <- ", text), text  # (the last step writes the donated cache)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "int32"])
@pytest.mark.parametrize("layout", sorted(SEQ_LAYOUTS))
def test_sequence_sharded_writes(layout, dtype):
    check_sequence_sharded_writes(layout, dtype, np.random.default_rng())


def test_sequence_sharded_write_gradient():
    """The where form's gradient: the cache's cotangent zero at t, the update's the cotangent's row t."""
    shape, names, spec = SEQ_LAYOUTS["dp2 x seq over tp2"]
    mesh = sf.DeviceMesh(shape, names, backend="numpy")
    r = np.random.default_rng()
    c, k, w = r.standard_normal((B, NH, SEQ_M, HD)), r.standard_normal((B, NH, HD)), r.standard_normal((B, NH, SEQ_M, HD))

    def loss(cache, k, t):
        return (sf.distribute(cache, mesh, spec).at[:, :, t].set(k * 2.0) * w).sum()

    def box_loss(cache, k, t):
        return (sf.dynamic_update_slice(sf.distribute(cache, mesh, spec), k[:, :, None] * 2.0, (0, 0, t, 0)) * w).sum()
    for f in (loss, box_loss):
        gc, gk = sf.jit(sf.grad(f, argnums=(0, 1)), mesh=mesh)(c, k, np.int32(-3))
        want_c = w.copy()
        want_c[:, :, -3] = 0
        np.testing.assert_allclose(np.asarray(gc), want_c, rtol=1e-14)
        np.testing.assert_allclose(np.asarray(gk), 2 * w[:, :, -3], rtol=1e-14)
