"""NumPy's unary math on traced values and sf.Arrays: np.sin / cos / log1p / expm1 (also sf.sin & co.),
np.tan / arcsin / arccos / arctan / sinh / cosh / arcsinh / arccosh / arctanh / log2 / log10 / exp2 / cbrt,
sf.erf (jax.lax.erf, scipy.special.erf), np.sign / floor / ceil / trunc / rint / round / around
(x.round(decimals)), np.isnan / isinf / isfinite, np.reciprocal, np.cumsum (x.cumsum) and sf.gelu
(sf.nn.gelu) with its tanh and exact forms; their entries of the NUMPY table, and their derivatives
(`VJP`, merged into autodiff.VJP: one rule per op beside the op, as JAX keeps one per primitive).

Dtypes are NumPy 2's: sin, cos, log1p, expm1, erf and gelu of integers are float64 (of booleans
float16), as np.exp's; sign keeps integers (of booleans it is refused, as NumPy refuses it); floor,
ceil, trunc and round of integers are the integers themselves, in their dtype (of booleans: floor,
ceil and trunc keep them, round gives float16, as NumPy's); isnan, isinf and isfinite are boolean (of
integers and booleans constant, as NumPy's); cumsum of integers and booleans is int64.  Each op but
cumsum is one elementwise step, so every layout passes through (the elementwise rule) and a pending
sum is made whole first; on sf.Arrays each call is a one-op plan.

Gradients: sign, floor, ceil, trunc and round have none (zero almost everywhere, as JAX's), nor have
the boolean tests; cumsum's is the reversed cumsum of the cotangent.
"""
from __future__ import annotations

import math

import numpy as np

from shardfuse import dtypes
from shardfuse.ops import MORE_MATH, Op
from shardfuse.ir import TensorType
from shardfuse.spec import check_axis, normalize_axis
from shardfuse.mesh import static_advice
from shardfuse.traced import NUMPY, cast, describe
from shardfuse.traced_numpy import apply_op, where

_SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)


def _floating(v):
    """v, cast to NumPy's float result dtype first where it is an integer or bool array."""
    return cast(v, dtypes.float_result(v.dtype_name))


def _function(op, traced, doc):
    """The public function of a traced one (made once: outside jit it keys the one-op plan cache)."""
    def fn(x):
        return apply_op(traced, str(op), x)
    fn.__name__, fn.__doc__ = str(op), doc
    return fn


def _of_floats(op):
    return lambda v: _floating(v).unary_op(op)


sin = _function(Op.SIN, _of_floats(Op.SIN), "sin elementwise (np.sin(x) works too).")
cos = _function(Op.COS, _of_floats(Op.COS), "cos elementwise (np.cos(x) works too).")
log1p = _function(Op.LOG1P, _of_floats(Op.LOG1P), "log(1 + x) elementwise, accurate for small x (np.log1p).")
expm1 = _function(Op.EXPM1, _of_floats(Op.EXPM1), "e**x - 1 elementwise, accurate for small x (np.expm1).")
erf = _function(Op.ERF, _of_floats(Op.ERF), "The error function elementwise (jax.lax.erf, scipy.special.erf; "
                                             "NumPy has none), integers in float64.")
# np.tan, np.arcsin (np.asin), ..., np.cbrt: their NumPy functions on traced values and sf.Arrays
MORE = {op: _function(op, _of_floats(op), f"np.{op} elementwise (integers in float64, booleans in float16, as NumPy's).")
        for op in sorted(MORE_MATH)}


def _sign(v):
    if v.dtype_name == "bool":
        raise TypeError(f"np.sign of the boolean array {describe(v)}: NumPy has no sign of booleans; "
                        "cast it first, x.astype('int32')")
    return v.unary_op(Op.SIGN)


def _whole(op):
    """floor / ceil / trunc / round: an op of floats; integers are whole already (NumPy 2 keeps their dtype)."""
    def traced(v):
        if dtypes.is_float(v.dtype_name):
            return v.unary_op(op)
        if op == Op.ROUND and v.dtype_name == "bool":  # (NumPy's rint of booleans is float16)
            return v.astype("float16")
        return v
    return traced


sign = _function(Op.SIGN, _sign, "NumPy's sign elementwise: -1, 0 or 1 in x's dtype (0 for -0.0), NaN for NaN.")
floor = _function(Op.FLOOR, _whole(Op.FLOOR), "np.floor elementwise (integers: themselves, in their dtype).")
ceil = _function(Op.CEIL, _whole(Op.CEIL), "np.ceil elementwise (integers: themselves, in their dtype).")
trunc = _function(Op.TRUNC, _whole(Op.TRUNC), "np.trunc elementwise: toward zero (integers: themselves, in their "
                                               "dtype).")
_round = _function(Op.ROUND, _whole(Op.ROUND), "np.round with decimals=0: halves to even.")
rint = _function(Op.ROUND, _of_floats(Op.ROUND), "np.rint elementwise: halves to even (integers in float64, "
                                                  "as NumPy's).")


def round(a, decimals=0, out=None):  # noqa: A001 (NumPy's name)
    """np.round / np.around / x.round(decimals) as NumPy's: halves to even (0.5 -> 0, 1.5 -> 2, -2.5 ->
    -2).  decimals=0: integers are themselves.  Other decimals d are NumPy's composition, in x's dtype:
    rint(x * 10**d) / 10**d, or rint(x / 10**-d) * 10**-d for d < 0 (so np.round(2.675, 2) is 2.68 where
    2.675 * 100 rounds to 267.5, as NumPy's; float16 x * 10**d may overflow, as NumPy's does); integers
    with d < 0 through float64 and back (np.round(25, -1) is 20), with d > 0 themselves; booleans with
    d != 0 are refused, as NumPy refuses them."""
    if out is not None:
        raise TypeError("np.round with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.round(x, decimals), a new value")
    d = _decimals(decimals)
    return _round(a) if d == 0 else apply_op(_round_decimals, str(Op.ROUND), a, d)


def _decimals(decimals) -> int:
    """np.round's decimals as a Python int (NumPy's: an integer; a float or a bool is refused)."""
    if isinstance(decimals, bool) or not isinstance(decimals, (int, np.integer)):
        raise TypeError(f"np.round: decimals must be an integer, got {type(decimals).__name__} {decimals!r}")
    return int(decimals)


def _power_of_ten(n):
    """10.0**n as NumPy's round computes it (exact to 1e22; beyond, multiplied up by 10 as NumPy's)."""
    p = 10.0 ** min(n, 8)
    for _ in range(n - 8):
        p *= 10.0
    return p


def _round_decimals(v, d):
    if v.dtype_name == "bool":
        raise TypeError(f"np.round of the boolean array {describe(v)} with decimals={d}: NumPy refuses it too "
                        "(its float64 product cannot be cast back to bool); cast it first, x.astype('float32')")
    f = _power_of_ten(abs(d))
    if not dtypes.is_float(v.dtype_name):
        return v if d > 0 else ((v.astype("float64") / f).unary_op(Op.ROUND) * f).astype(v.dtype_name)
    return (v * f).unary_op(Op.ROUND) / f if d > 0 else (v / f).unary_op(Op.ROUND) * f


def _test(op, constant):
    """isnan / isinf / isfinite: boolean; of integers and booleans `constant` everywhere, as NumPy's."""
    def traced(v):
        if dtypes.is_float(v.dtype_name):
            return v.unary_op(op, "bool")
        return v.unary_op(Op.FULL_LIKE, "bool", value=constant)
    return traced


isnan = _function(Op.ISNAN, _test(Op.ISNAN, False), "np.isnan elementwise: a boolean array.")
isinf = _function(Op.ISINF, _test(Op.ISINF, False), "np.isinf elementwise (either sign): a boolean array.")
isfinite = _function(Op.ISFINITE, _test(Op.ISFINITE, True), "np.isfinite elementwise: a boolean array.")


def _reciprocal(v):
    if not dtypes.is_float(v.dtype_name):
        raise TypeError(f"np.reciprocal of {describe(v)}: NumPy's reciprocal of integers is an integer (0 but for "
                        "1 and -1); write 1 / x (float64) or cast x to a float dtype first")
    return 1.0 / v


def reciprocal(x):
    """1 / x elementwise (np.reciprocal) of floats, in x's dtype; integers are refused (NumPy's is integral)."""
    return apply_op(_reciprocal, "reciprocal", x)


def cumsum(a, axis=None, dtype=None, out=None):
    """np.cumsum / x.cumsum: the running sum along `axis` (None: of the flattened array, as NumPy's), in
    NumPy's dtype (integers and booleans in int64; dtype= casts first, as NumPy accumulates in it);
    float16 and bfloat16 are summed in float32 and each prefix rounded once (as their sums).  One
    step along a whole axis: another axis keeps its sharding (no communication), and an axis that is
    sharded is gathered first (an Allgather, printed in the plan; so is the one axis of axis=None's
    flattened value), as a sliced one is: there is no scan across devices.  The gradient is the
    reversed cumsum."""
    if out is not None:
        raise TypeError("np.cumsum with out= is not supported on shardfuse values (inside sf.jit and on sf.Arrays): "
                        "write y = np.cumsum(x, axis), a new value")
    dt = None if dtype is None else dtypes.normalize_dtype(dtype)
    if dt == "bool":
        raise TypeError("np.cumsum(..., dtype=bool) (a running logical or) is not supported on shardfuse values: "
                        "write np.cumsum(x, axis) > 0")
    return apply_op(_cumsum, str(Op.CUMSUM), a, axis, dt)


def _cumsum(v, axis, dtype):
    v = v.astype(dtype) if dtype else v if dtypes.is_float(v.dtype_name) else v.astype("int64")
    if axis is None:
        v, axis = v.reshape(-1), 0
    ax = normalize_axis(axis, v.ndim, v.shape)
    if ax == v.ndim - 1:
        return _running_sum(v)
    perm = [k for k in range(v.ndim) if k != ax] + [ax]  # (the summed axis last: a view)
    return _running_sum(v.transpose(perm)).transpose([perm.index(k) for k in range(v.ndim)])


def _running_sum(v):
    """The cumsum of v's last axis: one step (ops.LOCAL_SCANS)."""
    return v.unary_op(Op.CUMSUM)


def _along_last(v, axis, fn):
    """fn(v with `axis` last) with that axis put back (None: of the flattened v, as NumPy's)."""
    if axis is None:
        return fn(v.reshape(-1))
    ax = normalize_axis(check_axis(axis), v.ndim, v.shape)
    if ax == v.ndim - 1:
        return fn(v)
    perm = [k for k in range(v.ndim) if k != ax] + [ax]  # (the axis last: a view)
    return fn(v.transpose(perm)).transpose([perm.index(k) for k in range(v.ndim)])


def _order(v):
    """The stable ascending order of v's last axis (int64; NaN last): one step, that axis whole (a 0-d
    v never comes here: its axis is refused by normalize_axis, and axis=None flattens it)."""
    return v.unary_op(Op.ARGSORT, "int64")


def _permute(v, order):
    """v's last axis permuted by order (a permutation of each row): out[..., j] = v[..., order[..., j]]."""
    return v.builder.emit(Op.PERMUTE, (v, order), TensorType(v.shape, v.dtype_name), "p")


def argsort(a, axis=-1, kind=None, order=None, *, stable=None):
    """np.argsort / x.argsort: the indices that sort `axis` (int64), stable (equal elements keep their
    order, as kind="stable"; every kind gives that order here), NaN last as NumPy's.  The axis is
    made whole on every device first (an Allgather where it is sharded, printed in the plan); other
    axes keep their sharding.  No gradient (integers)."""
    if order is not None or stable is False:
        raise TypeError("np.argsort(order=) / stable=False: not supported on shardfuse values (fields; an unstable "
                        "order): write np.argsort(x, axis)")
    return apply_op(_argsort_along, str(Op.ARGSORT), a, axis)


def sort(a, axis=-1, kind=None, order=None, *, stable=None):
    """np.sort: `axis` sorted ascending (NaN last), as x permuted by its argsort; the gradient goes
    back through the same permutation.  Sharding as np.argsort's."""
    if order is not None or stable is False:
        raise TypeError("np.sort(order=) / stable=False: not supported on shardfuse values: write np.sort(x, axis)")
    return apply_op(_sort_along, "sort", a, axis)


# (module-level functions, not lambdas: on sf.Arrays a one-op plan is cached by the function)
def _argsort_along(v, axis):
    return _along_last(v, axis, _order)


def _sort_along(v, axis):
    return _along_last(v, axis, _sorted)


def _sorted(w):
    return _permute(w, _order(w))


def top_k(operand, k):
    """(values, indices) of the k largest elements of the last axis, largest first, the lower index
    first among equals (jax.lax.top_k's; indices int32, as JAX's; NaN counts as the largest, as JAX's
    and torch.topk's, above +inf; +0 before -0, as JAX's; in float64, +inf ties with the largest finite value and
    a zero with the smallest subnormal).  One ordering of the
    whole axis (it is made whole first); the values' gradient goes to the elements picked."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise TypeError(f"sf.top_k: k must be a non-negative int (static), got {k!r}{static_advice(k)}")
    if hasattr(type(operand), "one_op"):  # (an sf.Array: a one-op plan makes one result, so one each)
        return apply_op(_top_k_values, "top_k", operand, int(k)), apply_op(_top_k_indices, "top_k", operand, int(k))
    return apply_op(_top_k, "top_k", operand, int(k))


def _top_k(v, k):
    if v.ndim == 0:
        raise ValueError(f"sf.top_k of {describe(v)}: a 0-d value has no axis to take the k largest of")
    if k > v.shape[-1]:
        raise ValueError(f"sf.top_k of {describe(v)}: k = {k} must be at most the last axis' extent")
    # (descending, stable; NaN first, then +inf (the largest finite float64 in its place): a serving probe's NaN
    # logits were never sampled by top-k, JAX's are)
    if v.dtype_name == "bool" or not dtypes.is_float(v.dtype_name):
        key = ~v
    else:
        w = v.astype("float64")  # (+0 before -0, as JAX's total order: 1 / w tells them apart)
        key = where(w != w, -np.inf, where(w == np.inf, -np.finfo(np.float64).max, where(w == 0, where(
            1.0 / where(w == 0, w, 1.0) > 0, -5e-324, 5e-324), -w)))
    order = _order(key)
    return _permute(v, order)[..., :k], order[..., :k].astype("int32")


def _top_k_values(v, k):
    return _top_k(v, k)[0]


def _top_k_indices(v, k):
    return _top_k(v, k)[1]


_GELU = {True: _of_floats(Op.GELU), False: _of_floats(Op.GELU_ERF)}  # (made once: see _function)
_APPROXIMATE = {True: True, False: False, "tanh": True, "none": False}  # (JAX's bools, torch's strings)


def gelu(x, approximate=True):
    """GELU elementwise (sf.gelu, sf.nn.gelu).  approximate=True (the default, jax.nn.gelu's, and what
    sf.gelu always computed): the tanh form of GPT-2 and Megatron, 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))), which is torch.nn.functional.gelu(x, approximate='tanh').  approximate=False (or
    'none', torch's default; torch.nn.GELU() and BERT's erf form): the exact x * Phi(x), computed as
    0.5 x erfc(-x / sqrt 2) as jax.nn.gelu(x, approximate=False).  torch's strings 'tanh' and 'none'
    are accepted too.  Note the defaults differ: jax.nn.gelu is tanh, torch's GELU is exact."""
    try:
        tanh_form = _APPROXIMATE[approximate]
    except (KeyError, TypeError):
        raise ValueError(f"sf.gelu(approximate={approximate!r}): expected True / 'tanh' (the tanh form) or "
                         "False / 'none' (the exact erf form)") from None
    return apply_op(_GELU[tanh_form], str(Op.GELU if tanh_form else Op.GELU_ERF), x)


NUMPY.update({
    np.sin: sin, np.cos: cos, np.log1p: log1p, np.expm1: expm1, np.sign: sign, np.floor: floor, np.ceil: ceil,
    np.rint: rint, np.round: round, np.around: round, np.isnan: isnan, np.isinf: isinf, np.isfinite: isfinite,
    np.reciprocal: reciprocal, np.trunc: trunc, np.cumsum: cumsum, np.argsort: argsort, np.sort: sort,
    **{getattr(np, str(op)): fn for op, fn in MORE.items()},
    # (NumPy 2's array-API names of the same ufuncs)
    np.asin: MORE[Op.ARCSIN], np.acos: MORE[Op.ARCCOS], np.atan: MORE[Op.ARCTAN], np.asinh: MORE[Op.ARCSINH],
    np.acosh: MORE[Op.ARCCOSH], np.atanh: MORE[Op.ARCTANH],
})


# ---- derivatives: rule(instruction, inputs, output, cotangent, instrs) -> input cotangents, as autodiff's ----
def _times(d):
    """The rule of an op whose derivative at x is d(x, y) (y its result): the cotangent times it."""
    return lambda ins, xs, out, ct, instrs: [ct * d(xs[0], out)]


def _rsqrt(v):
    return v.unary_op(Op.RSQRT)


def _gelu_erf(x, y):
    """d/dx x Phi(x) = Phi(x) + x phi(x): 0.5 (1 + erf(x / sqrt 2)) + x e^(-x^2 / 2) / sqrt(2 pi)."""
    phi = (-(x * x * 0.5)).unary_op(Op.EXP) * (1 / math.sqrt(2 * math.pi))
    return (x * _SQRT_HALF).unary_op(Op.ERF) * 0.5 + 0.5 + x * phi


VJP = {
    Op.SIN: _times(lambda x, y: x.unary_op(Op.COS)),
    Op.COS: _times(lambda x, y: -x.unary_op(Op.SIN)),
    Op.LOG1P: lambda ins, xs, out, ct, instrs: [ct / (xs[0] + 1.0)],
    Op.EXPM1: _times(lambda x, y: y + 1.0),
    Op.ERF: _times(lambda x, y: (-(x * x)).unary_op(Op.EXP) * (2 / math.sqrt(math.pi))),
    Op.GELU_ERF: _times(_gelu_erf),
    Op.TAN: _times(lambda x, y: y * y + 1.0),
    # ((1 - x)(1 + x), not 1 - x^2: exact near +-1, where the derivative is large)
    Op.ARCSIN: lambda ins, xs, out, ct, instrs: [ct * _rsqrt((1.0 - xs[0]) * (xs[0] + 1.0))],
    Op.ARCCOS: lambda ins, xs, out, ct, instrs: [-ct * _rsqrt((1.0 - xs[0]) * (xs[0] + 1.0))],
    Op.ARCTAN: lambda ins, xs, out, ct, instrs: [ct / (xs[0] * xs[0] + 1.0)],
    Op.SINH: _times(lambda x, y: x.unary_op(Op.COSH)),
    Op.COSH: _times(lambda x, y: x.unary_op(Op.SINH)),
    # (hypot(x, 1) and rsqrt(x - 1) rsqrt(x + 1): no x^2 to overflow, a float16 x of 300 has a gradient)
    Op.ARCSINH: lambda ins, xs, out, ct, instrs: [ct / xs[0].elementwise_op(Op.HYPOT, (xs[0], xs[0] * 0.0 + 1.0),
                                                                            xs[0].dtype_name)],
    Op.ARCCOSH: lambda ins, xs, out, ct, instrs: [ct * _rsqrt(xs[0] - 1.0) * _rsqrt(xs[0] + 1.0)],
    Op.ARCTANH: lambda ins, xs, out, ct, instrs: [ct / ((1.0 - xs[0]) * (xs[0] + 1.0))],
    Op.LOG2: lambda ins, xs, out, ct, instrs: [ct / (xs[0] * math.log(2))],
    Op.LOG10: lambda ins, xs, out, ct, instrs: [ct / (xs[0] * math.log(10))],
    Op.EXP2: _times(lambda x, y: y * math.log(2)),
    # d/dx x^(1/3) = 1 / (3 y^2), divided by y twice (y * y is subnormal in float16 sooner)
    Op.CBRT: lambda ins, xs, out, ct, instrs: [ct / (out * 3.0) / out],
    # d/dx_k of sum_i ct_i y_i is the sum of ct_i over i >= k: the cumsum of ct read backwards
    Op.CUMSUM: lambda ins, xs, out, ct, instrs: [_running_sum(ct[..., ::-1])[..., ::-1]],
    # y = x permuted by p: x's cotangent is y's permuted back, by p's own order (its inverse)
    Op.PERMUTE: lambda ins, xs, out, ct, instrs: [_permute(ct, _order(xs[1])), None],
}
# piecewise constant (zero almost everywhere, as JAX's), or boolean
NO_GRADIENT = frozenset({Op.SIGN, Op.FLOOR, Op.CEIL, Op.TRUNC, Op.ROUND, Op.ISNAN, Op.ISINF, Op.ISFINITE, Op.ARGSORT})
