"""Placements round-trip exactly, and sf.from_local cuts several tensor axes (a new user's Llama
port, JAX/DTensor background).

`sf.shard(x, 0, ("tp", "dp"))` and `sf.shard(x, 0, ("dp", "tp"))` both reported placements
('S(0)', 'S(0)') though the devices hold different blocks, so `sf.distribute(x, mesh,
y.placements)` silently gave the other layout.  Now the order other than the mesh's is DTensor's
_StridedShard (sf.StridedShard), checked here against a simulation of DTensor's own splitting
rule.  `sf.from_local(piece, axis=(0, 1), over=("dp", "tp"))` raised "axis must be an int"; now it
takes several axes, a tuple of mesh axes per axis, and placements (DTensor's call form too).
tests/mpi/test_cases_mpi.py runs the from_local cases under mpiexec."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import cases
import shardfuse as sf


def mesh22():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def dtensor_rows(n, mesh, placements, device):
    """Which rows of a tensor of n rows `device` holds under DTensor's rule: mesh dims applied in
    order, Shard(0) keeping its contiguous chunk of the local rows, _StridedShard(0, sf) its chunk
    of each of sf groups (torch's _StridedShard._split_tensor)."""
    rows = np.arange(n)
    for name, p in zip(mesh.axis_names, placements):
        if isinstance(p, sf.Shard):
            k, c = mesh.axis_size(name), mesh.coords(device)[mesh.axis_index(name)]
            split = getattr(p, "split_factor", 1)
            chunks = np.split(rows, k * split)
            rows = np.concatenate(chunks[c::k])
    return rows


@pytest.mark.parametrize("order", [("tp", "dp"), ("dp", "tp")])
def test_both_orders_of_one_axis_over_two_mesh_axes_round_trip(order):
    mesh = mesh22()
    x = np.arange(8.0 * 3).reshape(8, 3)  # distinct data per device
    y = sf.shard(x, 0, order, mesh=mesh)
    want = {("dp", "tp"): (sf.Shard(0), sf.Shard(0)), ("tp", "dp"): (sf.StridedShard(0, split_factor=2), sf.Shard(0))}
    assert y.placements == want[order]
    assert y.sharding.placements(mesh) == {("dp", "tp"): ("S(0)", "S(0)"), ("tp", "dp"): ("_S(0, 2)", "S(0)")}[order]
    for s in y.addressable_shards:  # tp outermost: device (dp, tp) holds block tp * 2 + dp
        dp, tp = mesh.coords(s.device)
        block = tp * 2 + dp if order == ("tp", "dp") else dp * 2 + tp
        np.testing.assert_array_equal(s.data, x[2 * block:2 * block + 2])
        np.testing.assert_array_equal(x[dtensor_rows(8, mesh, y.placements, s.device)], s.data)
    for z in (sf.distribute(x, mesh, y.placements), sf.distribute(x, mesh, list(y.placements)),
              y.redistribute(y.placements), sf.distribute(x, mesh, (order,))):
        assert z.sharding == y.sharding
        for a, b in zip(z.addressable_shards, y.addressable_shards):
            np.testing.assert_array_equal(a.data, b.data)
    other = sf.distribute(x, mesh, y.placements).redistribute((order[::-1],))  # a real move, both ways
    assert other.placements != y.placements
    np.testing.assert_array_equal(other.redistribute(y.placements).gather(), x)


def test_every_order_over_three_mesh_axes_matches_dtensor_and_round_trips():
    mesh = sf.DeviceMesh((2, 2, 2), ("a", "b", "c"), backend="numpy")
    x = np.arange(16.0)
    for order in itertools.permutations("abc"):
        y = sf.shard(x, 0, order, mesh=mesh)
        assert sf.distribute(x, mesh, y.placements).sharding == y.sharding, (order, y.placements)
        for s in y.addressable_shards:
            np.testing.assert_array_equal(x[dtensor_rows(16, mesh, y.placements, s.device)], s.data)


def test_a_split_factor_that_names_no_order_is_refused():
    with pytest.raises(ValueError, match=r"split_factor must be the product of the sizes of leading mesh axes among "
                                         r"\('tp',\).*got 3"):
        sf.distribute(np.ones((8, 2)), mesh22(), [sf.StridedShard(0, 3), sf.Shard(0)])
    assert sf.distribute(np.ones((8, 2)), mesh22(), [sf.StridedShard(0, 1), sf.Shard(0)]).placements == \
        (sf.Shard(0), sf.Shard(0))  # (split_factor 1: the mesh's order)


@pytest.mark.parametrize("case", list(cases.FROM_LOCAL_2AXES))
def test_from_local_on_two_tensor_axes(case):
    cases.from_local_2axes_case(mesh22(), case)


def test_from_local_partial_sums_are_refused_and_the_way_round_works():
    cases.from_local_partial_sums_case(mesh22())


@pytest.mark.parametrize("kwargs, error, match", [
    ({"axis": (0, 1), "over": "dp"}, TypeError, r"over= must name mesh axes for each of those axes"),
    ({"axis": (0, 0), "over": ("dp", "tp")}, ValueError, r"names a tensor axis twice"),
    ({"axis": (0, 1), "over": ("dp", ("dp", "tp"))}, ValueError, r"a mesh axis shards at most one tensor axis"),
    ({"axis": 0, "placements": [sf.Shard(0), sf.Shard(1)]}, TypeError, r"placements= or axis="),
    ({}, TypeError, r"needs axis= \(and over=\), or placements="),
    ({"axis": (0, 1), "over": ("dp", "pp")}, ValueError, r"pp"),
    ({"axis": 0, "over": ("tp", "dp")}, ValueError, r"axis 0 of extent 6 cannot be cut into the 4 block\(s\) of this "
                                                   r"process. positions \[0, 1, 2, 3\] along mesh axes \(.tp., .dp.\)"),
])
def test_from_local_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        sf.from_local(np.ones((6, 4)), mesh=mesh22(), **kwargs)


def test_the_printed_placements_place_a_value_again():
    """a.sharding.placements(mesh) prints ('R', 'S(1)'); sf.distribute reads that back (a probe got
    "unknown mesh axis 'R'"), the strided form too; a mesh axis of such a name stays a mesh axis."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = np.random.default_rng().standard_normal((4, 8))
    for placements in ([sf.Replicate(), sf.Shard(1)], [sf.StridedShard(0, split_factor=2), sf.Shard(0)]):
        a = sf.distribute(x, mesh, placements)
        b = sf.distribute(x, mesh, a.sharding.placements(mesh))
        assert b.placements == a.placements and b.sharding == a.sharding
        np.testing.assert_array_equal(np.asarray(b), x)
    odd = sf.DeviceMesh((2,), ("R",), backend="numpy")
    assert sf.distribute(x, odd, ("R",)).placements == (sf.Shard(0),)


def test_compact_placements_mixed_with_placement_objects():
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = np.random.default_rng().standard_normal((4, 8))
    assert sf.distribute(x, mesh, (sf.Shard(0), "R")).placements == (sf.Shard(0), sf.Replicate())


def test_make_array_from_single_device_arrays_takes_addressable_shards_back():
    """JAX's make_array_from_single_device_arrays: the pieces of x.addressable_shards (or copies) with
    x.sharding rebuild x; a piece of another shape or a wrong count is refused naming the device."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    w = np.random.default_rng(3).standard_normal((8, 6))
    for spec in [("dp", "tp"), (("tp", "dp"), None), (None, "tp")]:
        x = sf.distribute(w, mesh, spec)
        back = sf.make_array_from_single_device_arrays(x.shape, x.sharding, [s.data.copy() for s in x.addressable_shards],
                                                       mesh=mesh)
        assert back.sharding == x.sharding
        np.testing.assert_array_equal(np.asarray(back), w)
    x = sf.distribute(w, mesh, ("dp", "tp"))
    with pytest.raises(ValueError, match="4 devices .* 3 arrays"):
        sf.make_array_from_single_device_arrays(x.shape, x.sharding, [s.data for s in x.addressable_shards][:3], mesh=mesh)
    with pytest.raises(ValueError, match="its box of"):
        sf.make_array_from_single_device_arrays(x.shape, ("dp", None), [s.data for s in x.addressable_shards], mesh=mesh)
    with pytest.raises(ValueError, match="needs mesh="):
        sf.make_array_from_single_device_arrays(x.shape, ("dp", "tp"), [s.data for s in x.addressable_shards])
    with pytest.raises(ValueError, match="extent 7 over dp"):  # (a review: an extent the mesh axis cannot cut)
        sf.make_array_from_single_device_arrays((7,), ("dp",), [np.arange(3.0)] * 4, mesh=mesh)
    z = sf.distribute(np.array(3.0), mesh, ())
    back = sf.make_array_from_single_device_arrays((), (), [s.data for s in z.addressable_shards], mesh=mesh)
    assert np.asarray(back).shape == () and float(back) == 3.0  # (a 0-d value stays 0-d: a step count)


def test_dtensors_keyword_spellings():
    """A DTensor-port probe: redistribute(device_mesh=, placements=), full_tensor(), .device_mesh and
    from_local(device_mesh=) were refused; they are DTensor's names of what shardfuse has."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    x = np.random.default_rng().standard_normal((4, 8))
    a = sf.distribute(x, mesh, [sf.Shard(0), sf.Replicate()])
    b = a.redistribute(device_mesh=mesh, placements=[sf.Replicate(), sf.Shard(1)])
    assert b.placements == (sf.Replicate(), sf.Shard(1)) and a.device_mesh is mesh
    assert a.redistribute(placements=[sf.Shard(1), sf.Shard(0)]).placements == (sf.Shard(1), sf.Shard(0))
    full = a.full_tensor()
    assert full.placements == (sf.Replicate(), sf.Replicate())
    np.testing.assert_array_equal(np.asarray(full), x)
    c = sf.from_local(x, device_mesh=mesh, placements=[sf.Replicate(), sf.Replicate()])
    np.testing.assert_array_equal(np.asarray(c), x)
    with pytest.raises(ValueError, match="the array lives on .* move values between meshes inside sf.jit"):
        a.redistribute(device_mesh=sf.DeviceMesh(2, backend="numpy"), placements=[sf.Replicate()])
