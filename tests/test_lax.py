"""sf.lax: jax.lax's scan / fori_loop / while_loop / cond / switch, unrolled when traced, against NumPy
float64 loops written out; pytrees, reverse scans, gradients through a scan over stacked layer
weights (central differences), sharded carries, and the refusals (a traced loop bound or while
condition, a carry that changes shape, branches that differ)."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from cases import directional


def mesh():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def test_scan_over_stacked_layers_with_sharded_weights_and_its_gradient():
    m, r = mesh(), np.random.default_rng()
    ws, x = r.standard_normal((3, 4, 8)) * 0.4, r.standard_normal((6, 4))
    ws2 = r.standard_normal((3, 8, 4)) * 0.4

    def net(p, x):
        def layer(h, w):  # (Megatron's pair: column- then row-parallel, the carry back to replicated)
            a = np.tanh(sf.shard(h, axis=0, over="dp") @ sf.shard(w["a"], axis=1, over="tp"))
            out = a @ sf.shard(w["b"], axis=0, over="tp")
            return out, out.sum()
        return sf.lax.scan(layer, x, p)
    p = {"a": ws, "b": ws2}

    def ref(p, x):
        sums = []
        for a, b in zip(p["a"], p["b"]):
            x = np.tanh(x @ a) @ b
            sums.append(x.sum())
        return x, np.array(sums)
    h, ys = sf.jit(net, mesh=m)(p, x)
    want_h, want_ys = ref(p, x)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ys), want_ys, rtol=1e-12, atol=1e-12)
    grad = sf.jit(sf.grad(lambda p, x: net(p, x)[0].sum()), mesh=m)
    g = grad(p, x)
    numeric, analytic = directional(lambda q: float(ref(q, x)[0].sum()), p, g, r)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)
    # the layers' annotations place the stacks (their leading axis whole) and their gradients alike: no
    # gather of a weight or a gradient (a JAX-port probe: the stacks stayed replicated, 6 Allgathers)
    plan = grad.lower(p, x)
    assert plan.input_layouts[0]["a"].axes == (None, None, "tp") and plan.input_layouts[0]["b"].axes == (None, "tp", None)
    assert g["a"].sharding.axes == (None, None, "tp") and g["b"].sharding.axes == (None, "tp", None)
    assert "allgather" not in plan.collectives(), plan.collectives()


def test_scan_reverse_length_and_none_outputs():
    m, r = mesh(), np.random.default_rng()
    xs = r.standard_normal((4, 3))
    carry, ys = sf.jit(lambda xs: sf.lax.scan(lambda c, x: (c * 0.5 + x, c), np.zeros(3), xs, reverse=True),
                       mesh=m)(xs)
    c, want = np.zeros(3), [None] * 4
    for k in reversed(range(4)):
        want[k] = c
        c = c * 0.5 + xs[k]
    np.testing.assert_allclose(np.asarray(carry), c, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(ys), np.stack(want), rtol=1e-13)
    carry, ys = sf.jit(lambda v: sf.lax.scan(lambda c, _: (c + 1.0, None), v, length=5), mesh=m)(xs[0])
    assert ys is None
    np.testing.assert_allclose(np.asarray(carry), xs[0] + 5, rtol=1e-13)


def test_fori_while_cond_and_switch():
    m, r = mesh(), np.random.default_rng()
    x = r.standard_normal((4, 2))
    got = sf.jit(lambda x: sf.lax.fori_loop(1, 4, lambda i, c: c * 2 + i, x), mesh=m)(x)
    np.testing.assert_allclose(np.asarray(got), ((x * 2 + 1) * 2 + 2) * 2 + 3, rtol=1e-13)
    got = sf.jit(lambda x: sf.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)),
                 mesh=m)(x)
    assert got[0] == 3
    np.testing.assert_allclose(np.asarray(got[1]), x * 8, rtol=1e-13)
    branch = sf.jit(lambda x, p: sf.lax.cond(p > 0, lambda v: {"y": v * 2}, lambda v: {"y": v - 1}, x), mesh=m)
    np.testing.assert_allclose(np.asarray(branch(x, 0.5)["y"]), x * 2, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(branch(x, -0.5)["y"]), x - 1, rtol=1e-13)
    assert sf.lax.cond(True, lambda: 1, lambda: 2) == 1  # (a Python predicate: one branch, as JAX's)
    fns = [lambda v: v + 10.0, lambda v: v + 20.0, lambda v: v + 30.0]
    pick = sf.jit(lambda x, i: sf.lax.switch(i, fns, x), mesh=m)
    for i, add in [(-1, 10), (0, 10), (1, 20), (2, 30), (7, 30)]:  # (clamped, as JAX's)
        np.testing.assert_allclose(np.asarray(pick(x, np.int32(i))), x + add, rtol=1e-13)


def test_refusals_say_what_was_expected():
    m = mesh()
    x = np.ones((4, 2))
    with pytest.raises(TypeError, match="bounds must be Python ints"):
        sf.jit(lambda x, n: sf.lax.fori_loop(0, n, lambda i, c: c, x), mesh=m)(x, np.int32(3))
    with pytest.raises(TypeError, match="the condition is a traced value"):
        sf.jit(lambda x: sf.lax.while_loop(lambda c: c.sum() < 10, lambda c: c * 2, x), mesh=m)(x)
    with pytest.raises(TypeError, match="carry must keep its structure, shapes and dtypes"):
        sf.jit(lambda x: sf.lax.scan(lambda c, y: (c[:1], y), x, x), mesh=m)(x)
    with pytest.raises(TypeError, match="branches must give the same"):
        sf.jit(lambda x, p: sf.lax.cond(p > 0, lambda v: v, lambda v: v[:1], x), mesh=m)(x, 1.0)
    with pytest.raises(ValueError, match="one leading extent"):
        sf.jit(lambda a, b: sf.lax.scan(lambda c, y: (c, None), 0.0, (a, b)), mesh=m)(x, np.ones((3, 2)))


def test_a_stack_is_placed_by_its_layers_only_where_they_agree_and_are_all_it_is_read_as():
    """A review: a row x[0] annotated before x placed x by the row; layers annotated apart placed the
    stack by the first while its gradient came back replicated.  A direct annotation wins; layers that
    disagree (or a stack also read whole) leave it replicated, as its gradient."""
    m = mesh()
    direct = sf.jit(lambda x: (np.tanh(sf.shard(x, axis=0, over="dp")) * 2, sf.shard(x[0], axis=0, over="dp") * 3),
                    mesh=m)
    assert direct.lower(np.ones((64, 8))).input_layouts[0].axes == ("dp", None)
    r = np.random.default_rng()
    w, h = r.standard_normal((2, 8, 8)), r.standard_normal((4, 8))

    def apart(w, h):
        a = h @ sf.shard(w[0], axis=1, over="tp")
        return (np.tanh(a) @ sf.shard(w[1], axis=0, over="tp")).sum()
    grad = sf.jit(sf.grad(apart), mesh=m)
    assert grad.lower(w, h).input_layouts[0].axes == (None, None, None)
    g = grad(w, h)
    assert g.sharding.axes == (None, None, None)
    numeric, analytic = directional(lambda q: float((np.tanh(h @ q[0]) @ q[1]).sum()), w, g, r)
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (numeric, analytic)


def test_a_traced_conds_gradient_comes_from_the_selected_branch_only():
    """JAX's cond computes the branch taken: sqrt's infinite derivative at 0 in the branch not taken
    made the gradient NaN here (0 times it); the operands reach each branch through a select now, so
    the other branch's cotangent is dropped.  switch alike (clamped index)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    x = np.array([0.0, 1.0, 4.0, 0.0])

    def f(x, c):
        return sf.lax.cond(c > 0, lambda v: np.sqrt(v).sum(), lambda v: (v * 3.0).sum(), x)
    np.testing.assert_array_equal(np.asarray(sf.jit(sf.grad(f), mesh=mesh)(x, -1.0)), np.full(4, 3.0))
    np.testing.assert_array_equal(np.asarray(sf.jit(sf.grad(f), mesh=mesh)(x, 1.0)), [np.inf, 0.5, 0.25, np.inf])
    np.testing.assert_allclose(np.asarray(sf.jit(f, mesh=mesh)(x, 1.0)), 3.0)

    def g(x, i):
        return sf.lax.switch(i, [lambda v: np.sqrt(v).sum(), lambda v: (v * 2.0).sum(), lambda v: np.log(v).sum()], x)
    for i, want in ((-3, [np.inf, 0.5, 0.25, np.inf]), (1, [2.0] * 4), (9, [np.inf, 1.0, 0.25, np.inf])):
        np.testing.assert_array_equal(np.asarray(sf.jit(sf.grad(g), mesh=mesh)(x, i)), want)
    np.testing.assert_allclose(np.asarray(sf.jit(g, mesh=mesh)(x, 1)), 10.0)
    with pytest.raises(TypeError, match="the branches must give the same structure"):
        sf.jit(lambda x, i: sf.lax.switch(i, [lambda v: v.sum(), lambda v: v], x), mesh=mesh)(x, 0)


def test_values_the_branches_close_over_get_the_selected_branchs_gradient_only():
    """A JAX port's closures (no operands): the branch not taken gave NaN (sqrt's derivative at 0 times 0)
    where JAX's cond gives 0; each branch is differentiated alone now and its gradients selected, for
    closed-over values and operands alike, switch too, against float64 central differences where smooth."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    zeros = np.zeros(2)
    f = sf.jit(sf.grad(lambda x: sf.lax.cond(x.sum() > 1, lambda: np.sqrt(x).sum(), lambda: x.sum() * 0)), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(f(zeros)), [0.0, 0.0])
    w = np.array([[1.0, -2.0], [0.5, 3.0]])

    def h(x, w):  # (w and x closed over, x an operand too)
        i = (x.sum() > 0).astype(np.int32) + (x.sum() > 5).astype(np.int32)
        return sf.lax.switch(i, [lambda y: (np.tanh(y @ w) ** 2).sum(), lambda y: (x * y * w[0]).sum(),
                                 lambda y: np.sqrt(x).sum() * w.sum()], x)
    grad = sf.jit(sf.grad(h, argnums=(0, 1)), mesh=mesh)
    for xv in (np.array([-1.0, -2.0]), np.array([1.0, 2.0]), np.array([4.0, 9.0]), np.array([0.0, 6.0])):
        gx, gw = (np.asarray(g) for g in grad(xv, w))
        assert np.all(np.isfinite(gx)) or xv[0] == 0.0, (xv, gx)
        for arr, g, k in ((xv, gx, 0), (w, gw, 1)):
            for idx in np.ndindex(arr.shape):
                if xv[0] == 0.0:  # (sqrt at 0 taken: inf, as JAX's)
                    continue
                e = np.zeros_like(arr)
                e[idx] = 1e-6
                args_p = [xv, w]
                args_m = [xv, w]
                args_p[k], args_m[k] = arr + e, arr - e
                fd = (float(sf.jit(h, mesh=mesh)(*args_p)) - float(sf.jit(h, mesh=mesh)(*args_m))) / 2e-6
                assert abs(fd - g[idx]) < 1e-6 * (1 + abs(fd)), (xv, k, idx, fd, g[idx])


def test_a_switch_of_one_branch_with_a_traced_index():
    """A review: one branch and a traced index raised an IndexError (no picks to take the builder from)."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = np.array([1.0, -2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(sf.jit(lambda v, i: sf.lax.switch(i, [lambda a: a * 2], v),
                                                    mesh=mesh)(x, 5)), 2 * x)
    g = sf.jit(sf.grad(lambda v, i: (sf.lax.switch(i, [lambda a: a], v) ** 2).sum()), mesh=mesh)(x, 0)
    np.testing.assert_array_equal(np.asarray(g), 2 * x)


def test_a_numpy_carry_becomes_a_value_and_jaxs_names_for_slices_and_top_k():
    """A serving probe: fori_loop(0, n, lambda i, b: b.at[i].set(t), np.zeros(4)) met a NumPy array's
    missing .at (JAX makes the carry arrays); scan and while_loop likewise.  sf.lax.top_k,
    dynamic_slice, dynamic_update_slice and their _in_dim forms under jax.lax's names."""
    m, r = mesh(), np.random.default_rng()
    t = r.standard_normal()
    filled = sf.jit(lambda t: sf.lax.fori_loop(0, 4, lambda i, b: b.at[i].set(t * (i + 1)), np.zeros(4)), mesh=m)
    np.testing.assert_allclose(np.asarray(filled(t)), t * np.arange(1, 5), rtol=1e-15)
    xs = r.standard_normal((3, 2))
    carry, ys = sf.jit(lambda t, xs: sf.lax.scan(lambda c, x: (c.at[0].add(x[0] * t), c), np.ones(2), xs), mesh=m)(t, xs)
    np.testing.assert_allclose(np.asarray(carry), [1 + t * xs[:, 0].sum(), 1], rtol=1e-14)
    assert np.asarray(ys).shape == (3, 2)
    x, s = r.standard_normal((4, 6)), np.int32(r.integers(1, 4))
    got = sf.jit(lambda x, s: (sf.lax.dynamic_slice_in_dim(x, s, 2, axis=1),
                               sf.lax.dynamic_update_slice_in_dim(x, -x[:, :2], s, axis=-1),
                               sf.lax.dynamic_slice(x, (s, 0), (1, 6)), sf.lax.top_k(x, 3)), mesh=m)(x, s)
    np.testing.assert_array_equal(np.asarray(got[0]), x[:, s:s + 2])
    want = x.copy()
    want[:, s:s + 2] = -x[:, :2]
    np.testing.assert_array_equal(np.asarray(got[1]), want)
    np.testing.assert_array_equal(np.asarray(got[2]), x[s:s + 1])
    np.testing.assert_array_equal(np.asarray(got[3][1]), np.argsort(-x, axis=1, kind="stable")[:, :3])


@pytest.mark.parametrize("taken", [True, False])
def test_a_value_read_twice_by_one_op_of_a_branch_gets_its_gradient_once(taken):
    """A gradient fuzzer: a traced cond whose first branch read its operand twice in one op (v * v) gave
    every gradient of that operand twice, whichever branch was taken; values closed over twice (w * w) too,
    and sf.checkpoint's, which finds the values a function reads the same way."""
    m, r = mesh(), np.random.default_rng()
    x, w = r.standard_normal(4) + 0.1, r.standard_normal(4)
    sign = 1.0 if taken else -1.0

    def loss(x, w):
        p = sign * x.sum() > -1e9 if taken else sign * x.sum() > 1e9
        return sf.lax.cond(p, lambda v: v * v * (w * w), np.sin, x).sum() + \
            sf.lax.switch(np.int32(0 if taken else 1), [lambda v: v + v, lambda v: 3 * v], x).sum()
    gx, gw = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=m)(x, w)
    want_x = (2 * x * w * w + 2) if taken else (np.cos(x) + 3)
    np.testing.assert_allclose(np.asarray(gx), want_x, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(gw), 2 * w * x * x if taken else 0 * w, rtol=1e-12)
    g = sf.jit(sf.grad(lambda w, x: sf.checkpoint(lambda v: v * v * (w * w))(x).sum()), mesh=m)(w, x)
    np.testing.assert_allclose(np.asarray(g), 2 * w * x * x, rtol=1e-12)


def test_a_while_loop_keeps_its_numpy_counter():
    """A review: the carry made a value of the function turned a while_loop's NumPy counter into a traced
    value its condition could not decide."""
    x = np.random.default_rng().standard_normal(4)
    got = sf.jit(lambda t: sf.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (np.array(0), t))[1],
                 mesh=mesh())(x)
    np.testing.assert_allclose(np.asarray(got), 8 * x, rtol=1e-15)


def test_a_stacked_weights_gradient_grows_linearly_with_its_layers():
    """A pipeline probe: the cotangent of each w[k] was padded to w's whole shape with zeros and the L padded
    arrays summed, buffers quadratic in L (17 MB for a 0.5 MB gradient at L = 16); the pieces are joined once
    now. Values by central differences; w read twice at one k (overlapping pieces) still adds."""
    m, r = mesh(), np.random.default_rng()
    persistent = {}
    for layers in (4, 16):
        w, x = r.standard_normal((layers, 8, 8)) * 0.3, r.standard_normal((4, 8))

        def loss(w, x):
            h = sf.lax.scan(lambda h, wi: (np.tanh(h @ wi), None), x, w)[0]
            return (h ** 2).sum() + (w[0] * w[0]).sum()

        def loss_np(w, x=x, layers=layers):
            h = x
            for k in range(layers):
                h = np.tanh(h @ w[k])
            return (h ** 2).sum() + (w[0] ** 2).sum()
        f = sf.jit(sf.grad(loss), mesh=m)
        want, got = directional(loss_np, w, np.asarray(f(w, x)), r)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        persistent[layers] = f.lower(w, x).memory()["persistent"]
    assert persistent[16] < 6 * persistent[4], persistent  # (4x the layers: ~4x the buffers, not ~16x)


def test_a_stacked_weights_dp_gradient_is_one_bucket():
    """A pipeline probe: with the batch over dp, the gradient of a stack read as w[k] took one dp Allreduce per
    slice (6 for 3 layers of w and b); its pieces joined before the reduction, it is one bucket, as the same
    model's with separate weights."""
    m, r = mesh(), np.random.default_rng()

    def f(p, x):
        x = sf.shard(x, axis=0, over="dp")
        for i in range(3):
            x = np.tanh(x @ p["w"][i] + p["b"][i])
        return (x * x).mean()
    p, x = {"w": r.standard_normal((3, 4, 4)), "b": r.standard_normal((3, 4))}, r.standard_normal((8, 4))
    g = sf.jit(sf.grad(f), mesh=m)
    assert g.lower(p, x).collectives() == {"allreduce": 1}

    def f_np(w, b):
        h = x
        for i in range(3):
            h = np.tanh(h @ w[i] + b[i])
        return (h * h).mean()
    got = g(p, x)
    want, have = directional(lambda q: f_np(q["w"], q["b"]), p, {k: np.asarray(v) for k, v in got.items()}, r)
    np.testing.assert_allclose(have, want, rtol=1e-6)
