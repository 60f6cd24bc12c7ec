"""fuse_elementwise (issue 31 item 9): chains of elementwise steps as one step.  The plan prints
each fused step with its expression; results equal the unfused plan's (SHARDFUSE_FUSE=0) bit for
bit on NumPy devices (which evaluate a fused step op by op, each result in its own dtype) in every
float dtype; an intermediate read twice, viewed, or returned is never fused away.
tests/test_gpu_grad.py checks the CuPy kernels against the same."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype

MESH = sf.DeviceMesh((4,), ("tp",), backend="numpy")


def softmax_chain(x, mask):
    s = sf.where(mask, x * 0.125, -3.0e4)
    return sf.nn.softmax(s.astype("float32")).astype(x.dtype)


def gelu_norm_chain(x, b):
    y = sf.gelu(x + b) * 2.0 - 1.0
    return sf.rsqrt(y * y + 1.0) * np.maximum(y, 0.5) / (abs(x) + 1.0)


CASES = {
    "softmax": (softmax_chain, lambda r, dt: (r.standard_normal((8, 16)).astype(np_dtype(dt)),
                                              np.tril(np.ones((8, 16), bool)))),
    "gelu and norm arithmetic": (gelu_norm_chain, lambda r, dt: (r.standard_normal((8, 16)).astype(np_dtype(dt)),
                                                                 r.standard_normal(16).astype(np_dtype(dt)))),
}


def _both(fn, args, monkeypatch):
    fused = sf.jit(fn, mesh=MESH)
    got, plan = fused(*args), fused.lower(*args)
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    unfused = sf.jit(fn, mesh=MESH)
    return got, plan, unfused(*args), unfused.lower(*args)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_fused_equals_unfused_bit_for_bit(name, dtype, monkeypatch):
    fn, make = CASES[name]
    args = make(np.random.default_rng(0), dtype)
    got, plan, want, plain = _both(fn, args, monkeypatch)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    steps = lambda p: sum(1 for i in p.program.instrs if i.into is not None)  # noqa: E731
    fused = "Fused " in str(plan) or "FusedRows " in str(plan)  # (a softmax: one row group, passes/fuse_rows.py)
    assert fused and steps(plan) < steps(plain), (steps(plan), steps(plain))


def test_the_softmax_chain_prints_its_expressions(monkeypatch):
    x, mask = CASES["softmax"][1](np.random.default_rng(1), "float32")
    text = str(sf.jit(softmax_chain, mesh=MESH).lower(x, mask))
    # (the whole softmax is one row group now, passes/fuse_rows.py: the chains are inside its expression)
    assert "expr=div(exp(sub(add(where_then(#0, scale(#1, 0.125)), fill_else(#0, -30000.0)), reduce_max(" in text, text


def test_shared_viewed_and_returned_intermediates_stay():
    def f(x):
        a = x * 2.0  # read twice: kept
        b = a + 1.0  # returned: kept
        c = (a * a).T  # viewed by the transpose: kept
        return b, c * 3.0 + 1.0
    x = np.random.default_rng(2).standard_normal((4, 8))
    jf = sf.jit(f, mesh=MESH)
    plan = jf.lower(x)
    written = {i.into.name for i in plan.program.instrs if i.into is not None}
    assert {"m", "a"} <= written, str(plan)  # x * 2.0 and its + 1.0 are buffers of their own
    b, c = jf(x)
    np.testing.assert_array_equal(np.asarray(b), x * 2.0 + 1.0)
    np.testing.assert_allclose(np.asarray(c), ((x * 2.0) ** 2).T * 3.0 + 1.0, rtol=1e-15)


def test_a_float16_value_is_fused_only_into_a_kernel_that_stores_float16():
    """(an H200 run: CuPy defines float16 in a kernel only where a parameter is float16) in
    float64 -> float16 -> * 2 -> float64 the float16 product is stored, and the cast back is a step
    of its own; every fused expression holding a float16 node writes float16."""
    def nodes(e):
        yield e
        for a in e.args:
            yield from nodes(a)

    x = np.random.default_rng(3).standard_normal((4, 8))
    trip = sf.jit(lambda v: (v.astype("float16") * 2.0).astype("float64"), mesh=MESH)
    steps = [i for i in trip.lower(x).program.instrs if i.into is not None]
    assert [(str(i.op), i.into.type.dtype) for i in steps] == [("fused", "float16"), ("astype", "float64")], steps
    for i in steps:
        if str(i.op) == "fused":
            assert i.into.type.dtype == "float16" or all(n.dtype != "float16" for n in nodes(i.attrs["expr"]))
    np.testing.assert_array_equal(np.asarray(trip(x)), (x.astype(np.float16) * np.float16(2.0)).astype(np.float64))


def test_a_value_read_beside_a_twice_taken_cast_stays_written(monkeypatch):
    """A float16 product cast to float32 for two readers: the first reader takes the cast in and
    so reads the product; the second's float16 result must not take the product in and drop it
    (it did: the plan read an unwritten m, "m is used by fused before it is defined")."""
    def f(a, b, d):
        w = (a * b).astype("float32")
        return w * d, ((w - 1.0) * 2.0).astype("float16")
    r = np.random.default_rng(4)
    a, b = (r.standard_normal((4, 8)).astype(np.float16) for _ in range(2))
    d = r.standard_normal((4, 8)).astype(np.float32)
    one = sf.DeviceMesh(1, backend="numpy")
    plan = sf.jit(f, mesh=one).lower(a, b, d)
    assert "  Mul m <- a, b\n" in str(plan), plan  # (the product: written once, read by both)
    got = sf.jit(f, mesh=one)(a, b, d)
    monkeypatch.setenv("SHARDFUSE_FUSE", "0")
    for g, w in zip(got, sf.jit(f, mesh=one)(a, b, d)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_a_chain_read_twice_joins_and_the_tree_stays_bounded(monkeypatch):
    """t * t takes t's chain in at both reads (the GELU backward's tanh(u) * tanh(u)); t = t * t
    repeated would double the expression per step, so a join stops at MAX_NODES nodes (a review's
    case: sixteen squarings took 17 s to compile and printed 917k characters)."""
    from shardfuse.ops import Op
    from shardfuse.passes.fuse import MAX_NODES, expr_nodes

    def squarings(t):
        for _ in range(16):
            t = t * t
        return t

    def tanh_squared(u):
        t = np.tanh(u * 0.5)
        return (1.0 - t * t) * u
    x = np.full((4, 8), 1.0001)
    for fn, steps in ((squarings, None), (tanh_squared, 1)):
        got, plan, want, _ = _both(fn, (x,), monkeypatch)
        np.testing.assert_array_equal(got.gather(), want.gather())
        fused = [i for i in plan.program.walk() if i.op == Op.FUSED]
        assert all(expr_nodes(i.attrs["expr"], {}) <= MAX_NODES for i in fused), plan
        if steps is not None:
            assert len([i for i in plan.program.walk() if i.op in (Op.FUSED, Op.TANH)]) == steps, plan


def test_signed_zero_scalars_are_different_nodes():
    """x * -0.0 and x * 0.0 are two nodes (1 / (x * -0.0) is -inf): Exprs compare floats by their bits."""
    f = sf.jit(lambda x: 1.0 / (x * -0.0) + 1.0 / (x * 0.0), mesh=MESH)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(f(np.array([1.0, 2.0, -3.0, 4.0])).gather(), np.full(4, np.nan))
        g = sf.jit(lambda x: 1.0 / (x * -0.0) - 1.0 / (x * 0.0), mesh=MESH)
        np.testing.assert_array_equal(g(np.array([1.0, 2.0, -3.0, 4.0])).gather(), [-np.inf, -np.inf, np.inf, -np.inf])
