"""sf.custom_vjp: a function whose gradient is written by hand (jax.custom_vjp's API).

    @sf.custom_vjp
    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def softmax_fwd(x):                 # (output, residuals): what the backward reads
        y = softmax(x)
        return y, y

    def softmax_bwd(y, g):              # (residuals, output cotangent) -> one cotangent per argument
        return (y * (g - (g * y).sum(-1, keepdims=True)),)

    softmax.defvjp(softmax_fwd, softmax_bwd)

Traced under sf.grad (or value_and_grad, vjp, torch_function) the call runs `fwd` into the program
and records a `CustomRule` on the builder; autodiff.backward, walking the forward backwards, hands
the cotangents of the outputs to `bwd` where the call ended instead of differentiating the ops
`fwd` recorded, so the backward holds only the residuals `fwd` returned (softmax's output, not its
exponentials too).  The ops of `bwd` are traced like any others: their shardings come from the
rules and their communication from the planner.  Where no gradient is being traced (a plain
sf.jit forward, or outside jit) the call is the function itself, as JAX's.

As JAX's: arguments and outputs are pytrees of arrays; `bwd` returns a tuple with one entry per
argument (a pytree like it, or None for no cotangent); cotangents that reach no output arrive as
zeros; integer arguments get None.  `nondiff_argnums` is not supported: close over non-array
arguments instead (functools.partial or a closure).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from shardfuse import tree
from shardfuse.traced import Traced


@dataclass(eq=False)
class CustomRule:
    """One traced call whose backward is not its ops' (an sf.custom_vjp function's, sf.checkpoint's):
    where that backward goes and what it reads."""

    name: str
    args: list  # the call's argument leaves (Traced or not), in tree order
    outs: list  # the output leaves (Traced)
    after: Any  # the last instruction recorded when the call returned (its outputs' views): the backward runs there
    cotangents: Callable  # [the outputs' cotangents] -> [a cotangent or None per argument leaf]


class custom_vjp:  # noqa: N801 (JAX's name)
    """A function with a hand-written backward: `f = sf.custom_vjp(fun)`, then `f.defvjp(fwd, bwd)`
    (jax.custom_vjp's API; the module doc has an example)."""

    def __init__(self, fun: Callable):
        if not callable(fun):
            raise TypeError(f"sf.custom_vjp wraps a function, got {type(fun).__name__}")
        self.fun, self.fwd, self.bwd = fun, None, None
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        if not (callable(fwd) and callable(bwd)):
            raise TypeError("custom_vjp.defvjp(fwd, bwd) takes two functions: fwd(*args) -> (output, residuals) "
                            "and bwd(residuals, output_cotangent) -> a tuple of one cotangent per argument")
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args):
        builder = differentiated(args)
        if builder is None:  # no gradient traced here: the function itself
            return self.fun(*args)
        name = getattr(self.fun, "__name__", "custom_vjp")
        if self.fwd is None:
            raise TypeError(f"sf.custom_vjp function {name} is differentiated but has no rule: call "
                            f"{name}.defvjp(fwd, bwd) first")
        res = self.fwd(*args)
        if not (isinstance(res, tuple) and len(res) == 2):
            raise TypeError(f"the fwd of sf.custom_vjp function {name} must return a pair (output, residuals), "
                            f"got {type(res).__name__}")
        out, residuals = res
        leaves, args_tree = tree.flatten(args)
        return record(builder, name, leaves, out, f"the fwd of sf.custom_vjp function {name}",
                      lambda outs_tree: functools.partial(_cotangents, name, leaves, args_tree, outs_tree, residuals,
                                                          self.bwd))


def differentiated(args):
    """The builder of a call's traced arguments where sf.grad is tracing a gradient; None where the
    call is the function itself (outside jit, or no gradient traced)."""
    traced = [x for x in tree.leaves(args) if isinstance(x, Traced)]
    return traced[0].builder if traced and traced[0].builder.fresh else None


def record(builder, name, leaves, out, what, make_cotangents):
    """out, each output a value of this call's own (a view), and the call's CustomRule recorded:
    an output that is an argument, the same value twice, or another rule's output (a nested call)
    gets a cotangent of its own.  make_cotangents(the outputs' tree) -> the rule's cotangents."""
    outs, outs_tree = tree.flatten(out)
    if not outs or not all(isinstance(o, Traced) for o in outs):
        raise TypeError(f"{what} must return arrays computed from its arguments, got "
                        f"{', '.join(type(o).__name__ for o in outs) or 'none'}")
    outs = [o.reshape(o.shape) for o in outs]
    builder.custom_rules.append(CustomRule(name, leaves, outs, builder.instrs[-1], make_cotangents(outs_tree)))
    return outs_tree.unflatten(outs)


def rules_at(builder, instrs) -> dict:
    """id(instruction) -> the custom rules of the calls that ended with it (their outputs' last
    view), for the instructions in instrs."""
    here = {id(i) for i in instrs}
    out: dict = {}
    for r in builder.custom_rules:
        if id(r.after) in here:
            out.setdefault(id(r.after), []).append(r)
    return out


def _cotangents(name, args, args_tree, outs_tree, residuals, bwd, cts: list) -> list:
    """bwd's cotangent for each argument leaf of the call (None: none), given the outputs' (Traced,
    zeros where none arrived), checked against the arguments' shapes."""
    got = bwd(residuals, outs_tree.unflatten(cts))
    n = len(args_tree.children)
    if not isinstance(got, tuple) or len(got) != n:
        raise TypeError(f"the bwd of sf.custom_vjp function {name} must return a tuple of {n} cotangent(s), "
                        f"one per argument, got {type(got).__name__}"
                        + (f" of {len(got)}" if isinstance(got, (tuple, list)) else ""))
    flat = []
    for arg_tree, g in zip(args_tree.children, got):
        leaves = [None] * arg_tree.num_leaves if g is None else tree.flatten(g)[0]
        if len(leaves) != arg_tree.num_leaves:
            raise TypeError(f"the bwd of sf.custom_vjp function {name} returned a cotangent of structure "
                            f"{tree.flatten(g)[1]} for an argument of structure {arg_tree}")
        flat += leaves
    for x, g in zip(args, flat):
        if g is not None and not isinstance(g, Traced):
            raise TypeError(f"the bwd of sf.custom_vjp function {name} must return arrays computed from its "
                            f"residuals and cotangents (or None), got {type(g).__name__}")
        if g is not None and isinstance(x, Traced) and tuple(g.shape) != tuple(x.shape):
            raise ValueError(f"the bwd of sf.custom_vjp function {name} returned a cotangent of shape "
                             f"{tuple(g.shape)} for an argument of shape {tuple(x.shape)}")
    return flat
