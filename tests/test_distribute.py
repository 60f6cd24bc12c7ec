"""sf.Array outside jit (issue 16): sf.distribute with DTensor placements or a JAX spec, and
x.redistribute / sf.shard / sf.replicate of an existing sf.Array through one-op plans."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import shardfuse as sf

MESH = sf.DeviceMesh((2, 2), backend="numpy")
P = [sf.Replicate(), sf.Shard(0), sf.Shard(1)]
ALL = list(itertools.product(P, P))  # every placement pair of a 2-D value on a 2 x 2 mesh


@pytest.mark.parametrize("src", ALL, ids=lambda p: ",".join(map(str, p)))
def test_every_redistribution_keeps_the_value_and_states_the_placements(src):
    x = np.random.default_rng().standard_normal((8, 12))
    a = sf.distribute(x, MESH, src)
    assert a.placements == tuple(src)
    np.testing.assert_array_equal(a.gather(), x)
    for dst in ALL:
        b = a.redistribute(dst)
        assert b.placements == tuple(dst), (src, dst)
        np.testing.assert_array_equal(b.gather(), x)
        for s, piece in zip(b.shards, b.addressable_shards):  # each device holds exactly its block
            np.testing.assert_array_equal(s, x[piece.index])


def test_jax_specs_mean_the_same_as_placements():
    x = np.random.default_rng().standard_normal((8, 4))
    assert sf.distribute(x, MESH, ("DIDy", "DIDx")).placements == (sf.Shard(0), sf.Shard(1))
    assert sf.distribute(x, MESH, (("DIDy", "DIDx"),)).placements == (sf.Shard(0), sf.Shard(0))
    assert sf.distribute(x, MESH, (None, "DIDy")).placements == (sf.Shard(1), sf.Replicate())
    both = sf.distribute(x, MESH, [sf.Shard(0), sf.Shard(0)])  # DTensor: dim 0 over both, mesh order
    np.testing.assert_array_equal(both.shards[1], x[2:4])  # device (0, 1) holds block 0 * 2 + 1


def test_shard_and_replicate_reshard_an_existing_array():
    x = np.random.default_rng().standard_normal((8, 4))
    a = sf.shard(x, axis=0, over="DIDy", mesh=MESH)
    b = sf.shard(a, axis=1, over="DIDx")  # was a DLPack error
    assert b.placements == (sf.Shard(0), sf.Shard(1))  # axis 0 keeps DIDy (the annotation rule, README)
    np.testing.assert_array_equal(b.gather(), x)
    c = sf.replicate(b)
    assert c.placements == (sf.Replicate(), sf.Replicate()) and all(np.array_equal(s, x) for s in c.shards)


@pytest.mark.parametrize("placements, error", [
    ([sf.Partial(), sf.Replicate()], "Partial\\(\\) is no placement of a whole value"),
    ([sf.Shard(0)], "one per mesh axis"),
    ([sf.Shard(2), sf.Replicate()], "Shard\\(2\\) of a value of 2 axes"),
    (("DIDz",), "DIDz"),
    (("DIDy", "DIDy"), "a mesh axis shards two tensor axes"),
    ((None, None, None), "3 entries for a value of 2 axes"),
])
def test_bad_placements_are_refused_with_what_was_expected(placements, error):
    with pytest.raises(ValueError, match=error):
        sf.distribute(np.ones((4, 4)), MESH, placements)


def test_extents_that_do_not_divide_and_other_meshes_are_refused():
    with pytest.raises(ValueError, match="does not divide 3"):
        sf.distribute(np.ones((3, 4)), MESH, [sf.Shard(0), sf.Replicate()])
    a = sf.distribute(np.ones((4, 4)), MESH, [sf.Shard(0), sf.Replicate()])
    with pytest.raises(ValueError, match="lives on DeviceMesh"):
        sf.shard(a, axis=1, mesh=sf.DeviceMesh(4, backend="numpy"))
