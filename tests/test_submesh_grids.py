"""Pipeline stages of several mesh axes (Megatron's pp x dp x tp): a sub-mesh made from a grid of
device ids, and values cut on several tensor axes moved between stages."""
import pickle

import numpy as np
import pytest

import shardfuse as sf


def pp_dp_tp():
    return sf.DeviceMesh((2, 2, 2), ("pp", "dp", "tp"), backend="numpy")


@pytest.fixture
def mesh():
    return pp_dp_tp()


def stages(mesh):
    ids = np.arange(8).reshape(2, 2, 2)
    return mesh.submesh(ids[0], ("dp", "tp")), mesh.submesh(ids[1], ("dp", "tp"))


def test_a_grid_of_device_ids_is_a_stage_of_several_axes(mesh):
    s0, s1 = stages(mesh)
    assert s0.shape == (2, 2) and s0.axis_names == ("dp", "tp") and s0.devices == (0, 1, 2, 3)
    assert s1.teams("dp") == [(4, 6), (5, 7)] and s1.teams("tp") == [(4, 5), (6, 7)]
    assert repr(s1) == "DeviceMesh(dp=2, tp=2, devices=(4, 5, 6, 7), backend=numpy)"
    assert mesh.submesh(np.arange(8).reshape(2, 2, 2)[:, 0]) == mesh.submesh([[0, 1], [4, 5]], ("dp", "tp"))
    assert mesh.submesh([[0, 1], [4, 5]]).axis_names == ("dp", "tp")  # (this mesh's last axes' names)
    assert pickle.loads(pickle.dumps(s1)) == s1
    assert mesh.submesh([2, 3]).axis_names == ("tp",)


def test_bad_grids(mesh):
    with pytest.raises(ValueError, match=r"need 2 distinct axis names for a 2-D sub-mesh, got \('dp',\)"):
        mesh.submesh([[0, 1], [2, 3]], ("dp",))
    with pytest.raises(ValueError, match="a sub-mesh needs distinct devices"):
        mesh.submesh([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="a sub-mesh needs distinct devices"):
        mesh.submesh([[0, 1], [2, 9]])
    with pytest.raises(ValueError, match="a sub-mesh needs distinct devices"):
        mesh.submesh([])
    with pytest.raises(ValueError, match="give axis_names for a 2-D sub-mesh"):
        sf.DeviceMesh(4, backend="numpy").submesh([[0, 1], [2, 3]])
    with pytest.raises(TypeError, match="a sub-mesh device id must be an int, got 1.0"):
        mesh.submesh([[0, 1.0]])
    # (a review: a ragged grid was "a device id must be an int, got [0, 1]"; a 0-d array another error than 3's)
    for ragged in ([[0, 1], [2]], [0, [1, 2]]):
        with pytest.raises(ValueError, match="a sub-mesh's grid of device ids must be rectangular"):
            mesh.submesh(ragged)
    for scalar in (3, np.int64(3), np.array(3)):
        with pytest.raises(TypeError, match=r"submesh\(\) takes a sequence \(or a grid\) of device ids"):
            mesh.submesh(scalar)
    s0, s1 = stages(mesh)
    for bad, said in ((sf.Layout(("dp",)), "sf.to_mesh: a layout of 1 axes"),
                      (sf.Layout(("dp", "tp"), mesh=s0), "a whole placement on"),
                      (sf.Layout(("dp", None), partial=("tp",)), "a whole placement on")):
        with pytest.raises(ValueError, match=said):
            sf.jit(lambda x: sf.to_mesh(x * 1.0, s1, placements=bad), mesh=mesh).lower(np.ones((8, 8)))


def _two_stage(s0, s1, cut):
    """x [8, 16] rows over dp and w1's columns over tp on stage 0; the hidden value moved to stage 1
    cut as `cut` says (its placements there); w2's rows over tp on stage 1."""
    def loss(w1, w2, x):
        x = sf.shard(x, axis=0, over="dp", mesh=s0)
        h = np.tanh(x @ sf.shard(w1, axis=1, over="tp", mesh=s0))
        h = sf.to_mesh(h, s1, placements=cut)
        y = h @ sf.shard(w2, axis=0, over="tp", mesh=s1)
        return (y ** 2).sum()
    return loss


def _reference(w1, w2, x):
    h = np.tanh(x @ w1)
    y = h @ w2
    return (y ** 2).sum(), x.T @ ((2 * y) @ w2.T * (1 - h ** 2)), h.T @ (2 * y)


CUTS = {  # the hidden value's cut on stage 1 -> the plan's communication for the move
    "same": ((sf.Shard(0), sf.Shard(1)), {"sendrecv": 1}),
    "rows": ((sf.Shard(0), sf.Replicate()), {"allgather": 1, "sendrecv": 1}),
    "swapped": ((sf.Shard(1), sf.Shard(0)), {"sendrecv": 1}),
    "whole": ((sf.Replicate(), sf.Replicate()), None),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_value_cut_on_two_axes_moves_between_stages(mesh, cut, r=None):
    """Values and gradients against float64 NumPy; where both stages cut the value into the same
    blocks each device receives its own block (one SendRecv), else it is gathered on its stage as
    far as the destination asks first (an Allgather over tp), never whole when it need not be."""
    s0, s1 = stages(mesh)
    r = r or np.random.default_rng()
    w1, w2, x = r.standard_normal((16, 32)), r.standard_normal((32, 16)), r.standard_normal((8, 16))
    placements, moves = CUTS[cut]
    loss = _two_stage(s0, s1, placements)
    value, g1, g2 = _reference(w1, w2, x)
    f = sf.jit(loss, mesh=mesh)
    np.testing.assert_allclose(float(f(w1, w2, x)), value, rtol=1e-12)
    if moves is not None:
        text = str(f.lower(w1, w2, x))
        assert text.count("SendRecv") == 1 and "Broadcast" not in text and "Gather " not in text, text
        head = text[:text.index("SendRecv")]  # (before the move: what stage 0 does to cut it as stage 1 asks)
        assert head.count("Allgather") == moves.get("allgather", 0), text
    grad = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)
    if cut == "same":  # (the cotangent moves back as the value came: each block to where it came from)
        text = str(grad.lower(w1, w2, x))
        assert text.count("SendRecv") == 2 and "Broadcast" not in text and "Gather " not in text, text
        assert "SendRecv c_2_back <- c_2, from=(4, 5, 6, 7), to=(0, 1, 2, 3)" in text, text
    g = grad(w1, w2, x)
    np.testing.assert_allclose(np.asarray(g[0]), g1, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.asarray(g[1]), g2, rtol=1e-10, atol=1e-10)


def test_a_dp_tp_stage_feeds_a_one_axis_stage_and_back(mesh, r=None):
    """Stage 0 of dp x tp, stage 1 the 1-D sub-mesh of devices 4..7 (a value cut on two axes
    moved to one cut on one, and its gradient back)."""
    s0, _ = stages(mesh)
    s1 = mesh.submesh([4, 5, 6, 7], ("tp",))
    r = r or np.random.default_rng()
    w1, w2, x = r.standard_normal((16, 32)), r.standard_normal((32, 16)), r.standard_normal((8, 16))
    loss = _two_stage(s0, s1, (sf.Shard(1),))
    value, g1, g2 = _reference(w1, w2, x)
    np.testing.assert_allclose(float(sf.jit(loss, mesh=mesh)(w1, w2, x)), value, rtol=1e-12)
    # (a review: it was gathered whole and scattered from one device; cut into the destination's four
    # column blocks on its own stage first, one AllToAll over dp, then each block sent where it goes)
    moved = str(sf.jit(lambda x: sf.to_mesh(np.tanh(sf.distribute(x, s0, sf.P("dp", "tp"))), s1,
                                            placements=sf.P(None, "tp")), mesh=mesh).lower(x))
    assert "AllToAll" in moved and "SendRecv" in moved and "Allgather" not in moved, moved
    assert not any(k in moved for k in ("Scatter", "Gather ", "Broadcast")), moved
    g = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)(w1, w2, x)
    np.testing.assert_allclose(np.asarray(g[0]), g1, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.asarray(g[1]), g2, rtol=1e-10, atol=1e-10)


def test_adamw_over_a_pp_dp_tp_pipeline(mesh, r=None):
    """Megatron's layout: weights placed on their dp x tp stage outside jit (column- then row-parallel
    over tp, replicated over dp), the batch's rows over dp; two AdamW steps equal the same program
    unplaced, and each stage's weight gradients are summed over its dp teams (an Allreduce)."""
    s0, s1 = stages(mesh)
    r = r or np.random.default_rng()
    w = {"a": r.standard_normal((4, 8)), "b": r.standard_normal((8, 4))}
    x = r.standard_normal((8, 4))
    opt = sf.optim.adamw(0.01)

    def loss(p, x):
        h = np.tanh(sf.shard(x, axis=0, over="dp", mesh=s0) @ p["a"])
        y = sf.to_mesh(h, s1, placements=sf.P("dp", "tp")) @ p["b"]
        return sf.to_mesh((y ** 2).mean(), mesh)

    @sf.jit(mesh=mesh, donate_argnums=(0, 1))
    def step(p, st, x):
        value, g = sf.value_and_grad(loss)(p, x)
        u, st = opt.update(g, st, p)
        return sf.optim.apply_updates(p, u), st, value

    placed = {"a": sf.distribute(w["a"], s0, sf.P(None, "tp")), "b": sf.distribute(w["b"], s1, sf.P("tp", None))}
    init = sf.jit(opt.init, mesh=mesh)  # (under mpiexec, ops outside jit on a stage's arrays are refused: README)
    text = str(step.lower(placed, init(placed), x))
    # (the one Broadcast: the loss, a scalar, to the whole mesh; the gradients' dp sums stay on their stage)
    assert text.count("team=dp") == 3 and text.count("Broadcast") == 1 and "Gather " not in text, text
    p, st, losses = placed, init(placed), []
    for _ in range(2):
        p, st, value = step(p, st, x)
        losses.append(float(value))
    assert p["a"].sharding.mesh == s0 and p["b"].sharding.mesh == s1

    # the same steps unplaced (each device computes all: no stage, no sharding)
    flat = sf.jit(lambda q, s, x: (lambda v, g: (*opt.update(g, s, q), v))(*sf.value_and_grad(
        lambda q, x: (((np.tanh(x @ q["a"])) @ q["b"]) ** 2).mean())(q, x)), mesh=mesh)
    q, s, want = w, opt.init(w), []
    for _ in range(2):
        u, s, value = flat(q, s, x)
        q = {k: np.asarray(q[k]) + np.asarray(u[k]) for k in q}
        want.append(float(value))
    np.testing.assert_allclose(losses, want, rtol=1e-13)
    for k in q:
        np.testing.assert_allclose(np.asarray(p[k]), q[k], rtol=1e-12, atol=1e-14)


def test_stages_of_the_same_devices_and_names_but_other_shapes_keep_their_own_teams():
    """A review: a (2, 2) and a (1, 4) stage of devices 4..7, both ("dp", "tp"), shared one backend (keyed
    by devices and names): the second's sums and jitted results came out wrong (or NaN, poisoned)."""
    mesh = pp_dp_tp()
    ids = np.arange(8).reshape(2, 2, 2)
    x = np.random.default_rng().standard_normal((4, 4))
    grid, flat = mesh.submesh(ids[1], ("dp", "tp")), mesh.submesh(ids[1].reshape(1, 4), ("dp", "tp"))
    for stage, spec in ((grid, sf.P("dp", "tp")), (flat, sf.P(None, "tp")), (grid, sf.P(None, "tp"))):
        np.testing.assert_allclose(np.asarray(sf.distribute(x, stage, spec).sum(axis=1)), x.sum(axis=1), rtol=1e-14)
        f = sf.jit(lambda a: sf.replicate(sf.shard(a, axis=1, over="tp") * 1.0), mesh=stage)
        np.testing.assert_array_equal(np.asarray(f(x)), x)


def test_the_cotangent_goes_back_to_the_stage_whatever_the_operands_order(mesh, r=None):
    """A review: m = c * h with c replicated on the whole mesh and h on stage 0 lives on stage 0, but its
    cotangent went back to the whole mesh (the layout of c, the first operand): Broadcasts; as h * c, one
    SendRecv.  Both orders move it back by one SendRecv now; values against NumPy."""
    s0, s1 = stages(mesh)
    r = r or np.random.default_rng()
    x, c = r.standard_normal((2, 8, 8))
    for order in (lambda c, h: c * h, lambda c, h: h * c):
        def loss(x, c):
            m = order(sf.replicate(c, mesh=mesh), np.sin(sf.distribute(x, s0, sf.P("dp", "tp"))))
            return sf.to_mesh((sf.to_mesh(m, s1, placements=sf.P("tp", "dp")) ** 2).sum(), mesh)
        g = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)
        gx, gc = g(x, c)
        np.testing.assert_allclose(np.asarray(gx), 2 * (c * np.sin(x)) * c * np.cos(x), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(gc), 2 * c * np.sin(x) ** 2, rtol=1e-12, atol=1e-12)
        moves = [line for line in str(g.lower(x, c)).splitlines() if "SendRecv" in line and "_back" in line]
        assert len(moves) == 1 and "to=(0, 1, 2, 3)" in moves[0], moves


def test_an_embeddings_gradient_comes_back_by_its_rows(mesh, r=None):
    """A Megatron probe: the lookup's result (a take: no layout known while tracing) moved to stage 1 over
    dp; its cotangent went back through one device (Gather, Broadcast) and each stage-0 device scattered
    the whole batch.  It goes back as it came, over dp (one SendRecv each way), a 1-D stage of dp
    feeding a dp x tp one too; values against NumPy."""
    s0, s1 = stages(mesh)
    r = r or np.random.default_rng()
    wte, w, ids = r.standard_normal((16, 8)), r.standard_normal((8, 8)), r.integers(0, 16, (4, 8))
    for first in (s0, mesh.submesh([0, 1, 2, 3], ("dp",))):
        def loss(p, ids):
            x = sf.take(p["wte"], sf.distribute(ids, first, sf.P("dp", None)), axis=0)
            return ((sf.to_mesh(x, s1, placements=sf.P("dp", None, None)) @ p["w"]) ** 2).sum()
        p = {"wte": sf.distribute(wte, first, sf.P("tp" if first is s0 else None, None)),
             "w": sf.distribute(w, s1, sf.P(None, None))}
        g = sf.jit(sf.grad(loss), mesh=mesh)
        moved = g.lower(p, ids).collectives()
        assert moved.get("sendrecv") == 2 and not {"gather", "broadcast", "scatter"} & set(moved), moved
        x = wte[ids]
        y = x @ w
        want = np.zeros_like(wte)
        np.add.at(want, ids.reshape(-1), (2 * y @ w.T).reshape(-1, 8))
        got = g(p, ids)
        np.testing.assert_allclose(np.asarray(got["wte"]), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(got["w"]), x.reshape(-1, 8).T @ (2 * y).reshape(-1, 8), rtol=1e-12)


def test_a_plan_profiles_with_stage_placed_arguments(mesh):
    """A Megatron probe: plan.profile refused the stage-placed weight the call takes ("plan expects
    layout ('R', 'S(1)'), got ('R', 'R', 'S(1)')")."""
    s0, s1 = stages(mesh)
    w = sf.distribute(np.ones((4, 4)), s0, sf.P(None, "tp"))
    f = sf.jit(lambda w, x: sf.to_mesh(x @ w, s1, placements=sf.P("dp", "tp")), mesh=mesh)
    timeline = f.lower(w, np.ones((4, 4))).profile(w, np.ones((4, 4)))
    assert {e.step for e in timeline.events} and {d for e in timeline.events for d in e.devices} <= set(range(8))
