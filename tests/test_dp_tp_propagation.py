"""Issue 31 item 7 (second half): with tokens sharded over ("dp", "tp"), the row-parallel MLP
communicates what a data-parallel user expects: an Allgather over tp into the column-parallel GEMM
and a ReduceScatter over tp out of the row-parallel one, each GEMM on its dp shard of the tokens
(no collective across dp, no GEMM repeated on every dp rank).  Values against NumPy, in one
process and (tests/mpi/test_grad_mpi.py) under mpiexec -n 4."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf

MESH = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def mlp(order):
    def f(x, w1, w2):
        x = sf.shard(x, axis=0, over=order)
        h = sf.gelu(x @ sf.shard(w1, axis=1, over="tp"))
        return sf.shard(h @ sf.shard(w2, axis=0, over="tp"), axis=0, over=order)
    return sf.jit(f, mesh=MESH)


def reference(x, w1, w2):
    h = x @ w1
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))) @ w2


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((16, 8)), rng.standard_normal((8, 32)), rng.standard_normal((32, 8))


def test_tokens_over_dp_and_tp_communicate_over_tp_only():
    x, w1, w2 = _inputs(0)
    f = mlp(("dp", "tp"))
    plan = f.lower(x, w1, w2)
    assert plan.collectives() == {"allgather": 1, "reduce_scatter": 1}, str(plan)
    teams = {i.attrs.get("team") for i in plan.program.walk() if "team" in i.attrs}
    assert teams == {"tp"}, str(plan)
    matmuls = [i for i in plan.program.walk() if i.op == "matmul"]
    assert all(i.into.type.layout.axes[0] == "dp" for i in matmuls), str(plan)  # each on its dp shard of tokens
    np.testing.assert_allclose(np.asarray(f(x, w1, w2)), reference(x, w1, w2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", [("tp", "dp"), "dp", "tp"])
def test_other_token_shardings_stay_exact(order):
    x, w1, w2 = _inputs(1)
    np.testing.assert_allclose(np.asarray(mlp(order)(x, w1, w2)), reference(x, w1, w2), rtol=1e-12, atol=1e-12)
