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
from typing import Callable

from shardfuse import tree
from shardfuse.custom_rules import record, rules_at
from shardfuse.numpy_math import NO_GRADIENT as MATH_NO_GRADIENT
from shardfuse.ops import COMPARE, COMPARE_SCALAR, Op
from shardfuse.dtypes import FLOATS
from shardfuse.traced import Traced, describe


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
            raise TypeError(f"sf.custom_vjp function {name} closes over a value being differentiated (a traced "
                            f"array computed from sf.grad's arguments: {', '.join(map(describe, closed))}): its rule "
                            "gives cotangents for its arguments only, so that gradient would be lost (JAX refuses "
                            "it too); pass the value as an argument")
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


# ops whose results no gradient flows through (comparisons, fills, sign, floor, isnan & co.)
NO_GRADIENT = COMPARE | COMPARE_SCALAR | {Op.LOGICAL_NOT, Op.FILL_THEN, Op.FILL_ELSE, Op.FULL_LIKE, Op.FLOOR_DIVIDE}
NO_GRADIENT |= MATH_NO_GRADIENT  # (shardfuse/numpy_math.py)


def propagate_active(builder, instrs, active: set, custom: dict | None = None) -> set:
    """`active` (values a gradient reaches: floats) grown through instrs in order, as autodiff.backward
    sees them: an op's float results where it reads an active value (not through NO_GRADIENT ops nor
    stop_gradient's views), a recorded rule's outputs where it reads one (custom: rules_at's)."""
    custom = rules_at(builder, instrs) if custom is None else custom
    for ins in instrs:
        if ins.op not in NO_GRADIENT and not active.isdisjoint(ins.ins):
            active.update(o for o in ins.outs if o.type.dtype in FLOATS and o not in builder.no_gradient)
        for r in custom.get(id(ins), ()):
            if any(isinstance(a, Traced) and a.value in active for a in r.args):
                active.update(o.value for o in r.outs if o.dtype_name in FLOATS)
    return active


def closures(builder, start, given) -> list:
    """The traced values that the ops recorded since `start` read but did not make, other than `given`
    (the call's own traced arguments' values), and that a gradient being traced reaches (they depend
    on sf.grad's primals, floats): the values a function closes over, which JAX differentiates as its
    arguments (jax.checkpoint, a cond's branches; jax.custom_vjp refuses them)."""
    active = propagate_active(builder, builder.instrs[:start], {v for v in builder.fresh if v.type.dtype in FLOATS})
    made, found = set(), []
    for i in builder.instrs[start:]:
        for v in i.ins:  # (one at a time: an op reading a value twice, v * v, found it twice, a fuzzer)
            if v in active and v not in made and v not in given and v not in found:
                found.append(v)
        made.update(i.outs)
    return [Traced(builder, v) for v in found]


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
