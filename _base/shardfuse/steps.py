"""The steps of one call: the one list that the executor binds, the cost model predicts and a
profile labels (so a step's index names the same instruction in all three).

`ir.unroll` gives the instructions one call issues, loops unrolled.  Allocations, views and
stream switches issue nothing; every other instruction is one step, on the stream the last
SetCurrentStream picked (the main stream before any).  A step's text is its line of
`print(plan)`, with its loop step: `Matmul c_i <- a_i @ b  [i=3]`.

A step runs on the devices of the values it computes (`devices_of`): a Matmul whose result lives
on a pipeline stage's sub-mesh runs on that stage's devices only, a collective on its team's
mesh, a move between meshes on both ends, a Wait where its communication started; stream steps
(events, joins) on every device of the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardfuse.ir import Instr, format_instrs, unroll
from shardfuse.ops import COLLECTIVES, COMMUNICATION, ELEMENTWISE, VIEWS, Op
from shardfuse.streams import MAIN, Stream

KINDS = ("communication", "gemm", "compute", "copies", "stream")
NO_STEP = VIEWS | {Op.ALLOCATE, Op.GET_STREAM, Op.SET_STREAM}


def kind_of(op) -> str:
    """What a profile calls a step of this op (a Wait is its collective's)."""
    if op in COMMUNICATION or op == Op.WAIT:
        return "communication"
    if op == Op.MATMUL:
        return "gemm"
    if op in ELEMENTWISE or op in (Op.SUM, Op.TAKE, Op.SCATTER_ADD, Op.FUSED, Op.FUSED_SUM):
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
    stream: Stream  # MAIN or a numbered worker (streams.py), resolved for its loop step
    instr: Instr
    env: dict  # the loop variables of this step
    devices: tuple  # the global ids of the devices it runs on (devices_of); once bound, this process' of them
    run: Callable | None = None  # once bound: the backend's callable of the per-call buffer table


def index_of(idx, env) -> int:
    """The value of a loop index expression (ir.Idx) at a step with loop variables env."""
    return idx if isinstance(idx, int) else idx.eval(env)


def event_key(v, i, env):
    """Event v of instruction i: one per loop step, (v, step), where i records or waits for it in a loop."""
    return (v, index_of(i.attrs["index"], env)) if "index" in i.attrs else v


def stream_of(i, env, stream):
    """The stream the instructions after i issue on."""
    return i.attrs["stream"].at(env) if i.op == Op.SET_STREAM else stream


def mesh_of(v):
    """The mesh value v lives on (the program's or a sub-mesh: every layout in a plan names it).  (The
    one place the steps, and the executor through them, read a value's mesh.)"""
    return v.type.layout.mesh


def devices_of(i, prog, started) -> tuple:
    """The global ids of the devices instruction i runs on.  `started`: the devices of each
    communication handle issued so far, which its Wait runs on (filled here)."""
    if i.op == Op.WAIT:
        return started.pop(i.ins[0])
    if i.op == Op.TRANSFER:  # both ends of a move between meshes
        devices = tuple(dict.fromkeys(i.attrs["from"] + i.attrs["to"]))
    elif i.op in COLLECTIVES:  # every team of the mesh its operand lives on
        devices = tuple(mesh_of(i.ins[0]).devices)
    elif i.into is not None:  # compute and copies: where the result lives
        return tuple(mesh_of(i.into).devices)
    else:  # events and joins: the streams of every device
        return tuple(prog.mesh.devices)
    started[i.outs[0]] = devices
    return devices


def issue_order(prog):
    """(instruction, loop variables, PlanStep or None) for everything one call issues, in order."""
    stream, k, started = MAIN, 0, {}
    for i, env in unroll(prog.instrs):
        stream = stream_of(i, env, stream)
        if i.op in NO_STEP:
            yield i, env, None
            continue
        text = format_instrs([i], indent=0, home=prog.mesh)[0]
        where = ", ".join(f"{n}={v}" for n, v in env.items())
        yield i, env, PlanStep(k, f"{text}  [{where}]" if where else text, i.op, kind_of(i.op), stream, i, env,
                               devices_of(i, prog, started))
        k += 1


def plan_steps(prog) -> list:
    """The steps one call of the plan `prog` issues, in order."""
    return [s for _, _, s in issue_order(prog) if s is not None]
