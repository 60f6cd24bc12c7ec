"""sf.take(table, ids, axis) and np.take of traced values and sf.Arrays: NumPy's semantics (ids in
[-n, n), any shape; outside that clamped, as JAX's indexing), compared with NumPy in float64; with
the table sharded over the vocabulary, Megatron's vocab-parallel embedding: one Allreduce of the
result (a ReduceScatter where it is annotated sharded), never a gather of the table.  The case
bodies run on NumPy devices here and under mpiexec (tests/mpi/test_gather_mpi.py)."""
from __future__ import annotations

import ml_dtypes  # noqa: F401 (bfloat16)
import numpy as np
import pytest

import shardfuse as sf

V, H = 16, 8


def np_lookup(table, ids, axis=0):
    """The reference: NumPy's take with out-of-range ids clamped (negative ones from the end first)."""
    n = table.shape[axis]
    ids = np.clip(np.where(ids < 0, ids + n, ids), 0, n - 1)
    return np.take(table.astype(np.float64) if table.dtype.kind == "f" or table.dtype == "bfloat16" else table,
                   ids, axis=axis)


def ids_of(rng, shape, dtype="int32", out_of_range=False):
    ids = rng.integers(-V, V, shape).astype(dtype)
    if out_of_range and ids.size >= 2:
        ids.flat[0], ids.flat[-1] = 3 * V, -5 * V
    return ids


MESHES = {"1d": ((4,), ("tp",)), "2d": ((2, 2), ("dp", "tp"))}
# (table spec, ids spec): the vocabulary over tp (Megatron), over both mesh axes, the hidden axis
# over tp with the ids' batch over dp, and replicated
LAYOUTS = {
    "vocab": (("tp", None), (None, None)),
    "vocab-batch-dp": (("tp", None), ("dp", None)),
    "vocab-both": ((("dp", "tp"), None), (None, None)),
    "hidden": ((None, "tp"), ("dp", None)),
    "replicated": ((None, None), (None, None)),
}


def check_take(mesh, layout, dtype, ids_dtype, rng, jit=True, out_of_range=True):
    names = set(mesh.axis_names)
    t_spec, i_spec = LAYOUTS[layout]
    fix = lambda spec: tuple(a if a is None or set(a if isinstance(a, tuple) else (a,)) <= names else None
                             for a in spec)  # (a 1-D mesh has no dp)
    table = (rng.standard_normal((V, H)) * 3).astype(dtype)
    ids = ids_of(rng, (4, 6), ids_dtype, out_of_range)
    t, i = sf.distribute(table, mesh, fix(t_spec)), sf.distribute(ids, mesh, fix(i_spec))
    got = sf.jit(sf.take, mesh=mesh)(t, i) if jit else sf.take(t, i)
    assert got.dtype == np.dtype(dtype).name and got.shape == (4, 6, H)
    np.testing.assert_array_equal(np.asarray(got.gather()).astype(np.float64), np_lookup(table, ids))
    return got


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
def test_values_as_numpy(mesh_kind, layout, jit):
    mesh = sf.DeviceMesh(*MESHES[mesh_kind])
    check_take(mesh, layout, "float64", "int32", np.random.default_rng(0), jit)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_dtypes(dtype, ids_dtype):
    check_take(sf.DeviceMesh(4, "tp"), "vocab", dtype, ids_dtype, np.random.default_rng(1))


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)], ids=str)
def test_ids_of_any_shape(shape):
    rng = np.random.default_rng(2)
    table, ids = rng.standard_normal((V, H)), ids_of(rng, shape)
    mesh = sf.DeviceMesh(4)
    got = sf.jit(lambda t, i: sf.take(sf.shard(t, axis=0), i), mesh=mesh)(table, ids)
    assert got.shape == shape + (H,)
    np.testing.assert_array_equal(got.gather(), np_lookup(table, ids))


def test_vocab_parallel_plan_is_one_allreduce_never_a_gather():
    mesh = sf.DeviceMesh(4)
    f = sf.jit(lambda t, i: sf.take(sf.shard(t, axis=0), i), mesh=mesh)
    plan = f.lower(sf.TensorSpec((V, H), "float32"), sf.TensorSpec((4, 8), "int32"))
    assert plan.collectives() == {"allreduce": 1}, plan
    text = str(plan)
    assert "Take e <- t, i, const_sliced, vocab=16" in text and "const: i64[16]" in text, text
    assert "e = Allocate f32[4, 8, 8] partial(DIDx)" in text, text  # each device's rows, zeros elsewhere


def test_sequence_parallel_output_is_one_reduce_scatter():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    def f(t, i):  # the tokens' sequence axis sharded over tp on the way out: sequence parallel
        e = sf.take(sf.shard(t, axis=0, over="tp"), sf.shard(i, axis=0, over="dp"))
        return sf.shard(sf.shard(e, axis=0, over="dp"), axis=1, over="tp")
    f = sf.jit(f, mesh=mesh)
    rng = np.random.default_rng(3)
    table, ids = rng.standard_normal((V, H)), ids_of(rng, (4, 6))
    plan = f.lower(table, ids)
    assert plan.collectives() == {"reduce_scatter": 1}, plan
    out = f(table, ids)
    assert out.placements == (sf.Shard(0), sf.Shard(1))
    np.testing.assert_array_equal(out.gather(), np_lookup(table, ids))


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_other_axes_as_np_take(axis):
    rng = np.random.default_rng(4)
    table = rng.standard_normal((4, 8, 12))
    ids = rng.integers(0, table.shape[axis], (3, 2))
    f = sf.jit(lambda t, i: np.take(sf.shard(t, axis=axis), i, axis=axis), mesh=sf.DeviceMesh(4))
    np.testing.assert_array_equal(f(table, ids).gather(), np.take(table, ids, axis=axis))
    assert "allgather" not in f.lower(table, ids).collectives()  # the taken axis sharded: a pending sum


def test_np_take_flattens_without_axis_and_outside_jit():
    rng = np.random.default_rng(5)
    table, ids = rng.standard_normal((V, 4)), rng.integers(0, 4 * V, (3, 5))
    mesh = sf.DeviceMesh(4)
    np.testing.assert_array_equal(sf.jit(lambda t, i: np.take(t, i), mesh=mesh)(table, ids).gather(),
                                  np.take(table, ids))
    a = sf.shard(table, axis=0, mesh=mesh)
    np.testing.assert_array_equal(np.take(a, ids).gather(), np.take(table, ids))
    np.testing.assert_array_equal(np.take(a, ids % V, axis=0).gather(), table[ids % V])
    np.testing.assert_array_equal(sf.take(a, ids % V).gather(), table[ids % V])


def test_a_numpy_table_closed_over_is_a_constant():
    rng = np.random.default_rng(6)
    table, ids = rng.standard_normal((V, H)), ids_of(rng, (2, 3))
    f = sf.jit(lambda i: sf.take(table, i) * 2.0, mesh=sf.DeviceMesh(2))
    np.testing.assert_array_equal(f(ids).gather(), np_lookup(table, ids) * 2.0)


def test_errors_name_what_was_expected_and_what_came():
    mesh = sf.DeviceMesh(2)
    t, i = sf.TensorSpec((V, H), "float32"), sf.TensorSpec((3,), "int32")
    with pytest.raises(TypeError, match=r"ids must be an integer array \(int32 or int64\), got ids \(shape \(3,\), "
                                        r"float32\)"):
        sf.jit(sf.take, mesh=mesh).lower(t, sf.TensorSpec((3,), "float32"))
    with pytest.raises(ValueError, match="axis 2 is out of bounds|out of range"):
        sf.jit(lambda t, i: sf.take(t, i, axis=2), mesh=mesh).lower(t, i)
    with pytest.raises(TypeError, match="axis must be an int"):
        sf.jit(lambda t, i: sf.take(t, i, axis=None), mesh=mesh).lower(t, i)
    with pytest.raises(TypeError, match=r"mode='wrap'\) is not supported"):
        sf.jit(lambda t, i: np.take(t, i, axis=0, mode="wrap"), mesh=mesh).lower(t, i)
    with pytest.raises(TypeError, match="sf.take takes values inside an sf.jit function or sf.Arrays"):
        sf.take(np.ones((V, H)), np.zeros(3, int))


def _random_case(r):
    """A random table (3-D) and ids placement on a 1-D or 2-D mesh, and a random axis to take along."""
    mesh = [sf.DeviceMesh(4), sf.DeviceMesh((2, 2), ("dp", "tp"))][r.integers(2)]
    entries = [None] * 3
    for name in mesh.axis_names:
        j = r.integers(4)
        if j < 3:
            entries[j] = name if entries[j] is None else (entries[j], name)
    ids_spec = (mesh.axis_names[0],) if r.integers(3) == 0 and mesh.axis_names[0] not in \
        {n for e in entries for n in (e if isinstance(e, tuple) else (e,))} else (None,)
    return mesh, tuple(entries), ids_spec, int(r.integers(-3, 3))


@pytest.mark.parametrize("seed", range(40))
def test_random_placements_and_axes(seed):
    """Random table and ids placements and axes: np.take's values (ids clamped), and no Allgather
    (the result keeps the placements of the table's other axes and of the ids)."""
    r = np.random.default_rng(3000 + seed)
    mesh, spec, ids_spec, axis = _random_case(r)
    table = r.standard_normal((4, 8, 4))
    ids = r.integers(-2 * table.shape[axis], 2 * table.shape[axis], (4, 3))
    f = sf.jit(lambda t, i: sf.take(t, i, axis=axis), mesh=mesh)
    t, i = sf.distribute(table, mesh, spec), sf.distribute(ids, mesh, ids_spec)
    np.testing.assert_array_equal(f(t, i).gather(), np_lookup(table, ids, axis))
    assert "allgather" not in f.lower(t, i).collectives(), str(f.lower(t, i))


@pytest.mark.parametrize("spec", [(("DIDy", "DIDx"), None), (("DIDx", "DIDy"), None), (None, ("DIDy", "DIDx"))])
@pytest.mark.parametrize("axis", [0, 1])
def test_take_along_an_axis_split_over_both_mesh_axes(spec, axis):
    """A table split over (DIDy, DIDx): its lookup pends sums over both axes, made in two orders
    (\"cannot reshard ('P', 'P') -> ('P', 'P')\", a review); sf.random.permutation of such an array too."""
    mesh = sf.DeviceMesh((2, 2), ("DIDy", "DIDx"), backend="numpy")
    x = np.random.default_rng().standard_normal((8, 16))
    ids = np.array([3, 1, 7, 0], np.int64)
    xa = sf.distribute(x, mesh, spec)
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda t, i: sf.take(t, i, axis=axis), mesh=mesh)(xa, ids)),
                                  np.take(x, ids, axis=axis))
    key = sf.random.key(1)
    np.testing.assert_array_equal(np.asarray(sf.random.permutation(key, xa, axis=axis)),
                                  np.take(x, sf.random.permutation(key, x.shape[axis]), axis=axis))
