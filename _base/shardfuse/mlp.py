"""The tensor-parallel MLP block, y = gelu(x @ w1 + b1) @ w2 + b2, Megatron-style.

w1 [h, 4h] is column-sharded and w2 [4h, h] row-sharded over the tensor-parallel mesh axis.
- "tp": x replicated; the block ends in a pending sum, resolved by an Allreduce that is
  pipelined with the second GEMM (GEMM+Allreduce, chunk by chunk).
- "sp" (sequence parallel): x sharded on tokens; AllGather+GEMM in, GEMM+ReduceScatter out,
  both pipelined: one gather chain and one reduce-scatter chain, nothing else.
On a 2-D mesh, tokens are also sharded over the data-parallel axis (`dp`).
"""
from __future__ import annotations

import math

import numpy as np

import shardfuse as sf


def mlp_block(mesh, mode="sp", chunks=2, streams=4, tp=None, dp=None, approximate=True):
    """The jitted block.  x is [tokens, h], or [batch, tokens, h] with batch sharded over `dp`.
    approximate: the GELU's tanh form (GPT-2's, Megatron's, JAX's default); False: the exact erf
    form of torch.nn.GELU()."""
    tp = tp or mesh.axis_names[-1]
    if mode not in ("tp", "sp"):
        raise ValueError(f"mode must be 'tp' or 'sp', got {mode!r}")
    t = 1 if dp else 0  # the token axis

    def batch(v):  # data parallelism: every activation keeps its batch axis sharded over dp
        return sf.shard(v, axis=0, over=dp) if dp else v

    def mlp(x, w1, b1, w2, b2):
        if x.ndim != 2 + bool(dp):
            raise ValueError(f"mlp_block(dp={dp!r}) takes x of shape {'[batch, tokens, h]' if dp else '[tokens, h]'}, "
                             f"got {x.ndim} axes {tuple(x.shape)}")
        x = batch(x)
        w1, b1, w2 = sf.shard(w1, axis=1, over=tp), sf.shard(b1, axis=0, over=tp), sf.shard(w2, axis=0, over=tp)
        if mode == "sp":
            x = sf.shard(x, axis=t, over=tp)
            h = sf.stream(batch(sf.shard(x @ w1, axis=-1, over=tp)), axis=t, chunks=chunks)
            z = sf.stream(batch(sf.shard(sf.gelu(h + b1, approximate=approximate) @ w2, axis=t, over=tp)), axis=t, chunks=chunks)
        else:
            z = sf.stream(batch(sf.gelu(x @ w1 + b1, approximate=approximate) @ w2), axis=t, chunks=chunks)
        return z + b2

    mlp.__name__ = f"mlp_{mode}"
    return sf.jit(mlp, mesh=mesh, streams=streams)


def mlp_inputs(rng, tokens, hidden, dtype="float64", batch=None):
    shapes = [((batch,) if batch else ()) + (tokens, hidden), (hidden, 4 * hidden), (4 * hidden,), (4 * hidden, hidden), (hidden,)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def mlp_reference(x, w1, b1, w2, b2, approximate=True):
    """The block in float64 NumPy (the exact GELU as x Phi(x), from math.erfc: NumPy has no erf)."""
    x, w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in (x, w1, b1, w2, b2))
    h = x @ w1 + b1
    if approximate:
        g = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    else:
        g = 0.5 * h * np.vectorize(math.erfc)(-h / np.sqrt(2.0))
    return g @ w2 + b2
