"""sf.nn.cross_entropy(logits, labels) with integer labels: the mean over tokens of
-log_softmax(logits)[label], compared with NumPy in float64; with the vocabulary sharded, Megatron's
vocab-parallel cross-entropy: Allreduces of the max (op=max), of the sum of exponentials and of the
target logit, each of [tokens] values, and never a gather of the logits (pinned on the plan).  The
case bodies run on NumPy devices here and under mpiexec (tests/mpi/test_gather_mpi.py)."""
from __future__ import annotations

import ml_dtypes  # noqa: F401 (bfloat16)
import numpy as np
import pytest

import shardfuse as sf
from shardfuse import nn
from test_nn import allreduced_sizes

B, S, V = 2, 4, 16
MESHES = {"1d": ((4,), ("tp",)), "2d": ((2, 2), ("dp", "tp"))}
LAYOUTS = {  # logits [batch, seq, vocab], labels [batch, seq]
    "vocab": ((None, None, "tp"), (None, None)),
    "tokens-dp-vocab-tp": (("dp", None, "tp"), ("dp", None)),
    "replicated": ((None, None, None), (None, None)),
}
TOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 1e-5, "float16": 1e-5}  # (16-bit: computed in float32)


def np_cross_entropy(logits, labels):
    x = logits.astype(np.float64)
    n = x.shape[-1]
    labels = np.clip(np.where(labels < 0, labels + n, labels), 0, n - 1)
    m = x.max(-1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None], -1).mean()


def make(rng, dtype, labels_dtype="int32", out_of_range=True):
    logits = (rng.standard_normal((B, S, V)) * 4).astype(dtype)
    labels = rng.integers(0, V, (B, S)).astype(labels_dtype)
    if out_of_range:
        labels[0, 0], labels[1, 1], labels[1, 2] = -1, 5 * V, -V  # from the end; clamped; the first class
    return logits, labels


def check_cross_entropy(mesh, layout, dtype, rng, jit=True, labels_dtype="int32"):
    names = set(mesh.axis_names)
    fix = lambda spec: tuple(a if a is None or a in names else None for a in spec)  # (a 1-D mesh has no dp)
    logits, labels = make(rng, dtype, labels_dtype)
    x, y = (sf.distribute(a, mesh, fix(spec)) for a, spec in zip((logits, labels), LAYOUTS[layout]))
    got = sf.jit(nn.cross_entropy, mesh=mesh)(x, y) if jit else nn.cross_entropy(x, y)
    assert got.shape == () and got.dtype == ("float32" if dtype in ("bfloat16", "float16") else dtype)
    np.testing.assert_allclose(float(got.gather()), np_cross_entropy(logits, labels), rtol=TOL[dtype])
    return got


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
def test_values_as_numpy(mesh_kind, layout, jit):
    check_cross_entropy(sf.DeviceMesh(*MESHES[mesh_kind]), layout, "float64", np.random.default_rng(0), jit)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("labels_dtype", ["int32", "int64"])
def test_dtypes(dtype, labels_dtype):
    check_cross_entropy(sf.DeviceMesh(*MESHES["2d"]), "tokens-dp-vocab-tp", dtype, np.random.default_rng(1),
                        labels_dtype=labels_dtype)


@pytest.mark.parametrize("mesh_kind,layout,want", [
    ("1d", "vocab", {"allreduce": 2}),  # max; the sum of exponentials and the target logit (one bucket)
    ("2d", "tokens-dp-vocab-tp", {"allreduce": 4}),  # and the mean over dp's tokens
    ("1d", "replicated", {}),
])
def test_vocab_parallel_plan(mesh_kind, layout, want):
    mesh = sf.DeviceMesh(*MESHES[mesh_kind])
    logits, labels = make(np.random.default_rng(2), "float32")
    x, y = (sf.distribute(a, mesh, spec) for a, spec in zip((logits, labels), LAYOUTS[layout]))
    plan = sf.jit(nn.cross_entropy, mesh=mesh).lower(x, y)
    assert plan.collectives() == want, str(plan)  # never an Allgather of the logits
    if want:
        assert str(plan).count("op=max") == 1, str(plan)
        tokens = B * S if mesh_kind == "1d" else B * S // 2
        assert set(allreduced_sizes(plan)) <= {B * S, tokens, 1}, (allreduced_sizes(plan), str(plan))


def test_agrees_with_cross_entropy_onehot():
    mesh = sf.DeviceMesh(4, "tp")
    logits, labels = make(np.random.default_rng(3), "float64", out_of_range=False)
    onehot = np.eye(V)[labels]
    x = sf.distribute(logits, mesh, (None, None, "tp"))
    a = sf.jit(nn.cross_entropy, mesh=mesh)(x, labels)
    b = sf.jit(nn.cross_entropy_onehot, mesh=mesh)(x, sf.distribute(onehot, mesh, (None, None, "tp")))
    np.testing.assert_allclose(float(a.gather()), float(b.gather()), rtol=1e-12)


def test_labels_must_be_integers_of_the_tokens_shape():
    mesh = sf.DeviceMesh(2)
    logits = sf.TensorSpec((B, S, V), "float32")
    with pytest.raises(TypeError, match=r"labels must be an integer array \(int32 or int64\) of class ids, got "
                                        r"labels \(shape \(2, 4\), float32\)"):
        sf.jit(nn.cross_entropy, mesh=mesh).lower(logits, sf.TensorSpec((B, S), "float32"))
    with pytest.raises(ValueError, match=r"labels of shape \(2, 3\) for logits of shape \(2, 4, 16\): one label per "
                                         r"row of logits \(the shape \(2, 4\)\)"):
        sf.jit(nn.cross_entropy, mesh=mesh).lower(logits, sf.TensorSpec((B, 3), "int32"))


def test_numpy_labels_inside_jit_are_a_constant():
    mesh = sf.DeviceMesh(4, "tp")
    logits, labels = make(np.random.default_rng(4), "float64")
    f = sf.jit(lambda x: nn.cross_entropy(sf.shard(x, axis=2), labels), mesh=mesh)
    np.testing.assert_allclose(float(f(logits).gather()), np_cross_entropy(logits, labels), rtol=1e-12)
    assert f.lower(logits).collectives() == {"allreduce": 2}  # (the max; the two sums in one bucket)
