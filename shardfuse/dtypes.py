"""The dtypes shardfuse computes in, by name (bfloat16 from ml_dtypes)."""
from __future__ import annotations

import numpy as np

DTYPES = ("float16", "bfloat16", "float32", "float64")

_DTYPE_NAMES: dict = {}  # dtype object -> name (np.dtype(...).name costs microseconds on every call)


def normalize_dtype(dtype) -> str:
    name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype)
    if name is None:
        name = np.dtype(dtype).name
        if name in DTYPES:
            _DTYPE_NAMES[dtype] = name
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {name!r}: expected one of {DTYPES}")
    return name


def np_dtype(name: str):
    """The NumPy dtype for a dtype name; bfloat16 comes from ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
