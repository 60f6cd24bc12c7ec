"""Layouts the front end must never get wrong: streamed axes that are also sharded, inputs
placed differently from what the function annotates, and the verifier invariant that would
have caught those (a Slice never cuts a sharded axis; every sharded extent divides evenly)."""
import numpy as np
import pytest

import shardfuse as sf
from cases import assert_close
from shardfuse.ir import Idx, Instr, TensorType, Value
from shardfuse.layout import Layout
from shardfuse.passes.verify import PlanError, verify


def _mesh(d=4):
    return sf.DeviceMesh(d, backend="numpy")


@pytest.mark.parametrize("op", ["matmul", "scale", "batched", "batched_sum"])
def test_stream_axis_that_an_input_shards_without_chunks(op):
    """chunks omitted on an axis whose input is sharded: one chunk per index of each shard."""
    mesh, rng = _mesh(), np.random.default_rng()
    x = rng.standard_normal((8, 4, 6) if op.startswith("batched") else (16, 8))
    w = rng.standard_normal((6, 5) if op.startswith("batched") else (8, 6))
    bodies = {
        "matmul": (lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0), lambda: x @ w),
        "scale": (lambda x, w: sf.stream(sf.shard(x, axis=0) * 2.0, axis=0), lambda: x * 2.0),
        "batched": (lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0), lambda: x @ w),
        "batched_sum": (lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0).sum(0), lambda: (x @ w).sum(0)),
    }
    fn, ref = bodies[op]
    out = sf.jit(fn, mesh=mesh)(x, w)
    assert_close(out.gather(), ref(), "float64")


def test_seed_function_on_an_input_already_sharded_on_the_stream_axis():
    """The seed shards axis 1; an argument sharded on axis 0 (the stream axis) is resharded
    whole before the loop, never sliced one row of a 4-way split at a time."""
    mesh, rng = _mesh(), np.random.default_rng()
    A, B = rng.standard_normal((8, 4, 16, 32)), rng.standard_normal((32, 24))
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh)
    out = f(sf.shard(A, axis=0, mesh=mesh), B)
    assert_close(out.gather(), A @ B, "float64")
    plan = next(iter(f._plans.values()))
    assert "a2a = AllToAll a_1 <- a, team=DIDx, axis=0, to_axis=1\n" in str(plan)  # before the loop


def test_verify_refuses_a_slice_across_shards():
    mesh = _mesh()
    x = Value("x", TensorType((16, 8), "float64", Layout(("DIDx", None))))
    xi = Value("x_i", TensorType((1, 8), "float64", Layout(("DIDx", None))))
    from shardfuse.ir import Program

    loop = Instr("for", attrs={"var": "i", "extent": 16, "results": {}},
                 body=(Instr("set_stream", attrs={"stream": "Stream(0)", "index": 0}),
                       Instr("slice", (xi,), (x,), {"axis": 0, "index": Idx("i")}),
                       Instr("set_stream", attrs={"stream": "main"})))
    prog = Program("bad", mesh, (x,), (x,), (loop,), 1, ("handmade",))
    with pytest.raises(PlanError, match="x_i.*extent 1 is sharded over DIDx"):
        verify(prog)
