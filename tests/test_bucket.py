"""Gradient bucketing (issue 32, training; shardfuse/passes/bucket.py): a data-parallel layer's
gradients, one Allreduce each without bucketing, are summed in a few bucketed Allreduces, with
bit-for-bit the same gradients (checked against float64 central differences too); the bucket is
issued right after its last member is copied in, on a stream of its own (forked from main there,
joined back right after its Wait), and waited for where a result is first read; the cost model
predicts it running beside the backward's GEMMs; the size cap splits buckets; dependent Allreduces
are never merged; a gradient alone in its bucket goes on that stream too, as it stands, where main
has work to run beside it.  tests/mpi/test_bucket_mpi.py runs the layer's check under mpiexec,
tests/test_gpu_grad.py a data-parallel step with buckets on GPUs."""
from __future__ import annotations

import re

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import cost
from shardfuse.ops import STREAM_OPS, Op
from shardfuse.passes.verify import PlanError, verify
from shardfuse.transformer import init_params, layer_reference, transformer_layer
from test_nn import mesh_of  # (the 1-D tp mesh and the 2x2 dp x tp mesh, NumPy devices)
from cases import directional

HEADS, HIDDEN, SEQ, BATCH = 4, 16, 8, 4
DP = {"dp": "dp"}
DP_SP = {"tp": "tp", "sp": True, "dp": "dp", "chunks": 2}


def dp_mesh(backend="numpy"):
    """Four devices, all data parallel (under mpiexec -n 2: two per process, one team)."""
    return sf.DeviceMesh((4,), ("dp",), backend=backend)


def layer_grads(mesh, kw, bucket_mb, monkeypatch, seed=0):
    """(the plan, the gradients, the inputs) of the layer's loss sum(layer(p, x) * r), compiled
    with SHARDFUSE_BUCKET_MB=bucket_mb (None: the default)."""
    if bucket_mb is None:
        monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    else:
        monkeypatch.setenv("SHARDFUSE_BUCKET_MB", str(bucket_mb))
    rng = np.random.default_rng(seed)
    p = init_params(rng, HIDDEN, "float64", 0.3)
    x, r = rng.standard_normal((BATCH, SEQ, HIDDEN)), rng.standard_normal((BATCH, SEQ, HIDDEN))
    f = sf.jit(sf.grad(lambda p, x, r: (transformer_layer(p, x, HEADS, **kw) * r).sum()), mesh=mesh)
    plan = f.lower(p, x, r)
    grads = {k: np.asarray(g.gather() if hasattr(g, "gather") else g) for k, g in f(p, x, r).items()}
    return plan, grads, (p, x, r)


def check_dp_layer(mesh, kw, monkeypatch, before, after):
    """`before` Allreduces without bucketing, `after` with it, the same gradients bit for bit, and
    those gradients right (central differences of the float64 reference)."""
    plan0, g0, _ = layer_grads(mesh, kw, 0, monkeypatch)
    plan1, g1, (p, x, r) = layer_grads(mesh, kw, None, monkeypatch)
    assert plan0.collectives()["allreduce"] == before and "bucket=" not in str(plan0)
    assert plan1.collectives()["allreduce"] == after, str(plan1)
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
    numeric, analytic = directional(lambda q: float((layer_reference(q, x, HEADS) * r).sum()), p, g1,
                                     np.random.default_rng(1))
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)
    return plan1


def test_data_parallel_layer_gradients_in_one_bucket(monkeypatch):
    # the 13 parameters' gradients: 13 Allreduces; bucketed, one (sf.grad returns no loss, and the
    # backward's seed reads the loss for its shape alone: its pending sum is never reduced)
    plan = check_dp_layer(dp_mesh(), DP, monkeypatch, before=13, after=1)
    assert re.search(r"Allreduce bucket_dp_summed <- bucket_dp, team=dp, bucket=13\n", str(plan))


def test_dp_x_sp_layer_gradients_in_chained_buckets(monkeypatch):
    # weights replicated over dp: one bucket over dp; norms' and biases' gradients, replicated over
    # dp and tp: one bucket summed over dp, then over tp (not 2 Allreduces per parameter)
    plan = check_dp_layer(mesh_of("2d"), DP_SP, monkeypatch, before=19, after=3)
    text = str(plan)
    assert "team=dp, bucket=7" in text and "team=dp, bucket=6" in text and "team=tp, bucket=6" in text


def test_bucket_issued_after_its_last_input_on_its_stream_and_waited_for_where_read(monkeypatch):
    plan, _, _ = layer_grads(mesh_of("2d"), DP_SP, None, monkeypatch)
    lines = str(plan).splitlines()
    issue = next(k for k, line in enumerate(lines) if "bucket=7" in line)
    handle = lines[issue].split()[0]
    # on the buckets' own stream (Stream(streams): sf.jit's default 4 workers are Stream(0..3)),
    # which waits for main's last copy in; the plan goes back to main at once
    assert lines[issue - 3:issue] == ["  ready = RecordEvent main", "  SetCurrentStream Stream(4)", "  WaitEvent ready"]
    assert lines[issue + 1] == "  SetCurrentStream main"
    wait = lines.index(f"  Wait {handle}")
    assert lines[wait + 1] == "  Synchronize Stream(4)"  # main joins it before anything reads a result
    last_in = [line for line in lines[:issue - 3] if "= Allocate" not in line][-1]
    assert re.match(r"\s+Copy \w+_packed <- ", last_in), last_in  # issued right after the last copy in
    between = lines[issue + 2:wait]
    assert any(re.search(r"(Matmul|Sum|Fused|Mul) ", line) for line in between), "the backward runs under it"
    assert all("_summed" not in line or "bucket" in line for line in between)  # no result read before the Wait
    # the chained bucket: over dp, then tp, both on the side stream, the first waited for there
    dp = next(k for k, line in enumerate(lines) if "team=dp, bucket=6" in line)
    assert lines[dp + 1] == f"  Wait {lines[dp].split()[0]}" and "team=tp, bucket=6" in lines[dp + 2]
    assert lines[dp + 3] == "  SetCurrentStream main" and lines[dp - 1] == "  WaitEvent ready_1"


def test_size_cap_splits_buckets(monkeypatch):
    # 5 KiB a bucket: the 4 KiB gradients of the 16 x 16 weights each fill one
    mesh = dp_mesh()
    _, g0, _ = layer_grads(mesh, DP, 0, monkeypatch)
    plan, g1, _ = layer_grads(mesh, DP, 5 / 1024, monkeypatch)
    n = plan.collectives()["allreduce"]
    assert 1 < n < 13, n
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
    # a gradient alone in its bucket (one that fills it, or DDP's bucket of one big layer) is not
    # merged, but goes on the side stream too: every Allreduce (sf.grad reduces no loss: nothing is
    # read at once)
    lines = str(plan).splitlines()
    alone = [k for k, line in enumerate(lines) if "Allreduce" in line and "bucket=" not in line]
    assert len(alone) > 1, str(plan)
    assert all(lines[k - 1].strip() == "WaitEvent " + lines[k - 3].split()[0] for k in alone), str(plan)


def _rows(v):
    return sf.shard(v, axis=0)


def two_sums(mesh):
    """Two independent sums over the devices: one bucket of two."""
    return sf.jit(lambda v: (sf.replicate(_rows(v).sum(0)), sf.replicate((_rows(v) * _rows(v)).sum(0))), mesh=mesh)


# The bucket of two_sums on 4 devices: its Allreduce on the buckets' stream, forked from main after
# the last copy in, joined back to main right after its Wait; slabs shared as without buckets.
# (v * v and its sum are one step, passes/fuse.py: the product is never written.)
TWO_SUMS_PLAN = """\
plan <lambda>(v: f64[8:DIDx, 6]) -> (s: f64[6], s_2: f64[6])
  # mesh DIDx=4, streams=4
  main = GetCurrentStream
  s_partial = Allocate f64[6] partial(DIDx)  (once, in slab 0)
  Sum s_partial <- v, axis=0
  s = Allocate f64[6]  (per call)
  bucket_DIDx = Allocate f64[12] partial(DIDx)  (once)
  s_partial_box: f64[6] partial(DIDx) = SliceArray bucket_DIDx, begin=(0,)
  s_partial_packed: f64[6] partial(DIDx) = View s_partial_box
  Copy s_partial_packed <- s_partial
  s_2_partial = Allocate f64[6] partial(DIDx)  (once, in slab 0)
  FusedSum s_2_partial <- v, axis=0, expr=mul(#0, #0)
  s_2 = Allocate f64[6]  (per call)
  s_2_partial_box: f64[6] partial(DIDx) = SliceArray bucket_DIDx, begin=(6,)
  s_2_partial_packed: f64[6] partial(DIDx) = View s_2_partial_box
  Copy s_2_partial_packed <- s_2_partial
  bucket_DIDx_summed = Allocate f64[12]  (once, in slab 0)
  ready = RecordEvent main
  SetCurrentStream Stream(4)
  WaitEvent ready
  ar_bucket = Allreduce bucket_DIDx_summed <- bucket_DIDx, team=DIDx, bucket=2
  SetCurrentStream main
  Wait ar_bucket
  Synchronize Stream(4)
  s_box: f64[6] = SliceArray bucket_DIDx_summed, begin=(0,)
  s_summed: f64[6] = View s_box
  Copy s <- s_summed
  s_2_box: f64[6] = SliceArray bucket_DIDx_summed, begin=(6,)
  s_2_summed: f64[6] = View s_2_box
  Copy s_2 <- s_2_summed
  return s, s_2"""


def test_the_plan_of_a_bucket_on_its_stream(monkeypatch):
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    assert str(two_sums(sf.DeviceMesh(4, backend="numpy")).lower(np.zeros((8, 6)))) == TWO_SUMS_PLAN


def test_independent_sums_share_one_allreduce_dependent_ones_do_not(monkeypatch):
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    mesh = sf.DeviceMesh(4, backend="numpy")
    x = np.random.default_rng(5).standard_normal((8, 6))
    rows, both = _rows, two_sums(mesh)
    chain = sf.jit(lambda v: sf.replicate((rows(v) * sf.replicate(rows(v).sum(0))).sum(0)), mesh=mesh)
    assert both.lower(x).collectives() == {"allreduce": 1}
    assert chain.lower(x).collectives() == {"allreduce": 2}
    s, q = both(x)
    np.testing.assert_allclose(np.asarray(s), x.sum(0), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(q), (x * x).sum(0), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(chain(x)), (x * x.sum(0)).sum(0), rtol=1e-13)


def test_bad_cap_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDFUSE_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="SHARDFUSE_BUCKET_MB must be a number of megabytes"):
        sf.jit(lambda v: v * 2.0, mesh=dp_mesh()).lower(np.ones((4, 2)))


def test_the_cost_model_runs_a_bucket_under_the_backward(monkeypatch):
    """Predicted on an H200 (plans only: hidden 1024, 9 MB buckets, so the first bucket closes
    before the attention's input gradients): the bucket's Allreduce on its own stream overlaps
    GEMMs the main stream issues after it, and the call ends sooner than the same plan with its
    stream steps dropped (everything in order on main, as before issue 32's fix)."""
    monkeypatch.setenv("SHARDFUSE_BUCKET_MB", "9")
    p = {k: sf.TensorSpec(v.shape, "float32") for k, v in init_params(np.random.default_rng(0), 1024).items()}
    x = sf.TensorSpec((8, 512, 1024), "float32")
    f = sf.jit(sf.grad(lambda p, x, r: (transformer_layer(p, x, 8, dp="dp") * r).sum()), mesh=dp_mesh())
    prog = f.lower(p, x, x).program
    pred = cost.predict(prog, cost.H200)
    bucket = next(e for e in pred.events if "bucket=" in e.text)
    under = [e for e in pred.events if e.kind == "gemm" and e.step > bucket.step and e.start < bucket.end]
    assert bucket.stream == "4" and under and all(e.stream == "main" for e in under), bucket
    in_order = prog.with_instrs([i for i in prog.instrs if i.op not in STREAM_OPS], "in order")
    assert pred.total_s < cost.predict(in_order, cost.H200).total_s


def test_the_cost_model_runs_a_lone_allreduce_under_the_backward(monkeypatch):
    """The same layer with 3 MB buckets (its 4 MB weights' gradients, float32 at hidden 1024, each
    alone): each lone Allreduce on the side stream overlaps work main issues after it (a GEMM or
    the elementwise steps of the backward), and the call ends sooner than with the stream steps
    dropped (each such Allreduce in order on main: predicted 2.11 against 2.33 ms)."""
    monkeypatch.setenv("SHARDFUSE_BUCKET_MB", "3")
    p = {k: sf.TensorSpec(v.shape, "float32") for k, v in init_params(np.random.default_rng(0), 1024).items()}
    x = sf.TensorSpec((8, 512, 1024), "float32")
    f = sf.jit(sf.grad(lambda p, x, r: (transformer_layer(p, x, 8, dp="dp") * r).sum()), mesh=dp_mesh())
    prog = f.lower(p, x, x).program
    pred = cost.predict(prog, cost.H200)
    alone = [e for e in pred.events if "Allreduce" in e.text and "bucket=" not in e.text and e.stream == "4"]
    assert alone, [e.text for e in pred.events if "Allreduce" in e.text]
    for ar in alone:
        assert any(e.kind in ("gemm", "compute") and e.stream == "main" and e.step > ar.step and e.start < ar.end
                   for e in pred.events), ar
    in_order = prog.with_instrs([i for i in prog.instrs if i.op not in STREAM_OPS], "in order")
    assert pred.total_s < cost.predict(in_order, cost.H200).total_s


def test_verify_refuses_a_plan_left_on_the_side_stream(monkeypatch):
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    prog = two_sums(sf.DeviceMesh(4, backend="numpy")).lower(np.zeros((8, 6))).program
    back = max(k for k, i in enumerate(prog.instrs) if i.op == Op.SET_STREAM)
    with pytest.raises(PlanError, match="must end on the main stream"):
        verify(prog.with_instrs(prog.instrs[:back] + prog.instrs[back + 1:], "test"))


# ---- a lone Allreduce: no bucket to share, still on the side stream where work runs beside it ------

def sum_and_matmul(mesh):
    """A sum over the devices, then a GEMM that needs no communication: the sum's Allreduce alone."""
    return sf.jit(lambda v, w: (sf.replicate(_rows(v).sum(0)), _rows(v) @ w), mesh=mesh)


# The lone Allreduce issued as it stands (no flat buffer, no copies) on the buckets' stream, the
# GEMM on main beside it, main's Wait and join where the result is needed (here: the return).
SUM_AND_MATMUL_PLAN = """\
plan <lambda>(v: f64[8:DIDx, 6], w: f64[6, 5]) -> (s: f64[6], c: f64[8:DIDx, 5])
  # mesh DIDx=4, streams=4
  main = GetCurrentStream
  s_partial = Allocate f64[6] partial(DIDx)  (once)
  Sum s_partial <- v, axis=0
  s = Allocate f64[6]  (per call)
  ready = RecordEvent main
  SetCurrentStream Stream(4)
  WaitEvent ready
  ar = Allreduce s <- s_partial, team=DIDx
  SetCurrentStream main
  c = Allocate f64[8:DIDx, 5]  (per call)
  Matmul c <- v @ w
  Wait ar
  Synchronize Stream(4)
  return s, c"""


def test_the_plan_of_a_lone_allreduce_on_the_side_stream(monkeypatch):
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    f = sum_and_matmul(sf.DeviceMesh(4, backend="numpy"))
    rng = np.random.default_rng(11)
    v, w = rng.standard_normal((8, 6)), rng.standard_normal((6, 5))
    assert str(f.lower(v, w)) == SUM_AND_MATMUL_PLAN
    s, c = f(v, w)
    np.testing.assert_allclose(np.asarray(s), v.sum(0), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(c.gather()), v @ w, rtol=1e-13)


def sgd_step(mesh, bucket_mb, monkeypatch, seed=12):
    """(the plan, the results, the inputs) of one step on a two-layer MLP whose first weight is
    frozen: the second weight's gradient is the one gradient summed over dp, and the backward
    goes on to x's gradient (two GEMMs of work on main) before the update reads it."""
    monkeypatch.setenv("SHARDFUSE_BUCKET_MB", str(bucket_mb)) if bucket_mb is not None else \
        monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)

    def loss(w2, x, w1):
        return (np.tanh(np.tanh(sf.shard(x, axis=0) @ w1) @ w2) ** 2).sum()

    def step(w2, x, w1):
        g2, gx = sf.grad(loss, argnums=(0, 1))(w2, x, w1)
        return w2 - 0.1 * g2, gx
    rng = np.random.default_rng(seed)
    args = (rng.standard_normal((5, 3)), rng.standard_normal((8, 6)), rng.standard_normal((6, 5)))
    f = sf.jit(step, mesh=mesh)
    w2, gx = f(*args)
    return str(f.lower(*args)), (np.asarray(w2), np.asarray(gx.gather() if hasattr(gx, "gather") else gx)), args


def test_a_lone_gradient_allreduce_runs_beside_the_rest_of_the_backward(monkeypatch):
    plan, got, (w2, x, w1) = sgd_step(dp_mesh(), None, monkeypatch)
    lines = plan.splitlines()
    # the only Allreduce: w2's gradient (sf.grad returns no loss: the backward's seed reads the loss for
    # its shape alone, so its pending sum is never reduced)
    k, = [k for k, line in enumerate(lines) if "Allreduce" in line]
    assert "bucket" not in lines[k] and re.match(r"\s+ar(_\d+)? = Allreduce \w+ <- \w+_partial, team=dp$", lines[k])
    fork = [line.split(" = ")[-1].strip() for line in lines[k - 3:k]]
    assert fork == ["RecordEvent main", "SetCurrentStream Stream(4)", "WaitEvent ready"]
    assert lines[k + 1] == "  SetCurrentStream main"
    handle, result = lines[k].split()[0], lines[k].split()[3]
    wait = lines.index(f"  Wait {handle}")
    assert lines[wait + 1] == "  Synchronize Stream(4)"
    assert sum(line.strip().startswith("Matmul") for line in lines[k + 2:wait]) == 1, "x's gradient runs under it"
    assert not any(result in line.split("<-")[-1] for line in lines[k + 2:wait]), "nothing reads it before the Wait"
    assert any(result in line.split("<-")[-1] for line in lines[wait + 2:]), "the update reads it after"
    # the same numbers as with bucketing off (the Allreduce on main, waited for at once), and right
    plan0, want, _ = sgd_step(dp_mesh(), 0, monkeypatch)
    assert "SetCurrentStream" not in plan0
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)

    def value(w2, x):
        return float((np.tanh(np.tanh(x @ w1) @ w2) ** 2).sum())
    eps, g2, gx = 1e-6, np.zeros_like(w2), np.zeros_like(x)
    for g, which in ((g2, 0), (gx, 1)):
        for idx in np.ndindex(g.shape):
            d = np.zeros_like(g)
            d[idx] = eps
            hi, lo = ([w2 + d, x], [w2 - d, x]) if which == 0 else ([w2, x + d], [w2, x - d])
            g[idx] = (value(*hi) - value(*lo)) / (2 * eps)
    np.testing.assert_allclose(got[0], w2 - 0.1 * g2, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(got[1], gx, rtol=1e-7, atol=1e-9)


def test_a_lone_allreduce_with_nothing_beside_it_stays_on_main(monkeypatch):
    """A fork and a join would buy nothing where the result is read at once or nothing runs after."""
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    mesh = sf.DeviceMesh(4, backend="numpy")
    ones = np.ones((8, 6))
    for f, args in ((lambda v: sf.replicate(_rows(v).sum(0)), (ones,)),
                    (lambda v: sf.replicate(_rows(v).sum(0)) * 2.0, (ones,)),
                    (sf.grad(lambda w, x: (np.tanh(_rows(x) @ w) ** 2).sum()), (ones.T, ones))):  # (w's, last)
        text = str(sf.jit(f, mesh=mesh).lower(*args))
        assert "Allreduce" in text and "SetCurrentStream" not in text, text


def test_gradients_cast_to_their_float32_parameters_share_buckets(monkeypatch):
    """bfloat16 compute on float32 master weights: each reduced gradient cast back to float32
    right after its Allreduce closed its bucket there (a probe: 5 blocking Allreduces where float32
    gradients made 3, in two buckets): the casts, read by nothing but the plan's return, now go last."""
    import ml_dtypes
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    bf16 = ml_dtypes.bfloat16

    def loss(p, x):
        x = sf.shard(x, axis=0, over="dp")
        return ((x * p["g1"] * p["g2"]) @ sf.shard(p["w"], axis=1, over="tp")).astype(np.float32).sum()

    r = np.random.default_rng(7)
    p = {"g1": r.standard_normal(16), "g2": r.standard_normal(16), "w": r.standard_normal((16, 8))}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    x = r.standard_normal((4, 16)).astype(np.float32)
    mixed = sf.jit(sf.grad(lambda p, x: loss({k: v.astype(bf16) for k, v in p.items()}, x.astype(bf16))), mesh=mesh)
    plan = mixed.lower(p, x)
    assert plan.collectives() == sf.jit(sf.grad(loss), mesh=mesh).lower(p, x).collectives() == {"allreduce": 3}
    assert str(plan).count("bucket=2") == 2, str(plan)
    g = mixed(p, x)
    assert all(np.asarray(g[k]).dtype == np.float32 for k in p)
    cot = np.ones((4, 8))  # (d loss / d product: the float64 reference of the three gradients)
    a = x.astype(np.float64) * p["g1"] * p["g2"]
    want = {"w": a.T @ cot, "g1": (x * p["g2"] * (cot @ p["w"].T)).sum(0), "g2": (x * p["g1"] * (cot @ p["w"].T)).sum(0)}
    for k in p:
        np.testing.assert_allclose(np.asarray(g[k]), want[k], rtol=0.05, atol=0.05 * np.abs(want[k]).max())


def test_a_reduced_value_written_by_two_steps_stays_in_order(monkeypatch):
    """dynamic_update_slice writes its result by a Copy and an update: neither is moved to the end
    alone when it reads an Allreduce's result (a review: 'used before it is defined' either way)."""
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    a, u, x = r.standard_normal((8, 4, 3)), r.standard_normal((1, 3)), r.standard_normal((4, 3))
    into = sf.jit(lambda a, u: sf.dynamic_update_slice(sf.shard(a, axis=0).sum(0), u, (2, 0)), mesh=mesh)(a, u)
    want = a.sum(0)
    want[2:3] = u
    np.testing.assert_allclose(np.asarray(into), want, rtol=1e-12)
    row = sf.jit(lambda x, a: sf.dynamic_update_slice(x, sf.shard(a, axis=0).sum(0)[:1], (1, 0)), mesh=mesh)(x, a)
    want = x.copy()
    want[1:2] = a.sum(0)[:1]
    np.testing.assert_allclose(np.asarray(row), want, rtol=1e-12)
