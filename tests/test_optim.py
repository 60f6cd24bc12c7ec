"""sf.optim against optax's formulas written in float64 NumPy: Adam, AdamW, SGD with momentum (Nesterov
too), Lion, RMSProp, clip_by_global_norm, chain and schedules, eager on sf.Arrays and inside one jitted step on a
dp x tp mesh (the state sharded as its parameters, nothing communicated by the update)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import optim


def mesh():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def params_and_grads(seed=0):
    r = np.random.default_rng(seed)
    p = {"w": r.standard_normal((8, 4)), "b": r.standard_normal(4)}
    gs = [{"w": r.standard_normal((8, 4)), "b": r.standard_normal(4)} for _ in range(3)]
    return p, gs


def reference(name, p, gs, lr=0.1, b1=0.9, b2=0.999, eps=1e-8, wd=1e-2, momentum=0.9, max_norm=1.0):
    """optax's update rules, float64, step by step."""
    p = {k: v.copy() for k, v in p.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(gs, start=1):
        if name == "clip_adam":
            norm = np.sqrt(sum((v ** 2).sum() for v in g.values()))
            g = {k: v if norm < max_norm else v / norm * max_norm for k, v in g.items()}
        if name in ("adam", "adamw", "clip_adam", "schedule"):
            mu = {k: b1 * mu[k] + (1 - b1) * g[k] for k in p}
            nu = {k: b2 * nu[k] + (1 - b2) * g[k] ** 2 for k in p}
            u = {k: (mu[k] / (1 - b1 ** t)) / (np.sqrt(nu[k] / (1 - b2 ** t)) + eps) for k in p}
            if name == "adamw":
                u = {k: u[k] + wd * p[k] for k in p}
            rate = lr / t if name == "schedule" else lr
            p = {k: p[k] - rate * u[k] for k in p}
        elif name == "lion":  # (b1 0.9, b2 0.99, weight decay 1e-2)
            u = {k: np.sign((1 - 0.9) * g[k] + 0.9 * mu[k]) + wd * p[k] for k in p}
            mu = {k: 0.99 * mu[k] + (1 - 0.99) * g[k] for k in p}
            p = {k: p[k] - lr * u[k] for k in p}
        elif name == "rmsprop":  # (decay 0.9, eps 1e-8, initial scale 0.5, then momentum 0.9)
            nu = {k: 0.9 * (nu[k] if t > 1 else np.full_like(nu[k], 0.5)) + 0.1 * g[k] ** 2 for k in p}
            mu = {k: -lr * g[k] / np.sqrt(nu[k] + eps) + momentum * mu[k] for k in p}
            p = {k: p[k] + mu[k] for k in p}
        else:  # sgd with momentum, nesterov where asked
            mu = {k: g[k] + momentum * mu[k] for k in p}
            u = {k: g[k] + momentum * mu[k] for k in p} if name == "nesterov" else mu
            p = {k: p[k] - lr * u[k] for k in p}
    return p


OPTIMIZERS = {
    "adam": lambda: optim.adam(0.1),
    "adamw": lambda: optim.adamw(0.1, weight_decay=1e-2),
    "clip_adam": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1)),
    "schedule": lambda: optim.adam(lambda count: 0.1 / (count + 1)),
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optim.lion(0.1, weight_decay=1e-2),
    "rmsprop": lambda: optim.rmsprop(0.1, initial_scale=0.5, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_jitted_step_follows_optax(name):
    m = mesh()
    p, gs = params_and_grads()
    opt = OPTIMIZERS[name]()
    placed = sf.distribute(p, m, {"w": ("dp", "tp"), "b": ("tp",)})
    state = opt.init(placed)

    @sf.jit(mesh=m, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state
    layouts = {"w": ("dp", "tp"), "b": ("tp",)}
    for g in gs:
        placed, state = step(placed, state, sf.distribute(g, m, layouts))  # (gradients sharded as their weights)
    want = reference(name, p, gs)
    for k in p:
        assert placed[k].sharding == sf.distribute(p, m, {"w": ("dp", "tp"), "b": ("tp",)})[k].sharding
        np.testing.assert_allclose(np.asarray(placed[k]), want[k], rtol=1e-12, atol=1e-12)
    plan = step.lower(placed, state, sf.distribute(gs[0], m, layouts))
    assert set(plan.collectives()) <= {"allreduce"}, str(plan)  # (the clip's norm only: a scalar)
    assert ("allreduce" in plan.collectives()) == (name == "clip_adam")


def test_eager_on_sf_arrays_and_float32_stays_float32():
    m = mesh()
    p, gs = params_and_grads(1)
    p32 = sf.distribute({k: v.astype(np.float32) for k, v in p.items()}, m, {"w": (None, "tp"), "b": None})
    opt = optim.adamw(0.1, weight_decay=1e-2)
    state = opt.init(p32)
    for g in gs:
        g32 = sf.distribute({k: v.astype(np.float32) for k, v in g.items()}, m, {"w": (None, "tp"), "b": None})
        updates, state = opt.update(g32, state, p32)
        p32 = optim.apply_updates(p32, updates)
    want = reference("adamw", p, gs)
    for k in p:
        assert p32[k].dtype == np.float32
        np.testing.assert_allclose(np.asarray(p32[k]), want[k], rtol=2e-5, atol=2e-5)


def test_global_norm_and_errors():
    p, gs = params_and_grads(2)
    np.testing.assert_allclose(np.asarray(optim.global_norm(gs[0])),
                               np.sqrt(sum((v ** 2).sum() for v in gs[0].values())), rtol=1e-13)
    with pytest.raises(ValueError, match="needs params"):
        optim.adamw(0.1).update(gs[0], optim.adamw(0.1).init(p))


def test_review_cases_schedule_dtype_float16_norm_and_zero_momentum():
    """Eager schedules keep a float32 update float32 (a count of NumPy's made the rate float64); the
    global norm of float16 gradients past 256 widens before squaring (inf before); sgd(momentum=0.0)
    keeps its momentum state, as optax's."""
    p32 = {"w": np.ones((4, 2), np.float32)}
    opt = optim.sgd(lambda c: 0.1 / (c + 1))
    updates, _ = opt.update({"w": np.full((4, 2), 0.5, np.float32)}, opt.init(p32), p32)
    assert updates["w"].dtype == np.float32
    big = {"w": np.full((4,), 300.0, np.float16)}
    np.testing.assert_allclose(np.asarray(optim.global_norm(big)), 600.0, rtol=1e-6)
    assert isinstance(optim.sgd(0.1, momentum=0.0).init(p32)[0], optim.TraceState)


def test_init_under_jit_returns_the_state_placed_as_its_parameters():
    """jax.jit(opt.init, ...) is the usual sharded init (a JAX-port probe: a returned NumPy constant, the
    count's zeros, was refused); the returned constant is a copy, so donating it leaves the next init whole."""
    m = mesh()
    p = {"w": np.ones((4, 4)), "b": np.ones(4)}
    init = sf.jit(lambda p: optim.adam(1e-3).init(p), mesh=m, in_shardings=({"w": (None, "tp"), "b": ("tp",)},))
    state = init(p)
    assert int(state[0].count) == 0 and state[0].mu["w"].placements == (sf.Replicate(), sf.Shard(1))
    bump = sf.jit(lambda s: s[0].count + 1, mesh=m, donate_argnums=0)
    assert int(bump(state)) == 1 and int(init(p)[0].count) == 0


def traced_of(schedule, m):
    return sf.jit(lambda c: schedule(c) * 1.0, mesh=m)


def test_schedules_and_a_weight_decay_mask_follow_optax():
    """optax's warmup_cosine_decay / linear / cosine schedules (eager and traced counts) and adamw's
    mask= (no decay of the bias: a JAX-port probe wrote it by hand)."""
    import math
    sched = optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100, 1e-5)

    def ref(c):
        if c < 10:
            return 1e-3 * c / 10
        return (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * min((c - 10) / 90, 1))) + 1e-5
    m = mesh()
    traced = sf.jit(lambda c: sched(c) * 1.0, mesh=m)
    for c in (0, 5, 10, 50, 100, 150):
        assert abs(float(np.asarray(sched(np.int32(c)))) - ref(c)) < 1e-15
        assert abs(float(np.asarray(traced(np.int32(c)))) - ref(c)) < 1e-15
    assert float(optim.linear_schedule(1.0, 0.0, 4, 2)(np.int32(4))) == 0.5
    assert float(optim.linear_schedule(1.0, 0.1, 10, -5)(np.int32(0))) == 1.0  # (optax: a negative start is 0)
    assert float(optim.warmup_cosine_decay_schedule(0.0, 0.0, 2, 10, 0.01)(np.int32(6))) == 0.0  # (zero peak)
    # optax.exponential_decay: held before transition_begin, staircase floors the exponent, end_value bounds it
    for kw, want in [({}, {0: 1.0, 5: 1.0, 15: 0.5, 20: 0.5 ** 1.5}),
                     ({"staircase": True, "end_value": 0.3}, {14: 1.0, 15: 0.5, 20: 0.5, 25: 0.3, 100: 0.3}),
                     ({"decay_rate": 2.0, "end_value": 3.0}, {15: 2.0, 100: 3.0}),
                     ({"transition_begin": -5}, {0: 1.0, 10: 0.5}),  # (optax's: a negative start is 0, a review)
                     ({"decay_rate": 0.0}, {0: 1.0, 20: 1.0})]:  # (optax's: a constant)
        kw = {"transition_begin": 5, "decay_rate": 0.5, **kw} if "transition_begin" not in kw else {"decay_rate": 0.5, **kw}
        sched = optim.exponential_decay(1.0, 10, **kw)
        for c, v in want.items():
            assert abs(float(np.asarray(sched(np.int32(c)))) - v) < 1e-15, (kw, c)
            assert abs(float(np.asarray(traced_of(sched, m)(np.int32(c)))) - v) < 1e-15, (kw, c)
    with pytest.raises(ValueError, match="must pass warmup_steps"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10)
    with pytest.raises(ValueError, match="decay_steps must be positive"):
        optim.cosine_decay_schedule(1.0, 0)
    nested = {"layer": {"w": np.ones(2), "b": np.ones(2)}, "emb": np.ones(2)}  # (a mask that is a prefix, optax's)
    prefix = optim.adamw(0.1, weight_decay=1.0, mask={"layer": False, "emb": True})
    u, _ = prefix.update(nested, prefix.init(nested), nested)
    np.testing.assert_allclose(u["emb"], u["layer"]["w"] - 0.1, rtol=1e-14)
    p, gs = params_and_grads(3)
    opt = optim.adamw(0.1, weight_decay=0.5, mask=lambda params: {"w": True, "b": False})
    updates, _ = opt.update(gs[0], opt.init(p), p)
    plain, _ = optim.adam(0.1).update(gs[0], optim.adam(0.1).init(p), p)
    np.testing.assert_allclose(updates["b"], plain["b"], rtol=1e-14)  # (the bias: no decay)
    np.testing.assert_allclose(updates["w"], plain["w"] - 0.1 * 0.5 * p["w"], rtol=1e-13)


def test_apply_if_finite_masked_and_piecewise_constant_follow_optax():
    """optax.apply_if_finite (a step with an inf gradient skipped: zero updates, Adam's moments kept; applied
    anyway after max_consecutive_errors such steps), optax.masked (Adam on the weight only, the bias's
    updates passed through) and piecewise_constant_schedule, in one jitted step on a dp x tp mesh."""
    m = mesh()
    p, gs = params_and_grads(5)
    bad = {"w": gs[1]["w"].copy(), "b": gs[1]["b"]}
    bad["w"][3, 2] = np.inf
    layouts = {"w": ("dp", "tp"), "b": ("tp",)}
    opt = optim.apply_if_finite(optim.adam(0.1), max_consecutive_errors=1)

    @sf.jit(mesh=m)
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state
    placed, state = sf.distribute(p, m, layouts), opt.init(p)
    placed, state = step(placed, state, sf.distribute(gs[0], m, layouts))
    skipped, state2 = step(placed, state, sf.distribute(bad, m, layouts))  # (skipped: params and moments kept)
    for k in p:
        np.testing.assert_array_equal(np.asarray(skipped[k]), np.asarray(placed[k]))
    assert int(state2.notfinite_count) == 1 and int(state2.total_notfinite) == 1 and not bool(state2.last_finite)
    np.testing.assert_array_equal(np.asarray(state2.inner_state[0].mu["w"]), np.asarray(state.inner_state[0].mu["w"]))
    after, _ = step(skipped, state2, sf.distribute(gs[2], m, layouts))
    want = reference("adam", p, [gs[0], gs[2]])
    for k in p:
        np.testing.assert_allclose(np.asarray(after[k]), want[k], rtol=1e-12, atol=1e-12)
    forced, state3 = step(skipped, step(skipped, state2, sf.distribute(bad, m, layouts))[1],
                          sf.distribute(bad, m, layouts))  # (the third bad step in a row: applied anyway)
    assert int(state3.notfinite_count) == 3 and not np.isfinite(np.asarray(forced["w"])).all()
    masked = optim.masked(optim.adam(0.1), {"w": True, "b": False})
    u, s = masked.update(gs[0], masked.init(p), p)
    plain, _ = optim.adam(0.1).update(gs[0], optim.adam(0.1).init(p), p)
    np.testing.assert_allclose(u["w"], plain["w"], rtol=1e-14)
    np.testing.assert_array_equal(u["b"], gs[0]["b"])
    assert s.inner_state[0].mu["b"] is None  # (the state of the masked parameters only)
    sched = optim.piecewise_constant_schedule(1.0, {10: 0.5, 20: 0.1})
    for c, v in ((0, 1.0), (9, 1.0), (10, 0.5), (19, 0.5), (20, 0.05), (99, 0.05)):
        assert abs(float(np.asarray(sched(np.int32(c)))) - v) < 1e-15
        assert abs(float(np.asarray(traced_of(sched, m)(np.int32(c)))) - v) < 1e-15


def test_multisteps_accumulates_the_mean_and_applies_every_k():
    """optax.MultiSteps(adam, every_k_schedule=3): zero updates and Adam's state kept for two calls, then Adam
    on the mean of the three gradients; in a jitted, donated step on a dp x tp mesh and eagerly."""
    m = mesh()
    p, _ = params_and_grads(6)
    r = np.random.default_rng(7)
    gs = [{"w": r.standard_normal((8, 4)), "b": r.standard_normal(4)} for _ in range(6)]
    layouts = {"w": ("dp", "tp"), "b": ("tp",)}
    ms = optim.MultiSteps(optim.adam(0.1), every_k_schedule=3)

    @sf.jit(mesh=m, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = ms.update(grads, state, params)
        return optim.apply_updates(params, updates), state
    placed, state = sf.distribute(p, m, layouts), ms.init(sf.distribute(p, m, layouts))
    means = [{k: sum(g[k] for g in gs[j:j + 3]) / 3 for k in p} for j in (0, 3)]
    for j, g in enumerate(gs):
        before = {k: np.asarray(placed[k]).copy() for k in p}
        placed, state = step(placed, state, sf.distribute(g, m, layouts))
        if j % 3 != 2:
            for k in p:
                np.testing.assert_array_equal(np.asarray(placed[k]), before[k])
        else:
            want = reference("adam", p, means[: j // 3 + 1])
            for k in p:
                np.testing.assert_allclose(np.asarray(placed[k]), want[k], rtol=1e-12, atol=1e-12)
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    eager = ms.gradient_transformation()
    s = eager.init(p)
    for g in gs[:3]:
        u, s = eager.update(g, s, p)
    want = optim.adam(0.1).update(means[0], optim.adam(0.1).init(p), p)[0]
    np.testing.assert_allclose(u["w"], want["w"], rtol=1e-12)
    with pytest.raises(ValueError, match="positive int"):
        optim.MultiSteps(optim.adam(0.1), 0)


def test_inject_hyperparams_records_the_rates_and_reads_them_back_from_the_state():
    """optax.inject_hyperparams: a schedule's value at each step in state.hyperparams (float32), the updates
    those of the optimizer built with the schedule itself, a number changed in the state used by the next
    update, float32 parameters kept float32; inside a jitted step on dp x tp and eager on sf.Arrays."""
    p, gs = params_and_grads(3)
    p = {k: v.astype(np.float32) for k, v in p.items()}
    sched = optim.linear_schedule(0.1, 0.01, 2)
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=sched, weight_decay=0.05, b1=0.8)
    plain = optim.adamw(sched, weight_decay=0.05, b1=0.8)
    update = sf.jit(lambda g, s, p: opt.update(g, s, p), mesh=mesh())
    update_plain = sf.jit(lambda g, s, p: plain.update(g, s, p), mesh=mesh())
    s, s_plain = opt.init(p), plain.init(p)
    for step, g in enumerate(gs):
        g = {k: v.astype(np.float32) for k, v in g.items()}
        (u, s), (u_plain, s_plain) = update(g, s, p), update_plain(g, s_plain, p)
        assert float(np.asarray(s.hyperparams["learning_rate"])) == np.float32(sched(step))
        assert np.asarray(s.hyperparams["learning_rate"]).dtype == np.float32 and int(np.asarray(s.count)) == step + 1
        for k in p:
            np.testing.assert_allclose(np.asarray(u[k]), np.asarray(u_plain[k]), rtol=1e-6)
            assert np.asarray(u[k]).dtype == np.float32
    s = s._replace(hyperparams={**s.hyperparams, "weight_decay": np.float32(0.0)})  # (read by the next update)
    no_decay = optim.inject_hyperparams(optim.adamw)(learning_rate=sched, weight_decay=0.0, b1=0.8)
    g = {k: v.astype(np.float32) for k, v in gs[0].items()}
    u, _ = update(g, s, p)
    u_want, _ = sf.jit(lambda g, s, p: no_decay.update(g, s, p), mesh=mesh())(g, s, p)
    for k in p:
        np.testing.assert_allclose(np.asarray(u[k]), np.asarray(u_want[k]), rtol=1e-6)
    placed = {k: sf.replicate(v, mesh=mesh()) for k, v in p.items()}
    state = opt.init(placed)
    _, state = opt.update({k: sf.replicate(v.astype(np.float32), mesh=mesh()) for k, v in gs[0].items()}, state, placed)
    assert float(np.asarray(state.hyperparams["learning_rate"])) == np.float32(0.1)
    positional = optim.inject_hyperparams(optim.sgd)(0.1, 0.9)  # (optax binds them as the factory does)
    assert set(positional.init(p).hyperparams) == {"learning_rate", "momentum"}


def test_inject_hyperparams_of_bfloat16_parameters_equal_the_plain_optimizer():
    """A review: the float32 hyperparameters made bfloat16 parameters' updates and moments float32 (a new plan
    the next step, the donated state unusable); optax casts them to bfloat16, where Adam's b2 = 0.999 rounds to 1
    and its bias correction divides by zero.  A number stays a Python number, weak inside sf.jit: the updates
    and moments are the plain optimizer's, bit for bit; every numeric argument, defaults too, is held (optax's);
    hyperparam_dtype= holds them in that dtype."""
    import ml_dtypes
    r = np.random.default_rng()
    p = {"w": r.standard_normal((4, 4)).astype(ml_dtypes.bfloat16)}
    g = {"w": r.standard_normal((4, 4)).astype(ml_dtypes.bfloat16)}
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=optim.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.1)
    plain = optim.adamw(optim.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.1)
    step = sf.jit(lambda g, s, p, o: o.update(g, s, p), mesh=mesh(), static_argnums=3)
    s, s_plain = opt.init(p), plain.init(p)
    assert set(s.hyperparams) == {"learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay"}
    plans = []
    for _ in range(3):
        (u, s), (u_plain, s_plain) = step(g, s, p, opt), step(g, s_plain, p, plain)
        np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(u_plain["w"]))
        assert np.asarray(u["w"]).dtype == ml_dtypes.bfloat16 and np.isfinite(np.asarray(u["w"], np.float32)).all()
        assert sf.tree.leaves(s.inner_state)[1].dtype == ml_dtypes.bfloat16  # (the first moment)
        plans.append(step.cache_info()["plans"])
    assert plans[2] == plans[1]  # (the third step reused the second's plan: no dtype drift)
    held = optim.inject_hyperparams(optim.sgd, hyperparam_dtype="float32")(learning_rate=0.1, momentum=0.9)
    assert np.asarray(held.init(p).hyperparams["momentum"]).dtype == np.float32


def test_inject_hyperparams_keeps_an_array_hyperparameter():
    """A review: learning_rate=np.asarray(1e-2, np.float32) was left out of state.hyperparams (optax keeps arrays)."""
    p = {"w": np.ones(3, np.float32)}
    opt = optim.inject_hyperparams(optim.adam)(learning_rate=np.asarray(1e-2, np.float32))
    state = opt.init(p)
    assert float(np.asarray(state.hyperparams["learning_rate"])) == np.float32(1e-2)
    u, state = sf.jit(lambda g, s, p: opt.update(g, s, p), mesh=mesh())(p, state, p)
    np.testing.assert_allclose(np.asarray(u["w"]), -1e-2, rtol=1e-6)


def test_clip_by_global_norm_over_pipeline_stages():
    """A pipeline probe: global_norm added the stages' sums of squares across sub-meshes and raised ("operands
    live on different sub-meshes ... move one with sf.to_mesh", inside optim.py); each stage's sum now moves to
    the whole mesh, and the clipped updates stay on their stages."""
    m = sf.DeviceMesh((2, 2), ("pp", "tp"), backend="numpy")
    st0, st1 = m.submesh([0, 1], ("tp",)), m.submesh([2, 3], ("tp",))
    r = np.random.default_rng()
    w0, w1 = r.standard_normal((4, 4)), r.standard_normal((4, 2))
    norm = np.sqrt((w0 ** 2).sum() + (w1 ** 2).sum())
    place = lambda a, b: {"a": sf.replicate(a, mesh=st0), "b": sf.shard(b, axis=0, over="tp", mesh=st1)}  # noqa: E731
    np.testing.assert_allclose(float(sf.jit(lambda a, b: optim.global_norm(place(a, b)), mesh=m)(w0, w1)), norm,
                               rtol=1e-14)
    clip = optim.clip_by_global_norm(1.0)
    g = sf.jit(lambda a, b: clip.update(place(a, b), clip.init(None))[0], mesh=m)(w0, w1)
    np.testing.assert_allclose(np.asarray(g["a"]), w0 / norm, rtol=1e-14)
    np.testing.assert_allclose(np.asarray(g["b"]), w1 / norm, rtol=1e-14)
    assert g["a"].sharding.mesh == st0 and g["b"].sharding.mesh == st1
    with_number = sf.jit(lambda a, b: optim.global_norm({**place(a, b), "c": 3.0}), mesh=m)(w0, w1)  # (a review)
    np.testing.assert_allclose(float(with_number), np.sqrt(norm ** 2 + 9.0), rtol=1e-14)


def test_global_norm_and_clipping_of_stage_placed_arrays_outside_jit():
    """global_norm of sf.Arrays placed on two pipeline stages outside jit raised ("the operands live on different
    meshes"); it is now one plan of their whole mesh, and clip_by_global_norm, sgd and apply_updates follow."""
    m = sf.DeviceMesh((2, 2), ("pp", "tp"), backend="numpy")
    st0, st1 = m.submesh([0, 1], ("tp",)), m.submesh([2, 3], ("tp",))
    r = np.random.default_rng()
    w0, w1, g0, g1 = r.standard_normal((4, 4)), r.standard_normal((4, 2)), r.standard_normal((4, 4)), r.standard_normal((4, 2))
    p = {"a": sf.replicate(w0, mesh=st0), "b": sf.shard(w1, axis=0, over="tp", mesh=st1)}
    g = {"a": sf.replicate(g0, mesh=st0), "b": sf.shard(g1, axis=0, over="tp", mesh=st1)}
    norm = np.sqrt((g0 ** 2).sum() + (g1 ** 2).sum())
    np.testing.assert_allclose(float(optim.global_norm(g)), norm, rtol=1e-14)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
    u, _ = opt.update(g, opt.init(p), p)
    new = optim.apply_updates(p, u)
    np.testing.assert_allclose(np.asarray(new["a"]), w0 - 0.1 * g0 / norm, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(new["b"]), w1 - 0.1 * g1 / norm, rtol=1e-13)


def test_an_injected_state_through_a_numpy_checkpoint_resumes_bit_for_bit():
    """A training probe: inject_hyperparams' numbers are weak 0-d float64 in the state; np.asarray / np.savez made
    them strong float64, and the resumed Adam's moments became float64 (the run drifted, silently).  A held float64
    hyperparameter is weak again when read.  Also: mask= given as a function is the mask, not a schedule."""
    import io
    mesh = sf.DeviceMesh(1, backend="numpy")
    decay = optim.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=decay, weight_decay=0.1,
                                                mask=lambda p: {"w": True, "b": False})
    p0 = {"w": np.linspace(-1, 1, 8, dtype=np.float32), "b": np.ones(2, np.float32)}
    step = sf.jit(lambda p, s: (lambda u, s: (optim.apply_updates(p, u), s))(
        *opt.update(sf.tree.tree_map(lambda x: np.cos(x) * x, p), s, p)), mesh=mesh)
    p, s = p0, opt.init(p0)
    for _ in range(3):
        p, s = step(p, s)
    leaves, treedef = sf.tree.flatten((p, s))
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(x) for x in leaves])
    buf.seek(0)
    stored = np.load(buf)
    p_np, s_np = sf.tree.unflatten(treedef, [stored[f"arr_{k}"] for k in range(len(leaves))])
    for _ in range(3):
        p, s = step(p, s)
        p_np, s_np = step(p_np, s_np)
    for a, b in zip(sf.tree.leaves((p, s)), sf.tree.leaves((p_np, s_np))):
        assert np.asarray(a).dtype == np.asarray(b).dtype, (np.asarray(a).dtype, np.asarray(b).dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adagrad_clip_scale_zero_nans_and_two_more_schedules_as_optax():
    """optax's adagrad (scale_by_rss), scale, clip, zero_nans, polynomial_schedule and join_schedules, inside
    sf.jit on a sharded parameter, against their formulas in NumPy."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    p = {"w": r.standard_normal((4, 4)).astype(np.float32), "b": r.standard_normal(4).astype(np.float32)}
    g = {"w": r.standard_normal((4, 4)).astype(np.float32), "b": r.standard_normal(4).astype(np.float32)}
    opt = optim.adagrad(0.1)
    step = sf.jit(lambda g, s, p: opt.update(g, s, p), mesh=mesh)
    state, acc = opt.init(p), {k: np.full_like(v, 0.1) for k, v in p.items()}
    placed = {"w": sf.shard(g["w"], axis=0, mesh=mesh), "b": g["b"]}
    for _ in range(3):
        u, state = step(placed, state, p)
        for k in p:
            acc[k] = acc[k] + g[k] ** 2
            assert np.asarray(u[k]).dtype == np.float32
            np.testing.assert_allclose(np.asarray(u[k]), -0.1 * g[k] / np.sqrt(acc[k] + 1e-7), rtol=1e-6)
    g["b"][1] = np.nan
    opt = optim.chain(optim.zero_nans(), optim.clip(0.5), optim.scale(-2.0))
    u, state = sf.jit(lambda g, s: opt.update(g, s), mesh=mesh)(g, opt.init(p))
    for k in p:
        np.testing.assert_allclose(np.asarray(u[k]), -2 * np.clip(np.nan_to_num(g[k]), -0.5, 0.5), rtol=1e-7)
    assert bool(np.asarray(state[0].found_nan["b"])) and not bool(np.asarray(state[0].found_nan["w"]))
    poly = optim.polynomial_schedule(1.0, 0.1, 2.0, 10, 2)
    joined = optim.join_schedules([optim.linear_schedule(0.0, 1.0, 5), optim.cosine_decay_schedule(1.0, 10)], [5])
    for c in (0, 2, 3, 7, 12, 20):
        want_poly = 0.9 * (1 - min(max(c - 2, 0), 10) / 10) ** 2 + 0.1
        want_join = c / 5 if c < 5 else 0.5 * (1 + np.cos(np.pi * min((c - 5) / 10, 1.0)))
        for count in (c, np.int32(c)):
            np.testing.assert_allclose(float(poly(count)), want_poly, rtol=1e-12)
            np.testing.assert_allclose(float(joined(count)), want_join, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(float(sf.jit(joined, mesh=mesh)(np.int32(c))), want_join, rtol=1e-7, atol=1e-7)
