"""The tensor-parallel MLP block: results, and exactly the collectives each mode should insert."""
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import Op
from cases import assert_close, fresh_rng
from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference


def specs(args):
    return [sf.TensorSpec(a.shape, a.dtype.name) for a in args]


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("mode", ["tp", "sp"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_mlp_1d(d, mode, chunks):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = mlp_block(mesh, mode, chunks=chunks, streams=2)
    args = mlp_inputs(fresh_rng(mesh), tokens=4 * d * chunks, hidden=2 * d)
    plan = f.lower(*specs(args))
    if mode == "sp":  # one gather chain in, one reduce-scatter chain out, nothing else
        # (at D = 1 the gathers fold into views and the reduce-scatters into the output become copies)
        assert plan.collectives() == ({} if d == 1 else {"allgather": chunks, "reduce_scatter": chunks})
    else:  # the pending sum of the row-parallel GEMM, all-reduced chunk by chunk (at D = 1: copies)
        assert plan.collectives() == ({} if d == 1 else {"allreduce": chunks})
    assert sum(i.op == Op.FOR for i in plan.program.instrs) == (2 if mode == "sp" else 1)
    out = f(*args)
    assert out.sharding.placements(mesh) == (("S(0)",) if mode == "sp" else ("R",))
    assert_close(out.gather(), mlp_reference(*args), "float64")


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_mlp_2d_data_and_tensor_parallel(mode):
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    f = mlp_block(mesh, mode, chunks=2, dp="dp")
    args = mlp_inputs(fresh_rng(mesh), tokens=8, hidden=4, batch=2)
    plan = f.lower(*specs(args))
    text = str(plan)
    assert "team=dp" not in text  # data parallelism needs no communication in the forward block
    expected = {"allgather": 2, "reduce_scatter": 2} if mode == "sp" else {"allreduce": 2}
    assert plan.collectives() == expected
    out = f(*args)
    assert out.sharding.placements(mesh) == (("S(0)", "S(1)") if mode == "sp" else ("S(0)", "R"))
    assert_close(out.gather(), mlp_reference(*args), "float64")


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_mlp_exact_gelu_matches_torch_nn_gelu(mode):
    """approximate=False: torch.nn.GELU()'s erf form, against the float64 reference (whose two
    forms differ by far more than the tolerance, so the option cannot pass unread)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    args = mlp_inputs(fresh_rng(mesh), tokens=8, hidden=4)
    args[0] = args[0] * 3  # (where the two forms differ by ~1e-3)
    exact, tanh = mlp_reference(*args, approximate=False), mlp_reference(*args)
    assert np.abs(exact - tanh).max() > 1e-4
    assert_close(mlp_block(mesh, mode, approximate=False)(*args).gather(), exact, "float64")


def test_mlp_sp_pipelines_both_ends():
    mesh = sf.DeviceMesh(4, backend="numpy")
    plan = mlp_block(mesh, "sp", chunks=2).lower(*specs(mlp_inputs(np.random.default_rng(), 16, 8)))
    loops = [i for i in plan.program.instrs if i.op == "for"]
    ops = [[b.op for b in loop.body if b.op in ("allgather", "matmul", "reduce_scatter")] for loop in loops]
    assert ops == [["allgather", "matmul"], ["matmul", "reduce_scatter"]]


def test_mlp_bad_mode():
    with pytest.raises(ValueError, match="mode must be 'tp' or 'sp', got 'pp'"):
        mlp_block(sf.DeviceMesh(2, backend="numpy"), "pp")
