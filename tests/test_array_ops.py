"""sf.Array outside jit (issue 16): operators, ufuncs, reductions, len and basic indexing, each a
cached one-op plan (shardfuse/array_ops.py), checked against float64 NumPy on fresh random inputs."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import array_ops
from shardfuse.mesh import gpu_count

pytestmark = pytest.mark.gpu  # part of the GPU run (benchmarks/gpu_first.sh)

MESHES = {"1d": 4, "2x2": (2, 2)}
BACKENDS = ["numpy"] + ["cupy"] * (gpu_count() > 0)  # the same bodies on GPUs, where CuPy sees one
# how x (8, 12) and y (8, 12) are placed, per mesh: a JAX-style spec per tensor axis
PLACES = {"1d": {"R": (), "S0": ("DIDx",), "S1": (None, "DIDx")},
          "2x2": {"R": (), "S0": ("DIDy",), "S01": ("DIDy", "DIDx"), "S10": ("DIDx", "DIDy")}}
CASES = [(be, m, p) for be in BACKENDS for m in MESHES for p in PLACES[m]]

OPS = {  # name -> (op on sf.Arrays x, y, w (12, 5), NumPy reference on a, b, c)
    "x + y": (lambda x, y, w: x + y, lambda a, b, c: a + b),
    "x - y": (lambda x, y, w: x - y, lambda a, b, c: a - b),
    "x * y": (lambda x, y, w: x * y, lambda a, b, c: a * b),
    "x / y": (lambda x, y, w: x / y, lambda a, b, c: a / b),
    "x + 2": (lambda x, y, w: x + 2, lambda a, b, c: a + 2), "2.5 - x": (lambda x, y, w: 2.5 - x, lambda a, b, c: 2.5 - a),
    "3 * x": (lambda x, y, w: 3 * x, lambda a, b, c: 3 * a), "x / 4": (lambda x, y, w: x / 4, lambda a, b, c: a / 4),
    "4 / x": (lambda x, y, w: 4 / x, lambda a, b, c: 4 / a), "x - np.float64(1)": (lambda x, y, w: x - np.float64(1),
                                                                               lambda a, b, c: a - 1),
    "-x": (lambda x, y, w: -x, lambda a, b, c: -a), "abs(x)": (lambda x, y, w: abs(x), lambda a, b, c: np.abs(a)),
    "x @ w": (lambda x, y, w: x @ w, lambda a, b, c: a @ c),
    "np.exp(x)": (lambda x, y, w: np.exp(x), lambda a, b, c: np.exp(a)),
    "np.tanh(x)": (lambda x, y, w: np.tanh(x), lambda a, b, c: np.tanh(a)),
    "np.abs(x)": (lambda x, y, w: np.abs(x), lambda a, b, c: np.abs(a)),
    "np.multiply(x, y)": (lambda x, y, w: np.multiply(x, y), lambda a, b, c: a * b),
    "x.sum(0)": (lambda x, y, w: x.sum(0), lambda a, b, c: a.sum(0)),
    "x.sum(axis=-1)": (lambda x, y, w: x.sum(axis=-1), lambda a, b, c: a.sum(-1)),
    "x.sum()": (lambda x, y, w: x.sum(), lambda a, b, c: a.sum()),
    "x.mean(1)": (lambda x, y, w: x.mean(1), lambda a, b, c: a.mean(1)),
    "np.mean(x, axis=(0, 1))": (lambda x, y, w: np.mean(x, axis=(0, 1)), lambda a, b, c: a.mean()),
    "x[3]": (lambda x, y, w: x[3], lambda a, b, c: a[3]), "x[-1]": (lambda x, y, w: x[-1], lambda a, b, c: a[-1]),
    "x[2:6]": (lambda x, y, w: x[2:6], lambda a, b, c: a[2:6]),
    "x[..., 5]": (lambda x, y, w: x[..., 5], lambda a, b, c: a[..., 5]),
    "x[::2, 1:7]": (lambda x, y, w: x[::2, 1:7], lambda a, b, c: a[::2, 1:7]),
    "x[1, 2]": (lambda x, y, w: x[1, 2], lambda a, b, c: a[1, 2]),
    "x[:]": (lambda x, y, w: x[:], lambda a, b, c: a[:]),
}


def _inputs(mesh_name, place, backend="numpy"):
    mesh = sf.DeviceMesh(MESHES[mesh_name], backend=backend)
    rng = np.random.default_rng()  # fresh inputs every run
    a, b = rng.uniform(0.5, 2.0, (8, 12)), rng.uniform(0.5, 2.0, (8, 12))
    c = rng.standard_normal((12, 5))
    spec = PLACES[mesh_name][place]
    return mesh, (a, b, c), (sf.distribute(a, mesh, spec), sf.distribute(b, mesh, spec), sf.distribute(c, mesh, ()))


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("backend, mesh_name, place", CASES)
def test_ops_outside_jit_match_numpy(name, backend, mesh_name, place):
    mesh, (a, b, c), (x, y, w) = _inputs(mesh_name, place, backend)
    op, ref = OPS[name]
    got = op(x, y, w)
    assert isinstance(got, sf.Array) and got.mesh == mesh
    np.testing.assert_allclose(got.gather(), ref(a, b, c), rtol=1e-12, atol=1e-12)
    assert len(got.placements) == len(mesh.shape)


def test_plain_arrays_on_either_side_are_replicated_inputs():
    mesh, (a, b, c), (x, _, _) = _inputs("1d", "S0")
    np.testing.assert_allclose((b + x).gather(), a + b, rtol=1e-12)
    np.testing.assert_allclose((x - b).gather(), a - b, rtol=1e-12)
    np.testing.assert_allclose((x @ c).gather(), a @ c, rtol=1e-12)
    np.testing.assert_allclose((b.T @ x).gather(), b.T @ a, rtol=1e-12)  # ndarray @ sf.Array: np.matmul
    assert (b + x).placements == (sf.Shard(0),)


def test_results_keep_the_placement_a_plan_would_give():
    mesh, _, (x, y, w) = _inputs("1d", "S0")
    assert (x + y).placements == (x * 2).placements == np.exp(x).placements == (sf.Shard(0),)  # no communication
    assert (x @ w).placements == (sf.Shard(0),)  # rows stay where they are
    assert x[..., 3].placements == (sf.Shard(0),)  # an unsharded axis indexed: no gather
    assert x[3].placements == x[2:6].placements == (sf.Replicate(),)  # the sharded axis: gathered
    assert x.sum(0).placements == (sf.Replicate(),)  # a sum over the sharded axis: all-reduced
    mesh2, _, (x2, _, _) = _inputs("2x2", "S01")
    assert x2[1].placements == (sf.Replicate(), sf.Shard(0))  # axis 1 stays sharded over DIDx
    assert x2[:, 4:8].placements == (sf.Shard(0), sf.Replicate())


def test_the_collectives_are_those_of_the_same_op_inside_jit():
    mesh = sf.DeviceMesh(4, backend="numpy")
    rng = np.random.default_rng()
    a, b = sf.shard(rng.standard_normal((4, 8)), axis=1, mesh=mesh), sf.shard(rng.standard_normal((8, 4)), axis=0, mesh=mesh)
    c = a @ b  # a contraction over the sharded axis: pending sums, all-reduced
    (prog,) = [p for p in array_ops.cached_programs(mesh) if p.name == "matmul"]
    inside = sf.jit(lambda a, b: a @ b, mesh=mesh).lower(a, b)
    assert sf.Plan(prog).collectives() == inside.collectives() == {"allreduce": 1}
    assert c.placements == (sf.Replicate(), ) and np.allclose(c.gather(), a.gather() @ b.gather())


def test_a_repeated_op_reuses_its_cached_plan():
    mesh, (a, b, _), (x, y, _) = _inputs("1d", "S0")
    before = array_ops.cache_info()
    x + y
    mid = array_ops.cache_info()
    assert mid["compiled"] == before["compiled"] + 1
    plans = array_ops.cached_programs(mesh)
    for _ in range(3):
        z = x + y
    after = array_ops.cache_info()
    assert after["compiled"] == mid["compiled"] and after["reused"] == mid["reused"] + 3  # no recompile
    assert array_ops.cached_programs(mesh) == plans
    np.testing.assert_allclose(z.gather(), a + b, rtol=1e-12)
    x[1], x[1]  # indexing: the gather plan compiled once
    assert array_ops.cache_info()["compiled"] == after["compiled"] + 1


def test_indexing_at_an_int_is_one_plan_for_every_int():
    """A serving probe: x[:, t] in a decode loop outside sf.jit compiled a plan per position t; ints among
    whole slices are operands of one dynamic slice, with NumPy's values, shapes and IndexError."""
    mesh, r = sf.DeviceMesh(2, backend="numpy"), np.random.default_rng()
    a = r.standard_normal((4, 6, 2))
    x = sf.shard(a, axis=1, mesh=mesh)
    x[:, 0], x[0], x[0, :, 1]
    before = array_ops.cache_info()["compiled"]
    for t in range(-4, 4):
        for key in [(slice(None), t % 6), (t,), (t, slice(None), 1), (t, Ellipsis), (Ellipsis, t % 2)]:
            got = x[key]
            assert got.shape == a[key].shape
            np.testing.assert_array_equal(np.asarray(got), a[key])
    assert array_ops.cache_info()["compiled"] == before + 1  # (x[..., j]: its one new plan)
    assert x[1].placements == (sf.Shard(0),)  # (axis 1 of x, axis 0 of the row: still sharded)
    with pytest.raises(IndexError, match="index 4 is out of bounds for axis 0 with size 4"):
        x[4]
    np.testing.assert_array_equal(np.asarray(x[1, 2:4]), a[1, 2:4])  # (a partial slice: the basic path)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(array_ops, "MAX_PLANS", 3)
    mesh, _, (x, _, _) = _inputs("1d", "S0")
    for k in range(6):
        x * float(k + 2)  # a scalar is part of the plan: a new one each
    assert len(array_ops.cached_programs(mesh)) == 3


def test_len_and_iteration():
    mesh, (a, _, _), (x, _, _) = _inputs("1d", "S0")
    assert len(x) == 8
    rows = list(x)  # through __getitem__ until IndexError, as a sequence
    assert len(rows) == 8 and np.allclose(rows[5].gather(), a[5])
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d sf.Array"):
        len(x.sum())
    assert bool(x[0, 0] * 0 + 1) and not bool(x[0, 0] * 0)  # one element: its truth, as NumPy
    with pytest.raises(ValueError, match=r"truth value of an sf.Array of shape \(8, 12\) is ambiguous"):
        bool(x)


@pytest.mark.parametrize("expr, error, message", [
    (lambda x, z: x + z, ValueError, r"add: the operands live on different meshes, DeviceMesh\(DIDx=4.*DeviceMesh\(DIDx=2"),
    (lambda x, z: np.fmod(x, z), TypeError, r"np.fmod on an sf.Array is not supported; shardfuse has np.add, .*np.exp, np.tanh"),
    (lambda x, z: np.add.reduce(x), TypeError, r"np.add.reduce .*not supported"),
    (lambda x, z: np.add(x, x, out=np.empty((8, 12))), TypeError, r"np.add with out= on an sf.Array is not supported"),
    (lambda x, z: x[[0, 1]], TypeError, r"basic indexing"),
    (lambda x, z: x[8], IndexError, r"index 8 is out of bounds for axis 0 with size 8"),
    (lambda x, z: x[0, 0, 0], IndexError, r"too many indices for an array of shape \(8, 12\): 3 given"),
    (lambda x, z: x[..., ...], IndexError, r"single ellipsis"),
    (lambda x, z: x + "1", TypeError, r"unsupported operand type\(s\) for \+: 'Array' and 'str'"),
    (lambda x, z: x @ 2.0, TypeError, r"unsupported operand type\(s\) for @"),
    (lambda x, z: x + np.ones(5), ValueError, r"add of \w+ and \w+: shapes \(8, 12\) and \(5,\) do not broadcast"),
    (lambda x, z: x.sum(2), ValueError, r"axis 2 out of range"),
    (lambda x, z: x.sum((0, 0)), ValueError, r"duplicate value in axis=\(0, 0\)"),
    (lambda x, z: x.max(0, where=x > 0), ValueError, r"np.max with where=: NumPy's needs initial= too"),
    (lambda x, z: x.mean(0, initial=1.0), TypeError, r"sf.Array.mean with initial= is not supported"),
    (lambda x, z: sf.replicate(np.ones((6, 4)), mesh=sf.DeviceMesh(3, backend="numpy")).redistribute((None, "DIDx")),
     ValueError, r"cannot shard axis 1 of extent 4 over DIDx: the mesh axis has 3 devices"),
    (lambda x, z: sf.distribute(np.ones((4, 4)), z.mesh, "DIDx"), TypeError, r"placements: a list or tuple"),
    (lambda x, z: sf.distribute(np.ones((4, 4)), z.mesh, [0]), TypeError, r"entry 0 must be None, a mesh axis name"),
])
def test_mistakes_are_refused_with_what_was_expected(expr, error, message):
    _, (a, _, _), (x, _, _) = _inputs("1d", "S0")
    z = sf.shard(a, axis=0, mesh=sf.DeviceMesh(2, backend="numpy"))
    with pytest.raises(error, match=message):
        expr(x, z)


def test_equal_meshes_mix_and_redistribute_still_works():
    mesh, (a, b, _), (x, _, _) = _inputs("1d", "S0")
    y = sf.shard(b, axis=1, mesh=sf.DeviceMesh(4, backend="numpy"))  # an equal mesh: the same devices
    np.testing.assert_allclose((x + y).gather(), a + b, rtol=1e-12)
    moved = x.redistribute([sf.Shard(1)])  # resharding shares the one-op plan cache
    assert moved.placements == (sf.Shard(1),) and np.allclose(moved.gather(), a)
    assert any(p.name == "redistribute" for p in array_ops.cached_programs(mesh))


def test_arrays_on_a_sub_mesh():
    mesh = sf.DeviceMesh(4, backend="numpy")
    sub = mesh.submesh([2, 3])
    a = np.random.default_rng().standard_normal((4, 6))
    t = sf.jit(lambda v: sf.to_mesh(v, sub, axis=0), mesh=mesh)(a)  # on mesh, living on sub's devices
    for got, ref in ((t + 1, a + 1), (t[1], a[1]), (t[..., 2], a[..., 2]), (t.sum(0), a.sum(0))):
        assert got.sharding.mesh == sub
        np.testing.assert_allclose(got.gather(), ref, rtol=1e-12)


def test_transpose_swapaxes_and_reshape_methods_outside_jit():
    """From a new-user probe: the README listed .T / .transpose / .reshape among the ops of an
    sf.Array outside jit, which had none of them; each is a one-op plan, as inside jit."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = np.random.default_rng(3).standard_normal((8, 4, 2))
    a = sf.shard(x, axis=0, mesh=mesh)
    assert a.T.sharding.axes == (None, None, "DIDx")  # the sharding moves with its axis: a view
    np.testing.assert_array_equal(a.T.gather(), x.T)
    np.testing.assert_array_equal(a.transpose(1, 0, 2).gather(), x.transpose(1, 0, 2))
    np.testing.assert_array_equal(a.transpose((2, 0, 1)).gather(), x.transpose(2, 0, 1))
    np.testing.assert_array_equal(a.swapaxes(0, -1).gather(), x.swapaxes(0, -1))
    r = a.reshape(8, 8)
    assert r.sharding.axes == ("DIDx", None)
    np.testing.assert_array_equal(r.gather(), x.reshape(8, 8))
    np.testing.assert_array_equal(a.reshape((4, 2, 8)).gather(), x.reshape(4, 2, 8))


def test_float_and_int_of_one_element_arrays_as_numpy():
    """From a new-user probe: bool() of a one-element sf.Array worked, float() and int() did not."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    a = sf.shard(np.arange(8.0), axis=0, mesh=mesh)
    assert float(a.sum()) == 28.0 and int(a.sum()) == 28 and bool(a.sum())
    with pytest.raises(TypeError, match=r"float\(\) of an sf.Array of shape \(8,\): only one element converts"):
        float(a)


def test_sf_functions_on_sf_arrays_compile_once():
    """(a helper found it) sf.maximum / sf.relu / sf.sqrt / sf.gelu / sf.logical_not on sf.Arrays made
    a new traced function per call, which keyed a new one-op plan: a compile at every call."""
    from shardfuse import array_ops

    mesh = sf.DeviceMesh(4, backend="numpy")
    x = np.random.default_rng(4).standard_normal((8, 4))
    a = sf.shard(x, axis=0, mesh=mesh)
    for fn, ref in ((lambda v: sf.maximum(v, 0.0), lambda v: np.maximum(v, 0.0)), (sf.relu, lambda v: np.maximum(v, 0)),
                    (lambda v: sf.sqrt(v * v), lambda v: np.sqrt(v * v)), (sf.exp, np.exp),
                    (lambda v: sf.logical_not(v > 0), lambda v: ~(v > 0))):
        fn(a)  # (compiled here)
        before = array_ops.cache_info()["compiled"]
        for _ in range(3):
            got = fn(a)
        assert array_ops.cache_info()["compiled"] == before, fn
        np.testing.assert_allclose(np.asarray(got.gather(), dtype=float), ref(x).astype(float), rtol=1e-12)


def test_a_baked_constant_is_keyed_by_its_bits():
    # -0.0 == 0.0, but x + -0.0 keeps a negative zero where x + 0.0 does not: two plans (the review of
    # 2026-12-06); NaN, unequal to itself, still finds its plan
    mesh = sf.DeviceMesh(2, backend="numpy")
    a = sf.shard(np.array([-0.0, 1.0, -0.0, 2.0]), axis=0, mesh=mesh)
    assert not np.signbit((a + 0.0).gather()).any()
    assert np.signbit((a + -0.0).gather()).tolist() == np.signbit(np.array([-0.0, 1.0, -0.0, 2.0]) + -0.0).tolist()
    assert np.isnan((a + float("nan")).gather()).all() and np.isnan((a + float("nan")).gather()).all()


def test_a_python_float_that_keeps_changing_stops_compiling_plans():
    """An eager learning-rate schedule, lr * g with a new lr each step, compiled a plan per value (~0.7 ms,
    and the plan cache churned); past BAKED_FLOATS values at one op it is the plan's weak operand (JAX's:
    no recompile), same values and dtype as the baked form.  Against NumPy in float32."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    g = np.random.default_rng().standard_normal(8).astype(np.float32)
    a = sf.distribute(g, mesh, ("DIDx",))
    before = array_ops.cache_info()["compiled"]
    for t in range(3 * array_ops.BAKED_FLOATS):
        lr = 0.1 / (t + 1)
        for got, want in ((lr * a, np.float32(lr) * g), (a / (t + 0.5), g / np.float32(t + 0.5)),
                          (a - lr, g - np.float32(lr))):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(np.asarray(got), want)
    assert array_ops.cache_info()["compiled"] - before <= 3 * (array_ops.BAKED_FLOATS + 1)


def test_shape_methods_and_changing_numpy_scalars_reuse_their_plans():
    """A pipeline probe: x.astype / reshape / transpose / .T / swapaxes compiled a plan on every call (a fresh
    lambda keyed the cache: apply_updates' astype recompiled every leaf every eager step), and a NumPy float
    that changes every call (eager Adam's bias corrections) compiled one per value; now one plan each, the
    NumPy float an operand after BAKED_FLOATS values, as a Python float is (strong: NumPy 2's dtype)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    a = np.random.default_rng().standard_normal((8, 4))
    x = sf.replicate(a, mesh=mesh)
    for op in (lambda: x.astype(x.dtype), lambda: x.reshape(4, 8), lambda: x.T, lambda: x.swapaxes(0, 1),
               lambda: x.transpose(1, 0)):
        before = array_ops.cache_info()["compiled"]
        for _ in range(3):
            op()
        assert array_ops.cache_info()["compiled"] == before + 1
    before = array_ops.cache_info()["compiled"]
    x32 = sf.replicate(a.astype(np.float32), mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [x32 / np.float64(1 - 0.9 ** (i + 1)) for i in range(9)]
    assert array_ops.cache_info()["compiled"] == before + array_ops.BAKED_FLOATS + 1
    for i, out in enumerate(outs):
        assert out.dtype == np.float64
        np.testing.assert_allclose(np.asarray(out), a.astype(np.float32) / np.float64(1 - 0.9 ** (i + 1)), rtol=1e-15)
