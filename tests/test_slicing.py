"""Issue 31, item 3: basic indexing (ints, slices with negative and omitted bounds and any step,
'...', None) inside sf.jit and on sf.Arrays outside it, and matmul with NumPy's broadcasting
(1-D operands, batch axes of extent 1 or missing), on a 1-D mesh of 4 and a 2x2 mesh, inputs
sharded and replicated, against NumPy in float64 on fresh random inputs (buffers poisoned).

The case bodies (INDEXES, check_index, MATMULS, check_matmul) are shared: tests/mpi/ runs them
under mpiexec and tests/test_gpu.py on the CuPy backend.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from test_elementwise_ops import DTYPES, compare, mesh_of

SHAPE = (8, 12, 4)

# name -> the index (NumPy's semantics on shardfuse values and on the reference alike)
INDEXES = {
    "x[3]": (3,), "x[-1]": (-1,), "x[2:6]": (slice(2, 6),), "x[..., 1]": (Ellipsis, 1),
    "x[:, -5:-1]": (slice(None), slice(-5, -1)), "x[:, 7:]": (slice(None), slice(7, None)),
    "x[:, :-9]": (slice(None), slice(None, -9)), "x[None, 1:3]": (None, slice(1, 3)),
    "x[..., None]": (Ellipsis, None), "x[1, 2]": (1, 2), "x[1, 2, 3]": (1, 2, 3), "x[:]": (slice(None),),
    "x[...]": (Ellipsis,), "x[::2, 1:11:3]": (slice(None, None, 2), slice(1, 11, 3)),
    "x[4:, None, ..., 2:]": (slice(4, None), None, Ellipsis, slice(2, None)), "x[:, 5:99]": (slice(None), slice(5, 99)),
    "x[np.int64(2), :, -2]": (np.int64(2), slice(None), -2), "x[3:3]": (slice(3, 3),),
    # negative steps (reversals), issue 31: a reversed sharded axis is gathered first, as any cut axis
    "x[::-1]": (slice(None, None, -1),), "x[5:1:-2]": (slice(5, 1, -2),),
    "x[..., ::-1]": (Ellipsis, slice(None, None, -1)),
    "x[::-3, 10:2:-4, ::-1]": (slice(None, None, -3), slice(10, 2, -4), slice(None, None, -1)),
    "x[-1::-2, None, 1]": (slice(-1, None, -2), None, 1), "x[1:5:-1]": (slice(1, 5, -1),),
    "x[:, -2:-13:-5]": (slice(None), slice(-2, -13, -5)),
}

# layouts: name -> (mesh shape, spec of x per tensor axis)
LAYOUTS = {
    "1d R": (4, ()), "1d S0": (4, ("DIDx",)), "1d S1": (4, (None, "DIDx")), "1d S2": (4, (None, None, "DIDx")),
    "2d S0 S1": ((2, 2), ("DIDy", "DIDx")), "2d S(0,1)": ((2, 2), (("DIDy", "DIDx"),)),
    "2d S2 S0": ((2, 2), ("DIDx", None, "DIDy")),
}


def random(shape, dtype, rng):
    """Random values in dtype, never zero."""
    return (rng.uniform(0.25, 2.0, shape) * rng.choice([-1.0, 1.0], shape)).astype(np_dtype(dtype))


def check_index(name, mesh, spec, dtype, jit, rng):
    """INDEXES[name] of x placed with spec, inside sf.jit or outside: values, shape and dtype as NumPy's."""
    key = INDEXES[name]
    x = random(SHAPE, dtype, rng)
    xa = sf.distribute(x, mesh, spec)
    got = sf.jit(lambda v: v[key], mesh=mesh)(xa) if jit else xa[key]
    want = x.astype(np.float64)[key]
    assert got.shape == want.shape and got.dtype == x.dtype, (name, got.shape, got.dtype)
    compare(got.gather(), want, dtype, name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(INDEXES))
def test_index_on_every_layout(name, layout, jit):
    shape, spec = LAYOUTS[layout]
    check_index(name, mesh_of(shape), spec, "float64", jit, np.random.default_rng(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["x[..., 1]", "x[:, -5:-1]", "x[None, 1:3]", "x[::2, 1:11:3]"])
def test_index_in_every_dtype(name, dtype):
    check_index(name, mesh_of(4), ("DIDx",), dtype, True, np.random.default_rng(1))


def test_an_uncut_sharded_axis_stays_sharded_and_a_cut_one_is_gathered_once():
    mesh = mesh_of(4)
    rows = sf.jit(lambda x: sf.shard(x, axis=0)[..., 0:3], mesh=mesh)
    plan = rows.lower(sf.TensorSpec((8, 12), "float64"))
    assert plan.collectives() == {} and "SliceArray" in str(plan)
    assert rows(np.ones((8, 12))).placements == (sf.Shard(0),)
    cols = sf.jit(lambda x: (lambda v: (v[:, 0:4], v[:, 4:], v[1]))(sf.shard(x, axis=1)), mesh=mesh)
    assert cols.lower(sf.TensorSpec((8, 12), "float64")).collectives() == {"allgather": 1}  # one for all three
    x = sf.shard(np.arange(96.0).reshape(8, 12), axis=0, mesh=mesh)
    assert x[..., 3].placements == (sf.Shard(0),) and x[2:6].placements == (sf.Replicate(),)


def test_the_plan_prints_the_box():
    plan = sf.jit(lambda x: sf.shard(x, axis=0)[:, 2:10:2] * 2.0, mesh=mesh_of(4)).lower(
        sf.TensorSpec((8, 12), "float32"))
    assert "  x_1_s: f32[8:DIDx, 4] = SliceArray x, begin=(0, 2), step=(1, 2)\n" in str(plan), str(plan)


def test_a_reversal_is_a_view_of_a_whole_axis():
    """x[::-1] is a SliceArray with a negative step (a view, as NumPy's): of an axis that is whole on
    every device it stays local, and a reversed sharded axis is gathered first, as any cut axis."""
    spec, mesh = sf.TensorSpec((8, 12), "float32"), mesh_of(4)
    local = sf.jit(lambda x: sf.shard(x, axis=0)[:, ::-1] * 2.0, mesh=mesh).lower(spec)
    assert local.collectives() == {}, str(local)
    assert "  x_1_s: f32[8:DIDx, 12] = SliceArray x, begin=(0, 11), step=(1, -1)\n" in str(local), str(local)
    rows = sf.jit(lambda x: sf.shard(x, axis=0)[7:1:-2] * 2.0, mesh=mesh).lower(spec)
    assert rows.collectives() == {"allgather": 1}
    assert "SliceArray x_gathered, begin=(7, 0), step=(-2, 1)\n" in str(rows), str(rows)
    x = sf.shard(random((8, 12), "float64", np.random.default_rng(5)), axis=0, mesh=mesh)
    assert x[:, ::-1].placements == (sf.Shard(0),) and x[::-1].placements == (sf.Replicate(),)


def test_reversed_views_reach_gemms_and_collectives():
    """A reversed view's strides are negative: a GEMM of it, a collective of it (staged contiguous,
    printed) and a stream loop beside it give NumPy's values; cuBLAS is never handed a negative
    batch stride (gemm_layout declines, so the GPU backend stages the operand)."""
    mesh, rng = mesh_of(4), np.random.default_rng(6)
    x, w = random((4, 8, 12), "float64", rng), random((12, 6), "float64", rng)

    def f(x, w):
        x = sf.shard(x, axis=1)
        a = x[::-1, :, ::-1] @ w[::-1]  # batch, rows and contraction reversed
        b = sf.replicate(x[..., ::-1])  # an Allgather of a reversed view
        c = sf.stream(x[:, :, 10:1:-3] @ w[:3], axis=1, chunks=2)
        return a, b, c

    got = sf.jit(f, mesh=mesh)(x, w)
    for g, want in zip(got, (x[::-1, :, ::-1] @ w[::-1], x[..., ::-1], x[:, :, 10:1:-3] @ w[:3])):
        compare(g.gather(), want, "float64")
    from shardfuse.backends.cuda.gemm_layout import gemm_layout
    from shardfuse.backends.protocol import Ref
    a, b, out = (Ref(k, (0,), s, st, "float32") for k, (s, st) in enumerate(
        [((4, 6, 3), (-18, 3, 1)), ((3, 5), (5, 1)), ((4, 6, 5), (30, 5, 1))]))
    assert gemm_layout(a, b, out) is None
    assert gemm_layout(replace(a, strides=(18, 3, 1)), b, out) is not None


@pytest.mark.parametrize("spec", [("DIDx",), (None, "DIDx")], ids=["S0", "S1"])
def test_slices_inside_stream_loops_and_of_pending_sums(spec):
    mesh, rng = mesh_of(4), np.random.default_rng(2)
    x, w = random((16, 12), "float64", rng), random((12, 8), "float64", rng)

    def f(x, w):
        x = sf.shard(x, axis=spec.index("DIDx"))
        a = sf.stream(x[:, 2:10] @ w[2:10], axis=0, chunks=2)  # a slice of each chunk's input
        b = sf.stream((x @ w)[:, 1:7], axis=0, chunks=4)  # a streamed slice
        c = (x @ sf.shard(w, axis=0))[3:9, ::2]  # of a pending sum (S1: the sum is reduced after the slice)
        return a, b, c

    got = sf.jit(f, mesh=mesh)(x, w)
    for g, want in zip(got, (x[:, 2:10] @ w[2:10], (x @ w)[:, 1:7], (x @ w)[3:9, ::2])):
        compare(g.gather(), want, "float64")


def test_a_stream_along_a_cut_axis_is_refused_or_made_whole():
    mesh, x = mesh_of(4), np.random.default_rng(3).standard_normal((16, 8))
    whole = sf.jit(lambda v: sf.stream(v[2:10] * 2.0, axis=0), mesh=mesh)  # one chunk per index: made whole
    compare(whole(x).gather(), x[2:10] * 2, "float64")
    chunked = sf.jit(lambda v: sf.stream(sf.shard(v, axis=0)[2:10], axis=0, chunks=2), mesh=mesh)
    with pytest.raises(ValueError, match=r"sf.stream\(..., chunks=\) of \w+ along the axis its slice_array cuts"):
        chunked.lower(x)


REFUSED = [
    (lambda x: x[:, ::0], ValueError, r"slice step cannot be zero"),
    (lambda x: x[1.0], TypeError, r"an index takes ints, slices, '...', None \(NumPy's basic indexing\) and one "
                                  r"integer array \(x\[ids\], x\[:, ids\]\), got float"),
    (lambda x: x[[0, 1]], TypeError, r"got list \[0, 1\]; write a list of indices as an array, np.array"),
    (lambda x: x[np.array([True] * 8)], TypeError, r"with a boolean mask \(ndarray\): .*sf.where\(mask, x, 0\)"),
    (lambda x: x[x > 0], TypeError, r"boolean mask .*sf\.where\(mask, x, 0\)"),  # (a traced mask: was take's ids)
    (lambda x: x[0, 0, 0], IndexError, r"too many indices for an array of shape \(8, 12\): 3 given"),
    (lambda x: x[8], IndexError, r"index 8 is out of bounds for axis 0 with size 8"),
    (lambda x: x[:, -13], IndexError, r"index -13 is out of bounds for axis 1 with size 12"),
    (lambda x: x[..., 1, ...], IndexError, r"single ellipsis"),
]


@pytest.mark.parametrize("expr, error, message", REFUSED)
def test_bad_indexes_are_refused_at_trace_time(expr, error, message):
    f = sf.jit(expr, mesh=mesh_of(4))
    with pytest.raises(error, match=message):
        f.lower(sf.TensorSpec((8, 12), "float64"))  # (nothing runs)
    outside = message.replace(r"x \(shape \(8, 12\), float64\)", r"an sf.Array of shape \(8, 12\)")
    with pytest.raises(error, match=outside):  # (outside jit: the same refusal, before any plan)
        expr(sf.shard(np.ones((8, 12)), axis=0, mesh=mesh_of(4)))


def test_a_traced_bound_is_refused_at_trace_time():
    with pytest.raises(sf.ConcretizationError, match=r"use as an int"):
        sf.jit(lambda x: x[x.sum():], mesh=mesh_of(4)).lower(sf.TensorSpec((8, 12), "float64"))


# ---- matmul with NumPy's broadcasting ---------------------------------------------------------------

# name -> (shape of a, shape of b, axis of a to shard or None, axis of b to shard or None)
MATMULS = {
    "(2,3) @ (4,3,5)": ((8, 3), (4, 3, 5), 0, None), "(m,k) @ (b,k,n) b sharded": ((6, 3), (4, 3, 5), None, 0),
    "(b,1,m,k) @ (1,h,k,n)": ((4, 1, 6, 3), (1, 2, 3, 5), 0, None),
    "(b,1,m,k) @ (1,h,k,n) h sharded": ((2, 1, 6, 3), (1, 4, 3, 5), None, 1),
    "(b,h,m,k) @ (h,k,n)": ((2, 4, 6, 3), (4, 3, 5), 1, 0), "(h,m,k) @ (b,h,k,n)": ((4, 6, 3), (2, 4, 3, 5), 0, 1),
    "(b,1,m,k) @ (b,h,k,n)": ((2, 1, 8, 3), (2, 4, 3, 5), 2, 1), "(1,m,k) @ (b,k,n)": ((1, 8, 3), (4, 3, 5), 1, 0),
    "(k,) @ (k,n)": ((3,), (3, 8), None, 1), "(m,k) @ (k,)": ((8, 3), (3,), 0, None), "(k,) @ (k,)": ((4,), (4,), 0, 0),
    "(k,) @ (b,k,n)": ((3,), (4, 3, 5), None, 0), "(b,m,k) @ (k,)": ((4, 6, 3), (3,), 0, None),
    "(b,m,k) @ (k,n) as before": ((4, 8, 3), (3, 5), 1, None),
}


def check_matmul(name, mesh, dtype, jit, rng):
    sa, sb, ka, kb = MATMULS[name]
    a, b = random(sa, dtype, rng), random(sb, dtype, rng)
    pa = sf.shard(a, axis=ka, mesh=mesh) if ka is not None else a
    pb = sf.shard(b, axis=kb, mesh=mesh) if kb is not None else b
    got = sf.jit(lambda x, y: x @ y, mesh=mesh)(pa, pb) if jit else \
        (pa if ka is not None else sf.replicate(a, mesh=mesh)) @ pb
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert got.shape == want.shape and got.dtype == a.dtype, (name, got.shape, got.dtype)
    compare(got.gather(), want, dtype, name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul_broadcasts_as_numpy(name, jit):
    check_matmul(name, mesh_of(4), "float64", jit, np.random.default_rng(4))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_matmul_broadcasts_in_every_dtype(dtype):
    check_matmul("(b,1,m,k) @ (1,h,k,n)", mesh_of(4), dtype, True, np.random.default_rng(5))


def test_broadcast_matmul_of_a_head_sharded_weight_is_local():
    """x (m, k) @ w (heads, k, n) with heads sharded: the heads join w's columns, no communication."""
    plan = sf.jit(lambda x, w: x @ sf.shard(w, axis=0), mesh=mesh_of(4)).lower(
        sf.TensorSpec((6, 3), "float32"), sf.TensorSpec((4, 3, 5), "float32"))
    assert plan.collectives() == {}
    assert "Matmul c <- x_r_r @ w_1_t_r" in str(plan) and "c_r_t: f32[4:DIDx, 6, 5] = Transpose c_r" in str(plan)


@pytest.mark.parametrize("a, b, message", [
    ((2, 6, 3), (4, 3, 5), r"matmul x \(shape \(2, 6, 3\), float64\) @ w \(shape \(4, 3, 5\), float64\): the batch "
                           r"axes \(2,\) and \(4,\) do not broadcast"),
    ((6, 3), (4, 5), r"matmul x @ w: contraction sizes differ: x\(6, 3\) has K=3 on its last axis, w\(4, 5\) has K=4"),
    ((6, 3), (4,), r"w\(4,\) has K=4 on its only axis"),
    ((), (4,), r"matmul of a 0-d operand, x\(\) @ w\(4,\) \(NumPy refuses it too\): write x \* w"),
])
def test_matmul_mistakes_are_refused_at_trace_time(a, b, message):
    f = sf.jit(lambda x, w: x @ w, mesh=mesh_of(4))
    with pytest.raises(ValueError, match=message):
        f.lower(sf.TensorSpec(a, "float64"), sf.TensorSpec(b, "float64"))
