"""sf.jit(donate_argnums=) (issue 32): an update step writes its result into the donated
argument's buffers (one copy of the weights), printed in the plan; a donated sf.Array refuses any
later use; a caller's plain array or placed array is never written; a result that cannot take a
donated buffer safely gets its own; pytrees donate all their leaves."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import shardfuse as sf

MESH = sf.DeviceMesh((4,), ("tp",), backend="numpy")


def _loss(w, x):
    return ((sf.shard(x, axis=0) @ w) ** 2).mean()


def _sgd(w, x):
    return w - 0.1 * sf.grad(_loss)(w, x)


def _reference(w, x, steps):
    for _ in range(steps):
        w = w - 0.1 * (2 * x.T @ (x @ w) / (x.shape[0] * w.shape[1]))
    return w


def test_sgd_steps_write_the_weights_in_place_and_match_numpy():
    rng = np.random.default_rng(0)
    w0, x = rng.standard_normal((8, 4)), rng.standard_normal((16, 8))
    step = sf.jit(_sgd, mesh=MESH, donate_argnums=0)
    plan = step.lower(w0, x)
    assert "Fused w <- w, c_2, expr=sub(#0, scale(#1, 0.1))" in str(plan)  # (w - 0.1 * g: one step, in place)
    assert plan.program.outputs[0] is plan.program.inputs[0]
    kept = w0.copy()
    w = step(w0, x)  # a plain array: the first step writes a copy, never the caller's array
    np.testing.assert_array_equal(w0, kept)
    for _ in range(4):
        pieces = list(w.shards)
        new = step(w, x)
        assert all(a is b for a, b in zip(new.shards, pieces)), "the result is not in the donated buffers"
        with pytest.raises(RuntimeError, match="donated"):
            np.asarray(w)
        w = new
    np.testing.assert_allclose(np.asarray(w), _reference(w0, x, 5), rtol=1e-12)


def test_a_placed_array_is_copied_not_written():
    """sf.replicate of a NumPy array may view it (and its devices share one buffer): donating it
    must neither change the caller's array nor write one piece four times."""
    rng = np.random.default_rng(1)
    w0, x = rng.standard_normal((8, 4)), rng.standard_normal((16, 8))
    kept = w0.copy()
    w = sf.replicate(w0, mesh=MESH)
    out = sf.jit(_sgd, mesh=MESH, donate_argnums=(0,))(w, x)
    np.testing.assert_array_equal(w0, kept)
    np.testing.assert_allclose(np.asarray(out), _reference(kept, x, 1), rtol=1e-12)
    with pytest.raises(RuntimeError, match="donated to _sgd"):
        w.gather()


def test_a_result_written_before_the_argument_is_last_read_moves_after_it():
    """y = w * 2 traced before (w * w).sum(): the write of y is moved after that read (nothing between
    reads y), so y takes w's buffer (Lion's momentum update, written before the fused parameter update
    read the old momentum, warned and took a new buffer)."""
    def f(w):
        y = w * 2.0  # written first ...
        return y, (w * w).sum()  # ... while w is read after
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal((8, 4))
    jf = sf.jit(f, mesh=MESH, donate_argnums=0)
    plan = jf.lower(w0)
    assert set(plan.program.outputs) & set(plan.program.inputs), str(plan)
    text = str(plan)
    assert text.index("FusedSum") < text.index("Scale w <- w"), text
    y, s = jf(sf.jit(lambda w: w + 0.0, mesh=MESH)(w0))
    np.testing.assert_allclose(np.asarray(y), 2 * w0, rtol=1e-15)
    np.testing.assert_allclose(float(s), (w0 * w0).sum(), rtol=1e-12)


def test_a_result_read_beside_the_argument_keeps_its_own_buffer():
    """y read by the step that last reads w: y cannot move after it, so it keeps a buffer of its own."""
    def f(w):
        y = w * 2.0
        return y, (w * y).sum()
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal((8, 4))
    jf = sf.jit(f, mesh=MESH, donate_argnums=0)
    with pytest.warns(UserWarning, match=r"donated buffers were not usable: w: f64\[8, 4\] \(read after"):
        plan = jf.lower(w0)
        assert not set(plan.program.outputs) & set(plan.program.inputs)
        y, s = jf(sf.jit(lambda w: w + 0.0, mesh=MESH)(w0))
    np.testing.assert_allclose(np.asarray(y), 2 * w0, rtol=1e-15)
    np.testing.assert_allclose(float(s), 2 * (w0 * w0).sum(), rtol=1e-12)


def test_pytree_parameters_donated_leaf_by_leaf():
    rng = np.random.default_rng(3)
    params = {"b": rng.standard_normal(4), "w": rng.standard_normal((8, 4))}
    x = rng.standard_normal((16, 8))

    def loss(p, x):
        return np.tanh(sf.shard(x, axis=0) @ p["w"] + p["b"]).sum()

    def step(p, x):
        g = sf.grad(loss)(p, x)
        return {k: p[k] - 0.5 * g[k] for k in p}
    donating, plain = sf.jit(step, mesh=MESH, donate_argnums=0), sf.jit(step, mesh=MESH)
    p1 = p2 = params
    for _ in range(3):
        p1, p2 = donating(p1, x), plain(p2, x)
    for k in params:
        np.testing.assert_allclose(np.asarray(p1[k]), np.asarray(p2[k]), rtol=1e-14)
    text = str(donating.lower(params, x))
    assert "Fused p_b <- p_b, " in text and "Fused p_w <- p_w, " in text


def test_refusals():
    rng = np.random.default_rng(4)
    w = sf.jit(lambda w: w + 0.0, mesh=MESH)(rng.standard_normal((8, 4)))
    step = sf.jit(lambda a, b: a - 0.1 * b, mesh=MESH, donate_argnums=0)
    with pytest.raises(ValueError, match="input a is donated .* also passed as input b"):
        step(w, w)
    pair = sf.jit(lambda state, g: (state[0] - g, state[1]), mesh=MESH, donate_argnums=0)
    with pytest.raises(ValueError, match=r"input state_0 is donated .* also passed as input state_1"):
        pair((w, w), np.ones((8, 4)))  # named by the pytree leaves' inputs, not by flat positions
    z = rng.standard_normal((8, 4))  # a plain array in two donated leaves: each is copied for its result, as in JAX
    first, second = pair((z, z), np.ones((8, 4)))
    np.testing.assert_array_equal(np.asarray(first), z - 1)
    np.testing.assert_array_equal(np.asarray(second), z)
    with pytest.raises(ValueError, match="names argument 3"):
        sf.jit(lambda a: a * 2.0, mesh=MESH, donate_argnums=3)(np.ones(4))
    with pytest.raises(TypeError, match="donate_argnums"):
        sf.jit(lambda a: a, mesh=MESH, donate_argnums="w")


def test_donate_argnames_names_the_arguments_donated():
    # JAX's donate_argnames: resolved to positions once; combined with donate_argnums
    mesh = sf.DeviceMesh(2, backend="numpy")

    def step(w, g, lr):
        return w - lr * g

    f = sf.jit(step, mesh=mesh, donate_argnames="w")
    assert f.donate_argnums == (0,)
    rng = np.random.default_rng(31)
    w = sf.shard(rng.standard_normal((4, 2)), axis=0, mesh=mesh)
    g = rng.standard_normal((4, 2))
    want = w.gather() - 0.1 * g
    np.testing.assert_allclose(f(w, g, 0.1).gather(), want, rtol=1e-15)
    with pytest.raises(RuntimeError, match="donated"):
        w.gather()
    assert sf.jit(step, mesh=mesh, donate_argnums=1, donate_argnames=("w",)).donate_argnums == (0, 1)
    with pytest.raises(ValueError, match="names no positional parameter of step"):
        sf.jit(step, mesh=mesh, donate_argnames="x")


def test_a_donation_no_result_can_take_is_warned_with_the_reason():
    """JAX's "Some donated buffers were not usable": a float32 weight minus a NumPy float64 learning
    rate is float64 (NumPy 2's promotion), so no result can take the weight's buffer: said once, at
    compile time, with the dtypes; the weight stays usable.  A Python float keeps float32: no warning."""
    w = sf.replicate(np.ones((4, 8), np.float32), mesh=MESH)
    step = sf.jit(lambda w, lr: w - lr * w, mesh=MESH, donate_argnums=0)
    with pytest.warns(UserWarning, match=r"w: f32\[4, 8\] .*results of its shape are float64.*Python numbers"):
        assert step(w, np.float64(0.5)).dtype == np.float64
    np.testing.assert_array_equal(np.asarray(w), 1.0)  # (not donated: still usable)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step(w, 0.5).dtype == np.float32


def test_a_donated_leaf_returned_as_it_is_takes_its_buffer_and_the_reasons_are_right():
    """A frozen leaf of a donated state, returned unchanged, is the result itself (no copy, no
    warning); of two donated inputs with one result of their type, the other is warned about with
    that reason, not as read after the result is written."""
    m = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda s, g: {"w": s["w"] - g, "frozen": s["frozen"]}, mesh=m, donate_argnums=0)
    frozen = sf.replicate(np.arange(3, dtype=np.float32), mesh=m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = f({"w": sf.replicate(np.ones(4, np.float32), mesh=m), "frozen": frozen}, np.ones(4, np.float32))
    np.testing.assert_array_equal(np.asarray(out["frozen"]), [0, 1, 2])
    assert "Copy" not in str(f.lower({"w": np.ones(4, np.float32), "frozen": np.ones(3, np.float32)},
                                     np.ones(4, np.float32)))
    g = sf.jit(lambda a, b: a + b, mesh=m, donate_argnums=(0, 1))
    with pytest.warns(UserWarning, match=r"b: f64\[4\] \(each result of its type takes another donated input"):
        g(np.ones(4), np.ones(4))


def test_a_first_calls_state_in_another_layout_is_warned_once_briefly_with_the_way_out():
    """A replicated state whose updates come back sharded over tp (a first call on NumPy arrays):
    one reason for all of them, a few names and a count, and what reuses the buffers; fed its own
    results the step warns no more."""
    m = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    state = {f"w{k}": np.ones((4, 8), np.float32) for k in range(6)}
    step = sf.jit(lambda s: {k: sf.shard(v * 0.5, axis=1, over="tp") for k, v in s.items()}, mesh=m, donate_argnums=0)
    with pytest.warns(UserWarning) as said:
        state = step(state)
    (message,) = [str(w.message) for w in said]
    assert message.count("(its results come in another layout") == 1 and "and 2 more" in message, message
    assert "plan.output_layouts" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = step(state)
    np.testing.assert_array_equal(np.asarray(state["w5"]), 0.25)


@pytest.mark.parametrize("case", ["swap", "both", "transpose", "sum_first"])
def test_two_donated_results_never_overwrite_an_input_a_later_step_reads(case):
    """A DTensor-port probe: with two arguments donated, (x + v, v - x) returned v - x = -x (the Sub, moved
    after the Add to take v's buffer, read x after x + v was written into it); Lion's step returning
    (state, params) gave wrong parameters.  Every pair's checks now see the buffers earlier pairs took."""
    f = {"swap": lambda a, b: (b * 2.0, a + 1.0), "both": lambda a, b: (a + b, b - a),
         "transpose": lambda a, b: (a.T, b + a), "sum_first": lambda a, b: (b + a, a * 2.0)}[case]
    r = np.random.default_rng()
    a, b = r.standard_normal((4, 4)), r.standard_normal((4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a result that can take no buffer safely is warned: not the point here)
        got = sf.jit(f, mesh=MESH, donate_argnums=(0, 1))(a.copy(), b.copy())
    for g, w in zip(got, f(a, b)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-15)


@pytest.mark.parametrize("order", ["state_first", "params_first"])
def test_a_donated_lion_step_in_either_return_order_equals_the_undonated_one(order):
    from shardfuse import optim
    r = np.random.default_rng()
    params, x = {"w": r.standard_normal((8, 4))}, r.standard_normal((16, 8))
    opt = optim.lion(1e-2, weight_decay=0.1)

    def step(first, second):
        p, s = (second, first) if order == "state_first" else (first, second)
        u, s = opt.update(sf.grad(lambda p: _loss(p["w"], x))(p), s, p)
        p = optim.apply_updates(p, u)
        return (s, p) if order == "state_first" else (p, s)
    state = opt.init(params)
    args = (state, params) if order == "state_first" else (params, state)
    want = sf.jit(step, mesh=MESH)(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = sf.jit(step, mesh=MESH, donate_argnums=(0, 1))(*sf.tree.tree_map(np.copy, args))
    for g, w in zip(sf.tree.leaves(got), sf.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-15)


@pytest.mark.parametrize("case", ["transpose_read", "reshape_transpose_read", "rotation"])
def test_a_moved_write_never_passes_a_write_into_a_buffer_it_reads_through_a_view(case):
    """A review: (x + v, v * 2 + x.T) moved the second result's write after the first was written into x's
    buffer, and read x through its transpose: the check looked at x_t's writers, not x's."""
    f = {"transpose_read": lambda x, v: (x + v, v * 2.0 + x.T),
         "reshape_transpose_read": lambda x, v: (x + v, v * 2.0 + x.reshape(64).reshape(8, 8).T),
         "rotation": lambda x, y, z: (x + y.T, y + z.T, z + x.T)}[case]
    r = np.random.default_rng()
    args = [r.standard_normal((8, 8)) for _ in range(3 if case == "rotation" else 2)]
    for mesh in (MESH, sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sf.jit(f, mesh=mesh, donate_argnums=tuple(range(len(args))))(*[a.copy() for a in args])
        for g, w in zip(got, f(*args)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-15)


@pytest.mark.parametrize("view", ["T", "reversed", "tail"])
def test_a_result_returned_as_a_view_of_the_donated_buffer(view):
    """A review: (x * 2).T with x donated wrote into the caller's own array, once per replicated device
    (16 x, not 2 x), and left a donated sf.Array readable: the argument was neither copied nor marked, since
    the output was a view of the input, not the input."""
    take = {"T": lambda y: y.T, "reversed": lambda y: y[::-1], "tail": lambda y: y[1:]}[view]
    r = np.random.default_rng()
    a = r.standard_normal((4, 4))
    caller = a.copy()
    got = sf.jit(lambda x: take(x * 2.0), mesh=MESH, donate_argnums=0)(caller)
    np.testing.assert_allclose(np.asarray(got), take(2 * a), rtol=1e-15)
    np.testing.assert_array_equal(caller, a)  # (a caller's plain array is never written)
    owned = sf.jit(lambda x: x + 0.0, mesh=MESH)(a)
    got = sf.jit(lambda x: take(x * 2.0), mesh=MESH, donate_argnums=0)(owned)
    np.testing.assert_allclose(np.asarray(got), take(2 * a), rtol=1e-15)
    with pytest.raises(RuntimeError, match="was donated"):
        np.asarray(owned)
