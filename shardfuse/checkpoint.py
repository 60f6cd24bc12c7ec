"""sf.checkpoint: a function whose intermediates the backward computes again instead of keeping
(jax.checkpoint / jax.remat, torch.utils.checkpoint).

    @sf.checkpoint
    def block(params, x):                   # a layer: under sf.grad only its inputs are kept
        return sf.nn.transformer_layer(params, x, heads=8)

Traced under sf.grad (value_and_grad, vjp, torch_function), the call records its ops as usual (the
forward's values) and a `CustomRule` (shardfuse.custom_vjp) in place of their backward: where the
backward reaches the call it traces the function again on the same inputs and differentiates that
copy, so none of the call's intermediates lives from the forward into the backward; memory holds
one layer's activations at a time instead of every layer's, for one more forward per layer.  The
copy's reshardings are marked `recomputed` so the compiler never shares them with the forward's
(JAX's prevent_cse=True): an input the forward gathered is gathered again, not kept.  Where no
gradient is traced the call is the function itself.
"""
from __future__ import annotations

import functools
from typing import Callable

from shardfuse import tree
from shardfuse.autodiff import backward
from shardfuse.custom_rules import record
from shardfuse.custom_vjp import closures, differentiated
from shardfuse.traced import Traced


def checkpoint(fun: Callable) -> Callable:
    """fun, its intermediates computed again by the backward instead of kept (jax.checkpoint)."""
    if not callable(fun):
        raise TypeError(f"sf.checkpoint wraps a function, got {type(fun).__name__}")

    @functools.wraps(fun)
    def call(*args, **kwargs):
        builder = differentiated((args, kwargs))
        if builder is None:  # no gradient traced here: the function itself
            return fun(*args, **kwargs)
        name, start, leaves = getattr(fun, "__name__", "checkpoint"), len(builder.instrs), tree.leaves((args, kwargs))
        out = fun(*args, **kwargs)
        # (values fun closes over are inputs too, as jax.checkpoint's: their gradient was dropped, a zero)
        closed = closures(builder, start, {x.value for x in leaves if isinstance(x, Traced)})
        return record(builder, name, leaves + closed, out, f"sf.checkpoint: {name}",
                      lambda _: functools.partial(_again, fun, args, kwargs, builder, closed))
    return call


def _again(fun, args, kwargs, builder, closed, cts: list) -> list:
    """The cotangents of the leaves of (args, kwargs) and of the values fun closes over (`closed`): fun
    traced again here, in the backward, and that copy differentiated (cts: its outputs')."""
    start = len(builder.instrs)
    builder.recomputing += 1
    try:
        outs = tree.leaves(fun(*args, **kwargs))
    finally:
        builder.recomputing -= 1
    leaves = tree.leaves((args, kwargs)) + closed
    wrt = list(dict.fromkeys(x.value for x in leaves if isinstance(x, Traced)))  # (an array passed twice: once)
    grads = dict(zip(wrt, backward(builder, builder.instrs[start:], wrt, [o.value for o in outs], cts)))
    return [grads.pop(x.value, None) if isinstance(x, Traced) else None for x in leaves]
