"""Issue 31, item 7 (first half): identical collectives of one value (same source, layout and
chunks) are issued once and feed every consumer (passes/cse.py's share_resharding), streamed
consumers included: Q, K and V's GEMMs each take the chunk the one Allgather of x brought, in one
stream loop (passes/pipeline.py).  Collective counts pin the sharing; values are checked against
NumPy in float64 on random inputs, on a 1-D mesh and a 2x2 ("dp", "tp") mesh."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import tree
from shardfuse.ir import unroll
from shardfuse.ops import COMMUNICATION, Op
from shardfuse.passes import PIPELINE
from shardfuse.passes.cse import share_resharding
from shardfuse.trace import trace

F64 = "float64"


def _qkv(mesh, streamed, over=None, chunks=4, streams=4):
    kw = {} if over is None else {"over": over}

    def wrap(y):
        return sf.stream(y, axis=0, chunks=chunks) if streamed else y

    @sf.jit(mesh=mesh, streams=streams)
    def qkv(x, wq, wk, wv):
        x = sf.shard(x, axis=0, **kw)
        q = wrap(x @ sf.shard(wq, axis=1, **kw))
        k = wrap(x @ sf.shard(wk, axis=1, **kw))
        v = wrap(x @ sf.shard(wv, axis=1, **kw))
        return q, k, v

    return qkv


def _inputs(m=16, k=8, n=12, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in ((m, k), (k, n), (k, n), (k, n))]


def _specs(arrays):
    return [sf.TensorSpec(a.shape, F64) for a in arrays]


def _check(fn, arrays):
    x, wq, wk, wv = arrays
    got = fn(*arrays)
    for g, w in zip(got, (wq, wk, wv)):
        np.testing.assert_allclose(g.gather(), x @ w, rtol=1e-12, atol=1e-12)


def _loops(plan):
    return [i for i in plan.program.instrs if i.op == Op.FOR]


def test_unstreamed_projections_share_one_allgather():
    mesh = sf.DeviceMesh(4)
    fn, arrays = _qkv(mesh, streamed=False), _inputs()
    assert fn.lower(*_specs(arrays)).collectives() == {"allgather": 1}
    _check(fn, arrays)


def test_streamed_projections_share_each_chunks_allgather_in_one_loop():
    """Before: each projection all-gathered x again, chunk by chunk (3 x 4 Allgathers of x, and 3
    of the weights: 15).  Now one loop gathers each chunk of x once and runs the three GEMMs on it."""
    mesh = sf.DeviceMesh(4)
    fn, arrays = _qkv(mesh, streamed=True), _inputs()
    plan = fn.lower(*_specs(arrays))
    assert plan.collectives() == {"allgather": 4 + 3}
    (loop,) = _loops(plan)
    body = [i.op for i in loop.body]
    assert body.count(Op.ALLGATHER) == 1 and body.count(Op.MATMUL) == 3
    gathered = next(i.into for i in loop.body if i.op == Op.ALLGATHER)
    assert all(gathered in i.ins for i in loop.body if i.op == Op.MATMUL)
    _check(fn, arrays)


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_streamed_sharing_any_chunks(chunks, streams):
    mesh = sf.DeviceMesh(4)
    fn, arrays = _qkv(mesh, streamed=True, chunks=chunks, streams=streams), _inputs(m=32, seed=chunks)
    assert fn.lower(*_specs(arrays)).collectives() == {"allgather": chunks + 3}
    _check(fn, arrays)


def test_different_chunks_do_not_share_a_loop():
    """Chunks of different sizes are different collectives: each stream keeps its own."""
    mesh = sf.DeviceMesh(4)

    @sf.jit(mesh=mesh)
    def two(x, wq, wk):
        x = sf.shard(x, axis=0)
        q = sf.stream(x @ sf.shard(wq, axis=1), axis=0, chunks=2)
        k = sf.stream(x @ sf.shard(wk, axis=1), axis=0, chunks=4)
        return q, k

    x, wq, wk, _ = _inputs(m=32, seed=5)
    plan = two.lower(*_specs([x, wq, wk]))
    assert plan.collectives() == {"allgather": 2 + 4 + 2}
    q, k = two(x, wq, wk)
    np.testing.assert_allclose(q.gather(), x @ wq, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k.gather(), x @ wk, rtol=1e-12, atol=1e-12)


def test_repeated_annotation_moves_once():
    """Two sf.replicate(x) of one x: one Allgather, both consumers read it."""
    mesh = sf.DeviceMesh(4)

    @sf.jit(mesh=mesh)
    def f(x, w):
        x = sf.shard(x, axis=0)
        return sf.replicate(x) @ w, sf.replicate(x) * 2.0

    x, w, _, _ = _inputs(seed=7)
    plan = f.lower(*_specs([x, w]))
    assert plan.collectives() == {"allgather": 1}
    a, b = f(x, w)
    np.testing.assert_allclose(a.gather(), x @ w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b.gather(), x * 2.0, rtol=1e-12, atol=1e-12)


def test_returned_resharding_keeps_its_own_buffer():
    """A value returned twice after the same move: each output keeps a buffer of its own."""
    mesh = sf.DeviceMesh(4)

    @sf.jit(mesh=mesh)
    def f(x):
        x = sf.shard(x, axis=0)
        return sf.replicate(x), sf.replicate(x)

    (x, *_) = _inputs(seed=8)
    a, b = f(x)
    np.testing.assert_allclose(a.gather(), x, rtol=0, atol=0)
    np.testing.assert_allclose(b.gather(), x, rtol=0, atol=0)


@pytest.mark.parametrize("streamed", [False, True])
def test_2x2_mesh_shares_over_tp(streamed):
    """On a ("dp", "tp") mesh, x and the weights sharded over tp: the same counts per call."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))
    fn, arrays = _qkv(mesh, streamed=streamed, over="tp"), _inputs(m=16, seed=11)
    plan = fn.lower(*_specs(arrays))
    assert plan.collectives() == ({"allgather": 4 + 3} if streamed else {"allgather": 1})
    _check(fn, arrays)


@pytest.mark.parametrize("streamed", [False, True])
def test_2x2_mesh_rows_over_dp_and_tp(streamed):
    """x sharded over (dp, tp) on its rows, weights over tp on N: unstreamed, the products keep their
    rows over dp, so x is gathered over tp only, once for the three projections (before item 7's
    second half: over tp, then dp); streamed (a stream alone replicates), x's two-step gather is
    issued once per chunk for the three (before: 2 x 2 x 3 + 3 = 15)."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))

    def wrap(y):
        return sf.stream(y, axis=0, chunks=2) if streamed else y

    @sf.jit(mesh=mesh)
    def qkv(x, wq, wk, wv):
        x = sf.shard(x, axis=0, over=("dp", "tp"))
        return tuple(wrap(x @ sf.shard(w, axis=1, over="tp")) for w in (wq, wk, wv))

    arrays = _inputs(m=32, seed=13)
    plan = qkv.lower(*_specs(arrays))
    assert plan.collectives() == ({"allgather": 2 * 2 + 3} if streamed else {"allgather": 1})
    _check(qkv, arrays)


def test_ring_consumers_keep_their_own_rings():
    """A set feeding a ring matmul is the ring's (lower_ring replaces it): never shared."""
    mesh = sf.DeviceMesh(4)

    @sf.jit(mesh=mesh)
    def f(x, wq, wk):
        x = sf.shard(x, axis=0)
        q = sf.stream(x @ wq, axis=0, algorithm="ring")
        k = sf.stream(x @ wk, axis=0, algorithm="ring")
        return q, k

    x, wq, wk, _ = _inputs(m=16, seed=17)
    plan = f.lower(*_specs([x, wq, wk]))
    assert plan.collectives() == {"sendrecv": 2 * 3}  # (as before: each ring passes 3 shards on)
    q, k = f(x, wq, wk)
    np.testing.assert_allclose(q.gather(), x @ wq, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k.gather(), x @ wk, rtol=1e-12, atol=1e-12)


def test_joined_loop_hoists_and_defers_around_its_consumers():
    """Between the loop that gathers x's chunks and V's GEMM sit an op of Q's result (after the
    loop) and a stream that reads it (a loop of its own, later); wv's gather moves before the loop.
    Values as NumPy's whatever the order."""
    mesh = sf.DeviceMesh(4)

    @sf.jit(mesh=mesh)
    def f(x, wq, wk, wv):
        x = sf.shard(x, axis=0)
        q = sf.stream(x @ sf.shard(wq, axis=1), axis=0, chunks=2)
        t = q * 2.0 + 1.0
        k = sf.stream(x @ wk + t, axis=0, chunks=2)
        v = sf.stream(x @ sf.shard(wv, axis=1), axis=0, chunks=2)
        return t, k, v.sum(0)

    x, wq, wk, wv = _inputs(seed=19)
    plan = f.lower(*_specs([x, wq, wk, wv]))
    assert plan.collectives() == {"allgather": 6}  # (before: 8, x's chunks gathered twice)
    # (k = stream(x @ wk + t): the epilogue's GEMM streams with it, in the later loop)
    assert [sum(j.op == Op.MATMUL for j in loop.body) for loop in _loops(plan)] == [2, 1]
    t, k, vs = f(x, wq, wk, wv)
    want_t = (x @ wq) * 2.0 + 1.0
    for got, want in ((t, want_t), (k, x @ wk + want_t), (vs, (x @ wv).sum(0))):
        np.testing.assert_allclose(got.gather(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(64))
def test_random_consumers_of_one_value(seed):
    """Random mixes of consumers of one sharded x (streamed or not, chunks 1/2/4, weights sharded or
    replicated, an elementwise op after, a consumer reading an earlier result): values as NumPy's,
    and never more collectives than without share_resharding."""
    rng = np.random.default_rng(seed)
    mesh = sf.DeviceMesh(4) if seed % 2 else sf.DeviceMesh((2, 2), ("dp", "tp"))
    over = "DIDx" if seed % 2 else ("dp", "tp")
    n = int(rng.integers(2, 4))
    cfg = [(rng.random() < 0.75, int(rng.choice([2, 4, 4, 1])), bool(rng.integers(2)), bool(rng.integers(2)),
            i > 0 and rng.random() < 0.25) for i in range(n)]

    def consumer(x, w, prev, c):
        streamed, chunks, shard_w, scale, reads_prev = c
        w = sf.shard(w, axis=1, over=mesh.axis_names[-1]) if shard_w else w
        y = x @ w
        y = y + prev if reads_prev else y
        y = sf.stream(y, axis=0, chunks=chunks) if streamed else y
        return y * 0.5 if scale else y

    def numpy_consumer(x, w, prev, c):
        y = x @ w + (prev if c[4] else 0.0)
        return y * 0.5 if c[3] else y

    def build(cs):
        @sf.jit(mesh=mesh)
        def f(x, *ws):
            x = sf.shard(x, axis=0, over=over)
            outs = []
            for w, c in zip(ws, cs):
                outs.append(consumer(x, w, outs[-1] if outs else None, c))
            return tuple(outs)
        return f

    x = rng.standard_normal((32, 8))
    ws = [rng.standard_normal((8, 12)) for _ in cfg]
    f = build(cfg)
    got = f(x, *ws)
    want = []
    for w, c in zip(ws, cfg):
        want.append(numpy_consumer(x, w, want[-1] if want else None, c))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.gather(), w, rtol=1e-12, atol=1e-12)
    specs = _specs([x, *ws])
    assert sum(f.lower(*specs).collectives().values()) <= _unshared_count(f, mesh, specs), cfg


def _unshared_count(f, mesh, specs) -> int:
    """Collectives per call of f compiled by the pipeline without share_resharding."""
    prog = trace(tree.FlatFunction(f.fn), mesh, specs, 4)
    for p in PIPELINE:
        prog = prog if p is share_resharding else p(prog)
    return sum(1 for i, _ in unroll(prog.instrs) if i.op in COMMUNICATION)


def test_gradient_seeds_and_broadcasts_read_partial_values_for_their_shape_only():
    """A sum over a sharded axis pends its sum; sf.grad never returns it, and the backward's seed
    (ones) and sum-broadcasts (zeros of the forward's partial values, plus the cotangent) read
    those values for their shape alone: no Allreduce is made only to be overwritten.  With the
    value returned, one Allreduce, of the loss.  Gradients against the closed form, float64."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")

    def loss(x):
        return (sf.shard(x, 1, "tp") ** 3).sum(-1).sum(1).sum()
    x = np.random.default_rng(11).standard_normal((3, 4, 5))
    grad, both = sf.jit(sf.grad(loss), mesh=mesh), sf.jit(sf.value_and_grad(loss), mesh=mesh)
    assert grad.lower(x).collectives() == {}
    assert both.lower(x).collectives() == {"allreduce": 1}
    np.testing.assert_allclose(grad(x).gather(), 3 * x ** 2, rtol=1e-13, atol=1e-13)
    value, g = both(x)
    np.testing.assert_allclose(value.gather(), (x ** 3).sum(), rtol=1e-13)
    np.testing.assert_allclose(g.gather(), 3 * x ** 2, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("between", ["norm", "scale, norm", "scale"])
def test_vocab_parallel_embedding_is_reduced_once_for_the_norm_and_the_weights(between):
    """Megatron's vocab-parallel embedding: the lookup pends a sum over tp.  The norm needs it
    reduced; the norm's scaling is linear in it and would carry the sum on, into a column-parallel
    GEMM that then gathers its weight.  One Allreduce of the lookup feeds both instead, and the GEMM
    stays column parallel.  With only a linear op between ("scale"), the sum is reduced before the
    GEMM (the activation is smaller than the product and the weight), not carried into it."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    rng = np.random.default_rng(12)
    emb, w, ids = rng.standard_normal((8, 4)), rng.standard_normal((4, 6)), rng.integers(0, 8, (5,))

    def f(emb, w, ids):
        e = sf.take(sf.shard(emb, axis=0, over="tp"), ids)
        e = e * 2.0 if "scale" in between else e
        e = sf.nn.rms_norm(e, None) if "norm" in between else e
        return e @ sf.shard(w, axis=1, over="tp")
    jf = sf.jit(f, mesh=mesh)
    assert jf.lower(emb, w, ids).collectives() == {"allreduce": 1}
    out = jf(emb, w, ids)
    assert out.sharding.placements(mesh) == ("S(1)",)
    e = emb[ids] * (2.0 if "scale" in between else 1.0)
    e = e / np.sqrt((e * e).mean(-1, keepdims=True) + 1e-6) if "norm" in between else e
    np.testing.assert_allclose(out.gather(), e @ w, rtol=1e-13, atol=1e-13)


TP2 = sf.DeviceMesh((2,), ("tp",), backend="numpy")


def _check_tp2(f, args, want, *refs):
    jf = sf.jit(f, mesh=TP2)
    assert jf.lower(*args).collectives() == want, str(jf.lower(*args))
    for got, ref in zip(tree.leaves(jf(*args)), refs):
        np.testing.assert_allclose(got.gather(), ref, rtol=1e-12, atol=1e-12)


def test_an_annotated_output_of_a_partial_input_is_reduce_scattered_not_its_input():
    """u pends a sum; u @ wc is annotated rows-over-tp, which wc's columns do not give: the output's
    reduce-scatter (and wc's gather) is the smaller move, the input's Allreduce is not made."""
    rng = np.random.default_rng(13)
    x, wr, wc = rng.standard_normal((8, 8)), rng.standard_normal((8, 8)), rng.standard_normal((8, 4))

    def f(x, wr, wc):
        u = sf.shard(x, 1, "tp") @ sf.shard(wr, 0, "tp")
        return sf.shard(u @ sf.shard(wc, 1, "tp"), 0, "tp")
    _check_tp2(f, (x, wr, wc), {"allgather": 1, "reduce_scatter": 1}, x @ wr @ wc)
    rs = [line for line in str(sf.jit(f, mesh=TP2).lower(x, wr, wc)).splitlines() if "ReduceScatter" in line]
    assert "_partial, team=tp" in rs[0], rs  # (the product's pending sums, not u's)


def test_a_row_parallel_weights_gradient_reduce_scatters_the_small_product():
    """dW of a column-parallel weight after a row-parallel one: the [K, K] product is reduce-scattered,
    the [M, K] activation gradient is not all-reduced for it."""
    rng = np.random.default_rng(14)
    x, w0, w1 = rng.standard_normal((64, 8)), rng.standard_normal((8, 8)), rng.standard_normal((8, 8))

    def loss(w0, w1, x):
        return (np.tanh(x @ sf.shard(w0, 0, "tp")) @ sf.shard(w1, 1, "tp")).sum()
    h = np.tanh(x @ w0)
    dz = (np.ones((64, 8)) @ w1.T) * (1 - h ** 2)
    _check_tp2(sf.grad(loss, argnums=(0, 1)), (w0, w1, x), {"allreduce": 1, "reduce_scatter": 1},
           x.T @ dz, h.T @ np.ones((64, 8)))


def test_chained_partial_values_reduced_in_one_round_leave_no_stale_gather():
    """u and o = u @ wc both pend sums and both are needed reduced: reducing u leaves o whole (and
    sharded by wc's columns), so o's reduction from the same round is dropped, not lowered to a
    gather of the now sharded o."""
    rng = np.random.default_rng(15)
    x, wr, wc = rng.standard_normal((64, 8)), rng.standard_normal((8, 8)), rng.standard_normal((8, 2))

    def f(x, wr, wc):
        u = sf.shard(x, 1, "tp") @ sf.shard(wr, 0, "tp")
        o = u @ sf.shard(wc, 1, "tp")
        return np.tanh(u), np.tanh(o), (o * 3).sum(0)
    u = x @ wr
    _check_tp2(f, (x, wr, wc), {"allreduce": 1}, np.tanh(u), np.tanh(u @ wc), (u @ wc * 3).sum(0))


def test_pythons_sum_starting_at_zero_keeps_one_allreduce():
    """optax's global norm, sqrt(sum(sum(g ** 2) for g in grads)): Python's sum() starts at 0, and
    0 + a pending sum is still that pending sum (x + 0 on every device's piece sums to the sum + 0,
    signed zeros included): one Allreduce for the four gradients, not one each."""
    rng = np.random.default_rng(16)
    gs = [rng.standard_normal((4, 6)) for _ in range(4)]

    def norm(*g):
        return np.sqrt(sum((sf.shard(x, 1, "tp") ** 2).sum() for x in g))
    _check_tp2(norm, gs, {"allreduce": 1}, np.sqrt(sum((x ** 2).sum() for x in gs)))
    zeros = -0.0 * gs[0]
    got = float(sf.jit(lambda x: (sf.shard(x, 1, "tp")).sum() + 0, mesh=TP2)(zeros))
    assert got == 0.0 and np.copysign(1, got) == np.copysign(1, zeros.sum() + 0)


def test_small_elementwise_results_are_computed_once():
    """A hand-written Adam makes 1 - b1 ** count once per parameter (an MPI probe): the small results
    (at most passes.cse.SMALL elements) are shared, one kernel each; a large one made twice is not
    (sf.checkpoint's recomputation relies on it), and the values are the same either way."""
    mesh = sf.DeviceMesh(2, backend="numpy")

    def step(ps, count):
        return [p * 0.5 / (1 - 0.9 ** (count + 1)) + np.tanh(p) for p in ps]
    ps = [np.random.default_rng(k).standard_normal((8, 1024)) for k in range(3)]
    plan = sf.jit(step, mesh=mesh).lower(ps, 3)
    text = str(plan)
    assert text.count("rpow") == 1, text
    assert text.count("tanh") == 3, text  # ([8, 1024] each, on distinct inputs: nothing to share anyway)
    twice = sf.jit(lambda p: np.tanh(p) + np.tanh(p) * 2.0, mesh=mesh).lower(ps[0])
    assert str(twice).count("tanh") == 2, str(twice)
    for got, p in zip(plan(*ps, 3), ps):
        np.testing.assert_allclose(np.asarray(got), p * 0.5 / (1 - 0.9 ** 4) + np.tanh(p), rtol=1e-13)


def test_ops_of_signed_zeros_are_not_shared():
    """x * 0.0 and x * -0.0 are two values (1 / each: inf and -inf), though 0.0 == -0.0 (a review)."""
    f = sf.jit(lambda x: 1.0 / (x * 0.0) + 1.0 / (x * -0.0), mesh=sf.DeviceMesh(2, backend="numpy"))
    with np.errstate(all="ignore"):
        want = 1.0 / (np.full(4, 3.0) * 0.0) + 1.0 / (np.full(4, 3.0) * -0.0)
    np.testing.assert_array_equal(np.asarray(f(np.full(4, 3.0))), want)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_one_device_collectives_in_a_stream_loop_issue_nothing(chunks):
    """On a (2, 1) dp x tp mesh a row-parallel GEMM's ReduceScatter over tp is the identity: a view
    outside a stream loop, and inside one (its destination a chunk of a buffer read whole after it)
    a copy on the device; neither is a collective (a README probe counted 16 under `demo --layer dp`)."""
    mesh = sf.DeviceMesh((2, 1), ("dp", "tp"), backend="numpy")
    r = np.random.default_rng()
    x, w = r.standard_normal((8, 6)), r.standard_normal((6, 4))

    def f(x, w):
        h = sf.stream(sf.shard(x, axis=1, over="tp") @ sf.shard(w, axis=0, over="tp"), axis=0, chunks=chunks)
        return sf.shard(h, axis=0, over="tp")
    g = sf.jit(f, mesh=mesh)
    assert g.lower(x, w).collectives() == {}, str(g.lower(x, w))
    np.testing.assert_allclose(np.asarray(g(x, w)), x @ w, rtol=1e-12)
