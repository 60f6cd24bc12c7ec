"""The counter-based bits under sf.random (shardfuse/random.py): one 32-bit word per (key, counter),
composed of shardfuse's integer ops, so that the word of element i of a result depends on the key
and on i (its flat index in the global array) alone.  Any sharding of the result then holds the
same values, each device computes its own piece from its own indices (no communication), and a
draw is the same on every mesh, backend and number of MPI ranks.

The hash: two keyed rounds of lowbias32 (Chris Wellons' hash-prospector) with the constants
TheIronBorn found in 2022 (its README's best two-multiply 32-bit permutation, avalanche bias 0.108;
also the finalizer of common splitmix32 ports):

    lowbias32(x) = x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15
    word(k, c)   = lowbias32(lowbias32(c_lo ^ k0) ^ k1 ^ (c_hi * 0x9e3779b9 mod 2**32))

(c_hi, the counter's bits above 32, is 0 below 2**32 elements and costs nothing there.)  Why this
one: shardfuse has no uint32 and no shift ops (int32 / int64 with + - * // % & | ^), and lowbias32
needs only xor, right shifts and two multiplies mod 2**32.  Words are held in int64 in [0, 2**32)
and a right shift is `// 2**k` of a non-negative value; both multipliers are below 2**31, so a
word times one is below 2**63 and exact in int64, then `& (2**32 - 1)` (mul32; a larger constant
is multiplied in 16-bit halves).  Exact integer arithmetic, one meaning on every backend, relying
on no signed wraparound (undefined in CUDA C++): a round is ten elementwise steps.  Philox-2x32
would need the high half of 32x32-bit products (four partial products each here) and ten rounds:
several times the steps.  NOT cryptographic: a statistical generator for sampling and dropout
(the tests check moments, Kolmogorov-Smirnov distances, frequencies and the avalanche of every
counter bit), never for secrets.

Every function here works alike on traced values (inside sf.jit: each op one step of the plan)
and on NumPy int64 arrays (the host reference, and keys made outside jit): the operators are the
same, and the NumPy constants below become constants of a traced program where they meet one.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from shardfuse.dtypes import np_dtype
from shardfuse.traced import Traced

M32 = 0xFFFFFFFF
WORD = 1 << 32
# Domains: a key's words are tweaked by a pair of these before hashing (the digits of pi, nothing
# up the sleeve), so that the keys split / fold_in / key make are not the bits a draw reads.
SAMPLE, SEED, SPLIT, FOLD = (0, 0), (0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
_GOLDEN = 0x9E3779B9  # the counter's high word, spread (2**32 / golden ratio)
_MANTISSA = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53}  # significant bits: exact grids


@functools.lru_cache(maxsize=None)
def const(v: int) -> np.ndarray:
    """v as a 0-d int64 array, one object per value: in a traced program a 0-d constant input (one
    per value, shared by its uses) rather than a full_like of the operand's shape per use."""
    a = np.array(v, np.int64)
    a.setflags(write=False)
    return a


def lift(like, a: np.ndarray):
    """A NumPy array as a value of the program `like` is traced in (a replicated constant); as it
    is on the host."""
    return like.builder.constant(a) if isinstance(like, Traced) else a


def mul32(x, c: int):
    """x * c mod 2**32 for words x (int64 in [0, 2**32)) and a Python int 0 <= c < 2**32: one
    product below 2**63 where c < 2**31, else two of at most 48 bits: no int64 overflows."""
    if c < 1 << 31:
        return (x * c) & const(M32)
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & const(0xFFFF)) * 65536) & const(M32)


def _xorshift(x, k: int):
    return x ^ (x // const(1 << k))  # (x >> k of a non-negative x)


def lowbias32(x):
    """Wellons' lowbias32 of words x (int64 in [0, 2**32)): a bijection, no two inputs alike."""
    x = mul32(_xorshift(x, 16), 0x21F0AAAD)
    x = mul32(_xorshift(x, 15), 0x735A2D97)
    return _xorshift(x, 15)


def key_words(key, domain=SAMPLE) -> tuple:
    """(k0, k1): a key's two words (0-d), tweaked for `domain`.  A key of int32 holds them as bit
    patterns (a negative word is its two's complement), of int64 as values."""
    k = key.astype("int64") & const(M32)
    return tuple(k[j] ^ const(domain[j]) if domain[j] else k[j] for j in (0, 1))


def hash_words(k0, k1, counters, wide: bool):
    """The word of every counter (int64 >= 0) under the key words (k0, k1); `wide` where a counter
    may reach 2**32 (the high word then enters the second round)."""
    lo = counters & const(M32) if wide else counters
    x = lowbias32(lo ^ k0) ^ k1
    if wide:
        x = x ^ mul32(counters // const(WORD), _GOLDEN)
    return lowbias32(x)


def counters(like, shape: tuple, nwords: int):
    """flat index * nwords of every element of `shape` (int64): one np.arange constant per axis,
    broadcast and summed, so a device holding a block of the result computes its block alone."""
    strides = [math.prod(shape[a + 1:]) * nwords for a in range(len(shape))]
    total = None
    for ax, n in enumerate(shape):
        r = lift(like, _axis_counters(n, strides[ax], ax, len(shape)))
        total = r if total is None else total + r
    return lift(like, const(0)) if total is None else total


@functools.lru_cache(maxsize=256)
def _axis_counters(n: int, stride: int, ax: int, ndim: int) -> np.ndarray:
    a = (np.arange(n, dtype=np.int64) * stride).reshape((1,) * ax + (n,) + (1,) * (ndim - ax - 1))
    a.setflags(write=False)
    return a


def words(key, shape: tuple, nwords: int) -> list:
    """nwords words per element of `shape`: word w of element i is the hash of counter i * nwords + w."""
    k0, k1 = key_words(key)
    base = counters(key, shape, nwords)
    wide = math.prod(shape) * nwords > WORD
    return [hash_words(k0, k1, base if w == 0 else base + w, wide) for w in range(nwords)]


def nwords_of(dtype: str) -> int:
    """Words per uniform of `dtype`: one for 8 to 24 significant bits, two for float64's 53."""
    return 2 if _MANTISSA[dtype] > 32 else 1


def grid(ws: list, dtype: str, half: bool = False):
    """Uniform floats of dtype in [0, 1), multiples of 2**-m (m: its significant bits, so each one
    is exact), from the words ws (nwords_of(dtype) of them); with `half`, in (0, 1): the grid of
    2**-(m - 1) moved by half a step (log(u) and log(1 - u) both finite)."""
    m = _MANTISSA[dtype] - (1 if half else 0)
    if m <= 32:
        ints = ws[0] // const(1 << (32 - m))
    else:  # (m - 27 high bits of one word, 27 of the other: < 2**53, exact in float64)
        ints = (ws[0] // const(1 << (59 - m))) * (1 << 27) + ws[1] // const(1 << 5)
    dt = np_dtype(dtype)
    u = ints.astype(dt)
    # (scalars of the dtype: NumPy with ml_dtypes 0.6 takes bfloat16 * a Python float to float32)
    if half:
        u = u + dt.type(0.5)
    return u * dt.type(2.0 ** -m)


def inside(value: float, dtype: str, up: bool) -> float:
    """The value of dtype nearest to `value` on its side (>= it where `up`, else < it): the bounds a
    uniform's affine map, rounded to dtype, is clamped to ([minval, maxval) stays half-open)."""
    dt = np_dtype(dtype)
    v = np.array(value, dt)
    if (float(v) < value) if up else (float(v) >= value):
        v = np.nextafter(v, np.array(np.inf if up else -np.inf, dt))
    return float(v)
