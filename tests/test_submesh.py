"""Moving values between meshes (pipeline stages): SendRecv, Broadcast, Scatter, Gather."""
import pytest

import shardfuse as sf
from cases import MOVES, move_case, pipeline_case


@pytest.fixture
def mesh():
    return sf.DeviceMesh(4, backend="numpy")


@pytest.mark.parametrize("entry", sorted(MOVES))
def test_move(mesh, entry):
    move_case(mesh, entry)


def test_two_stage_pipeline(mesh):
    pipeline_case(mesh)


def test_pipeline_plan_text(mesh):
    s0, s1 = mesh.submesh([0, 1]), mesh.submesh([2, 3])
    f = sf.jit(lambda x: sf.shard(sf.shard(x, axis=0, mesh=s0) * 2.0, axis=0, mesh=s1), mesh=mesh)
    text = str(f.lower(sf.TensorSpec((8, 6), "float64")))
    assert text.splitlines()[0] == "plan <lambda>(x: f64[8:DIDx, 6] @devices(0, 1)) -> (s: f64[8:DIDx, 6] @devices(2, 3))"
    # the scale is annotated onto stage 1, so it runs there: x moves first
    assert "  sendrecv = SendRecv x_moved <- x, from=(0, 1), to=(2, 3), axis=0" in text


def test_operands_on_different_meshes_need_a_move(mesh):
    s0, s1 = mesh.submesh([0, 1]), mesh.submesh([2, 3])
    f = sf.jit(lambda x, y: sf.replicate(x, mesh=s0) * 2.0 + sf.replicate(y, mesh=s1) * 2.0, mesh=mesh)
    with pytest.raises(ValueError, match="add: operands live on different meshes"):
        f.lower(sf.TensorSpec((4, 4)), sf.TensorSpec((4, 4)))


def test_bad_submeshes(mesh):
    with pytest.raises(ValueError, match="a sub-mesh needs distinct devices"):
        mesh.submesh([0, 0])
    with pytest.raises(ValueError, match="a sub-mesh needs distinct devices"):
        mesh.submesh([4])
    other = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda x: sf.replicate(x, mesh=other.submesh([1])), mesh=mesh)
    with pytest.raises(ValueError, match="is not the program's mesh"):
        f.lower(sf.TensorSpec((4, 4)))


def test_to_mesh_keeps_the_producer_on_its_mesh(mesh):
    s0, s1 = mesh.submesh([0, 1]), mesh.submesh([2, 3])
    f = sf.jit(lambda x: sf.to_mesh(sf.shard(x, axis=0, mesh=s0) * 2.0, s1, axis=0), mesh=mesh)
    lines = str(f.lower(sf.TensorSpec((8, 6), "float64"))).splitlines()
    assert lines[2:8] == [
        "  s = Allocate f64[8:DIDx, 6] @devices(0, 1)  (once)",
        "  Scale s <- x, value=2.0",
        "  s_moved = Allocate f64[8:DIDx, 6] @devices(2, 3)  (per call)",
        "  sendrecv = SendRecv s_moved <- s, from=(0, 1), to=(2, 3), axis=0",
        "  Wait sendrecv",
        "  return s_moved",
    ]


def test_collectives_inside_a_stage(mesh):
    from cases import stage_collectives_case

    stage_collectives_case(mesh)
