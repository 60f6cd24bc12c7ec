"""The table of NumPy's functions on traced values, `NUMPY` (NumPy function or ufunc -> the same on
traced values; filled by shardfuse.traced_numpy, re-exported as `traced.NUMPY`), and the array
methods that are functions of it (`x.var(...)` is `np.var(x, ...)`), shared by traced values and
sf.Arrays: the table's functions take either (an sf.Array's call runs as a one-op plan), so the
two classes answer each method the same way.  Here, below both, so that neither imports the other.
"""
from __future__ import annotations

import numpy as np

from shardfuse import dtypes

# NumPy function or ufunc -> the same on traced values (and on sf.Array: array_ops): adding an op is one
# line.  Filled by shardfuse.traced_numpy (imported with the package), which holds the functions.
NUMPY: dict = {}

# NumPy functions that are also array methods (x.var(axis, ddof=1)), run through NUMPY on either class
METHODS = (np.var, np.std, np.clip, np.argmax, np.argmin)


def cast_to(src: str, dtype, casting="unsafe") -> str:
    """x.astype(dtype, casting=)'s dtype name, refused where NumPy's casting rule refuses the cast (order=,
    subok= and copy= are about memory, which shardfuse values do not share: accepted, as JAX's)."""
    dt = dtypes.normalize_dtype(dtype)
    if casting != "unsafe" and not np.can_cast(dtypes.np_dtype(src), dtypes.np_dtype(dt), casting):
        raise TypeError(f"Cannot cast array data from dtype('{src}') to dtype('{dt}') according to the rule "
                        f"{casting!r} (NumPy's astype refusal)")
    return dt


def c_order(what, order):
    """x.reshape(..., order=): C order only (shardfuse values are read in C order)."""
    if order != "C":
        raise TypeError(f"{what}(..., order={order!r}) is not supported on shardfuse values (inside sf.jit and on "
                        "sf.Arrays): they are read in C order; write it without order=")


def _method(func):
    def method(self, *args, **kwargs):
        return NUMPY[func](self, *args, **kwargs)
    method.__name__ = func.__name__
    method.__doc__ = f"np.{func.__name__}(x, ...) as NumPy's method (its function of the NUMPY table)."
    return method


def _operator(func, reflected=False):
    def op(self, other):
        return NUMPY[func](other, self) if reflected else NUMPY[func](self, other)
    op.__name__ = f"__{'r' if reflected else ''}{func.__name__}__"
    return op


class NumpyMethods:
    """x.var / std / clip / argmax / argmin / any / all / ravel / flatten / squeeze / copy / dot / cumsum and
    x // y, x % y, x & y, x | y, x ^ y, ~x, as NumPy's ndarray methods and operators: each its
    function of the table; NumPy's other methods raise an AttributeError saying what there is."""

    __slots__ = ()
    var, std, argmax, argmin = (_method(f) for f in (np.var, np.std, np.argmax, np.argmin))

    def clip(self, min=None, max=None, out=None, **kwargs):  # noqa: A002 (NumPy's names)
        """np.clip(x, min=, max=) as NumPy's method: either bound may be left out (None: no bound)."""
        return NUMPY[np.clip](self, min=min, max=max, out=out, **kwargs)

    __floordiv__, __rfloordiv__ = _operator(np.floor_divide), _operator(np.floor_divide, reflected=True)
    __mod__, __rmod__ = _operator(np.mod), _operator(np.mod, reflected=True)
    # & | ^ ~: logical of booleans, bitwise of integers (shardfuse/logical.py)
    __and__, __rand__ = _operator(np.bitwise_and), _operator(np.bitwise_and, reflected=True)
    __or__, __ror__ = _operator(np.bitwise_or), _operator(np.bitwise_or, reflected=True)
    __xor__, __rxor__ = _operator(np.bitwise_xor), _operator(np.bitwise_xor, reflected=True)
    __invert__ = _method(np.invert)
    any, all = _method(np.any), _method(np.all)  # (np.any(x, axis, out, keepdims): NumPy's method order)
    ravel, flatten, squeeze, copy, dot = (_method(f) for f in (np.ravel, np.ravel, np.squeeze, np.copy, np.dot))
    cumsum = _method(np.cumsum)  # (x.cumsum(axis=None, dtype=None): NumPy's method order)
    argsort = _method(np.argsort)  # (x.argsort(axis=-1); NumPy's x.sort() sorts in place: np.sort(x) is a new value)
    repeat = _method(np.repeat)  # (x.repeat(repeats, axis=None): an int count)
    swapaxes = _method(np.swapaxes)

    @property
    def mT(self):  # noqa: N802 (NumPy's name)
        """The last two axes swapped (NumPy 2's x.mT, np.matrix_transpose; torch's x.mT): a transpose."""
        return NUMPY[np.matrix_transpose](self)

    def round(self, decimals=0, out=None):
        """np.round(x, decimals) as NumPy's method: halves to even."""
        return NUMPY[np.round](self, decimals, out)

    __pos__ = _method(np.positive)
    __divmod__, __rdivmod__ = _operator(np.divmod), _operator(np.divmod, reflected=True)

    def __round__(self, ndigits=None):
        """round(x) as NumPy's: np.round(x, ndigits), an array (not a Python number)."""
        return NUMPY[np.round](self, ndigits or 0)

    prod, cumprod = _method(np.prod), _method(np.cumprod)  # (x.prod(axis=None, dtype=None, ...): NumPy's order)
    trace, diagonal = _method(np.trace), _method(np.diagonal)
    searchsorted = _method(np.searchsorted)  # (x.searchsorted(v, side, sorter): x the sorted array)

    def __getattr__(self, name):
        """Only reached for a name neither class has: NumPy's array methods that shardfuse lacks
        raise an AttributeError saying what it has instead (any other name: Python's own error)."""
        if name.startswith("__") or not hasattr(np.ndarray, name):
            return object.__getattribute__(self, name)  # (Python's error, or a property's own)
        inside = type(self).__name__ == "Traced"
        where = ("on traced values (inside sf.jit); write it with the methods and NumPy functions shardfuse has "
                 "(np.* of the supported list in a TypeError's message), or apply it to the jitted function's result"
                 if inside else "on sf.Arrays; for NumPy's result on the gathered value write np.asarray(x)."
                 f"{name} (a host copy on every process: collective under mpiexec)")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}': NumPy's x.{name} is not "
                             f"supported {where}. Supported: {SUPPORTED_METHODS}")


SUPPORTED_METHODS = ("x.shape / ndim / size / dtype, x.sum / mean / max / min / any / all / var / std / argmax / "
                     "argmin(axis, keepdims=), x.cumsum / cumprod / prod(axis), x.trace(), x.diagonal(), x.searchsorted(v), "
                     "x.argsort(axis), x.repeat(n, axis), x.clip, x.round(decimals), "
                     "x.astype(dtype), x.reshape / ravel / flatten / squeeze / transpose / swapaxes / T / mT, "
                     "x.copy(), x.dot(y), x[...], the operators + - * / // % ** @ < <= > >= == != & | ^ ~")
