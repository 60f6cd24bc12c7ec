"""sf.random and sf.nn.dropout (shardfuse/random.py, shardfuse/random_bits.py) on NumPy devices.

- the hash is what random_bits' docstring says (two keyed rounds of lowbias32, checked against a
  plain-Python uint32 version), the high word of counters >= 2**32 included;
- determinism: one key, one draw; keys made by key / split / fold_in all differ;
- the counter-based promise: every draw is bit-identical on the host (NumPy), inside sf.jit on 1, 2
  and 2x2 devices sharded along either axis or both, and eagerly on a mesh, and a sharded draw
  issues no collective (each device computes its own piece);
- statistics with fixed seeds and generous bounds (moments, ranges, a Kolmogorov-Smirnov distance
  against the normal and Gumbel CDFs, chi-square counts of randint and categorical against softmax,
  dropout's mean and zero rate), and the dtypes;
- bad arguments raise before anything runs (at trace time inside jit, before any plan outside).

tests/mpi/test_random_mpi.py runs `check_draw` under mpiexec: each rank's pieces equal these values.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import array_ops, random_bits

KEY = sf.random.key(1234)
LOGITS = np.linspace(-2.0, 3.0, 12 * 8).reshape(12, 8).astype(np.float32)
X = np.linspace(-1.0, 1.0, 12 * 8).reshape(12, 8).astype(np.float32)
DRAWS = {  # name -> a draw of shape (12, 8) (categorical: (12,)), from a key
    "bits": lambda k: sf.random.bits(k, (12, 8)),
    "uniform": lambda k: sf.random.uniform(k, (12, 8)),
    "uniform f64 [-3, 5)": lambda k: sf.random.uniform(k, (12, 8), np.float64, -3, 5),
    "uniform bf16": lambda k: sf.random.uniform(k, (12, 8), "bfloat16"),
    "normal": lambda k: sf.random.normal(k, (12, 8)),
    "normal f64": lambda k: sf.random.normal(k, (12, 8), "float64"),
    "normal bf16": lambda k: sf.random.normal(k, (12, 8), "bfloat16"),
    "gumbel": lambda k: sf.random.gumbel(k, (12, 8)),
    "bernoulli": lambda k: sf.random.bernoulli(k, 0.3, (12, 8)),
    "randint": lambda k: sf.random.randint(k, (12, 8), -5, 1000),
    "categorical": lambda k: sf.random.categorical(k, LOGITS),
    "dropout": lambda k: sf.nn.dropout(k, X, 0.25),
}
LAYOUTS = {  # name -> (mesh shape, axis names, one mesh axis (or None) per tensor axis)
    "1 device": ((1,), ("tp",), (None, "tp")),
    "D2 S0": ((2,), ("tp",), ("tp", None)),
    "D2 S1": ((2,), ("tp",), (None, "tp")),
    "2x2 S0 S1": ((2, 2), ("dp", "tp"), ("dp", "tp")),
    "2x2 S1 S0": ((2, 2), ("dp", "tp"), ("tp", "dp")),
}
_MESHES: dict = {}


def mesh_of(shape, names):
    if (shape, names) not in _MESHES:
        _MESHES[shape, names] = sf.DeviceMesh(shape, names, backend="numpy")
    return _MESHES[shape, names]


def annotated(y, spec):
    """y with axis a sharded over spec[a] (None: left as it is)."""
    for ax, over in enumerate(spec[:y.ndim]):
        if over is not None:
            y = sf.shard(y, axis=ax, over=over)
    return y


def same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert got.tobytes() == want.tobytes(), f"{(got != want).sum()} of {got.size} elements differ"


def check_pieces(arr, want):
    """Every piece this process holds equals the same box of the one-process values, bit for bit."""
    for s in arr.addressable_shards:
        same_bits(np.asarray(s.data).view(want.dtype), want[s.index])


def check_draw(name, mesh, spec, eager=True):
    """One draw inside sf.jit (the key an argument, the result sharded as spec says) and eagerly on
    the mesh: the same bits as on the host, in each piece and gathered."""
    want = np.asarray(DRAWS[name](KEY))
    f = sf.jit(lambda key: annotated(DRAWS[name](key), spec), mesh=mesh)
    got = f(KEY)
    check_pieces(got, want)
    same_bits(got.gather(), want)
    if eager:
        check_pieces(DRAWS[name](sf.random.key(1234, mesh=mesh)), want)


# ---- the hash --------------------------------------------------------------------------------------
def lowbias32_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def word_py(k0: int, k1: int, c: int) -> int:
    lo, hi = c & 0xFFFFFFFF, c >> 32
    return lowbias32_py(lowbias32_py(lo ^ k0) ^ k1 ^ ((hi * 0x9E3779B9) & 0xFFFFFFFF))


def test_the_hash_is_two_keyed_rounds_of_lowbias32():
    k0, k1 = (int(w) for w in KEY)
    got = np.asarray(sf.random.bits(KEY, (3, 5)))
    assert got.dtype == np.int64
    assert got.ravel().tolist() == [word_py(k0, k1, i) for i in range(15)]
    wide = np.array([0, 1, 2**32 - 1, 2**32, 2**32 + 7, 3 * 2**40 + 5], np.int64)
    hashed = random_bits.hash_words(np.int64(k0), np.int64(k1), wide, wide=True)
    assert hashed.tolist() == [word_py(k0, k1, int(c)) for c in wide]
    assert random_bits.hash_words(np.int64(k0), np.int64(k1), wide[:3], wide=False).tolist() == hashed[:3].tolist()
    xs = np.array([0, 1, 0xDEADBEEF, 2**32 - 1], np.int64)
    assert random_bits.lowbias32(xs).tolist() == [lowbias32_py(int(x)) for x in xs]
    for c in (2**31 - 1, 2**31, 2**32 - 1):  # (one product below 2**63, or two halves)
        assert int(random_bits.mul32(np.int64(2**32 - 1), c)) == ((2**32 - 1) * c) & 0xFFFFFFFF


def test_every_bit_is_balanced_neighbours_are_uncorrelated_and_counters_avalanche():
    b = np.asarray(sf.random.bits(KEY, (200_000,)))
    ones = ((b[:, None] >> np.arange(32)) & 1).mean(0)
    assert np.abs(ones - 0.5).max() < 0.01, ones
    u = np.asarray(sf.random.uniform(KEY, (200_000,)), np.float64)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    k0, k1 = random_bits.key_words(KEY)  # avalanche: flipping one counter bit flips each word bit half the time
    c = np.random.default_rng(0).integers(0, 2**32, 20_000)
    base = random_bits.hash_words(k0, k1, c, wide=False)
    for b in range(32):
        flipped = random_bits.hash_words(k0, k1, c ^ (1 << b), wide=False) ^ base
        assert np.abs(((flipped[:, None] >> np.arange(32)) & 1).mean(0) - 0.5).max() < 0.03, b


# ---- determinism and keys --------------------------------------------------------------------------
def test_same_key_same_values_and_new_keys_differ():
    same_bits(sf.random.normal(sf.random.key(1234), (50,)), sf.random.normal(KEY, (50,)))
    keys = [sf.random.key(s) for s in (0, 1, 2, -1, 2**32, 2**63 - 1, np.int64(7))]
    keys += list(sf.random.split(KEY, 4)) + [sf.random.fold_in(KEY, d) for d in (0, 1, 2**31, -1)]
    keys += [KEY, sf.random.key(np.uint64(2**64 - 1))]
    words = {tuple(int(w) for w in k) for k in keys}
    assert len(words) == len(keys) - 1, "two keys coincide"  # (-1 and 2**64 - 1 are one seed mod 2**64)
    assert all(k.dtype == np.int64 and k.shape == (2,) and 0 <= k.min() and k.max() < 2**32 for k in keys)
    a, b = sf.random.split(KEY)
    same_bits(a, sf.random.split(KEY, 2)[0])
    assert not np.array_equal(sf.random.uniform(a, (50,)), sf.random.uniform(b, (50,)))
    same_bits(sf.random.fold_in(KEY, 2**32 + 3), sf.random.fold_in(KEY, 3))  # (data: its low 32 bits, as JAX's)
    same_bits(sf.random.fold_in(KEY, np.array(3, np.uint32)), sf.random.fold_in(KEY, np.int64(3)))
    same_bits(sf.random.split(KEY.astype(np.int32), 3)[2], sf.random.split(KEY, 3)[2])  # (int32, uint32 keys)
    same_bits(sf.random.uniform(KEY.astype(np.uint32), (9,)), sf.random.uniform(KEY, (9,)))
    assert sf.random.PRNGKey is sf.random.key


def test_keys_and_their_draws_are_uncorrelated():
    draws = [sf.random.uniform(k, (100_000,), np.float64) for k in
             (sf.random.key(0), sf.random.key(1), *sf.random.split(KEY), sf.random.fold_in(KEY, 0),
              sf.random.fold_in(KEY, 1))]
    c = np.corrcoef(np.stack([np.asarray(d) for d in draws]))
    assert np.abs(c - np.eye(len(draws))).max() < 0.015, c


def test_keys_made_split_and_folded_inside_jit_equal_the_hosts():
    check_keys_inside_jit(mesh_of((2,), ("tp",)))


def check_keys_inside_jit(mesh):
    """A seed, a key and a step as arguments of a jitted function: its keys and draws are the host's."""
    @sf.jit(mesh=mesh)
    def f(seed, key, step):
        a, b, c = sf.random.split(sf.random.fold_in(key, step), 3)
        return sf.random.key(seed), c, sf.random.fold_in(b, 5), sf.random.normal(a, (4, 6))

    got = f(np.int64(-42), KEY, np.int32(7))
    a, b, c = sf.random.split(sf.random.fold_in(KEY, 7), 3)
    for g, w in zip(got, (sf.random.key(-42), c, sf.random.fold_in(b, 5), sf.random.normal(a, (4, 6)))):
        same_bits(g.gather(), w)
    made_inside = sf.jit(lambda x: x + sf.random.uniform(sf.random.key(3), x.shape), mesh=mesh)
    same_bits(made_inside(np.zeros((2, 3), np.float32)).gather(), sf.random.uniform(sf.random.key(3), (2, 3)))


# ---- one draw on every mesh and sharding -----------------------------------------------------------
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_a_draw_is_the_same_on_every_mesh_and_sharding(name, layout):
    shape, names, spec = LAYOUTS[layout]
    check_draw(name, mesh_of(shape, names), spec)


def test_a_sharded_draw_computes_each_piece_with_no_communication():
    mesh = mesh_of((2, 2), ("dp", "tp"))
    f = sf.jit(lambda key: sf.shard(sf.random.normal(key, (4, 16)), axis=1, over="tp"), mesh=mesh)
    plan = f.lower(KEY)
    assert plan.collectives() == {}
    text = str(plan)
    assert "ShardSlice const" in text and "i64[4, 16]" not in text  # (every int64 buffer a [4, 16:tp] piece)
    drop = sf.jit(lambda key, x: sf.nn.dropout(key, sf.shard(sf.shard(x, axis=0, over="dp"), axis=1), 0.1), mesh=mesh)
    assert drop.lower(KEY, X).collectives() == {}
    pick = sf.jit(lambda key, logits: sf.random.categorical(key, sf.shard(logits, axis=1)), mesh=mesh)
    assert pick.lower(KEY, LOGITS).collectives() == {"allreduce": 2}  # the argmax's two, never a gather


def test_dropout_is_differentiated_through_its_mask():
    mesh = mesh_of((2,), ("tp",))
    grad = sf.jit(sf.grad(lambda w, key: (sf.nn.dropout(key, sf.shard(w, axis=0), 0.25) ** 2).sum()), mesh=mesh)
    keep = np.asarray(sf.random.bernoulli(KEY, 0.75, X.shape))
    np.testing.assert_allclose(np.asarray(grad(X, KEY).gather()), np.where(keep, 2 * X / 0.75 ** 2, 0), rtol=1e-6)


# ---- statistics (fixed seeds; the bounds are many standard errors wide) ---------------------------
N = 200_000


def ks_distance(x, cdf) -> float:
    """The Kolmogorov-Smirnov distance between the sample x and a continuous CDF."""
    x = np.sort(np.asarray(x, np.float64))
    f = cdf(x)
    n = len(x)
    return float(max((np.arange(1, n + 1) / n - f).max(), (f - np.arange(n) / n).max()))


def normal_cdf(x):
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_uniform_moments_and_half_open_range(dtype):
    u = np.asarray(sf.random.uniform(sf.random.key(1), (N,), dtype))
    assert u.dtype == sf.random.uniform(KEY, (), dtype).dtype == np.dtype(u.dtype)
    u64 = u.astype(np.float64)
    assert 0.0 <= u64.min() and u64.max() < 1.0
    assert abs(u64.mean() - 0.5) < 0.005 and abs(u64.var() - 1 / 12) < 0.002
    v = np.asarray(sf.random.uniform(sf.random.key(2), (N,), dtype, minval=-3, maxval=5)).astype(np.float64)
    assert -3.0 <= v.min() and v.max() < 5.0 and abs(v.mean() - 1.0) < 0.04 and abs(v.var() - 64 / 12) < 0.1
    assert ks_distance(v, lambda t: (t + 3) / 8) < 0.01


def test_uniform_stays_below_maxval_where_rounding_would_reach_it():
    one = np.asarray(sf.random.uniform(KEY, (1000,), "bfloat16", 1.0, 1.0078125)).astype(np.float64)
    assert (one == 1.0).all()  # (no other bfloat16 lies in [1, 1 + 2**-7))
    near = np.asarray(sf.random.uniform(KEY, (N,), "float32", 0.0, 1e-30)).astype(np.float64)
    assert near.max() < 1e-30 and near.min() >= 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_normal_moments_and_ks_distance(dtype):
    z = np.asarray(sf.random.normal(sf.random.key(3), (N,), dtype))
    assert z.dtype == (np.float32 if dtype == "float32" else np.float64 if dtype == "float64" else z.dtype)
    z = z.astype(np.float64)
    assert abs(z.mean()) < 0.01 and abs(z.var() - 1) < 0.02 and np.isfinite(z).all()
    assert ks_distance(z, normal_cdf) < (0.01 if dtype == "bfloat16" else 0.006)  # (1% critical value: 0.0036)
    assert np.abs(z).max() < (8.6 if dtype == "float64" else 5.8)


def test_gumbel_moments_and_ks_distance():
    g = np.asarray(sf.random.gumbel(sf.random.key(4), (N,))).astype(np.float64)
    assert abs(g.mean() - 0.5772156649) < 0.015 and abs(g.var() - math.pi ** 2 / 6) < 0.05
    assert ks_distance(g, lambda t: np.exp(-np.exp(-t))) < 0.006


def test_bernoulli_rates():
    assert abs(np.asarray(sf.random.bernoulli(sf.random.key(5), 0.3, (N,))).mean() - 0.3) < 0.005
    p = np.array([0.0, 0.1, 0.5, 0.9, 1.0])
    b = np.asarray(sf.random.bernoulli(sf.random.key(6), p, (N // 5, 5)))
    assert b.dtype == np.bool_ and b.shape == (N // 5, 5)
    np.testing.assert_allclose(b.mean(0), p, atol=0.01)
    assert sf.random.bernoulli(KEY, p).shape == (5,) and np.asarray(sf.random.bernoulli(KEY)).shape == ()


def chi_square(counts, expected) -> float:
    return float((((counts - expected) ** 2) / expected).sum())


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_randint_range_and_near_uniform_counts(dtype):
    r = np.asarray(sf.random.randint(sf.random.key(7), (N,), -3, 7, dtype))
    assert r.dtype == np.dtype(dtype) and r.min() == -3 and r.max() == 6
    assert chi_square(np.bincount(r + 3, minlength=10), N / 10) < 40  # (9 degrees of freedom: 99.99% at 33.7)
    big = np.asarray(sf.random.randint(sf.random.key(8), (N,), -2**40, 2**40, "int64")).astype(np.float64)
    assert -2**40 <= big.min() and big.max() < 2**40 and abs(big.mean()) < 0.01 * 2**40
    edge = np.asarray(sf.random.randint(KEY, (1000,), 2**31 - 2, 2**31, "int32"))
    assert set(edge.tolist()) == {2**31 - 2, 2**31 - 1}


def test_categorical_frequencies_follow_softmax():
    logits = np.array([1.0, -0.5, 2.0, 0.0, -3.0], np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    ids = np.asarray(sf.random.categorical(sf.random.key(9), np.broadcast_to(logits, (N, 5))))
    assert ids.shape == (N,) and ids.dtype == np.int32 and ids.min() >= 0 and ids.max() <= 4  # (int32: JAX's)
    assert chi_square(np.bincount(ids, minlength=5), N * p) < 30  # (4 degrees of freedom: 99.99% at 23.5)
    cols = np.asarray(sf.random.categorical(sf.random.key(10), logits[:, None], axis=0, shape=(N // 4, 1)))
    assert cols.shape == (N // 4, 1) and chi_square(np.bincount(cols.ravel(), minlength=5), N / 4 * p) < 30
    masked = np.where(np.arange(5) == 2, -np.inf, logits).astype(np.float32)
    assert 2 not in np.asarray(sf.random.categorical(KEY, np.broadcast_to(masked, (1000, 5)))).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_dropout_keeps_the_mean_and_zeroes_about_rate(dtype):
    x = np.ones(N, dtype=sf.random.uniform(KEY, (), dtype).dtype)
    y = np.asarray(sf.nn.dropout(sf.random.key(11), x, 0.3))
    assert y.dtype == x.dtype
    assert abs((y == 0).mean() - 0.3) < 0.005 and abs(y.astype(np.float64).mean() - 1.0) < 0.015
    assert set(np.unique(y.astype(np.float64)).tolist()) <= {0.0, float(np.asarray(1 / 0.7, x.dtype))}
    assert sf.nn.dropout(KEY, x, 0) is x and not np.asarray(sf.nn.dropout(KEY, x, 1.0)).any()


# ---- errors, raised before anything runs ----------------------------------------------------------
BAD = {
    "a seed for a key": (lambda: sf.random.normal(0, (3,)), TypeError, "a key was expected"),
    "a float key": (lambda: sf.random.uniform(np.zeros(2), (3,)), TypeError, "a key was expected"),
    "a key of 3 words": (lambda: sf.random.split(np.zeros(3, np.int64)), TypeError, "shape \\(2,\\)"),
    "a negative extent": (lambda: sf.random.normal(KEY, (2, -1)), TypeError, "non-negative ints"),
    "a float extent": (lambda: sf.random.uniform(KEY, (2.5,)), TypeError, "non-negative ints"),
    "minval >= maxval": (lambda: sf.random.uniform(KEY, (3,), minval=1.0, maxval=1.0), ValueError, "minval < maxval"),
    "an int dtype for normal": (lambda: sf.random.normal(KEY, (3,), "int32"), TypeError, "float dtype"),
    "randint's empty range": (lambda: sf.random.randint(KEY, (3,), 5, 5), ValueError, "minval < maxval"),
    "randint outside int32": (lambda: sf.random.randint(KEY, (3,), 0, 2**31 + 1), ValueError, "within int32"),
    "randint of floats": (lambda: sf.random.randint(KEY, (3,), 0.0, 2), TypeError, "must be ints"),
    "p above 1": (lambda: sf.random.bernoulli(KEY, 1.5, (3,)), ValueError, "in \\[0, 1\\]"),
    "p that does not broadcast": (lambda: sf.random.bernoulli(KEY, np.full(3, 0.5), (4,)), ValueError, "broadcast"),
    "categorical's axis": (lambda: sf.random.categorical(KEY, LOGITS, axis=2), ValueError, "out of range"),
    "categorical of ints": (lambda: sf.random.categorical(KEY, np.zeros(3, np.int32)), TypeError, "float array"),
    "split into 0": (lambda: sf.random.split(KEY, 0), ValueError, "positive int"),
    "fold_in of a float": (lambda: sf.random.fold_in(KEY, 1.5), TypeError, "data must be"),
    "dropout's rate": (lambda: sf.nn.dropout(KEY, X, 1.5), ValueError, "rate must be"),
    "dropout of ints": (lambda: sf.nn.dropout(KEY, np.ones(3, np.int32), 0.5), TypeError, "float array"),
    "a float seed": (lambda: sf.random.key(1.0), TypeError, "a seed is an integer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_before_anything_runs(case):
    fn, error, match = BAD[case]
    with pytest.raises(error, match=match):
        fn()


def test_bad_arguments_raise_at_trace_time_and_before_an_eager_plan():
    mesh = mesh_of((2,), ("tp",))
    with pytest.raises(TypeError, match="a key was expected"):
        sf.jit(lambda k: sf.random.normal(k, (4,)), mesh=mesh).lower(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="minval < maxval"):
        sf.jit(lambda k: sf.random.uniform(k, (4,), minval=2, maxval=1), mesh=mesh).lower(KEY)
    with pytest.raises(TypeError, match="a key was expected"):
        sf.jit(lambda x: sf.random.normal(x, (4,)), mesh=mesh).lower(np.zeros(2, np.float32))
    key = sf.random.key(0, mesh=mesh)
    before = array_ops.cache_info()["compiled"]
    for call in (lambda: sf.random.normal(key, (-1,)), lambda: sf.random.randint(key, (3,), 2, 1),
                 lambda: sf.random.uniform(key, (3,), mesh=mesh_of((2, 2), ("dp", "tp")))):
        with pytest.raises((TypeError, ValueError)):
            call()
    assert array_ops.cache_info()["compiled"] == before


def test_permutation_is_uniform_the_same_everywhere_and_shuffles_arrays():
    """sf.random.permutation (jax.random.permutation): every permutation of 4 about equally often over
    2,400 keys (chi-square, 23 degrees of freedom, below its 1e-6 quantile 70); the same permutation on
    the host, in sf.jit on one and on 4 devices; an array shuffled along an axis, sharded or not."""
    import itertools

    seed = int(np.random.default_rng().integers(2**31))
    root = sf.random.key(seed)
    counts = dict.fromkeys(itertools.permutations(range(4)), 0)
    for i in range(2400):
        counts[tuple(int(v) for v in sf.random.permutation(sf.random.fold_in(root, i), 4))] += 1
    chi2 = sum((c - 100) ** 2 / 100 for c in counts.values())
    assert chi2 < 70, (seed, chi2)
    host = sf.random.permutation(root, 64)
    assert sorted(host.tolist()) == list(range(64)) and host.dtype == np.int64
    for mesh in (sf.DeviceMesh(1, backend="numpy"), sf.DeviceMesh(4, backend="numpy")):
        np.testing.assert_array_equal(np.asarray(sf.jit(lambda k: sf.random.permutation(k, 64), mesh=mesh)(root)), host)
    x = np.random.default_rng().standard_normal((8, 64))
    mesh = sf.DeviceMesh(4, backend="numpy")
    got = sf.jit(lambda k, x: sf.random.permutation(k, sf.shard(x, axis=0), axis=1), mesh=mesh)(root, x)
    np.testing.assert_array_equal(np.asarray(got), x[:, host])
    with pytest.raises(NotImplementedError, match="independent=True"):
        sf.random.permutation(root, x, independent=True)


def test_split_is_one_array_of_keys_as_jaxs():
    """jax.random.split gives a [num, 2] array (a JAX port scanned over it: sf's was a tuple, and the scan
    ran along a key's words); unpacked, indexed and scanned over, the same keys."""
    mesh = sf.DeviceMesh(2)
    keys = sf.random.split(KEY, 3)
    assert isinstance(keys, np.ndarray) and keys.shape == (3, 2) and keys.dtype == np.int64
    a, b, c = keys
    same_bits(c, keys[2])
    draws = sf.jit(lambda k: sf.lax.scan(lambda s, kk: (s, sf.random.uniform(kk, (4,), "float64")), 0.0,
                                         sf.random.split(k, 3))[1], mesh=mesh)(KEY)
    for j, kk in enumerate(keys):
        np.testing.assert_array_equal(np.asarray(draws)[j], np.asarray(sf.random.uniform(kk, (4,), "float64")))
    traced = sf.jit(lambda k: sf.random.split(k, 3), mesh=mesh)(KEY)
    assert traced.shape == (3, 2) and np.array_equal(np.asarray(traced), keys)


@pytest.mark.parametrize("lower, upper", [(-2.0, 2.0), (0.0, np.inf), (-np.inf, -1.5), (0.5, 0.6)])
def test_truncated_normal_inverts_the_uniform_it_draws(lower, upper):
    """jax.random.truncated_normal (flax's initializers draw it): erf(x / sqrt 2) is the uniform drawn in
    (erf(lower / sqrt 2), erf(upper / sqrt 2)) to float64's precision, every value inside the bounds, the same
    on every mesh and on the host; float32 and bfloat16 inside too."""
    import math
    k = sf.random.key(int(np.random.default_rng().integers(1 << 30)))
    x = np.asarray(sf.random.truncated_normal(k, lower, upper, (4000,), "float64"))
    a, b = (math.erf(v / math.sqrt(2)) for v in (lower, upper))
    u = np.asarray(sf.random.uniform(k, (4000,), "float64", a, b))
    np.testing.assert_allclose(np.vectorize(math.erf)(x / math.sqrt(2)), u, rtol=0, atol=1e-14)
    assert (x > lower).all() and (x < upper).all()
    on_mesh = sf.jit(lambda k: sf.random.truncated_normal(k, lower, upper, (4000,), "float64"),
                     mesh=sf.DeviceMesh(4, backend="numpy"))(k)
    np.testing.assert_array_equal(np.asarray(on_mesh), x)
    for dt in ("float32", "bfloat16"):
        y = np.asarray(sf.random.truncated_normal(k, lower, upper, (500,), dt)).astype(np.float64)
        assert (y >= lower).all() and (y <= upper).all() and np.isfinite(y).all()
    with pytest.raises(ValueError, match="lower < upper"):
        sf.random.truncated_normal(k, 1.0, 1.0, (3,))
