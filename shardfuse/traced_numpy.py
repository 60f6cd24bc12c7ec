"""The functions on traced values (sf.exp, sf.sqrt, sf.where, ...) and NumPy's on them: the one
table `traced.NUMPY`, filled here, that `Traced.__array_ufunc__` / `__array_function__` and
sf.Array (shardfuse/array_ops.py) look NumPy's functions up in.

The sf.* functions take traced values inside sf.jit and sf.Arrays outside it (each op there a
one-op plan, array_ops.apply); NumPy's semantics: dtype promotion (NumPy 2's own, shardfuse.promotion: weak
Python scalars), broadcasting, negative axes.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from shardfuse import dtypes
from shardfuse.ops import Op
from shardfuse.shape_ops import NUMPY_SHAPES
from shardfuse.spec import check_axis, normalize_axis, reduced_axes
from shardfuse.traced import NUMPY, Traced, cast, is_weak_scalar


def _apply(fn, what, *args):
    """fn(*args) on traced values (NumPy arrays among them captured as constants); with an sf.Array
    among args (outside jit), as its one-op plan."""
    traced = next((a for a in args if isinstance(a, Traced)), None)
    if traced is not None:
        return fn(*(traced.builder.constant(a) for a in args))
    for a in args:
        if hasattr(type(a), "one_op"):  # sf.Array (array_ops.ArrayOps)
            return a.one_op(fn, args, what)
    raise TypeError(f"sf.{what} takes values inside an sf.jit function or sf.Arrays, got "
                    f"{', '.join(type(a).__name__ for a in args)}")


apply_op = _apply  # (public: the other modules of NumPy's functions, logical.py and numpy_shapes.py)


def _floating(x):
    """x, cast to a float dtype first where it is an integer or bool array (NumPy's result of sqrt, log ...)."""
    return cast(x, dtypes.float_result(x.dtype_name))  # (np.sqrt of a weak int: a weak float, as JAX's)


# The traced functions _apply runs are made once per op, not per call: outside jit they key the one-op plan cache.

def _math(op):
    def traced(v):
        return _floating(v).unary_op(op)

    def fn(x):
        return _apply(traced, str(op), x)
    fn.__name__ = str(op)
    return fn


exp, tanh, sqrt, rsqrt, log, sigmoid, silu = (_math(op) for op in (Op.EXP, Op.TANH, Op.SQRT, Op.RSQRT, Op.LOG,
                                                                     Op.SIGMOID, Op.SILU))
exp.__doc__ = "e**x elementwise (np.exp(x) works too)."
tanh.__doc__ = "tanh elementwise (np.tanh(x) works too)."
sqrt.__doc__ = "The square root elementwise (np.sqrt(x) works too); NaN below 0, as NumPy's."
rsqrt.__doc__ = "1 / sqrt(x) elementwise, in one step (16-bit values in float32, rounded once), as jax.lax.rsqrt."
log.__doc__ = "The natural logarithm elementwise (np.log(x) works too); -inf at 0, NaN below, as NumPy's."
sigmoid.__doc__ = "1 / (1 + e**-x) elementwise, without overflow for large |x| (jax.nn.sigmoid)."
silu.__doc__ = "x * sigmoid(x) elementwise (SiLU, swish: jax.nn.silu)."


_relu = lambda v: v.unary_op(Op.RELU)  # noqa: E731 (made once: see _math; sf.gelu is in numpy_math.py)


def relu(x):
    """max(x, 0) elementwise."""
    return _apply(_relu, str(Op.RELU), x)


def linear(x, w, b=None):
    """x @ w (+ b): a dense layer, w [in, out] (flax's Dense kernel; torch.nn.Linear's weight is [out, in], its
    F.linear x @ weight.T: pass weight.T); on sf.Arrays outside jit, one plan."""
    return _apply(_linear, "linear", x, w, b)


def _linear(x, w, b):
    y = x @ w
    return y if b is None else y + b


def absolute(x):
    """|x| elementwise (np.abs(x), abs(x)): relu(x) + relu(-x), exact (one of the two is zero)."""
    return abs(x)


def _extremum(op, scalar_op):
    def traced(a, b):
        if is_weak_scalar(a):
            a, b = b, a
        if is_weak_scalar(b):
            v, c = a.with_scalar(b, op)
            return v.unary_op(scalar_op, value=c)
        a, b = a.promote_with(b, op)
        return a.elementwise_op(op, (a, b), a.dtype_name)

    def fn(x, y):
        return _apply(traced, str(op), x, y)
    fn.__name__ = str(op)
    fn.__doc__ = f"np.{op}(x, y) elementwise: arrays (broadcast, promoted) or an array and a scalar; NaN propagates."
    return fn


maximum, minimum = _extremum(Op.MAXIMUM, Op.MAXIMUM_SCALAR), _extremum(Op.MINIMUM, Op.MINIMUM_SCALAR)


def _floor_op(op, ufunc):
    def fn(x, y):
        return _apply(_floor_traced, str(op), x, y, op)
    fn.__name__ = ufunc.__name__
    fn.__doc__ = (f"np.{ufunc.__name__}(x, y) (x {'//' if op == Op.FLOOR_DIVIDE else '%'} y) elementwise, NumPy's: "
                  "arrays (broadcast, promoted; integers stay integers) or an array and a scalar on either side.")
    return fn


def scalar_operands(a, b, op):
    """(a, b) as two arrays of one dtype for a binary op: a Python scalar on either side becomes an
    array of the other operand's shape (a full_like, in the dtype NumPy 2 computes op in), so one
    op serves x // 2 and 2 // x and its sharding is the elementwise rule's; two arrays promoted."""
    if is_weak_scalar(b):
        a, c = a.with_scalar(b, op)
        return a, a.unary_op(Op.FULL_LIKE, value=c)
    if is_weak_scalar(a):
        b, c = b.with_scalar(a, op, reflected=True)
        return b.unary_op(Op.FULL_LIKE, value=c), b
    return a.promote_with(b, op)


def _floor_traced(a, b, op):
    a, b = scalar_operands(a, b, op)
    if a.dtype_name == "bool":  # (NumPy's result is int8, a dtype shardfuse lacks)
        raise TypeError(f"{op} of boolean arrays: cast them first, x.astype('int32')")
    return a.elementwise_op(op, (a, b), a.dtype_name)


floor_divide, mod = _floor_op(Op.FLOOR_DIVIDE, np.floor_divide), _floor_op(Op.MOD, np.remainder)


def where(c, x, y):
    """x where c is true, else y, elementwise (np.where / jnp.where with three arguments): c a
    boolean array (others count as c != 0, as NumPy), x and y arrays or Python scalars, all three
    broadcast; the dtype is NumPy's (arrays promoted, scalars weak).  It runs as two halves added,
    each exact: where(c, x, 0) + where(c, 0, y), with -0.0 as the zero of floats."""
    return _apply(_where, "where", c, x, y)


def _where(c, x, y):
    if not isinstance(c, Traced):  # (a scalar condition beside an array: a 0-d constant, as NumPy's np.where(True, ...))
        t = next((v for v in (x, y) if isinstance(v, Traced)), None)
        if t is None or not isinstance(c, (bool, int, float, np.generic)):
            raise TypeError(f"sf.where: the condition must be an array, or a scalar beside an array x or y, got "
                            f"{type(c).__name__}")
        c = t.builder.constant(np.asarray(c != 0))
    c = c if c.dtype_name == "bool" else c.astype("bool")
    for v in (x, y):
        if not (isinstance(v, Traced) or is_weak_scalar(v)):
            raise TypeError(f"sf.where: x and y must be arrays or Python scalars, got {type(v).__name__}")
    arrays = [v for v in (x, y) if isinstance(v, Traced)]
    if len(arrays) == 2:
        x, y = x.promote_with(y, "where")
        dt = x.dtype_name
    elif arrays:
        dt = arrays[0].with_scalar(y if arrays[0] is x else x)[0].dtype_name
    else:
        dt = np.result_type(x, y).name  # (two Python scalars: NumPy's default dtypes)
    halves = []
    for v, (array_op, fill_op) in ((x, (Op.WHERE_THEN, Op.FILL_THEN)), (y, (Op.WHERE_ELSE, Op.FILL_ELSE))):
        if isinstance(v, Traced):
            v = v.astype(dt)
            halves.append(c.elementwise_op(array_op, (c, v), dt))
        else:
            halves.append(c.unary_op(fill_op, dt, value=float(v) if dtypes.is_float(dt) else
                                     bool(v) if dt == "bool" else int(v)))
    return halves[0] + halves[1]


def _compare(op):
    return lambda a, b: a._compare(b, op) if isinstance(a, Traced) else b._compare(a, _REFLECT[op])


_REFLECT = {Op.LT: Op.GT, Op.LE: Op.GE, Op.GT: Op.LT, Op.GE: Op.LE, Op.EQ: Op.EQ, Op.NE: Op.NE}


def logical_not(x):
    """~x of a boolean array (np.logical_not; other dtypes count as x != 0)."""
    return _apply(_logical_not, str(Op.LOGICAL_NOT), x)


def _logical_not(v):
    return ~(v if v.dtype_name == "bool" else v.astype("bool"))


# ---- NumPy's functions on traced values ---------------------------------------------------------
def _binary(method, reflected):
    """np.<ufunc>(a, b) with a traced operand: its own operator method (never a + b again, which
    with a NumPy scalar on the left would come back here).  Named as `operator`'s functions."""
    def call(a, b):
        if isinstance(b, Traced):  # (a NumPy array on the left: a constant)
            a = b.builder.constant(a)
        out = getattr(a, method)(b) if isinstance(a, Traced) else getattr(b, reflected)(a) if reflected else NotImplemented
        if out is NotImplemented:
            raise TypeError(f"np.{method.strip('_')} of a {type(a).__name__} and a {type(b).__name__} inside sf.jit: "
                            "an array (NumPy's, captured as a constant, or a traced value) was expected: write np.asarray(...)")
        return out
    call.__name__ = method.strip("_")
    return call


def defaults_only(what: str, takes: str, **given):
    """Refuse the arguments of a NumPy function shardfuse's op lacks (None / False: NumPy's defaults)."""
    bad = [k for k, v in given.items() if v is not None and v is not False]
    if bad:
        raise TypeError(f"{what} with {', '.join(k + '=' for k in bad)} is not supported on shardfuse values "
                        f"(inside sf.jit and on sf.Arrays): write {takes}")


def _reduction(method):
    """np.sum / mean / max / min (amax, amin) of a traced value with NumPy's signature each (np.max's is (a,
    axis, out, keepdims, initial, where)): dtype=, where= (a mask), sum's initial= added, max's compared."""
    name = method.__name__

    def reduced(a, axis, dtype, out, keepdims, where, initial, rest):
        defaults_only(f"np.{name}", f"np.{name}(x, axis, keepdims=...), a new value", out=out, **rest)
        return _reduced(method, a, axis, dtype, keepdims, where, initial)

    def sum_(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None, **rest):
        return reduced(a, axis, dtype, out, keepdims, where, initial, rest)

    def mean_(a, axis=None, dtype=None, out=None, keepdims=False, *, where=None, **rest):
        return reduced(a, axis, dtype, out, keepdims, where, None, rest)

    def extremum(a, axis=None, out=None, keepdims=False, initial=None, where=None, **rest):
        return reduced(a, axis, None, out, keepdims, where, initial, rest)
    call = {Traced.sum: sum_, Traced.mean: mean_}.get(method, extremum)
    call.__name__ = name
    return call


def _reduced(method, a, axis, dtype, keepdims, where, initial):
    if dtype is not None:  # (the result in it too: an integer sum is int64 otherwise, a probe)
        dtype = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        return _reduced(method, a.astype(dtype), axis, None, keepdims, where, initial).astype(dtype)
    if method is Traced.sum and initial is not None:  # (NumPy's: the sum plus initial cast to the sum's dtype)
        s = _reduced(method, a, axis, None, keepdims, where, None)
        return s + np.asarray(initial).astype(dtypes.np_dtype(s.dtype_name))[()]
    if (where is None or where is True) and initial is None:
        return method(a, axis, keepdims=keepdims)
    kept = None if where is None or where is True else \
        where if isinstance(where, Traced) else a.builder.constant(np.asarray(where, dtype=bool))
    if method in (Traced.max, Traced.min):
        return _extremum_from(method, a, axis, keepdims, kept, initial)
    if method is Traced.sum:
        return _where(kept, a, 0).sum(axis, keepdims=keepdims)
    # (NumPy's mean: integers in float64, 16-bit floats in float32, each rounded once to the result)
    out_dt = a.dtype_name if dtypes.is_float(a.dtype_name) else "float64"
    work = "float64" if out_dt == "float64" else "float32"
    total = _where(kept, a.astype(work), 0).sum(axis, keepdims=keepdims)
    ones = a.unary_op(Op.FULL_LIKE, work, value=1.0)  # (the mask counted over a's shape)
    count = _where(kept, ones, 0).sum(axis, keepdims=keepdims)
    return (total / count).astype(out_dt)


def _extremum_from(method, a, axis, keepdims, kept, initial):
    """np.max / np.min with initial= (cast to x's dtype) and where=: the extremum of initial and the kept."""
    if initial is None:
        raise ValueError(f"np.{method.__name__} with where=: NumPy's needs initial= too (the result where the mask "
                         f"keeps nothing), e.g. np.{method.__name__}(x, axis, where=mask, initial=-np.inf)")
    c = np.asarray(initial).astype(dtypes.np_dtype(a.dtype_name))
    if 0 in a.shape:  # (no element: initial is the result, as NumPy's; a review)
        return a.builder.constant(np.max(np.empty(a.shape, c.dtype), axis=axis, keepdims=keepdims, initial=c))
    c = a.builder.constant(c)
    best = method(a if kept is None else _where(kept, a, c), axis, keepdims=keepdims)
    return maximum(best, c) if method is Traced.max else minimum(best, c)


def _where_numpy(condition, *xy):
    if len(xy) != 2:
        raise TypeError("np.where(condition) with one argument (the indices of true elements) has no static shape: "
                        "inside sf.jit write np.where(condition, x, y); outside it, on an sf.Array, "
                        "np.nonzero(np.asarray(condition)) (the gathered value)")
    return where(condition, *xy)


# ---- statistics written with the ops above: their shardings, communication and gradients follow ----
def var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, correction=None, **rest):
    """np.var / x.var: the mean of the squared deviations from the mean over `axis` (an int, a tuple, None:
    all), times n / (n - ddof) (correction=: the array API's ddof), as NumPy's (integers and booleans in
    float64; inf or NaN where n <= ddof).  mean((x - mean(x))**2): a sharded axis' means Allreduced."""
    defaults_only("np.var", "np.var(x, axis, ddof=, keepdims=)", out=out, **rest)
    return _apply(_var, "var", a, _axis_key(axis), ddof if correction is None else correction, bool(keepdims), False,
                  None if dtype is None else dtypes.normalize_dtype(dtype))


def std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, correction=None, **rest):
    """np.std / x.std: sqrt(var(x, axis, ddof, keepdims)), as NumPy's."""
    defaults_only("np.std", "np.std(x, axis, ddof=, keepdims=)", out=out, **rest)
    return _apply(_var, "std", a, _axis_key(axis), ddof if correction is None else correction, bool(keepdims), True,
                  None if dtype is None else dtypes.normalize_dtype(dtype))


def norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002 (NumPy's name)
    """np.linalg.norm with ord None (or 2 of a vector, "fro" of a matrix): sqrt(sum(x * x)) over `axis` (None:
    every element), integers and booleans in float64, as NumPy's; a sharded axis' sum Allreduced; no other ord."""
    axes = _axis_key(axis)
    rank = x.ndim if axes is None else 1 if isinstance(axes, int) else len(axes)
    if not (ord is None or (ord == 2 and rank == 1) or (ord == "fro" and rank == 2)):
        raise TypeError(f"np.linalg.norm(..., ord={ord!r}) over {rank} axes is not supported inside sf.jit and on "
                        "sf.Arrays: shardfuse has the 2-norm and the Frobenius norm (ord=None); write the others "
                        "with the ops (np.abs(x).max(axis), np.abs(x).sum(axis))")
    return _apply(_norm, "linalg.norm", x, axes, bool(keepdims))


def _statistic_input(x):  # (norm, var, std of integers and booleans in float64, as NumPy's: not sqrt's float16
    return x if dtypes.is_float(x.dtype_name) else cast(x, "float64")  # of booleans, a probe)


def _norm(x, axis, keepdims):
    x = _statistic_input(x)
    return sqrt((x * x).sum(axis, keepdims=keepdims))


def _axis_key(axis):  # (axis as a hashable value, a list to a tuple: outside jit it keys the one-op plan)
    return tuple(axis) if isinstance(axis, list) else axis


def _var(x, axis, ddof, keepdims, root, dtype):
    x = _statistic_input(x) if dtype is None else x.astype(dtype)  # (dtype=: computed and returned in it)
    n = math.prod(x.shape[a] for a in reduced_axes(axis, x.ndim, x.shape))
    d = x - x.mean(axis, keepdims=True)
    v = (d * d).mean(axis, keepdims=keepdims)
    if ddof:  # (NumPy divides by max(n - ddof, 0): a positive sum over 0 is inf, 0 / 0 NaN, as mean * inf;
        v = v.unary_op(Op.SCALE, value=n / (n - ddof) if n > ddof else math.inf)  # the factor not rounded)
    return sqrt(v) if root else v


def argmax(a, axis=None, out=None, *, keepdims=False):
    """np.argmax / x.argmax: the index of the first largest element over `axis` (an int, or None:
    of the flattened array), int64 as NumPy's; the first NaN where there is one."""
    defaults_only("np.argmax", "np.argmax(x, axis, keepdims=)", out=out)
    return _apply(_arg_extremum, "argmax", a, axis, bool(keepdims), "max")


def argmin(a, axis=None, out=None, *, keepdims=False):
    """np.argmin / x.argmin: as argmax, of the first smallest element."""
    defaults_only("np.argmin", "np.argmin(x, axis, keepdims=)", out=out)
    return _apply(_arg_extremum, "argmin", a, axis, bool(keepdims), "min")


def _arg_extremum(x, axis, keepdims, kind):
    """The least index where x equals its max (min) over the axis: the extremum first (over a
    sharded axis each device's, then an Allreduce with max), then where(x == it, index, n).min(axis),
    the index a constant that the axis's sharding slices, so each device's least index is already
    global and one Allreduce with min combines them (NumPy's first occurrence).  NaN counts as the
    extremum (NumPy's rule): where the extremum is NaN, x == it holds nowhere and x != x marks them."""
    if axis is None:
        flat = _arg_extremum(x.reshape(-1), 0, False, kind)
        return flat.reshape((1,) * x.ndim) if keepdims else flat
    ax = normalize_axis(check_axis(axis), x.ndim, x.shape)
    n = x.shape[ax]
    best = x.max(ax, keepdims=True) if kind == "max" else x.min(ax, keepdims=True)
    index = x.builder.constant(np.arange(n, dtype=np.int64).reshape((n,) + (1,) * (x.ndim - ax - 1)))
    found = where(x == best, index, n)
    if dtypes.is_float(x.dtype_name):
        found = where(x != x, index, found)
    return found.min(ax, keepdims=keepdims)


NUMPY.update({  # NumPy function or ufunc -> the same on traced values: adding an op is one line
    np.add: _binary("__add__", "__radd__"), np.subtract: _binary("__sub__", "__rsub__"),
    np.multiply: _binary("__mul__", "__rmul__"), np.divide: _binary("__truediv__", "__rtruediv__"),
    np.matmul: _binary("__matmul__", None), np.negative: operator.neg, np.absolute: absolute,
    np.exp: exp, np.tanh: tanh, np.sqrt: sqrt, np.log: log,  # (np.power, np.square: numpy_broadcast.py)
    np.maximum: maximum, np.minimum: minimum, np.logical_not: logical_not,
    np.less: _compare(Op.LT), np.less_equal: _compare(Op.LE), np.greater: _compare(Op.GT),
    np.greater_equal: _compare(Op.GE), np.equal: _compare(Op.EQ), np.not_equal: _compare(Op.NE),
    np.where: _where_numpy,  # (np.transpose, np.swapaxes, np.reshape: NUMPY_SHAPES)
    np.sum: _reduction(Traced.sum), np.mean: _reduction(Traced.mean), np.max: _reduction(Traced.max),
    np.amax: _reduction(Traced.max), np.min: _reduction(Traced.min), np.amin: _reduction(Traced.min),
    np.var: var, np.std: std, np.argmax: argmax, np.argmin: argmin,
    np.floor_divide: floor_divide, np.mod: mod,  # (np.remainder is np.mod)
    np.linalg.norm: norm,
    **NUMPY_SHAPES,  # np.concatenate, np.stack, np.split
})
