"""Constants: NumPy arrays a traced function closes over or makes while it is traced, and then
combines with traced values, become replicated inputs (as plain arrays passed in are) of the program (as JAX's constants).

Each is captured once per trace (one array object, one input), as a copy of its value at trace
time, and named `const`, `const_1`, ...: the plan prints them among its inputs and in one comment
line, and binds them itself at every call after the function's own arguments (Program.constants),
so they are part of the trace that compiled the plan.  A function traced again (other input specs)
captures what its arrays hold then; nothing is compiled into the plan's text, so two traces with
equal text and different constants never share values.
"""
from __future__ import annotations

import numpy as np

from shardfuse import dtypes
from shardfuse.ir import TensorType, Value


def is_constant(x) -> bool:
    """A NumPy array (a 0-d one too) that tracing captures: NumPy scalars stay scalars (strongly typed)."""
    return isinstance(x, np.ndarray)


def capture(builder, array: np.ndarray) -> Value:
    """`array` as an input value of `builder`'s program (traced.Builder.constant wraps it): a
    replicated input the plan binds at each call."""
    held = builder.constants.get(id(array))
    if held is not None and held[0] is array:
        return held[2]
    name = np.dtype(array.dtype).name
    if name not in dtypes.TABLE:
        raise TypeError(f"a NumPy array of dtype {name} (shape {array.shape}) met a traced value inside sf.jit: "
                        f"constants take the dtypes shardfuse has ({', '.join(dtypes.TABLE)}); cast it first")
    value = Value(builder.namer("const"), TensorType(tuple(array.shape), name))
    builder.constants[id(array)] = (array, np.array(array, copy=True), value)  # (the caller's array kept: ids stay unique)
    return value


def captured(builder) -> tuple:
    """(the constants' input values, their arrays), in capture order."""
    held = list(builder.constants.values())
    return tuple(v for _, _, v in held), tuple(a for _, a, _ in held)
