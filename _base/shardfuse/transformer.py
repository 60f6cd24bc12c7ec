"""sf.nn.transformer_layer: a pre-norm GPT block written with sf.nn and shardfuse's ops, with
Megatron's shardings (shardfuse's shardings and gradients come from the ops' rules).

    LayerNorm -> Q, K, V projections -> causal attention -> output projection -> residual
    LayerNorm -> MLP (GELU) -> residual

- tp (a mesh axis name): tensor parallel.  Q/K/V and the first MLP weight column-parallel (heads
  and the 4h axis sharded), the output projection and the second MLP weight row-parallel: each
  half of the block ends in one pending sum.  Without sp the activations between halves are
  replicated over tp and each pending sum is an Allreduce (pipelined with its GEMM when chunks=).
- sp=True: sequence parallel (Megatron-LM's): the sequence axis of the activations between the
  halves is sharded over tp too.  Each column-parallel GEMM is an AllGather+GEMM and each
  row-parallel one a GEMM+ReduceScatter, each pipelined over `chunks` of the sequence.
- dp (a mesh axis name): data parallel: the batch axis of every activation sharded over it.

Parameters are one dict (a pytree): see `init_params`.  x is [batch, seq, hidden].
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import trace
from shardfuse.nn import attention, layer_norm
from shardfuse.numpy_math import gelu

PARAMS = ("ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "bo", "ln2_w", "ln2_b", "w1", "b1", "w2", "b2")


def init_params(rng, hidden, dtype="float32", scale=0.02):
    """A layer's parameters, GPT-2's initialisation: weights N(0, scale), norms' weights one, biases zero
    plus a little noise (so a test sees every parameter)."""
    def normal(*shape):
        return (rng.standard_normal(shape) * scale).astype(dtype)
    h = hidden
    return {"ln1_w": (1 + normal(h)).astype(dtype), "ln1_b": normal(h), "wq": normal(h, h), "wk": normal(h, h),
            "wv": normal(h, h), "wo": normal(h, h), "bo": normal(h), "ln2_w": (1 + normal(h)).astype(dtype),
            "ln2_b": normal(h), "w1": normal(h, 4 * h), "b1": normal(4 * h), "w2": normal(4 * h, h), "b2": normal(h)}


def causal_mask(seq):
    """[seq, seq] booleans, True where a position may attend (itself and earlier ones)."""
    return np.tril(np.ones((seq, seq), bool))


def transformer_layer(params, x, heads, *, causal=True, mask=None, tp=None, sp=False, dp=None, chunks=None,
                      eps=1e-5, approximate=True):
    """One pre-norm transformer block on x [batch, seq, hidden]: causal self-attention (GPT's), or
    with mask= [seq, seq] booleans (True: attend) and causal=False.  heads divides hidden (and,
    with tp, the heads divide over tp).  approximate: the MLP's GELU (sf.gelu's: True the tanh
    form of GPT-2 and Megatron, False the exact erf form of torch.nn.GELU())."""
    p = params
    if sp and tp is None:
        raise ValueError("transformer_layer(sp=True) shards the sequence over the tensor-parallel axis: give tp=")
    b, s, h = x.shape
    if h % heads:
        raise ValueError(f"transformer_layer: heads={heads} does not divide hidden={h}")

    def batch(v):  # data parallel: the batch axis sharded over dp
        return trace.shard(v, axis=0, over=dp) if dp else v

    def col(w, axis=1):
        return trace.shard(w, axis=axis, over=tp) if tp else w

    def column_parallel(v, w):  # v @ w, the result's last axis sharded over tp
        y = v @ col(w)
        if sp:  # AllGather+GEMM, pipelined over the sequence
            return trace.stream(batch(trace.shard(y, axis=-1, over=tp)), axis=1, chunks=chunks)
        return batch(trace.shard(y, axis=-1, over=tp)) if tp else y

    def row_parallel(v, w):  # v @ w, w's rows sharded over tp: a pending sum, made whole
        y = v @ col(w, axis=0)
        if sp:  # GEMM+ReduceScatter into the sequence shards, pipelined
            return trace.stream(batch(trace.shard(y, axis=1, over=tp)), axis=1, chunks=chunks)
        if tp and chunks:  # GEMM+Allreduce, pipelined
            return trace.stream(batch(y), axis=1, chunks=chunks)
        return y

    def heads_first(t):  # [b, s, h] -> [b, heads, s, d]
        return t.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)

    x = batch(trace.shard(x, axis=1, over=tp)) if sp else batch(x)
    y = layer_norm(x, p["ln1_w"], p["ln1_b"], eps)
    q, k, v = (heads_first(column_parallel(y, p[w])) for w in ("wq", "wk", "wv"))
    o = attention(q, k, v, causal=causal, mask=mask).transpose(0, 2, 1, 3).reshape(b, s, h)
    x = x + (row_parallel(o, p["wo"]) + p["bo"])
    y = layer_norm(x, p["ln2_w"], p["ln2_b"], eps)
    z = gelu(column_parallel(y, p["w1"]) + col(p["b1"], axis=0), approximate=approximate)
    return x + (row_parallel(z, p["w2"]) + p["b2"])


def layer_reference(params, x, heads, mask=None, eps=1e-5, approximate=True):
    """The same block in float64 NumPy (the tests' and the demo's reference)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    b, s, h = x.shape

    def ln(t, w, c):
        d = t - t.mean(-1, keepdims=True)
        return d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * w + c

    def split(t):
        return t.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)

    y = ln(x, p["ln1_w"], p["ln1_b"])
    q, k, v = (split(y @ p[w]) for w in ("wq", "wk", "wv"))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(h // heads)
    mask = causal_mask(s) if mask is None else mask
    scores = np.where(mask, scores, -0.7 * np.finfo(np.float64).max)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    o = ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
    x = x + o @ p["wo"] + p["bo"]
    g = ln(x, p["ln2_w"], p["ln2_b"]) @ p["w1"] + p["b1"]
    if approximate:
        g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    else:  # (x Phi(x); NumPy has no erf)
        g = 0.5 * g * np.vectorize(math.erfc)(-g / np.sqrt(2.0))
    return x + g @ p["w2"] + p["b2"]


# ---- a GPT model: embeddings, L blocks, the final norm, the vocabulary head, the loss ---------------

def adam_step(heads, b1=0.9, b2=0.999, lr=1e-4, eps=1e-8):
    """One training step of the layer, to jit (donate the first three): value_and_grad of the
    squared error of transformer_layer(p, x, heads) against t, then Adam written with shardfuse ops
    (the step benchmarks/layer_vs_torch.py times against torch's, and its memory tests plan)."""
    from shardfuse.transforms import value_and_grad

    def step(p, m, v, x, t):
        loss, g = value_and_grad(lambda p: ((transformer_layer(p, x, heads) - t) ** 2).mean())(p)
        m = {k: m[k] * b1 + g[k] * (1 - b1) for k in p}
        v = {k: v[k] * b2 + g[k] * g[k] * (1 - b2) for k in p}
        p = {k: p[k] - m[k] * (lr / (1 - b1)) / (np.sqrt(v[k] * (1 / (1 - b2))) + eps) for k in p}
        return p, m, v, loss
    return step


def init_gpt(rng, vocab, hidden, layers, seq, dtype="float32", scale=0.02):
    """GPT parameters: token and position embeddings, `layers` blocks, the final norm and an
    untied vocabulary head [hidden, vocab]."""
    def normal(*shape):
        return (rng.standard_normal(shape) * scale).astype(dtype)
    return {"wte": normal(vocab, hidden), "wpe": normal(seq, hidden),
            "layers": [init_params(rng, hidden, dtype, scale) for _ in range(layers)],
            "lnf_w": (1 + normal(hidden)).astype(dtype), "lnf_b": normal(hidden), "head": normal(hidden, vocab)}


def gpt_loss(params, ids, labels, heads, *, tp=None, sp=False, dp=None, chunks=None, checkpoint=False):
    """The mean cross-entropy of a GPT on token ids [batch, seq] against labels [batch, seq].  With
    tp: the vocabulary-parallel embedding (each device looks up its rows, one Allreduce, or one
    ReduceScatter into the sequence shards with sp) and head (logits sharded over the vocabulary,
    Megatron's vocab-parallel cross-entropy: three Allreduces of per-token values).  checkpoint=True:
    each layer under sf.checkpoint (Megatron's full recompute): the backward computes a layer's
    activations again instead of keeping every layer's."""
    from shardfuse.checkpoint import checkpoint as recomputed
    from shardfuse.nn import cross_entropy
    from shardfuse.take import take

    p = params
    wte = trace.shard(p["wte"], axis=0, over=tp) if tp else p["wte"]
    x = take(wte, ids) + p["wpe"]
    block = recomputed(transformer_layer) if checkpoint else transformer_layer
    for layer in p["layers"]:
        x = block(layer, x, heads, tp=tp, sp=sp, dp=dp, chunks=chunks)
    x = layer_norm(x, p["lnf_w"], p["lnf_b"])
    logits = x @ (trace.shard(p["head"], axis=1, over=tp) if tp else p["head"])
    if tp:
        logits = trace.shard(logits, axis=-1, over=tp)
    if dp:
        logits = trace.shard(logits, axis=0, over=dp)
    return cross_entropy(logits, labels)


def gpt_reference(params, ids, labels, heads):
    """gpt_loss in float64 NumPy."""
    p = params
    x = np.asarray(p["wte"], np.float64)[np.clip(np.where(ids < 0, ids + len(p["wte"]), ids), 0, len(p["wte"]) - 1)]
    x = x + np.asarray(p["wpe"], np.float64)
    for layer in p["layers"]:
        x = layer_reference(layer, x, heads)
    d = x - x.mean(-1, keepdims=True)
    x = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5) * np.asarray(p["lnf_w"], np.float64) + p["lnf_b"]
    logits = x @ np.asarray(p["head"], np.float64)
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    target = np.take_along_axis(logits, labels[..., None].astype(np.int64), -1)[..., 0]
    return float((lse - target).mean())
