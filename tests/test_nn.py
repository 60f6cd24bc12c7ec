"""Issue 31, item 6: sf.nn (softmax, log_softmax, layer_norm, rms_norm, gelu, silu, linear, attention,
cross_entropy_onehot) inside sf.jit and on sf.Arrays outside it, on a 1-D mesh of 4 (`tp`) and a 2x2
mesh (`dp` x `tp`), inputs replicated and sharded as Megatron shards them (tokens / batch over dp,
hidden / heads / vocabulary over tp), against float64 NumPy references on random inputs (never
zeros), in float64, float32 and bfloat16; and a pre-norm transformer block (params as a dict)
with its collectives pinned: one Allreduce after the attention's output projection and one after
the MLP's second GEMM.

The case bodies (CASES, check_case, BLOCK, check_block) are shared: tests/mpi/test_nn_mpi.py runs
them under mpiexec.
"""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import shardfuse as sf
from shardfuse import array_ops
from shardfuse.dtypes import np_dtype

nn = sf.nn
TOL = {"bfloat16": 2e-2, "float32": 5e-5, "float64": 1e-12}
T, E, V = 8, 16, 16  # tokens, hidden, vocabulary
B, H, S, D = 2, 4, 8, 8  # batch, heads, sequence, head_dim


# ---- float64 NumPy references -------------------------------------------------------------------
def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_log_softmax(x, axis=-1):
    s = x - x.max(axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis, keepdims=True))


def np_layer_norm(x, w, b, eps=1e-5):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def np_rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_gelu(x):  # the tanh form (GPT-2, Megatron; sf.gelu)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def np_attention(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    return np_softmax(s) @ v


def np_cross_entropy(logits, onehot):
    return -(onehot * np_log_softmax(logits)).sum(-1).mean()


# ---- inputs and placements ----------------------------------------------------------------------
def signed(rng, shape, lo=0.25, hi=2.0):
    """Random values of magnitude in [lo, hi), either sign: never zero."""
    return rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)


def rows(rng, *extra):  # x [tokens, hidden], then [hidden] vectors (a weight near 1, a bias)
    out = [signed(rng, (T, E))]
    for what in extra:
        out.append(rng.uniform(0.5, 1.5, E) if what == "w" else signed(rng, E, 0.05, 0.5))
    return out


def qkv(rng, mask=None):
    out = [signed(rng, (B, H, S, D)) for _ in range(3)]
    if mask == "bool":  # random, and every row attends to its own position at least
        out.append((rng.random((S, S)) < 0.5) | np.eye(S, dtype=bool))
    elif mask == "additive":
        out.append(signed(rng, (S, S), 0.1, 3.0))
    return out


def onehot_targets(rng):
    return [signed(rng, (T, V), 0.25, 4.0), np.eye(V)[rng.integers(0, V, T)]]


# layout name -> the spec (one mesh axis, a tuple of them, or None per tensor axis) of the first input
ROW_LAYOUTS = {"1d": {"R": (None, None), "tokens": ("tp", None), "hidden": (None, "tp")},
               "2d": {"R": (None, None), "tokens": ("dp", None), "hidden": (None, "tp"),
                      "tokens+hidden": ("dp", "tp"), "tokens over (dp,tp)": (("dp", "tp"), None)}}
HEAD_LAYOUTS = {"1d": {"R": (None,) * 4, "heads": (None, "tp", None, None)},
                "2d": {"R": (None,) * 4, "heads": (None, "tp", None, None), "batch+heads": ("dp", "tp", None, None)}}


def _vectors(spec, n):  # [hidden] vectors follow x's hidden axis
    return [spec] + [(spec[1],)] * n


def _same(spec, n, extra=0):  # q, k, v alike; a mask replicated
    return [spec] * n + [(None, None)] * extra


# name -> (the sf.nn call, its float64 reference, inputs(rng), specs(first spec), layouts, runs on sf.Arrays)
CASES = {
    "softmax": (lambda x: nn.softmax(x), np_softmax, lambda r: rows(r), lambda s: [s], ROW_LAYOUTS, True),
    "softmax axis=0": (lambda x: nn.softmax(x, axis=0), lambda x: np_softmax(x, 0), lambda r: rows(r),
                       lambda s: [s], ROW_LAYOUTS, True),
    "log_softmax": (lambda x: nn.log_softmax(x), np_log_softmax, lambda r: rows(r), lambda s: [s], ROW_LAYOUTS, True),
    "layer_norm": (lambda x, w, b: nn.layer_norm(x, w, b), np_layer_norm, lambda r: rows(r, "w", "b"),
                   lambda s: _vectors(s, 2), ROW_LAYOUTS, True),
    "layer_norm no affine": (lambda x: nn.layer_norm(x, None, None, eps=1e-3),
                             lambda x: np_layer_norm(x, None, None, eps=1e-3), lambda r: rows(r), lambda s: [s],
                             ROW_LAYOUTS, True),
    "rms_norm": (lambda x, w: nn.rms_norm(x, w), np_rms_norm, lambda r: rows(r, "w"), lambda s: _vectors(s, 1),
                 ROW_LAYOUTS, True),
    "gelu": (lambda x: nn.gelu(x), np_gelu, lambda r: rows(r), lambda s: [s], ROW_LAYOUTS, True),
    "silu": (lambda x: nn.silu(x), lambda x: x / (1 + np.exp(-x)), lambda r: rows(r), lambda s: [s], ROW_LAYOUTS,
             True),
    "linear": (lambda x, w, b: nn.linear(x, w, b), lambda x, w, b: x @ w + b,
               lambda r: [signed(r, (T, E)), signed(r, (E, 12)), signed(r, 12)],
               lambda s: [s, (s[1], None), (None,)], ROW_LAYOUTS, True),
    "cross_entropy_onehot": (lambda x, t: nn.cross_entropy_onehot(x, t), np_cross_entropy, onehot_targets,
                             lambda s: [s, s], ROW_LAYOUTS, True),
    "attention": (lambda q, k, v: nn.attention(q, k, v), np_attention, qkv, lambda s: _same(s, 3), HEAD_LAYOUTS,
                  True),
    "attention bool mask": (lambda q, k, v, m: nn.attention(q, k, v, mask=m), np_attention,
                            lambda r: qkv(r, "bool"), lambda s: _same(s, 3, 1), HEAD_LAYOUTS, True),
    "attention additive mask": (lambda q, k, v, m: nn.attention(q, k, v, mask=m), np_attention,
                                lambda r: qkv(r, "additive"), lambda s: _same(s, 3, 1), HEAD_LAYOUTS, True),
}
# (case, layout) pairs whose plan must communicate nothing: the axis reduced is never sharded
LOCAL = {(c, lay) for c in ("softmax", "log_softmax", "layer_norm", "layer_norm no affine", "rms_norm", "gelu",
                            "silu") for lay in ("R", "tokens", "tokens over (dp,tp)")}
LOCAL |= {(c, lay) for c in ("gelu", "silu") for lay in ("hidden", "tokens+hidden")}
LOCAL |= {(c, lay) for c in ("attention", "attention bool mask", "attention additive mask")
          for lay in ("R", "heads", "batch+heads")}
LOCAL |= {("softmax axis=0", "hidden"), ("linear", "R"), ("linear", "tokens")}


def mesh_kind(mesh):
    return "1d" if len(mesh.shape) == 1 else "2d"


def layouts_of(name, kind):
    return sorted(CASES[name][4][kind])


def check_case(name, mesh, layout, dtype, jit, rng):
    """CASES[name] on inputs placed with `layout`, in sf.jit or on sf.Arrays: values (against the
    float64 reference of the same rounded inputs), dtype, and no communication where LOCAL says."""
    fn, ref, make, specs, layouts, eager = CASES[name]
    assert jit or eager, f"{name} runs inside sf.jit only"
    inputs = [v.astype(np_dtype(dtype)) if v.dtype == np.float64 else v for v in make(rng)]
    placed = [sf.distribute(v, mesh, spec) for v, spec in zip(inputs, specs(layouts[mesh_kind(mesh)][layout]))]
    if jit:
        f = sf.jit(fn, mesh=mesh)
        counts = f.lower(*placed).collectives()
        print(f"{name} [{layout}, {mesh_kind(mesh)}, {dtype}]: {counts}")
        if (name, layout) in LOCAL:
            assert counts == {}, (name, layout, counts)
        got = f(*placed)
    else:
        got = fn(*placed)
    want = ref(*(v.astype(np.float64) if v.dtype != bool else v for v in inputs))
    widened = dtype == "bfloat16" and name == "cross_entropy_onehot"  # (a loss of 16-bit logits is float32)
    assert got.dtype == np.dtype("float32" if widened else np_dtype(dtype)), (name, got.dtype)
    assert got.shape == np.shape(want), (name, got.shape, np.shape(want))
    np.testing.assert_allclose(np.asarray(got.gather(), np.float64), want, rtol=TOL[dtype], atol=TOL[dtype],
                               err_msg=f"{name} [{layout}, {dtype}, {'jit' if jit else 'eager'}]")


_MESHES: dict = {}


def mesh_of(kind):
    if kind not in _MESHES:
        _MESHES[kind] = (sf.DeviceMesh((4,), ("tp",), backend="numpy") if kind == "1d"
                         else sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy"))
    return _MESHES[kind]


ALL = [(name, kind, lay, jit) for name in CASES for kind in ("1d", "2d") for lay in layouts_of(name, kind)
       for jit in (True, False) if jit or CASES[name][5]]


@pytest.mark.parametrize("name, kind, layout, jit", ALL,
                         ids=[f"{n}-{k}-{lay}-{'jit' if j else 'eager'}" for n, k, lay, j in ALL])
def test_float64_every_layout(name, kind, layout, jit):
    check_case(name, mesh_of(kind), layout, "float64", jit, np.random.default_rng(0))


SHARDED = {"1d": "hidden", "2d": "tokens+hidden"}  # the reduced axis sharded: the hardest layout
HEADS = {"1d": "heads", "2d": "batch+heads"}


def _sharded(name, kind):
    return (HEADS if CASES[name][4] is HEAD_LAYOUTS else SHARDED)[kind]


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_float32(name, kind):
    check_case(name, mesh_of(kind), _sharded(name, kind), "float32", True, np.random.default_rng(1))


BF16_CASES = ["softmax", "log_softmax", "layer_norm", "rms_norm", "attention", "cross_entropy_onehot"]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("name", BF16_CASES)
def test_bfloat16_normalised_in_float32(name, kind, jit):
    check_case(name, mesh_of(kind), _sharded(name, kind), "bfloat16", jit, np.random.default_rng(2))


def test_bfloat16_softmax_runs_in_float32_and_casts_back():
    f = sf.jit(lambda x: nn.softmax(x), mesh=mesh_of("1d"))
    text = str(f.lower(sf.TensorSpec((T, E), "bfloat16")))
    assert ("Astype" in text or "astype(" in text) and ("f32[" in text or "FusedRows" in text) and text.splitlines()[0].endswith(f"bf16[{T}, {E}])"), text
    assert ml_dtypes.bfloat16 == f(np.ones((T, E), ml_dtypes.bfloat16)).dtype


# ---- collectives where the reduced axis is sharded ----------------------------------------------
# (case, mesh kind) -> plan.collectives() with the hidden / vocabulary axis sharded over tp (tokens
# over dp too on the 2x2 mesh).  Every Allreduce is of [tokens]-sized values (check_small_allreduces);
# the Allgather is max's: max over a sharded axis gathers that axis until it reduces with an
# Allreduce-max (a known gap, issue 31 item 2; then the gathers go and these pins change).
SHARDED_COLLECTIVES = {
    # the max (an Allreduce with op=max) and the sum of exponentials
    ("softmax", "1d"): {"allreduce": 2}, ("softmax", "2d"): {"allreduce": 2},
    ("log_softmax", "1d"): {"allreduce": 2}, ("log_softmax", "2d"): {"allreduce": 2},
    ("layer_norm", "1d"): {"allreduce": 2}, ("layer_norm", "2d"): {"allreduce": 2},  # mean and variance
    ("rms_norm", "1d"): {"allreduce": 1}, ("rms_norm", "2d"): {"allreduce": 1},
    # the sum of exponentials and the target logit over tp, and on the 2x2 mesh the mean over dp's tokens
    # (on the 1-D mesh the two sums share one bucket: the loss's mean, their only reader, goes after them)
    ("cross_entropy_onehot", "1d"): {"allreduce": 2},
    ("cross_entropy_onehot", "2d"): {"allreduce": 4},
}


def lowered(name, kind, dtype="float64"):
    fn, _, make, specs, layouts, _ = CASES[name]
    mesh = mesh_of(kind)
    args = [sf.distribute(v, mesh, s) for v, s in zip(make(np.random.default_rng(0)), specs(layouts[kind][SHARDED[kind]]))]
    return sf.jit(fn, mesh=mesh).lower(*args)


def allreduced_sizes(plan) -> list:
    """The global element count of every Allreduce's result, read from the plan's Allocate lines; of a
    bucketed one (several values in one buffer), each member's, read from its box of the bucket."""
    text = str(plan)
    sizes = []
    for out, src in re.findall(r"= Allreduce (\w+) <- (\w+)", text):
        members = re.findall(rf"\w+_box: \w+\[(\d+)\][^=]*= SliceArray {src}, begin", text)
        if members:
            sizes += [int(n) for n in members]
            continue
        shape = re.search(rf"\b{out} = Allocate \w+\[([^\]]*)\]", text).group(1)
        sizes.append(math.prod(int(s.split(":")[0]) for s in shape.split(", ") if s) if shape else 1)
    return sizes


@pytest.mark.parametrize("case", sorted(SHARDED_COLLECTIVES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_collectives_with_the_reduced_axis_sharded(case):
    plan = lowered(*case)
    assert plan.collectives() == SHARDED_COLLECTIVES[case], (case, plan.collectives(), str(plan))
    # each Allreduce carries one value per token (or the 0-d loss), never a [tokens, hidden] array
    assert set(allreduced_sizes(plan)) <= {T, 1}, (case, allreduced_sizes(plan), str(plan))


def test_cross_entropy_vocab_parallel_never_gathers_the_logits():
    plan = lowered("cross_entropy_onehot", "1d")
    assert "allgather" not in plan.collectives(), str(plan)
    assert "op=max" in str(plan), str(plan)  # the max of the logits: an Allreduce with max


def test_attention_with_heads_sharded_communicates_nothing():
    """The heads axis annotated inside sf.jit (the module's example); inputs come replicated."""
    mesh = mesh_of("2d")

    @sf.jit(mesh=mesh)
    def attend(q, k, v, mask):
        q, k, v = (sf.shard(sf.shard(t, axis=0, over="dp"), axis=1, over="tp") for t in (q, k, v))
        return nn.attention(q, k, v, mask=mask)

    q, k, v, mask = qkv(np.random.default_rng(3), "bool")
    plan = attend.lower(q, k, v, mask)
    assert plan.collectives() == {}, str(plan)
    out = attend(q, k, v, mask)
    assert out.placements == (sf.Shard(0), sf.Shard(1))
    np.testing.assert_allclose(out.gather(), np_attention(q, k, v, mask), rtol=1e-12, atol=1e-12)


# ---- causal attention, masks, errors ------------------------------------------------------------
def test_causal_outside_jit_and_the_mask_argument_inside_agree():
    mesh = mesh_of("1d")
    q, k, v = (sf.distribute(t, mesh, HEAD_LAYOUTS["1d"]["heads"]) for t in qkv(np.random.default_rng(4)))
    tril = np.tril(np.ones((S, S), bool))
    want = np_attention(*(t.gather() for t in (q, k, v)), tril)
    np.testing.assert_allclose(nn.attention(q, k, v, causal=True).gather(), want, rtol=1e-12, atol=1e-12)
    inside = sf.jit(lambda q, k, v, m: nn.attention(q, k, v, mask=m), mesh=mesh)(q, k, v, tril)
    np.testing.assert_allclose(inside.gather(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_causal_inside_jit_is_a_constant_mask(kind):
    """causal=True inside sf.jit: the np.tril mask is a constant of the program (printed), heads
    sharded still communicate nothing, and the values are the float64 reference's."""
    mesh = mesh_of(kind)
    q, k, v = (sf.distribute(t, mesh, HEAD_LAYOUTS[kind]["heads"]) for t in qkv(np.random.default_rng(5)))
    f = sf.jit(lambda q, k, v: nn.attention(q, k, v, causal=True), mesh=mesh)
    plan = f.lower(q, k, v)
    assert "# constants: const " in str(plan) and "const: bool[8, 8]" in str(plan), str(plan)
    assert plan.collectives() == {}, str(plan)
    want = np_attention(*(t.gather() for t in (q, k, v)), np.tril(np.ones((S, S), bool)))
    np.testing.assert_allclose(f(q, k, v).gather(), want, rtol=1e-12, atol=1e-12)


def test_a_numpy_mask_closed_over_inside_jit_is_a_constant():
    tril = np.tril(np.ones((S, S), bool))
    tril[3, 0] = False  # (not the causal mask: this one is what the program must use)
    q, k, v = qkv(np.random.default_rng(5))
    f = sf.jit(lambda q, k, v: nn.attention(q, k, v, mask=tril), mesh=mesh_of("1d"))
    np.testing.assert_allclose(f(q, k, v).gather(), np_attention(q, k, v, tril), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_causal_and_a_mask_together_both_apply(jit):
    """jax.nn.dot_product_attention's is_causal with a mask (a padding mask: a JAX-port probe met a refusal):
    a boolean mask and'ed with the causal one, a float mask (a bias) kept below the diagonal."""
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng)
    pad = np.ones((B, 1, 1, S), bool)
    pad[1, :, :, 5:] = False  # (sequence 1's last three positions are padding)
    bias = rng.standard_normal((1, H, S, S))
    tril = np.tril(np.ones((S, S), bool))
    for mask, want in ((pad, np_attention(q, k, v, pad & tril)),
                       (bias, np_attention(q, k, v, np.where(tril, bias, -1e300)))):
        run = sf.jit(lambda q, k, v, m: nn.attention(q, k, v, causal=True, mask=m), mesh=mesh_of("1d")) if jit else \
            (lambda *a: nn.attention(*(sf.replicate(t, mesh=mesh_of("1d")) for t in a[:3]), causal=True, mask=a[3]))
        np.testing.assert_allclose(np.asarray(run(q, k, v, mask).gather()), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_a_row_with_nothing_to_attend_to_is_uniform_not_nan(dtype):
    q, k, v = (t.astype(np_dtype(dtype)) for t in qkv(np.random.default_rng(7)))
    mask = np.tril(np.ones((S, S), bool))
    mask[3] = False
    got = sf.jit(lambda q, k, v, m: nn.attention(q, k, v, mask=m), mesh=mesh_of("1d"))(q, k, v, mask).gather()
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:, :, 3], v.astype(np.float64).mean(-2), rtol=TOL[dtype], atol=TOL[dtype])


def test_outside_jit_each_call_is_one_plan():
    x = sf.distribute(signed(np.random.default_rng(8), (T, 24)), mesh_of("1d"), ("tp", None))
    before = array_ops.cache_info()["compiled"]
    nn.layer_norm(x, np.ones(24), np.zeros(24))  # plain arrays beside an sf.Array: replicated
    assert array_ops.cache_info()["compiled"] == before + 1
    nn.layer_norm(x, np.ones(24), np.zeros(24))
    assert array_ops.cache_info()["compiled"] == before + 1  # compiled once, kept on the mesh


def test_plain_arrays_alone_are_refused_with_what_to_pass():
    with pytest.raises(TypeError, match="inside an sf.jit function or sf.Arrays"):
        nn.softmax(np.ones((2, 3)))


def test_re_exports():
    assert (nn.gelu, nn.silu, nn.linear) == (sf.gelu, sf.silu, sf.linear)
    assert set(nn.__all__) <= set(dir(nn))


# ---- a pre-norm transformer block, Megatron's tensor parallelism -----------------------------------
BLOCK_HEADS = 4


def block_params(rng, hidden=E):
    """The block's parameters as one dict (a pytree): QKV and the MLP's first GEMM column-parallel,
    the output projection and the MLP's second GEMM row-parallel (block() shards them)."""
    p = {n: signed(rng, s, 0.1, 1.0) / np.sqrt(s[0]) for n, s in (
        ("wq", (hidden, hidden)), ("wk", (hidden, hidden)), ("wv", (hidden, hidden)), ("wo", (hidden, hidden)),
        ("w1", (hidden, 4 * hidden)), ("w2", (4 * hidden, hidden)))}
    p.update({n: signed(rng, s, 0.05, 0.5) for n, s in (
        ("bq", hidden), ("bk", hidden), ("bv", hidden), ("bo", hidden), ("b1", 4 * hidden), ("b2", hidden))})
    p.update({n: rng.uniform(0.5, 1.5, hidden) for n in ("ln1_w", "ln2_w")})
    p.update({n: signed(rng, hidden, 0.05, 0.5) for n in ("ln1_b", "ln2_b")})
    return p


def transformer_block(mesh, tp="tp", dp=None):
    """x [batch, seq, hidden] -> the same: x + attn(ln1(x)), then + mlp(ln2(.)); batch over dp."""
    def block(params, x, mask):
        p = dict(params)
        for n in ("wq", "wk", "wv", "w1"):  # column-parallel: output features (heads) over tp
            p[n], p["b" + n[1]] = sf.shard(p[n], axis=1, over=tp), sf.shard(p["b" + n[1]], axis=0, over=tp)
        p["wo"], p["w2"] = sf.shard(p["wo"], axis=0, over=tp), sf.shard(p["w2"], axis=0, over=tp)  # row-parallel
        x = sf.shard(x, axis=0, over=dp) if dp else x
        b, s, e = x.shape

        def heads(t):  # [b, s, e] -> [b, heads, s, e / heads]: heads stay sharded over tp
            return t.reshape(b, s, BLOCK_HEADS, e // BLOCK_HEADS).transpose(0, 2, 1, 3)

        h = nn.layer_norm(x, p["ln1_w"], p["ln1_b"])
        q, k, v = (heads(nn.linear(h, p["w" + n], p["b" + n])) for n in "qkv")
        a = nn.attention(q, k, v, mask=mask).transpose(0, 2, 1, 3).reshape(b, s, e)
        x = x + nn.linear(a, p["wo"], p["bo"])  # partial sums over tp: one Allreduce
        h = nn.layer_norm(x, p["ln2_w"], p["ln2_b"])
        return x + nn.linear(nn.gelu(nn.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])  # and one more

    return sf.jit(block, mesh=mesh)


def np_block(p, x, mask):
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    b, s, e = x.shape

    def heads(t):
        return t.reshape(b, s, BLOCK_HEADS, e // BLOCK_HEADS).transpose(0, 2, 1, 3)

    h = np_layer_norm(x, p["ln1_w"], p["ln1_b"])
    q, k, v = (heads(h @ p["w" + n] + p["b" + n]) for n in "qkv")
    x = x + np_attention(q, k, v, mask).transpose(0, 2, 1, 3).reshape(b, s, e) @ p["wo"] + p["bo"]
    h = np_layer_norm(x, p["ln2_w"], p["ln2_b"])
    return x + np_gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def check_block(mesh, dtype, rng):
    """The block on `mesh` (tp its last axis; a 2-D mesh's first is dp) against np_block: its plan
    has the Megatron pattern, one Allreduce after each row-parallel GEMM and nothing else."""
    dp = mesh.axis_names[0] if len(mesh.shape) == 2 else None
    f = transformer_block(mesh, tp=mesh.axis_names[-1], dp=dp)
    params = {k: v.astype(np_dtype(dtype)) for k, v in block_params(rng).items()}
    x = signed(rng, (2, S, E)).astype(np_dtype(dtype))
    mask = np.tril(np.ones((S, S), bool))  # causal, passed as an argument (not captured inside sf.jit)
    plan = f.lower(params, x, mask)
    print(f"transformer block [{mesh}, {dtype}]: {plan.collectives()}")
    assert plan.collectives() == {"allreduce": 2}, str(plan)
    text = str(plan)
    for w in ("params_wo", "params_w2"):  # each Allreduce resolves the partial sums of a row-parallel GEMM
        out = re.search(rf"Matmul (\w+) <- \w+ @ {w}\b", text).group(1)
        assert re.search(rf"= Allreduce \w+ <- {out}, team={mesh.axis_names[-1]}\b", text), (w, text)
    got = f(params, x, mask)
    want = np_block({k: v.astype(np.float64) for k, v in params.items()}, x.astype(np.float64), mask)
    assert got.dtype == np.dtype(np_dtype(dtype))
    np.testing.assert_allclose(np.asarray(got.gather(), np.float64), want, rtol=TOL[dtype], atol=TOL[dtype])
    return plan


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_transformer_block(kind, dtype):
    plan = check_block(mesh_of(kind), dtype, np.random.default_rng(9))
    if kind == "2d":  # batch stays sharded over dp from input to output: dp never communicates
        assert "team=dp" not in str(plan) and str(plan).splitlines()[0].endswith(f"f{dtype[-2:]}[2:dp, {S}, {E}])")


def test_attention_takes_a_scale_and_a_decode_steps_mask():
    """scale= (jax.nn.dot_product_attention's) replaces 1 / sqrt(head_dim); a decode step's queries, the
    last of the cached positions, attend with the bottom-right causal mask the docstring gives."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    q, k, v = r.standard_normal((1, 2, 2, 4)), r.standard_normal((1, 2, 5, 4)), r.standard_normal((1, 2, 5, 4))
    mask = np.tril(np.ones((2, 5), bool), k=5 - 2)

    def ref(scale):
        s = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v
    got = sf.jit(lambda q, k, v: sf.nn.attention(q, k, v, mask=mask, scale=0.3), mesh=mesh)(q, k, v)
    np.testing.assert_allclose(np.asarray(got), ref(0.3), rtol=1e-12)
    got = sf.jit(lambda q, k, v: sf.nn.attention(q, k, v, mask=mask), mesh=mesh)(q, k, v)
    np.testing.assert_allclose(np.asarray(got), ref(0.5), rtol=1e-12)


def test_grouped_query_attention_reads_kv_head_n_over_g():
    """k and v with fewer heads than q (a divisor): query head n reads kv head n // G, as
    jax.nn.dot_product_attention and torch's enable_gqa (a Llama probe: it was a broadcast error
    naming an internal value).  With heads sharded over tp no collective; the gradient of k and v
    sums over each group; a count that does not divide is refused naming both."""
    mesh = mesh_of("2d")
    r = np.random.default_rng()
    q, k, v = r.standard_normal((2, 4, 6, 8)), r.standard_normal((2, 2, 6, 8)), r.standard_normal((2, 2, 6, 8))

    def ref(q, k, v):
        k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        s = np.where(np.tril(np.ones((6, 6), bool)), q @ k.swapaxes(-1, -2) / np.sqrt(8), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v

    def attend(q, k, v):
        return nn.attention(*(sf.shard(t, axis=1, over="tp") for t in (q, k, v)), causal=True)
    f = sf.jit(attend, mesh=mesh)
    assert f.lower(q, k, v).collectives() == {}
    np.testing.assert_allclose(np.asarray(f(q, k, v)), ref(q, k, v), rtol=1e-12, atol=1e-12)
    c = r.standard_normal((2, 4, 6, 8))
    dk = sf.jit(sf.grad(lambda q, k, v: (attend(q, k, v) * c).sum(), argnums=1), mesh=mesh)(q, k, v)
    e, i = 1e-6, (1, 1, 3, 5)  # (central difference at one element of k)
    kp, km = k.copy(), k.copy()
    kp[i] += e
    km[i] -= e
    np.testing.assert_allclose(np.asarray(dk)[i], ((ref(q, kp, v) * c).sum() - (ref(q, km, v) * c).sum()) / (2 * e),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="q has 4 heads .* k 3 and v 3"):
        sf.jit(lambda q, k: nn.attention(q, k, k), mesh=mesh)(q, r.standard_normal((2, 3, 6, 8)))
    # no copy of k or v: q's heads viewed as [kv heads, G] (a review: repeating them copied each G times)
    assert not [line for line in str(f.lower(q, k, v)).splitlines() if "Fused " in line or "Copy " in line]


@pytest.mark.parametrize("kv_heads, mask_heads", [(2, 4), (2, 1), (1, None), (1, 4)])
def test_grouped_and_multi_query_attention_with_masks_per_head(kv_heads, mask_heads):
    """A mask per head ([batch, heads, seq, seq]) or broadcast over heads ([batch, 1, ...]) meets the
    grouped scores as it met the ungrouped ones; one kv head (multi-query) broadcasts as it is."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    r = np.random.default_rng()
    q, k, v = r.standard_normal((2, 4, 5, 8)), r.standard_normal((2, kv_heads, 5, 8)), r.standard_normal((2, kv_heads, 5, 8))
    mask = None if mask_heads is None else r.random((2, mask_heads, 5, 5)) < 0.7
    if mask is not None:
        mask[..., 0] = True  # (every row attends somewhere)
    g = 4 // kv_heads
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ kk.swapaxes(-1, -2) / np.sqrt(8)
    s = s if mask is None else np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv
    got = sf.jit(lambda q, k, v: nn.attention(q, k, v, mask=mask), mesh=mesh)(q, k, v)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_a_mask_given_where_causal_goes_says_to_pass_it_by_keyword():
    """A JAX-port probe: attention(q, k, v, mask) read the mask as causal= and failed on its truth value."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    q = np.ones((1, 2, 3, 4))
    with pytest.raises(TypeError, match="causal takes True or False, got ndarray; pass a mask by keyword"):
        sf.jit(lambda q: nn.attention(q, q, q, np.ones((3, 3), bool)), mesh=mesh)(q)


def test_attention_names_shapes_that_do_not_fit():
    """A serving probe: a KV cache of another length than the mask met "where_then of g_r_r and s_5:
    shapes ... do not broadcast" from inside; the shapes are checked where attention is called."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    q, k = np.ones((2, 4, 1, 8)), np.ones((2, 2, 16, 8))
    attend = sf.jit(lambda q, k, v, m: sf.nn.attention(q, k, v, mask=m), mesh=mesh)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 1, 12\) does not broadcast against the scores "
                                         r"\(2, 4, 1, 16\)"):
        attend(q, k, k, np.ones((2, 1, 1, 12), bool))
    with pytest.raises(ValueError, match=r"k needs q's head_dim \(axis -1\), v k's seq"):
        attend(q, np.ones((2, 2, 16, 4)), k, np.ones((1, 16), bool))
    with pytest.raises(ValueError, match="must broadcast together"):  # (a review: the chained != let v's pass)
        attend(q, k, np.ones((3, 2, 16, 8)), np.ones((1, 16), bool))
    with pytest.raises(ValueError, match="at least 2 axes"):
        attend(q, k[0, 0, 0], k[0, 0, 0], np.ones((1, 16), bool))
    # (batch axes broadcast, as torch's SDPA: k and v of one sequence, or with no batch axis, for every q)
    np.testing.assert_allclose(np.asarray(attend(q, k[:1], k[:1], np.ones((1, 16), bool))), np.ones((2, 4, 1, 8)),
                               rtol=1e-14)
    np.testing.assert_allclose(np.asarray(attend(q[:, :2], k[0], k[0], np.ones((1, 16), bool))),
                               np.ones((2, 2, 1, 8)), rtol=1e-14)
    out = attend(q, k, k, np.ones((2, 1, 1, 16), bool))  # (a mask per sequence: broadcast over heads and queries)
    np.testing.assert_allclose(np.asarray(out), np.ones((2, 4, 1, 8)), rtol=1e-14)


def test_integer_and_boolean_inputs_give_floats():
    """A probe: sf.nn.softmax / log_softmax / logsumexp / layer_norm / rms_norm of integers or booleans
    were truncated back to them ([[0 0 0] [0 0 1]]); float64 as np.exp of them, against NumPy."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    i = np.array([[1, 2, 3, 4], [0, 0, 700, 1]])
    f = i.astype(np.float64)
    e = np.exp(f - f.max(1, keepdims=True))
    d = f - f.mean(-1, keepdims=True)
    want = {"softmax": e / e.sum(1, keepdims=True), "log_softmax": np.log(e / e.sum(1, keepdims=True)),
            "logsumexp": np.log(e.sum(1)) + f.max(1), "layer_norm": d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5),
            "rms_norm": f / np.sqrt((f * f).mean(-1, keepdims=True) + 1e-6)}
    calls = {"softmax": lambda a: sf.nn.softmax(a, axis=1), "log_softmax": lambda a: sf.nn.log_softmax(a, axis=1),
             "logsumexp": lambda a: sf.nn.logsumexp(a, axis=1), "layer_norm": lambda a: sf.nn.layer_norm(a, None, None),
             "rms_norm": lambda a: sf.nn.rms_norm(a, None)}
    for name, call in calls.items():
        for x in (i, i.astype(np.int32)):
            got = sf.jit(call, mesh=mesh)(x)
            assert got.dtype == np.float64, name
            np.testing.assert_allclose(np.asarray(got), want[name], rtol=1e-12, err_msg=name)
        assert sf.jit(call, mesh=mesh)(i > 1).dtype == np.float64


def test_softmax_and_log_softmax_where_leave_elements_out():
    """jax.nn.softmax / log_softmax's where=: left-out elements count for nothing and are 0 (-inf for
    log_softmax), a row left wholly out is 0; vocabulary sharded, on sf.Arrays, gradients by central
    differences (a serving probe's softmax(x, where=m) was refused without the function's name)."""
    from cases import directional
    r = np.random.default_rng()
    x, mask = r.standard_normal((3, 8)), r.random((3, 8)) > 0.4
    mask[0, :2], mask[2] = True, False

    def ref(x):
        top = np.where(mask, x, -np.inf).max(-1, keepdims=True)
        e = np.where(mask, np.exp(x - np.where(np.isfinite(top), top, 0)), 0)
        return np.where(mask, e / np.maximum(e.sum(-1, keepdims=True), 1e-300), 0)
    mesh = sf.DeviceMesh(2, backend="numpy")
    got = sf.jit(lambda x, m: (nn.softmax(sf.shard(x, axis=1), where=m), nn.log_softmax(x, where=m)), mesh=mesh)(x, mask)
    np.testing.assert_allclose(np.asarray(got[0]), ref(x), rtol=1e-12, atol=1e-15)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(np.asarray(got[1]), np.log(ref(x)), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(nn.softmax(sf.replicate(x, mesh=mesh), where=mask)), ref(x), rtol=1e-12)
    w = r.standard_normal(x.shape)
    g = sf.jit(sf.grad(lambda x: (nn.softmax(x, where=mask) * w).sum()), mesh=mesh)(x)
    want, have = directional(lambda x: (ref(x) * w).sum(), x, np.asarray(g), r)
    np.testing.assert_allclose(have, want, rtol=1e-6)
    with pytest.raises(TypeError, match="where= must be a boolean mask, got int64"):
        sf.jit(lambda x: nn.softmax(x, where=mask.astype(np.int64)), mesh=mesh)(x)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_label_smoothing_is_torchs_with_no_collective_more(reduction):
    """torch's F.cross_entropy(label_smoothing=) (a DTensor-port probe met a TypeError): the target
    (1 - eps) one-hot + eps / vocab, ignored tokens 0, with the vocabulary over tp the same two Allreduces;
    its gradient against central differences."""
    from cases import directional
    r = np.random.default_rng()
    logits, labels, eps = r.standard_normal((6, V)), r.integers(0, V, 6), 0.15
    labels[2] = -100

    def ref(x):
        s = x - x.max(-1, keepdims=True)
        lse = np.log(np.exp(s).sum(-1))
        y = np.where(labels == -100, 0, labels)
        per = lse - (1 - eps) * s[np.arange(6), y] - eps * s.mean(-1)
        per = np.where(labels == -100, 0.0, per)
        return per if reduction == "none" else per.sum() if reduction == "sum" else per.sum() / (labels != -100).sum()
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    f = sf.jit(lambda x, y: nn.cross_entropy(sf.shard(x, axis=1, over="tp"), y, ignore_index=-100, reduction=reduction,
                                             label_smoothing=eps), mesh=mesh)
    np.testing.assert_allclose(np.asarray(f(logits, labels)), ref(logits), rtol=1e-12, atol=1e-15)
    plain = sf.jit(lambda x, y: nn.cross_entropy(sf.shard(x, axis=1, over="tp"), y, ignore_index=-100), mesh=mesh)
    assert f.lower(logits, labels).collectives() == plain.lower(logits, labels).collectives()
    if reduction != "none":
        g = sf.jit(sf.grad(lambda x: nn.cross_entropy(x, labels, ignore_index=-100, reduction=reduction,
                                                      label_smoothing=eps)), mesh=mesh)(logits)
        want, got = directional(ref, logits, np.asarray(g), r)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\]"):
        nn.cross_entropy(sf.replicate(logits, mesh=mesh), labels, label_smoothing=1.5)
