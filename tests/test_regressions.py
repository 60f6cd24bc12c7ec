"""Programs the differential test (tests/test_differential.py) found wrong or refused with a
compiler error, each checked against NumPy on fresh random inputs (outputs poisoned)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf


def rng():
    return np.random.default_rng()


def check(f, mesh, args, ref, streams=1):
    out = sf.jit(f, mesh=mesh, streams=streams)(*args)
    np.testing.assert_allclose(out.gather(), ref, rtol=1e-12, atol=1e-12)
    return out


def test_a_restream_along_another_axis_of_the_same_extent_waits_for_the_whole_value():
    # the second loop (axis 1, extent 3) joined the first (axis 0, extent 3): chunk shapes crossed
    mesh = sf.DeviceMesh(4, backend="numpy")
    x, w = rng().standard_normal((3, 3, 4)), rng().standard_normal((4, 2))
    check(lambda x, w: sf.stream(sf.replicate(sf.stream(x @ w, 0)), 1), mesh, (x, w), x @ w)


def test_a_streamed_reshape_that_merges_axes_is_made_whole():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = rng().standard_normal((2, 3))
    check(lambda x: sf.stream(x.reshape(6), 0), mesh, (x,), x.reshape(6))


def test_a_streamed_shard_slice_writes_each_chunk_into_its_result():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = rng().standard_normal((4, 2))
    out = check(lambda x: sf.stream(sf.shard(x, 0), 0, chunks=1), mesh, (sf.replicate(x, mesh=mesh),), x)
    assert out.placements == (sf.Shard(0),)


def test_split_stream_views_do_not_inherit_their_inputs_schedule():
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = rng().standard_normal((4, 3))

    def f(x):
        v = sf.shard(sf.replicate(sf.stream(x, 1)), 0, over="DIDy")
        return sf.stream(v, 0, chunks=1)
    check(f, mesh, (sf.shard(x, axis=0, over="DIDy", mesh=mesh),), x)
    y = rng().standard_normal((2, 4, 4))

    def g(x):
        v = sf.stream(sf.shard(sf.replicate(x.reshape(8, 4)), 1, over=("DIDy", "DIDx")), 0)
        return sf.stream(sf.shard(sf.replicate(v), 0, over="DIDy"), 1)
    check(g, mesh, (y,), y.reshape(8, 4))


def test_a_reshape_of_a_strided_piece_is_staged_through_a_copy_the_plan_shows():
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = rng().standard_normal((2, 4, 4))

    def f(x):
        v = sf.shard(sf.shard(sf.replicate(x.reshape(8, 4)), 0, over="DIDy"), 1, over="DIDx")
        return sf.shard(v.T, 0, over="DIDy").reshape(32)
    check(f, mesh, (x,), x.reshape(8, 4).T.reshape(32))
    plan = sf.jit(f, mesh=mesh).lower(x)
    assert "_contig = Allocate" in str(plan) and "Copy" in str(plan), plan


def test_a_view_that_needs_no_copy_gets_none():
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = rng().standard_normal((4, 6))
    plan = sf.jit(lambda x: (sf.shard(x, 0) * 2.0).reshape(2, 2, 6), mesh=mesh).lower(x)
    assert "_contig" not in str(plan), plan
    check(lambda x: (sf.shard(x, 0) * 2.0).reshape(2, 2, 6), mesh, (x,), (2 * x).reshape(2, 2, 6))


def test_ring_on_anything_but_a_matmul_result_is_refused_at_compile_time():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x, w = rng().standard_normal((4, 4)), rng().standard_normal((4, 4))
    f = sf.jit(lambda x, w: x @ sf.stream(w, 0, algorithm="ring"), mesh=mesh)
    with pytest.raises(ValueError, match="algorithm='ring' streams the result of a matmul"):
        f.lower(x, sf.shard(w, axis=0, mesh=mesh))


def test_a_streamed_reshard_between_mesh_axes_is_refused_clearly():
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = rng().standard_normal((4, 4))
    f = sf.jit(lambda x: sf.shard(sf.stream(x, 0, chunks=1), 0, over=("DIDy", "DIDx")), mesh=mesh)
    with pytest.raises(ValueError, match="sharded over different mesh axes"):
        f.lower(sf.shard(x, axis=0, over="DIDy", mesh=mesh))


def test_a_streamed_reshape_that_splits_an_axis_writes_each_chunk_into_its_result():
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = rng().standard_normal((2, 4, 2))
    check(lambda x: sf.replicate(sf.stream(x.reshape(2, 2, 2, 2), 0)), mesh, (x,), x.reshape(2, 2, 2, 2))


@pytest.mark.parametrize("op", ["add", "mul"])
def test_a_broadcast_operand_of_a_split_stream_axis_keeps_numpys_alignment(op):
    # the (4, 2, 1) operand was aligned with the split axes of the (4, 2, 4, 2, 1) chunked result
    mesh = sf.DeviceMesh(4, backend="numpy")
    r = rng()
    x0, x1, x2, x3 = r.standard_normal((2, 4, 4)), r.standard_normal((4, 8)), r.standard_normal(8), r.standard_normal((4, 2, 1))
    fn = (lambda a, b: a + b) if op == "add" else (lambda a, b: a * b)
    check(lambda x0, x1, x2, x3: sf.stream(fn(sf.linear(x0, x1, x2).transpose(1, 0, 2), x3), 2), mesh,
          (x0, x1, sf.shard(x2, axis=0, mesh=mesh), x3), fn((x0 @ x1 + x2).transpose(1, 0, 2), x3))
    y0, y1, y2 = r.standard_normal((2, 4, 4)), r.standard_normal((4, 4)), r.standard_normal((2, 4, 1))
    check(lambda a, b, c: sf.stream(fn(a @ b, c), 2), mesh, (y0, sf.shard(y1, axis=1, mesh=mesh), y2), fn(y0 @ y1, y2))


def test_a_partial_operand_times_a_value_sharded_over_the_same_mesh_axis_gathers_the_other_first():
    # P(DIDy) * S(0 over DIDy) claimed a layout both sharded and pending over DIDy: wrong numbers
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = rng().standard_normal((2, 4, 4))
    f = lambda x: sf.replicate(sf.shard(x.sum(0), 0, over="DIDy").sum(0) * x)  # noqa: E731
    check(f, mesh, (sf.shard(x, axis=0, over="DIDy", mesh=mesh),), x.sum(0).sum(0) * x)


def test_a_streamed_input_used_only_inside_the_ring_loop_is_made():
    mesh = sf.DeviceMesh(4, backend="numpy")
    r = rng()
    x0, x1, x2, x3 = r.standard_normal((2, 4, 4)), r.standard_normal((4, 4)), r.standard_normal((4, 2)), r.standard_normal((2, 2))

    def f(x0, x1, x2, x3):
        g = sf.gelu(sf.shard(x0 @ x1 @ x2, 1, over="DIDx"))
        return sf.stream(g @ sf.stream(x3, 0), 1, algorithm="ring")
    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # noqa: E731
    check(f, mesh, (x0, x1, x2, x3), gelu(x0 @ x1 @ x2) @ x3)


def test_ring_with_b_sharded_on_k_is_refused_at_compile_time():
    mesh = sf.DeviceMesh(4, backend="numpy")
    r = rng()
    x0, x1, x2 = r.standard_normal((2, 4, 4)), r.standard_normal((4, 4)), r.standard_normal((4, 2))
    f = sf.jit(lambda x0, x1, x2: sf.stream(sf.gelu(sf.shard(x0 @ x1, 1, over="DIDx")) @ sf.shard(x2, 0, over="DIDx"),
                                            1, algorithm="ring"), mesh=mesh)
    with pytest.raises(ValueError, match="whole along K"):
        f.lower(x0, x1, x2)
