"""Buffer reuse (passes/reuse.py): buffers made once whose lives do not overlap share a slab.

Results are unchanged (float64 against NumPy, and bit for bit against the same plan compiled with
SHARDFUSE_REUSE=0) for the seed example, the MLP block (tp / sp, pipelined), a ring, a transformer
training step and the GPT's; every plan is also checked by an independent liveness walk over the
steps one call issues (a shared slab never holds two values live at once); a collective keeps
its buffers until its Wait; SHARDFUSE_POISON still catches an element a plan never writes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import shardfuse as sf
from cases import assert_close, check_lives_apart, fresh_rng, seed_case, slabs_of
from shardfuse import tree
from shardfuse.ir import Instr, walk
from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference
from shardfuse.ops import COMMUNICATION, Op
from shardfuse.passes.reuse import assign_slabs, live_ranges, reuse_buffers, side_regions
from shardfuse.plan import Plan
from shardfuse.streams import Stream
from shardfuse.transformer import gpt_loss, gpt_reference, init_gpt, init_params, layer_reference



@pytest.fixture(autouse=True)
def _one_step_per_op(monkeypatch):
    """These tests read the buffers of chains of elementwise steps: with fusion (passes/fuse.py) most
    of them would not exist; tests/test_fusion.py checks the two together."""
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")

def shared(plan) -> bool:
    m = plan.memory()
    return m["persistent"] < m["unshared"]


def without_reuse(monkeypatch, make):
    monkeypatch.setenv("SHARDFUSE_REUSE", "0")
    try:
        return make()
    finally:
        monkeypatch.delenv("SHARDFUSE_REUSE")


@pytest.mark.parametrize("d", [1, 2, 4])
def test_the_seed_example(d):
    plan = seed_case(sf.DeviceMesh(d, backend="numpy"), chunks=3, streams=2, dtype="float64")
    check_lives_apart(plan.program)


@pytest.mark.parametrize("mode, chunks, d", [("tp", 2, 2), ("sp", 2, 4), ("tp", 1, 4), ("sp", 4, 2)])
def test_the_mlp_block(mode, chunks, d):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = mlp_block(mesh, mode, chunks=chunks, streams=2)
    args = mlp_inputs(fresh_rng(mesh), tokens=4 * d * chunks, hidden=2 * d)
    assert_close(f(*args).gather(), mlp_reference(*args), "float64")
    check_lives_apart(f.lower(*args).program)


@pytest.mark.parametrize("d", [2, 4])
def test_a_ring(d):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=1, algorithm="ring"), mesh=mesh, streams=2)
    rng = fresh_rng(mesh)
    a, b = rng.standard_normal((3, d, 4, 8)), rng.standard_normal((8, 5))
    assert_close(f(a, b).gather(), a @ b, "float64")
    check_lives_apart(f.lower(a, b).program)


def _training_step(mesh, **kw):
    return sf.jit(sf.value_and_grad(lambda p, x: (sf.nn.transformer_layer(p, x, 4, **kw) ** 2).mean()), mesh=mesh)


@pytest.mark.parametrize("mesh_d, kw", [(1, {}), (4, {"tp": "DIDx"}), (4, {"tp": "DIDx", "sp": True, "chunks": 2}),
                                        (4, {"dp": "DIDx"})])
def test_a_transformer_training_step_shares_most_of_its_memory(monkeypatch, mesh_d, kw):
    """(dp: its gradients summed in a bucket on a stream of its own, passes/bucket.py)"""
    mesh = sf.DeviceMesh(mesh_d, backend="numpy")
    rng = np.random.default_rng(5)
    p, x = init_params(rng, 16, "float64", 0.3), rng.standard_normal((4 if "dp" in kw else 2, 8, 16))
    f = _training_step(mesh, **kw)
    value, grads = f(p, x)
    np.testing.assert_allclose(float(value), (layer_reference(p, x, 4) ** 2).mean(), rtol=1e-12)
    plain = _training_step(mesh, **kw)
    (value0, grads0), plan0 = without_reuse(monkeypatch, lambda: (plain(p, x), plain.lower(p, x)))  # (compiled here)
    assert float(value) == float(value0)  # the same steps on the same values: bit for bit
    for g, g0 in zip(tree.leaves(grads), tree.leaves(grads0)):
        np.testing.assert_array_equal(g.gather(), g0.gather())
    plan = f.lower(p, x)
    assert "in slab" not in str(plan0) and plan0.memory()["persistent"] == plan.memory()["unshared"]
    m = plan.memory()
    assert m["unshared"] >= 3 * m["persistent"], m  # (a 64-wide layer: 4.3x; wider layers more)
    text = str(plan)  # (tp's norms' and biases' gradients are bucketed too)
    assert ("bucket=" in text) == ("SetCurrentStream Stream(4)" in text) and ("bucket=" in text or "dp" not in kw)
    check_lives_apart(plan.program)


@pytest.mark.parametrize("config", [("1d", {"tp": "tp"}), ("1d", {"tp": "tp", "sp": True, "chunks": 2})])
def test_the_gpt_training_step(config):
    mesh = sf.DeviceMesh((4,), ("tp",), backend="numpy")
    rng = np.random.default_rng(3)
    p = init_gpt(rng, 16, 16, 2, 8, "float64", 0.3)
    ids = rng.integers(0, 16, (2, 8)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    f = sf.jit(sf.value_and_grad(lambda p, i, l: gpt_loss(p, i, l, 4, **config[1])), mesh=mesh)
    value, _ = f(p, ids, labels)
    np.testing.assert_allclose(float(value), gpt_reference(p, ids, labels, 4), rtol=1e-12)
    plan = f.lower(p, ids, labels)
    assert shared(plan)
    check_lives_apart(plan.program)


def _chain():
    """x * 2 + 1, * 3, exp, + x: s and s_1 share a slab, a and e another (the plan in the docstring
    of test_poisoning_still_catches_an_element_never_written)."""
    return sf.jit(lambda x: sf.exp((x * 2.0 + 1.0) * 3.0) + x, mesh=sf.DeviceMesh(2, backend="numpy"))


def test_values_live_at_once_never_share():
    """b is written after a, and a is read after that (a * b): they may not share; a * b may take
    a's slab only written in place of it (the step reads a's element k before it writes its own),
    and c, made once both are dead, either's slab."""
    f = sf.jit(lambda x: ((x * 2.0) * (x + 1.0) + 1.0) * 3.0 + x, mesh=sf.DeviceMesh(2, backend="numpy"))
    x = np.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(f(x).gather(), ((x * 2.0) * (x + 1.0) + 1.0) * 3.0 + x)
    prog = f.lower(x).program
    a, b, ab, c = [i.into for i in prog.instrs if i.into is not None][:4]
    slab = slabs_of(prog)
    assert a in slab and c in slab and slab[a] == slab[c]  # a is dead once a * b is computed
    assert slab.get(b, -1) != slab.get(a, -2)
    over = {i.outs[0]: i.attrs.get("in_place_of") for i in prog.instrs if i.op == Op.ALLOCATE}
    assert slab.get(ab, -1) not in (slab.get(a, -2), slab.get(b, -3)) or over[ab] in (a.name, b.name)
    assert over[ab] == a.name and over[c] == ab.name  # (as planned: a dies at a * b, a * b at c)
    ranges = live_ranges(prog)
    assert ranges[a][1] >= ranges[b][0]  # (the overlap the plan has)
    check_lives_apart(prog)


def _delayed_wait(prog):
    """prog with its first top-level Wait moved to just before the last instruction: a collective
    whose send and receive buffers stay in use until then."""
    instrs = list(prog.instrs)
    k = next(n for n, i in enumerate(instrs) if i.op == Op.WAIT)
    wait = instrs.pop(k)
    instrs.insert(len(instrs) - 1, wait)
    return prog.with_instrs(instrs, "test"), k


def test_a_collective_keeps_its_buffers_until_its_wait():
    mesh = sf.DeviceMesh(4, backend="numpy")
    rng = np.random.default_rng(6)
    p, x = init_params(rng, 16, "float64", 0.3), rng.standard_normal((2, 8, 16))
    prog = _training_step(mesh, tp="DIDx").lower(p, x).program
    late, k = _delayed_wait(prog)
    start = late.instrs[k - 1]
    assert start.op in COMMUNICATION
    send, recv = start.ins[0], start.into
    before, after = assign_slabs(prog), assign_slabs(late)
    # as planned, the send buffer is free once the Wait is done: a later buffer takes its slab
    mates = [v for v, s in before.items() if s == before.get(send) and v is not send]
    assert any(live_ranges(prog)[v][0] > k for v in mates)
    # with the Wait last, both buffers are live to the end: nothing used after the start shares them
    ranges = live_ranges(late)
    assert ranges[send][1] == ranges[recv][1] == len(late.instrs) - 2
    for b in (send, recv):
        if b in after:
            assert all(ranges[v][1] < ranges[b][0] for v, s in after.items() if s == after[b] and v is not b)


def test_poisoning_still_catches_an_element_never_written(monkeypatch):
    """s and s_1 share slab 0 (s = x * 2 is dead once a = s + 1 is made, in place of s, and s_1 = a * 3
    is written in place of a).  A plan whose step writing s_1 is lost would read a's old values there;
    with SHARDFUSE_POISON the slab is refilled with NaN where s_1's life starts (it is no longer
    written in place, so it gets its poison), so the loss shows.  (Without it, old values come out:
    the test below checks that too, so the poisoning is what catches it.)"""
    f, x = _chain(), np.arange(8.0).reshape(2, 4)
    prog = f.lower(x).program
    slab = slabs_of(prog)
    s, _, s_1 = [i.into for i in prog.instrs if i.into is not None][:3]
    assert slab[s] == slab[s_1]
    broken = prog.with_instrs([i for i in prog.instrs if i.into is not s_1], "test")
    monkeypatch.setenv("SHARDFUSE_POISON", "1")
    assert np.isnan(Plan(broken)(x).gather()).all()
    monkeypatch.setenv("SHARDFUSE_POISON", "0")
    stale = Plan(broken)(x).gather()
    np.testing.assert_array_equal(stale, np.exp(x * 2.0 + 1.0) + x)  # a's values, read as s_1's


def test_buffers_live_at_the_end_of_a_call_are_not_shared():
    """An output (made per call) and the buffers it views never take a slab: the caller keeps them."""
    f = _chain()
    prog = f.lower(np.zeros((2, 4))).program
    outs = {i.outs[0] for i in walk(prog.instrs) if i.op == Op.ALLOCATE and i.attrs.get("per_call")}
    assert outs and not outs & set(slabs_of(prog))


def test_reuse_off_prints_no_slab(monkeypatch):
    plan = without_reuse(monkeypatch, lambda: _chain().lower(np.zeros((2, 4))))
    assert "slab" not in str(plan) and plan.memory()["persistent"] == plan.memory()["unshared"] == 4 * 64
    plan = _chain().lower(np.zeros((2, 4)))
    # each step of the chain written in place of the one before: one buffer
    assert str(plan).count("in slab 0") == 4 and str(plan).count("in place of") == 3
    assert plan.memory()["persistent"] == 64


def test_a_stream_switch_outside_a_loop_turns_reuse_off():
    """Liveness assumes top-level work runs on the main stream; a plan that breaks that gets no slab."""
    prog = _chain().lower(np.zeros((2, 4))).program
    plain = prog.with_instrs([replace(i, attrs={k: v for k, v in i.attrs.items() if k != "slab"}) for i in prog.instrs],
                             "test")
    assert slabs_of(reuse_buffers(plain))
    switched = plain.with_instrs([Instr(Op.SET_STREAM, attrs={"stream": Stream(0)})] + list(plain.instrs), "test")
    assert not slabs_of(reuse_buffers(switched))



def _bucket_plan():
    """tests/test_bucket.py's two sums over 4 devices: one bucket, on its own stream."""
    import test_bucket

    return test_bucket.two_sums(sf.DeviceMesh(4, backend="numpy")).lower(np.zeros((8, 6))).program


def test_a_bucket_on_its_stream_keeps_sharing_and_its_buffers_live_from_its_fork(monkeypatch):
    """The bucket's region (passes/reuse.py, side_regions): the buffers it touches live from the
    RecordEvent main makes before it (so a slab-mate's last step comes before the side stream's
    wait, and SHARDFUSE_POISON fills on main before the fork), its send and receive buffers until
    its Wait, right before main joins the side stream."""
    monkeypatch.delenv("SHARDFUSE_BUCKET_MB", raising=False)
    prog = _bucket_plan()
    [(fork, back, joined)] = side_regions(prog.instrs)
    assert [prog.instrs[k].op for k in (fork, fork + 1, fork + 2, back)] == \
        [Op.RECORD_EVENT, Op.SET_STREAM, Op.WAIT_EVENT, Op.SET_STREAM]
    ar = next(i for i in prog.instrs[fork:back] if i.op == Op.ALLREDUCE)
    wait = next(k for k, i in enumerate(prog.instrs) if i.op == Op.WAIT and i.ins == ar.outs)
    ranges = live_ranges(prog)
    assert joined == wait and ranges[ar.into][0] == fork and ranges[ar.ins[0]][1] == wait and ranges[ar.into][1] > wait
    assert ar.into in slabs_of(prog)  # it shares a slab with buffers dead before the fork
    check_lives_apart(prog)


def test_a_chained_bucket_keeps_its_first_buffers_until_main_joins_it(monkeypatch):
    """dp x sp: a bucket summed over dp, then tp, both on the side stream, the first waited for
    there.  That Wait is host order only: on the device the first Allreduce's buffers are known
    free at main's join after the last Wait, so they live until then."""
    import test_bucket
    from test_nn import mesh_of

    plan, _, _ = test_bucket.layer_grads(mesh_of("2d"), test_bucket.DP_SP, None, monkeypatch)
    prog = plan.program
    ranges = live_ranges(prog)
    chained = [(f, j) for f, last, j in side_regions(prog.instrs)
               if sum(i.op == Op.ALLREDUCE for i in prog.instrs[f:last]) == 2]
    assert chained
    for fork, joined in chained:
        first_ar = next(i for i in prog.instrs[fork:] if i.op == Op.ALLREDUCE)
        assert prog.instrs[joined + 1].op == Op.SYNCHRONIZE
        assert ranges[first_ar.into][0] == fork and ranges[first_ar.ins[0]][0] < fork  # (copied in before)
        assert ranges[first_ar.ins[0]][1] >= joined and ranges[first_ar.into][1] >= joined
    check_lives_apart(prog)


@pytest.mark.parametrize("change", ["join later", "join missing", "copy on the side stream", "no fork event"])
def test_a_side_stream_region_of_another_shape_turns_reuse_off(change):
    """Only the one shape passes/bucket.py makes is understood; any other top-level stream switch
    gets no slab (as before issue 32)."""
    prog = _bucket_plan()
    instrs = [replace(i, attrs={k: v for k, v in i.attrs.items() if k != "slab"}) for i in prog.instrs]
    plain = prog.with_instrs(instrs, "test")
    assert slabs_of(reuse_buffers(plain))
    sync = next(k for k, i in enumerate(instrs) if i.op == Op.SYNCHRONIZE)
    fork = next(k for k, i in enumerate(instrs) if i.op == Op.RECORD_EVENT)
    if change == "join later":
        instrs.insert(sync + 4, instrs.pop(sync))  # after the first copy out
    elif change == "join missing":
        del instrs[sync]
    elif change == "copy on the side stream":
        copy = next(i for i in instrs if i.op == Op.COPY)
        instrs.insert(fork + 3, copy)
    else:
        del instrs[fork]
    changed = plain.with_instrs(instrs, "test")
    assert side_regions(changed.instrs) is None and not slabs_of(reuse_buffers(changed))
