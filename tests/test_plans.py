"""Exact texts of printed plans: the printed host program is a contract.

Each expected text was read and checked by hand: which collectives the compiler inserts,
where buffers live, which stream each chunk runs on.
"""
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import Op
from shardfuse.ir import Instr, Program
from shardfuse.layout import Layout
from shardfuse.passes import PIPELINE, compile_program
from shardfuse.passes.verify import PlanError, verify

T = sf.TensorSpec


@pytest.fixture
def mesh():
    return sf.DeviceMesh(4, backend="numpy")


def ag_matmul(a, b):
    a = sf.shard(a, axis=1, over="DIDx")
    return sf.stream(a @ b, axis=0)


def ag_then_matmul(a, b):
    a = sf.shard(a, axis=1, over="DIDx")
    return sf.replicate(a @ b)


def linear(x, w):
    x = sf.shard(x, axis=0, over="DIDx")
    return sf.stream(x @ w, axis=0, chunks=2)


def row_parallel(x, w):
    return sf.shard(sf.shard(x, axis=1) @ sf.shard(w, axis=0), axis=0)


def total(x):
    return sf.shard(x, axis=1).sum(1)


def column(x, w):
    return sf.shard(x @ w, axis=0)


SEED = """\
plan ag_matmul(a: f32[8, 4:DIDx, 16, 32], b: f32[32, 24]) -> (c: f32[8, 4, 16, 24])
  # mesh DIDx=4, streams=4
  main = GetCurrentStream
  a_gathered_pool = Allocate 4 x f32[1, 4, 16, 32]  (one per stream)
  c = Allocate f32[8, 4, 16, 24]  (per call)
  entry = RecordEvent main
  For i in range(8):
    SetCurrentStream Stream(i % 4)
    WaitEvent entry
    a_i: f32[1, 4:DIDx, 16, 32] = Slice a, axis=0, index=i
    a_gathered_i: f32[1, 4, 16, 32] = Select a_gathered_pool, index=i % 4
    ag = Allgather a_gathered_i <- a_i, team=DIDx, axis=1
    Wait ag
    c_i: f32[1, 4, 16, 24] = Slice c, axis=0, index=i
    Matmul c_i <- a_gathered_i @ b
    SetCurrentStream main
    Synchronize Stream(i % 4)
  return c
"""

UNPIPELINED = """\
plan ag_then_matmul(a: f32[8, 4:DIDx, 16, 32], b: f32[32, 24]) -> (c: f32[8, 4, 16, 24])
  # mesh DIDx=4, streams=4
  a_gathered = Allocate f32[8, 4, 16, 32]  (once, rank-major)
  ag = Allgather a_gathered <- a, team=DIDx, axis=1
  Wait ag
  c = Allocate f32[8, 4, 16, 24]  (per call)
  Matmul c <- a_gathered @ b
  return c
"""

NATURAL = """\
plan linear(x: f64[64:DIDx, 32], w: f64[32, 24]) -> (c: f64[64, 24])
  # mesh DIDx=4, streams=4
  main = GetCurrentStream
  x_split: f64[4:DIDx, 2, 8, 32] = View x
  x_split_gathered_pool = Allocate 2 x f64[4, 1, 8, 32]  (one per stream)
  c_split = Allocate f64[4, 2, 8, 24]  (per call)
  entry = RecordEvent main
  For i in range(2):
    SetCurrentStream Stream(i % 2)
    WaitEvent entry
    x_split_i: f64[4:DIDx, 1, 8, 32] = Slice x_split, axis=1, index=i
    x_split_gathered_i: f64[4, 1, 8, 32] = Select x_split_gathered_pool, index=i % 2
    ag = Allgather x_split_gathered_i <- x_split_i, team=DIDx, axis=0
    Wait ag
    c_split_i: f64[4, 1, 8, 24] = Slice c_split, axis=1, index=i
    Matmul c_split_i <- x_split_gathered_i @ w
    SetCurrentStream main
    Synchronize Stream(i % 2)
  c: f64[64, 24] = View c_split
  return c
"""

REDUCE_SCATTER = """\
plan row_parallel(x: f32[8, 12:DIDx], w: f32[12:DIDx, 4]) -> (c: f32[8:DIDx, 4])
  # mesh DIDx=4, streams=4
  c_partial = Allocate f32[8, 4] partial(DIDx)  (once)
  Matmul c_partial <- x @ w
  c = Allocate f32[8:DIDx, 4]  (per call)
  rs = ReduceScatter c <- c_partial, team=DIDx, axis=0
  Wait rs
  return c
"""

ALLREDUCE = """\
plan total(x: f32[8, 12:DIDx]) -> (s_reduced: f32[8])
  # mesh DIDx=4, streams=4
  s = Allocate f32[8] partial(DIDx)  (once)
  Sum s <- x, axis=1
  s_reduced = Allocate f32[8]  (per call)
  ar = Allreduce s_reduced <- s, team=DIDx
  Wait ar
  return s_reduced
"""

SLICE = """\
plan column(x: f32[8, 3], w: f32[3, 4]) -> (c: f32[8:DIDx, 4])
  # mesh DIDx=4, streams=4
  x_sliced: f32[8:DIDx, 3] = ShardSlice x, axis=0, team=DIDx
  c = Allocate f32[8:DIDx, 4]  (per call)
  Matmul c <- x_sliced @ w
  return c
"""

CASES = {
    "SEED": (ag_matmul, [T((8, 4, 16, 32)), T((32, 24))], SEED),
    "UNPIPELINED": (ag_then_matmul, [T((8, 4, 16, 32)), T((32, 24))], UNPIPELINED),
    "NATURAL": (linear, [T((64, 32), "float64"), T((32, 24), "float64")], NATURAL),
    "REDUCE_SCATTER": (row_parallel, [T((8, 12)), T((12, 4))], REDUCE_SCATTER),
    "ALLREDUCE": (total, [T((8, 12))], ALLREDUCE),
    "SLICE": (column, [T((8, 3), layout=Layout.replicated(2)), T((3, 4), layout=Layout.replicated(2))], SLICE),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_text(mesh, name):
    fn, specs, expected = CASES[name]
    assert str(sf.jit(fn, mesh=mesh).lower(*specs)) == expected.rstrip("\n")


def test_the_plan_a_call_runs_went_through_every_pass_and_verify_last(mesh):
    """The plan that a call runs (the one the jitted function keeps, not a fresh .lower) was made by
    every pass of PIPELINE once, in order, and verified last: no pass changes it after verify."""
    rng = np.random.default_rng(0)
    f = sf.jit(ag_matmul, mesh=mesh)
    f(rng.standard_normal((8, 4, 16, 32)).astype(np.float32), rng.standard_normal((32, 24)).astype(np.float32))
    (plan,) = f.cached_plans().values()
    assert plan.program.history == ("trace",) + tuple(p.__name__ for p in PIPELINE)
    assert PIPELINE[-1] is verify and len(set(PIPELINE)) == len(PIPELINE)


def test_every_stage_is_stamped_by_the_pass_that_made_it(mesh):
    """Each prefix of the pipeline stops where it is asked to, and its program's history names
    exactly the passes that ran (a pass that stamps another's name, or none, fails here)."""
    from shardfuse.trace import trace

    prog = trace(ag_matmul, mesh, [T((8, 4, 16, 32)), T((32, 24))])
    names = [p.__name__ for p in PIPELINE]
    for k, name in enumerate(names):
        staged = compile_program(prog, stop_after=name)
        assert staged.history == ("trace", *names[:k + 1]), f"stopped after {name}"


def test_stages_print(mesh):
    """Any prefix of the pipeline gives a printable program (here: after propagation)."""
    from shardfuse.trace import trace

    prog = trace(ag_matmul, mesh, [T((8, 4, 16, 32)), T((32, 24))])
    staged = compile_program(prog, stop_after="propagate_sharding")
    assert str(staged).splitlines()[2:] == ["  c: f32[8:Stream, 4, 16, 24] = matmul(a, b)", "  return c"]


def test_streams_option_changes_the_pool(mesh):
    text = str(sf.jit(ag_matmul, mesh=mesh, streams=2).lower(T((8, 4, 16, 32)), T((32, 24))))
    assert "a_gathered_pool = Allocate 2 x f32[1, 4, 16, 32]  (one per stream)" in text
    assert "SetCurrentStream Stream(i % 2)" in text


def test_dump_env_prints_plans(mesh, monkeypatch, capsys):
    monkeypatch.setenv("SHARDFUSE_DUMP", "plan")
    sf.jit(ag_matmul, mesh=mesh).lower(T((8, 4, 16, 32)), T((32, 24)))
    assert capsys.readouterr().out.strip() == SEED.strip()


def test_verifier_rejects_unwaited_collective(mesh):
    plan = sf.jit(ag_then_matmul, mesh=mesh).lower(T((8, 4, 16, 32)), T((32, 24)))
    prog = plan.program
    broken = Program(prog.name, prog.mesh, prog.inputs, prog.outputs,
                     tuple(i for i in prog.instrs if i.op != Op.WAIT), prog.streams)
    with pytest.raises(PlanError, match="never waited"):
        verify(broken)


def test_verifier_rejects_use_before_definition(mesh):
    plan = sf.jit(ag_then_matmul, mesh=mesh).lower(T((8, 4, 16, 32)), T((32, 24)))
    prog = plan.program
    reordered = Program(prog.name, prog.mesh, prog.inputs, prog.outputs, prog.instrs[::-1], prog.streams)
    with pytest.raises(PlanError, match="before it is defined"):
        verify(reordered)


def test_verifier_rejects_array_level_ops(mesh):
    prog = Program("p", mesh, (), (), (Instr(Op.SET),))
    with pytest.raises(PlanError, match="not a host-level instruction"):
        verify(prog)


def test_trace_shows_the_program_before_the_passes():
    """f.trace(...) (JAX's make_jaxpr): the annotations as stated, the schedule on the instruction
    sf.stream annotates; pytree and static arguments as lower takes them."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    a, b = np.ones((16, 8)), np.ones((8, 4))
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, 0) @ b, axis=0, chunks=2), mesh=mesh)
    lines = str(f.trace(a, b)).splitlines()
    assert "  a_1: f64[16:DIDx, 8] = set(a, annotation=True)" in lines
    assert "  c_1: f64[16:Stream, 4] = set(c, annotation=True, chunks=2)" in lines
    g = sf.jit(lambda p, k, x: x @ p["w"] * k, mesh=mesh, static_argnums=1)
    text = str(g.trace({"w": b}, 3.0, a))
    assert "matmul(x, p_w)" in text and "scale(c, value=3.0)" in text, text  # (the static value: a constant)


def test_a_traced_program_displays_as_its_text_in_jupyter():
    """A DTensor probe: `f.trace(...)` as a cell's last expression showed the dataclass dump
    (Program(name=..., instrs=(Instr(op=<Op.SET...); IPython's pretty printer gets the program's text."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    prog = sf.jit(lambda x: sf.shard(x, axis=0) * 2.0, mesh=mesh).trace(sf.TensorSpec((4, 2), "float32"))
    from IPython.lib.pretty import pretty  # (ipykernel's, the test extra's: what a notebook cell calls)
    assert pretty(prog) == str(prog) and pretty(prog).startswith("plan <lambda>(x: f32[4, 2] ?)")
