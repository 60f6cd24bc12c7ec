"""The cost model: a compiled plan's time predicted from rates (issue 15).

`Rates` is plain data: GEMM throughput by dtype with an efficiency curve in size, collective time
as latency + bytes / bandwidth by kind and team size (nccl-tests' bus-bandwidth convention), the
host's cost to issue a step, and how much a GEMM slows while a collective runs beside it.
`predict(program, rates)` takes the steps one call issues (steps.plan_steps: the list the
executor binds and a profile labels) and simulates one device's streams: each step on its stream
in issue order, not before the host has issued it, after the events and joins it waits for; one
compute engine (GEMMs and other kernels) and one communication engine, so communication on one
stream overlaps compute on another.  Plans are SPMD, so one simulated device stands for every
device of the mesh.  The result turns into a `timeline.Timeline`: the same plot, Chrome trace and
summary as a profile.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from itertools import accumulate

from shardfuse.dtypes import TABLE
from shardfuse.ir import TensorType, local_shape
from shardfuse.ops import COMMUNICATION, ELEMENTWISE, Op
from shardfuse.steps import event_key, plan_steps
from shardfuse.timeline import Event, Timeline

@dataclass(frozen=True)
class Rates:
    """Figures for one device (a GPU, or a host's share of one NumPy device).  Seconds, bytes."""

    name: str
    gemm_flops: dict  # dtype name -> sustained FLOP/s of a large GEMM
    gemm_half_flops: float  # a GEMM of this many FLOPs of the fastest dtype runs at half its peak
    mem_bw: float  # bytes/s read + written by elementwise ops, sums and copies
    gemm_bw: float  # bytes/s a GEMM streams its operands and result at: the bound of skinny GEMMs
    comm_bw: dict  # communication Op -> bus bandwidth (bytes/s, nccl-tests' busbw)
    comm_latency_s: float  # per collective
    comm_step_latency_s: float  # per ring step (D - 1 of them)
    step_s: float  # host time to issue a compute step (a GEMM, an elementwise op), per local device
    comm_step_s: float  # host time to issue a communication step, per local device
    event_s: float  # host time to issue a stream step (record, wait, join), per local device
    call_s: float  # host time per call besides its steps (inputs placed, fences)
    gemm_slowdown: float  # GEMMs run this much slower while a collective runs on their device
    serial: bool = False  # steps run on the host as they are issued (NumPy backends): nothing overlaps

    def to_json(self) -> dict:
        d = asdict(self)
        d["comm_bw"] = {str(k): v for k, v in self.comm_bw.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Rates":
        """Rates from to_json's dict, every figure checked (a bad file must not give odd plans)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"rates need the fields {sorted(names)}, got {sorted(d) if isinstance(d, dict) else d!r}")
        for n, want in (("gemm_flops", dict), ("comm_bw", dict), ("serial", bool), ("name", str)):
            if not isinstance(d[n], want):
                raise ValueError(f"rates' {n} must be a {want.__name__}, got {d[n]!r}")
        gemm = {str(k): _positive(v, f"gemm_flops[{k}]", zero=False) for k, v in d["gemm_flops"].items()}
        comm = {Op(k): _positive(v, f"comm_bw[{k}]", zero=False) for k, v in d["comm_bw"].items()}
        if not gemm or not comm:
            raise ValueError("rates need at least one GEMM rate and one bandwidth")
        scalars = {n: _positive(d[n], n, zero=n not in ("gemm_slowdown", "mem_bw", "gemm_bw"))
                   for n in names - {"name", "gemm_flops", "comm_bw", "serial"}}
        return cls(name=d["name"], gemm_flops=gemm, comm_bw=comm, serial=d["serial"], **scalars)


def _positive(v, what: str, zero: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise ValueError(f"rate {what} must be a {'non-negative' if zero else 'positive'} number, got {v!r}")
    return float(v)


_ALL_COMM = (Op.ALLGATHER, Op.REDUCE_SCATTER, Op.ALLREDUCE, Op.ALLTOALL, Op.SENDRECV, Op.TRANSFER)

# One H200 SXM (../shared/MULTIGPU-FIGURES.md): cuBLAS sustained ~720 TFLOP/s bf16 / fp16, chunk
# efficiency 1 / (1 + 14 / m) at n = k = 8192 (half rate at 1.9 GFLOP), operands streamed at ~4 TB/s
# (HBM3e, 4.8 TB/s peak: a chunk of few rows re-reads all of B); NCCL ring busbw ~370 GB/s
# (ReduceScatter ~350), 10 us + 0.6 us per ring step; a GEMM 1.3x slower beside an SM-based
# collective; host 9.3 us per pre-bound cuBLASLt GEMM step (BENCHMARKS.md, issue 14), 7 us per NCCL call,
# 0.7 us per event (FIELD-NOTES.md).
H200 = Rates("h200", gemm_flops={"float16": 720e12, "bfloat16": 720e12, "float32": 51e12, "float64": 60e12},
             gemm_half_flops=1.9e9, mem_bw=4.3e12, gemm_bw=4.0e12,
             comm_bw={op: 350e9 if op == Op.REDUCE_SCATTER else 370e9 for op in _ALL_COMM},
             comm_latency_s=10e-6, comm_step_latency_s=0.6e-6, step_s=9.3e-6, comm_step_s=7e-6, event_s=0.7e-6,
             call_s=20e-6, gemm_slowdown=1.3)
# NumPy devices: a modest host; steps run as they are issued, one device after another.
CPU = Rates("numpy/cpu", gemm_flops={"float16": 2e9, "bfloat16": 1e9, "float32": 100e9, "float64": 50e9},
            gemm_half_flops=0.0, mem_bw=10e9, gemm_bw=10e9, comm_bw={op: 5e9 for op in _ALL_COMM}, comm_latency_s=2e-6,
            comm_step_latency_s=0.0, step_s=10e-6, comm_step_s=8e-6, event_s=0.0, call_s=20e-6, gemm_slowdown=1.0,
            serial=True)
DEFAULTS = {"h200": H200, "numpy/cpu": CPU}


# ---- what one step costs ------------------------------------------------------------------------
ROOFLINE_P = 3  # the roofline's corner, smoothed: near it a GEMM is bound by neither alone (H200 sweeps)


def gemm_time(flops: float, nbytes: float, dtype: str, rates: Rates) -> float:
    """A smoothed roofline of two times: flops / peak plus a fixed time (the fastest dtype's
    half-rate size at its peak: efficiency f / (f + half) there), and the time to stream its operands and result (nbytes) at gemm_bw,
    the bound of a chunk of few rows, which reads all of B.  Their 3-norm, not their max: a chunk
    GEMM near the corner (256 x 8192 x 8192 bf16) runs ~30% slower than either bound alone."""
    peak = rates.gemm_flops.get(dtype, min(rates.gemm_flops.values()))
    if flops <= 0:
        return 0.0
    # (a fixed time, not FLOPs: at float32's peak, 1.9 GFLOP would be a 37 us floor for any GEMM;
    # the recorded bf16 / fp16 sweeps predict alike either way, so the model's version stays 4)
    fl, by = flops / peak + rates.gemm_half_flops / max(rates.gemm_flops.values()), nbytes / rates.gemm_bw
    return (fl ** ROOFLINE_P + by ** ROOFLINE_P) ** (1 / ROOFLINE_P)


# bytes x factor(D) / busbw is the time (nccl-tests PERFORMANCE.md: busbw = algbw x factor)
BUS_FACTOR = {Op.ALLGATHER: lambda d: (d - 1) / d, Op.REDUCE_SCATTER: lambda d: (d - 1) / d,
              Op.ALLREDUCE: lambda d: 2 * (d - 1) / d, Op.ALLTOALL: lambda d: (d - 1) / d,
              Op.SENDRECV: lambda d: 1.0, Op.TRANSFER: lambda d: 1.0}


def collective_time(op, nbytes: float, d: int, rates: Rates) -> float:
    """latency + bytes x factor(D) / bus bandwidth; nbytes: the whole (gathered / unscattered) buffer."""
    bw = rates.comm_bw.get(op, min(rates.comm_bw.values()))
    return rates.comm_latency_s + rates.comm_step_latency_s * max(d - 1, 0) + nbytes * BUS_FACTOR[op](d) / bw


def _nbytes(v, mesh) -> int:
    return math.prod(local_shape(v, mesh)) * TABLE[v.type.dtype].itemsize


def communication_of(i, mesh) -> tuple:
    """(bytes, team size) of a communication instruction, as collective_time takes them."""
    if i.op == Op.TRANSFER:
        return _nbytes(i.ins[0], mesh), 2
    d = i.ins[0].type.layout.mesh.axis_size(i.attrs["team"])
    return _nbytes(i.into if i.op == Op.ALLGATHER else i.ins[0], mesh), d


def work_of(i, mesh, rates: Rates, share: int = 1) -> tuple:
    """(engine, seconds on it) of one instruction: "compute", "comm" or None (a stream step).
    share: devices whose compute runs one after another on one engine (NumPy devices, virtual
    devices of one GPU)."""
    if i.op == Op.MATMUL:
        flops = 2 * math.prod(local_shape(i.into, mesh)) * local_shape(i.ins[0], mesh)[-1]
        nbytes = sum(_nbytes(v, mesh) for v in (*i.ins[:2], i.into))
        return "compute", share * gemm_time(flops, nbytes, i.into.type.dtype, rates)
    if i.op in COMMUNICATION:
        nbytes, d = communication_of(i, mesh)
        # Virtual devices of one GPU: their "collectives" are copies in the one GPU's memory, run by
        # the same SMs and HBM as the GEMMs; measured on an H200 (D = 2, 4) they never overlap them
        # (S = 1 was the fastest at almost every sweep point), so they queue on the compute engine.
        engine = "compute" if share > 1 and not rates.serial else "comm"
        return engine, collective_time(i.op, nbytes, d, rates)
    if i.op in ELEMENTWISE or i.op in (Op.SUM, Op.COPY, Op.TAKE, Op.SCATTER_ADD, Op.FUSED, Op.FUSED_SUM):
        nbytes = sum(_nbytes(v, mesh) for v in i.values() if isinstance(v.type, TensorType))
        return "compute", share * nbytes / rates.mem_bw
    return None, 0.0


# ---- the steps of one call ----------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """A plan step as the simulation sees it."""

    plan: object  # its steps.PlanStep
    stream: object  # its stream (a resolved streams.Stream: MAIN or a numbered worker)
    engine: str | None
    work: float  # seconds on the engine
    host: float  # seconds of host time to issue it
    needs: tuple  # steps (indices) it waits for besides the previous step on its stream


HOST_COST = {"compute": lambda r: r.step_s, "comm": lambda r: r.comm_step_s, None: lambda r: r.event_s}


def steps_of(prog, rates: Rates, local: int = 1, share: int = 1) -> list:
    """The plan's steps (steps.plan_steps), each with its engine, work, host cost and waits.  A
    Wait costs the host nothing: collectives are ordered on their stream (GPUs bind no step for
    it) or complete in their start's time (NumPy)."""
    last, events, out = {}, {}, []
    for s in plan_steps(prog):
        i, env = s.instr, s.env
        needs = ()
        if i.op == Op.RECORD_EVENT:
            events[event_key(i.outs[0], i, env)] = len(out)
        elif i.op == Op.WAIT_EVENT:
            needs = (events[event_key(i.ins[0], i, env)],)
        elif i.op == Op.SYNCHRONIZE:  # the current stream waits for all that the worker was given
            w = i.attrs["stream"].at(env)
            needs = (last[w],) if w in last else ()
        engine, work = work_of(i, prog.mesh, rates, share)
        host = 0.0 if i.op == Op.WAIT else HOST_COST[engine](rates) * local
        last[s.stream] = len(out)
        out.append(Step(s, s.stream, engine, work, host, needs))
    return out


# ---- simulating them ----------------------------------------------------------------------------
def schedule(steps, rates: Rates) -> list:
    """(start, end) of every step.  Serial backends run each step as the host issues it.  Else
    each stream runs its steps in order, a step starting once the host has issued it, its waits
    are met and its engine is free; a compute step progresses at 1 / gemm_slowdown while a
    collective runs."""
    issued = list(accumulate(s.host for s in steps))
    if rates.serial:
        out, t = [], 0.0
        for s in steps:
            t += s.host
            out.append((t, t + s.work))
            t += s.work
        return out
    n = len(steps)
    start, end = [math.nan] * n, [math.nan] * n
    queues: dict = {}
    for k, s in enumerate(steps):
        queues.setdefault(s.stream, deque()).append(k)
    running: dict = {}  # engine -> [step, work left]
    t, done = 0.0, 0
    while done < n:
        done += _start_ready(steps, queues, running, issued, start, end, t)
        if done == n:
            break
        rate = {"compute": 1.0 / rates.gemm_slowdown if "comm" in running else 1.0, "comm": 1.0}
        finish = {e: t + left / rate[e] for e, (_, left) in running.items()}
        waits = [issued[q[0]] for q in queues.values() if q and issued[q[0]] > t]
        if not finish and not waits:
            raise RuntimeError("the simulated plan is stuck: a step waits for one that never runs")
        t1 = min(list(finish.values()) + waits)
        for e, (k, left) in list(running.items()):
            if finish[e] <= t1:
                end[k] = t1
                del running[e]
                queues[steps[k].stream].popleft()
                done += 1
            else:
                running[e][1] = left - (t1 - t) * rate[e]
        t = t1
    return list(zip(start, end))


def _start_ready(steps, queues, running, issued, start, end, t) -> int:
    """Start every stream's next step that can start at t, in issue order; steps without work
    end at once (and may free others).  Returns how many ended."""
    ended, again = 0, True
    while again:
        again = False
        for q in sorted((q for q in queues.values() if q), key=lambda q: q[0]):
            k = q[0]
            s = steps[k]
            if not math.isnan(start[k]) or issued[k] > t or not all(end[d] <= t for d in s.needs):
                continue
            if s.engine is not None and s.work > 0:
                if s.engine not in running:
                    start[k] = t
                    running[s.engine] = [k, s.work]
                continue
            start[k] = end[k] = t
            q.popleft()
            ended += 1
            again = True
    return ended


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted call: total_s (call_s + until the last step ends or is issued) and the
    steps as timeline Events (rank 0, call 0; each on every device of the mesh: the plan is SPMD,
    and the one simulated device stands for each, so every device gets its track)."""

    plan_name: str
    total_s: float
    events: tuple

    def __repr__(self):  # (not its events: thousands for many chunks)
        return f"Prediction({self.plan_name!r}: {self.total_s * 1e3:.3f} ms, {len(self.events)} steps)"

    def timeline(self) -> Timeline:
        return Timeline(self.events, self.plan_name)

    def summary(self) -> dict:
        """Timeline.summary's figures (overlap efficiency over the span of the steps: the chart's
        and `shardfuse profile`'s one definition), with total_s this prediction's whole call,
        host time outside the steps included; span_s is the steps' span."""
        s = self.timeline().summary()
        s.update(span_s=s["total_s"], total_s=self.total_s)
        return s


def predict(prog, rates: Rates, local: int = 1, share: int = 1) -> Prediction:
    """Predict one call of the compiled plan `prog`.  local: devices this process issues steps
    for (host cost per step x local); share: devices whose compute shares one engine."""
    steps = steps_of(prog, rates, local, share)
    times = schedule(steps, rates)
    events = tuple(Event(0, 0, s.plan.index, s.plan.devices, str(s.plan.stream), s.plan.text, s.plan.kind, a, b)
                   for s, (a, b) in zip(steps, times))
    last = max([b for _, b in times] + [sum(s.host for s in steps)])
    return Prediction(prog.name, rates.call_s + last, events)
