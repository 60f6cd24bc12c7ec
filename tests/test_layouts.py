"""Layouts the front end must never get wrong: streamed axes that are also sharded, inputs
placed differently from what the function annotates, and the verifier invariant that would
have caught those (a Slice never cuts a sharded axis; every sharded extent divides evenly)."""
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import Op
from cases import assert_close
from shardfuse.ir import Idx, Instr, TensorType, Value
from shardfuse.layout import Layout
from shardfuse.passes.verify import PlanError, verify
from shardfuse.streams import MAIN, Stream


def _mesh(d=4):
    return sf.DeviceMesh(d, backend="numpy")


@pytest.mark.parametrize("op", ["matmul", "scale", "batched", "batched_sum"])
def test_stream_axis_that_an_input_shards_without_chunks(op):
    """chunks omitted on an axis whose input is sharded: one chunk per index of each shard."""
    mesh, rng = _mesh(), np.random.default_rng()
    x = rng.standard_normal((8, 4, 6) if op.startswith("batched") else (16, 8))
    w = rng.standard_normal((6, 5) if op.startswith("batched") else (8, 6))
    bodies = {
        "matmul": (lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0), lambda: x @ w),
        "scale": (lambda x, w: sf.stream(sf.shard(x, axis=0) * 2.0, axis=0), lambda: x * 2.0),
        "batched": (lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0), lambda: x @ w),
        "batched_sum": (lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0).sum(0), lambda: (x @ w).sum(0)),
    }
    fn, ref = bodies[op]
    out = sf.jit(fn, mesh=mesh)(x, w)
    assert_close(out.gather(), ref(), "float64")


def test_seed_function_on_an_input_already_sharded_on_the_stream_axis():
    """The seed shards axis 1; an argument sharded on axis 0 (the stream axis) is resharded
    whole before the loop, never sliced one row of a 4-way split at a time."""
    mesh, rng = _mesh(), np.random.default_rng()
    A, B = rng.standard_normal((8, 4, 16, 32)), rng.standard_normal((32, 24))
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh)
    out = f(sf.shard(A, axis=0, mesh=mesh), B)
    assert_close(out.gather(), A @ B, "float64")
    plan = next(iter(f.cached_plans().values()))
    # before the loop; its send (block r of axis 1 of each piece) staged, printed
    assert "Copy a_staged <- a\n  a2a = AllToAll a_1 <- a_staged, team=DIDx, axis=0, to_axis=1\n" in str(plan)


def test_verify_refuses_a_slice_across_shards():
    mesh = _mesh()
    x = Value("x", TensorType((16, 8), "float64", Layout(("DIDx", None), mesh=mesh)))
    xi = Value("x_i", TensorType((1, 8), "float64", Layout(("DIDx", None), mesh=mesh)))
    from shardfuse.ir import Program

    loop = Instr(Op.FOR, attrs={"var": "i", "extent": 16},
                 body=(Instr(Op.SET_STREAM, attrs={"stream": Stream(0)}),
                       Instr(Op.SLICE, (xi,), (x,), {"axis": 0, "index": Idx("i")}),
                       Instr(Op.SET_STREAM, attrs={"stream": MAIN})))
    prog = Program("bad", mesh, (x,), (x,), (loop,), 1, ("handmade",))
    with pytest.raises(PlanError, match="x_i.*extent 1 is sharded over DIDx"):
        verify(prog)


# ---- one tensor axis sharded over several mesh axes; every 2-D / 3-D reshard ------------------

def _place(x, spec):
    """spec: per tensor axis, None or a mesh axis entry (a name or a tuple of names)."""
    for ax, over in enumerate(spec):
        if over is not None:
            x = sf.shard(x, axis=ax, over=over)
    return x if any(spec) else sf.replicate(x)


def placer(spec):
    return lambda x: _place(x, spec)


def layout_specs(mesh, ndim):
    """Every placement of an ndim-D value on a 2-D mesh: each mesh axis on some tensor axis or
    none, and for two mesh axes on one tensor axis both orders."""
    y, x = mesh.axis_names
    out = set()
    for ay in [None, *range(ndim)]:
        for ax in [None, *range(ndim)]:
            spec = [None] * ndim
            if ay is not None and ay == ax:
                for order in ((y, x), (x, y)):
                    spec[ay] = order
                    out.add(tuple(spec))
                continue
            if ay is not None:
                spec[ay] = y
            if ax is not None:
                spec[ax] = x
            out.add(tuple(spec))
    return sorted(out, key=str)


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)])
def test_every_2d_reshard_runs_and_is_exact(shape):
    mesh = sf.DeviceMesh(shape, backend="numpy")
    X = np.random.default_rng().standard_normal((12, 12))
    specs = layout_specs(mesh, 2)
    placed = {s: sf.jit(placer(s), mesh=mesh)(X) for s in specs}
    for src in specs:
        for dst in specs:
            out = sf.jit(placer(dst), mesh=mesh)(placed[src])
            assert out.sharding.axes == tuple(dst), (src, dst)
            np.testing.assert_array_equal(out.gather(), X, err_msg=f"{src} -> {dst}")


@pytest.mark.parametrize("src, dst, counts", [
    ((None, "DIDx"), ("DIDy", None), {"allgather": 1}),           # [R, S(0)] -> [S(0), R]
    (("DIDy", "DIDx"), ("DIDx", "DIDy"), {"allgather": 1, "alltoall": 1}),  # [S(0), S(1)] -> [S(1), S(0)]
    ((("DIDy", "DIDx"), None), (None, ("DIDy", "DIDx")), {"allgather": 1, "alltoall": 1}),
    ((("DIDy", "DIDx"), None), ("DIDy", "DIDx"), {"alltoall": 1}),
    (("DIDx", None), (("DIDx", "DIDy"), None), {}),                 # a local slice only
])
def test_2d_reshard_collective_counts(src, dst, counts):
    """Fewest collectives (DTensor's count or fewer) and the table's steps."""
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    X = np.random.default_rng().standard_normal((8, 8))
    a = sf.jit(lambda x: _place(x, src), mesh=mesh)(X)
    f = sf.jit(lambda x: _place(x, dst), mesh=mesh)
    out = f(a)
    assert next(iter(f.cached_plans().values())).collectives() == counts
    np.testing.assert_array_equal(out.gather(), X)


def test_3d_mesh_reverse_placements():
    """[S(0), S(1), S(2)] -> [S(2), S(1), S(0)] on a 2 x 2 x 2 mesh."""
    mesh = sf.DeviceMesh((2, 2, 2), backend="numpy")
    X = np.random.default_rng().standard_normal((4, 4, 4))
    a = sf.jit(lambda x: _place(x, ("DIDz", "DIDy", "DIDx")), mesh=mesh)(X)
    f = sf.jit(lambda x: _place(x, ("DIDx", "DIDy", "DIDz")), mesh=mesh)
    out = f(a)
    assert [str(p) for p in out.placements] == ["S(2)", "S(1)", "S(0)"]
    assert sum(next(iter(f.cached_plans().values())).collectives().values()) == 2
    np.testing.assert_array_equal(out.gather(), X)


@pytest.mark.parametrize("over, blocks", [(("dp", "tp"), [0, 1, 2, 3]), (("tp", "dp"), [0, 2, 1, 3])])
def test_shard_over_a_tuple_of_mesh_axes(over, blocks):
    """sf.shard(x, axis=0, over=("dp", "tp")): device (dp, tp) holds block dp * 2 + tp (the
    first mesh axis outermost, as JAX's P(("dp", "tp"))); ("tp", "dp") the transposed order."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    X = np.random.default_rng().standard_normal((8, 3))
    a = sf.shard(X, axis=0, over=over, mesh=mesh)
    assert [str(p) for p in a.placements] == (["S(0)", "S(0)"] if over == ("dp", "tp") else ["_S(0, 2)", "S(0)"])
    for d, b in zip(mesh.devices, blocks):
        np.testing.assert_array_equal(a.shards[d], X[2 * b:2 * b + 2])
    np.testing.assert_array_equal(a.gather(), X)


def test_contraction_over_a_tuple_sharded_axis_reduces_over_both():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng()
    A, B = rng.standard_normal((6, 8)), rng.standard_normal((8, 5))
    f = sf.jit(lambda a, b: sf.shard(a, axis=1, over=("dp", "tp")) @ sf.shard(b, axis=0, over=("dp", "tp")),
               mesh=mesh)
    plan = f.lower(sf.TensorSpec(A.shape, "float64"), sf.TensorSpec(B.shape, "float64"))
    assert "a: f64[6, 8:(dp,tp)]" in str(plan)
    assert plan.collectives() == {"allreduce": 2}
    assert_close(f(A, B).gather(), A @ B, "float64")


@pytest.mark.parametrize("over, match", [
    (("DIDx", "DIDx"), "distinct"), ((), "distinct"), (("DIDx", "nope"), "unknown mesh axis 'nope'"),
    (("DIDy", "DIDx", "DIDy"), "distinct"), (3, "mesh axis name"),
])
def test_bad_over_is_refused(over, match):
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = np.ones((8, 8))
    with pytest.raises(ValueError, match=match):
        sf.shard(x, axis=0, over=over, mesh=mesh)
    with pytest.raises(ValueError, match=match):
        sf.jit(lambda v: sf.shard(v, axis=0, over=over), mesh=mesh)(x)


def test_a_tuple_needs_its_product_to_divide():
    mesh = sf.DeviceMesh((2, 3), backend="numpy")
    with pytest.raises(ValueError, match="6 devices, which does not divide 8"):
        sf.shard(np.ones((8, 2)), axis=0, over=("DIDy", "DIDx"), mesh=mesh)


# ---- smaller cases that used to crash or refuse -------------------------------------------------

def test_stream_a_transposed_shard():
    """sf.stream(sf.shard(x, 0).T, axis=1): a view streamed; each chunk is copied into the result."""
    mesh, X = _mesh(), np.random.default_rng().standard_normal((8, 12))
    out = sf.jit(lambda x: sf.stream(sf.shard(x, 0).T, axis=1), mesh=mesh)(X)
    np.testing.assert_array_equal(out.gather(), X.T)


@pytest.mark.parametrize("ax", [0, 1, 2])
def test_stream_a_sum_and_a_transpose_with_chunks(ax):
    mesh, X = _mesh(2), np.random.default_rng().standard_normal((4, 6, 8))
    keep = [a for a in range(3) if a != ax]
    f = sf.jit(lambda x: sf.stream(x.sum(ax), axis=1, chunks=2), mesh=mesh)
    assert_close(f(X).gather(), X.sum(ax), "float64")
    g = sf.jit(lambda x: sf.stream(x.transpose(ax, *keep), axis=0, chunks=2), mesh=mesh)
    np.testing.assert_array_equal(g(X).gather(), X.transpose(ax, *keep))


def test_reshape_that_regroups_axes_of_a_contiguous_value():
    mesh, Y = _mesh(), np.random.default_rng().standard_normal((16, 32))
    out = sf.jit(lambda y: (y * 2.0).reshape(32, 16), mesh=mesh)(Y)
    assert_close(out.gather(), (Y * 2.0).reshape(32, 16), "float64")


@pytest.mark.parametrize("fn, shape", [
    (lambda a, b: sf.stream(a @ b, axis=0, chunks=2), (0, 4)),
    (lambda a, b: sf.stream(a * 2.0, axis=1, chunks=2), (0, 8)),
])
def test_zero_size_extents_with_chunks(fn, shape):
    mesh = _mesh()
    out = sf.jit(fn, mesh=mesh)(np.ones((0, 8)), np.ones((8, 4)))
    assert out.gather().shape == shape


def test_too_many_stream_chunks_are_refused_before_binding():
    f = sf.jit(lambda v: sf.stream(v * 2.0, axis=0), mesh=_mesh())
    with pytest.raises(ValueError, match=r"streamed in 20000 chunks: at most 1024"):
        f.lower(sf.TensorSpec((20000, 2), "float64"))


def test_contraction_sharded_differently_in_each_operand():
    """a's K over DIDx, b's K over DIDy: b is resharded to DIDx and only DIDx pends a sum (the
    DIDy Allreduce once doubled the result).  Found by tests/test_differential.py."""
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    rng = np.random.default_rng()
    A, B = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    f = sf.jit(lambda a, b: a @ b, mesh=mesh, streams=1)
    out = f(sf.shard(A, axis=1, over="DIDx", mesh=mesh), sf.shard(B, axis=0, over="DIDy", mesh=mesh))
    assert_close(out.gather(), A @ B, "float64")
    assert next(iter(f.cached_plans().values())).collectives() == {"allgather": 1, "allreduce": 1}


def test_layout_repr_names_only_what_it_holds():
    """An sf.Array's `.sharding` printed `mesh=None` (a probe read it as "on no mesh"): None is the
    array's own mesh, so the repr leaves it out, and what it prints builds the same Layout."""
    mesh = _mesh()
    x = sf.shard(np.arange(32, dtype=np.float32).reshape(8, 4), axis=0, mesh=mesh)
    assert repr(x.sharding) == "Layout(('DIDx', None))"
    sub = sf.DeviceMesh(2, backend="numpy")
    for lay in (Layout(("DIDx", None)), Layout((None, ("a", "b")), partial=("c",))):
        assert eval(repr(lay), {"Layout": Layout}) == lay
    assert "mesh=" in repr(Layout(("DIDx",), mesh=sub)) and "partial=('c',)" in repr(Layout((None,), partial=("c",)))
