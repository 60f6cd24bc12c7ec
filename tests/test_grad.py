"""sf.grad, sf.value_and_grad, sf.vjp (issue 32): every op's gradient against float64 central
differences of the same function's compiled forward, on fresh random inputs, with inputs
replicated and sharded on a 1-D and a 2-D mesh; gradients in their primals' layouts; the MLP
block's gradients against NumPy's analytic ones and its backward's collectives pinned; the API's
forms inside and outside jit, pytrees, has_aux, argnums, and its refusals.

tests/mpi/test_grad_mpi.py runs the same checks under mpiexec."""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.dtypes import np_dtype
from test_nn import mesh_of  # (the 1-D tp mesh and the 2x2 dp x tp mesh, NumPy devices)
from shardfuse.mlp import mlp_block, mlp_inputs



def pos(rng, shape):  # away from 0, for sqrt, log, 1/x
    return rng.uniform(0.5, 2.0, shape)


def unit(rng, shape):  # inside (-1, 1), away from its ends, for arcsin, arccos, arctanh
    return rng.uniform(-0.8, 0.8, shape)


def normal(rng, shape):
    return rng.standard_normal(shape)


def ids(rng, shape):  # integer ids, negative ones too (NumPy's: from the end)
    return rng.integers(-8, 8, shape).astype(np.int32)


def repeated_ids(rng, shape):  # ids, each drawn from three values: every row taken several times
    return rng.choice(np.array([2, -1, 5], np.int32), shape)


# name -> (function, [(shape, generator)], argnums); the loss is sum(fn(*args) * r)
X, Y = (8, 12), (12,)
CASES = {
    "exp": (np.exp, [(X, normal)], 0),
    "tanh": (np.tanh, [(X, normal)], 0),
    "relu": (sf.relu, [(X, normal)], 0),
    "gelu": (sf.gelu, [(X, normal)], 0),
    "silu": (sf.silu, [(X, normal)], 0),
    "sigmoid": (sf.sigmoid, [(X, normal)], 0),
    "sqrt": (np.sqrt, [(X, pos)], 0),
    "rsqrt": (sf.rsqrt, [(X, pos)], 0),
    "log": (np.log, [(X, pos)], 0),
    "sin": (np.sin, [(X, normal)], 0),
    "cos": (sf.cos, [(X, normal)], 0),
    "log1p": (np.log1p, [(X, pos)], 0),
    "expm1": (np.expm1, [(X, normal)], 0),
    "erf": (sf.erf, [(X, normal)], 0),
    "tan": (lambda x: np.tan(x * 0.5), [(X, normal)], 0),
    "arcsin arccos arctanh": (lambda x: np.arcsin(x) + np.arccos(x) * 2.0 + np.arctanh(x), [(X, unit)], 0),
    "arctan sinh cosh arcsinh": (lambda x: np.arctan(x) + np.sinh(x) * np.cosh(x) + np.arcsinh(x), [(X, normal)], 0),
    "arccosh": (lambda x: np.arccosh(x + 1.0), [(X, pos)], 0),
    "log2 log10 exp2 cbrt": (lambda x: np.log2(x) + np.log10(x) * np.exp2(x) + np.cbrt(x), [(X, pos)], 0),
    "gelu exact": (lambda x: sf.nn.gelu(x * 2.0, approximate=False), [(X, normal)], 0),
    "reciprocal": (np.reciprocal, [(X, pos)], 0),
    # piecewise constant (zero gradient, as JAX's: the product rule leaves them as factors), and boolean tests
    "sign floor ceil round (no gradient)": (lambda x: (np.sign(x) + np.floor(x * 2.0) + np.ceil(x) + np.round(x * 3.0)
                                                       + x.round()) * x, [(X, normal)], 0),
    "isnan isinf isfinite (no gradient)": (lambda x: sf.where(np.isfinite(x) & ~np.isnan(x) & ~np.isinf(x), x * x, 0.0)
                                           + np.isnan(x) * x, [(X, normal)], 0),
    "pow 3": (lambda x: x ** 3, [(X, normal)], 0),
    "pow 0.5": (lambda x: x ** 0.5, [(X, pos)], 0),
    "rpow": (lambda x: 2.0 ** x, [(X, normal)], 0),
    "abs": (abs, [(X, normal)], 0),
    "scalars": (lambda x: (3.0 - x * 2.0) / 4.0 + 1.5 / (x * x + 1.0), [(X, normal)], 0),
    "maximum scalar": (lambda x: np.maximum(x, 0.3) + np.minimum(x, -0.2), [(X, normal)], 0),
    "astype": (lambda x: (x.astype("float32") * 2.0).astype("float64"), [(X, normal)], 0),
    "add broadcast": (lambda x, y: x + y, [(X, normal), (Y, normal)], (0, 1)),
    "sub column": (lambda x, y: x - y, [(X, normal), ((8, 1), normal)], (0, 1)),
    "mul broadcast": (lambda x, y: x * y, [(X, normal), ((1, 12), normal)], (0, 1)),
    "div": (lambda x, y: x / y, [(X, normal), (X, pos)], (0, 1)),
    "einsum diagonal and trace": (lambda x: np.einsum("ii,ij->j", x[:, :8], x) + np.einsum("ii", x[:, 4:]),
                                  [(X, normal)], 0),
    "repeat counts": (lambda x: np.repeat(x, [1, 0, 2, 3, 1, 1, 4, 2], axis=0) ** 2, [(X, normal)], 0),
    "arctan2 hypot copysign": (lambda x, y: np.arctan2(x, y) + np.hypot(y, x) * 0.5 + np.copysign(x, y) * x,
                               [(X, normal), (Y, normal)], (0, 1)),
    "maximum": (lambda x, y: np.maximum(x, y) - np.minimum(x, y) * 0.5, [(X, normal), (X, normal)], (0, 1)),
    "where": (lambda x, y: sf.where(x > 0.1, x * y, y), [(X, normal), (Y, normal)], (0, 1)),
    "where scalar": (lambda x: sf.where(x > 0, x, 2.0) + sf.where(x < 0.5, -1.0, x * x), [(X, normal)], 0),
    "sum axis 0": (lambda x: x.sum(0), [(X, normal)], 0),
    "sum keepdims": (lambda x: x * x.sum(axis=1, keepdims=True), [(X, normal)], 0),
    "sum all": (lambda x: x.sum() * x, [(X, normal)], 0),
    "mean": (lambda x: x.mean(axis=(0, 1)) + x.mean(axis=-1, keepdims=True), [(X, normal)], 0),
    "max last": (lambda x: x.max(axis=-1), [(X, normal)], 0),
    "max first keepdims": (lambda x: x - x.max(axis=0, keepdims=True), [(X, normal)], 0),
    "min all": (lambda x: x.min() * x, [(X, normal)], 0),
    "reshape": (lambda x: x.reshape(4, 24) * 2.0, [(X, normal)], 0),
    "transpose": (lambda x: x.T @ x, [(X, normal)], 0),
    "swapaxes": (lambda x: x.reshape(4, 2, 12).swapaxes(0, 2), [(X, normal)], 0),
    "matmul": (lambda x, w: x @ w, [(X, normal), ((12, 4), normal)], (0, 1)),
    "matmul batch @ 2-D": (lambda x, w: x.reshape(4, 2, 12) @ w, [(X, normal), ((12, 4), normal)], (0, 1)),
    "matmul batched": (lambda x, w: x.reshape(4, 2, 12) @ w, [(X, normal), ((4, 12, 4), normal)], (0, 1)),
    "softmax": (sf.nn.softmax, [(X, normal)], 0),
    "log_softmax": (lambda x: sf.nn.log_softmax(x, axis=0), [(X, normal)], 0),
    "layer_norm": (sf.nn.layer_norm, [(X, normal), (Y, normal), (Y, normal)], (0, 1, 2)),
    "rms_norm": (sf.nn.rms_norm, [(X, normal), (Y, normal)], (0, 1)),
    "attention": (lambda q, k, v: sf.nn.attention(q, k, v), [((2, 4, 6, 4), normal)] * 3, (0, 1, 2)),
    "cross_entropy_onehot": (lambda x, t: sf.nn.cross_entropy_onehot(x, t), [(X, normal), (X, normal)], 0),
    "cross_entropy": (lambda x, t: sf.nn.cross_entropy(x, t), [(X, normal), ((8,), ids)], 0),
    "take": (lambda t, i: sf.take(t, i), [((12, 4), normal), ((8, 3), ids)], 0),
    "take vocab-parallel": (lambda t, i: sf.take(sf.shard(t, axis=0), i), [(X, normal), ((4, 2), ids)], 0),
    "take repeated ids": (lambda t, i: sf.take(sf.shard(t, axis=0), i), [(X, normal), ((12,), repeated_ids)], 0),
    "take axis 1": (lambda t, i: sf.take(t, i, axis=1), [((4, 12), normal), ((5,), ids)], 0),
    "scatter_add": (lambda i, v: sf.scatter_add(i, v * v, 8), [((8, 3), repeated_ids), ((8, 3, 4), normal)], 1),
    "slicing": (lambda x: x[1:7, ::3] * x[2:8, -4:] + x[3, None, 2:6], [(X, normal)], 0),
    "negative steps": (lambda x: sf.concatenate([x[::-1, 10:2:-2] * x[:, 3:7], x[7::-3, ::-3]], axis=0),
                       [(X, normal)], 0),
    "reversal": (lambda x: x[..., ::-1] * x + x[::-1], [(X, normal)], 0),
    "split and concatenate": (lambda x, y: sf.concatenate(sf.split(x, 3, axis=1)[::-1] + [y], axis=1),
                              [(X, normal), ((8, 4), normal)], (0, 1)),
    "stack": (lambda x, y: sf.stack([x, y * 2.0], axis=1), [(X, normal), (X, normal)], (0, 1)),
    "fused qkv split": (lambda x, w: sf.split((x @ w).reshape(8, 2, 6), 3, axis=-1)[1] * 2.0,
                        [(X, normal), ((12, 12), normal)], (0, 1)),
    "var": (lambda x: x.var(axis=1, ddof=1) + np.var(x, axis=0).sum() + x.var(), [(X, normal)], 0),
    "std": (lambda x: x * np.std(x, axis=-1, keepdims=True), [(X, normal)], 0),
    "layer norm by hand": (lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
                           [(X, normal)], 0),
    "clip": (lambda x, y: np.clip(x, -0.5, 0.7) * x + x.clip(min=y), [(X, normal), (Y, normal)], (0, 1)),
    "mod": (lambda x, y: x % y + 2.5 % y, [(X, normal), (X, pos)], (0, 1)),
    "floor_divide (no gradient)": (lambda x: (x // 0.3) * x, [(X, normal)], 0),
    "argmax (no gradient)": (lambda x: x * x.argmax(axis=1, keepdims=True).astype("float64"), [(X, normal)], 0),
    "causal attention": (lambda q, k, v: sf.nn.attention(q, k, v, causal=True), [((2, 4, 6, 4), normal)] * 3,
                         (0, 1, 2)),
    # what a torch / JAX port met as missing (shardfuse/numpy_einsum.py, shardfuse/numpy_math.py)
    "cumsum": (lambda x: np.cumsum(x, 0) * x + np.cumsum(x, axis=-1) + x.cumsum().reshape(X), [(X, normal)], 0),
    "cumsum of a 3-D value": (lambda x: np.cumsum(x.reshape(4, 2, 12), 1), [(X, normal)], 0),
    "trunc round decimals (no gradient)": (lambda x: (np.trunc(x * 3.0) + np.round(x, 1) + x.round(-1)) * x,
                                           [(X, normal)], 0),
    "einsum bsh,hd->bsd": (lambda x, w: np.einsum("bsh,hd->bsd", x.reshape(4, 2, 12), w),
                           [(X, normal), ((12, 4), normal)], (0, 1)),
    "einsum bhqd,bhkd->bhqk": (lambda q, k: np.einsum("bhqd,bhkd->bhqk", q, k), [((4, 2, 6, 4), normal)] * 2, (0, 1)),
    "einsum bsd,bsh->dh": (lambda x, y: np.einsum("bsd,bsh->dh", x.reshape(4, 2, 12), y),
                           [(X, normal), ((4, 2, 4), normal)], (0, 1)),
    "einsum three operands": (lambda x, w, v: np.einsum("...c,cd,de->...e", x, w, v),
                              [(X, normal), ((12, 4), normal), ((4, 8), normal)], (0, 1, 2)),
    "einsum product and sum": (lambda x, y: np.einsum("ij,j->i", x, y)[:, None] * np.einsum("ij,ij->j", x, x),
                               [(X, normal), (Y, normal)], (0, 1)),
    "tensordot": (lambda x, w: np.tensordot(x.reshape(4, 2, 12), w, ([1, 2], [1, 0])),
                  [(X, normal), ((12, 2, 4), normal)], (0, 1)),
    # a Llama port's (shardfuse/numpy_broadcast.py, shardfuse/numpy_shapes.py)
    "broadcast_to": (lambda x: np.broadcast_to(x[:, None, :], (8, 3, 12)) * np.arange(3.0)[:, None], [(X, normal)], 0),
    "repeat and tile": (lambda x: np.repeat(x, 2, axis=0) * np.tile(x, (2, 1))
                        + np.tile(x.repeat(3, 1)[:, ::3], (2, 1)), [(X, normal)], 0),
    "repeat_kv": (lambda k: np.repeat(k.reshape(4, 2, 12), 3, axis=1), [(X, normal)], 0),
    "outer": (lambda x, y: np.outer(x.sum(1), y), [(X, normal), (Y, normal)], (0, 1)),
    "logaddexp": (lambda x, y: np.logaddexp(x, y) + np.logaddexp(x, 0.3), [(X, normal), (Y, normal)], (0, 1)),
    "power of arrays": (lambda x, y: x ** y + np.power(2.5, y), [(X, pos), (Y, normal)], (0, 1)),
    "power by a 0-d array": (lambda x, t: x ** t, [(X, pos), ((), normal)], (0, 1)),
    "take_along_axis": (lambda x, i: np.take_along_axis(x, i, 1) + np.take_along_axis(x, i[:, :1], -1),
                        [(X, normal), ((8, 3), ids)], 0),
    "mT": (lambda x: x.mT @ np.matrix_transpose(x.reshape(4, 2, 12)).reshape(12, 8).mT, [(X, normal)], 0),
}

# how each argument is placed, per mesh kind: replicated, or its first axis sharded
PLACEMENTS = {"1d": {"R": None, "S0": ("tp",)}, "2d": {"R": None, "S0": ("dp",), "S01": (("dp", "tp"),)}}


def placed(a, mesh, spec):
    if spec is None or a.ndim == 0 or a.shape[0] % np.prod([mesh.axis_size(n) for n in np.atleast_1d(spec[0])]):
        return sf.distribute(a, mesh, (None,) * a.ndim)
    return sf.distribute(a, mesh, tuple(spec) + (None,) * (a.ndim - len(spec)))


def loss_of(fn):
    def loss(*args):
        *xs, r = args
        return (fn(*xs) * r).sum()
    loss.__name__ = "loss"
    return loss


def check_case(name, mesh, placement, rng, eps=1e-6):
    """sf.grad of sum(fn(*args) * r) against the central difference of the compiled forward, in two
    random directions; each gradient in its argument's layout."""
    fn, gens, argnums = CASES[name]
    nums = (argnums,) if isinstance(argnums, int) else argnums
    xs = [g(rng, s) for s, g in gens]
    r = rng.standard_normal(np.shape(np.asarray(sf.jit(fn, mesh=mesh)(*xs))))
    spec = PLACEMENTS["1d" if len(mesh.axis_names) == 1 else "2d"][placement]
    args = [placed(x, mesh, spec) for x in xs] + [sf.replicate(r, mesh=mesh)]
    loss = loss_of(fn)
    value, grads = sf.jit(sf.value_and_grad(loss, argnums=nums), mesh=mesh)(*args)
    forward = sf.jit(loss, mesh=mesh)
    assert abs(float(value) - float(forward(*args))) <= 1e-12 * (1 + abs(float(value)))
    for k, g in zip(nums, grads):
        assert g.shape == xs[k].shape and g.dtype == np.float64, (name, k, g.shape)
        assert g.sharding == args[k].sharding, (name, k, g.sharding, args[k].sharding)
    if name == "astype":  # (linear, but through float32: a step float32's rounding does not swamp)
        eps, tol = 1e-2, 2e-4
    else:
        tol = 1e-6
    for _ in range(2):
        vs = [rng.standard_normal(x.shape) for x in xs]
        moved = [lambda s, k=k: [x + s * v if j == k else x for j, (x, v) in enumerate(zip(xs, vs))] for k in nums]
        for k, g, at in zip(nums, grads, moved):
            hi, lo = (float(forward(*at(s), r)) for s in (eps, -eps))
            numeric = (hi - lo) / (2 * eps)
            analytic = float(np.sum(np.asarray(g) * vs[k]))
            assert abs(numeric - analytic) <= tol * (1 + abs(numeric)), (name, k, numeric, analytic)


def seed_of(*names):  # (the same on every rank: Python's hash of a str is not)
    return np.random.default_rng(zlib.crc32(repr(names).encode()))


ALL = [(name, kind, p) for name in CASES for kind in ("1d", "2d") for p in PLACEMENTS[kind]]


@pytest.mark.parametrize("name, kind, placement", ALL, ids=[f"{n}-{k}-{p}" for n, k, p in ALL])
def test_gradient_against_central_differences(name, kind, placement):
    check_case(name, mesh_of(kind), placement, seed_of(name, kind, placement))


# ---- the MLP block: analytic gradients, the backward pipelined --------------------------------------

def np_mlp_grads(x, w1, b1, w2, b2, r):
    """d sum((gelu(x w1 + b1) w2 + b2) * r) / d(x, w1, b1, w2, b2), written out in NumPy."""
    k = np.sqrt(2 / np.pi)
    h = x @ w1 + b1
    t = np.tanh(k * (h + 0.044715 * h ** 3))
    g = 0.5 * h * (1 + t)
    dg = r @ w2.T
    dh = dg * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * k * (1 + 3 * 0.044715 * h * h))
    return dh @ w1.T, x.T @ dh, dh.sum(0), g.T @ r, r.sum(0)


def mlp_grad(mesh, mode, chunks, dp=None):
    block = mlp_block(mesh, mode, chunks=chunks, dp=dp)

    def loss(x, w1, b1, w2, b2, r):
        return (block(x, w1, b1, w2, b2) * r).sum()
    return sf.jit(sf.grad(loss, argnums=(0, 1, 2, 3, 4)), mesh=mesh)


def check_mlp(mesh, mode, chunks, rng, dp=None):
    x, w1, b1, w2, b2 = mlp_inputs(rng, 16, 8, batch=2 if dp else None)
    r = rng.standard_normal(x.shape)
    grads = mlp_grad(mesh, mode, chunks, dp)(x, w1, b1, w2, b2, r)
    if dp:  # the batch is data-parallel: weight gradients summed over it
        per = [np_mlp_grads(x[b], w1, b1, w2, b2, r[b]) for b in range(x.shape[0])]
        want = [np.stack([p[0] for p in per])] + [sum(p[i] for p in per) for i in range(1, 5)]
    else:
        want = np_mlp_grads(x, w1, b1, w2, b2, r)
    for name, g, w in zip(("x", "w1", "b1", "w2", "b2"), grads, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("mode, chunks", [("sp", 2), ("sp", 4), ("tp", 2)])
def test_mlp_block_gradients_exact(mode, chunks):
    check_mlp(mesh_of("1d"), mode, chunks, np.random.default_rng(3))


def test_mlp_block_gradients_data_parallel():
    check_mlp(mesh_of("2d"), "sp", 2, np.random.default_rng(4), dp="dp")


def _loops_with(plan, op):
    return [i for i in plan.program.instrs if i.op == "for" and any(b.op == op for b in i.body)]


@pytest.mark.parametrize("chunks", [2, 4])
def test_sequence_parallel_backward_is_pipelined(chunks):
    """The forward's AllGather+GEMM gives a backward GEMM+ReduceScatter over the same chunks (the
    input gradient), and its GEMM+ReduceScatter an AllGather+GEMM: each a stream loop of S steps."""
    rng = np.random.default_rng(5)
    x, w1, b1, w2, b2 = mlp_inputs(rng, 16, 8)
    plan = mlp_grad(mesh_of("1d"), "sp", chunks).lower(x, w1, b1, w2, b2, x)
    gathers, scatters = _loops_with(plan, "allgather"), _loops_with(plan, "reduce_scatter")
    assert len(gathers) == 2 and len(scatters) == 2, str(plan)  # forward and backward, one each
    assert all(loop.attrs["extent"] == chunks for loop in gathers + scatters)
    # besides: the weight gradients gather the activations again, as Megatron does (an Allgather of x
    # for dW1, of dZ for dW2: no AllToAll of the larger dH), and one Allreduce, of b2's gradient (sf.grad
    # returns no loss: its gradient's seed, ones of its shape, reads it for the shape alone, so the loss's
    # pending sum is never reduced)
    assert plan.collectives() == {"allgather": 2 * chunks + 2, "reduce_scatter": 2 * chunks, "allreduce": 1}
    # the backward's loops come after the forward's, in the other order (the last layer first)
    assert plan.program.instrs.index(gathers[0]) < plan.program.instrs.index(scatters[0]) \
        < plan.program.instrs.index(gathers[1]) < plan.program.instrs.index(scatters[1])


# ---- layouts of gradients -------------------------------------------------------------------------

def test_gradient_has_its_primals_layout():
    mesh = mesh_of("2d")
    rng = np.random.default_rng(6)
    w = sf.distribute(rng.standard_normal((12, 8)), mesh, (None, "tp"))  # column-parallel
    v = sf.replicate(rng.standard_normal((8, 4)), mesh=mesh)  # replicated over dp and tp
    x = sf.distribute(rng.standard_normal((4, 12)), mesh, ("dp", None))  # data-parallel batch

    def loss(w, v, x):
        return ((x @ w) @ v).sum()
    f = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)
    dw, dv = f(w, v, x)
    assert dw.sharding == w.sharding and dv.sharding == v.sharding
    xs = np.asarray(x)
    np.testing.assert_allclose(np.asarray(dw), xs.T @ np.ones((4, 4)) @ np.asarray(v).T, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(dv), (xs @ np.asarray(w)).T @ np.ones((4, 4)), rtol=1e-12)
    assert "allreduce" in f.lower(w, v, x).collectives()  # the replicated weight's gradient: summed over dp


@pytest.mark.parametrize("steps", [((0, "dp"), (1, "tp")), ((1, "tp"), (0, "dp")), ((0, "tp"), (1, "tp"))])
def test_composed_annotations_state_the_gradients_layout(steps):
    """A probe: sf.shard(sf.shard(w, 0, "dp"), 1, "tp") (the README's composition) placed w as (dp, tp)
    but its gradient came back replicated, two Allgathers more: each step annotates w itself, and the
    gradient took a layout only where every annotation of w agreed; the last one states it now."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng()
    w, x = rng.standard_normal((4, 4)), rng.standard_normal((3, 4))
    want = [None, None]
    for ax, over in steps:
        want[ax] = over
        want[1 - ax] = want[1 - ax] if over != want[1 - ax] else None  # (a mesh axis moved to another tensor axis)

    def loss(w, x):
        for ax, over in steps:
            w = sf.shard(w, axis=ax, over=over)
        return ((x @ w) ** 2).sum()
    f = sf.jit(sf.grad(loss), mesh=mesh)
    dw = f(w, x)
    assert dw.sharding.axes == tuple(want) and "allgather" not in f.lower(w, x).collectives()
    np.testing.assert_allclose(np.asarray(dw), x.T @ (2 * x @ w), rtol=1e-12)


@pytest.mark.parametrize("w_axes, gathered", [(("dp", None), None), (("dp", "tp"), "tp"), ((None, "dp"), None)])
def test_the_gradient_of_a_gathered_weight_is_reduce_scattered(w_axes, gathered):
    """FSDP: a weight stored sharded over dp and gathered for the forward (sf.replicate, or an
    annotation keeping only tp) has its gradient reduce-scattered into its shards, as JAX
    transposes all_gather and FSDP reduces: no Allreduce of the whole gradient and slice of it."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng(9)
    w = sf.distribute(rng.standard_normal((8, 4)), mesh, w_axes)
    x = rng.standard_normal((6, 8))

    def loss(w, x):
        full = sf.replicate(w) if gathered is None else sf.shard(w, axis=1, over=gathered)
        return (sf.shard(x, axis=0, over="dp") @ full).sum()
    f = sf.jit(sf.grad(loss), mesh=mesh)
    plan = f.lower(w, x)
    assert "reduce_scatter" in plan.collectives() and "ShardSlice" not in str(plan), str(plan)
    dw = f(w, x)
    assert dw.sharding == w.sharding
    np.testing.assert_allclose(np.asarray(dw), np.repeat(x.sum(0)[:, None], 4, axis=1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_axes, w_axes, merged", [
    ((None, None, None), (None, None), True),
    (("dp", None, None), (None, None), True),  # a batch over dp merges with the rows: still over dp
    (("dp", "tp", None), (None, "tp"), True),  # sequence parallel: x gathered over tp first
    ((None, "dp", None), (None, None), False),  # rows over dp under a whole batch axis: no view
])
def test_weight_gradient_of_a_batched_input_is_one_gemm(x_axes, w_axes, merged):
    """x [b, s, h] @ w [h, f]: dw is one GEMM of x's and dy's rows merged ([b*s, h]^T @ [b*s, f],
    Megatron's view), not b per-batch [h, f] products and their sum, where the merge is a view."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng(16)
    xs, ws = rng.standard_normal((4, 6, 12)), rng.standard_normal((12, 8))
    x, w = sf.distribute(xs, mesh, x_axes), sf.distribute(ws, mesh, w_axes)
    f = sf.jit(sf.grad(lambda w, x: np.tanh(x @ w).sum()), mesh=mesh)
    np.testing.assert_allclose(np.asarray(f(w, x)), xs.reshape(24, 12).T @ (1 - np.tanh(xs @ ws) ** 2).reshape(24, 8),
                               rtol=1e-12)
    text = str(f.lower(w, x))
    per_batch = [ln for ln in text.splitlines() if "Allocate f64[4" in ln and ", 12, 8" in ln]
    assert (not per_batch) == merged, text
    assert bool(re.search(r"= Transpose x\w*_r, perm=\(1, 0\)", text)) == merged, text


# ---- the API --------------------------------------------------------------------------------------

def _loss(params, x):
    h = np.tanh(x @ params["w"] + params["b"])
    return (h * h).mean()


def _params(rng):
    return {"w": rng.standard_normal((6, 4)), "b": rng.standard_normal((4,))}


def _np_loss_grads(params, x):
    h = np.tanh(x @ params["w"] + params["b"])
    dz = 2 * h * (1 - h * h) / h.size
    return {"w": x.T @ dz, "b": dz.sum(0)}


def test_pytree_parameters_inside_jit_value_and_grad_and_aux():
    mesh = mesh_of("1d")
    rng = np.random.default_rng(7)
    params, x = _params(rng), rng.standard_normal((8, 6))

    def with_aux(params, x):
        return _loss(params, x), {"scaled": _loss(params, x) * 2.0}
    value, grads = sf.jit(sf.value_and_grad(_loss), mesh=mesh)(params, x)
    (v2, aux), g2 = sf.jit(sf.value_and_grad(with_aux, has_aux=True), mesh=mesh)(params, x)
    g3, aux3 = sf.jit(sf.grad(with_aux, has_aux=True), mesh=mesh)(params, x)
    want = _np_loss_grads(params, x)
    assert sorted(grads) == ["b", "w"]
    for g in (grads, g2, g3):
        for k in want:
            np.testing.assert_allclose(np.asarray(g[k]), want[k], rtol=1e-12)
    np.testing.assert_allclose(float(aux["scaled"]), 2 * float(value), rtol=1e-15)
    np.testing.assert_allclose(float(aux3["scaled"]), 2 * float(v2), rtol=1e-15)


def test_grad_outside_jit_on_sf_arrays_and_of_a_jitted_function():
    mesh = mesh_of("1d")
    rng = np.random.default_rng(8)
    params, x = _params(rng), rng.standard_normal((8, 6))
    want = _np_loss_grads(params, x)
    placed = {k: sf.replicate(v, mesh=mesh) for k, v in params.items()}
    eager = sf.grad(_loss)(placed, sf.shard(x, axis=0, mesh=mesh))
    of_jitted = sf.grad(sf.jit(_loss, mesh=mesh))(params, x)
    argnums = sf.grad(_loss, argnums=(0, 1))(placed, sf.replicate(x, mesh=mesh))
    for g in (eager, of_jitted, argnums[0]):
        for k in want:
            np.testing.assert_allclose(np.asarray(g[k]), want[k], rtol=1e-12)
    assert argnums[1].shape == x.shape


def test_vjp_inside_and_outside_jit():
    mesh = mesh_of("1d")
    rng = np.random.default_rng(10)
    a, b, ct = rng.standard_normal((8, 6)), rng.standard_normal((6, 4)), rng.standard_normal((8, 4))

    def f(a, b):
        return np.tanh(a @ b)
    t = np.tanh(a @ b)
    want_a, want_b = ((1 - t * t) * ct) @ b.T, a.T @ ((1 - t * t) * ct)

    def inside(a, b, ct):
        out, pull = sf.vjp(f, sf.shard(a, axis=0), b)
        return (out,) + pull(ct)
    out, da, db = sf.jit(inside, mesh=mesh)(a, b, ct)
    np.testing.assert_allclose(np.asarray(out), t, rtol=1e-12)
    out2, pull = sf.vjp(f, sf.shard(a, axis=0, mesh=mesh), sf.replicate(b, mesh=mesh))
    da2, db2 = pull(ct)
    np.testing.assert_allclose(np.asarray(out2), t, rtol=1e-12)
    for got, want in ((da, want_a), (db, want_b), (da2, want_a), (db2, want_b)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12)
    assert da2.sharding == sf.shard(a, axis=0, mesh=mesh).sharding


def test_annotations_inside_the_differentiated_function_reach_its_primal():
    """A primal made by an annotation outside the function is a new value to it: the function's own
    annotation does not compose through it (the gradient would miss it)."""
    mesh = mesh_of("1d")
    rng = np.random.default_rng(11)
    w, x = rng.standard_normal((8, 4)), rng.standard_normal((8, 8))

    def loss(w, x):
        return (x @ sf.shard(w, axis=0)).sum()

    def outer(w, x):
        return sf.grad(loss)(sf.shard(w, axis=1), x)
    np.testing.assert_allclose(np.asarray(sf.jit(outer, mesh=mesh)(w, x)), x.T @ np.ones((8, 4)), rtol=1e-12)


def test_unused_argument_gets_zeros_and_integer_outputs_carry_none():
    mesh = mesh_of("1d")
    x, y = np.arange(1.0, 9.0), np.arange(8.0)

    def loss(x, y):
        return (x * (x > 3).astype("float64")).sum()
    dx, dy = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)(x, y)
    np.testing.assert_array_equal(np.asarray(dx), (x > 3).astype(float))
    np.testing.assert_array_equal(np.asarray(dy), np.zeros(8))


@pytest.mark.parametrize("fn, args, argnums, match", [
    (lambda x: x * 2.0, (np.ones(4),), 0, "must return a float scalar"),
    (lambda x: x.sum(), (np.arange(4, dtype=np.int32),), 0, "float arrays only"),
    (lambda x, y: (x * y).sum(), (np.ones(4), np.ones(4)), 2, "at least 3 positional arguments"),
    (lambda x: x.sum(), (np.ones(4),), "0", "argnums must be an int"),
])
def test_refusals(fn, args, argnums, match):
    with pytest.raises((TypeError, ValueError), match=match):
        sf.jit(sf.grad(fn, argnums=argnums), mesh=mesh_of("1d"))(*args)


def test_refusals_outside_jit_and_of_the_cotangent():
    with pytest.raises(ValueError, match="mesh of its sf.Array arguments"):
        sf.grad(lambda x: x.sum())(np.ones(4))
    mesh = mesh_of("1d")
    _, pull = sf.vjp(lambda x: x * 2.0, sf.replicate(np.ones(4), mesh=mesh))
    with pytest.raises(ValueError, match="shape"):
        pull(np.ones(5))


@pytest.mark.parametrize("d", [2, 4, 8])
def test_seed_backward_exact(d):
    """The seed's pipelined AllGather+GEMM, differentiated: da, db against NumPy's (the cotangent
    of its replicated result is replicated, so da is a local slice of r @ b.T: no collective)."""
    mesh = sf.DeviceMesh(d, backend="numpy")
    rng = np.random.default_rng(d)
    a, b, r = rng.standard_normal((4, d, 8, 16)), rng.standard_normal((16, 12)), rng.standard_normal((4, d, 8, 12))

    def loss(a, b, r):
        return (sf.stream(sf.shard(a, axis=1) @ b, axis=0, chunks=2) * r).sum()
    f = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)
    da, db = f(a, b, r)
    np.testing.assert_allclose(np.asarray(da), r @ b.T, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(db), np.einsum("sdmk,sdmn->kn", a, r), rtol=1e-12)
    assert da.sharding == sf.shard(a, axis=1, mesh=mesh).sharding


def test_a_moved_pending_product_gets_its_cotangent_whole():
    """Found by tests/test_differential_grad.py: the cotangent of a product that pends a sum (a
    contraction over a sharded axis), moved by sf.to_mesh, was pinned as pending too, so the
    backward summed it over the devices again (a gradient D times too large)."""
    mesh = mesh_of("1d")
    rng = np.random.default_rng(12)
    x0, x1, r = rng.standard_normal((4, 4)), rng.standard_normal((4, 2)), rng.standard_normal((4, 2))

    def loss(x0, x1, r):
        return (sf.to_mesh(sf.replicate(x0) @ x1, mesh) * r).sum()
    d0, d1 = sf.jit(sf.grad(loss, argnums=(0, 1)), mesh=mesh)(x0, sf.shard(x1, axis=0, mesh=mesh), r)
    np.testing.assert_allclose(np.asarray(d0), r @ x1.T, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(d1), x0.T @ r, rtol=1e-12)


def test_vjp_outside_jit_compiles_once():
    mesh = mesh_of("1d")
    rng = np.random.default_rng(13)

    def f(a):
        return np.tanh(a) * 2.0
    for _ in range(3):
        a, ct = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
        out, pull = sf.vjp(f, sf.replicate(a, mesh=mesh))
        (da,) = pull(ct)
        np.testing.assert_allclose(np.asarray(da), 2 * (1 - np.tanh(a) ** 2) * ct, rtol=1e-12)
    from shardfuse.transforms import VJP_PLANS

    (pair,) = [p for (g, *_), p in VJP_PLANS.snapshot().items() if g is f]
    assert all(len(j.cached_plans()) == 1 for j in pair)


@pytest.mark.parametrize("x1_axes, x2_axes, out_axis", [
    (("dp", None, None), (None, "tp", None), "dp"),  # x's operands known in two layouts: not knowable
    (("dp", None, None), ("dp", None, None), "tp"),  # x's rows over dp, its cotangent's over tp
])
def test_weight_gradient_stays_batched_where_rows_are_not_known_alike(x1_axes, x2_axes, out_axis):
    """The merged GEMM only where x's and the cotangent's layouts are known and split the rows
    alike; else the per-batch products (no gathers of x to make a merge that is not a view)."""
    mesh = mesh_of("2d")
    rng = np.random.default_rng(18)
    x1, x2, ws = rng.standard_normal((4, 6, 12)), rng.standard_normal((4, 6, 12)), rng.standard_normal((12, 8))

    def put(v, axes):  # (annotated inside the function: what the backward knows of them)
        for k, over in enumerate(axes):
            v = sf.shard(v, axis=k, over=over) if over else v
        return v

    def loss(w, a, b):
        return np.tanh(sf.shard(put(a, x1_axes) * put(b, x2_axes) @ w, axis=0, over=out_axis)).sum()
    args = (ws, x1, x2)
    f = sf.jit(sf.grad(loss), mesh=mesh)
    x = x1 * x2
    np.testing.assert_allclose(np.asarray(f(*args)), x.reshape(24, 12).T @ (1 - np.tanh(x @ ws) ** 2).reshape(24, 8),
                               rtol=1e-12)
    assert "perm=(1, 0)" not in str(f.lower(*args))  # (the merged GEMM's operand: [rows, k] transposed)


def test_cross_entropy_backward_never_compares_logits_with_their_max():
    """The max shift of sf.nn.cross_entropy is held constant (its terms cancel with one label per
    row): one comparison in the plan, the labels' with the vocabulary ids, none with the max."""
    mesh = mesh_of("1d")
    rng = np.random.default_rng(17)
    x, labels = rng.standard_normal((8, 12)), rng.integers(0, 12, (8,)).astype(np.int32)
    text = str(sf.jit(sf.grad(lambda x, i: sf.nn.cross_entropy(x, i, ignore_index=None)), mesh=mesh).lower(x, labels))
    assert text.count(" = Allocate bool[") == 2, text  # (labels < 0, and labels == ids)
    text = str(sf.jit(sf.grad(lambda x, i: sf.nn.cross_entropy(x, i)), mesh=mesh).lower(x, labels))
    assert text.count(" = Allocate bool[") == 3, text  # (and labels != -100: torch's ignore_index, the default)


def test_a_primal_is_told_from_the_same_array_closed_over():
    """Inside a traced function, grad of lambda z: sum(x * z) at z = x is x (JAX's new tracer), not
    2x: the primal is a value of its own (a view); sf.vjp the same.  An annotation on that view
    still states the input's layout (a training step's parameters: tests/test_transformer.py)."""
    mesh = mesh_of("1d")
    xs = np.random.default_rng(19).standard_normal((8, 4))
    g = sf.jit(lambda x: sf.grad(lambda z: (x * z).sum())(x), mesh=mesh)(xs)
    np.testing.assert_allclose(np.asarray(g), xs, rtol=1e-15)
    ct = sf.jit(lambda x: sf.vjp(lambda z: x * z, x)[1](x * 0.0 + 1.0)[0], mesh=mesh)(xs)
    np.testing.assert_allclose(np.asarray(ct), xs, rtol=1e-15)
    step = sf.jit(lambda w: w - 0.5 * sf.grad(lambda v: (sf.shard(v, axis=0, over="tp") ** 2).sum())(w), mesh=mesh)
    assert str(step.lower(xs)).startswith("plan <lambda>(w: f64[8:tp, 4])")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_abs_at_zero_has_jax_gradient_and_keeps_its_value(jit, dtype):
    """|x|'s gradient at 0 was 0 (relu(x) + relu(-x)), JAX's is +1 (a probe); -0.0 too.  Its value under
    sf.vjp is NumPy's bit for bit: +0.0 at -0.0, inf, NaN."""
    mesh = sf.DeviceMesh(2)
    x64 = np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, -3.0])
    x = sf.distribute(x64.astype(np_dtype(dtype)), mesh, ("DIDx",))
    ct = sf.distribute(np.arange(1.0, 9.0).astype(np_dtype(dtype)), mesh, ("DIDx",))

    def run(a, c):
        y, back = sf.vjp(lambda b: np.abs(b), a)
        return y, back(c)[0]

    y, g = (sf.jit(run, mesh=mesh) if jit else run)(x, ct)
    want = np.abs(x64).astype(np_dtype(dtype))
    assert np.asarray(y.gather()).tobytes() == want.tobytes()
    np.testing.assert_array_equal(np.asarray(g.gather(), np.float64)[:6], [1.0, 2.0, 3.0, -4.0, 5.0, -6.0])
