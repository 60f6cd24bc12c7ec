"""Calls whose backward is not their ops' (sf.custom_vjp's, sf.checkpoint's, a traced cond's, and the
JAX gradients of jax_gradients.py): each recorded on its builder as a CustomRule, which autodiff.backward
runs where the call ended instead of differentiating the ops it recorded.  Below traced.py (no import of
it), so that traced values' own methods can record one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shardfuse import tree


@dataclass(eq=False)
class CustomRule:
    """One traced call whose backward is not its ops': where that backward goes and what it reads."""

    name: str
    args: list  # the call's argument leaves (Traced or not), in tree order
    outs: list  # the output leaves (Traced)
    after: Any  # the last instruction recorded when the call returned (its outputs' views): the backward runs there
    cotangents: Callable  # [the outputs' cotangents] -> [a cotangent or None per argument leaf]


def record(builder, name, leaves, out, what, make_cotangents):
    """out, each output a value of this call's own (a view), and the call's CustomRule recorded:
    an output that is an argument, the same value twice, or another rule's output (a nested call)
    gets a cotangent of its own.  make_cotangents(the outputs' tree) -> the rule's cotangents."""
    outs, outs_tree = tree.flatten(out)
    if not outs or not all(getattr(o, "builder", None) is builder for o in outs):  # (traced values of this trace)
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
