"""Pytrees, as JAX has them: nested tuples, lists, dicts and namedtuples of arrays (a model's
parameters as one dict), flattened into a list of leaves and a `TreeDef` that rebuilds the
same structure around other leaves.  sf.jit takes and returns them; everything else sees leaves.

JAX's conventions, so a model ported from JAX meets no surprise: a dict's leaves come in sorted
key order (and a rebuilt dict has its keys in that order, as jax.tree_util's), None is a node
with no leaves, and anything that is not a tuple, list, dict or None is a leaf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class TreeDef:
    """The structure of a pytree: `kind` is "leaf", "none", "tuple", "list", "dict" or a
    namedtuple class; `meta` a dict's keys in sorted order."""

    kind: Any
    children: tuple = ()
    meta: tuple = ()

    @property
    def num_leaves(self) -> int:
        return 1 if self.kind == "leaf" else sum(c.num_leaves for c in self.children)

    def unflatten(self, leaves) -> Any:
        leaves = list(leaves)
        if len(leaves) != self.num_leaves:
            raise ValueError(f"this tree structure holds {self.num_leaves} leaves, got {len(leaves)}")
        return self._build(iter(leaves))

    def _build(self, it):
        if self.kind == "leaf":
            return next(it)
        if self.kind == "none":
            return None
        built = [c._build(it) for c in self.children]
        if self.kind == "dict":
            return dict(zip(self.meta, built))
        if self.kind == "tuple":
            return tuple(built)
        if self.kind == "list":
            return built
        return self.kind(*built)  # a namedtuple

    def __str__(self):
        if self.kind == "leaf":
            return "*"
        if self.kind == "none":
            return "None"
        inner = ", ".join(map(str, self.children))
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.meta, self.children)) + "}"
        if self.kind == "tuple":
            return f"({inner}{',' if len(self.children) == 1 else ''})"
        if self.kind == "list":
            return f"[{inner}]"
        return f"{self.kind.__name__}({inner})"


LEAF = TreeDef("leaf")


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def flatten(tree) -> tuple[list, TreeDef]:
    """(leaves, structure) of a pytree, leaves in JAX's order (dicts by sorted key)."""
    leaves: list = []
    return leaves, _flatten(tree, leaves)


def _flatten(x, leaves) -> TreeDef:
    if x is None:
        return TreeDef("none")
    if isinstance(x, dict):
        try:
            keys = tuple(sorted(x))
        except TypeError:
            raise TypeError(f"a dict in a pytree needs sortable keys, got {list(x)!r}") from None
        return TreeDef("dict", tuple(_flatten(x[k], leaves) for k in keys), keys)
    if _is_namedtuple(x):
        return TreeDef(type(x), tuple(_flatten(c, leaves) for c in x))
    if isinstance(x, (tuple, list)):
        return TreeDef("tuple" if isinstance(x, tuple) else "list", tuple(_flatten(c, leaves) for c in x))
    leaves.append(x)
    return LEAF


def leaves(tree) -> list:
    return flatten(tree)[0]


def tree_map(fn: Callable, tree, *rest) -> Any:
    """fn applied to each leaf (and the matching leaves of `rest`, which must have tree's structure)."""
    xs, td = flatten(tree)
    others = []
    for r in rest:
        ys, rd = flatten(r)
        if rd != td:
            raise ValueError(f"tree_map: structures differ: {td} and {rd}")
        others.append(ys)
    return td.unflatten(fn(*args) for args in zip(xs, *others))
