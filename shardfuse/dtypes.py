"""The dtypes shardfuse computes in: the one table of their names, sizes and printed names
(bfloat16 from ml_dtypes).  Everything else reads it: plans and messages print the short
names, the cost model and the backends take the sizes, and a backend keeps only its own
library's enums (backends/cuda/libs.py: CUDA_T, NCCL_T)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DTypeInfo:
    name: str  # NumPy's name of it
    itemsize: int  # bytes per element
    short: str  # as plans and messages print it: f32[8, 4:DIDx]
    bits: type  # the NumPy type CuPy holds it in (CuPy has no bfloat16: its uint16 bit pattern)


TABLE = {t.name: t for t in (
    DTypeInfo("float16", 2, "f16", np.float16),
    DTypeInfo("bfloat16", 2, "bf16", np.uint16),
    DTypeInfo("float32", 4, "f32", np.float32),
    DTypeInfo("float64", 8, "f64", np.float64),
)}
DTYPES = tuple(TABLE)  # the names, in the order messages list them


def short_name(name: str) -> str:
    """The printed name (f32 for float32); a name not in TABLE as it is."""
    info = TABLE.get(name)
    if info is None:
        return name
    return info.short


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
