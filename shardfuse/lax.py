"""sf.lax: jax.lax's control flow for shardfuse values, unrolled while the function is traced (a Llama
probe's port stopped at lax.scan over layers).

A shardfuse plan is a flat host program, so a loop runs as its unrolled steps: `scan` calls `f` once
per element of xs' leading axis, `fori_loop` once per index of static bounds, and a `cond` whose
predicate is a traced value computes both branches and selects with sf.where (a predicate Python
knows picks one branch, as jax.lax.cond does).  Results are jax.lax's; what differs is cost (each
step planned on its own: compile time grows with the length, and both branches of a traced cond
run).  A traced cond's gradient reaches its operands through the selected branch only, as JAX's (the
other's cotangent, NaN where its derivative is infinite, is dropped by a select, never multiplied by 0);
values the branches close over instead of taking as operands still get 0 times the other branch's
derivative (pass them as operands).  `while_loop` needs a condition Python can decide, and refuses a
traced one.  These take pytrees as JAX's do, inside sf.jit or on sf.Arrays.
"""
from __future__ import annotations

from typing import Any, Callable

from shardfuse import tree
from shardfuse.autodiff import stop_gradient
from shardfuse.shape_ops import stack
from shardfuse.traced import Traced
from shardfuse.traced_numpy import where


def _signature(x) -> tuple:
    """(structure, each leaf's shape and dtype; None for a Python number's, weak as JAX's): what a loop's
    carry must keep."""
    leaves, td = tree.flatten(x)
    return td, tuple((tuple(getattr(v, "shape", ())), str(v.dtype) if hasattr(v, "dtype") else None) for v in leaves)


def _same(a, b) -> bool:
    (ta, la), (tb, lb) = _signature(a), _signature(b)
    return ta == tb and all(sa == sb and None in (da, db) or (sa, da) == (sb, db) for (sa, da), (sb, db) in zip(la, lb))


def _check_carry(what: str, before, after) -> None:
    if not _same(before, after):
        raise TypeError(f"{what}: the carry must keep its structure, shapes and dtypes (as jax.lax's), got "
                        f"{_signature(before)} in and {_signature(after)} out")


def scan(f: Callable, init, xs=None, length: int | None = None, reverse: bool = False, unroll: Any = 1):
    """jax.lax.scan: (carry, ys) where carry, y = f(carry, x) for each x along xs' leading axis (a pytree;
    None with `length`), ys the ys stacked on a new leading axis (None where f returns None).  `unroll`
    is accepted for JAX's signature; every step is unrolled."""
    leaves, td = tree.flatten(xs)
    n = {int(v.shape[0]) for v in leaves}
    if length is not None:
        n.add(int(length))
    if len(n) != 1:
        raise ValueError(f"sf.lax.scan: xs' leaves need one leading extent (or length= without xs), got {sorted(n)}")
    (n,) = n
    carry, ys = init, []
    for k in (reversed(range(n)) if reverse else range(n)):
        x = td.unflatten([v[k] for v in leaves]) if leaves else None
        new, y = f(carry, x)
        _check_carry("sf.lax.scan", carry, new)
        carry = new
        ys.append(y)
    if reverse:
        ys.reverse()
    if not ys or all(y is None for y in ys):
        return carry, None
    ytd = tree.flatten(ys[0])[1]
    per_leaf = list(zip(*(tree.flatten(y)[0] for y in ys)))
    return carry, ytd.unflatten([stack(list(vs), axis=0) for vs in per_leaf])


def fori_loop(lower: int, upper: int, body_fun: Callable, init_val):
    """jax.lax.fori_loop with bounds Python knows: val = body_fun(i, val) for i in range(lower, upper)."""
    if isinstance(lower, Traced) or isinstance(upper, Traced):
        raise TypeError("sf.lax.fori_loop: the bounds must be Python ints (the loop is unrolled when traced); a "
                        "bound computed inside sf.jit, or passed to it as an argument, is known only when the plan "
                        "runs: pass it as a static argument (sf.jit(f, static_argnums=...): a plan per value)")
    val = init_val
    for i in range(int(lower), int(upper)):
        new = body_fun(i, val)
        _check_carry("sf.lax.fori_loop", val, new)
        val = new
    return val


def while_loop(cond_fun: Callable, body_fun: Callable, init_val):
    """jax.lax.while_loop where cond_fun gives a value Python can decide (a traced one is refused)."""
    val = init_val
    while True:
        go = cond_fun(val)
        if isinstance(go, Traced):
            raise TypeError("sf.lax.while_loop: the condition is a traced value, known only when the plan runs, and "
                            "shardfuse unrolls loops when it traces them; bound the loop (sf.lax.fori_loop with "
                            "Python ints) and select with sf.where")
        if not go:
            return val
        new = body_fun(val)
        _check_carry("sf.lax.while_loop", val, new)
        val = new


def cond(pred, true_fun: Callable, false_fun: Callable, *operands):
    """jax.lax.cond: true_fun(*operands) if pred else false_fun(*operands).  A traced pred (a 0-d bool or
    number) runs both and selects each leaf with sf.where; the two results must match in structure,
    shapes and dtypes, as JAX requires."""
    if not isinstance(pred, Traced):
        return true_fun(*operands) if pred else false_fun(*operands)
    if pred.shape != ():
        raise TypeError(f"sf.lax.cond: the predicate must be a scalar (0-d), got shape {pred.shape}")
    p = pred if pred.dtype_name == "bool" else pred != 0
    graded = bool(pred.builder.fresh)  # (a gradient traced: each branch reads its operands through a select of p)
    t = true_fun(*(_through(p, operands, True) if graded else operands))
    f = false_fun(*(_through(p, operands, False) if graded else operands))
    if not _same(t, f):
        raise TypeError(f"sf.lax.cond: the branches must give the same structure, shapes and dtypes, got "
                        f"{_signature(t)} and {_signature(f)}")
    return tree.tree_map(lambda a, b: where(p, a, b), t, f)


def _through(p, operands, taken):
    """operands as the branch taken where p is `taken` reads them: the same values, but the gradient
    reaches them from that branch only where it is selected (a select drops the other's, NaN included:
    sqrt's infinite derivative at 0 in the branch not taken gave NaN, where JAX's cond gives 0)."""
    def gate(x):
        if not isinstance(x, Traced) or x.dtype.kind != "f":
            return x
        held = stop_gradient(x)
        return where(p, x, held) if taken else where(p, held, x)
    return tree.tree_map(gate, operands)


def switch(index, branches, *operands):
    """jax.lax.switch: branches[index](*operands), index clamped to the branches, as JAX's; a traced index
    runs every branch and selects (cond's rules)."""
    if not branches:
        raise ValueError("sf.lax.switch: no branches")
    n = len(branches)
    if not isinstance(index, Traced):
        return branches[min(max(int(index), 0), n - 1)](*operands)
    if index.shape != ():
        raise TypeError(f"sf.lax.switch: the index must be a scalar (0-d), got shape {index.shape}")
    i, graded = index.clip(0, n - 1), bool(index.builder.fresh)  # (clamped as JAX's)
    outs = [b(*(_through(i == k, operands, True) if graded else operands)) for k, b in enumerate(branches)]
    for k, o in enumerate(outs[:-1]):
        if not _same(o, outs[-1]):
            raise TypeError(f"sf.lax.switch: the branches must give the same structure, shapes and dtypes, got "
                            f"{_signature(o)} (branch {k}) and {_signature(outs[-1])} (branch {n - 1})")
    out = outs[-1]
    for k in reversed(range(n - 1)):
        out = tree.tree_map(lambda a, b, k=k: where(i == k, a, b), outs[k], out)
    return out
