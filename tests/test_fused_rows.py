"""passes/fuse_rows.py's FusedRows: softmax, log_softmax, layer_norm and rms_norm (with an
attention-style prologue and the cast back, and their backward chains in sf.grad) are one step
where fuse_elementwise left several: a chain written to memory, a ReduceMax, a FusedSum, a Fused.
On NumPy devices the step evaluates the group op by op on whole arrays, so its results equal the
unfused plan's (SHARDFUSE_FUSE=0) bit for bit in every float dtype, and they are checked against
float64 NumPy written out here.  Inputs are fresh random values (the seed is in each failure's
message; no zeros); buffers are poisoned (conftest), so an unwritten element fails.
tests/test_gpu_fused_rows.py runs the same cases through the generated CUDA kernel."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op
from test_fused_sum import fresh_rng, fused_and_unfused, leaves, randn

DTYPES = ["float64", "float32", "float16", "bfloat16"]
MESH = sf.DeviceMesh((4,), ("tp",), backend="numpy")
# relative error (2-norm) against float64 NumPy on the same (rounded) inputs
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}


def _masked(x, mask, fill=float("-inf")):
    """The attention prologue: scale, where(mask, x, fill), in float32 (16-bit) or x's float dtype."""
    wide = "float64" if x.dtype_name == "float64" else "float32"
    return sf.where(mask, x * 0.125, fill).astype(wide)


def softmax_fwd(x, mask):
    return sf.nn.softmax(_masked(x, mask)).astype(x.dtype_name)


def log_softmax_fwd(x, mask):
    return sf.nn.log_softmax(_masked(x, mask, -3e4)).astype(x.dtype_name)  # (finite: a log of 0 is -inf)


def softmax_bwd(x, v):
    return sf.grad(lambda x, v: (sf.nn.softmax(x) @ v).sum())(x, v)


def log_softmax_bwd(x, v):
    return sf.grad(lambda x, v: (sf.nn.log_softmax(x) @ v).sum())(x, v)


def layer_norm_fwd(x, w, b):
    return sf.nn.layer_norm(x, w, b)


def rms_norm_fwd(x, w):
    return sf.nn.rms_norm(x, w)


def layer_norm_bwd(x, w, b, v):
    return sf.grad(lambda x, w, b: (sf.nn.layer_norm(x, w, b) @ v).sum(), argnums=(0, 1, 2))(x, w, b)


def rms_norm_bwd(x, w, v):
    return sf.grad(lambda x, w: (sf.nn.rms_norm(x, w) @ v).sum(), argnums=(0, 1))(x, w)


# float64 NumPy references -------------------------------------------------------------------------
def np_softmax(s):
    """softmax over the last axis, float64 NumPy."""
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_masked(x, mask, fill=-np.inf):
    return np.where(mask, x * 0.125, fill)


def _cotangent(x, v):
    """d sum(y @ v) / dy: ones @ v^T."""
    return np.ones(x.shape[:-1] + (v.shape[-1],)) @ np.swapaxes(v, -1, -2)


def _np_layer_norm(x, w, b, eps=1e-5):
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * w + b


def _np_layer_norm_bwd(x, w, b, v, eps=1e-5):
    g = _cotangent(x, v)
    d = x - x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((d * d).mean(-1, keepdims=True) + eps)
    xhat, gx = d * rstd, g * w
    dx = rstd * (gx - gx.mean(-1, keepdims=True) - xhat * (gx * xhat).mean(-1, keepdims=True))
    lead = tuple(range(x.ndim - 1))
    return dx, (g * xhat).sum(lead), g.sum(lead)


def _np_rms_norm_bwd(x, w, v, eps=1e-6):
    g = _cotangent(x, v)
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    gx = g * w
    dx = r * gx - x * r ** 3 * (gx * x).mean(-1, keepdims=True)
    return dx, (g * x * r).sum(tuple(range(x.ndim - 1)))


def _np_log_softmax(x):
    s = x - x.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


REFERENCE = {
    softmax_fwd: lambda x, m: [np_softmax(_np_masked(x, m))],
    log_softmax_fwd: lambda x, m: [_np_log_softmax(_np_masked(x, m, -3e4))],
    softmax_bwd: lambda x, v: [(lambda y, g: y * (g - (g * y).sum(-1, keepdims=True)))(np_softmax(x), _cotangent(x, v))],
    log_softmax_bwd: lambda x, v: [(lambda y, g: g - np.exp(y) * g.sum(-1, keepdims=True))(_np_log_softmax(x),
                                                                                         _cotangent(x, v))],
    layer_norm_fwd: lambda x, w, b: [_np_layer_norm(x, w, b)],
    rms_norm_fwd: lambda x, w: [x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w],
    layer_norm_bwd: _np_layer_norm_bwd,
    rms_norm_bwd: _np_rms_norm_bwd,
}


def make_args(fn, r, dtype, shape, mask_shape=None):
    """Arguments of a case over rows of `shape`: a mask (True at column 0 of every row, so none is
    all masked) of mask_shape, a [L] weight and bias, a [L, 3] v for the backward's loss."""
    x = randn(r, shape, dtype)
    n = shape[-1]
    if fn in (softmax_fwd, log_softmax_fwd):
        mask = r.random(mask_shape or (1, 1) + shape[-2:]) < 0.7
        mask[..., 0] = True
        return x, mask
    if fn in (softmax_bwd, log_softmax_bwd):
        return x, randn(r, (n, 3), dtype)
    w, b = 1 + 0.1 * randn(r, (n,), dtype), randn(r, (n,), dtype)
    w = w.astype(x.dtype)
    return {layer_norm_fwd: (x, w, b), rms_norm_fwd: (x, w), layer_norm_bwd: (x, w, b, randn(r, (n, 3), dtype)),
            rms_norm_bwd: (x, w, randn(r, (n, 3), dtype))}[fn]


# fn -> how many FusedRows its plan holds (a softmax's backward: the forward's and the backward's).  The
# norms' backward: pieces of the forward (the mean and x - mean, the rsqrt of the variance) and of the
# backward, since the forward's values the backward reads (x - mean, the rsqrt, x-hat) would be further
# results of one group, and a FusedRows step writes one value
CASES = {softmax_fwd: 1, log_softmax_fwd: 1, layer_norm_fwd: 1, rms_norm_fwd: 1, softmax_bwd: 2,
         log_softmax_bwd: 2, layer_norm_bwd: 3, rms_norm_bwd: 2}


def rel(got, want) -> float:
    """The relative error of got; against an all-zero want (log_softmax of rows of one: exactly 0),
    the absolute one."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1.0 if not want.any() else 0.0))


def fused_rows(plan) -> list:
    return [i for i in plan.program.instrs if i.op == Op.FUSED_ROWS]


def check_case(fn, args, mesh, dtype, seed, monkeypatch, exact=True, fuses=True):
    got, plan, want, plain = fused_and_unfused(fn, args, monkeypatch, mesh=mesh)
    rows = fused_rows(plan)
    assert len(rows) == (CASES[fn] if fuses else 0), f"{len(rows)} FusedRows, wanted {CASES[fn]}:\n{plan}"
    assert not fused_rows(plain), plain
    ref = REFERENCE[fn](*[np.asarray(a, np.float64) for a in args])
    for g, w, f in zip(got, want, ref):
        assert not np.any(np.isnan(g.astype(np.float64))), f"seed {seed}: unwritten (poisoned) elements"
        if exact:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"seed {seed}")
        assert rel(g, f) <= TOL[dtype], f"seed {seed}: {rel(g, f):.2e} from float64 NumPy ({dtype})"
    return plan, plain


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", list(CASES), ids=lambda f: f.__name__)
def test_row_groups_are_one_step_and_equal_the_unfused_plan(fn, dtype, monkeypatch):
    r, seed = fresh_rng()
    check_case(fn, make_args(fn, r, dtype, (2, 4, 8, 16)), MESH, dtype, seed, monkeypatch)


def _compute(plan) -> list:
    return [i.op for i in plan.program.instrs if i.into is not None]


def test_the_attention_softmax_is_one_step_where_it_was_seven(monkeypatch):
    """The scale, the mask's fill, where, the cast to float32, the max, exp and its sum, the division
    and the cast back: one FusedRows reading the scores and the mask, writing the result."""
    r, seed = fresh_rng()
    x, mask = make_args(softmax_fwd, r, "bfloat16", (2, 4, 8, 8))
    _, plan, _, plain = fused_and_unfused(softmax_fwd, (x, mask), monkeypatch)
    # plan softmax_fwd(x: bf16[2, 4, 8, 8], mask: bool[1, 1, 8, 8]) -> (a_2: bf16[2, 4, 8, 8])
    #   a_2 = Allocate bf16[2, 4, 8, 8]  (per call)
    #   FusedRows a_2 <- mask, x, expr=astype(div(exp(sub(astype(add(where_then(#0, scale(#1, 0.125)), ...
    assert _compute(plan) == [Op.FUSED_ROWS], plan
    assert len(_compute(plain)) >= 7, plain
    made = [i.outs[0].type.shape for i in plan.program.instrs if i.op == Op.ALLOCATE]
    assert made == [(2, 4, 8, 8)], plan  # (nothing between: no buffer of x, the max or the sum)
    text = str(plan)
    assert "FusedRows a_2 <- mask, x, expr=astype(div(exp(sub(astype(" in text and "reduce_max(" in text, text


def test_the_layer_forward_has_one_step_per_softmax_and_norm():
    """The transformer layer's forward (benchmarks/layer_vs_torch.py's, small): its softmax and both
    layer norms are one FusedRows each, and no ReduceMax, Sum or FusedSum of a row is left."""
    from shardfuse.transformer import init_params, transformer_layer

    hidden, heads, seq, batch = 64, 4, 16, 2
    p = {k: sf.TensorSpec(a.shape, "bfloat16") for k, a in init_params(np.random.default_rng(0), hidden).items()}
    x = sf.TensorSpec((batch, seq, hidden), "bfloat16")
    plan = sf.jit(lambda p, x: transformer_layer(p, x, heads), mesh=sf.DeviceMesh(1, backend="numpy")).lower(p, x)
    ops = _compute(plan)
    assert ops.count(Op.FUSED_ROWS) == 3, plan
    assert not {Op.REDUCE_MAX, Op.SUM, Op.FUSED_SUM} & set(ops), plan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_or_batch_sharded_fuse_and_a_sharded_row_does_not(dtype, monkeypatch):
    """Rows whole on every device fuse (heads over tp on a mesh of 2, batch and heads on 2 x 2); a
    softmax over the sharded axis (an Allreduce between its steps) does not, and stays right."""
    r, seed = fresh_rng()
    x, mask = make_args(softmax_fwd, r, dtype, (2, 4, 8, 16))
    two = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    grid = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    heads = lambda x, m: softmax_fwd(sf.shard(x, axis=1, over="tp"), m)  # noqa: E731
    both = lambda x, m: softmax_fwd(sf.shard(sf.shard(x, axis=0, over="dp"), axis=1, over="tp"), m)  # noqa: E731
    last = lambda x, m: softmax_fwd(sf.shard(x, axis=3, over="tp"), m)  # noqa: E731
    for fn, mesh, fuses in [(heads, two, True), (both, grid, True), (last, two, False), (last, grid, False)]:
        REFERENCE[fn] = REFERENCE[softmax_fwd]
        CASES[fn] = 1
        try:
            plan, _ = check_case(fn, (x, mask), mesh, dtype, seed, monkeypatch, fuses=fuses)
        finally:
            del REFERENCE[fn], CASES[fn]
        if not fuses:
            assert any(i.op == Op.ALLREDUCE for i in plan.program.walk()), plan


def test_a_value_read_outside_the_group_is_written_and_stays_a_step(monkeypatch):
    """softmax's max also returned: the group would write two values, so the max stays its own step
    (and whatever fuses around it still equals the unfused plan)."""
    r, seed = fresh_rng()
    x = randn(r, (4, 16), "float32")
    fn = lambda x: (sf.nn.softmax(x), x.max(-1, keepdims=True))  # noqa: E731
    got, plan, want, _ = fused_and_unfused(fn, (x,), monkeypatch)
    assert Op.REDUCE_MAX in _compute(plan), plan
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w, err_msg=f"seed {seed}")


def test_row_lengths_and_broadcast_masks(monkeypatch):
    """Rows of 1, 7 and 33 elements, a mask of the full shape and one broadcast over rows only."""
    for n in (1, 7, 33):
        for mask_shape in [(2, 3, 5, n), (1, 1, 1, n)]:
            r, seed = fresh_rng()
            x, mask = make_args(softmax_fwd, r, "float32", (2, 3, 5, n), mask_shape)
            check_case(softmax_fwd, (x, mask), MESH, "float32", seed, monkeypatch)


def test_kernel_sources_one_kernel_per_group_and_cached():
    """The CUDA source of a group (backends/cuda/rows_source.py, no GPU needed): one __global__
    function, every reduction a block reduction, generated once per group, dtypes and strides."""
    from shardfuse.backends.cuda import rows_source

    r, _ = fresh_rng()
    x, mask = make_args(softmax_fwd, r, "bfloat16", (2, 4, 8, 16))
    plan = sf.jit(softmax_fwd, mesh=MESH).lower(x, mask)
    (step,) = fused_rows(plan)
    shapes = (((1, 1, 8, 16), (128, 128, 16, 1)), ((2, 4, 8, 16), (512, 128, 16, 1)))
    src, name, threads, rows = rows_source.source(step.attrs["expr"], ("bool", "bfloat16"), shapes,
                                            ("bfloat16", (2, 4, 8, 16), (512, 128, 16, 1)))
    assert src.count("__global__") == 1 and f"void {name}(" in src, src
    assert src.count("block_max(") >= 1 and src.count("block_sum(") >= 1, src
    assert threads == 32 and rows == 64
    again = rows_source.source(step.attrs["expr"], ("bool", "bfloat16"), shapes,
                               ("bfloat16", (2, 4, 8, 16), (512, 128, 16, 1)))
    assert again[0] is src  # (cached: the same text object)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_float32_softmax_kept_for_the_backward_and_its_cast_are_one_step(dtype, monkeypatch):
    """In sf.grad a 16-bit softmax writes its float32 y (the backward reads it) and y cast back for
    the next GEMM: both results of one FusedRows (`FusedRows d, a <- ..., more=(astype(...))`), no
    Astype step reading y again; the loss (through the cast) and the gradient (through y) equal the
    unfused plan's bit for bit."""
    r, seed = fresh_rng()
    x, v = make_args(softmax_bwd, r, dtype, (2, 4, 8, 16))
    fn = sf.value_and_grad(lambda x, v: (sf.nn.softmax(x) @ v).sum())
    got, plan, want, _ = fused_and_unfused(fn, (x, v), monkeypatch)
    (fwd,) = [i for i in fused_rows(plan) if "more" in i.attrs]
    assert [o.type.dtype for o in (fwd.into, *fwd.outs)] == ["float32", dtype], plan
    assert str(fwd.attrs["more"][0]).startswith("astype(div(exp("), plan
    assert not any(i.op == Op.ASTYPE and i.into.type.shape == x.shape for i in plan.program.instrs), plan
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8), err_msg=f"seed {seed}")


def test_the_layer_training_step_equals_the_unfused_plan():
    """The layer's training step (forward, backward, Adam; bfloat16, small) with its row groups (the
    norms' and softmax's, some writing two results) gives the unfused plan's parameters, moments and
    loss bit for bit."""
    import os

    from shardfuse.transformer import adam_step, init_params

    hidden, heads, seq, batch = 32, 2, 8, 2
    r, seed = fresh_rng()
    p = {k: a.astype(np_dtype("bfloat16")) for k, a in init_params(r, hidden).items()}
    x, t = randn(r, (batch, seq, hidden), "bfloat16"), randn(r, (batch, seq, hidden), "bfloat16")
    mesh = sf.DeviceMesh(1, backend="numpy")
    results = []
    for fuse in ("1", "0"):
        os.environ["SHARDFUSE_FUSE"] = fuse
        try:
            step = sf.jit(adam_step(heads), mesh=mesh)
            zeros = {k: np.zeros_like(a) for k, a in p.items()}
            if fuse == "1":
                assert sum(i.op == Op.FUSED_ROWS for i in step.lower(p, zeros, zeros, x, t).program.instrs) >= 5
            *trees, loss = step(p, zeros, dict(zeros), x, t)
            results.append([np.asarray(tree[k]) for tree in trees for k in sorted(tree)] + [np.asarray(loss)])
        finally:
            del os.environ["SHARDFUSE_FUSE"]
    for g, w in zip(*results):
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8), err_msg=f"seed {seed}")


def test_a_transposed_view_of_the_groups_result_is_not_read_as_the_result():
    # the review of 2026-12-06: softmax(x).T * 2 of square rows was written as y * 2 (a transpose has
    # the result's shape, not its elements where they are); a reshape of the same shape may join
    rng = np.random.default_rng(41)
    mesh = sf.DeviceMesh(2, backend="numpy")

    def softmax64(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    got = np.asarray(sf.jit(lambda x: sf.nn.softmax(x).T * 2.0, mesh=mesh)(x))
    np.testing.assert_allclose(got, softmax64(x.astype(np.float64)).T * 2, rtol=1e-6, atol=1e-7)
    x3 = rng.standard_normal((4, 4, 4)).astype(np.float32)
    got = sf.jit(lambda x: np.swapaxes(sf.nn.softmax(sf.shard(x, axis=0)), 1, 2) + 1.0, mesh=mesh)(x3).gather()
    np.testing.assert_allclose(got, np.swapaxes(softmax64(x3.astype(np.float64)), 1, 2) + 1, rtol=1e-6, atol=1e-7)
    f = sf.jit(lambda x: sf.nn.softmax(x).reshape(8, 8) * 2.0, mesh=mesh)
    np.testing.assert_allclose(np.asarray(f(x)), softmax64(x.astype(np.float64)) * 2, rtol=1e-6, atol=1e-7)
    assert str(f.lower(x)).count("FusedRows") == 1


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 8)])
def test_a_sharded_rows_vjp_with_a_whole_cotangent(shape):
    """log_softmax over a sharded last axis, its vjp taking a replicated cotangent (a torch user's
    vocab-parallel loss): the cotangent's whole rows beside the logits' shards are no group, and the
    gradient is g - softmax(l) * sum(g) (its grouping raised a broadcast error in fuse_rows)."""
    r = np.random.default_rng()
    logits, g = r.standard_normal(shape), r.standard_normal(shape)
    f = lambda l: sf.nn.log_softmax(sf.shard(l, axis=-1))  # noqa: E731
    got = sf.jit(lambda l, g: sf.vjp(f, l)[1](g), mesh=sf.DeviceMesh(2, backend="numpy"))(logits, g)[0]
    soft = np.exp(logits - logits.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(got), g - soft * g.sum(-1, keepdims=True), rtol=1e-12, atol=1e-12)
