"""Every entry of the resharding table, on virtual meshes (tests/mpi/ runs them under mpiexec)."""
import pytest

import shardfuse as sf
from cases import RESHARD_TABLE, reshard_case


@pytest.mark.parametrize("entry", sorted(RESHARD_TABLE))
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_reshard_entry(d, entry):
    reshard_case(sf.DeviceMesh(d, backend="numpy"), entry)


def test_alltoall_plan_text():
    mesh = sf.DeviceMesh(4, backend="numpy")
    f = sf.jit(lambda x: sf.shard(sf.shard(x, axis=0) * 2.0, axis=1), mesh=mesh)
    text = str(f.lower(sf.TensorSpec((8, 12, 5), "float64")))
    # rank r's send is block r of axis 1 of its [2, 12, 5] piece: strided, so the plan stages it,
    # stored as the AllToAll reads it (4 blocks of axis 1, block r first); the receive is contiguous
    assert text.splitlines()[2:7] == [
        "  x_moved = Allocate f64[8, 12:DIDx, 5]  (once)",
        "  x_staged = Allocate f64[8:DIDx, 12, 5]  (once, as 4 blocks of axis 1)",
        "  Copy x_staged <- x",
        "  a2a = AllToAll x_moved <- x_staged, team=DIDx, axis=0, to_axis=1",
        "  Wait a2a",
    ]


def test_a_pending_sum_cannot_be_made_by_resharding():
    from shardfuse.layout import Layout
    from shardfuse.passes.lower import reshard_steps

    with pytest.raises(ValueError, match=r"cannot reshard \('R',\) -> \('P',\) over DIDx"):
        reshard_steps(Layout((None,)), Layout((None,), ("DIDx",)), sf.DeviceMesh(2, backend="numpy"))
