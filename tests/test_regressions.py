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


# ---- found by a new-user probe (2026-12-05) --------------------------------------------------

@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("d", [1, 2])
def test_a_staged_copy_inside_a_stream_loop_gets_a_buffer_per_stream(d, streams):
    # the staging copy of a strided reshape was allocated inside the loop and never bound
    x = rng().standard_normal((2, 3, 2))
    check(lambda x: sf.stream(x.transpose(1, 0, 2).reshape(6, 2), axis=1), sf.DeviceMesh(d, backend="numpy"),
          (x,), x.transpose(1, 0, 2).reshape(6, 2), streams)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_dividing_by_a_small_scalar_divides(dtype):
    # x / c was x * (1 / c), and 1 / c overflowed the dtype: inf where NumPy is finite.  c is rounded
    # to x's dtype first, as NumPy 2 (NEP 50) and JAX round a Python float: float16 1e-5 is the
    # subnormal 1.0014e-05, and 1e5 is inf in float16, so there x / 1e5 is 0 and x * 1e5 inf, as NumPy's
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = (0.1 + 0.4 * rng().random((4, 2))).astype(dtype)  # x / c within float16's range
    c = 1e-5 if dtype == np.float16 else 1e-310  # 1 / c overflows the dtype
    x = x if dtype == np.float16 else x * 1e-300
    with np.errstate(over="ignore"):
        want = x / c
    assert np.isfinite(want).all()
    for got in (sf.jit(lambda a: a / c, mesh=mesh)(x), sf.shard(x, 0, mesh=mesh) / c):
        np.testing.assert_array_equal(got.gather(), want)
    if dtype == np.float16:
        y, z = x * 1000, x / 1000
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(sf.jit(lambda a: a / 1e5, mesh=mesh)(y).gather(), y / 1e5)
            np.testing.assert_array_equal(sf.jit(lambda a: a * 1e5, mesh=mesh)(z).gather(), z * 1e5)
    with np.errstate(divide="ignore"):
        assert np.isinf(sf.jit(lambda a: a / 0, mesh=mesh)(x).gather()).all()  # as NumPy, not ZeroDivisionError


@pytest.mark.parametrize("sharded", [False, True])
def test_16_bit_sums_and_means_accumulate_in_float32_whatever_the_layout(sharded):
    import ml_dtypes

    mesh = sf.DeviceMesh(4, backend="numpy")
    x = (30 + rng().random((8, 4096))).astype(np.float16)  # its sums overflow float16, its means do not
    y = (1 + 0.1 * rng().random((8, 4096))).astype(ml_dtypes.bfloat16)
    place = (lambda a: sf.shard(a, 1)) if sharded else (lambda a: a)
    mean = sf.jit(lambda a: place(a).mean(1), mesh=mesh)(x).gather()
    np.testing.assert_allclose(mean.astype(np.float64), x.astype(np.float64).mean(1), rtol=2 ** -10)
    total = sf.jit(lambda a: place(a).sum(1), mesh=mesh)(y).gather()  # NumPy's own bfloat16 sum gives 512
    np.testing.assert_allclose(total.astype(np.float64), y.astype(np.float64).sum(1), rtol=2 ** -7)
    assert np.isnan(sf.jit(lambda a: a.mean(1), mesh=mesh)(np.ones((3, 0))).gather()).all()


def test_ring_over_a_batch_axis_with_a_batched_b_is_refused_before_it_runs():
    mesh = sf.DeviceMesh(2, backend="numpy")
    a, b = rng().standard_normal((2, 4, 3)), rng().standard_normal((2, 3, 5))
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, 0) @ b, axis=0, algorithm="ring"), mesh=mesh)
    with pytest.raises(ValueError, match=r"algorithm='ring' streams the batch axis .* has batch axes too"):
        f.lower(a, b)
    g = sf.jit(lambda a, b: sf.stream(a @ b, axis=1, chunks=2), mesh=mesh)
    with pytest.raises(ValueError, match=r"on the row axis 1 of c = a @ b, whose B has batch axes, is not supported"):
        g.lower(a, b)
    check(lambda a, b: sf.stream(sf.shard(a, 0) @ b, axis=0), mesh, (a, b), a @ b)  # the batch axis streams


@pytest.mark.parametrize("between", [lambda v: v, sf.replicate, lambda v: v * 1.0])
def test_a_reshaped_replicated_value_is_sharded_after_the_reshape(between):
    # the sharding was pushed into the reshape's input, whose rows (3) two devices do not divide
    x = rng().standard_normal((3, 4))
    out = check(lambda x: sf.shard(between(x.reshape(12)), axis=0), sf.DeviceMesh(2, backend="numpy"), (x,),
                x.reshape(12))
    assert out.placements == (sf.Shard(0),)


def test_a_pending_sum_times_a_weight_sharded_on_k_is_reduce_scattered_first():
    # the matmul asked for its pending input sharded on K while still pending over that mesh axis
    mesh = sf.DeviceMesh(2, backend="numpy")
    a, b = rng().standard_normal((2, 4, 4))
    f = lambda a, b: (sf.shard(a, axis=1) @ sf.shard(b, axis=0)) @ b  # noqa: E731
    check(f, mesh, (a, b), (a @ b) @ b)
    assert sf.jit(f, mesh=mesh).lower(a, b).collectives() == {"reduce_scatter": 1, "allreduce": 1}


@pytest.mark.parametrize("case", ["matmul", "sum"])
def test_sums_pending_over_two_mesh_axes_into_a_k_sharded_matmul_are_never_wrong(case):
    # the long differential profile found these giving twice the value once a pending input was
    # reduced for the matmul but its output still pended over the other axis: now refused
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    if case == "matmul":
        x0, x1, x2 = rng().standard_normal((2, 4)), rng().standard_normal((4, 4)), rng().standard_normal((4, 4))
        f, args, ref = (lambda x0, x1, x2: (sf.shard(x0, 1, over=("DIDy", "DIDx")) @ x1) @ x2,
                        (x0, x1, sf.shard(x2, axis=0, over="DIDy", mesh=mesh)), x0 @ x1 @ x2)
    else:
        y0, y1 = rng().standard_normal((4, 4, 4)), rng().standard_normal((4, 4))
        f, args, ref = (lambda x0, x1: x0.sum(0).T.reshape(2, 2, 4) @ x1,
                        (sf.shard(y0, axis=0, over=("DIDy", "DIDx"), mesh=mesh), sf.shard(y1, axis=0, over="DIDy", mesh=mesh)),
                        y0.sum(0).T.reshape(2, 2, 4) @ y1)
    try:
        out = sf.jit(f, mesh=mesh)(*args)
    except ValueError as e:  # a refusal, at compile time, is fine
        assert "cannot reshard" in str(e)
        return
    np.testing.assert_allclose(out.gather(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunks", [2, 3])
def test_streaming_a_value_on_a_sub_mesh_keeps_it_there(chunks):
    # the stream annotation put the product on the whole mesh: each chunk gathered to device 0 and
    # broadcast to all four, cut into 4 shards though its sub-mesh has 2 (a crash under mpiexec -n 4)
    mesh = sf.DeviceMesh(4, backend="numpy")
    sub = mesh.submesh([3, 2])
    x, w = rng().standard_normal((12, 12)), rng().standard_normal((12, 6))

    def f(x, w):
        return sf.stream(sf.shard(x, axis=0, mesh=sub) @ sf.replicate(w, mesh=sub), axis=0, chunks=chunks)
    check(f, mesh, (x, w), x @ w)
    assert sf.jit(f, mesh=mesh).lower(x, w).collectives() == {"allgather": chunks}


def test_a_sub_mesh_argument_streams_on_its_sub_mesh_and_annotations_compose_either_way():
    mesh = sf.DeviceMesh(4, backend="numpy")
    sub = mesh.submesh([2, 3])
    x, w = rng().standard_normal((8, 8)), rng().standard_normal((8, 4))
    t = sf.jit(lambda v: sf.to_mesh(v, sub, axis=0), mesh=mesh)(x)  # an argument living on the sub-mesh
    out = sf.jit(lambda a, b: sf.stream(a @ sf.replicate(b, mesh=sub), axis=0, chunks=2), mesh=mesh)(t, w)
    assert out.sharding.mesh == sub
    np.testing.assert_allclose(out.gather(), x @ w, rtol=1e-12)
    y = lambda v: sf.shard(v, 0, mesh=sub) * 2.0  # noqa: E731
    for f in (lambda v: sf.stream(sf.shard(y(v), 1), 0, chunks=2), lambda v: sf.shard(sf.stream(y(v), 0, chunks=2), 1)):
        out = sf.jit(f, mesh=mesh)(x)
        assert out.sharding.mesh is None and out.placements == (sf.Shard(1),)  # the same in either order
        np.testing.assert_allclose(out.gather(), 2 * x, rtol=1e-12)
    ring = sf.jit(lambda v, b: sf.stream(sf.shard(v, 0, mesh=sub) @ sf.replicate(b, mesh=sub), 0, algorithm="ring"),
                  mesh=mesh)
    with pytest.raises(ValueError, match="algorithm='ring' on a value of a sub-mesh .* is not supported"):
        ring.lower(x, w)


def test_a_negated_chunk_of_a_tuple_sharded_stream_is_right():
    # the long differential profile: NumPy 2.4.6's float64 `negative` misreads some strided views
    # (here each device's chunk), so Neg is x * -1
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    x = rng().standard_normal((3, 2, 4))
    f = lambda x: sf.shard(sf.stream(-sf.replicate(x), 1, chunks=2), 2, over=("DIDy", "DIDx"))  # noqa: E731
    check(f, mesh, (sf.shard(x, axis=2, over="DIDy", mesh=mesh),), -x)
    check(f, mesh, (x,), -x)


@pytest.mark.parametrize("w_spec", [("DIDx", None), ("DIDy", None), (None, "DIDx"), ("DIDx", "DIDy")])
def test_a_sum_pending_over_two_mesh_axes_into_a_contraction_sharded_over_one(w_spec):
    """A review: v = x sharded over (DIDy, DIDx) on its contracted axis @ w pends sums over both mesh
    axes; w.T @ v with w's rows over DIDx asked for v pending over DIDx *and* sharded over it ("cannot
    reshard ('P', 'P') -> ('P', 'S(0)')"): the sums over K's mesh axis are reduce-scattered into it, the
    other carried on.  Values and gradients against float64 NumPy and central differences."""
    from cases import directional
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    r = rng()
    x, w = r.standard_normal((8, 8)), r.standard_normal((8, 8))

    def f(x, w):
        return w.T @ (sf.shard(x, axis=1, over=("DIDy", "DIDx")) @ w)
    ws = sf.distribute(w, mesh, w_spec)
    np.testing.assert_allclose(np.asarray(sf.jit(f, mesh=mesh)(x, ws)), w.T @ (x @ w), rtol=1e-12, atol=1e-12)
    g = sf.jit(sf.grad(lambda p: (f(p["x"], p["w"]) ** 2).sum()), mesh=mesh)({"x": x, "w": ws})
    numeric, analytic = directional(lambda p: float(((p["w"].T @ (p["x"] @ p["w"])) ** 2).sum()), {"x": x, "w": w}, g, r)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)


@pytest.mark.parametrize("x_spec, w_spec", [(("DIDx", "DIDy", None), (None, "DIDx")), ((None, "DIDy", None), (None, "DIDx")),
                                            ((None, "DIDy", None), None)])
def test_the_gradient_of_a_token_flatten_with_an_inner_axis_sharded(x_spec, w_spec):
    """A review: [B, S, H] -> [B * S, H] with S sharded (gathered first, the README's rule) ran forward,
    but its gradient, a reshape back of a value pending sums, was refused ("crosses the boundary of
    axis 1"): a reshape is linear, so the sums flow through the gathered reshape."""
    from cases import directional
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    r = rng()
    x, w, c = r.standard_normal((4, 4, 8)), r.standard_normal((8, 8)), r.standard_normal((4, 4, 8))

    def f(x, w):
        return ((x.reshape(16, 8) @ w).reshape(4, 4, 8) * c).sum()
    args = {"x": sf.distribute(x, mesh, x_spec), "w": sf.distribute(w, mesh, w_spec) if w_spec else w}
    g = sf.jit(sf.grad(lambda p: f(p["x"], p["w"])), mesh=mesh)(args)
    np.testing.assert_allclose(np.asarray(g["x"]), (c.reshape(16, 8) @ w.T).reshape(4, 4, 8), rtol=1e-12, atol=1e-12)
    numeric, analytic = directional(lambda p: f(p["x"], p["w"]), {"x": x, "w": w}, g, r)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)


def test_a_jitted_partial_or_callable_object_nests_prints_and_refuses_by_its_name():
    """An MoE probe: sf.jit(functools.partial(moe, k=2)) ran, but nesting it in another sf.jit, its repr,
    sf.grad of it and its argument errors raised AttributeError: a partial has no __name__."""
    import functools
    mesh = sf.DeviceMesh(2, backend="numpy")
    x, w = rng().standard_normal((4, 3)), rng().standard_normal((3, 2))
    jf = sf.jit(functools.partial(lambda x, w, scale=1.0: (x @ w) * scale, scale=2.0), mesh=mesh)
    assert repr(jf).startswith("sf.jit(partial(<lambda>), mesh="), repr(jf)
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x, w: jf(x, w).sum(), mesh=mesh)(x, w)), 2 * (x @ w).sum())
    g = sf.grad(lambda x, w: jf(x, w).sum())(sf.replicate(x, mesh=mesh), w)
    np.testing.assert_allclose(np.asarray(g), np.broadcast_to(2 * w.sum(1), (4, 3)), rtol=1e-12)
    with pytest.raises(TypeError, match=r"partial\(<lambda>\)\(\): argument x \(position 0\) is a list"):
        jf([1.0, 2.0], w)

    class Double:
        def __call__(self, v):
            return v * 2.0
    jd = sf.jit(Double(), mesh=mesh)
    assert repr(jd).startswith("sf.jit(Double, mesh="), repr(jd)
    assert float(np.asarray(sf.jit(lambda v: jd(v).sum(), mesh=mesh)(np.ones(4)))) == 8.0


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_numpys_reductions_read_their_positional_arguments_in_numpys_order(jit):
    """A fuzzer: inside sf.jit np.sum / np.max / np.min read (a, axis, dtype, out, keepdims, where, initial),
    so np.sum(x, 0, None, None, False, 0) masked everything (initial read as where=) and np.max(x, 0, None,
    False, 4.0) kept the dimensions and dropped initial; x.max(0, None, True) raised."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = rng().standard_normal((4, 6))
    a = sf.shard(x, axis=0, mesh=mesh)
    calls = [lambda v: np.sum(v, 0, None, None, False, 0.5), lambda v: np.max(v, 0, None, False, 4.0),
             lambda v: np.min(v, 1, None, False, -1.0), lambda v: np.max(v, 0, None, True),
             lambda v: np.amin(v, 0, None, True), lambda v: np.amax(v, 1, None, False, 0.0, v > 0),
             lambda v: v.max(0, None, True), lambda v: v.min(1, None, False, 0.25), lambda v: v.sum(1, None, None, True, 2.0),
             lambda v: np.sum(v, 1, None, None, False, 1.5, v > 0), lambda v: np.mean(v, 0, None, None, True),
             lambda v: v.sum(initial=3.0)]
    for call in calls:
        want = call(x)
        got = np.asarray((sf.jit(call, mesh=mesh) if jit else call)(a))
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-13)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_numpys_spellings_a_fuzzer_met(jit):
    """A NumPy-semantics fuzzer: np.clip of booleans took int64 / float64 from its pairwise maximum and minimum
    (NumPy's dtype is of x and both bounds at once); np.where(True, x, y), +x, divmod(x, y), round(x),
    x.astype(dt, copy=False), x.reshape(shape, order='C') and np.var / np.std(dtype=) raised; np.ravel(order='K')
    of a transposed value was read in C order, silently (refused now, as JAX refuses it)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    b, x = np.array([True, False, True, False]), rng().standard_normal(4).astype(np.float32)
    ba, xa = sf.shard(b, axis=0, mesh=mesh), sf.shard(x, axis=0, mesh=mesh)
    run = (lambda f, *a: sf.jit(f, mesh=mesh)(*a)) if jit else (lambda f, *a: f(*a))
    for bounds in [(-1, np.ones(4, np.int32)), (-1, np.ones(4, np.float32)), (0, np.float32(1.5)), (-1, 1)]:
        got = run(lambda v: np.clip(v, *bounds), ba)
        assert got.dtype == np.clip(b, *bounds).dtype, (bounds, got.dtype)
        np.testing.assert_array_equal(np.asarray(got), np.clip(b, *bounds))
    cases = [(lambda v: np.where(True, v, 0.5), lambda v: np.where(True, v, 0.5)),
             (lambda v: np.where(np.False_, 1.5, v), lambda v: np.where(np.False_, 1.5, v)),
             (lambda v: +v, lambda v: +v), (lambda v: divmod(v, 0.75)[1], lambda v: divmod(v, 0.75)[1]),
             (lambda v: np.divmod(2.0, v)[0], lambda v: np.divmod(2.0, v)[0]), (round, np.round),
             (lambda v: v.astype(np.float64, copy=False), lambda v: v.astype(np.float64, copy=False)),
             (lambda v: v.reshape((2, 2), order="C"), lambda v: v.reshape((2, 2), order="C")),
             (lambda v: np.std(v, 0, np.float64, ddof=1), lambda v: np.std(v, 0, np.float64, ddof=1)),
             (lambda v: np.var(v, dtype="float16"), lambda v: np.var(v, dtype="float16"))]
    for f, ref in cases:
        got, want = run(f, xa), ref(x)
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3 if want.dtype == np.float16 else 1e-6)
    with pytest.raises(TypeError, match=r"order='K'\) is not supported .* memory layout"):
        run(lambda v: np.ravel(v.reshape(2, 2).T, order="K"), xa)
    with pytest.raises(TypeError, match=r"according to the rule 'safe'"):
        run(lambda v: v.astype("int32", casting="safe"), xa)


def test_a_gathered_minus_zero_keeps_its_sign():
    """A fuzzer: x[ids] / np.take of a value sharded on the taken axis summed the devices' parts, zeros where a
    device holds no row: +0.0 + -0.0 made a picked -0.0 +0.0 (NumPy's gather keeps it); and the one-process
    Allreduce started Python's sum() from the int 0.  Now -0.0 fills the rows not held, and the sums start
    from the first part."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    z = np.array([-0.0, 1.0, -0.0, 3.0], np.float32)
    s = sf.shard(z, axis=0, mesh=mesh)
    for got, ids in ((s[np.array([0, 2, 1])], [0, 2, 1]), (np.take(s, np.array([2, 0])), [2, 0]),
                     (sf.jit(lambda v: v[np.array([0, 3])], mesh=mesh)(s), [0, 3])):
        np.testing.assert_array_equal(np.signbit(np.asarray(got)), np.signbit(z[ids]))
    np.testing.assert_array_equal(np.signbit(np.asarray(sf.replicate(sf.shard(z, axis=0, mesh=mesh)))), np.signbit(z))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_an_integer_at_update_converts_its_value_first_as_jax(jit):
    """A fuzzer: an int32 x's .at[].add(2.5) added 2 (JAX's rule: the update in x's dtype first) but .multiply(2.5)
    multiplied in float and truncated (-3 * 2.5 -> -7, JAX's -6), and .power(2.5) of a negative x gave int32's min."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.array([-3, -2, 2, 3], np.int32)
    a = sf.shard(x, axis=0, mesh=mesh)
    run = (lambda f: sf.jit(f, mesh=mesh)(a)) if jit else (lambda f: f(a))
    for name, op in (("add", np.add), ("multiply", np.multiply), ("power", np.power), ("min", np.minimum),
                     ("max", np.maximum)):
        for idx in (slice(None), np.array([0, 2])):
            want = x.copy()
            want[idx] = op(x[idx], np.int32(2))
            got = np.asarray(run(lambda v: getattr(v.at[idx], name)(2.5)))
            assert got.dtype == np.int32, got.dtype
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_decode_loop_fed_its_own_outputs_compiles_once():
    """A serving probe counted cached_plans() going from 1 to 2 when the step's replicated outputs replaced its NumPy
    inputs: the second key serves the same plan object (plan_cache.serving_plan), compiled once."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    w = sf.distribute(rng().standard_normal((8, 4)), mesh, (None, "tp"))

    @sf.jit(mesh=mesh)
    def step(tok, pos, hist):
        nxt = np.argmax(np.take(w, tok, axis=0) @ w.T, axis=-1).astype(np.int32)
        return nxt, pos + 1, hist.at[np.arange(4), pos].set(nxt)
    tok, pos, hist = np.zeros(4, np.int32), np.zeros(4, np.int32), np.zeros((4, 16), np.int32)
    for _ in range(4):
        tok, pos, hist = step(tok, pos, hist)
    assert len({id(p) for p in step.cached_plans().values()}) == 1, step.cached_plans()
