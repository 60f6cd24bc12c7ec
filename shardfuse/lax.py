"""sf.lax: jax.lax's control flow for shardfuse values, unrolled while the function is traced (a Llama
probe's port stopped at lax.scan over layers).

A shardfuse plan is a flat host program, so a loop runs as its unrolled steps: `scan` calls `f` once
per element of xs' leading axis, `fori_loop` once per index of static bounds, and a `cond` whose
predicate is a traced value computes both branches and selects with sf.where (a predicate Python
knows picks one branch, as jax.lax.cond does).  Results are jax.lax's; what differs is cost (each
step planned on its own: compile time grows with the length, and both branches of a traced cond
run).  A traced cond's gradient comes from the selected branch only, as JAX's: each branch is
differentiated alone and its gradients selected, for its operands and the values it closes over alike
(the other's, NaN where its derivative is infinite, is dropped by a select, never multiplied by 0).
`while_loop` needs a condition Python can decide, and refuses a
traced one.  These take pytrees as JAX's do, inside sf.jit or on sf.Arrays.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from shardfuse import constants, tree
from shardfuse.custom_rules import record
from shardfuse.custom_vjp import closures
from shardfuse.autodiff import backward, full_like, stop_gradient  # noqa: F401 (sf.lax.stop_gradient, JAX's)
from shardfuse.numpy_math import top_k  # noqa: F401 (sf.lax.top_k, JAX's name of sf.top_k)
from shardfuse.update_slice import dynamic_slice, dynamic_update_slice  # (sf.lax's, as jax.lax's)
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


def dynamic_slice_in_dim(operand, start_index, slice_size: int, axis: int = 0):
    """jax.lax.dynamic_slice_in_dim: dynamic_slice along one axis, the others whole."""
    axis = _axis(operand, axis, "dynamic_slice_in_dim")
    starts = [start_index if a == axis else 0 for a in range(operand.ndim)]
    return dynamic_slice(operand, starts, [slice_size if a == axis else n for a, n in enumerate(operand.shape)])


def dynamic_update_slice_in_dim(operand, update, start_index, axis: int):
    """jax.lax.dynamic_update_slice_in_dim: dynamic_update_slice at start_index along one axis, 0 on the others."""
    axis = _axis(operand, axis, "dynamic_update_slice_in_dim")
    return dynamic_update_slice(operand, update, [start_index if a == axis else 0 for a in range(operand.ndim)])


def _axis(x, axis, what) -> int:
    from shardfuse.spec import normalize_axis

    if not hasattr(x, "ndim"):
        raise TypeError(f"sf.lax.{what}: the operand must be an array, got {type(x).__name__}")
    return normalize_axis(axis, x.ndim, tuple(x.shape))


def _carried(init):
    """init with its NumPy arrays as values of the function being traced (JAX makes a carry arrays: a probe's
    fori_loop(0, n, lambda i, b: b.at[i].set(t), np.zeros(4)) met a NumPy array's missing .at); as it is
    outside sf.jit."""
    leaves = tree.flatten(init)[0]
    builder = next((v.builder for v in leaves if isinstance(v, Traced)), None) or constants.active()
    return init if builder is None else tree.tree_map(builder.constant, init)


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
    carry, ys = _carried(init), []
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
    return carry, ytd.unflatten([stack(list(vs)) for vs in per_leaf])


def fori_loop(lower: int, upper: int, body_fun: Callable, init_val):
    """jax.lax.fori_loop with bounds Python knows: val = body_fun(i, val) for i in range(lower, upper)."""
    if isinstance(lower, Traced) or isinstance(upper, Traced):
        raise TypeError("sf.lax.fori_loop: the bounds must be Python ints (the loop is unrolled when traced); a "
                        "bound computed inside sf.jit, or passed to it as an argument, is known only when the plan "
                        "runs: pass it as a static argument (sf.jit(f, static_argnums=...): a plan per value)")
    val = _carried(init_val)
    for i in range(int(lower), int(upper)):
        new = body_fun(i, val)
        _check_carry("sf.lax.fori_loop", val, new)
        val = new
    return val


def while_loop(cond_fun: Callable, body_fun: Callable, init_val):
    """jax.lax.while_loop where cond_fun gives a value Python can decide (a traced one is refused: so its
    carry's NumPy arrays stay NumPy arrays, which the condition may read)."""
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
    return _selected("sf.lax.cond", [p], [true_fun, false_fun], operands)


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
    if n == 1:  # (one branch: whatever the index, a review: its picks were none)
        return branches[0](*operands)
    i = index.clip(0, n - 1)  # (clamped as JAX's)
    return _selected("sf.lax.switch", [i == k for k in range(n - 1)], list(branches), operands)


def _selected(what, picks, branches, operands):
    """Every branch traced on the operands, its result taken where its pick (a 0-d bool; the last branch
    where none is) says.  Where a gradient is traced, the call is a rule of its own (custom_rules.record):
    each branch differentiated alone and its gradients taken where its result was, for the operands
    and for the values the branches close over alike, so the branch not taken contributes nothing, NaN
    included (sqrt's infinite derivative at 0 there gave NaN, where JAX's cond gives 0)."""
    builder = picks[0].builder
    starts, outs = [], []
    for b in branches:
        starts.append(len(builder.instrs))
        outs.append(b(*operands))
    for k, o in enumerate(outs[:-1]):
        if not _same(o, outs[-1]):
            raise TypeError(f"{what}: the branches must give the same structure, shapes and dtypes, got "
                            f"{_signature(o)} (branch {k}) and {_signature(outs[-1])} (branch {len(outs) - 1})")
    bounds = starts + [len(builder.instrs)]
    out = _pick(picks, outs)
    if not builder.fresh:
        return out
    inputs = closures(builder, starts[0], set())  # (operands and closed-over values: whatever the branches read)
    return record(builder, what, inputs, out, what, lambda _: functools.partial(_branch_cotangents, builder, picks,
                                                                                bounds, outs, inputs))


def _pick(picks, values):
    """values[k] where picks[k] says (the last where none does), leaf by leaf."""
    out = values[-1]
    for k in reversed(range(len(picks))):
        out = tree.tree_map(lambda a, b, k=k: where(picks[k], a, b), values[k], out)
    return out


def _branch_cotangents(builder, picks, bounds, outs, inputs, cts):
    """The inputs' cotangents: each branch's, through its own ops alone (autodiff.backward), taken where
    its result was."""
    wrt = [x.value for x in inputs]
    per_branch = []
    for k, o in enumerate(outs):  # (a leaf a branch gives as a Python number has no cotangent to take)
        pairs = [(v.value, c) for v, c in zip(tree.leaves(o), cts) if isinstance(v, Traced)]
        per_branch.append(backward(builder, builder.instrs[bounds[k]:bounds[k + 1]], wrt, [v for v, _ in pairs],
                                   [c for _, c in pairs]))
    grads = []
    for j, x in enumerate(inputs):
        got = [g[j] for g in per_branch]
        if all(g is None for g in got):
            grads.append(None)
            continue
        zero = full_like(x, 0.0)
        grads.append(_pick(picks, [zero if g is None else g for g in got]))
    return grads
