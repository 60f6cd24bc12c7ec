"""sf.grad(..., remat="regather" | "keep") (issue 32): what a streamed AllGather+GEMM's weight
gradient reads.  "regather" (the default, Megatron's) gathers the forward's input again in the
backward; "keep" reads what the forward's stream loop gathered, each chunk kept in one whole buffer
(passes/keep.py).  Both give the same gradients bit for bit, and they match float64 central
differences; keep has one Allgather fewer per gathered input (Q, K and V share theirs), its forward
stays a For loop with the Allgathers inside, and plan.memory() shows the buffer it holds.

tests/mpi/test_remat_mpi.py runs the same checks under mpiexec."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from test_nn import mesh_of  # (the 1-D tp mesh and the 2x2 dp x tp mesh, NumPy devices)
from shardfuse import tree
from shardfuse.mlp import mlp_inputs
from cases import directional

REMATS = ("regather", "keep")


def sp_rows(x, w, r):  # sequence parallel: tokens over tp, gathered chunk by chunk (a copy per chunk)
    h = sf.stream(sf.shard(sf.shard(x, axis=0, over="tp") @ sf.shard(w, axis=1, over="tp"), axis=-1, over="tp"),
                  axis=0, chunks=2)
    return (h * r).sum()


def over_batch(x, w, r):  # tokens over tp, streamed over the batch: each chunk a contiguous slice (no copy)
    h = sf.stream(sf.shard(sf.shard(x, axis=1, over="tp") @ sf.shard(w, axis=1, over="tp"), axis=-1, over="tp"),
                  axis=0, chunks=2)
    return (h * r).sum()


def whole(x, w, r):  # not streamed: the forward's one Allgather is kept
    return (sf.shard(sf.shard(x, axis=1, over="tp") @ sf.shard(w, axis=1, over="tp"), axis=-1, over="tp") * r).sum()


def ring(x, w, r):  # the ring passes shards around (no Allgather to keep): gathered again
    h = sf.stream(sf.shard(sf.shard(x, axis=0, over="tp") @ sf.shard(w, axis=1, over="tp"), axis=-1, over="tp"),
                  axis=0, chunks=4, algorithm="ring")
    return (h * r).sum()


# name -> (loss, shapes of x, w, r, Allgathers keep saves)
CASES = {"sp rows": (sp_rows, [(16, 8), (8, 32), (16, 32)], 1),
         "over batch": (over_batch, [(4, 8, 6), (6, 8), (4, 8, 8)], 1),
         "whole": (whole, [(4, 8, 6), (6, 8), (4, 8, 8)], 1),
         "ring": (ring, [(8, 8, 6), (6, 8), (8, 8, 8)], 0)}


def _inputs(name, rng):
    return [rng.standard_normal(s) for s in CASES[name][1]]


def _grads(name, remat, mesh):
    return sf.jit(sf.grad(CASES[name][0], argnums=(0, 1), remat=remat), mesh=mesh)


def check_case(name, mesh, rng, eps=1e-6):
    """keep's gradients equal regather's bit for bit, and both the central differences of the
    compiled forward in two random directions."""
    xs = _inputs(name, rng)
    got = {remat: [np.asarray(g) for g in _grads(name, remat, mesh)(*xs)] for remat in REMATS}
    for k, (a, b) in enumerate(zip(*got.values())):
        assert np.array_equal(a, b), (name, k, np.abs(a - b).max())
    forward = sf.jit(CASES[name][0], mesh=mesh)
    for _ in range(2):
        for k in (0, 1):
            v = rng.standard_normal(xs[k].shape)
            hi, lo = (float(forward(*[x + s * v if j == k else x for j, x in enumerate(xs)])) for s in (eps, -eps))
            numeric, analytic = (hi - lo) / (2 * eps), float(np.sum(got["keep"][k] * v))
            assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (name, k, numeric, analytic)


@pytest.mark.parametrize("name", CASES)
def test_keep_and_regather_agree_bit_for_bit_and_with_central_differences(name):
    check_case(name, mesh_of("1d"), np.random.default_rng(7))


def _forward_loop(plan):
    return next(i for i in plan.program.instrs if i.op == "for")


@pytest.mark.parametrize("name", CASES)
def test_keep_has_one_allgather_fewer_and_the_forward_stays_pipelined(name):
    mesh, xs = mesh_of("1d"), _inputs(name, np.random.default_rng(8))
    plans = {remat: _grads(name, remat, mesh).lower(*xs) for remat in REMATS}
    counts = {remat: p.collectives() for remat, p in plans.items()}
    assert counts["keep"].pop("allgather", 0) == counts["regather"].pop("allgather", 0) - CASES[name][2]
    assert counts["keep"] == counts["regather"]  # (nothing else changes)
    if name in ("sp rows", "over batch"):  # the forward: a For loop with an Allgather per chunk, as before
        loops = [_forward_loop(p) for p in plans.values()]
        assert all(loop.attrs["extent"] == 2 and [b.op for b in loop.body].count("allgather") == 1 for loop in loops)
    if CASES[name][2]:
        assert "kept=allgather over tp (the forward's)" in str(plans["keep"])
    assert "keep" not in str(plans["regather"]) and "keep=True" not in str(plans["keep"])


def test_keep_plan_text_and_memory():
    """The sequence-parallel case: each gathered chunk is copied from its pool slot into its slice of
    x_kept after the GEMM, on its stream, and the weight gradient views x_kept.  x_kept lives from the
    forward to the backward: the bytes regather spends on a second Allgather, held instead."""
    mesh, xs = mesh_of("1d"), _inputs("sp rows", np.random.default_rng(9))
    plans = {remat: _grads("sp rows", remat, mesh).lower(*xs) for remat in REMATS}
    text = str(plans["keep"])
    assert "\n".join(text.splitlines()[3:22]) == """\
  x_split: f64[4:tp, 2, 2, 8] = View x
  x_split_gathered_pool = Allocate 2 x f64[4, 1, 2, 8]  (one per stream)
  c_split = Allocate f64[4, 2, 2, 32:tp]  (once, in slab 0)
  x_kept = Allocate f64[4, 2, 2, 8]  (once)
  entry = RecordEvent main
  For i in range(2):
    SetCurrentStream Stream(i % 2)
    WaitEvent entry
    x_split_i: f64[4:tp, 1, 2, 8] = Slice x_split, axis=1, index=i
    x_split_gathered_i: f64[4, 1, 2, 8] = Select x_split_gathered_pool, index=i % 2
    ag = Allgather x_split_gathered_i <- x_split_i, team=tp, axis=0
    Wait ag
    c_split_i: f64[4, 1, 2, 32:tp] = Slice c_split, axis=1, index=i
    Matmul c_split_i <- x_split_gathered_i @ w
    x_kept_i: f64[4, 1, 2, 8] = Slice x_kept, axis=1, index=i
    Copy x_kept_i <- x_split_gathered_i
    SetCurrentStream main
    Synchronize Stream(i % 2)
  c: f64[16, 32:tp] = View c_split""", text
    assert "x_1_1: f64[16, 8] = View x_kept, kept=allgather over tp (the forward's)" in text, text
    keep, regather = plans["keep"].memory(), plans["regather"].memory()
    kept = 16 * 8 * 8  # x gathered, float64, on each device
    assert keep["persistent"] - regather["persistent"] == kept and keep["per_call"] == regather["per_call"]


@pytest.mark.parametrize("chunks", [2, 4])
def test_mlp_block_sequence_parallel(chunks):
    """The MLP block: keep reads the forward's gathered x for dW1 and the backward's gathered dZ (its
    AllGather+GEMM's) for dW2: 2 * chunks Allgathers, all in loops, where regather has 2 more."""
    import test_grad as tg

    rng = np.random.default_rng(5)
    x, w1, b1, w2, b2 = mlp_inputs(rng, 16, 8)
    r = rng.standard_normal(x.shape)
    args = (x, w1, b1, w2, b2, r)
    got = {}
    for remat in REMATS:
        f = tg.mlp_grad(mesh_of("1d"), "sp", chunks) if remat == "regather" else _mlp_keep(chunks)
        got[remat] = [np.asarray(g) for g in f(*args)]
        plan = f.lower(*args)
        assert plan.collectives()["allgather"] == 2 * chunks + 2 * (remat == "regather"), str(plan)
        assert len(_loops_with_allgathers(plan)) == 2
    for name, a, b, want in zip("x w1 b1 w2 b2".split(), *got.values(), tg.np_mlp_grads(x, w1, b1, w2, b2, r)):
        assert np.array_equal(a, b), name
        np.testing.assert_allclose(b, want, rtol=1e-10, atol=1e-10, err_msg=name)


def _loops_with_allgathers(plan):
    return [i for i in plan.program.instrs if i.op == "for" and any(b.op == "allgather" for b in i.body)]


def _mlp_keep(chunks):
    from shardfuse.mlp import mlp_block

    block = mlp_block(mesh_of("1d"), "sp", chunks=chunks)

    def loss(x, w1, b1, w2, b2, r):
        return (block(x, w1, b1, w2, b2) * r).sum()
    return sf.jit(sf.grad(loss, argnums=(0, 1, 2, 3, 4), remat="keep"), mesh=mesh_of("1d"))


@pytest.mark.parametrize("config", ["sp", "dp x sp"])
def test_transformer_layer_sequence_parallel(config):
    """sf.nn.transformer_layer, sp: keep's gradients are regather's bit for bit and match central
    differences; 4 Allgathers fewer (the forward's two gathered inputs, Q, K and V's and fc1's; the
    backward's two gathered output gradients, of wo's and fc2's), the forward's 4 still in loops."""
    import test_transformer as tt
    from shardfuse.transformer import init_params, layer_reference, transformer_layer

    kind, kw, forward = tt.CONFIGS[config]
    rng = np.random.default_rng(2)
    p = init_params(rng, tt.HIDDEN, "float64", 0.3)
    x = rng.standard_normal((tt.BATCH, tt.SEQ, tt.HIDDEN))
    r = rng.standard_normal(x.shape)
    grads, plans = {}, {}
    for remat in REMATS:
        f = sf.jit(sf.grad(lambda p, x, r: (transformer_layer(p, x, tt.HEADS, **kw) * r).sum(), remat=remat),
                   mesh=mesh_of(kind))
        grads[remat], plans[remat] = f(p, x, r), f.lower(p, x, r)
    assert all(np.array_equal(np.asarray(grads["keep"][k]), np.asarray(grads["regather"][k])) for k in p)
    numeric, analytic = directional(lambda q: float((layer_reference(q, x, tt.HEADS) * r).sum()), p,
                                        grads["keep"], rng)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)
    assert plans["keep"].collectives()["allgather"] == plans["regather"].collectives()["allgather"] - 4
    loops = _loops_with_allgathers(plans["keep"])
    assert sum(loop.attrs["extent"] for loop in loops[:2]) == forward["allgather"]  # (the forward's two loops)
    assert plans["keep"].memory()["persistent"] > plans["regather"].memory()["persistent"]


def test_value_and_grad_and_vjp_take_remat():
    mesh, xs = mesh_of("1d"), _inputs("sp rows", np.random.default_rng(10))
    want = [np.asarray(g) for g in _grads("sp rows", "regather", mesh)(*xs)]
    value, got = sf.jit(sf.value_and_grad(sp_rows, argnums=(0, 1), remat="keep"), mesh=mesh)(*xs)
    assert all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want))

    def pulled(x, w, r):
        out, pull = sf.vjp(lambda x, w: sp_rows(x, w, r), x, w, remat="keep")
        return pull(out * 0.0 + 1.0)
    f = sf.jit(pulled, mesh=mesh)
    assert all(np.array_equal(np.asarray(g), w) for g, w in zip(f(*xs), want))
    assert "kept=" in str(f.lower(*xs))
    xa = [sf.replicate(a, mesh=mesh) for a in xs[:2]]  # outside jit: the pullback's plan keeps too
    _, pull = sf.vjp(lambda x, w: sp_rows(x, w, xs[2]), *xa, remat="keep")
    assert all(np.array_equal(np.asarray(g), w) for g, w in zip(pull(np.float64(1.0)), want))


@pytest.mark.parametrize("make", [lambda f, r: sf.grad(f, remat=r), lambda f, r: sf.value_and_grad(f, remat=r),
                                  lambda f, r: sf.vjp(f, np.ones(3), remat=r)], ids=["grad", "value_and_grad", "vjp"])
def test_remat_is_checked(make):
    for bad in ("save", None, True, "Keep"):
        with pytest.raises(ValueError, match=r"remat=.*'regather'.*'keep'.*got"):
            make(lambda x: x.sum(), bad)
