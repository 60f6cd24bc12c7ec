"""sf.jit(static_argnums=, static_argnames=): Python values as arguments, as JAX's (a probe: "no
static_argnames").  Each set of static values compiles its own plans and the function sees the
values; results against NumPy in float64 on random inputs."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

MESH = sf.DeviceMesh(4, backend="numpy")
RNG = np.random.default_rng(7)
X, W = RNG.standard_normal((8, 6)), RNG.standard_normal((6, 8))


def heads_fn(x, heads, w, act="relu"):
    y = (sf.shard(x, 0) @ w).reshape(x.shape[0], heads, -1)
    return sf.maximum(y, 0.0) if act == "relu" else y * 2.0


def heads_ref(x, heads, w, act="relu"):
    y = (x @ w).reshape(x.shape[0], heads, -1)
    return np.maximum(y, 0.0) if act == "relu" else y * 2.0


def test_static_values_are_python_values_with_plans_of_their_own():
    f = sf.jit(heads_fn, mesh=MESH, static_argnums=1, static_argnames="act")
    for heads, act in ((2, "relu"), (4, "relu"), (4, "linear"), (2, "relu")):
        np.testing.assert_allclose(f(X, heads, W, act=act).gather(), heads_ref(X, heads, W, act), rtol=1e-12)
    info = f.cache_info()
    assert info["static_values"] == 3 and info["plans"] == 3, info
    assert len(f.cached_plans()) == 3


def test_keywords_defaults_and_negative_argnums():
    f = sf.jit(heads_fn, mesh=MESH, static_argnums=(-3,), static_argnames=("act",))  # (-3: heads)
    np.testing.assert_allclose(f(X, heads=2, w=W).gather(), heads_ref(X, 2, W), rtol=1e-12)
    np.testing.assert_allclose(f(x=X, w=W, heads=4, act="linear").gather(), heads_ref(X, 4, W, "linear"), rtol=1e-12)


def test_lower_takes_the_static_values_where_the_function_does():
    f = sf.jit(heads_fn, mesh=MESH, static_argnums=1)
    text = str(f.lower(X, 2, W))
    assert text.startswith("plan heads_fn(x: f64[8:DIDx, 6], w: f64[6, 8])") and "2, 4]" in text, text


def test_refusals_name_what_came():
    with pytest.raises(TypeError, match="static argument heads must be hashable.*list"):
        sf.jit(heads_fn, mesh=MESH, static_argnums=1)(X, [2], W)
    with pytest.raises(ValueError, match="static_argnums=.*names no positional parameter"):
        sf.jit(heads_fn, mesh=MESH, static_argnums=7)
    with pytest.raises(ValueError, match="has no parameter 'nope'"):
        sf.jit(heads_fn, mesh=MESH, static_argnames="nope")
    with pytest.raises(ValueError, match="donate_argnums names argument 1 .heads., which is static"):
        sf.jit(heads_fn, mesh=MESH, static_argnums=1, donate_argnums=1)(X, 2, W)


def test_donation_counts_the_array_arguments_only():
    def step(lr, w, g):
        return w - lr * g

    f = sf.jit(step, mesh=MESH, static_argnums=0, donate_argnums=1)
    w, g = RNG.standard_normal((4, 4)), RNG.standard_normal((4, 4))
    ws = sf.replicate(w, mesh=MESH)
    out = f(0.5, ws, g)
    np.testing.assert_allclose(out.gather(), w - 0.5 * g, rtol=1e-12)
    with pytest.raises(Exception, match="donated"):
        ws.gather()  # (its buffer went to the result)


def test_pytrees_and_inlining_with_static_values():
    def layer(p, scale):
        return sf.shard(p["x"], 0) @ p["w"] * scale

    f = sf.jit(layer, mesh=MESH, static_argnums=1)
    np.testing.assert_allclose(f({"x": X, "w": W}, 3.0).gather(), X @ W * 3.0, rtol=1e-12)
    outer = sf.jit(lambda x, w: f({"x": x, "w": w}, 2.0) + 1.0, mesh=MESH)  # (inlined: 2.0 a Python value)
    np.testing.assert_allclose(outer(X, W).gather(), X @ W * 2.0 + 1.0, rtol=1e-12)
