"""Max and min over a sharded axis: each device's maximum of its shard, then one Allreduce with that
operator (printed `op=max`), never an Allgather; NaN as NumPy's (a NaN on any device gives NaN),
which MPI's and NCCL's float max do not keep: floats cross as order keys (backends/extrema.py).
The case bodies run on NumPy devices here and under mpiexec (tests/mpi/test_gather_mpi.py)."""
from __future__ import annotations

import ml_dtypes  # noqa: F401 (bfloat16)
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends import extrema
from shardfuse.dtypes import order_key_dtype

SHAPE = (6, 8)


def rand(rng, dtype, shape=SHAPE):
    if dtype in ("int32", "int64"):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def check_max(mesh, kind, dtype, axis, keepdims, nans, rng, jit=True):
    """x sharded over the mesh on axis 1 (and axis 0 over a second mesh axis), reduced with `kind`."""
    x = rand(rng, dtype)
    for r, c in nans:
        x[r, c] = np.nan
    spec = (mesh.axis_names[0], mesh.axis_names[1]) if len(mesh.axis_names) == 2 else (None, mesh.axis_names[0])
    a = sf.distribute(x, mesh, spec)
    fn = (lambda v: getattr(v, kind)(axis, keepdims=keepdims))
    got = sf.jit(fn, mesh=mesh)(a) if jit else fn(a)
    want = getattr(x.astype(np.float64) if dtype not in ("int32", "int64") else x, kind)(axis, keepdims=keepdims)
    assert got.dtype == np.dtype(x.dtype).name, (got.dtype, x.dtype)
    np.testing.assert_array_equal(np.asarray(got.gather()).astype(want.dtype), want)
    return got


def plan_of(mesh, kind, axis, dtype="float32"):
    return sf.jit(lambda v: getattr(sf.shard(v, axis=1), kind)(axis), mesh=mesh).lower(sf.TensorSpec(SHAPE, dtype))


@pytest.mark.parametrize("kind", ["max", "min"])
def test_plan_is_one_allreduce_with_the_operator(kind):
    plan = plan_of(sf.DeviceMesh(4), kind, 1)
    assert plan.collectives() == {"allreduce": 1}, plan
    text = str(plan)
    assert f"Allreduce m_keys <- m_partial_keys, team=DIDx, op={kind}" in text, text
    assert f"partial({kind}: DIDx)" in text and "OrderKeys" in text and "FromOrderKeys" in text, text
    ints = plan_of(sf.DeviceMesh(4), kind, 1, "int32")  # integers need no keys
    assert f"op={kind}" in str(ints) and "OrderKeys" not in str(ints), ints


def test_an_unsharded_axis_is_local():
    plan = sf.jit(lambda v: sf.shard(v, axis=0).max(1), mesh=sf.DeviceMesh(2)).lower(sf.TensorSpec(SHAPE, "float32"))
    assert plan.collectives() == {}, plan


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64"])
@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("axis,keepdims", [(1, False), (-1, True), (None, False), ((0, 1), True), (0, False)])
def test_values_as_numpy(dtype, kind, axis, keepdims):
    check_max(sf.DeviceMesh(4), kind, dtype, axis, keepdims, (), np.random.default_rng(1))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("nans", [((0, 0),), ((3, 7),), ((2, 1), (2, 6)), ((5, 3),)], ids=str)
def test_nan_on_any_device_gives_nan(dtype, kind, nans, jit):
    got = check_max(sf.DeviceMesh(4), kind, dtype, 1, False, nans, np.random.default_rng(2), jit)
    assert np.isnan(np.asarray(got.gather(), np.float64)[[r for r, _ in nans]]).all()


def test_infinities_and_signed_zeros_order():
    x = np.array([[-np.inf, -0.0, 0.0, np.inf], [-1e-30, -0.0, -np.inf, -5.0]], np.float32)
    a = sf.shard(x, axis=1, mesh=sf.DeviceMesh(4))
    f = sf.jit(lambda v: (v.max(1), v.min(1)), mesh=a.mesh)
    hi, lo = f(a)
    np.testing.assert_array_equal(hi.gather(), x.max(1))
    np.testing.assert_array_equal(lo.gather(), x.min(1))


def test_on_a_2d_mesh_both_axes_sharded():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    for kind in ("max", "min"):
        got = check_max(mesh, kind, "float32", None, False, ((4, 5),), np.random.default_rng(3))
        assert np.isnan(got.gather())
        check_max(mesh, kind, "float64", 1, True, (), np.random.default_rng(4))
    plan = sf.jit(lambda v: sf.shard(sf.shard(v, 0, over="dp"), 1, over="tp").max(), mesh=mesh).lower(
        sf.TensorSpec(SHAPE, "float32"))
    assert plan.collectives() == {"allreduce": 2}, plan  # one per mesh axis, never an Allgather


def test_order_keys_round_trip_and_order():
    """The keys themselves: integer order is float order; NaN the largest (max) or smallest (min)."""
    x = np.array([np.nan, -np.inf, -2.5, -0.0, 0.0, 1e-40, 3.0, np.inf], np.float64)
    for dt in ("float16", "bfloat16", "float32", "float64"):
        v = x.astype(dt)
        for op in ("max", "min"):
            k = np.empty(v.shape, order_key_dtype(dt))
            extrema.to_keys(np, v, op, k)
            back = np.empty_like(v)
            extrema.from_keys(np, k, op, back)
            np.testing.assert_array_equal(back.astype(np.float64), v.astype(np.float64))
            assert (k[0] > k[1:]).all() if op == "max" else (k[0] < k[1:]).all()
            assert (np.diff(k[1:]) >= 0).all()


def _random_case(r):
    """A random 3-D value on a 1-D, 2-D or 3-D mesh, a random placement, axes and operator."""
    mesh = [sf.DeviceMesh(4), sf.DeviceMesh((2, 2), ("dp", "tp")), sf.DeviceMesh((2, 1, 2), ("a", "b", "c"))][r.integers(3)]
    shape = (4, 8, 4)
    entries = [None] * 3
    for name in mesh.axis_names:  # each mesh axis shards at most one tensor axis, or none
        j = r.integers(4)
        if j < 3:
            entries[j] = name if entries[j] is None else (entries[j], name) if isinstance(entries[j], str) \
                else entries[j] + (name,)
    axis = [None, int(r.integers(-3, 3)), tuple(sorted(set(int(a) for a in r.integers(0, 3, 2))))][r.integers(3)]
    return mesh, shape, tuple(entries), axis, bool(r.integers(2)), ["max", "min"][r.integers(2)]


@pytest.mark.parametrize("seed", range(60))
def test_random_placements_axes_and_operators(seed):
    """Random placements (several mesh axes on one tensor axis too), axes, keepdims and NaNs: the
    values NumPy gives in float64, and no Allgather where nothing else asks for one."""
    r = np.random.default_rng(1000 + seed)
    mesh, shape, spec, axis, keepdims, kind = _random_case(r)
    x = rand(r, "float32", shape)
    if r.integers(2):
        x[tuple(int(r.integers(n)) for n in shape)] = np.nan
    f = sf.jit(lambda v: getattr(v, kind)(axis, keepdims=keepdims), mesh=mesh)
    a = sf.distribute(x, mesh, spec)
    want = getattr(x.astype(np.float64), kind)(axis, keepdims=keepdims)
    np.testing.assert_array_equal(np.asarray(f(a).gather(), np.float64), want)
    assert "allgather" not in f.lower(a).collectives(), (spec, axis, str(f.lower(a)))


def tie_share(x, kind, axis, keepdims):
    """JAX's gradient of sum(w * x.max(axis)): each tie of an extremum gets w / (its count of ties)."""
    m = getattr(x, kind)(axis, keepdims=True)
    tie = (x == m).astype(np.float64)
    return tie / tie.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("seed", range(12))
def test_ties_over_several_axes_share_the_gradient_equally(seed):
    """The max of [[1, 0], [1, 1]] had the gradient [[0.5, 0], [0.25, 0.25]] (each axis' reduction
    shared its ties in turn, a probe); JAX gives each tie a third.  Random placements, several axes
    with many ties, max and min, keepdims, eager and jit; the value stays the reductions' bit for bit."""
    r = np.random.default_rng(2000 + seed)
    mesh, shape, spec, _, keepdims, kind = _random_case(r)
    axis = [None, tuple(sorted({int(a) for a in r.integers(0, len(shape) - 1, 2)} | {len(shape) - 1}))][r.integers(2)]
    x = r.integers(-2, 2, shape).astype(np.float64)  # (few values: ties everywhere)
    w = r.standard_normal(np.max(x, axis=axis, keepdims=keepdims).shape) + 1.5

    def loss(v):
        return (getattr(v, kind)(axis, keepdims=keepdims) * w).sum()

    a = sf.distribute(x, mesh, spec)
    want = tie_share(x, kind, axis, keepdims) * (w if keepdims else np.expand_dims(w, axis if axis is not None
                                                                                  else tuple(range(x.ndim))))
    for run in (sf.value_and_grad(loss), sf.jit(sf.value_and_grad(loss), mesh=mesh)):
        value, g = run(a)
        np.testing.assert_allclose(np.asarray(g.gather()), want, rtol=1e-12, atol=1e-15)
        assert float(value) == (getattr(x, kind)(axis, keepdims=keepdims) * w).sum()


def test_ties_keep_the_value_bit_for_bit():
    """The value is the reductions' bit for bit (-0.0, infinities, NaN) and the gradient JAX's there too."""
    mesh = sf.DeviceMesh(2)
    for x, kind in [(np.array([[-0.0, -1.0], [-2.0, -3.0]]), "max"), (np.array([[np.inf, 1.0], [np.inf, 2.0]]), "max"),
                    (np.array([[np.nan, 1.0], [0.0, 2.0]]), "min"), (np.array([[0.0, 1.0], [0.0, 2.0]]), "min")]:
        value, g = sf.jit(sf.value_and_grad(lambda v: getattr(v, kind)()), mesh=mesh)(sf.distribute(x, mesh, ("DIDx", None)))
        want = getattr(x, kind)()
        assert np.asarray(value).tobytes() == np.float64(want).tobytes(), (x, value)
        if np.isnan(want):  # (no tie: NaN, as JAX's)
            assert np.isnan(np.asarray(g.gather())).all()
        else:  # (an infinite extremum's ties too: a review found them 0)
            np.testing.assert_array_equal(np.asarray(g.gather()), tie_share(x, kind, None, True))
