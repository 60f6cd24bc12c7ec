"""sf.jit takes and returns pytrees (issue 31, item 5): dicts, lists, tuples and namedtuples of
arrays, a model's parameters as one dict, with jax.tree_util's conventions (shardfuse/tree.py).
Every result against NumPy float64 on random inputs."""
from collections import namedtuple

import numpy as np
import pytest

import shardfuse as sf

Pair = namedtuple("Pair", "w b")


def rand(rng, *shape):
    return rng.standard_normal(shape)


def test_a_dict_of_parameters_in_and_a_dict_out():
    mesh, rng = sf.DeviceMesh(4), np.random.default_rng(1)
    params = {"w1": rand(rng, 8, 16), "w2": rand(rng, 16, 8), "b": rand(rng, 8)}
    x = rand(rng, 12, 8)

    @sf.jit(mesh=mesh)
    def mlp(params, x):
        h = sf.gelu(x @ sf.shard(params["w1"], axis=1))
        y = h @ sf.shard(params["w2"], axis=0) + params["b"]
        return {"y": y, "h": h}

    out = mlp(params, x)
    assert set(out) == {"h", "y"} and isinstance(out["y"], sf.Array)
    h = x @ params["w1"]
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    np.testing.assert_allclose(out["h"].gather(), h, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out["y"].gather(), h @ params["w2"] + params["b"], rtol=1e-10, atol=1e-10)
    assert mlp(params, x)["y"].shape == (12, 8)  # the same plan again (one compiled)
    assert len(mlp.cached_plans()) == 1


def test_lists_tuples_namedtuples_and_none():
    mesh, rng = sf.DeviceMesh(2), np.random.default_rng(2)
    xs = [rand(rng, 4, 6), (rand(rng, 4, 6), None), Pair(rand(rng, 6, 3), rand(rng, 3))]

    @sf.jit(mesh=mesh)
    def f(xs):
        a, (b, nothing), p = xs
        assert nothing is None
        return [a + b, Pair((a - b) @ p.w + p.b, None)]

    out = f(xs)
    a, (b, _), p = xs
    assert isinstance(out, list) and isinstance(out[1], Pair) and out[1].b is None
    np.testing.assert_allclose(out[0].gather(), a + b, rtol=1e-12)
    np.testing.assert_allclose(out[1].w.gather(), (a - b) @ p.w + p.b, rtol=1e-10, atol=1e-12)


def test_structures_compile_apart_and_lower_takes_trees_of_specs():
    mesh, rng = sf.DeviceMesh(2), np.random.default_rng(3)

    @sf.jit(mesh=mesh)
    def f(d):
        return d["a"] * 2.0

    a = rand(rng, 4, 2)
    np.testing.assert_allclose(f({"a": a}).gather(), 2 * a)
    np.testing.assert_allclose(f({"a": a, "b": a}).gather(), 2 * a)  # another structure: another plan
    plan = f.lower({"a": sf.TensorSpec((4, 2), "float64")})
    assert "d_a" in str(plan)  # leaves named after their parameter and key path


def test_arrays_in_and_a_pytree_out():
    mesh, rng = sf.DeviceMesh(2), np.random.default_rng(4)
    x = rand(rng, 4, 4)
    out = sf.jit(lambda x: {"double": x * 2.0, "pair": (x, -x)}, mesh=mesh)(x)
    np.testing.assert_allclose(out["double"].gather(), 2 * x)
    np.testing.assert_allclose(out["pair"][1].gather(), -x)
    single = sf.jit(lambda x: x + 1.0, mesh=mesh)(x)  # a leaf and a flat tuple come back as before
    assert isinstance(single, sf.Array)
    assert isinstance(sf.jit(lambda x: (x, x * 2.0), mesh=mesh)(x), tuple)


def test_plans_and_their_profile_take_the_pytrees_the_function_takes():
    """From a new-user probe: plan(...) and plan.profile(...) took only the leaves; lower() read a
    namedtuple or tuple of arrays as (shape, dtype) specs."""
    mesh, rng = sf.DeviceMesh(2), np.random.default_rng(5)
    w, x = rand(rng, 6, 4), rand(rng, 8, 6)
    f = sf.jit(lambda p, x: sf.shard(x, axis=0) @ p["w"], mesh=mesh)
    plan = f.lower({"w": w}, x)
    np.testing.assert_allclose(plan({"w": w}, x).gather(), x @ w, rtol=1e-12)
    assert len(plan.profile({"w": w}, x).events) > 0
    g = sf.jit(lambda t: t.w + t.b, mesh=mesh)
    plan = g.lower(Pair(w, w))
    np.testing.assert_allclose(plan(Pair(w, w)).gather(), 2 * w)
    assert "t_w" in str(plan) and "t_b" in str(plan)
    h = sf.jit(lambda t: t[0] * t[1], mesh=mesh)
    assert "t_0" in str(h.lower((w, w))) and "t_0" in str(h.lower([((6, 4), "float64"), ((6, 4), "float64")]))


def test_state_dict_keys_name_the_leaves():
    """A DTensor probe: keys of a PyTorch state_dict ("fc1.weight", "layers.0.w", "a-b") made leaf names
    that are no identifiers ("'p_fc1.weight' is not a valid parameter name"), and "a_b" beside
    {"a": {"b"}} the same name twice; each is an identifier now, a repeated one numbered."""
    import shardfuse as sf
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    p = {"fc1.weight": r.standard_normal((8, 4)), "fc1.bias": r.standard_normal(4), "a-b": r.standard_normal(4),
         "a_b": r.standard_normal(4), "a": {"b": r.standard_normal(4)}}
    x = r.standard_normal((2, 8))
    f = sf.jit(lambda p, x: x @ p["fc1.weight"] + p["fc1.bias"] + p["a-b"] + p["a_b"] - p["a"]["b"], mesh=mesh)
    np.testing.assert_allclose(np.asarray(f(p, x)), x @ p["fc1.weight"] + p["fc1.bias"] + p["a-b"] + p["a_b"] - p["a"]["b"],
                               rtol=1e-13)
    names = [v.name for v in f.lower(p, x).program.inputs]
    assert len(set(names)) == len(names) and all(n.isidentifier() for n in names), names
    assert "p_fc1_weight" in names and "p_a_b_2" in names
    # (a converted key is the one numbered: the user's own "a_b" keeps its name, a review)
    two = sf.jit(lambda p: p["a.b"].sum() + p["a_b"].sum(), mesh=mesh).lower({"a.b": np.ones(4), "a_b": np.ones(3)})
    assert {v.name: v.type.shape for v in two.program.inputs} == {"p_a_b_2": (4,), "p_a_b": (3,)}
    g = sf.jit(sf.grad(lambda p, x: (x @ p["fc1.weight"]).sum()), mesh=mesh)({"fc1.weight": p["fc1.weight"]}, x)
    np.testing.assert_allclose(np.asarray(g["fc1.weight"]), np.broadcast_to(x.sum(0)[:, None], (8, 4)), rtol=1e-13)


def test_a_resumed_step_count_stays_0_d_and_optax_like_states_are_pytrees():
    """A Megatron probe: a 0-d sf.Array unpickled, then donated, came back holding [1] (NumPy's and CuPy's
    ascontiguousarray of a 0-d array is 1-d); and lower() read a 3-tuple of named tuples (an optax chain's
    state) as a (shape, dtype, sharding) spec and crashed inside np.atleast_1d."""
    import collections
    import pickle

    mesh = sf.DeviceMesh(2, backend="numpy")
    count = pickle.loads(pickle.dumps(sf.replicate(np.zeros((), np.int32), mesh=mesh)))
    out = sf.jit(lambda c: c + 1, mesh=mesh, donate_argnums=0)(count)
    assert out.shape == () and np.asarray(out).shape == () and int(np.asarray(out)) == 1
    State = collections.namedtuple("State", "mu nu")
    state = (State(np.ones(4), np.zeros(4)), State(np.ones(2), np.ones(2)), State(np.zeros(1), np.zeros(1)))
    plan = sf.jit(lambda s: s[0].mu + s[1].nu.sum(), mesh=mesh).lower(state)
    np.testing.assert_array_equal(np.asarray(plan(state)), np.ones(4) + 2)
