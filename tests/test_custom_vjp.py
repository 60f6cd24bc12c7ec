"""sf.custom_vjp (jax.custom_vjp's API): the hand-written backward is the one used, inside and
outside jit, on sharded inputs, with pytrees; the forward alone runs the plain function; bad rules
are refused with what was expected; sf.nn.softmax / log_softmax keep only their output."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import shardfuse as sf
from test_nn import mesh_of  # (the 1-D tp mesh and the 2x2 dp x tp mesh, NumPy devices)


def _scaled_tanh_rule():
    """tanh whose backward is 3x the true one, so a test tells the rule from differentiation."""
    calls = {"fun": 0, "fwd": 0}

    @sf.custom_vjp
    def f(x):
        calls["fun"] += 1
        return np.tanh(x)

    def fwd(x):
        calls["fwd"] += 1
        y = np.tanh(x)
        return y, y

    f.defvjp(fwd, lambda y, g: (3.0 * g * (1.0 - y * y),))
    return f, calls


@pytest.mark.parametrize("kind, axes", [("1d", (None, None)), ("1d", ("tp", None)), ("2d", ("dp", "tp"))])
def test_the_rule_is_what_grad_uses(kind, axes):
    mesh = mesh_of(kind)
    rng = np.random.default_rng(1)
    xs, r = rng.standard_normal((8, 12)), rng.standard_normal((8, 12))
    f, calls = _scaled_tanh_rule()
    x = sf.distribute(xs, mesh, axes)
    g = sf.jit(sf.grad(lambda x: (f(x) * r).sum()), mesh=mesh)(x)
    np.testing.assert_allclose(np.asarray(g), 3.0 * r * (1 - np.tanh(xs) ** 2), rtol=1e-13)
    assert g.sharding == x.sharding
    assert calls["fwd"] >= 1


def test_forward_alone_runs_the_function_not_fwd():
    mesh = mesh_of("1d")
    f, calls = _scaled_tanh_rule()
    xs = np.random.default_rng(2).standard_normal((8, 4))
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x: f(x) * 2.0, mesh=mesh)(xs)), 2 * np.tanh(xs), rtol=1e-15)
    assert calls == {"fun": 1, "fwd": 0}


def test_outside_jit_on_sf_arrays_and_value_and_grad():
    mesh = mesh_of("1d")
    f, _ = _scaled_tanh_rule()
    xs = np.random.default_rng(3).standard_normal((8, 4))
    x = sf.shard(xs, axis=0, mesh=mesh)
    value, g = sf.value_and_grad(lambda x: f(x).sum())(x)
    np.testing.assert_allclose(float(value), np.tanh(xs).sum(), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(g), 3.0 * (1 - np.tanh(xs) ** 2), rtol=1e-13)


def test_pytrees_none_cotangents_and_an_unused_output():
    """Two arguments (a dict of two arrays, and an int array whose cotangent is None), two outputs
    of which the loss reads one: the other's cotangent arrives as zeros."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng(4)
    p = {"a": rng.standard_normal((4, 6)), "b": rng.standard_normal((6,))}
    ids = rng.integers(0, 4, (4,)).astype(np.int32)
    seen = {}

    @sf.custom_vjp
    def f(p, ids):
        return (p["a"] * p["b"], p["a"].sum(-1))

    def bwd(res, cts):
        a, b = res
        ga, gs = cts
        seen["zeros"] = gs  # the unused output's cotangent
        return ({"a": ga * b + gs.reshape(4, 1), "b": (ga * a).sum(0)}, None)
    f.defvjp(lambda p, ids: (f.fun(p, ids), (p["a"], p["b"])), bwd)

    g = sf.jit(sf.grad(lambda p, ids: f(p, ids)[0].sum()), mesh=mesh)(p, ids)
    np.testing.assert_allclose(np.asarray(g["a"]), np.broadcast_to(p["b"], (4, 6)), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(g["b"]), p["a"].sum(0), rtol=1e-14)
    assert tuple(seen["zeros"].shape) == (4,)


@pytest.mark.parametrize("bwd, match", [
    (lambda y, g: g, "must return a tuple of 1 cotangent"),
    (lambda y, g: (g, g), "must return a tuple of 1 cotangent"),
    (lambda y, g: (g.sum(-1),), "cotangent of shape \\(8,\\) for an argument of shape \\(8, 4\\)"),
    (lambda y, g: (1.0,), "must return arrays"),
])
def test_bad_rules_are_refused(bwd, match):
    mesh = mesh_of("1d")

    @sf.custom_vjp
    def f(x):
        return np.tanh(x)
    f.defvjp(lambda x: (np.tanh(x), None), bwd)
    with pytest.raises((TypeError, ValueError), match=match):
        sf.jit(sf.grad(lambda x: f(x).sum()), mesh=mesh).lower(sf.TensorSpec((8, 4), "float64"))


def test_no_rule_and_a_bad_fwd_are_refused():
    mesh = mesh_of("1d")
    spec = sf.TensorSpec((8, 4), "float64")

    @sf.custom_vjp
    def f(x):
        return np.tanh(x)
    with pytest.raises(TypeError, match="has no rule: call f.defvjp"):
        sf.jit(sf.grad(lambda x: f(x).sum()), mesh=mesh).lower(spec)
    f.defvjp(lambda x: np.tanh(x), lambda y, g: (g,))
    with pytest.raises(TypeError, match="must return a pair \\(output, residuals\\)"):
        sf.jit(sf.grad(lambda x: f(x).sum()), mesh=mesh).lower(spec)
    with pytest.raises(TypeError, match="takes two functions"):
        f.defvjp(None, None)


@pytest.mark.parametrize("fn", [sf.nn.softmax, sf.nn.log_softmax])
def test_softmax_backward_holds_only_its_output(fn):
    """The exponentials die in the forward: the backward reads only softmax's output (the rule),
    and the gradient is right against float64 central differences."""
    mesh = mesh_of("1d")
    rng = np.random.default_rng(5)
    xs, r = rng.standard_normal((6, 10)), rng.standard_normal((6, 10))
    loss = sf.jit(sf.grad(lambda x: (fn(x) * r).sum()), mesh=mesh)
    g = np.asarray(loss(xs))

    def value(x):
        s = x - x.max(-1, keepdims=True)
        ls = s - np.log(np.exp(s).sum(-1, keepdims=True))
        return ((np.exp(ls) if fn is sf.nn.softmax else ls) * r).sum()
    eps, want = 1e-6, np.zeros_like(xs)
    for idx in np.ndindex(xs.shape):
        d = np.zeros_like(xs)
        d[idx] = eps
        want[idx] = (value(xs + d) - value(xs - d)) / (2 * eps)
    np.testing.assert_allclose(g, want, rtol=1e-7, atol=1e-9)
    text = str(loss.lower(xs))
    backward = text[text.index("Full_like"):]  # (the loss's seed cotangent: the backward starts there)
    assert "Reduce_max" not in backward and " e," not in backward and " e " not in backward, text


def test_outputs_are_values_of_the_call_own():
    """An output that is the argument itself (JAX's clip_gradient pattern), one value returned
    twice, a nested rule and a re-annotated output: each output's cotangent goes through this
    call's bwd, and only its own."""
    mesh = mesh_of("1d")
    rng = np.random.default_rng(6)
    xs, r = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    dt = 1 - np.tanh(xs) ** 2

    @sf.custom_vjp
    def half_grad(x):
        return x
    half_grad.defvjp(lambda x: (x, None), lambda res, g: (0.5 * g,))
    g = sf.jit(sf.grad(lambda x: (half_grad(np.tanh(x)) * r).sum() + np.tanh(x).sum()), mesh=mesh)(xs)
    np.testing.assert_allclose(np.asarray(g), (0.5 * r + 1) * dt, rtol=1e-13)

    @sf.custom_vjp
    def two(x):
        y = np.tanh(x)
        return y, y
    two.defvjp(lambda x: (two.fun(x), np.tanh(x)), lambda y, g: (2.0 * g[0] + 3.0 * g[1],))
    g = sf.jit(sf.grad(lambda x: (two(x)[0] * r).sum() + two(x)[1].sum()), mesh=mesh)(xs)
    np.testing.assert_allclose(np.asarray(g), 2.0 * r + 3.0, rtol=1e-13)

    def scaled_tanh(k, inner=np.tanh, annotate=lambda y: y):
        @sf.custom_vjp
        def f(x):
            return annotate(inner(x))
        f.defvjp(lambda x: (lambda y: (y, y))(annotate(inner(x))), lambda y, g: (k * g * (1 - y * y),))
        return f
    outer = scaled_tanh(7.0, inner=scaled_tanh(5.0))  # (the outer's rule, not the inner's)
    sharded = scaled_tanh(3.0, annotate=lambda y: sf.shard(y, axis=0, over="tp"))
    for f, k, again in ((outer, 7.0, lambda y: y), (sharded, 3.0, lambda y: sf.shard(y, axis=1, over="tp"))):
        g = sf.jit(sf.grad(lambda x: (again(f(x)) * r).sum()), mesh=mesh)(xs)
        np.testing.assert_allclose(np.asarray(g), k * r * dt, rtol=1e-12)


# ---- nondiff_argnums (JAX's): static arguments that fwd takes in place and bwd takes first ----------

def _central(value, xs: list, eps=1e-6) -> list:
    """float64 central differences of value(*xs) (a float) with respect to each array in xs."""
    out = []
    for k, x in enumerate(xs):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            hi, lo = [a.copy() for a in xs], [a.copy() for a in xs]
            hi[k][idx] += eps
            lo[k][idx] -= eps
            g[idx] = (value(*hi) - value(*lo)) / (2 * eps)
        out.append(g)
    return out


DERIVATIVE = {np.tanh: lambda x: 1 - np.tanh(x) ** 2, np.exp: np.exp}  # (what bwd knows of the callable)


def _act_matmul(seen):
    """act(x @ w) * scale with act (a callable) and scale (a float) nondiff, at positions 0 and 2:
    bwd takes them first and returns cotangents for x and w only."""
    @functools.partial(sf.custom_vjp, nondiff_argnums=(2, 0))  # (any order, as JAX's: sorted)
    def f(act, x, scale, w):
        return act(x @ w) * scale

    def fwd(act, x, scale, w):
        z = x @ w
        return act(z) * scale, (x, w, z)

    def bwd(act, scale, res, g):
        seen.append((act, scale))
        x, w, z = res
        gz = g * scale * DERIVATIVE[act](z)
        return gz @ w.T, x.T @ gz
    f.defvjp(fwd, bwd)
    return f


@pytest.mark.parametrize("act, scale", [(np.tanh, 0.5), (np.exp, -3.0)])
@pytest.mark.parametrize("where", ["jit", "outside jit"])
def test_nondiff_callable_and_scale_gradients_against_central_differences(act, scale, where):
    mesh = mesh_of("1d")
    rng = np.random.default_rng([7, int(scale * 10) % 97, where == "jit"])
    xs, ws, r = 0.5 * rng.standard_normal((8, 6)), rng.standard_normal((6, 4)), rng.standard_normal((8, 4))
    seen = []
    f = _act_matmul(seen)
    loss = sf.grad(lambda x, w: (f(act, x, scale, w) * r).sum(), argnums=(0, 1))
    if where == "jit":
        gx, gw = sf.jit(loss, mesh=mesh)(xs, ws)
    else:
        gx, gw = loss(sf.shard(xs, axis=0, mesh=mesh), sf.replicate(ws, mesh=mesh))
    want = _central(lambda x, w: float((act(x @ w) * scale * r).sum()), [xs, ws])
    np.testing.assert_allclose(np.asarray(gx), want[0], rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(np.asarray(gw), want[1], rtol=1e-7, atol=1e-8)
    assert seen and all(s == (act, scale) for s in seen)  # (bwd got the Python values themselves)
    np.testing.assert_allclose(np.asarray(sf.jit(lambda x, w: f(act, x, scale, w), mesh=mesh)(xs, ws)),
                               act(xs @ ws) * scale, rtol=1e-13)  # (the forward alone: the function)


def test_nondiff_numpy_array_gets_no_cotangent_and_a_traced_one_is_refused():
    """A NumPy constant in a nondiff position is a static value (JAX accepts a concrete array
    there and gives it no cotangent); a traced array is refused, as JAX refuses a Tracer."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng(8)
    xs, mask = rng.standard_normal((4, 6)), (rng.random((4, 6)) > 0.3).astype(np.float64)

    @functools.partial(sf.custom_vjp, nondiff_argnums=(0,))
    def masked_exp(m, x):
        return np.exp(x) * m
    masked_exp.defvjp(lambda m, x: (lambda y: (y, y))(np.exp(x) * m), lambda m, y, g: (g * y,))

    g = sf.jit(sf.grad(lambda x: np.tanh(masked_exp(mask, x)).sum()), mesh=mesh)(sf.distribute(xs, mesh, ("dp", "tp")))
    want, = _central(lambda x: float(np.tanh(np.exp(x) * mask).sum()), [xs])
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-7, atol=1e-8)
    for fn in (sf.grad(lambda x, m: masked_exp(m, x).sum()), lambda x, m: masked_exp(m, x)):
        with pytest.raises(TypeError, match="argument 0 is in nondiff_argnums but holds a traced array.*"
                                            "as an ordinary argument and have bwd return None"):
            sf.jit(fn, mesh=mesh).lower(sf.TensorSpec((4, 6), "float64"), sf.TensorSpec((4, 6), "float64"))


def test_nondiff_in_the_middle_with_pytrees():
    """Pytrees on both sides of a nondiff config dict: fwd sees the arguments in place, bwd the
    config first and returns a tuple of two cotangent trees (the params dict, the pair)."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng(9)
    p = {"w": rng.standard_normal((6, 5)), "b": rng.standard_normal((5,))}
    pair = (rng.standard_normal((4, 6)), rng.standard_normal((4, 5)))
    cfg = {"power": 3, "name": "cube"}

    @functools.partial(sf.custom_vjp, nondiff_argnums=(1,))
    def f(p, cfg, pair):
        return (pair[0] @ p["w"] + p["b"]) ** cfg["power"] * pair[1]

    def fwd(p, cfg, pair):
        z = pair[0] @ p["w"] + p["b"]
        return z ** cfg["power"] * pair[1], (p["w"], pair, z)

    def bwd(cfg, res, g):
        assert cfg == {"power": 3, "name": "cube"}
        w, (x, s), z = res
        gz = g * s * cfg["power"] * z ** (cfg["power"] - 1)
        return {"w": x.T @ gz, "b": gz.sum(0)}, (gz @ w.T, g * z ** cfg["power"])
    f.defvjp(fwd, bwd)

    g_p, g_pair = sf.jit(sf.grad(lambda p, pair: f(p, cfg, pair).sum(), argnums=(0, 1)), mesh=mesh)(p, pair)

    def value(w, b, x, s):
        return float(((x @ w + b) ** 3 * s).sum())
    want = _central(value, [p["w"], p["b"], *pair])
    got = [g_p["w"], g_p["b"], *g_pair]
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


def test_bad_nondiff_argnums_are_refused():
    def f(a, b):
        return a * b
    for bad, match in [(("0",), "positions are non-negative ints.*'0'"), ((True,), "non-negative ints.*True"),
                       ((1.0,), "non-negative ints.*1.0"), ((-1,), "non-negative ints.*-1"),
                       (None, "takes a tuple of argument positions, got NoneType")]:
        with pytest.raises(TypeError, match=match):
            sf.custom_vjp(f, nondiff_argnums=bad)
    with pytest.raises(ValueError, match=r"nondiff_argnums=\(0, 2\)\): f has 2 positional parameter\(s\), so "
                                         r"positions run 0..1"):
        functools.partial(sf.custom_vjp, nondiff_argnums=(0, 2))(f)
    assert sf.custom_vjp(f, nondiff_argnums=1).nondiff_argnums == (1,)
    assert sf.custom_vjp(f, nondiff_argnums=[1, 0, 1]).nondiff_argnums == (0, 1)

    def variadic(*xs):  # (how many arguments: known at the call only)
        return xs[0]
    v = sf.custom_vjp(variadic, nondiff_argnums=(3,))
    with pytest.raises(TypeError, match=r"nondiff_argnums=\(3,\) but was called with 2 positional"):
        v(np.ones(2), 2.0)


def test_nondiff_bwd_returning_a_cotangent_for_a_nondiff_argument_is_refused():
    mesh = mesh_of("1d")

    @functools.partial(sf.custom_vjp, nondiff_argnums=(1,))
    def f(x, k):
        return x * k
    f.defvjp(lambda x, k: (x * k, None), lambda k, res, g: (g * k, None))  # (one too many)
    with pytest.raises(TypeError, match=r"tuple of 1 cotangent\(s\), one per differentiable argument \(none for "
                                        r"nondiff_argnums\), got tuple of 2"):
        sf.jit(sf.grad(lambda x: f(x, 2.0).sum()), mesh=mesh).lower(sf.TensorSpec((8, 4), "float64"))


def test_a_rule_closing_over_a_value_being_differentiated_is_refused():
    """Its rule gives cotangents for its arguments only: a closed-over weight's gradient would be lost, silently
    (JAX refuses it too).  A closed-over NumPy constant, or a value no gradient reaches, is fine."""
    mesh = mesh_of("1d")

    def make(w):
        @sf.custom_vjp
        def scale(x):
            return x * w
        scale.defvjp(lambda x: (x * w, None), lambda _, g: (g * w,))
        return scale
    x = np.random.default_rng(41).standard_normal(4)
    with pytest.raises(TypeError, match="closes over .*a value being differentiated.*pass the value as an argument"):
        sf.jit(sf.grad(lambda w, x: make(w)(x).sum()), mesh=mesh)(np.full(4, 2.0), x)
    g = sf.jit(sf.grad(lambda x: make(np.full(4, 2.0))(x).sum()), mesh=mesh)(x)  # (a constant: fine)
    np.testing.assert_array_equal(np.asarray(g), np.full(4, 2.0))
    g = sf.jit(sf.grad(lambda x, w: make(w)(x).sum()), mesh=mesh)(x, np.full(4, 3.0))  # (w not differentiated)
    np.testing.assert_array_equal(np.asarray(g), np.full(4, 3.0))


def test_closing_over_values_no_gradient_reaches_is_fine():
    """A review: a stop_gradient view or a comparison's mask closed over was refused as 'being differentiated'
    (JAX's are not tracers of the gradient either)."""
    mesh = mesh_of("1d")
    x = np.random.default_rng(42).standard_normal(4)

    def held(v, w):
        ws = sf.lax.stop_gradient(w)
        g = sf.custom_vjp(lambda a: a * ws)
        g.defvjp(lambda a: (a * ws, None), lambda _, ct: (ct * ws,))
        return g(v).sum()
    gx, gw = sf.jit(sf.grad(held, argnums=(0, 1)), mesh=mesh)(x, x + 1.0)
    np.testing.assert_array_equal(np.asarray(gx), x + 1.0)
    np.testing.assert_array_equal(np.asarray(gw), np.zeros(4))

    def masked(v):
        mask = (v > 0).astype(np.float64)
        g = sf.custom_vjp(lambda a: a * mask)
        g.defvjp(lambda a: (a * mask, None), lambda _, ct: (ct * mask,))
        return g(v).sum()
    np.testing.assert_array_equal(np.asarray(sf.jit(sf.grad(masked), mesh=mesh)(x)), (x > 0).astype(float))
