"""& | ^ ~, np.logical_and / or / xor / not, np.bitwise_and / or / xor / invert and x.any / x.all
(np.any / np.all) inside sf.jit and on sf.Arrays outside it (a new user's probe: `mask & np.tril(...)`,
which sf.nn.attention's own error asks for, raised "unsupported operand type(s) for &"), on a 1-D
mesh of 4 and a 2x2 mesh, sharded and not, against NumPy on fresh random inputs (never zeros), with
NumPy's result dtypes; booleans and integers carry no gradient, and a mask built with them gates the
gradient of the values it selects (checked against central differences).

The case bodies (CASES, check) are shared: tests/mpi/test_logical_mpi.py runs them under mpiexec and
tests/test_gpu_numpy_port.py on GPUs.
"""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
import test_elementwise_ops as ew
from shardfuse.traced import NUMPY


def nonzero(rng, shape):
    return rng.uniform(0.25, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


def ints32(rng, shape):
    return (rng.integers(1, 1 << 20, shape) * rng.choice([-1, 1], shape)).astype(np.int32)


def ints64(rng, shape):
    return (rng.integers(1, 1 << 40, shape) * rng.choice([-1, 1], shape)).astype(np.int64)


TRIL = np.tril(np.ones(ew.SHAPE, bool))  # (a NumPy constant beside a traced mask: as attention's causal mask)

# name -> (fn(x, y) on traced values or sf.Arrays, its NumPy reference, input generator)
CASES = {
    "mask & mask": (lambda x, y: (x > 0) & (y < 0.5), lambda x, y: (x > 0) & (y < 0.5), nonzero),
    "mask | mask": (lambda x, y: (x > 0) | (y < 0.5), lambda x, y: (x > 0) | (y < 0.5), nonzero),
    "mask ^ mask": (lambda x, y: (x > 0) ^ (y < 0.5), lambda x, y: (x > 0) ^ (y < 0.5), nonzero),
    "~mask": (lambda x, y: ~(x > 0), lambda x, y: ~(x > 0), nonzero),
    "mask & np.tril": (lambda x, y: (x > 0) & TRIL, lambda x, y: (x > 0) & TRIL, nonzero),
    "np.tril | mask": (lambda x, y: np.logical_or(TRIL, x > 0), lambda x, y: np.logical_or(TRIL, x > 0), nonzero),
    "mask & True": (lambda x, y: (x > 0) & True, lambda x, y: (x > 0) & True, nonzero),
    "False | mask": (lambda x, y: False | (x > 0), lambda x, y: False | (x > 0), nonzero),
    "True ^ mask": (lambda x, y: True ^ (x > 0), lambda x, y: True ^ (x > 0), nonzero),
    "np.logical_and": (lambda x, y: np.logical_and(x > 0, y > 0), lambda x, y: np.logical_and(x > 0, y > 0), nonzero),
    "np.logical_or of floats": (lambda x, y: np.logical_or(x - x, y), lambda x, y: np.logical_or(x - x, y), nonzero),
    "np.logical_xor": (lambda x, y: np.logical_xor(x > 0, y > 0), lambda x, y: np.logical_xor(x > 0, y > 0), nonzero),
    "np.logical_not of floats": (lambda x, y: np.logical_not(x), lambda x, y: np.logical_not(x), nonzero),
    "sf.logical_and": (lambda x, y: sf.logical_and(x > 0, y), lambda x, y: np.logical_and(x > 0, y), nonzero),
    "np.bitwise_and of masks": (lambda x, y: np.bitwise_and(x > 0, y > 0), lambda x, y: np.bitwise_and(x > 0, y > 0),
                                nonzero),
    "np.invert of a mask": (lambda x, y: np.invert(x > 0), lambda x, y: np.invert(x > 0), nonzero),
    "where(mask & mask)": (lambda x, y: np.where((x > 0) & (y > 0), x, y), lambda x, y: np.where((x > 0) & (y > 0), x, y),
                           nonzero),
    "int32 & int32": (lambda x, y: x & y, lambda x, y: x & y, ints32),
    "int32 | int32": (lambda x, y: x | y, lambda x, y: x | y, ints32),
    "int32 ^ 0x5a5a": (lambda x, y: x ^ 0x5A5A, lambda x, y: x ^ 0x5A5A, ints32),
    "~int32": (lambda x, y: ~x, lambda x, y: ~x, ints32),
    "int64 & int64": (lambda x, y: np.bitwise_and(x, y), lambda x, y: np.bitwise_and(x, y), ints64),
    "~int64": (lambda x, y: np.invert(x), lambda x, y: np.invert(x), ints64),
    "int32 & int64": (lambda x, y: x & y.astype("int64") * 3, lambda x, y: x & y.astype("int64") * 3, ints32),
    "mask & int32": (lambda x, y: (x > 0) & y, lambda x, y: (x > 0) & y, ints32),
    "mask & 1 (int64)": (lambda x, y: (x > 0) & 1, lambda x, y: (x > 0) & 1, nonzero),
    "x.any()": (lambda x, y: (x > 1.9).any(), lambda x, y: (x > 1.9).any(), nonzero),
    "x.all()": (lambda x, y: (x > -1.9).all(), lambda x, y: (x > -1.9).all(), nonzero),
    "x.any(0)": (lambda x, y: (x > 1.5).any(0), lambda x, y: (x > 1.5).any(0), nonzero),
    "x.any(1) keepdims": (lambda x, y: (x > 1.5).any(1, keepdims=True), lambda x, y: (x > 1.5).any(1, keepdims=True),
                          nonzero),
    "np.all(-1)": (lambda x, y: np.all(x > -1.5, axis=-1), lambda x, y: np.all(x > -1.5, axis=-1), nonzero),
    "np.all((0, 1))": (lambda x, y: np.all(x > -1.5, axis=(0, 1)), lambda x, y: np.all(x > -1.5, axis=(0, 1)), nonzero),
    "np.any of floats": (lambda x, y: np.any(x - x, axis=0), lambda x, y: np.any(x - x, axis=0), nonzero),
    "x.all of ints": (lambda x, y: x.all(1), lambda x, y: x.all(1), ints32),
}
LAYOUTS = ["1d R", "1d S0", "1d S1", "2d S0 S1", "2d S(0,1)"]


def check(name, mesh, layout, jit, rng):
    """CASES[name] on x, y placed with ew.LAYOUTS[layout], in sf.jit or outside: values (exact) and
    dtype as NumPy's."""
    fn, ref, gen = CASES[name]
    _, lx, ly = ew.LAYOUTS[layout]
    x, y = gen(rng, ew.SHAPE), gen(rng, ew.SHAPE)
    xa, ya = ew.place(x, mesh, lx), ew.place(y, mesh, ly)
    got = sf.jit(fn, mesh=mesh)(xa, ya) if jit else fn(xa, ya)
    want = np.asarray(ref(x, y))
    assert isinstance(got, sf.Array), (name, type(got))
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    np.testing.assert_array_equal(got.gather(), want, err_msg=name)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, layout, jit):
    check(name, ew.mesh_of(ew.LAYOUTS[layout][0]), layout, jit, np.random.default_rng(11))


def test_every_numpy_logical_and_bitwise_ufunc_has_a_table_entry():
    for f in (np.logical_and, np.logical_or, np.logical_xor, np.logical_not, np.bitwise_and, np.bitwise_or,
              np.bitwise_xor, np.invert, np.bitwise_not, np.any, np.all):
        assert f in NUMPY, f


def _collectives(fn, spec, mesh=None, dtype="float64"):
    mesh = mesh or ew.mesh_of(4)
    return sf.jit(fn, mesh=mesh).lower(sf.TensorSpec(ew.SHAPE, dtype, sf.Layout(spec))).collectives()


def test_masks_combine_where_they_lie_and_any_all_reduce_with_max_and_min():
    """& | ^ ~ are elementwise (no communication beside two S(0) masks); any / all over a sharded
    axis are one Allreduce with op max / min (the plan prints them), over a whole axis local."""
    assert _collectives(lambda x: ((x > 0) & (x < 1)) | ~(x > 0.5), ("DIDx", None)) == {}
    assert _collectives(lambda x: (x > 0).any(1), ("DIDx", None)) == {}
    mesh = ew.mesh_of(4)
    plan = sf.jit(lambda x: ((x > 0).any(0), (x > 0).all(0)), mesh=mesh).lower(
        sf.TensorSpec(ew.SHAPE, "float64", sf.Layout(("DIDx", None))))
    assert plan.collectives() == {"allreduce": 2}, plan
    text = str(plan)
    assert "op=max" in text and "op=min" in text, text
    traced = str(sf.jit(lambda x, y: (x > 0) & (y > 0) | (x < y), mesh=mesh).trace(np.ones(4), np.ones(4)))
    assert "bitwise_and(" in traced and "bitwise_or(" in traced, traced


def test_any_and_all_of_an_empty_axis_are_numpys():
    x = np.zeros((0, 6))
    f = sf.jit(lambda v: ((v > 0).any(0), (v > 0).all(0), np.any(v, axis=(0, 1))), mesh=ew.mesh_of(2))
    for got, want in zip(f(x), ((x > 0).any(0), (x > 0).all(0), np.any(x, axis=(0, 1)))):
        np.testing.assert_array_equal(got.gather(), want)


def test_a_mask_folded_into_the_causal_one_as_attention_asks():
    """A mask folded into the causal one by hand (mask & np.tril(...)) is what causal=True beside mask= does."""
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((2, 4, 8, 8)) for _ in range(3))
    keep = rng.uniform(size=(2, 1, 8, 8)) > 0.3
    mesh = ew.mesh_of(4)
    both_given = sf.jit(lambda q, k, v, m: sf.nn.attention(q, k, v, mask=m, causal=True), mesh=mesh)(q, k, v, keep)
    folded = sf.jit(lambda q, k, v, m: sf.nn.attention(sf.shard(q, axis=1), k, v, mask=m & np.tril(np.ones((8, 8), bool))),
                    mesh=mesh)
    both = keep & np.tril(np.ones((8, 8), bool))
    s = np.where(both, q @ np.swapaxes(k, -1, -2) / np.sqrt(8), -np.inf)
    with np.errstate(invalid="ignore"):  # (rows with nothing to attend to: NaN here, left out below)
        e = np.exp(s - s.max(-1, keepdims=True))
        want = np.nan_to_num(e / e.sum(-1, keepdims=True)) @ v
    rows = both.any(-1)  # (a row with nothing to attend to is uniform in sf.nn.attention: compare the others)
    got = folded(q, k, v, keep).gather()
    np.testing.assert_allclose(got[np.broadcast_to(rows, got.shape[:-1])], want[np.broadcast_to(rows, want.shape[:-1])],
                               rtol=1e-10, atol=1e-12)
    eager = sf.nn.attention(sf.shard(q, axis=1, mesh=mesh), k, v, mask=sf.replicate(keep, mesh=mesh) & np.tril(
        np.ones((8, 8), bool)))
    np.testing.assert_allclose(eager.gather(), got, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(both_given.gather(), got, rtol=1e-12, atol=1e-12)


def test_the_gradient_flows_through_the_values_a_combined_mask_selects():
    rng = np.random.default_rng(22)
    x, y = nonzero(rng, ew.SHAPE), nonzero(rng, ew.SHAPE)
    mesh = ew.mesh_of(4)

    def loss(x, y):
        m = ((x > 0) & (y > 0)) | ~(x < 1.5)
        return (np.where(m, x * y, 0.0) ** 2).sum()
    g = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)(sf.shard(x, axis=0, mesh=mesh), y)
    m = ((x > 0) & (y > 0)) | ~(x < 1.5)
    np.testing.assert_allclose(g[0].gather(), np.where(m, 2 * x * y * y, 0), rtol=1e-12)
    np.testing.assert_allclose(g[1].gather(), np.where(m, 2 * x * x * y, 0), rtol=1e-12)
    eps, d = 1e-6, rng.standard_normal(ew.SHAPE)
    central = (loss(x + eps * d, y) - loss(x - eps * d, y)) / (2 * eps)
    np.testing.assert_allclose((g[0].gather() * d).sum(), central, rtol=1e-6)


@pytest.mark.parametrize("fn, message", [
    (lambda x: x & x, r"x & y \(np.bitwise_and\) of \w+ \(shape \(8, 12\), float64\): & \| \^ ~ are NumPy's bitwise "
                      r"ops, of booleans \(logical\) and integers only.*np.logical_and"),
    (lambda x: (x > 0) | 1.5, r"x \| y \(np.bitwise_or\) of .*float64.*bitwise ops"),
    (lambda x: ~x, r"~x \(np.invert\) of .*float64"),
    (lambda x: (x > 0) & "a", r"(x & y \(np.bitwise_and\): an array or a Python scalar was expected, got str"
                              r"|unsupported operand type\(s\) for &: 'Array' and 'str')"),  # (eager: Python's, as x + "1")
    (lambda x: np.any(x, where=x > 0), r"np.any with where= is not supported .*write np.any\(x, axis, keepdims=\)"),
])
def test_floats_and_unsupported_arguments_are_refused_as_numpy_refuses_them(fn, message):
    x = nonzero(np.random.default_rng(23), ew.SHAPE)
    mesh = ew.mesh_of(4)
    with pytest.raises(TypeError, match=message):
        sf.jit(fn, mesh=mesh)(x)
    with pytest.raises(TypeError, match=message):
        fn(sf.shard(x, axis=0, mesh=mesh))
