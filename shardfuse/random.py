"""sf.random: random numbers with explicit keys, as jax.random (its names and argument orders),
inside sf.jit and outside it.

    key = sf.random.key(0)                              # a key: int64 [2] (two 32-bit words)
    key, sub = sf.random.split(key)                     # keys are values: split before each use

    @sf.jit(mesh=mesh)
    def sample(logits, key, temperature):               # a decode step: logits [batch, vocab]
        logits = sf.shard(logits, axis=1, over="tp")    # the vocabulary sharded
        return sf.random.categorical(key, logits / temperature)   # token ids [batch]: Gumbel-max

Counter-based (shardfuse/random_bits.py): the bits of element i of a result are a hash of the key
and of i, its flat index in the global array, alone.  So any sharding of a result holds the same
values, each device computing its own piece with no communication
(`sf.shard(sf.random.normal(key, (B, V)), axis=1, over="tp")` issues no collective), and a draw is
the same on every mesh, inside jit and outside it, and under any number of MPI ranks.  bits,
randint, bernoulli and uniform on [0, 1) are exact integer arithmetic and exact casts, so
bit-identical on every backend too; uniform on another range rounds a multiply and an add (a GPU
kernel may fuse them), and normal and gumbel (and categorical, through gumbel) pass through log /
sqrt / cos, whose last bit may differ between NumPy and CUDA.  Not cryptographic.

Keys are NumPy int64 arrays of shape (2,) holding two 32-bit words (shardfuse has no uint32;
`np.asarray(key).astype(np.uint32)` is JAX's layout).  They are arguments of jitted functions like
any array (traced there), or constants of one; int32 keys (the words' bit patterns) and uint32
keys are taken too.  Outside jit a function computes where its key lives: on the key's mesh for an
`sf.Array` key (`sf.random.key(seed, mesh=mesh)`), on mesh= for a NumPy key given one (one cached
plan either way, its result a replicated sf.Array), else on the host in NumPy (the same bits).

Differences from jax.random: split returns a tuple of keys (unpack it, index it), not a [num, 2]
array, because a traced value does not iterate; key(seed) hashes the seed (JAX's raw key is
[0, seed]); categorical's ids are int64 (NumPy's argmax); there is no permutation (no sort op).
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import constants, dtypes
from shardfuse.api import replicate
from shardfuse.random_bits import (FOLD, M32, SEED, SPLIT, WORD, const, counters, grid, hash_words, inside,
                                   key_words, lift, nwords_of, words)
from shardfuse.traced import Traced, describe, is_scalar

__all__ = ["key", "PRNGKey", "split", "fold_in", "bits", "uniform", "normal", "truncated_normal", "bernoulli", "randint",
           "gumbel",
           "categorical", "permutation"]

_FLOATS_16 = ("float16", "bfloat16")  # drawn in float32, rounded once


def apply_keyed(fn, name: str, mesh, *args):
    """fn(*args) where it runs (args[0] a key, checked): traced into the function sf.jit is tracing
    (NumPy arrays among args its constants); outside jit as one cached plan on the mesh of the
    sf.Arrays among args, or on mesh= (a NumPy key replicated there); else on the host in NumPy."""
    builder = next((a.builder for a in args if isinstance(a, Traced)), None) or constants.active()
    if builder is not None:
        return fn(*(builder.constant(a) for a in args))
    homes = {a.mesh for a in args if hasattr(type(a), "one_op")}  # (sf.Arrays)
    if mesh is not None:
        homes.add(mesh)
    if len(homes) > 1:
        raise ValueError(f"sf.{name}: the key and arrays live on different meshes ({', '.join(map(str, homes))}); "
                         "place them on one (sf.random.key(seed, mesh=mesh), sf.replicate(x, mesh=mesh))")
    if not homes:
        return fn(*args)
    if not hasattr(type(args[0]), "one_op"):
        args = (replicate(args[0], mesh=homes.pop()), *args[1:])
    return args[0].one_op(fn, args, name)


def check_key(k, what: str):
    """k, checked to be a key (before anything runs): a NumPy one as int64."""
    shape, dt = getattr(k, "shape", None), getattr(k, "dtype", None)
    name = np.dtype(dt).name if dt is not None and not isinstance(dt, str) else dt
    if isinstance(k, Traced) or hasattr(type(k), "one_op"):
        ok = name in ("int32", "int64")
    else:
        ok = isinstance(k, np.ndarray) and name in ("int32", "int64", "uint32", "uint64")
    if not ok or tuple(shape) != (2,):
        got = describe(k) if isinstance(k, Traced) else f"{type(k).__name__} (shape {shape}, dtype {name})" \
            if shape is not None else repr(k)
        raise TypeError(f"sf.{what if '.' in what else 'random.' + what}: a key was expected (an integer array of shape (2,) from "
                        f"sf.random.key(seed) or sf.random.split), got {got}")
    return k.astype(np.int64) if isinstance(k, np.ndarray) and name != "int64" else k


def _shape(shape, what: str) -> tuple:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise TypeError(f"sf.random.{what}: shape must be a tuple of non-negative ints, got {shape!r}")
    return tuple(int(n) for n in shape)


def _float(dtype, what: str) -> str:
    name = dtypes.normalize_dtype(dtype)
    if not dtypes.is_float(name):
        raise TypeError(f"sf.random.{what}: dtype must be a float dtype ({', '.join(dtypes.FLOATS)}), got {name}")
    return name


def _word(w) -> np.ndarray:
    return np.array(int(w) & M32, np.int64)


# ---- keys -----------------------------------------------------------------------------------------
def key(seed, mesh=None):
    """A key from an integer seed (jax.random.key / PRNGKey): a Python or NumPy int (any size:
    taken mod 2**64), or a 0-d integer array inside sf.jit.  A NumPy int64 array of shape (2,)
    (the seed hashed into two 32-bit words); with mesh=, an sf.Array replicated on it."""
    if isinstance(seed, Traced) or hasattr(type(seed), "one_op"):
        if seed.shape != () or np.dtype(seed.dtype).name not in ("int32", "int64"):
            raise TypeError(f"sf.random.key: a seed is an integer, got {describe(seed)}")
        return apply_keyed(_seed_key, "random.key", mesh, seed)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"sf.random.key: a seed is an integer, got {seed!r}")
    signed = (int(seed) + (1 << 63)) % (1 << 64) - (1 << 63)  # (mod 2**64, as an int64)
    k = _seed_key(np.array(signed, np.int64))
    return k if mesh is None else replicate(k, mesh=mesh)


PRNGKey = key


def _seed_key(seed):
    s = seed.astype(np.int64)
    lo, hi = s & const(M32), (s // const(WORD)) & const(M32)
    return hash_words(hi ^ const(SEED[0]), lo ^ const(SEED[1]), counters(seed, (2,), 1), wide=False)


def split(key, num: int = 2):
    """num new keys from key as one [num, 2] array, as jax.random.split's: unpacked (`key, sub =
    sf.random.split(key)`), indexed (`keys[j]`) or scanned over (sf.lax.scan's xs: a key per step)."""
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or not 1 <= num <= 1 << 30:
        raise ValueError(f"sf.random.split: num must be a positive int, got {num!r}")
    return apply_keyed(_split, "random.split", None, check_key(key, "split"), int(num))


def _split(key, num):
    k0, k1 = key_words(key, SPLIT)
    return hash_words(k0, k1, counters(key, (num, 2), 1), wide=False)


def fold_in(key, data):
    """A new key from key and an integer (jax.random.fold_in): a Python int (its low 32 bits), or a
    0-d integer array (a step counter or a rank passed to a jitted function)."""
    if isinstance(data, bool) or not (isinstance(data, (int, np.integer)) or getattr(data, "shape", None) == ()):
        raise TypeError(f"sf.random.fold_in: data must be an int or a 0-d integer array, got {data!r}")
    if isinstance(data, (int, np.integer)) or isinstance(data, np.ndarray) and data.dtype.kind in "iu":
        data = _word(data)  # (a host integer of any width: its low 32 bits, as JAX's uint32 data)
    elif np.dtype(data.dtype).name not in ("int32", "int64"):
        raise TypeError(f"sf.random.fold_in: data must be an integer, got dtype {np.dtype(data.dtype).name}")
    return apply_keyed(_fold_in, "random.fold_in", None, check_key(key, "fold_in"), data)


def _fold_in(key, data):
    k0, k1 = key_words(key, FOLD)
    c = (data.astype(np.int64) & const(M32)) * 2 + lift(key, np.arange(2, dtype=np.int64))
    return hash_words(k0, k1, c, wide=True)


# ---- draws ----------------------------------------------------------------------------------------
def bits(key, shape=(), *, mesh=None):
    """Random 32-bit words of `shape`, int64 in [0, 2**32) (jax.random.bits' uint32, widened)."""
    return apply_keyed(_bits, "random.bits", mesh, check_key(key, "bits"), _shape(shape, "bits"))


def _bits(key, shape):
    return words(key, shape, 1)[0]


def uniform(key, shape=(), dtype="float32", minval=0.0, maxval=1.0, *, mesh=None):
    """Uniform floats in [minval, maxval) (jax.random.uniform; minval, maxval Python numbers): the
    grid of 2**-m (m the dtype's significant bits: 24 for float32, 53 for float64, 8 for bfloat16)
    mapped affinely (16-bit dtypes in float32) and kept inside [minval, maxval) after rounding."""
    dt = _float(dtype, "uniform")
    if not (is_scalar(minval) and is_scalar(maxval)):
        raise TypeError(f"sf.random.uniform: minval and maxval must be numbers, got {minval!r} and {maxval!r}")
    lo, hi = float(minval), float(maxval)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi and math.isfinite(hi - lo)):
        raise ValueError(f"sf.random.uniform: minval < maxval (both finite) is needed, got {minval!r} and {maxval!r}")
    return apply_keyed(_uniform, "random.uniform", mesh, check_key(key, "uniform"), _shape(shape, "uniform"), dt, lo, hi)


def _uniform(key, shape, dt, lo, hi):
    u = grid(words(key, shape, nwords_of(dt)), dt)
    if (lo, hi) == (0.0, 1.0):
        return u
    wide = "float32" if dt in _FLOATS_16 else dt
    v = (u.astype(dtypes.np_dtype(wide)) * (hi - lo) + lo).astype(dtypes.np_dtype(dt))
    return np.minimum(np.maximum(v, inside(lo, dt, up=True)), inside(hi, dt, up=False))


def normal(key, shape=(), dtype="float32", *, mesh=None):
    """Standard normal floats (jax.random.normal), by Box-Muller from two uniforms per element
    (float32 for 16-bit dtypes, then rounded); |x| stays below 5.8 in float32, 8.6 in float64."""
    dt = _float(dtype, "normal")
    return apply_keyed(_normal, "random.normal", mesh, check_key(key, "normal"), _shape(shape, "normal"), dt)


def _normal(key, shape, dt):
    work = "float32" if dt in _FLOATS_16 else dt
    n = nwords_of(work)
    ws = words(key, shape, 2 * n)
    radius = np.sqrt(np.log(grid(ws[:n], work, half=True)) * -2.0)
    return (radius * np.cos(grid(ws[n:], work) * (2 * math.pi))).astype(dtypes.np_dtype(dt))


def truncated_normal(key, lower, upper, shape=(), dtype="float32", *, mesh=None):
    """Standard normal floats truncated to (lower, upper) (jax.random.truncated_normal; bounds Python numbers,
    +-inf allowed): a uniform in (erf(lower / sqrt 2), erf(upper / sqrt 2)) mapped back by sqrt 2 erfinv (an
    approximation refined by two Newton steps on erf, in float32 for 16-bit dtypes), inside the bounds."""
    dt = _float(dtype, "truncated_normal")
    if not (is_scalar(lower) and is_scalar(upper)) or not float(lower) < float(upper):
        raise ValueError(f"sf.random.truncated_normal: lower < upper (numbers) is needed, got {lower!r} and {upper!r}")
    return apply_keyed(_truncated_normal, "random.truncated_normal", mesh, check_key(key, "truncated_normal"),
                       _shape(shape, "truncated_normal"), dt, float(lower), float(upper))


def _truncated_normal(key, shape, dt, lower, upper):
    work = "float32" if dt in _FLOATS_16 else dt
    a, b = (math.erf(v / math.sqrt(2.0)) for v in (lower, upper))
    x = _erfinv(_uniform(key, shape, work, a, b))
    out = (x * math.sqrt(2.0)).astype(dtypes.np_dtype(dt))
    lo, hi = (np.nextafter(dtypes.np_dtype(dt).type(v), dtypes.np_dtype(dt).type(d)) for v, d in ((lower, 1), (upper, -1)))
    return np.minimum(np.maximum(out, lo), hi)


def _erfinv(y):
    """erf's inverse: Giles' single-precision approximation ("Approximating the erfinv function", 2010), then two
    Newton steps on erf (as fine as erf itself in float64)."""
    from shardfuse.numpy_math import erf

    def erf_of(x):  # (on the host, math.erf per element: NumPy has none)
        return np.vectorize(math.erf)(x).astype(x.dtype) if isinstance(x, np.ndarray) else erf(x)
    w = -np.log((1.0 - y) * (1.0 + y))
    near, far = w - 2.5, np.sqrt(np.maximum(w, 5.0)) - 3.0
    p, q = 2.81022636e-08, -0.000200214257
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503, -0.00417768164,
              0.246640727, 1.50140941):
        p = c + p * near
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613, 0.00943887047,
              1.00167406, 2.83297682):
        q = c + q * far
    x = np.where(w < 5.0, p, q) * y
    for _ in range(2):
        x = x - (erf_of(x) - y) * (math.sqrt(math.pi) / 2) * np.exp(x * x)
    return x


def gumbel(key, shape=(), dtype="float32", *, mesh=None):
    """Standard Gumbel floats, -log(-log(u)) of u in (0, 1) (jax.random.gumbel)."""
    dt = _float(dtype, "gumbel")
    return apply_keyed(_gumbel, "random.gumbel", mesh, check_key(key, "gumbel"), _shape(shape, "gumbel"), dt)


def _gumbel(key, shape, dt):
    work = "float32" if dt in _FLOATS_16 else dt
    u = grid(words(key, shape, nwords_of(work)), work, half=True)
    return (-np.log(-np.log(u))).astype(dtypes.np_dtype(dt))


def bernoulli(key, p=0.5, shape=None, *, mesh=None):
    """Booleans, True with probability p (jax.random.bernoulli): p a number in [0, 1] or an array
    (float64 ones compared with float64 uniforms, others with float32); shape defaults to p's."""
    if is_scalar(p):
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"sf.random.bernoulli: p must be in [0, 1], got {p!r}")
        p_shape = ()
    elif hasattr(p, "shape") and hasattr(p, "dtype") and dtypes.is_float(np.dtype(p.dtype).name):
        p_shape = tuple(p.shape)
    else:
        raise TypeError(f"sf.random.bernoulli: p must be a number or a float array, got {p!r}")
    shape = p_shape if shape is None else _shape(shape, "bernoulli")
    if np.broadcast_shapes(p_shape, shape) != shape:
        raise ValueError(f"sf.random.bernoulli: p of shape {p_shape} does not broadcast to shape {shape}")
    return apply_keyed(_bernoulli, "random.bernoulli", mesh, check_key(key, "bernoulli"), p, shape)


def _bernoulli(key, p, shape):
    dt = "float64" if getattr(p, "dtype", None) == np.float64 else "float32"
    return grid(words(key, shape, nwords_of(dt)), dt) < p


def randint(key, shape, minval, maxval, dtype="int32", *, mesh=None):
    """Integers in [minval, maxval) (jax.random.randint; Python ints), int32 or int64: 63 random
    bits per element reduced mod the span (maxval - minval): a bias below span / 2**63, so below
    2**-31 for spans up to 2**32 (every int32 range) and none for powers of two; an int64 span near
    2**62 is strongly biased (low values up to twice as likely)."""
    dt = dtypes.normalize_dtype(dtype)
    if dt not in ("int32", "int64"):
        raise TypeError(f"sf.random.randint: dtype must be int32 or int64, got {dt}")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (minval, maxval)):
        raise TypeError(f"sf.random.randint: minval and maxval must be ints, got {minval!r} and {maxval!r}")
    info = np.iinfo(dt)
    if not info.min <= int(minval) < int(maxval) <= int(info.max) + 1 or int(maxval) - int(minval) > 1 << 62:
        raise ValueError(f"sf.random.randint: minval < maxval within {dt} (a span of at most 2**62) is needed, "
                         f"got {minval!r} and {maxval!r}")
    return apply_keyed(_randint, "random.randint", mesh, check_key(key, "randint"), _shape(shape, "randint"),
                       int(minval), int(maxval), dt)


def _randint(key, shape, lo, hi, dt):
    w0, w1 = words(key, shape, 2)
    r = (w0 * (1 << 31) + w1 // const(2)) % const(hi - lo)
    return (r + lo).astype(dtypes.np_dtype(dt))


def categorical(key, logits, axis=-1, shape=None, *, mesh=None):
    """Class ids drawn with probabilities softmax(logits) along `axis` (jax.random.categorical):
    argmax(logits + Gumbel noise), the noise in the logits' dtype (float32 for 16-bit ones).  shape:
    the result's (default: logits' without `axis`), leading axes beyond it drawn independently.
    With the classes sharded each device draws its own noise and the argmax costs two Allreduces
    of the result's size (max, then the least index reaching it); the logits are never gathered."""
    lshape = getattr(logits, "shape", None)
    if lshape is None or not lshape or not dtypes.is_float(np.dtype(logits.dtype).name):
        raise TypeError(f"sf.random.categorical: logits must be a float array of at least one axis, got "
                        f"{describe(logits) if isinstance(logits, Traced) else repr(logits)}")
    lshape = tuple(lshape)
    ax = axis + len(lshape) if isinstance(axis, int) and -len(lshape) <= axis < 0 else axis
    if isinstance(ax, bool) or not isinstance(ax, int) or not 0 <= ax < len(lshape):
        raise ValueError(f"sf.random.categorical: axis {axis!r} is out of range for logits of shape {lshape}")
    batch = lshape[:ax] + lshape[ax + 1:]
    shape = batch if shape is None else _shape(shape, "categorical")
    if len(shape) < len(batch) or np.broadcast_shapes(batch, shape[len(shape) - len(batch):]) != \
            shape[len(shape) - len(batch):]:
        raise ValueError(f"sf.random.categorical: shape {shape} must end with the logits' batch shape {batch}")
    noise = shape[:len(shape) - len(batch)] + shape[len(shape) - len(batch):][:ax] + (lshape[ax],) + \
        shape[len(shape) - len(batch):][ax:]
    return apply_keyed(_categorical, "random.categorical", mesh, check_key(key, "categorical"), logits, noise,
                       len(shape) - len(batch) + ax)


def _categorical(key, logits, noise, ax):
    dt = np.dtype(logits.dtype).name
    # (int32, as jax.random.categorical's and this module's randint: a README probe found int64)
    return (logits + _gumbel(key, noise, "float32" if dt in _FLOATS_16 else dt)).argmax(ax).astype("int32")


def permutation(key, x, axis=0, independent=False, *, mesh=None):
    """A random permutation (jax.random.permutation): of range(x) for an int x (int64), else x's
    elements shuffled along `axis` (x an array: sf.take of the permutation; independent=False only, one
    permutation for the whole axis).  The order of 63 random bits per position (np.argsort of them,
    stable: a tie, about n**2 / 2**64 likely, keeps the lower position first); the same permutation
    on every mesh and backend and on the host."""
    if independent:
        raise NotImplementedError("sf.random.permutation(independent=True): one permutation per row is not "
                                  "supported; draw keys per row and stack the permutations")
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        if int(x) < 1:
            raise ValueError(f"sf.random.permutation: the number of elements must be positive, got {x!r}")
        return apply_keyed(_permutation, "random.permutation", mesh, check_key(key, "permutation"), int(x))
    shape = getattr(x, "shape", None)
    if not shape:
        raise TypeError(f"sf.random.permutation: x must be an int or an array of at least one axis, got {x!r}")
    ax = axis + len(shape) if isinstance(axis, int) and -len(shape) <= axis < 0 else axis
    if isinstance(ax, bool) or not isinstance(ax, int) or not 0 <= ax < len(shape):
        raise ValueError(f"sf.random.permutation: axis {axis!r} is out of range for x of shape {tuple(shape)}")
    return apply_keyed(_shuffled, "random.permutation", mesh, check_key(key, "permutation"), x, ax)


def _permutation(key, n):
    w0, w1 = words(key, (n,), 2)
    return np.argsort(w0 * (1 << 31) + w1 // const(2), kind="stable")


def _shuffled(key, x, ax):
    from shardfuse.take import take

    order = _permutation(key, x.shape[ax])
    return take(x, order, axis=ax) if isinstance(x, Traced) else np.take(x, order, axis=ax)
