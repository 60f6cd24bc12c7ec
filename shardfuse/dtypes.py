"""The dtypes shardfuse computes in: the one table of their names, sizes and printed names
(bfloat16 from ml_dtypes), and how they promote (NumPy 2's rules, JAX's among floats).  Everything else reads it: plans and messages print the short
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
    DTypeInfo("int32", 4, "i32", np.int32),
    DTypeInfo("int64", 8, "i64", np.int64),
    DTypeInfo("bool", 1, "bool", np.bool_),
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
        if hasattr(dtype, "shape") and not isinstance(dtype, (type, np.dtype)):
            # (np.dtype() reads any object's .dtype: an array, a traced value or an sf.Array would pass as
            # its dtype, where NumPy's own functions refuse it)
            raise TypeError(f"a dtype was expected, got an array ({type(dtype).__name__}): Cannot construct a "
                            "dtype from an array")
        name = np.dtype(dtype).name
        if name in DTYPES:
            _DTYPE_NAMES[dtype] = name
    if name not in DTYPES and isinstance(dtype, str):  # (NumPy's aliases: "f4", "float", "int", "i8", as np.sum takes)
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in DTYPES:
        kind = np.dtype(name).kind if name in np.sctypeDict else ""
        hint = "; cast first, e.g. ids.astype(np.int32) (token ids stored as uint16 too)" if kind and kind in "iu" \
            else "; complex values are not supported" if kind == "c" else \
            "; a bfloat16 array saved by np.save / np.savez comes back as void16: view it, x.view(ml_dtypes.bfloat16)" \
            if name == "void16" else ""
        raise TypeError(f"unsupported dtype {name!r}: expected one of {DTYPES}{hint}")
    return name


def np_dtype(name: str):
    """The NumPy dtype for a dtype name; bfloat16 comes from ml_dtypes."""
    got = _NP_DTYPES.get(name)
    if got is None:  # (remembered: every sf.Array made asks)
        if name == "bfloat16":
            import ml_dtypes

            got = np.dtype(ml_dtypes.bfloat16)
        else:
            got = np.dtype(name)
        if name in DTYPES:
            _NP_DTYPES[name] = got
    return got


_NP_DTYPES: dict = {}  # name -> NumPy dtype, for names of DTYPES


def dtype_pair(dtype) -> tuple:
    """(normalize_dtype(dtype), its NumPy dtype), remembered per dtype given: every sf.Array made asks."""
    try:
        return _PAIRS[dtype]  # (the hot path: a name or dtype seen before)
    except (KeyError, TypeError):  # (TypeError: unhashable, e.g. a list given as a dtype)
        pass
    name = normalize_dtype(dtype)
    got = (name, np_dtype(name))
    if isinstance(dtype, (str, np.dtype, type)):
        _PAIRS[dtype] = got
    return got


_PAIRS: dict = {}  # dtype as given (a name, a NumPy dtype or scalar type) -> (name, NumPy dtype)


FLOATS = ("float16", "bfloat16", "float32", "float64")
KINDS = {"bool": 0, "int32": 1, "int64": 1, **{f: 2 for f in FLOATS}}  # bool < integer < floating


def is_float(name: str) -> bool:
    return name in FLOATS


def promote_types(a: str, b: str) -> str:
    """The dtype of an op on arrays of dtypes a and b: as jnp.promote_types among floats (float16
    and bfloat16 meet at float32), as NumPy 2 otherwise (bool < int32 < int64; an integer beside a
    float gives float64 as NumPy's int32 + float32 does, and a larger float's own type): NumPy 2's
    result_type of two arrays of these dtypes, bfloat16's by ml_dtypes.  (Operators with scalars and
    weak values ask NumPy itself: shardfuse.promotion.)"""
    if a == b:
        return a
    if is_float(a) and is_float(b):
        if {a, b} == {"float16", "bfloat16"}:
            return "float32"
        return max(a, b, key=lambda t: TABLE[t].itemsize)
    if is_float(a) or is_float(b):
        f, other = (a, b) if is_float(a) else (b, a)
        return f if other == "bool" else "float64"
    return max(a, b, key=lambda t: (KINDS[t], TABLE[t].itemsize))


def poison_value(name: str):
    """What a poisoned buffer (SHARDFUSE_POISON=1, tests) is filled with: NaN for floats, the
    smallest integer, True; so that an element a plan never writes shows."""
    dt = np_dtype(name)
    return np.nan if is_float(name) else True if name == "bool" else np.iinfo(dt).min


def float_result(name: str) -> str:
    """The dtype of sqrt, log, exp, / ... of an array of dtype `name` (NumPy's: bool -> float16,
    int32 / int64 -> float64)."""
    return name if is_float(name) else "float16" if name == "bool" else "float64"


def order_key_dtype(dtype: str):
    """The integer dtype an Allreduce of max / min moves `dtype` values as (order-preserving keys,
    backends/extrema.py), or None where the values themselves go (integers)."""
    if dtype in ("int32", "int64"):
        return None
    return "int64" if dtype == "float64" else "int32"


def as_value(c, dtype: str):
    """A scalar as the plan stores it beside an array of `dtype`: rounded to that dtype where NumPy 2
    rounds a weak scalar (so that the kernels of every backend compare and pick the same value)."""
    if dtype == "bool":
        return bool(c)
    if not is_float(dtype):
        return int(c)
    with np.errstate(over="ignore"):  # (1e5 is inf in float16, as NumPy 2 compares it)
        return float(np_dtype(dtype).type(c)) if TABLE[dtype].itemsize < 8 else float(c)
