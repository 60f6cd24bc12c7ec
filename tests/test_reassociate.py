"""passes/reassociate.py: gradients accumulated over micro-batches inside one sf.jit are summed on
each device and reduced once (a probe's 4-micro-batch step made 4 Allreduces of every gradient,
in bfloat16 where the weights were cast), against float64 NumPy on fresh random inputs."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf

MESH = sf.DeviceMesh((2,), ("dp",), backend="numpy")
MICRO = 4
ATOL = 1e-4  # (float32 sums of 8 to 32 terms of size ~1: a sum near 0 is off by ~1e-6 in float32)


def accumulate(loss, start_at_zero=False):
    def step(w, xs):
        grads = [sf.grad(loss)(w, xs[m]) for m in range(MICRO)]
        return sum(grads) if start_at_zero else grads[0] + grads[1] + grads[2] + grads[3]
    return step


def data(x_dtype):
    r = np.random.default_rng()
    return r.standard_normal((16, 16)).astype(np.float32), r.standard_normal((MICRO, 8, 16)).astype(x_dtype)


def plain_loss(w, x):
    return (sf.shard(x, axis=0, over="dp") @ w).sum()


def bf16_loss(w, x):  # (bfloat16 activations and a bfloat16 copy of float32 weights: the GEMM in bfloat16)
    return (sf.shard(x, axis=0, over="dp") @ w.astype("bfloat16")).astype(np.float32).sum()


def allreduces(plan):
    return [line for line in str(plan).splitlines() if "= Allreduce" in line]


def reduced_values(plan) -> int:
    """The values the plan's Allreduces reduce (a bucket of n: n values)."""
    return sum(int(line.split("bucket=")[1].split(",")[0]) if "bucket=" in line else 1 for line in allreduces(plan))


@pytest.mark.parametrize("start_at_zero", [False, True])
def test_micro_batch_gradients_are_reduced_once(start_at_zero):
    w, xs = data(np.float32)
    fn = sf.jit(accumulate(plain_loss, start_at_zero), mesh=MESH)
    assert reduced_values(fn.lower(w, xs)) == 1, fn.lower(w, xs)
    want = sum(xs[m].astype(np.float64).T @ np.ones((8, 16)) for m in range(MICRO))
    np.testing.assert_allclose(np.asarray(fn(w, xs)), want, rtol=1e-5, atol=ATOL)


def test_bfloat16_gradients_widened_to_float32_are_reduced_once_in_float32():
    w, xs = data(ml_dtypes.bfloat16)
    fn = sf.jit(accumulate(bf16_loss), mesh=MESH)
    (line,) = allreduces(fn.lower(w, xs))
    assert "team=dp" in line
    reduced = [i for i in fn.lower(w, xs).program.walk() if i.op == sf.ops.Op.ALLREDUCE]
    assert reduced[0].into.type.dtype == "float32"
    want = sum(xs[m].astype(np.float64).T @ np.ones((8, 16)) for m in range(MICRO))
    got = np.asarray(fn(w, xs))
    assert got.dtype == np.float32
    # (each device's piece rounded to bfloat16 once: 2^-8 of each piece's size)
    np.testing.assert_allclose(got, want, atol=2 ** -7 * np.abs(want).max())


def test_a_rounding_cast_between_reduction_and_sum_keeps_each_reduction():
    """A float32 GEMM's gradient of a bfloat16 copy is rounded to bfloat16 (its cotangent's dtype):
    summing the pieces first would skip that rounding of the whole, so each stays reduced alone."""
    w, xs = data(np.float32)
    fn = sf.jit(accumulate(bf16_loss), mesh=MESH)
    assert reduced_values(fn.lower(w, xs)) == MICRO, fn.lower(w, xs)
    one = lambda x: np.asarray(x.T @ np.ones((8, 16)), np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    np.testing.assert_allclose(np.asarray(fn(w, xs)), sum(one(xs[m].astype(np.float64)) for m in range(MICRO)),
                               rtol=2 ** -7)


def test_a_reduced_value_read_elsewhere_stays_reduced_where_it_is():
    w, xs = data(np.float32)

    def step(w, xs):
        g0, g1 = (sf.grad(plain_loss)(w, xs[m]) for m in range(2))
        return g0 + g1, g0
    fn = sf.jit(step, mesh=MESH)
    assert reduced_values(fn.lower(w, xs)) == 2, fn.lower(w, xs)
    total, first = fn(w, xs)
    g = [xs[m].astype(np.float64).T @ np.ones((8, 16)) for m in range(2)]
    np.testing.assert_allclose(np.asarray(total), g[0] + g[1], rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(np.asarray(first), g[0], rtol=1e-5, atol=ATOL)


def test_a_reduce_scatter_target_keeps_each_reduction_and_sub_folds():
    """Sums reduce-scattered into a sharded layout (ZeRO / FSDP gradients) keep one ReduceScatter
    each, so the sum is of shards, not of whole pieces (a review); g0 - g1 of pending pieces is one
    Allreduce."""
    w, xs = data(np.float32)
    r = np.random.default_rng()
    a, b, c, d = (r.standard_normal((8, 8)) for _ in range(4))
    shard = lambda x, axis: sf.shard(x, axis=axis, over="dp")  # noqa: E731
    fn = sf.jit(lambda a, b, c, d: shard(shard(a, 1) @ shard(b, 0), 0) + shard(shard(c, 1) @ shard(d, 0), 0), mesh=MESH)
    plan = fn.lower(a, b, c, d)
    assert str(plan).count("= ReduceScatter") == 2 and not allreduces(plan), plan
    np.testing.assert_allclose(np.asarray(fn(a, b, c, d)), a @ b + c @ d, rtol=1e-12)
    diff = sf.jit(lambda w, xs: sf.grad(plain_loss)(w, xs[0]) - sf.grad(plain_loss)(w, xs[1]), mesh=MESH)
    assert reduced_values(diff.lower(w, xs)) == 1, diff.lower(w, xs)
    g = [xs[m].astype(np.float64).T @ np.ones((8, 16)) for m in range(2)]
    np.testing.assert_allclose(np.asarray(diff(w, xs)), g[0] - g[1], rtol=1e-5, atol=ATOL)


def test_a_global_norm_over_sharded_and_replicated_leaves_is_one_reduction():
    """optax's global norm, sum(sum(g ** 2) for g in leaves), over leaves sharded over tp (squares
    pending over tp) and replicated ones (whole): the pending squares are summed on each device and
    reduced once at the end (a probe's step made one scalar Allreduce per sharded leaf, 12)."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    leaves = [r.standard_normal(s) for s in [(8, 6), (6,), (6, 8), (4, 8), (8,), (8, 4)]]
    sharded = [True, False, True, True, False, True]

    def norm(*gs):
        gs = [sf.shard(g, axis=g.ndim - 1, over="tp") if s else g for g, s in zip(gs, sharded)]
        return np.sqrt(sum((g * g).sum() for g in gs))
    fn = sf.jit(norm, mesh=mesh)
    plan = fn.lower(*leaves)
    assert reduced_values(plan) == 1, plan
    np.testing.assert_allclose(float(fn(*leaves)), np.sqrt(sum((g * g).sum() for g in leaves)), rtol=1e-13)
    loose = sf.jit(lambda a, b, c: sf.shard(a, axis=1, over="tp").sum() + b.sum() + sf.shard(c, axis=0, over="tp").sum(),
                   mesh=mesh)
    a, b, c = leaves[0], leaves[1], leaves[2]
    assert reduced_values(loose.lower(a, b, c)) == 1, loose.lower(a, b, c)
    np.testing.assert_allclose(float(loose(a, b, c)), a.sum() + b.sum() + c.sum(), rtol=1e-13)


def test_a_chain_mixing_sums_pending_over_two_mesh_axes_reduces_each_kind_once():
    """t(p) + d(q) + t(r) + d(s) + y, t pending over tp and d over dp (a review: 4 Allreduces where 2
    do), y whole: one Allreduce over tp and one over dp; random chains of such terms against float64
    NumPy (each kind summed apart, then the whole terms)."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    r = np.random.default_rng()
    xs = [r.standard_normal((4, 8)) for _ in range(5)]

    def term(x, kind):  # a scalar pending over tp or dp, or whole
        return x.sum() if kind is None else sf.shard(x, axis=1 if kind == "tp" else 0, over=kind).sum()

    for kinds in (["tp", "dp", "tp", "dp", None], [None, "tp", "tp", "dp", "dp"], ["dp", None, "tp", None, "dp"]):
        fn = sf.jit(lambda *xs, kinds=kinds: sum(term(x, k) for x, k in zip(xs, kinds)), mesh=mesh)
        plan = fn.lower(*xs)
        assert reduced_values(plan) == len({k for k in kinds if k}), (kinds, plan)
        np.testing.assert_allclose(float(fn(*xs)), sum(x.sum() for x in xs), rtol=1e-12)


def rms_norm_head_loss(p, x):
    h = x * sf.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * p["g"]
    return sf.nn.cross_entropy(h @ sf.shard(p["wout"], axis=1, over="tp"), np.array([[1, 2, 3, 4]] * 2))


def test_an_rms_norm_backward_reduces_its_input_gradient_once():
    """The norm's input gradient before a vocab-parallel head is g * w / rms - x * sum(g * w * x) / ...,
    each term pending sums over tp: x * reduced(s) + reduced(g) is now reduced(x * s + g), one
    Allreduce of [tokens, hidden] as Megatron's (a Llama probe: a [tokens, 1] one first, 5 -> 4)."""
    r = np.random.default_rng()
    p, x = {"g": r.standard_normal(16), "wout": r.standard_normal((16, 8))}, r.standard_normal((2, 4, 16))
    grads = [sf.jit(sf.grad(rms_norm_head_loss, argnums=(0, 1)), mesh=sf.DeviceMesh((n,), ("tp",), backend="numpy"))
             for n in (1, 2)]
    assert grads[1].lower(p, x).collectives() == {"allreduce": 4}  # (3 of the loss' forward, 1 bucket)
    for a, b in zip(sf.tree.leaves(grads[1](p, x)), sf.tree.leaves(grads[0](p, x))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["x * s", "s * x", "s / y", "-s * 2", "s read twice", "s read elsewhere"])
def test_a_pending_sum_carried_through_linear_ops_into_a_sum(form):
    """reduced(s) broadcast (as autodiff broadcasts a cotangent: 0 + s) and multiplied by a whole value,
    divided by one, negated or scaled, then added to reduced(g): one reduction of the sum (two before); where reduced(s) is read by something that is no
    such sum too, its reduction stays for that reader, and every value is NumPy's."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    a, b, b2, x, y = (r.standard_normal(shape) for shape in [(6, 8), (8, 5), (8, 5), (6, 5), (6, 5)])
    y = np.abs(y) + 1.0

    def f(a, b, b2, x, y):
        c = sf.shard(a, axis=1, over="tp") @ sf.shard(b, axis=0, over="tp")  # pending over tp
        s = np.zeros_like(x) + c.sum(-1, keepdims=True)  # [6, 1] broadcast to [6, 5]: the sum reduced first
        g = sf.shard(a, axis=1, over="tp") @ sf.shard(b2, axis=0, over="tp")
        term = {"x * s": lambda: x * s, "s * x": lambda: s * x, "s / y": lambda: s / y, "-s * 2": lambda: -s * 2.0,
                "s read twice": lambda: x * s + s * y, "s read elsewhere": lambda: x * s}[form]()
        out = term + g
        return (out, s * 3.0) if form == "s read elsewhere" else out
    s = np.zeros_like(x) + (a @ b).sum(-1, keepdims=True)
    want = {"x * s": x * s, "s * x": s * x, "s / y": s / y, "-s * 2": -s * 2.0, "s read twice": x * s + s * y,
            "s read elsewhere": x * s}[form] + a @ b2
    plan = sf.jit(f, mesh=mesh).lower(a, b, b2, x, y)
    got = plan(a, b, b2, x, y)
    if form == "s read elsewhere":
        np.testing.assert_allclose(np.asarray(got[1]), s * 3.0, rtol=1e-12)
        got = got[0]
    else:
        assert len(allreduces(plan)) == 1, str(plan)  # (one bucket of s and g before)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_a_sum_times_a_value_split_over_two_mesh_axes_is_reduced_once():
    """A README probe's silent 2x (the long hypothesis profile): b summed over its rows (pending over
    DIDy, columns over DIDx) times c split over (DIDy, DIDx): the output is over DIDx, so the sum
    stays pending over DIDy and is reduced once; the rule that places the operands took DIDy as
    clashing too and reduced it first, while the output still pended it: reduced twice."""
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    r = np.random.default_rng()
    b, c = r.standard_normal((4, 4)), r.standard_normal(4)
    for op in (np.multiply, np.divide):
        f = sf.jit(lambda b, c: op(sf.shard(sf.shard(b, 0, over="DIDy"), 1, over="DIDx").sum(0),
                                   sf.shard(c, 0, over=("DIDy", "DIDx"))), mesh=mesh)
        np.testing.assert_allclose(np.asarray(f(b, c)), op(b.sum(0), c), rtol=1e-12, atol=1e-13)
        assert len(allreduces(f.lower(b, c))) == 1


def test_carrying_pending_sums_never_adds_communication_or_refuses_a_placement():
    """A review: pieces pending over tp placed where a row is split over tp were refused at lowering
    (an rms-norm backward with the hidden axis over tp); x * s + y * s, both linear in one reduced
    [rows, 1] s, turned one Allreduce of [rows, 1] into one of [rows, cols]."""
    m = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    x = r.standard_normal((4, 8))
    g = sf.jit(sf.grad(lambda x, w: (sf.nn.rms_norm(sf.shard(x, 1, over="tp"), w) ** 2).sum()), mesh=m)(x, np.ones(8))
    one = sf.jit(sf.grad(lambda x, w: (sf.nn.rms_norm(x, w) ** 2).sum()), mesh=sf.DeviceMesh((1,), ("tp",), backend="numpy"))
    np.testing.assert_allclose(np.asarray(g), np.asarray(one(x, np.ones(8))), rtol=1e-12, atol=1e-12)
    X, Y, A, B = r.standard_normal((64, 512)), r.standard_normal((64, 512)), r.standard_normal((64, 8)), r.standard_normal((8, 1))

    def h(X, Y, A, B):
        s = np.zeros_like(X) + (sf.shard(A, 1, over="tp") @ sf.shard(B, 0, over="tp")).sum(1, keepdims=True)
        return X * s + Y * s
    plan = sf.jit(h, mesh=m).lower(X, Y, A, B)
    assert [line for line in allreduces(plan)] and all("s_r_reduced" in line for line in allreduces(plan)), str(plan)
    s = (A @ B).sum(1, keepdims=True)
    want = X * s + Y * s
    np.testing.assert_allclose(np.asarray(plan(X, Y, A, B)), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
