"""np.einsum and np.tensordot on traced values and sf.Arrays, lowered onto the ops shardfuse has
(transpose, reshape, sum, multiply, matmul), so they need no kernel of their own and shard as those
ops do: `np.einsum("bsh,hd->bsd", x, w)` is `x @ w` (a row-sharded x stays sharded, a contraction
over a sharded h is a pending sum and one Allreduce), `"bhqd,bhkd->bhqk"` a batched matmul of q and
k transposed (heads sharded: no communication).

NumPy's semantics: explicit ("ij,jk->ik") and implicit ("ij,jk": the labels seen once, in ASCII
order) output, "..." (broadcast, aligned from the right), labels of extent 1 broadcast, the operands'
promoted dtype (sums of integers accumulate in int64 and are cast back, as NumPy's wrap-around).
Operands combine left to right, two at a time (`optimize=` is accepted and changes nothing): labels
that neither the output nor a later operand needs are summed first, then a pair is one matmul
(batch labels its batch axes, the others its rows and columns; several contracted labels are
merged into one axis by a reshape, which gathers an inner sharded one first, printed), or an
elementwise product where nothing is contracted.  Integers and booleans are never a matmul
(there is no integer GEMM): their products are broadcast and summed.  A label repeated within
one operand ("ii->i", "ii", "bii->b") takes that operand's diagonal first (np.diagonal: advanced
indexing, the axes made whole).
"""
from __future__ import annotations

from functools import reduce

import numpy as np

from shardfuse import dtypes
from shardfuse.spec import normalize_axis
from shardfuse.traced import NUMPY, Traced, cast, describe, is_scalar
from shardfuse.numpy_stats import diagonal
from shardfuse.traced_numpy import apply_op, defaults_only

_ELLIPSIS = "."  # (an ellipsis axis is the label ".0", ".1", ...: never a letter)


def einsum(*operands, out=None, dtype=None, order="K", casting="safe", optimize=False):
    """np.einsum(subscripts, *operands) as NumPy's (see the module's text): the subscripts a
    string, explicit or implicit, with "..."; the interleaved form np.einsum(a, [0, 1], b, [1, 2])
    and out= / dtype= / order= / casting= are refused, optimize= is ignored (left to right)."""
    if not operands or not isinstance(operands[0], str):
        raise TypeError("np.einsum on shardfuse values (inside sf.jit and on sf.Arrays) takes the subscripts as a "
                        "string: write np.einsum('ij,jk->ik', a, b) (the interleaved form np.einsum(a, [0, 1], b, "
                        "[1, 2]) is not supported)")
    given = {"out=": out is not None, "dtype=": dtype is not None, "order=": order != "K", "casting=": casting != "safe"}
    if any(given.values()):
        raise TypeError(f"np.einsum with {', '.join(k for k, v in given.items() if v)} is not supported on shardfuse "
                        "values (inside sf.jit and on sf.Arrays): write np.einsum(subscripts, *operands), a new value "
                        "(x.astype(dtype) for another dtype)")
    _arrays("np.einsum", operands[1:])
    return apply_op(_einsum, "einsum", operands[0].replace(" ", ""), *operands[1:])


def _einsum(subscripts, *xs):
    labels, out = parse(subscripts, [x.ndim for x in xs])
    what = f"np.einsum('{subscripts}')"
    xs, labels = zip(*(_diagonals(x, labs, what) for x, labs in zip(xs, labels)))
    return contract(xs, labels, out, what)


def _diagonals(x, labs, what) -> tuple:
    """(x, labs) with each label repeated within the operand taken once, along its diagonal ("ii->i",
    "bii->b": np.diagonal, the diagonal axis last)."""
    labs = tuple(labs)
    while (c := next((c for c in labs if labs.count(c) > 1), None)) is not None:
        p, q = [k for k, d in enumerate(labs) if d == c][:2]
        if x.shape[p] != x.shape[q]:
            raise ValueError(f"{what}: the repeated subscript '{c}' has extents {x.shape[p]} and {x.shape[q]} in "
                             f"{describe(x)} (a diagonal needs them equal)")
        x = diagonal(x, 0, p, q)
        labs = tuple(d for k, d in enumerate(labs) if k not in (p, q)) + (c,)
    return x, labs


def _arrays(what, xs):
    """Refuse operands that are not arrays (NumPy's, traced values, sf.Arrays) before anything is traced."""
    bad = [type(x).__name__ for x in xs if not (isinstance(x, (np.ndarray, Traced)) or hasattr(type(x), "one_op"))]
    if bad:
        raise TypeError(f"{what}: the operands must be arrays inside sf.jit and on sf.Arrays, got {', '.join(bad)}; "
                        "write np.asarray(...) for a list, or multiply the result by a scalar")


def parse(subscripts: str, ndims) -> tuple:
    """(labels of each operand, labels of the output) of an einsum string, "..." expanded into
    ellipsis labels (".0", ".1", ...: the broadcast axes, aligned from the right)."""
    what = f"np.einsum('{subscripts}')"
    lhs, arrow, rhs = subscripts.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"{what}: {len(terms)} operand subscripts for {len(ndims)} operands")
    if "->" in rhs:
        raise ValueError(f"{what}: more than one '->'")
    spans = [_term(t, what, k) for k, t in enumerate(terms)]
    width = max([n - len(letters) for (letters, dots), n in zip(spans, ndims) if dots is not None], default=0)
    labels = []
    for k, ((letters, dots), n) in enumerate(zip(spans, ndims)):
        e = n - len(letters)
        if e < 0 or e > 0 and dots is None:
            raise ValueError(f"{what}: operand {k} has {n} axes for the {len(letters)} subscripts "
                             f"'{terms[k]}'{'' if dots is not None else ' (no ... to stand for the others)'}")
        ell = tuple(f"{_ELLIPSIS}{j}" for j in range(width - e, width))
        labels.append(tuple(letters[:dots or 0]) + ell + tuple(letters[dots or 0:]) if dots is not None
                      else tuple(letters))
    seen = [c for labs in labels for c in labs]  # (implicit: a label repeated anywhere is summed, "ii" a trace)
    ell_out = tuple(f"{_ELLIPSIS}{j}" for j in range(width))
    if not arrow:  # implicit: the broadcast axes, then the labels seen once, in ASCII order
        return labels, ell_out + tuple(sorted(c for c in set(seen) if len(c) == 1 and seen.count(c) == 1))
    letters, dots = _term(rhs, what, "the output")
    if dots is None and width:
        raise ValueError(f"{what}: the operands have broadcast axes (...) but the output names no '...'")
    out = tuple(letters[:dots]) + ell_out + tuple(letters[dots:]) if dots is not None else tuple(letters)
    for c in letters:
        if c not in seen:
            raise ValueError(f"{what}: the output subscript '{c}' appears in no operand")
        if letters.count(c) > 1:
            raise ValueError(f"{what}: the output subscript '{c}' appears more than once")
    return labels, out


def _term(t, what, k) -> tuple:
    """(the letters of one term, where its "..." stands among them or None)."""
    dots = t.find("...")
    letters = t.replace("...", "", 1) if dots >= 0 else t
    bad = next((c for c in letters if not (c.isascii() and c.isalpha())), None)
    if bad is not None:
        raise ValueError(f"{what}: invalid subscript {bad!r} in operand {k}: subscripts are letters, and one '...'")
    return letters, dots if dots >= 0 else None


def contract(xs, labels, out, what):
    """The einsum of traced xs (labels: a tuple per operand) into `out` labels: pairs left to right."""
    sizes = {}
    for x, labs in zip(xs, labels):
        for c, n in zip(labs, x.shape):
            if n != sizes.get(c, n) and 1 not in (n, sizes[c]):
                raise ValueError(f"{what}: the subscript '{c}' has extents {sizes[c]} and {n} (operand "
                                 f"{describe(x)})")
            sizes[c] = max(sizes.get(c, 1), n)
    dt = reduce(dtypes.promote_types, [x.dtype_name for x in xs])
    terms = [(cast(x, dt), tuple(labs)) for x, labs in zip(xs, labels)]
    while len(terms) > 1:
        later = {c for _, labs in terms[2:] for c in labs}
        terms[:2] = [_pair(*terms[0], *terms[1], set(out) | later)]
    x, labs = _sum_out(*terms[0], set(out))
    x = _arrange(x, labs, out)
    return cast(x, dt) if x.dtype_name != dt else x


def _sum_out(x, labs, keep) -> tuple:
    """x summed over the axes whose labels are not in keep (and those labels dropped)."""
    axes = tuple(k for k, c in enumerate(labs) if c not in keep)
    return (x.sum(axes), tuple(c for c in labs if c in keep)) if axes else (x, labs)


def _arrange(x, labs, order, units=()):
    """x (labels labs) transposed into `order`, with an axis of extent 1 for each label of units."""
    perm = [labs.index(c) for c in order if c not in units]
    if perm != list(range(len(perm))):
        x = x.transpose(perm)
    if any(c in units for c in order):
        extents = iter(x.shape)
        x = x.reshape(tuple(1 if c in units else next(extents) for c in order))
    return x


def _pair(a, la, b, lb, keep) -> tuple:
    """The einsum of two operands keeping the labels in keep: (result, its labels)."""
    a, la = _sum_out(a, la, keep | set(lb))
    b, lb = _sum_out(b, lb, keep | set(la))
    # a contracted label of extent 1 in one operand: each side summed alone (sum_i a_i b_0 = b_0 sum_i a_i)
    alone = {c for c in la if c in lb and c not in keep and a.shape[la.index(c)] != b.shape[lb.index(c)]}
    if alone:
        (a, la), (b, lb) = _sum_out(a, la, set(la) - alone), _sum_out(b, lb, set(lb) - alone)
    batch = tuple(c for c in la if c in lb and c in keep)
    summed = tuple(c for c in la if c in lb and c not in keep)
    fa, fb = tuple(c for c in la if c not in lb), tuple(c for c in lb if c not in la)
    if summed and dtypes.is_float(a.dtype_name):
        return _matmul(a, la, b, lb, batch, summed, fa, fb)
    # no contraction (or integers: no integer GEMM): the broadcast product, summed over what is contracted
    order = batch + summed + fa + fb
    return _sum_out(_arrange(a, la, order, set(fb)) * _arrange(b, lb, order, set(fa)), order, keep)


def _matmul(a, la, b, lb, batch, summed, fa, fb) -> tuple:
    """One matmul A[batch, fa[:-1], 1.., m, K] @ B[batch, 1.., fb[:-1], K, n], m and n the last free
    labels (an axis of extent 1 where one has none): the other free axes are broadcast batch axes,
    which join the rows or columns of the one GEMM (leading axes of extent 1 are left out: NumPy
    broadcasts from the right); several contracted labels are merged into one K axis by a reshape."""
    if len(summed) > 1:
        a, la = _merged(a, la, summed)
        b, lb = _merged(b, lb, summed)
        summed = ("_k",)
    m, n = fa[-1:] or ("_m",), fb[-1:] or ("_n",)
    lead_a = fb[:-1] if batch or fa[:-1] else ()  # (A's axes of extent 1 for B's free ones)
    lead_b = fa[:-1] if batch else ()
    y = _arrange(a, la, batch + fa[:-1] + lead_a + m + summed, set(lead_a) | {"_m"})
    z = _arrange(b, lb, batch + lead_b + fb[:-1] + summed + n, set(lead_b) | {"_n"})
    out, labs = y @ z, batch + fa[:-1] + fb[:-1] + m + n
    if "_m" in labs or "_n" in labs:
        out = out.reshape(tuple(s for s, c in zip(out.shape, labs) if c not in ("_m", "_n")))
        labs = tuple(c for c in labs if c not in ("_m", "_n"))
    return out, labs


def _merged(x, labs, summed) -> tuple:
    """x with the labels `summed` moved last and merged into one axis "_k"."""
    rest = tuple(c for c in labs if c not in summed)
    x = _arrange(x, labs, rest + summed)
    return x.reshape(x.shape[:len(rest)] + (-1,)), rest + ("_k",)


def tensordot(a, b, axes=2):
    """np.tensordot: the sum over the last `axes` axes of a and the first of b (an int), or over the
    axes of a and of b that a pair of sequences (or ints) names; the result has a's other axes, then
    b's, as NumPy's.  One einsum (a matmul: see the module's text)."""
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        if axes < 0:
            raise ValueError(f"np.tensordot: axes={axes} must be at least 0")
        pair = (tuple(range(-int(axes), 0)), tuple(range(int(axes))))
    else:
        try:
            xa, xb = axes
        except (TypeError, ValueError):
            raise ValueError(f"np.tensordot: axes must be an int or a pair of sequences, got {axes!r}") from None
        pair = tuple(tuple(int(k) for k in v) if isinstance(v, (tuple, list)) else (int(v),) for v in (xa, xb))
    _arrays("np.tensordot", (a, b))
    return apply_op(_tensordot, "tensordot", a, b, pair)


def _tensordot(a, b, pair):
    if len(pair[0]) != len(pair[1]):
        raise ValueError(f"np.tensordot: {len(pair[0])} axes of a for {len(pair[1])} of b (shape-mismatch for sum)")
    xa = [normalize_axis(k, a.ndim, a.shape) for k in pair[0]]
    xb = [normalize_axis(k, b.ndim, b.shape) for k in pair[1]]
    if len(set(xa)) != len(xa) or len(set(xb)) != len(xb):
        raise ValueError(f"np.tensordot: a repeated axis in axes={pair}")
    for i, j in zip(xa, xb):
        if a.shape[i] != b.shape[j]:
            raise ValueError(f"np.tensordot: shape-mismatch for sum: axis {i} of {describe(a)} has {a.shape[i]} "
                             f"elements, axis {j} of {describe(b)} has {b.shape[j]}")
    la = tuple(f"k{xa.index(k)}" if k in xa else f"a{k}" for k in range(a.ndim))
    lb = tuple(f"k{xb.index(k)}" if k in xb else f"b{k}" for k in range(b.ndim))
    out = tuple(c for c in la if c[0] == "a") + tuple(c for c in lb if c[0] == "b")
    return contract((a, b), (la, lb), out, "np.tensordot")


def _dot(a, b, out=None):
    defaults_only("np.dot", "np.dot(a, b)", out=out)
    if is_scalar(a) or is_scalar(b) or 0 in (getattr(a, "ndim", None), getattr(b, "ndim", None)):
        return a * b
    if getattr(a, "ndim", None) in (1, 2) and getattr(b, "ndim", None) in (1, 2):
        return a @ b  # (NumPy's dot of 1-D and 2-D operands is their matmul)
    raise TypeError(f"np.dot of {describe(a)} and {describe(b)} inside sf.jit (and on sf.Arrays): shardfuse runs "
                    "np.dot as a matmul of 1-D and 2-D operands only (NumPy's dot of higher ranks is no matmul); "
                    "write a @ b (a matmul, batched over leading axes)")


NUMPY.update({np.einsum: einsum, np.tensordot: tensordot, np.dot: _dot})
