"""The table of NumPy's functions on traced values, `NUMPY` (NumPy function or ufunc -> the same on
traced values; filled by shardfuse.traced_numpy, re-exported as `traced.NUMPY`), and the array
methods that are functions of it (`x.var(...)` is `np.var(x, ...)`), shared by traced values and
sf.Arrays: the table's functions take either (an sf.Array's call runs as a one-op plan), so the
two classes answer each method the same way.  Here, below both, so that neither imports the other.
"""
from __future__ import annotations

import numpy as np

# NumPy function or ufunc -> the same on traced values (and on sf.Array: array_ops): adding an op is one
# line.  Filled by shardfuse.traced_numpy (imported with the package), which holds the functions.
NUMPY: dict = {}

# NumPy functions that are also array methods (x.var(axis, ddof=1)), run through NUMPY on either class
METHODS = (np.var, np.std, np.clip, np.argmax, np.argmin)


def _method(func):
    def method(self, *args, **kwargs):
        return NUMPY[func](self, *args, **kwargs)
    method.__name__ = func.__name__
    method.__doc__ = f"np.{func.__name__}(x, ...) as NumPy's method (see shardfuse.traced_numpy.{func.__name__})."
    return method


def _operator(func, reflected=False):
    def op(self, other):
        return NUMPY[func](other, self) if reflected else NUMPY[func](self, other)
    op.__name__ = f"__{'r' if reflected else ''}{func.__name__}__"
    return op


class NumpyMethods:
    """x.var / std / clip / argmax / argmin and x // y, x % y, as NumPy's ndarray methods and
    operators: its function of the table."""

    __slots__ = ()
    var, std, argmax, argmin = (_method(f) for f in (np.var, np.std, np.argmax, np.argmin))

    def clip(self, min=None, max=None, out=None, **kwargs):  # noqa: A002 (NumPy's names)
        """np.clip(x, min=, max=) as NumPy's method: either bound may be left out (None: no bound)."""
        return NUMPY[np.clip](self, min=min, max=max, out=out, **kwargs)

    __floordiv__, __rfloordiv__ = _operator(np.floor_divide), _operator(np.floor_divide, reflected=True)
    __mod__, __rmod__ = _operator(np.mod), _operator(np.mod, reflected=True)
