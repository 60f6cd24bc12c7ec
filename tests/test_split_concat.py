"""Issue 31, item 3: sf.split, sf.concatenate and sf.stack (and np.split / np.concatenate / np.stack)
inside sf.jit and on sf.Arrays outside it, with NumPy's semantics, against NumPy in float64 on
fresh random inputs (buffers poisoned); local when the cut or joined axis is not sharded, one
Allgather (printed) when it is; and the fused QKV projection, gathered or laid out as Megatron's.

The case bodies (SPLITS, JOINS, check_split, check_join, check_qkv) are shared: tests/mpi/ runs
them under mpiexec and tests/test_gpu.py on the CuPy backend.
"""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import array_ops
from shardfuse.ops import Op
from test_elementwise_ops import DTYPES, compare, mesh_of
from test_slicing import LAYOUTS, random

SHAPE = (8, 12, 4)

# name -> (sf's split on a value, NumPy's): sections, split points (negative, past the end, empty pieces)
SPLITS = {
    "sf.split(x, 2)": lambda m, x: m.split(x, 2), "sf.split(x, 3, axis=1)": lambda m, x: m.split(x, 3, axis=1),
    "np.split(x, 4, axis=-1)": lambda m, x: m.split(x, 4, axis=-1),
    "sf.split(x, [3, -2], axis=1)": lambda m, x: m.split(x, [3, -2], axis=1),
    "sf.split(x, [2, 2, 30])": lambda m, x: m.split(x, [2, 2, 30]),
    "np.split(x, [5, 1], axis=1)": lambda m, x: m.split(x, [5, 1], axis=1),
}

# name -> (sf's join of x and y, NumPy's); y is x's shape but on the joined axis
JOINS = {
    "concatenate axis 0": (lambda m, x, y: m.concatenate([x, y, x]), 0),
    "concatenate axis 1": (lambda m, x, y: m.concatenate((x, y), axis=1), 1),
    "concatenate axis -1": (lambda m, x, y: m.concatenate([y, x], axis=-1), 2),
    "concatenate axis None": (lambda m, x, y: m.concatenate([x, y], axis=None), 0),
    "concatenate one": (lambda m, x, y: m.concatenate([x], axis=1), 0),
    "stack axis 0": (lambda m, x, y: m.stack([x, x * 2.0]), None),
    "stack axis -1": (lambda m, x, y: m.stack([x, x + 1.0, x], axis=-1), None),
    "stack axis 1": (lambda m, x, y: m.stack([x * 3.0, x], axis=1), None),
}


def _y_shape(axis):
    return SHAPE if axis is None else SHAPE[:axis] + (2 * SHAPE[axis] if axis != 1 else 4,) + SHAPE[axis + 1:]


def check_split(name, mesh, spec, dtype, jit, rng):
    """SPLITS[name] of x placed with spec: each piece's values, shape and dtype as NumPy's."""
    x = random(SHAPE, dtype, rng)
    xa = sf.distribute(x, mesh, spec)
    fn = SPLITS[name]
    module = np if name.startswith("np.") else sf
    got = sf.jit(lambda v: tuple(fn(module, v)), mesh=mesh)(xa) if jit else fn(module, xa)
    want = fn(np, x.astype(np.float64))
    assert len(got) == len(want), (name, len(got))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        compare(g.gather(), w, dtype, name)


def check_join(name, mesh, spec, dtype, jit, rng, y_spec=()):
    """JOINS[name] of x placed with spec and y with y_spec: values, shape and dtype as NumPy's."""
    fn, axis = JOINS[name]
    x, y = random(SHAPE, dtype, rng), random(_y_shape(axis), dtype, rng)
    xa, ya = sf.distribute(x, mesh, spec), sf.distribute(y, mesh, y_spec)
    for module in (sf, np):
        got = sf.jit(lambda u, v: fn(module, u, v), mesh=mesh)(xa, ya) if jit else fn(module, xa, ya)
        want = fn(np, x.astype(np.float64), y.astype(np.float64))
        assert isinstance(got, sf.Array) and got.shape == want.shape and got.dtype == x.dtype, (name, got)
        compare(got.gather(), want, dtype, name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(SPLITS))
def test_split_on_every_layout(name, layout, jit):
    shape, spec = LAYOUTS[layout]
    check_split(name, mesh_of(shape), spec, "float64", jit, np.random.default_rng(0))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(JOINS))
def test_join_on_every_layout(name, layout, jit):
    shape, spec = LAYOUTS[layout]
    check_join(name, mesh_of(shape), spec, "float64", jit, np.random.default_rng(1), y_spec=spec[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_and_join_in_every_dtype(dtype):
    check_split("sf.split(x, 3, axis=1)", mesh_of(4), ("DIDx",), dtype, True, np.random.default_rng(2))
    check_join("concatenate axis -1", mesh_of(4), ("DIDx",), dtype, True, np.random.default_rng(3))
    check_join("stack axis 1", mesh_of(4), (None, "DIDx"), dtype, True, np.random.default_rng(4))


def test_concatenate_promotes_as_numpy():
    mesh, rng = mesh_of(4), np.random.default_rng(5)
    a, b = rng.standard_normal((8, 3)).astype(np.float32), rng.integers(1, 9, (8, 2)).astype(np.int32)
    got = sf.jit(lambda u, v: sf.concatenate([u, v], axis=1), mesh=mesh)(sf.shard(a, axis=0, mesh=mesh), b)
    assert got.dtype == np.concatenate([a, b], axis=1).dtype == np.float64
    compare(got.gather(), np.concatenate([a, b], axis=1).astype(np.float64), "float64")


def test_communication_only_where_the_axis_is_sharded():
    mesh, spec = mesh_of(4), sf.TensorSpec((8, 12), "float64")

    def collectives(fn):
        return sf.jit(fn, mesh=mesh).lower(spec, spec).collectives()
    assert collectives(lambda x, y: sf.concatenate([sf.shard(x, axis=0), sf.shard(y, axis=0)], axis=1)) == {}
    assert collectives(lambda x, y: sf.split(sf.shard(x, axis=0), 3, axis=1)) == {}
    assert collectives(lambda x, y: sf.split(sf.shard(x, axis=1), 3, axis=1)) == {"allgather": 1}  # one for all
    assert collectives(lambda x, y: sf.concatenate([sf.shard(x, axis=0), y])) == {"allgather": 1}
    # the result sharded on the joined axis: gathered, joined, then each device's slice (no second collective)
    assert collectives(lambda x, y: sf.shard(sf.concatenate([sf.shard(x, axis=0), y]), axis=0)) == {"allgather": 1}
    text = str(sf.jit(lambda x, y: sf.concatenate([sf.shard(x, axis=0), y]), mesh=mesh).lower(spec, spec))
    assert "ag = Allgather x_gathered <- x, team=DIDx, axis=0" in text
    assert "cat_y: f64[8, 12] = SliceArray cat, begin=(8, 0)\n  Copy cat_y <- y" in text, text


def test_pending_sums_flow_through_a_concatenation():
    """Both halves contract a sharded K: their sums are joined first and reduced once."""
    mesh, rng = mesh_of(4), np.random.default_rng(6)
    x, w1, w2 = random((8, 12), "float64", rng), random((12, 5), "float64", rng), random((12, 3), "float64", rng)
    f = sf.jit(lambda x, a, b: sf.concatenate([sf.shard(x, axis=1) @ sf.shard(a, axis=0),
                                               sf.shard(x, axis=1) @ sf.shard(b, axis=0)], axis=1), mesh=mesh)
    assert f.lower(x, w1, w2).collectives() == {"allreduce": 1}
    compare(f(x, w1, w2).gather(), np.concatenate([x @ w1, x @ w2], axis=1), "float64")


def test_join_inside_a_stream_loop():
    mesh, rng = mesh_of(4), np.random.default_rng(7)
    x, y, w = random((16, 8), "float64", rng), random((16, 4), "float64", rng), random((12, 6), "float64", rng)
    f = sf.jit(lambda x, y, w: sf.stream(sf.concatenate([sf.shard(x, axis=0), sf.shard(y, axis=0)], axis=1) @ w,
                                         axis=0, chunks=2), mesh=mesh)
    compare(f(x, y, w).gather(), np.concatenate([x, y], axis=1) @ w, "float64")
    g = sf.jit(lambda x, y: sf.stream(sf.concatenate([x, y], axis=1) * 2.0, axis=0, chunks=4), mesh=mesh)
    compare(g(x, y).gather(), np.concatenate([x, y], axis=1) * 2, "float64")
    along = sf.jit(lambda x: sf.stream(sf.concatenate([sf.shard(x, axis=0), x]), axis=0, chunks=2), mesh=mesh)
    with pytest.raises(ValueError, match=r"sf.stream\(..., chunks=\) of cat along the axis its concat cuts or joins"):
        along.lower(x)


# ---- the fused QKV projection ----------------------------------------------------------------------

def check_qkv(mesh, dtype, rng):
    """q, k, v = sf.split(x @ w_qkv, 3, axis=-1) with w_qkv (K, 3H) column-sharded: right, with one
    printed Allgather; with w_qkv laid out per head as Megatron's (K, heads, 3, head_dim), the split of
    x @ w_qkv viewed as (M, heads, 3 * head_dim) along its last axis is local."""
    m, kk, heads, hd = 8, 16, 4, 3
    x = random((m, kk), dtype, rng)
    wq, wk, wv = (random((kk, heads * hd), dtype, rng) for _ in range(3))
    want = [x.astype(np.float64) @ w.astype(np.float64) for w in (wq, wk, wv)]

    def plain(x, w):
        return tuple(sf.split(x @ sf.shard(w, axis=1), 3, axis=-1))
    f = sf.jit(plain, mesh=mesh)
    fused = np.concatenate([wq, wk, wv], axis=1)
    # (D = 1: no collective, the gather that writes the outputs a device copy, passes/fold.py)
    assert f.lower(x, fused).collectives() == ({"allgather": 1} if mesh.size > 1 else {})
    for g, w in zip(f(x, fused), want):
        compare(g.gather(), w, dtype)

    def megatron(x, w):  # w: (K, heads * 3 * hd), each head's q, k, v side by side; heads sharded
        y = (x @ sf.shard(w, axis=1)).reshape(m, heads, 3 * hd)
        return tuple(v.reshape(m, heads * hd) for v in sf.split(y, 3, axis=-1))
    per_head = np.stack([w.reshape(kk, heads, hd) for w in (wq, wk, wv)], axis=2).reshape(kk, heads * 3 * hd)
    g = sf.jit(megatron, mesh=mesh)
    assert g.lower(x, per_head).collectives() == {}
    for out, w in zip(g(x, per_head), want):
        assert len(mesh.devices) == 1 or out.placements == (sf.Shard(1),)  # heads stay sharded
        compare(out.gather(), w, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_qkv_split(dtype):
    for d in (1, 4):
        check_qkv(mesh_of(d), dtype, np.random.default_rng(8))


# ---- mistakes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, error, message", [
    (lambda x, y: sf.concatenate([x, y]), ValueError, r"concatenate along axis 0: every array must have the shape of "
                                                      r"the first, \(8, 12\), but on that axis; got y \(shape \(8, 5\)"),
    (lambda x, y: sf.concatenate([x, y.sum(1)], axis=1), ValueError, r"every array must have the shape of the first"),
    (lambda x, y: sf.concatenate([x.sum(), x.sum()]), ValueError, r"zero-dimensional arrays cannot be concatenated"),
    (lambda x, y: sf.concatenate([x, x], axis=2), ValueError, r"axis 2 out of range"),
    (lambda x, y: sf.concatenate([]), ValueError, r"concatenate needs at least one array"),
    (lambda x, y: sf.concatenate([x, [[1.0] * 12] * 8]), TypeError, r"every array must be a value of the traced "
                                                                   r"function, got list; .*make them inputs"),
    (lambda x, y: np.concatenate([x, x], dtype=np.float32), TypeError, r"np.concatenate with out=, dtype= or casting= "
                                                                       r"is not supported .* write sf.concatenate"),
    (lambda x, y: sf.stack([x, y]), ValueError, r"stack: all input arrays must have the same shape, got "
                                                r"\[\(8, 5\), \(8, 12\)\]"),
    (lambda x, y: sf.split(x, 5), ValueError, r"split of x \(shape \(8, 12\), float64\) along axis 0: 5 sections do "
                                              r"not divide the axis of extent 8 equally"),
    (lambda x, y: sf.split(x, 2.0), TypeError, r"indices_or_sections must be an int or a list of ints, got float"),
    (lambda x, y: sf.split(x, 2, axis=-3), ValueError, r"axis -3 out of range"),
])
def test_mistakes_are_refused_at_trace_time(expr, error, message):
    f = sf.jit(expr, mesh=mesh_of(4))
    with pytest.raises(error, match=message):
        f.lower(sf.TensorSpec((8, 12), "float64"), sf.TensorSpec((8, 5), "float64"))


def test_split_of_a_plain_array_is_refused():
    with pytest.raises(TypeError, match=r"sf.split takes a value inside sf.jit or an sf.Array, got ndarray"):
        sf.split(np.ones(4), 2)


def test_split_of_an_sf_array_gathers_its_axis_once():
    mesh = sf.DeviceMesh(4, backend="numpy")  # (a fresh mesh: its one-op plans are this test's)
    x = random((8, 12), "float64", np.random.default_rng(9))
    pieces = sf.split(sf.shard(x, axis=1, mesh=mesh), 3, axis=1)
    ops = [i.op for prog in array_ops.cached_programs(mesh) for i in prog.walk()]
    assert ops.count(Op.ALLGATHER) == 1 and len(pieces) == 3  # the axis gathered once, then three local boxes
    for got, want in zip(pieces, np.split(x, 3, axis=1)):
        assert got.placements == (sf.Replicate(),)
        compare(got.gather(), want, "float64")


def test_numpy_joins_of_sf_arrays_outside_jit_run_as_shardfuse_ops():
    """np.concatenate / np.stack of sf.Arrays (beside plain arrays, replicated) are one-op plans, as
    sf.concatenate's: an sf.Array keeping the sharding of the axes not joined, no gather to the host."""
    mesh = sf.DeviceMesh(4, backend="numpy")  # (a fresh mesh: its one-op plans are this test's)
    rng = np.random.default_rng(10)
    a, b = random((8, 12), "float64", rng), random((4, 12), "float64", rng)
    xa, xb = sf.shard(a, axis=1, mesh=mesh), sf.shard(b, axis=1, mesh=mesh)
    cases = [(np.concatenate([xa, xb]), np.concatenate([a, b])), (np.concatenate((xa, b)), np.concatenate([a, b])),
             (np.concatenate([b, xa], axis=0), np.concatenate([b, a])), (np.stack([xa, a], -1), np.stack([a, a], -1))]
    for got, want in cases:
        assert isinstance(got, sf.Array) and got.shape == want.shape and got.placements != (sf.Replicate(),), got
        compare(got.gather(), want, "float64")
    ops = [i.op for prog in array_ops.cached_programs(mesh) for i in prog.walk()]
    assert Op.ALLGATHER not in ops  # the joined axis 0 is whole already: no communication


@pytest.mark.parametrize("expr, error, message", [
    (lambda x: np.concatenate([x, 3.0]), TypeError, r"np.concatenate / sf.concatenate of sf.Arrays: every item must be an "
                                                    r"array of rank >= 1 .*got float 3.0"),
    (lambda x: np.concatenate([x, x.sum()]), ValueError, r"every item must be an array of rank >= 1 .*got Array of "
                                                         r"shape \(\)"),
    (lambda x: np.stack([x, "x"]), TypeError, r"np.stack / sf.stack of sf.Arrays: every item must be an array .*got str"),
    (lambda x: np.concatenate([x, x], out=np.empty((16, 12))), TypeError, r"np.concatenate with out=, dtype= or "
                                                                           r"casting= is not supported"),
])
def test_numpy_joins_of_sf_arrays_refuse_what_is_not_an_array(expr, error, message):
    with pytest.raises(error, match=message):
        expr(sf.shard(np.ones((8, 12)), axis=0, mesh=mesh_of(4)))
