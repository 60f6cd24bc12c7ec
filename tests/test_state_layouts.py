"""A training loop's state and its layouts (a new user's probe, 2026-12-06): a step called with NumPy
arrays, then with its own replicated results, traces once (plan_cache.serving_plan); a
tensor-parallel step returns its weights sharded, and plan.output_layouts says how, so
sf.distribute places a first state the steady-state plan takes; sf.distribute inside sf.jit states
a whole layout (JAX's with_sharding_constraint).  NumPy devices, values against float64 NumPy."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.layout import Layout

MESH = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def rng():
    return np.random.default_rng()


def _dp_step(w, x):
    g = sf.grad(lambda w: ((sf.shard(x, axis=0, over="dp") @ w) ** 2).mean())(w)
    return w - 0.1 * g


def _tp_step(params, x):
    def loss(p):
        h = sf.shard(x, axis=0, over="dp") @ sf.shard(p["w1"], axis=1, over="tp")
        return ((h @ sf.shard(p["w2"], axis=0, over="tp")) ** 2).mean()
    g = sf.grad(loss)(params)
    return sf.tree.tree_map(lambda w, d: w - 0.1 * d, params, g)


def _tp_reference(params, x):
    w1, w2 = params["w1"], params["w2"]
    h = x @ w1
    y = h @ w2
    dy = 2 * y / y.size
    return {"w1": w1 - 0.1 * x.T @ (dy @ w2.T), "w2": w2 - 0.1 * h.T @ dy}


def test_a_replicated_state_comes_back_into_the_same_plan_without_tracing_again():
    traced = []

    def step(w, x):
        traced.append(1)
        return _dp_step(w, x)
    f = sf.jit(step, mesh=MESH, donate_argnums=0)
    w, x = rng().standard_normal((8, 4)), rng().standard_normal((16, 8))
    want = w
    for _ in range(3):
        want = want - 0.1 * 2 * x.T @ (x @ want) / (16 * 4)
    w = f(f(f(w, x), x), x)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-12)
    assert len(traced) == 1 and len({id(p) for p in f.cached_plans().values()}) == 1


def test_a_tensor_parallel_state_placed_as_the_step_returns_it_compiles_once():
    params = {"w1": rng().standard_normal((8, 12)), "w2": rng().standard_normal((12, 6))}
    x = rng().standard_normal((16, 8))
    f = sf.jit(_tp_step, mesh=MESH, donate_argnums=0)
    layouts = f.lower(params, x).output_layouts
    assert layouts["w1"].axes == (None, "tp") and layouts["w2"].axes == ("tp", None)
    g = sf.jit(_tp_step, mesh=MESH, donate_argnums=0)  # (a fresh function: its first plan is the steady one)
    state = sf.distribute(params, MESH, layouts)
    assert state["w1"].sharding.axes == (None, "tp") and state["w2"].sharding.axes == ("tp", None)
    want = params
    for _ in range(3):
        state, want = g(state, x), _tp_reference(want, x)
    for k in want:  # (atol: an element near 0 after three steps carries the summation order's rounding)
        np.testing.assert_allclose(np.asarray(state[k]), want[k], rtol=1e-12, atol=1e-12 * np.abs(want[k]).max())
    assert g.cache_info()["plans"] == 1
    plan = next(iter(g.cached_plans().values()))
    (ins, x_layout) = plan.input_layouts  # (the arguments' structure: a dict, then one array)
    assert (ins["w1"].axes, ins["w2"].axes, x_layout.axes) == ((None, "tp"), ("tp", None), ("dp", None))
    assert "Allgather" not in str(plan)  # (the weights stay sharded: nothing gathers them)


def test_distribute_inside_jit_states_the_whole_layout():
    x = rng().standard_normal((8, 4))
    f = sf.jit(lambda x: sf.distribute(sf.shard(x * 2, axis=0, over="dp"), MESH, (None, "tp")), mesh=MESH)
    y = f(x)
    assert y.sharding.axes == (None, "tp")  # (the dp annotation before it replaced: axes not named replicate)
    np.testing.assert_allclose(np.asarray(y), 2 * x, rtol=1e-15)
    z = sf.jit(lambda x: sf.distribute(x, MESH, [sf.Shard(1), sf.Shard(0)]), mesh=MESH)(x)
    assert z.sharding.axes == ("tp", "dp")
    with pytest.raises(ValueError, match="does not divide"):
        sf.jit(lambda x: sf.distribute(x, MESH, (None, ("dp", "tp"))), mesh=MESH)(rng().standard_normal((8, 6)))
    with pytest.raises(ValueError, match="unknown mesh axis"):
        sf.jit(lambda x: sf.distribute(x, MESH, ("x", None)), mesh=MESH)(x)


def test_distribute_takes_a_layout_and_pytrees():
    x = rng().standard_normal((8, 4))
    one = sf.distribute(x, MESH, Layout((None, "tp")))
    assert one.sharding.axes == (None, "tp")
    tree = sf.distribute({"a": x, "b": [x, x]}, MESH, ("dp", None))  # (one spec for every leaf)
    assert all(leaf.sharding.axes == ("dp", None) for leaf in sf.tree.tree_leaves(tree))
    each = sf.distribute({"a": x, "b": x}, MESH, {"a": Layout(("dp", None)), "b": Layout((None, "tp"))})
    assert each["a"].sharding.axes == ("dp", None) and each["b"].sharding.axes == (None, "tp")
    np.testing.assert_array_equal(np.asarray(each["b"]), x)


def test_shard_given_a_whole_spec_says_to_write_distribute():
    x = rng().standard_normal((4, 4))
    with pytest.raises(TypeError, match=r"takes one tensor axis.*sf.distribute\(x, mesh, \(None, 'tp'\)\)"):
        sf.jit(lambda w: sf.shard(w, (None, "tp")), mesh=MESH)(x)
    with pytest.raises(TypeError, match="sf.distribute"):
        sf.shard(x, [sf.Replicate(), sf.Shard(0)], mesh=MESH)


def test_distribute_of_a_sub_mesh_layout_places_there_and_a_partial_layout_is_refused():
    sub = MESH.submesh([0, 1])
    x = rng().standard_normal((4, 2))
    a = sf.distribute(x, MESH, Layout(("tp", None), mesh=sub))
    assert a.mesh == sub and a.sharding.axes == ("tp", None)
    np.testing.assert_array_equal(np.asarray(a), x)
    y = sf.jit(lambda x: sf.distribute(x * 2, MESH, Layout(("tp", None), mesh=sub)), mesh=MESH)(x)
    assert y.sharding.mesh == sub and y.sharding.axes == ("tp", None)
    np.testing.assert_array_equal(np.asarray(y), 2 * x)
    with pytest.raises(ValueError, match="pends sums over"):
        sf.distribute(x, MESH, Layout(("dp", None), partial=("tp",)))


def test_a_step_count_in_the_state_stays_weak_and_the_weights_keep_their_dtype():
    """{"w": float32, "step": 0}: the count's Python int is weak, and so is its result (JAX keeps
    weak types on jit's outputs), so 0.1 / (step + 1) * g stays float32 on every later call and
    the plan is traced once (the count came back strong int64: w turned float64 on call 2)."""
    traced = []

    @sf.jit(mesh=MESH, donate_argnums=0)
    def step(state, g):
        traced.append(1)
        lr = 0.1 / (state["step"] + 1)
        return {"w": state["w"] - lr * g, "step": state["step"] + 1}
    g = rng().standard_normal(4).astype(np.float32)
    s, want = {"w": np.ones(4, np.float32), "step": 0}, np.ones(4, np.float32)
    for t in range(4):
        s = step(s, g)
        want = want - np.float32(0.1 / (t + 1)) * g
        assert s["w"].dtype == np.float32 and s["step"].weak and int(s["step"]) == t + 1
    np.testing.assert_allclose(np.asarray(s["w"]), want, rtol=1e-6)
    assert len(traced) == 1
    assert not (s["step"] + np.int64(1)).weak  # (a NumPy scalar is strong: so is the result)


def test_a_state_placed_by_a_pytree_of_specs_or_the_plans_input_layouts():
    """sf.distribute(tree, mesh, tree of JAX-style specs) as jax.device_put(tree, shardings); a Python
    count placed stays weak (jax.device_put keeps it), so the weights stay float32; plan.input_layouts
    holds the arguments' structure, so sf.distribute(args, mesh, plan.input_layouts) places them."""
    params = {"w1": rng().standard_normal((8, 4)).astype(np.float32), "b1": np.ones(4, np.float32), "count": 0}
    placed = sf.distribute(params, MESH, {"w1": (None, "tp"), "b1": ("tp",), "count": ()})
    assert placed["w1"].sharding.axes == (None, "tp") and placed["b1"].sharding.axes == ("tp",)
    assert placed["count"].weak and not sf.distribute(np.int32(0), MESH, ()).weak

    @sf.jit(mesh=MESH, donate_argnums=0)
    def step(s, x):
        lr = 0.1 / (s["count"] + 1)
        return {"w1": s["w1"] - lr * x, "b1": s["b1"], "count": s["count"] + 1}
    x = rng().standard_normal((8, 4)).astype(np.float32)
    plan = step.lower(params, x)
    layouts = plan.input_layouts
    assert isinstance(layouts, tuple) and set(layouts[0]) == {"w1", "b1", "count"}
    args = sf.distribute((params, x), MESH, layouts)
    out = step(*args)
    assert out["w1"].dtype == np.float32 and out["count"].weak
    np.testing.assert_allclose(np.asarray(out["w1"]), params["w1"] - np.float32(0.1) * x, rtol=1e-6)


def test_a_step_capturing_a_numpy_array_serves_its_own_results_without_tracing_again():
    """A serving probe's greedy step (argmax makes an np.arange; so do masks): fed its own results
    it traced and compiled a second time, the captured constant counted as an input; now one trace,
    one plan (cache_info counts distinct plans: one serving two argument kinds counts once)."""
    traced = []

    def step(x):
        traced.append(1)
        return x + np.arange(4.0)
    f = sf.jit(step, mesh=sf.DeviceMesh((2,), ("tp",), backend="numpy"))
    y = f(np.zeros(4))
    y = f(f(y))
    np.testing.assert_array_equal(np.asarray(y), 3 * np.arange(4.0))
    assert len(traced) == 1 and f.cache_info()["plans"] == 1, (len(traced), f.cache_info())
