"""Pytrees, as JAX has them: nested tuples, lists, dicts and namedtuples of arrays (a model's
parameters as one dict), flattened into a list of leaves and a `TreeDef` that rebuilds the
same structure around other leaves.  sf.jit takes and returns them (`FlatFunction`: the user's
function as one of leaves, which is what tracing sees); everything below jit sees leaves.

JAX's conventions, so a model ported from JAX meets no surprise: a dict's leaves come in sorted
key order (and a rebuilt dict has its keys in that order, as jax.tree_util's), None is a node
with no leaves, and anything that is not a tuple, list, dict or None is a leaf.
"""
from __future__ import annotations

import builtins
import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class TreeDef:
    """The structure of a pytree: `kind` is "leaf", "none", "tuple", "list", "dict" or a
    namedtuple class; `meta` a dict's keys in sorted order."""

    kind: Any
    children: tuple = ()
    meta: tuple = ()
    hashed: int = field(init=False, compare=False, repr=False)  # (sf.jit keys its plans by it)

    def __post_init__(self):
        object.__setattr__(self, "hashed", hash((self.kind, self.children, self.meta)))

    def __hash__(self):
        return self.hashed

    def __reduce__(self):  # (by its fields: a str hash differs between processes, so it is made anew)
        return TreeDef, (self.kind, self.children, self.meta)

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
        inner = ", ".join(builtins.map(str, self.children))
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


_STRUCTURES: dict = {}  # a pytree's signature (see _walk) -> its TreeDef
MAX_STRUCTURES = 1024  # kept before the table starts over


def flatten(tree, is_leaf: Callable | None = None) -> tuple[list, TreeDef]:
    """(leaves, structure) of a pytree, leaves in JAX's order (dicts by sorted key); is_leaf(x)
    True makes x a leaf whatever it is (as jax.tree_util's is_leaf).

    sf.jit flattens its arguments on every call: a model's parameters are hundreds of leaves.  The
    structure is read as a flat signature (tokens in C-hashable tuples) and its TreeDef built only
    the first time it is seen, then looked up: the same TreeDef object each call, its hash kept."""
    leaves: list = []
    if is_leaf is not None:
        return leaves, _flatten(tree, leaves, is_leaf)
    signature: list = []
    _walk(tree, leaves, signature)
    key = tuple(signature)
    td = _STRUCTURES.get(key)
    if td is None:
        td = _flatten(tree, [], None)
        if len(_STRUCTURES) >= MAX_STRUCTURES:
            _STRUCTURES.clear()
        _STRUCTURES[key] = td
    return leaves, td


def _walk(x, leaves, signature) -> None:
    """x's leaves appended to `leaves`, and its structure to `signature` in preorder: 0 a leaf, 1
    None, ("t" | "l" | a namedtuple class, length) a sequence, ("d", keys, their types) a dict (the
    types: {1: x} and {True: x} have equal keys but are rebuilt with their own)."""
    if isinstance(x, dict):
        keys = _sorted_keys(x)
        signature.append(("d", keys, tuple(builtins.map(_key_type, keys))))
        children = [x[k] for k in keys]
    elif isinstance(x, (tuple, list)):
        kind = "l" if isinstance(x, list) else type(x) if hasattr(type(x), "_fields") else "t"
        signature.append((kind, len(x)))
        children = x
    elif x is None:
        signature.append(1)
        return
    else:
        leaves.append(x)
        signature.append(0)
        return
    for c in children:
        if c is None or isinstance(c, (dict, tuple, list)):
            _walk(c, leaves, signature)
        else:  # (a leaf without a call: most children are)
            leaves.append(c)
            signature.append(0)


def _key_type(k):
    """A dict key's type, through tuple keys ((1,) and (True,) are equal keys of other types)."""
    return (tuple, tuple(builtins.map(_key_type, k))) if type(k) is tuple else type(k)


def _sorted_keys(x: dict) -> tuple:
    try:
        return tuple(sorted(x))
    except TypeError:
        raise TypeError(f"a dict in a pytree needs sortable keys, got {list(x)!r}") from None


def _flatten(x, leaves, is_leaf=None) -> TreeDef:
    if is_leaf is not None and is_leaf(x):
        leaves.append(x)
        return LEAF
    if x is None:
        return TreeDef("none")
    if isinstance(x, dict):
        keys = _sorted_keys(x)
        return TreeDef("dict", tuple(_flatten(x[k], leaves, is_leaf) for k in keys), keys)
    if _is_namedtuple(x):
        return TreeDef(type(x), tuple(_flatten(c, leaves, is_leaf) for c in x))
    if isinstance(x, (tuple, list)):
        return TreeDef("tuple" if isinstance(x, tuple) else "list", tuple(_flatten(c, leaves, is_leaf) for c in x))
    leaves.append(x)
    return LEAF


def leaves(tree, is_leaf: Callable | None = None) -> list:
    """The leaves of a pytree in JAX's order (jax.tree_util.tree_leaves)."""
    if is_leaf is not None:
        return flatten(tree, is_leaf)[0]
    out: list = []
    _walk(tree, out, [])
    return out


def tree_map(fn: Callable, tree, *rest, is_leaf: Callable | None = None) -> Any:
    """fn applied to each leaf (and the matching leaves of `rest`, which must have tree's structure);
    is_leaf as flatten's (jax.tree_util.tree_map)."""
    xs, td = flatten(tree, is_leaf)
    return td.unflatten(fn(*args) for args in zip(xs, *_matching(td, rest, is_leaf)))


def _matching(td, rest, is_leaf) -> list:
    """The leaves of each of `rest`, which must have td's structure."""
    others = []
    for r in rest:
        ys, rd = flatten(r, is_leaf)
        if rd != td:
            raise ValueError(f"tree_map: structures differ: {td} and {rd}")
        others.append(ys)
    return others


def key_paths(td: TreeDef, prefix: tuple = ()) -> list:
    """Each leaf's path, in order: the tuple of dict keys, positions and namedtuple field names on
    the way to it (JAX's key paths, with the keys themselves where JAX has DictKey / SequenceKey /
    GetAttrKey objects)."""
    if td.kind == "leaf":
        return [prefix]
    if td.kind == "dict":
        keys = list(td.meta)
    elif td.kind in ("tuple", "list", "none"):
        keys = list(range(len(td.children)))
    else:
        keys = list(td.kind._fields)
    return [p for k, c in zip(keys, td.children) for p in key_paths(c, prefix + (k,))]


def tree_flatten_with_path(tree, is_leaf: Callable | None = None) -> tuple:
    """([(path, leaf)], structure) (jax.tree_util.tree_flatten_with_path; paths as key_paths')."""
    xs, td = flatten(tree, is_leaf)
    return list(zip(key_paths(td), xs)), td


def tree_map_with_path(fn: Callable, tree, *rest, is_leaf: Callable | None = None) -> Any:
    """fn(path, leaf, *the matching leaves of rest) for each leaf (jax.tree_util.tree_map_with_path):
    a weight decay that skips biases, `lambda path, w: w if path[-1].startswith("b") else w * 0.99`."""
    xs, td = flatten(tree, is_leaf)
    return td.unflatten(fn(p, *args) for p, args in zip(key_paths(td), zip(xs, *_matching(td, rest, is_leaf))))


def tree_structure(tree, is_leaf: Callable | None = None) -> TreeDef:
    """The TreeDef of a pytree (jax.tree_util.tree_structure)."""
    return flatten(tree, is_leaf)[1]


def tree_unflatten(treedef: TreeDef, leaves) -> Any:
    """The pytree of structure treedef holding `leaves` in order (jax.tree_util.tree_unflatten)."""
    return treedef.unflatten(leaves)


def tree_reduce(fn: Callable, tree, *initializer, is_leaf: Callable | None = None) -> Any:
    """functools.reduce(fn, the leaves[, initializer]) (jax.tree_util.tree_reduce)."""
    return functools.reduce(fn, flatten(tree, is_leaf)[0], *initializer)


def tree_all(tree, *, is_leaf: Callable | None = None) -> bool:
    """Whether every leaf is true (jax.tree_util.tree_all: all(leaves); a traced leaf refuses bool(),
    as JAX's tracers do: write sf.tree.tree_reduce(lambda a, b: a & b, ...) for a traced value)."""
    return builtins.all(flatten(tree, is_leaf)[0])


# jax.tree_util's names for the two above (sf.tree.tree_leaves(params), sf.tree.tree_flatten(params))
tree_leaves, tree_flatten = leaves, flatten


def is_container(x) -> bool:
    """Whether x is a pytree node rather than a leaf (None, a dict, list, tuple or namedtuple)."""
    return x is None or isinstance(x, (dict, list, tuple))


def is_flat(td: TreeDef) -> bool:
    """A tuple of leaves: the arguments (or results) of a function that takes (returns) arrays."""
    return td.kind == "tuple" and builtins.all(c is LEAF for c in td.children)


def leaf_paths(td: TreeDef, prefix: str) -> list:
    """A name per leaf: prefix, then each dict key, namedtuple field or position on its path,
    joined by '_' (params['w1'] -> params_w1, xs[2].b -> xs_2_b)."""
    if td.kind == "leaf":
        return [prefix]
    if td.kind == "dict":  # (a state_dict's "layers.0.w" as layers_0_w: a name must be an identifier)
        keys = _identifiers([str(k) for k in td.meta])
    elif td.kind in ("tuple", "list", "none"):
        keys = [str(i) for i in range(len(td.children))]
    else:
        keys = list(td.kind._fields)
    return [n for k, c in zip(keys, td.children) for n in leaf_paths(c, f"{prefix}_{k}")]


def _identifiers(keys: list) -> list:
    """Each key as an identifier: "fc1.weight" as fc1_weight, numbered where that is another key of the
    dict ("a.b" beside "a_b" is a_b_2: the user's own a_b keeps its name, a review)."""
    out = []
    for k in keys:
        name = re.sub(r"\W", "_", k)
        out.append(name if name == k else _free(name, set(keys) | set(out)))
    return out


def unique(names: list) -> list:
    """names with a repeated one numbered (keys "a_b" and "a.b" both read a_b: a_b, a_b_2)."""
    seen, out = set(names), []
    for n in names:
        if n in out:
            n = _free(n, seen)
            seen.add(n)
        out.append(n)
    return out


def _free(base: str, taken: set) -> str:
    """base, else the first of base_2, base_3, ... not taken."""
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


class FlatFunction:
    """fn, which takes one pytree per parameter and returns a pytree, as a function of the
    leaves of its arguments (structure in_tree) that returns a leaf or a tuple of leaves: what
    tracing sees.  Each call records the structure of fn's result in out_tree (None where fn
    returned a leaf or a tuple of leaves: nothing to rebuild).  Its signature names the leaves
    after their parameters and paths, so plans print params_w1, not an index."""

    def __init__(self, fn: Callable, in_tree: TreeDef | None = None, params: list | None = None):
        """in_tree None: fn's arguments are arrays, passed as they are (fn's own signature)."""
        self.fn, self.in_tree, self.out_tree = fn, in_tree, None
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        if in_tree is None:
            self.__signature__ = inspect.signature(fn)
            return
        names = unique([n for p, c in zip(params, in_tree.children) for n in leaf_paths(c, p)])
        P = inspect.Parameter
        self.__signature__ = inspect.Signature([P(n, P.POSITIONAL_ONLY) for n in names])

    def __call__(self, *leaves):
        out = self.fn(*(leaves if self.in_tree is None else self.in_tree.unflatten(leaves)))
        outs, td = flatten(out)
        # (a tuple of one leaf keeps its structure: f returning (x,) gives (x,), as JAX's jit does,
        # not x; a plan returns a bare tuple of its outputs only where there are several)
        self.out_tree = None if td is LEAF or (is_flat(td) and len(td.children) != 1) else td
        return outs[0] if td is LEAF else tuple(outs)


def leaves_with_path(tree, is_leaf: Callable | None = None) -> list:
    """[(key path, leaf), ...] (jax.tree.leaves_with_path)."""
    return tree_flatten_with_path(tree, is_leaf)[0]


# jax.tree's names (jax.tree.map, jax.tree.structure, ...): the same functions (this module uses the
# builtins map and all as builtins.map / builtins.all, which these names shadow here)
map, structure, unflatten, reduce, all = tree_map, tree_structure, tree_unflatten, tree_reduce, tree_all  # noqa: A001
flatten_with_path, map_with_path = tree_flatten_with_path, tree_map_with_path
