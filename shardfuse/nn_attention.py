"""sf.nn.attention's checks and masks (shardfuse/nn.py computes it): the shapes of q, k, v and the
mask, grouped-query heads, the causal mask, and attention-probability dropout's keep mask, so that the
mask is drawn in one shape whatever the mesh (a grouped or a repeated layout of the heads)."""
from __future__ import annotations

import numpy as np

from shardfuse import dtypes
from shardfuse.traced import Traced, is_scalar

# The score a masked-out position gets: finite, so a row with every position masked is uniform
# rather than NaN (jax.nn.dot_product_attention's choice, 0.7 of the dtype's largest magnitude).
MASKED = {"float16": -0.7 * 65504.0, "bfloat16": -0.7 * 3.3895313892515355e38,
          "float32": -0.7 * float(np.finfo(np.float32).max), "float64": -0.7 * float(np.finfo(np.float64).max)}


def masked(x, mask):
    """x with MASKED where the boolean mask is False (finite: a row left wholly out stays finite; the caller
    sets its result), for softmax's and log_softmax's where=."""
    if dtypes.normalize_dtype(mask.dtype) != "bool":
        raise TypeError(f"sf.nn: where= must be a boolean mask, got {dtypes.normalize_dtype(mask.dtype)}")
    return select(mask, x, MASKED[x.dtype_name])


def select(mask, a, b):
    """np.where(mask, a, b), traced where either is a traced value."""
    from shardfuse.traced_numpy import where

    return where(mask, a, b) if isinstance(a, Traced) or isinstance(mask, Traced) else np.where(mask, a, b)


def kept(x, keep, rate):
    """x / (1 - rate) where keep, else 0 (inverted dropout's scaling)."""
    dt = np.dtype(x.dtype)
    if dtypes.is_float(dt.name):  # (as NEP 50 takes x / (1 - rate): the factor rounded to x's dtype, on any ml_dtypes)
        return np.where(keep, x / dt.type(1.0 - rate), dt.type(0))
    return np.where(keep, x / (1.0 - rate), 0)


def with_causal(q, k, mask):
    """mask and'ed with np.tril(np.ones((seq_q, seq_k), bool)) (top-left aligned: query i sees keys 0..i); a
    float mask gets MASKED above the diagonal."""
    tril = np.tril(np.ones((q.shape[-2], k.shape[-2]), bool))
    dtype = None if mask is None else dtypes.normalize_dtype(mask.dtype)
    return tril if mask is None else mask & tril if dtype == "bool" else np.where(tril, mask, MASKED[dtype])


def dropout_rate(rate, rng) -> float:
    """rate as a float in [0, 1], checked with its key (flax's dot_product_attention: dropout_rate and
    dropout_rng); 0.0 where no dropout is asked for."""
    if not is_scalar(rate) or isinstance(rate, (bool, np.bool_)):
        raise TypeError(f"sf.nn.attention: dropout_rate must be a number in [0, 1], got {rate!r}")
    if not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"sf.nn.attention: dropout_rate must be a number in [0, 1], got {rate!r}")
    if float(rate) > 0.0 and rng is None:
        raise TypeError(f"sf.nn.attention: dropout_rate={float(rate)} needs a key, dropout_rng=sf.random.key(seed) "
                        "(a fresh one per step: sf.random.fold_in(key, step))")
    return float(rate)


def keep_shape(q, k, v, mask, broadcast: bool) -> tuple:
    """The shape of the keep mask of the probabilities [..., heads, seq_q, seq_k]: the scores' (q's heads where k
    and v have fewer, a mask's leading axes too); with broadcast (flax's broadcast_dropout) one mask for every
    batch and head, [1, ..., seq_q, seq_k]."""
    grouped = groups(q, k, v) > 1

    def lead(t):  # (grouped-query k and v: as many heads as q's)
        return tuple(t.shape[:-3]) + (q.shape[-3],) if grouped else tuple(t.shape[:-2])
    lead = np.broadcast_shapes(tuple(q.shape[:-2]), lead(k), lead(v), tuple(np.shape(mask))[:-2])
    return (1,) * len(lead) + (q.shape[-2], k.shape[-2]) if broadcast else lead + (q.shape[-2], k.shape[-2])


def check_shapes(q, k, v, mask):
    """q, k, v [..., heads, seq, head_dim] that fit together, and a mask that broadcasts against the scores
    [..., seq_q, seq_k], else an error naming the shapes (a serving probe's cache of another length met
    "where_then of g_r_r and s_5: shapes ... do not broadcast" from inside)."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ValueError(f"sf.nn.attention: q, k and v need at least 2 axes ([..., seq, head_dim]), got {shapes}")
    lead = _broadcasts(tuple(q.shape[:-3]), _broadcasts(tuple(k.shape[:-3]), tuple(v.shape[:-3])))
    if k.shape[-1] != q.shape[-1] or k.shape[-2] != v.shape[-2] or lead is None:
        raise ValueError(f"sf.nn.attention: k needs q's head_dim (axis -1), v k's seq (axis -2), and the leading axes "
                         f"of all three must broadcast together ([batch, heads, seq, head_dim]), got {shapes}")
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)
    kind = None if mask is None else "f" if dtypes.is_float(dtypes.normalize_dtype(mask.dtype)) else \
        "b" if dtypes.normalize_dtype(mask.dtype) == "bool" else "i"
    if kind == "i":  # (a tokenizer's int64 attention_mask of 0 / 1 would be added to the scores: a probe)
        raise TypeError(f"sf.nn.attention: mask must be boolean (True: attend) or a float bias added to the scores, "
                        f"got {dtypes.normalize_dtype(mask.dtype)}; for a 0 / 1 attention_mask write mask != 0 "
                        "(or mask.astype(bool))")
    if mask is not None and np.ndim(mask) and _broadcasts(tuple(np.shape(mask)), scores) is None:
        raise ValueError(f"sf.nn.attention: mask of shape {tuple(np.shape(mask))} does not broadcast against the "
                         f"scores {scores} ([..., seq_q, seq_k]; {shapes})")


def _broadcasts(a, b):
    try:
        return np.broadcast_shapes(a, b)
    except (ValueError, TypeError):  # (TypeError: a None from an earlier pair)
        return None


def groups(q, k, v):
    """G, the query heads that share one key / value head (grouped-query attention, as
    jax.nn.dot_product_attention and torch's enable_gqa: query head n reads kv head n // G): 1 where
    the heads match, or k and v have one head (multi-query: it broadcasts as it is)."""
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim or k.shape[-3] == q.shape[-3] or k.shape[-3] == 1:
        return 1
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads % kv_heads or v.shape[-3] != kv_heads:
        raise ValueError(f"sf.nn.attention: q has {heads} heads (axis -3 of {tuple(q.shape)}), k {kv_heads} and v "
                         f"{v.shape[-3]}: grouped-query attention needs k and v with one number of heads, a divisor "
                         "of q's ([batch, heads, seq, head_dim])")
    return heads // kv_heads
