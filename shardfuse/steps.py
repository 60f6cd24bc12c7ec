"""The steps of one call: the one list that the executor binds, the cost model predicts and a
profile labels (so a step's index names the same instruction in all three).

`ir.unroll` gives the instructions one call issues, loops unrolled.  Allocations, views and
stream switches issue nothing; every other instruction is one step, on the stream the last
SetCurrentStream picked (the main stream before any).  A step's text is its line of
`print(plan)`, with its loop step: `Matmul c_i <- a_i @ b  [i=3]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardfuse.ir import Instr, format_instrs, unroll
from shardfuse.ops import COMMUNICATION, ELEMENTWISE, VIEWS, Op

KINDS = ("communication", "gemm", "compute", "copies", "stream")
NO_STEP = VIEWS | {Op.ALLOCATE, Op.GET_STREAM, Op.SET_STREAM}


def kind_of(op) -> str:
    """What a profile calls a step of this op (a Wait is its collective's)."""
    if op in COMMUNICATION or op == Op.WAIT:
        return "communication"
    if op == Op.MATMUL:
        return "gemm"
    if op in ELEMENTWISE or op == Op.SUM:
        return "compute"
    if op == Op.COPY:
        return "copies"
    return "stream"


@dataclass(frozen=True, eq=False)
class PlanStep:
    index: int  # its place in the plan's list of steps
    text: str  # its line of print(plan), with its loop step
    op: Op
    kind: str  # kind_of(op)
    stream: object  # "main" (backends.protocol.MAIN) or a worker stream's index
    instr: Instr
    env: dict  # the loop variables of this step
    devices: tuple  # the devices it runs on: the mesh's in the plan; this process' once bound
    run: Callable | None = None  # once bound: the backend's callable of the per-call buffer table


def index_of(idx, env) -> int:
    """The value of a loop index expression (ir.Idx) at a step with loop variables env."""
    return idx if isinstance(idx, int) else idx.eval(env)


def event_key(v, i, env):
    """Event v of instruction i: one per loop step, (v, step), where i records or waits for it in a loop."""
    return (v, index_of(i.attrs["index"], env)) if "index" in i.attrs else v


def stream_of(i, env, stream):
    """The stream the instructions after i issue on."""
    if i.op != Op.SET_STREAM:
        return stream
    return index_of(i.attrs["index"], env) if "index" in i.attrs else i.attrs["stream"]


def issue_order(prog):
    """(instruction, loop variables, PlanStep or None) for everything one call issues, in order."""
    stream, k, devices = "main", 0, tuple(prog.mesh.devices)
    for i, env in unroll(prog.instrs):
        stream = stream_of(i, env, stream)
        if i.op in NO_STEP:
            yield i, env, None
            continue
        text = format_instrs([i], indent=0)[0]
        where = ", ".join(f"{n}={v}" for n, v in env.items())
        yield i, env, PlanStep(k, f"{text}  [{where}]" if where else text, i.op, kind_of(i.op), stream, i, env, devices)
        k += 1


def plan_steps(prog) -> list:
    """The steps one call of the plan `prog` issues, in order."""
    return [s for _, _, s in issue_order(prog) if s is not None]
