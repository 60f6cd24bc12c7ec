"""What a PyTorch / JAX user porting a nanoGPT training loop tried and found wrong or missing,
each against NumPy in float64 (or torch's autograd in float64) on random inputs, on a dp x tp
mesh with the axes sharded:

- sf.jit of a function returning a tuple of one value returned the bare value (so
  `sf.grad(f, argnums=(0,))` gave an array where JAX gives a 1-tuple, and `(g,) = f(x)` unpacked
  rows of it);
- sf.torch_function took only flat tensors (not a dict of parameters) and failed on bfloat16 results;
- sf.nn.cross_entropy had no ignore_index (torch's padded labels, -100, read as a class);
- np.linalg.norm, np.tril / np.triu, np.moveaxis, x.item() and sf.linear on sf.Arrays were missing;
- then np.einsum, np.tensordot, np.cumsum, np.trunc and np.round(x, decimals) were (their own tests:
  tests/test_einsum.py, tests/test_math_ops.py);
- then, for a Llama script, np.broadcast_to, np.repeat (GQA's repeat_kv), np.tile, np.outer, np.logaddexp,
  x ** y of arrays, x.mT and np.take_along_axis were (tests/test_broadcast_ops.py).

The case bodies are shared with tests/mpi/test_user_port_mpi.py (the sharded axes across ranks).
"""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

DPTP = ((2, 2), ("dp", "tp"))


def mesh_2d():
    return sf.DeviceMesh(*DPTP)


def sharded(x, mesh, spec):
    """x placed with one mesh axis name (or None) per tensor axis."""
    return sf.distribute(x, mesh, spec)


# ---- NumPy functions: name -> (fn on traced values / sf.Arrays, NumPy reference, spec of x) ----------
CASES = {
    "norm all": (lambda x: np.linalg.norm(x), lambda x: np.linalg.norm(x), ("dp", "tp")),
    "norm axis 1": (lambda x: np.linalg.norm(x, axis=1), lambda x: np.linalg.norm(x, axis=1), (None, "tp")),
    "norm axis 0 keepdims": (lambda x: np.linalg.norm(x, axis=0, keepdims=True),
                             lambda x: np.linalg.norm(x, axis=0, keepdims=True), ("dp", None)),
    "norm fro": (lambda x: np.linalg.norm(x, "fro"), lambda x: np.linalg.norm(x, "fro"), ("tp", "dp")),
    "tril": (lambda x: np.tril(x), lambda x: np.tril(x), ("dp", "tp")),
    "tril k=-1": (lambda x: np.tril(x, -1), lambda x: np.tril(x, -1), (None, "tp")),
    "triu k=2": (lambda x: np.triu(x, k=2), lambda x: np.triu(x, k=2), ("tp", None)),
    "moveaxis": (lambda x: np.moveaxis(x, 0, -1), lambda x: np.moveaxis(x, 0, -1), ("dp", "tp")),
    "linear": (lambda x: sf.linear(x, W, B), lambda x: x @ W + B, ("dp", None)),
    "nn.linear": (lambda x: sf.nn.linear(x, W), lambda x: x @ W, (None, "tp")),
    "einsum sh,hd->sd": (lambda x: np.einsum("sh,hd->sd", x, W), lambda x: x @ W, ("dp", "tp")),
    "einsum ij,kj->ik": (lambda x: np.einsum("ij,kj->ik", x, x), lambda x: x @ x.T, ("dp", "tp")),
    "einsum implicit ...j,j": (lambda x: np.einsum("...j,j", x, W[:, 0]), lambda x: x @ W[:, 0], ("tp", "dp")),
    "tensordot": (lambda x: np.tensordot(x, W, 1), lambda x: x @ W, (None, "tp")),
    "tensordot axes=2": (lambda x: np.tensordot(x, x, 2), lambda x: np.tensordot(x, x, 2), ("dp", "tp")),
    "cumsum axis 0": (lambda x: np.cumsum(x, 0), lambda x: np.cumsum(x, 0), ("dp", "tp")),
    "cumsum axis 1": (lambda x: x.cumsum(1), lambda x: np.cumsum(x, 1), ("dp", None)),
    "cumsum flattened": (lambda x: np.cumsum(x), lambda x: np.cumsum(x), ("tp", "dp")),
    "trunc": (lambda x: np.trunc(x * 3.0), lambda x: np.trunc(x * 3.0), ("dp", "tp")),
    "round decimals": (lambda x: np.round(x, 2) + x.round(-1), lambda x: np.round(x, 2) + x.round(-1), ("tp", None)),
    # a Llama port's (tests/test_broadcast_ops.py)
    "repeat_kv": (lambda x: np.repeat(x.reshape(2, 4, 12), 3, axis=1), lambda x: np.repeat(x.reshape(2, 4, 12), 3, 1),
                  ("dp", "tp")),
    "repeat flattened": (lambda x: x.repeat(2), lambda x: x.repeat(2), ("tp", None)),
    "tile": (lambda x: np.tile(x, (2, 1)), lambda x: np.tile(x, (2, 1)), (None, "tp")),
    "broadcast_to": (lambda x: np.broadcast_to(x[:, None], (8, 4, 12)), lambda x: np.broadcast_to(x[:, None], (8, 4, 12)),
                     ("dp", "tp")),
    "outer": (lambda x: np.outer(x[:, 0], x[0]), lambda x: np.outer(x[:, 0], x[0]), ("dp", "tp")),
    "logaddexp": (lambda x: np.logaddexp(x, x.mT[:, :1].mT), lambda x: np.logaddexp(x, x.mT[:, :1].mT),
                  ("dp", "tp")),
    "power of arrays": (lambda x: np.abs(x) ** x[0] + x ** np.round(x), lambda x: np.abs(x) ** x[0] + x ** np.round(x),
                        ("tp", "dp")),
    "mT": (lambda x: x.reshape(2, 4, 12).mT, lambda x: x.reshape(2, 4, 12).mT, ("dp", "tp")),
    "take_along_axis vocab sharded": (lambda x: np.take_along_axis(x, LABELS[:8, None], -1),
                                      lambda x: np.take_along_axis(x, LABELS[:8, None], -1), ("dp", "tp")),
    "take_along_axis axis 0": (lambda x: np.take_along_axis(x, LABELS[None] % 8, 0),
                               lambda x: np.take_along_axis(x, LABELS[None] % 8, 0), ("dp", "tp")),
}
_RNG = np.random.default_rng(11)
W, B = _RNG.standard_normal((12, 6)), _RNG.standard_normal(6)
LABELS = _RNG.integers(-12, 12, 12)


def check(name, mesh, jit, rng):
    fn, ref, spec = CASES[name]
    x = rng.uniform(0.5, 2.0, (8, 12)) * rng.choice([-1.0, 1.0], (8, 12))
    got = sf.jit(fn, mesh=mesh)(sharded(x, mesh, spec)) if jit else fn(sharded(x, mesh, spec))
    want = ref(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_functions(name, jit):
    check(name, mesh_2d(), jit, np.random.default_rng(3))


def test_moveaxis_of_several_axes_and_tril_of_a_batch():
    rng, mesh = np.random.default_rng(4), mesh_2d()
    x = rng.standard_normal((2, 4, 6, 8))
    f = sf.jit(lambda x: (np.moveaxis(sf.shard(x, axis=1, over="tp"), (0, 1), (-1, 1)), np.triu(x, -1)), mesh=mesh)
    moved, upper = f(x)
    np.testing.assert_array_equal(np.asarray(moved), np.moveaxis(x, (0, 1), (-1, 1)))
    np.testing.assert_array_equal(np.asarray(upper), np.triu(x, -1))
    assert f.lower(x).collectives() == {}  # (a transpose and a constant mask: nothing moves)


def test_gradients_of_norm_and_tril():
    rng, mesh = np.random.default_rng(5), mesh_2d()
    x, r = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))

    def loss(x):
        x = sf.shard(sf.shard(x, axis=0, over="dp"), axis=1, over="tp")
        return np.linalg.norm(x) * 3 + (np.tril(x, 1) * r).sum()
    g = sf.jit(sf.grad(loss), mesh=mesh)(x)
    np.testing.assert_allclose(np.asarray(g), 3 * x / np.linalg.norm(x) + np.tril(r, 1), rtol=1e-13, atol=1e-13)


def test_norm_refuses_other_orders():
    with pytest.raises(TypeError, match="ord=1"):
        sf.jit(lambda x: np.linalg.norm(x, 1), mesh=mesh_2d())(np.ones(4))


# ---- a tuple of one result ----------------------------------------------------------------------------
def test_a_one_tuple_result_stays_a_tuple():
    rng, mesh = np.random.default_rng(6), mesh_2d()
    x = rng.standard_normal((4, 6))
    out = sf.jit(lambda x: (x * 2,), mesh=mesh)(x)
    assert isinstance(out, tuple) and len(out) == 1
    np.testing.assert_array_equal(np.asarray(out[0]), x * 2)
    (g,) = sf.jit(sf.grad(lambda x: (x ** 3).sum(), argnums=(0,)), mesh=mesh)(x)  # JAX's: a tuple of one
    np.testing.assert_allclose(np.asarray(g), 3 * x ** 2, rtol=1e-14)
    assert not isinstance(sf.jit(sf.grad(lambda x: (x ** 3).sum()), mesh=mesh)(x), tuple)  # (argnums=0: the array)
    both = sf.jit(lambda x: ((x,), [x + 1]), mesh=mesh)(x)
    assert isinstance(both[0], tuple) and isinstance(both[1], list)


# ---- cross-entropy with ignored labels ---------------------------------------------------------------
def ce_case(rng, vocab=16):
    logits = rng.standard_normal((4, 6, vocab))
    labels = rng.integers(0, vocab, (4, 6))
    labels[rng.random((4, 6)) < 0.3] = -100
    labels[0, 0] = -100
    return logits, labels


def np_ce_ignoring(logits, labels, ignore=-100):
    lse = np.log(np.exp(logits).sum(-1))
    kept = labels != ignore
    target = np.take_along_axis(logits, np.where(kept, labels, 0)[..., None], -1)[..., 0]
    per_token = lse - target
    return (per_token * kept).sum() / kept.sum(), kept


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_cross_entropy_ignore_index_is_torchs(jit):
    rng, mesh = np.random.default_rng(7), mesh_2d()
    logits, labels = ce_case(rng)
    want, kept = np_ce_ignoring(logits, labels)
    x = sharded(logits, mesh, ("dp", None, "tp"))
    if jit:
        got = sf.jit(lambda x, l: sf.nn.cross_entropy(x, l, ignore_index=-100), mesh=mesh)(x, labels)
    else:
        got = sf.nn.cross_entropy(x, sharded(labels, mesh, ("dp", None)), ignore_index=-100)
    np.testing.assert_allclose(float(got), want, rtol=1e-13)
    np.testing.assert_allclose(float(sf.nn.cross_entropy(x, labels)), want, rtol=1e-13)  # (torch's default, -100)
    assert abs(float(sf.nn.cross_entropy(x, labels, ignore_index=None)) - want) > 1e-3  # (none: -100 clamped, a class)


def test_cross_entropy_ignore_index_gradient_matches_torch():
    torch = pytest.importorskip("torch")
    rng, mesh = np.random.default_rng(8), mesh_2d()
    logits, labels = ce_case(rng)
    g = sf.jit(sf.grad(lambda x, l: sf.nn.cross_entropy(sf.shard(x, axis=-1, over="tp"), l, ignore_index=-100)),
               mesh=mesh)(logits, labels)
    t = torch.tensor(logits, requires_grad=True)
    torch.nn.functional.cross_entropy(t.reshape(-1, 16), torch.tensor(labels).reshape(-1)).backward()
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-12, atol=1e-14)


# ---- x.item() -------------------------------------------------------------------------------------------
def test_item_of_a_loss():
    rng, mesh = np.random.default_rng(9), mesh_2d()
    x = rng.standard_normal((8, 6))
    loss = sf.jit(lambda x: (sf.shard(x, axis=0, over="dp") ** 2).mean(), mesh=mesh)(x)
    assert isinstance(loss.item(), float) and loss.item() == pytest.approx((x ** 2).mean(), rel=1e-14)
    assert sharded(np.arange(1, 2), mesh, (None,)).item() == 1
    with pytest.raises(ValueError, match="size 1"):
        sharded(x, mesh, ("dp", None)).item()


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_cross_entropy_reductions_are_torchs(jit):
    """reduction="none" (per token, 0 where ignored: a JAX-port probe wanted optax's per-token loss) and
    "sum", with ignore_index, the vocabulary sharded over tp; their gradients too."""
    rng, mesh = np.random.default_rng(17), mesh_2d()
    logits, labels = ce_case(rng)
    _, kept = np_ce_ignoring(logits, labels)
    lse = np.log(np.exp(logits).sum(-1))
    per_token = (lse - np.take_along_axis(logits, np.where(kept, labels, 0)[..., None], -1)[..., 0]) * kept
    x = sharded(logits, mesh, ("dp", None, "tp"))
    for reduction, want in (("none", per_token), ("sum", per_token.sum())):
        def ce(v, ls, r=reduction):
            return sf.nn.cross_entropy(v, ls, ignore_index=-100, reduction=r)
        got = sf.jit(ce, mesh=mesh)(x, labels) if jit else ce(x, sharded(labels, mesh, ("dp", None)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-15)
    w = rng.standard_normal(labels.shape)  # (a per-token weighting of the "none" loss, differentiated)
    g = sf.jit(sf.grad(lambda v, ls: (sf.nn.cross_entropy(v, ls, ignore_index=-100, reduction="none") * w).sum()),
               mesh=mesh)(x, labels)
    soft = np.exp(logits - lse[..., None])
    onehot = np.eye(logits.shape[-1])[np.where(kept, labels, 0)]
    np.testing.assert_allclose(np.asarray(g), (soft - onehot) * (w * kept)[..., None], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="reduction must be"):
        sf.nn.cross_entropy(x, labels, reduction="average")
