"""Pytrees (shardfuse/tree.py) with jax.tree_util's conventions: dicts by sorted key, None a node
without leaves, namedtuples kept, anything else a leaf."""
from collections import namedtuple

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import tree

Pair = namedtuple("Pair", "w b")


def test_flatten_orders_dict_leaves_by_key_and_rebuilds_the_structure():
    params = {"wq": 1, "b": [2, (3, None)], "a": Pair(4, {"z": 5, "y": 6})}
    leaves, td = tree.flatten(params)
    assert leaves == [4, 6, 5, 2, 3, 1]  # a (Pair(w, b={y, z})), b, wq
    back = td.unflatten(leaves)
    assert back == params and list(back) == ["a", "b", "wq"] and isinstance(back["a"], Pair)
    assert td.num_leaves == 6
    assert str(td) == "{'a': Pair(*, {'y': *, 'z': *}), 'b': [*, (*, None)], 'wq': *}"


def test_arrays_and_scalars_are_leaves_and_none_has_none():
    x = np.ones(3)
    assert tree.flatten(x) == ([x], tree.LEAF)
    assert tree.flatten(None)[0] == [] and tree.flatten(None)[1].unflatten([]) is None
    assert tree.flatten((x,))[1].unflatten([7]) == (7,)


def test_unflatten_checks_the_number_of_leaves():
    _, td = tree.flatten({"a": 1, "b": 2})
    with pytest.raises(ValueError, match="holds 2 leaves, got 3"):
        td.unflatten([1, 2, 3])


def test_tree_map_over_matching_structures():
    a, b = {"w": 1.0, "b": [2.0]}, {"w": 10.0, "b": [20.0]}
    assert tree.tree_map(lambda x, y: x + y, a, b) == {"b": [22.0], "w": 11.0}
    with pytest.raises(ValueError, match="structures differ"):
        tree.tree_map(lambda x, y: x, a, {"w": 1.0})


def test_dict_keys_must_sort():
    with pytest.raises(TypeError, match="sortable keys"):
        tree.flatten({1: 0, "a": 1})


def test_a_structure_seen_before_is_the_same_treedef_and_keeps_its_own_keys():
    # sf.jit flattens its arguments every call: a structure is looked up by its signature, so the
    # second flatten returns the very TreeDef of the first (its hash kept), and structures that
    # only look alike stay apart: {1: x} and {True: x}, a tuple and a namedtuple, [] and None
    import pickle

    a = {"l0": {"w": 1, "b": 2}, "l1": {"w": 3, "b": 4}}
    td = tree.flatten(a)[1]
    assert tree.flatten({"l1": {"b": 5, "w": 6}, "l0": {"w": 7, "b": 8}})[1] is td
    assert list(tree.flatten({1: 0})[1].unflatten([9])) == [1]
    assert list(tree.flatten({True: 0})[1].unflatten([9])) == [True]
    assert type(list(tree.flatten({True: 0})[1].unflatten([9]))[0]) is bool
    assert isinstance(tree.flatten(Pair(1, 2))[1].unflatten([3, 4]), Pair)
    assert type(tree.flatten((1, 2))[1].unflatten([3, 4])) is tuple
    assert tree.flatten([[], None])[1].unflatten([]) == [[], None]
    assert tree.flatten([None, []])[1].unflatten([]) == [None, []]
    assert tree.flatten([[1], 2])[1] != tree.flatten([1, [2]])[1]
    back = pickle.loads(pickle.dumps(td))
    assert back == td and hash(back) == hash(td) and {back: 1}[td] == 1
    assert tree.leaves(a) == [2, 1, 4, 3]


def test_tuple_keys_of_other_types_are_other_structures():
    # (1,) == (True,) as keys: the signature holds their types through tuples (the review of 2026-12-06)
    first = tree.flatten({(1,): 0})[1]
    other = tree.flatten({(True,): 0})[1]
    assert type(list(other.unflatten([5]))[0][0]) is bool and type(list(first.unflatten([5]))[0][0]) is int


def test_jax_tree_names_are_the_same_functions():
    """jax.tree.map / structure / unflatten / reduce / all / leaves_with_path / ... (a JAX port wrote
    sf.tree.map and met an AttributeError), over a nested pytree."""
    t = {"layer": {"w": 2.0, "b": (3.0, 4.0)}, "emb": 5.0}
    assert sf.tree.map(lambda x, y: x * y, t, t) == sf.tree.tree_map(lambda x, y: x * y, t, t)
    td = sf.tree.structure(t)
    assert sf.tree.unflatten(td, sf.tree.leaves(t)) == t and sf.tree.flatten(t)[1] == td
    assert sf.tree.reduce(lambda a, b: a + b, t) == 14.0 and sf.tree.all(t) and not sf.tree.all({"a": 0.0})
    assert [leaf for _, leaf in sf.tree.leaves_with_path(t)] == sf.tree.leaves(t)
    assert sf.tree.flatten_with_path(t) == sf.tree.tree_flatten_with_path(t)
    assert sf.tree.map_with_path(lambda path, x: len(path), t) == {"layer": {"w": 2, "b": (3, 3)}, "emb": 1}
