"""sf.nn: the functions of a transformer layer, written with shardfuse's ops (as jax.nn and
torch.nn.functional), so that their shardings come from the ops' rules and nothing else.

    import numpy as np, shardfuse as sf
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"))

    @sf.jit(mesh=mesh)
    def attend(q, k, v, mask):                       # [batch, heads, seq, head_dim]
        q, k, v = (sf.shard(sf.shard(t, axis=0, over="dp"), axis=1, over="tp") for t in (q, k, v))
        return sf.nn.attention(q, k, v, mask=mask)   # heads sharded: no communication

Inside sf.jit each function adds its ops to the traced program.  Outside it, on sf.Arrays (and
plain arrays beside them, replicated), each call is one plan, compiled once per input specs and
kept on the mesh as the one-op plans of array ops are (`Array.one_op`): `sf.nn.softmax(x)` of an
sf.Array is one plan call, not five.

16-bit inputs (float16, bfloat16) of softmax, log_softmax, layer_norm and rms_norm are computed in
float32 and the result cast back to the input's dtype (as torch's kernels and Megatron's
fp32 softmax do); other dtypes are computed in their own.
"""
from __future__ import annotations

import functools
import inspect
import math

import numpy as np

from shardfuse import dtypes
from shardfuse.autodiff import stop_gradient
from shardfuse.custom_vjp import custom_vjp
from shardfuse.mesh import static_advice
from shardfuse.traced import Traced, describe, is_scalar
from shardfuse.numpy_broadcast import repeat
from shardfuse import nn_activations as act
from shardfuse import nn_attention as attn
from shardfuse import nn_init as initializers  # noqa: F401 (sf.nn.initializers, jax.nn.initializers')
from shardfuse.numpy_math import gelu
from shardfuse.traced_numpy import exp, linear, log, maximum, minimum, rsqrt, silu, where

__all__ = ["softmax", "log_softmax", "logsumexp", "one_hot", "layer_norm", "rms_norm", "linear", "attention",
           "dot_product_attention", "cross_entropy", "cross_entropy_onehot", "stop_gradient",
           *(f.__name__ for f in (gelu, silu))]  # (the ops' names by reference: an op name is never a string here)

_WIDENED = {"float16": "float32", "bfloat16": "float32"}  # 16-bit values are normalised in float32


def _one_plan(fn=None, *, name=None):
    """fn as it is on traced values (inside sf.jit); on sf.Arrays the whole of fn as one plan.  `name`: the
    public function's, where fn is a private one's body (messages name it)."""
    if fn is None:
        return functools.partial(_one_plan, name=name)
    signature, name = inspect.signature(fn), name or fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:  # (a probe's softmax(x, where=m) met "got an unexpected keyword argument" unnamed)
            raise TypeError(f"sf.nn.{name}{signature}: {e}") from None
        bound.apply_defaults()
        args = bound.args
        traced = next((a for a in args if isinstance(a, Traced)), None)
        if traced is not None:  # (NumPy arrays beside: constants, as ops take them; a grouped-query k repeated was one)
            return fn(*(traced.builder.constant(a) for a in args))
        for a in args:
            if hasattr(type(a), "one_op"):  # sf.Array (array_ops.ArrayOps)
                return a.one_op(fn, args, f"nn.{name}")
        raise TypeError(f"sf.nn.{name} takes values inside an sf.jit function or sf.Arrays, got "
                        f"{', '.join(type(a).__name__ for a in args)}")
    return call


def _widened(x):
    """x in the dtype it is normalised in (float32 for 16-bit floats), and the result's dtype: its own, or
    float64 for integers and bools (NumPy's np.exp of them, JAX's inexact promotion; a probe: they were
    truncated back to the integers)."""
    dtype = x.dtype_name if dtypes.is_float(x.dtype_name) else "float64"
    return x.astype(_WIDENED.get(dtype, dtype)), dtype


@_one_plan
def softmax(x, axis=-1, where=None):
    """exp(x - max) / sum(exp(x - max)) over `axis` (jax.nn.softmax); the max and the sum keep
    their axis (keepdims), so they broadcast back.  Over a sharded axis the sum is an Allreduce of
    the reduced shape, and the max gathers that axis (until max reduces with an Allreduce).
    Its gradient is written by hand (as jax.nn.softmax's custom_jvp): y * (g - sum(g * y)), so the
    backward holds only the output y, not the exponentials too.  where= (a boolean mask broadcast
    against x, jax.nn.softmax's): the elements it leaves out count for nothing and are 0."""
    x, dtype = _widened(x)
    x = x if where is None else attn.masked(x, where)
    y = _with_rule(_softmax, lambda y, g: (y * (g - (g * y).sum(axis, keepdims=True)),), axis)(x)
    return (y if where is None else attn.select(where, y, 0.0)).astype(dtype)


def _softmax(x, axis):
    e = exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@_one_plan
def log_softmax(x, axis=-1, where=None):
    """x - max - log(sum(exp(x - max))) over `axis` (jax.nn.log_softmax); its gradient by hand,
    g - exp(y) * sum(g), holds only the output y.  where= as softmax's: left-out elements are -inf."""
    x, dtype = _widened(x)
    x = x if where is None else attn.masked(x, where)
    y = _with_rule(_log_softmax, lambda y, g: (g - exp(y) * g.sum(axis, keepdims=True),), axis)(x)
    return (y if where is None else attn.select(where, y, -np.inf)).astype(dtype)


def _log_softmax(x, axis):
    s = x - x.max(axis, keepdims=True)
    return s - log(exp(s).sum(axis, keepdims=True))


def _with_rule(fn, bwd, axis):
    """fn(x, axis) as an sf.custom_vjp function of x whose backward is bwd(y, g), y its output."""
    f = custom_vjp(functools.partial(fn, axis=axis))
    f.defvjp(lambda x: (lambda y: (y, y))(fn(x, axis)), bwd)
    return f


@_one_plan
def layer_norm(x, weight, bias, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (torch's F.layer_norm with
    normalized_shape the last extent; the biased variance).  weight and bias are [hidden] arrays,
    or None for none.  A hidden axis sharded over a mesh axis is reduced with Allreduces of
    [tokens]-sized values."""
    x, dtype = _widened(x)
    d = x - x.mean(-1, keepdims=True)
    y = d * rsqrt((d * d).mean(-1, keepdims=True) + eps)
    y = y if weight is None else y * weight
    y = y if bias is None else y + bias
    return y.astype(dtype)


@_one_plan
def rms_norm(x, weight, eps=1e-6):
    """x / sqrt(mean(x**2) + eps) * weight over the last axis (RMSNorm, as in LLaMA); weight a
    [hidden] array or None."""
    x, dtype = _widened(x)
    y = x * rsqrt((x * x).mean(-1, keepdims=True) + eps)
    y = y if weight is None else y * weight
    return y.astype(dtype)


def _swap_last_two(t):
    return t.transpose(tuple(range(t.ndim - 2)) + (t.ndim - 1, t.ndim - 2))


@_one_plan(name="attention")
def _attention(q, k, v, mask, scale):
    return _attention_of(q, k, v, mask, scale, None, 0.0)


@_one_plan(name="attention")
def _dropped_attention(key, q, k, v, mask, scale, rate, broadcast):
    from shardfuse import random

    keep = random.bernoulli(key, 1.0 - rate, attn.keep_shape(q, k, v, mask, broadcast))
    return _attention_of(q, k, v, mask, scale, keep, rate)


def _attention_of(q, k, v, mask, scale, keep, rate):
    """The probabilities' elements where keep is False dropped (and the others scaled), keep drawn in the
    shape of q's heads, so the same key drops the same ones on any mesh."""
    groups = attn.groups(q, k, v)
    mesh = getattr(q, "builder", None) and q.builder.mesh
    if groups > 1 and mesh is not None and any(k.shape[-3] % mesh.axis_size(n) for n in mesh.axis_names):
        # (q's heads may be split over more devices than there are kv heads: viewed as [kv heads, G] they
        # would be gathered (a review); k and v repeated instead, a copy each, the heads staying split)
        k, v, groups = repeat(k, groups, axis=-3), repeat(v, groups, axis=-3), 1
    if groups > 1:  # (grouped-query: q's heads as [kv heads, G], k and v broadcast over G; no copy of them)
        heads = q.shape[-3]
        split = lambda t, g: t.reshape(t.shape[:-3] + (t.shape[-3] // g, g) + t.shape[-2:])  # noqa: E731
        q, k, v = split(q, groups), split(k, 1), split(v, 1)
        # (a mask per head: as q's; broadcast over heads: over both)
        mask, keep = (t if t is None or t.ndim < 3 else split(t, groups if t.shape[-3] == heads else 1)
                      for t in (mask, keep))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = (q @ _swap_last_two(k)) * scale
    if mask is not None:  # (a NumPy mask inside sf.jit is a constant of the program)
        scores = where(mask, scores, attn.MASKED[scores.dtype_name]) if mask.dtype == "bool" else scores + mask
    probs = softmax(scores, -1)
    if keep is not None:  # (after the softmax, as flax's dot_product_attention and torch's dropout_p)
        probs = np.zeros_like(probs) if rate == 1.0 else attn.kept(probs, keep, rate)
    out = probs @ v
    # (the leading axes the scores broadcast to: q's batch of 1 beside k's of 3, a review)
    return out.reshape(out.shape[:-4] + (heads,) + out.shape[-2:]) if groups > 1 else out


def attention(q, k, v, causal=False, mask=None, *, scale=None, dropout_rate=0.0, dropout_rng=None,
              broadcast_dropout=True):
    """Scaled dot-product attention, softmax(q @ k^T * scale + mask) @ v, over [batch, heads, seq,
    head_dim] operands (any leading axes, the same on q, k and v); scale 1 / sqrt(head_dim) unless given
    (jax.nn.dot_product_attention's scale=, a Python number).  Grouped-query attention where k and v
    have fewer heads than q, a divisor of them: query head n reads key / value head n // (heads of q /
    heads of k), as jax.nn.dot_product_attention and torch's enable_gqa (q's heads taken as [kv heads,
    G], k and v broadcast over G: never copied).

    mask broadcasts against the scores [..., seq_q, seq_k]: a boolean array (True: attend, as
    jax.nn.dot_product_attention; a masked score becomes a large negative number, so a row with
    nothing to attend to is uniform, not NaN) or a float array added to the scores.  The softmax
    of 16-bit scores runs in float32.  With heads (or batch) sharded over a mesh axis and
    sequence and head_dim whole, nothing is communicated.

    causal=True builds np.tril(np.ones((seq_q, seq_k), bool)) as the mask (and'ed with a boolean mask given
    too; a float mask gets a large negative number above the diagonal): outside sf.jit it is
    passed as a replicated array, inside sf.jit it is a constant of the program (shardfuse/constants.py).
    It is aligned at the top left, query i seeing keys 0..i (jax.nn.dot_product_attention's is_causal,
    torch's is_causal): for a decode step whose seq_q queries are the last of seq_k cached positions,
    give the mask np.tril(np.ones((seq_q, seq_k), bool), k=seq_k - seq_q) (a serving probe's trap).

    dropout_rate > 0 drops attention probabilities (after the softmax) with that probability and scales
    the others by 1 / (1 - rate), with the key dropout_rng (flax.linen.dot_product_attention's names);
    broadcast_dropout=True (flax's default) draws one mask [seq_q, seq_k] for every batch and head,
    False one per element (torch's dropout_p, Megatron's attention dropout).  The mask is
    sf.random.bernoulli's, so it is the same on every mesh; pass a fresh key per step."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"sf.nn.attention(q, k, v, causal=False, mask=None, *, scale=None): causal takes True or False, "
                        f"got {type(causal).__name__}; pass a mask by keyword, mask=... (jax.nn.dot_product_attention's "
                        "fourth positional argument is a bias)")
    attn.check_shapes(q, k, v, mask)
    rate = attn.dropout_rate(dropout_rate, dropout_rng)
    if causal:  # (with a mask too, both apply: jax.nn.dot_product_attention's is_causal and mask)
        mask = attn.with_causal(q, k, mask)
    if rate == 0.0:
        return _attention(q, k, v, mask, scale)
    from shardfuse import random

    if not isinstance(broadcast_dropout, (bool, np.bool_)):
        raise TypeError(f"sf.nn.attention: broadcast_dropout takes True or False, got {broadcast_dropout!r}")
    return _dropped_attention(random.check_key(dropout_rng, "nn.attention"), q, k, v, mask, scale, rate,
                              bool(broadcast_dropout))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, **unsupported):
    """jax.nn.dot_product_attention: [batch, seq, heads, head_dim] operands (JAX's layout; sf.nn.attention's
    is [batch, heads, seq, head_dim]), a float bias added to the scores and a boolean mask (True: attend), both
    broadcast against [batch, heads, seq_q, seq_k]; grouped-query heads as attention's."""
    given = [k for k, a in unsupported.items() if a is not None]  # (JAX code passes implementation=None and the like)
    if given:
        raise TypeError(f"sf.nn.dot_product_attention: {', '.join(k + '=' for k in given)} not supported (its "
                        "keywords: bias, mask, scale, is_causal; write query_seq_lengths, key_value_seq_lengths or "
                        "local_window_size as a boolean mask=)")
    heads_first = lambda t: t.swapaxes(-2, -3)  # noqa: E731
    dtype = None if bias is None else dtypes.normalize_dtype(bias.dtype)
    if dtype is not None and not dtypes.is_float(dtype):
        raise TypeError(f"sf.nn.dot_product_attention: bias must be a float array added to the scores, got {dtype}")
    if bias is not None:  # (JAX's: the scores in the operands' dtype)
        bias = bias.astype(query.dtype)
        dtype = dtypes.normalize_dtype(bias.dtype)
    if bias is not None and mask is not None:  # (one additive mask: the bias where attended, masked elsewhere)
        bias, mask = None, attn.select(mask, bias, attn.MASKED[dtype])
    out = attention(heads_first(query), heads_first(key), heads_first(value), is_causal,
                    mask if bias is None else bias, scale=scale)
    return heads_first(out)


@_one_plan
def cross_entropy_onehot(logits, targets):
    """The mean over tokens of -sum(targets * log_softmax(logits)) over the last (vocabulary)
    axis, for one-hot targets of the logits' shape (or any rows that sum to 1: soft labels).
    For integer labels: cross_entropy.

    Written as Megatron's vocab-parallel cross-entropy: per token log(sum(exp(logits - max))) minus
    the target's logit (minus max), so no [tokens, vocabulary] log_softmax is formed; with the
    vocabulary sharded the sum of exponentials and the target logit are Allreduces of [tokens]
    values, and so is the max (an Allreduce with op=max).  The result is a 0-d array of the
    logits' dtype (float32 for 16-bit logits)."""
    x, _ = _widened(logits)
    s = x - x.max(-1, keepdims=True)
    target = (targets * s).sum(-1)
    return (log(exp(s).sum(-1)) - target).mean()


@_one_plan
def cross_entropy(logits, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """The mean over tokens of -log_softmax(logits)[label] (torch's F.cross_entropy with integer
    targets, optax's softmax_cross_entropy_with_integer_labels): logits [..., vocab], labels [...]
    int32 / int64.  Labels index as sf.take's (negative from the end; outside [-vocab, vocab)
    clamped to the first or last class).

    ignore_index (a Python int, None: none): tokens whose label equals it count for nothing, and
    the mean is over the others (torch's ignore_index and its default, -100, so labels padded as torch's
    are ignored (three probes' torch ports met -100 read as a class id); NaN where every token is ignored,
    as torch's; it costs no collective more).  reduction= as torch's: "mean",
    "sum" (over the tokens not ignored) or "none" (the loss per token, labels' shape, 0 where ignored:
    optax's softmax_cross_entropy_with_integer_labels, for a per-token weighting).  label_smoothing=eps as
    torch's: the target distribution (1 - eps) one-hot + eps / vocab (in the same sum: no collective more).

    Written as Megatron's vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py): per token
    the max of the logits, log(sum(exp(logits - max))) and the target's logit (the logits where
    the vocabulary ids, a constant np.arange(vocab), equal the label, summed), so that with the
    vocabulary sharded over a mesh axis each is one Allreduce of [tokens] values (max, sum of
    exponentials, target logit) and the logits are never gathered.  The result (0-d, or labels'
    shape for "none") has the logits' dtype (float32 for 16-bit logits, computed in float32)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"sf.nn.cross_entropy: reduction must be 'mean', 'sum' or 'none' (torch's), got {reduction!r}")
    if not is_scalar(label_smoothing) or isinstance(label_smoothing, bool) or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"sf.nn.cross_entropy: label_smoothing must be a number in [0, 1] (torch's), got {label_smoothing!r}")
    if not _int_array(labels):
        raise TypeError(f"sf.nn.cross_entropy: labels must be an integer array (int32 or int64) of class ids, got "
                        f"{describe(labels)}; for one-hot or soft targets use cross_entropy_onehot")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"sf.nn.cross_entropy: labels of shape {tuple(labels.shape)} for logits of shape "
                         f"{tuple(logits.shape)}: one label per row of logits (the shape {tuple(logits.shape[:-1])})")
    x, _ = _widened(logits)
    n = x.shape[-1]
    # (the max shift held constant by sf.grad: with one target per row its terms cancel, so the
    # backward neither compares the logits with their max nor keeps them for it)
    s = x - stop_gradient(x.max(-1, keepdims=True))
    kept = None if ignore_index is None else labels != int(ignore_index)
    labels = minimum(maximum(where(labels < 0, labels + n, labels), 0), n - 1)
    hit = labels.reshape(tuple(labels.shape) + (1,)) == np.arange(n, dtype=labels.dtype)  # (a constant)
    eps = float(label_smoothing)
    target = where(hit, s, 0.0).sum(-1) if eps == 0.0 else where(hit, s * (1.0 - eps + eps / n), s * (eps / n)).sum(-1)
    per_token = log(exp(s).sum(-1)) - target
    if kept is not None:
        per_token = where(kept, per_token, 0.0)
    if reduction != "mean":
        return per_token if reduction == "none" else per_token.sum()
    return per_token.mean() if kept is None else per_token.sum() / kept.astype(per_token.dtype_name).sum()


@_one_plan
def logsumexp(x, axis=None, keepdims=False):
    """log(sum(exp(x))) over `axis` (None: every axis) without overflow (jax.nn.logsumexp): the max
    (held constant by sf.grad; 0 where it is not finite, so a row of -inf gives -inf, not NaN)
    shifted out and added back.  16-bit values in float32, the result cast back."""
    x, dtype = _widened(x)
    m = x.max(axis, keepdims=True)
    m = stop_gradient(where(np.isfinite(m), m, 0.0))
    total = exp(x - m).sum(axis, keepdims=keepdims)
    return (log(total) + m.reshape(total.shape)).astype(dtype)  # (m: as many elements as total)


def one_hot(x, num_classes, dtype="float32", axis=-1):
    """jax.nn.one_hot: x (integer class ids, traced or an sf.Array) as 1.0 at each id along a new
    axis of num_classes entries (last by default), 0.0 elsewhere; an id outside [0, num_classes)
    gives a row of zeros.  The ids are compared with a constant np.arange(num_classes)."""
    if not _int_array(x) and not (hasattr(type(x), "one_op") and np.dtype(x.dtype).kind in "iu"):
        where = "" if isinstance(x, Traced) or hasattr(type(x), "one_op") else \
            " (sf.nn takes values inside sf.jit or sf.Arrays: place it with sf.replicate(x, mesh=mesh))"
        raise TypeError(f"sf.nn.one_hot: x must be integer class ids (int32 or int64), got {describe(x)}{where}")
    if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(f"sf.nn.one_hot: num_classes must be a positive int, got {num_classes!r}"
                         f"{static_advice(num_classes)}")
    return _one_hot(x, int(num_classes), np.dtype(dtype).name if not isinstance(dtype, str) else dtype, axis)


@_one_plan
def _one_hot(x, n, dtype, axis):
    hit = x.reshape(tuple(x.shape) + (1,)) == np.arange(n, dtype=x.dtype)  # (a constant)
    hit = hit.astype(dtype)
    return hit if axis in (-1, hit.ndim - 1) else np.moveaxis(hit, -1, axis)


def _int_array(v) -> bool:
    return isinstance(v, Traced) and v.dtype_name in ("int32", "int64")


def dropout(key, x, rate):
    """Inverted dropout (torch.nn.functional.dropout in training, flax's Dropout): each element of x
    zeroed with probability `rate` and the others scaled by 1 / (1 - rate), so E[result] = x; the
    mask is sf.random.bernoulli(key, 1 - rate, x.shape) (counter-based: computed where x's pieces
    lie, with no communication, the same on every mesh).  rate 0 returns x, rate 1 zeros.  Inside
    sf.jit, and outside it on sf.Arrays (one plan) or NumPy arrays (on the host); its gradient is
    the same mask, scaled (sf.grad).  Pass a fresh key per step (sf.random.fold_in(key, step))."""
    from shardfuse import random

    if not is_scalar(rate) or not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"sf.nn.dropout: rate must be a number in [0, 1], got {rate!r}")
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or np.dtype(x.dtype).kind != "f" and \
            np.dtype(x.dtype).name != "bfloat16":
        raise TypeError(f"sf.nn.dropout: x must be a float array, got {describe(x)}")
    if float(rate) == 0.0:
        return x
    return random.apply_keyed(_dropout, "nn.dropout", None, random.check_key(key, "nn.dropout"), x, float(rate))


def _dropout(key, x, rate):
    from shardfuse import random

    if rate == 1.0:
        return np.zeros_like(x)
    return attn.kept(x, random.bernoulli(key, 1.0 - rate, tuple(x.shape)), rate)


__all__ += [dropout.__name__]

# jax.nn's other activations (shardfuse/nn_activations.py: JAX's own formulas), one plan each on sf.Arrays
log_sigmoid, softplus, leaky_relu, elu, celu, selu, glu, hard_tanh, soft_sign, standardize = (_one_plan(f) for f in (
    act.log_sigmoid, act.softplus, act.leaky_relu, act.elu, act.celu, act.selu, act.glu, act.hard_tanh, act.soft_sign,
    act.standardize))
relu, sigmoid, swish = act.relu, act.sigmoid, silu  # (ops of their own: on sf.Arrays already)
__all__ += [f.__name__ for f in act.ACTIVATIONS if f.__name__ not in __all__] + ["swish"]
