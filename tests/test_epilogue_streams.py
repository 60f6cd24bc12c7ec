"""Pipelining a user expects from where sf.stream is written (a new-user probe found it silently
lost): a streamed epilogue (+ bias, an activation) streams the GEMM that feeds it, and a weight's
whole gather between a chunk's gather and its GEMM moves before the loop, so each plan is ONE
stream loop with the GEMM and the collectives of each chunk in it.  Values against NumPy in
float64 on random inputs."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import COMMUNICATION, Op

MESH = sf.DeviceMesh(4, backend="numpy")


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


CASES = {
    # name: (function, NumPy's, the ops every chunk's step holds)
    "relu epilogue, result moved to columns": (
        lambda x, w, b: sf.stream(sf.shard(sf.maximum(sf.shard(x, 0) @ w, 0.0), axis=1), axis=0, chunks=4),
        lambda x, w, b: np.maximum(x @ w, 0.0), {Op.MATMUL, Op.ALLTOALL}),
    "bias epilogue, gathered": (
        lambda x, w, b: sf.stream(sf.shard(x, 0) @ w + b, axis=0, chunks=2),
        lambda x, w, b: x @ w + b, {Op.MATMUL, Op.ALLGATHER}),
    "a chain of epilogues": (
        lambda x, w, b: sf.stream(sf.gelu(sf.shard(x, 0) @ w + b) * 2.0, axis=0, chunks=2),
        lambda x, w, b: _gelu(x @ w + b) * 2.0, {Op.MATMUL, Op.ALLGATHER}),
    "column-parallel weight gathered whole before the loop": (
        lambda x, w, b: sf.stream(sf.shard(x, 0) @ sf.shard(w, 1), axis=0, chunks=4),
        lambda x, w, b: x @ w, {Op.MATMUL, Op.ALLGATHER}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_loop_with_the_gemm_and_the_collectives(name):
    fn, ref, per_chunk = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    x, w, b = rng.standard_normal((16, 8)), rng.standard_normal((8, 8)), rng.standard_normal(8)
    f = sf.jit(fn, mesh=MESH)
    plan = f.lower(x, w, b)
    loops = [i for i in plan.program.instrs if i.op == Op.FOR]
    assert len(loops) == 1, str(plan)
    assert per_chunk <= {j.op for j in loops[0].body}, str(plan)
    # every collective of x's rows is in the loop (only a weight's whole gather may precede it)
    outside = [i for i in plan.program.instrs if i.op in COMMUNICATION]
    assert all(i.ins[0].name.startswith("w") for i in outside), str(plan)
    np.testing.assert_allclose(f(x, w, b).gather(), ref(x, w, b), rtol=1e-12, atol=1e-12)


def test_an_epilogue_gemm_the_split_would_refuse_stays_whole():
    """x over ("dp", "tp") on its rows and the product's rows over dp: streaming the GEMM with its
    epilogue would split an axis sharded two ways; the GEMM stays whole, the epilogue streams."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((16, 8)), rng.standard_normal((8, 8)), rng.standard_normal((16, 8))
    f = sf.jit(lambda x, w, b: sf.stream(sf.shard(sf.shard(x, 0, over=("dp", "tp")) @ w, 0, over="dp") + b,
                                         axis=0, chunks=2), mesh=mesh)
    np.testing.assert_allclose(f(x, w, b).gather(), x @ w + b, rtol=1e-12, atol=1e-12)


def test_a_sharded_producer_streams_only_with_chunks():
    """(the long property profile found it) gelu(gelu(x) sharded on rows) streamed with no chunks=:
    the inner gelu's rows are sharded, which sf.stream itself refuses to stream without chunks=; it
    stays whole (its chunks would cut the shards), the outer streams, values as NumPy's."""
    x = np.random.default_rng(0).standard_normal(4)
    f = sf.jit(lambda v: sf.stream(sf.gelu(sf.shard(sf.gelu(v), 0)), 0), mesh=MESH, streams=1)
    np.testing.assert_allclose(f(x).gather(), _gelu(_gelu(x)), rtol=1e-12, atol=1e-12)
