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
zeros; integer arguments get None.

`nondiff_argnums` is JAX's too: the arguments at those positions are Python values (a scale, a
string, a callable, a NumPy constant), static, never differentiated.  `fwd` takes them where the
function does; `bwd` takes them first, `bwd(*nondiff_args, residuals, g)`, and returns cotangents
for the other arguments only:

    @functools.partial(sf.custom_vjp, nondiff_argnums=(0,))
    def clip_gradient(bound, x):
        return x

    clip_gradient.defvjp(lambda bound, x: (x, None),
                         lambda bound, _, g: (np.clip(g, -bound, bound),))

A traced array there is refused, as JAX refuses a Tracer (since its PR #4008): its gradient would be
silently dropped.  Pass it as an ordinary argument and return None for it from `bwd`.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from shardfuse import tree
from shardfuse.dtypes import FLOATS
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
    """A function with a hand-written backward: `f = sf.custom_vjp(fun, nondiff_argnums=())`, then
    `f.defvjp(fwd, bwd)` (jax.custom_vjp's API; the module doc has examples).  The arguments at
    `nondiff_argnums` are static Python values that `fwd` takes in place and `bwd` takes first."""

    def __init__(self, fun: Callable, nondiff_argnums=()):
        if not callable(fun):
            raise TypeError(f"sf.custom_vjp wraps a function, got {type(fun).__name__}")
        self.fun, self.fwd, self.bwd = fun, None, None
        self.nondiff_argnums = _checked_argnums(fun, nondiff_argnums)
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        """Set the rule: fwd(*args) -> (output, residuals); bwd(*nondiff_args, residuals, output
        cotangent) -> a tuple of one cotangent (or None) per differentiable argument."""
        if not (callable(fwd) and callable(bwd)):
            first = "*nondiff_args, " if self.nondiff_argnums else ""
            raise TypeError(f"custom_vjp.defvjp(fwd, bwd) takes two functions: fwd(*args) -> (output, residuals) "
                            f"and bwd({first}residuals, output_cotangent) -> a tuple of one cotangent per "
                            f"{'differentiable ' if first else ''}argument")
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args):
        name = getattr(self.fun, "__name__", "custom_vjp")
        static, dynamic = self._split(name, args)
        builder = differentiated(dynamic)
        if builder is None:  # no gradient traced here: the function itself
            return self.fun(*args)
        if self.fwd is None:
            raise TypeError(f"sf.custom_vjp function {name} is differentiated but has no rule: call "
                            f"{name}.defvjp(fwd, bwd) first")
        start = len(builder.instrs)
        res = self.fwd(*args)
        if not (isinstance(res, tuple) and len(res) == 2):
            raise TypeError(f"the fwd of sf.custom_vjp function {name} must return a pair (output, residuals), "
                            f"got {type(res).__name__}")
        out, residuals = res
        leaves, args_tree = tree.flatten(dynamic)
        closed = closures(builder, start, {x.value for x in leaves if isinstance(x, Traced)})
        if closed:  # (its gradient would be dropped silently: JAX refuses it too)
            raise TypeError(f"sf.custom_vjp function {name} closes over {', '.join(x.value.name for x in closed)}, "
                            "a value being differentiated: its rule gives cotangents for its arguments only, so "
                            "that gradient would be lost (JAX refuses it too); pass the value as an argument")
        return record(builder, name, leaves, out, f"the fwd of sf.custom_vjp function {name}",
                      lambda outs_tree: functools.partial(_cotangents, name, leaves, args_tree, outs_tree, residuals,
                                                          self.bwd, static))

    def _split(self, name, args) -> tuple:
        """(the nondiff arguments, in nondiff_argnums' order; the others, in theirs), checked."""
        if not self.nondiff_argnums:
            return (), args
        if self.nondiff_argnums[-1] >= len(args):
            raise TypeError(f"sf.custom_vjp function {name} has nondiff_argnums={self.nondiff_argnums} but was "
                            f"called with {len(args)} positional argument(s)")
        for i in self.nondiff_argnums:
            if any(isinstance(x, Traced) for x in tree.leaves(args[i])):
                raise TypeError(f"sf.custom_vjp function {name}: argument {i} is in nondiff_argnums but holds a "
                                f"traced array (a jit input or a value computed from one); as JAX refuses a "
                                f"Tracer there, nondiff arguments are static Python values (a scale, a string, a "
                                f"callable, a NumPy constant). Pass the array as an ordinary argument and have "
                                f"bwd return None for it")
        nondiff = set(self.nondiff_argnums)
        return (tuple(args[i] for i in self.nondiff_argnums),
                tuple(x for i, x in enumerate(args) if i not in nondiff))


def _checked_argnums(fun, argnums) -> tuple:
    """nondiff_argnums as sorted distinct positions (JAX's), each a non-negative int naming a
    positional parameter of fun where its signature says how many it has."""
    argnums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
    try:
        argnums = tuple(argnums)
    except TypeError:
        raise TypeError(f"sf.custom_vjp(nondiff_argnums=...) takes a tuple of argument positions, got "
                        f"{type(argnums).__name__} {argnums!r}") from None
    bad = [k for k in argnums if isinstance(k, bool) or not isinstance(k, int) or k < 0]
    if bad:
        raise TypeError(f"sf.custom_vjp(nondiff_argnums={argnums!r}): positions are non-negative ints "
                        f"(counted from the first argument), got {', '.join(map(repr, bad))}")
    n = _positional_count(fun)
    if n is not None and any(k >= n for k in argnums):
        raise ValueError(f"sf.custom_vjp(nondiff_argnums={argnums!r}): "
                         f"{getattr(fun, '__name__', 'the function')} has {n} positional parameter(s), "
                         f"so positions run 0..{n - 1}")
    return tuple(sorted(set(argnums)))


def _positional_count(fun):
    """How many positional parameters fun has; None where that is open (*args) or unknown (a
    builtin without a signature)."""
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return None
    P = inspect.Parameter
    if any(p.kind == P.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) for p in params)


def differentiated(args):
    """The builder of a call's traced arguments where sf.grad is tracing a gradient; None where the
    call is the function itself (outside jit, or no gradient traced)."""
    traced = [x for x in tree.leaves(args) if isinstance(x, Traced)]
    return traced[0].builder if traced and traced[0].builder.fresh else None


def closures(builder, start, given) -> list:
    """The traced values that the ops recorded since `start` read but did not make, other than `given`
    (the call's own traced arguments' values), and that a gradient being traced reaches (they depend
    on sf.grad's primals, floats): the values a function closes over, which JAX differentiates as its
    arguments (jax.checkpoint, a cond's branches; jax.custom_vjp refuses them)."""
    active = set(builder.fresh)
    for i in builder.instrs[:start]:
        if not active.isdisjoint(i.ins):
            active.update(i.outs)
    made, found = set(), []
    for i in builder.instrs[start:]:
        found += [v for v in i.ins if v in active and v not in made and v not in given and v not in found]
        made.update(i.outs)
    return [Traced(builder, v) for v in found if v.type.dtype in FLOATS]


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


def _cotangents(name, args, args_tree, outs_tree, residuals, bwd, static, cts: list) -> list:
    """bwd's cotangent for each differentiable argument leaf of the call (None: none), given the
    outputs' (Traced, zeros where none arrived), checked against the arguments' shapes; `static`:
    the nondiff arguments, which bwd takes first (JAX's order)."""
    got = bwd(*static, residuals, outs_tree.unflatten(cts))
    n = len(args_tree.children)
    if not isinstance(got, tuple) or len(got) != n:
        per = "differentiable argument (none for nondiff_argnums)" if static else "argument"
        raise TypeError(f"the bwd of sf.custom_vjp function {name} must return a tuple of {n} cotangent(s), "
                        f"one per {per}, got {type(got).__name__}"
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
