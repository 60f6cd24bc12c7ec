"""Constants: arrays a traced function closes over or makes while it is traced, and then combines
with traced values, become inputs of the program (as JAX's constants).

A NumPy array is a replicated input (as plain arrays passed in are), captured as a copy of its
value at trace time.  An sf.Array (on the program's mesh) is captured as it is, with its own
layout, as an sf.Array argument would be: no gather, and its pieces are read where they lie; an
op on one inside the traced function (``W * 2``) is traced too (array_ops.run asks `active`).
Each is captured once per trace (one array object, one input) and named `const`, `const_1`, ...:
the plan prints them among its inputs and in one comment line, and binds them itself at every
call after the function's own arguments (Program.constants), so they are part of the trace that
compiled the plan.  A function traced again (other input specs) captures what its arrays hold
then; nothing is compiled into the plan's text, so two traces with equal text and different
constants never share values.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

from shardfuse import dtypes
from shardfuse.ir import TensorType, Value
from shardfuse.pieces import Placed


class _Tracing(threading.local):
    def __init__(self):
        self.stack: list = []  # the builders tracing on this thread, the innermost last


_TRACING = _Tracing()


@contextmanager
def tracing(builder):
    """While trace.trace runs a function for `builder`: ops on sf.Arrays are traced into it."""
    _TRACING.stack.append(builder)
    try:
        yield
    finally:
        _TRACING.stack.pop()


def active():
    """The builder of the function being traced on this thread (the innermost), or None."""
    stack = _TRACING.stack
    return stack[-1] if stack else None


def is_constant(x) -> bool:
    """A NumPy array (a 0-d one too) or an sf.Array, which tracing captures: NumPy scalars stay
    scalars (strongly typed)."""
    return isinstance(x, (np.ndarray, Placed))


def capture(builder, array) -> Value:
    """`array` as an input value of `builder`'s program (traced.Builder.constant wraps it): a
    NumPy array replicated, an sf.Array with its layout; the plan binds it at each call."""
    held = builder.constants.get(id(array))
    if held is not None and held[0] is array:
        return held[2]
    if isinstance(array, Placed):
        value, kept = _placed(builder, array), array  # (immutable: the array itself, never copied)
    else:
        name = np.dtype(array.dtype).name
        if name not in dtypes.TABLE:
            raise TypeError(f"a NumPy array of dtype {name} (shape {array.shape}) met a traced value inside sf.jit: "
                            f"constants take the dtypes shardfuse has ({', '.join(dtypes.TABLE)}); cast it first")
        value, kept = Value(builder.namer("const"), TensorType(tuple(array.shape), name)), np.array(array, copy=True)
    builder.constants[id(array)] = (array, kept, value)  # (the caller's array kept: ids stay unique)
    return value


def value_of(t):
    """The NumPy array a traced value was captured from (a constant of its program), else None: what
    tracing may read at trace time."""
    for _, kept, value in t.builder.constants.values():
        if value is t.value and isinstance(kept, np.ndarray):
            return kept
    return None


def _placed(builder, x) -> Value:
    """A closed-over sf.Array as an input with its layout (as trace.trace makes an sf.Array argument's)."""
    if x.mesh != builder.mesh:
        raise ValueError(f"a function traced for {builder.mesh} uses an sf.Array of shape {x.shape} on {x.mesh}: a "
                         "closed-over sf.Array becomes a constant of the program only on the program's mesh; place it "
                         "there (sf.distribute, sf.shard(x, ..., mesh=)), or pass it as an argument")
    lay = x.sharding.on(x.sharding.home(builder.mesh))
    value = Value(builder.namer("const"), TensorType(tuple(x.shape), x.dtype_name, lay))
    builder.homes[value] = lay.mesh
    return value


def captured(builder) -> tuple:
    """(the constants' input values, their arrays), in capture order."""
    held = list(builder.constants.values())
    return tuple(v for _, _, v in held), tuple(a for _, a, _ in held)
