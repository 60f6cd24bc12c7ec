"""sf.stream(chunks="auto"): compile the plan for each allowed S, predict each, keep the fastest.

The function is traced once; its program keeps chunks="auto" on the axes so streamed, and the
candidates are the S up to MAX_AUTO_CHUNKS that divide all of their extents.  The one traced
program is compiled with each candidate S in place of "auto" (one that the compiler refuses,
e.g. an extent that does not divide into D x S, is listed with its reason and skipped),
predicted by the cost model, and the fastest kept: the fewest chunks predicted within
AUTO_MARGIN (1%) of the fastest (the model is not that exact, and fewer chunks mean fewer
steps).  A program without "auto" is compiled once and the cost model is not consulted.
`Explanation` is what plan.explain() shows.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from shardfuse import faults, schedule
from shardfuse.cost import predict
from shardfuse.ir import unroll, walk
from shardfuse.ops import COMMUNICATION, Op
from shardfuse.passes import compile_program
from shardfuse.passes.pipeline import MAX_STREAM_CHUNKS
from shardfuse.schedule import scheduled

log = logging.getLogger("shardfuse")
MAX_AUTO_CHUNKS = min(16, MAX_STREAM_CHUNKS)  # more rarely pays: per-chunk steps and collective latency
AUTO_MARGIN = 0.01  # the fewest chunks predicted within this much of the fastest are chosen


@dataclass(frozen=True)
class Candidate:
    s: int | None  # None: a plan without a stream loop
    total_s: float = math.nan
    comm_s: float = math.nan
    compute_s: float = math.nan
    exposed_s: float = math.nan
    error: str | None = None  # why the compiler refused this S


@dataclass(frozen=True)
class Explanation:
    plan_name: str
    rates_name: str
    candidates: tuple
    chosen: int | None
    auto: bool
    reason: str
    loops: tuple = ()  # a fixed plan's stream loops' chunk counts

    def __str__(self):
        fixed = "S=" + ", ".join(map(str, self.loops)) if self.loops else "no stream loop"
        head = (f"plan {self.plan_name}: chunks='auto' chose S={self.chosen}" if self.auto
                else f"plan {self.plan_name}: chunks fixed ({fixed})")
        lines = [f"{head}, predicted with the {self.rates_name} rates",
                 f"  {'S':>4} {'total ms':>10} {'comm ms':>10} {'compute ms':>11} {'exposed comm ms':>16}"]
        for c in self.candidates:
            mark = "*" if c.s == self.chosen and c.error is None else " "
            s = "-" if c.s is None else c.s
            if c.error is not None:
                lines.append(f"{mark} {s:>4}  not possible: {c.error}")
                continue
            lines.append(f"{mark} {s:>4} {c.total_s * 1e3:>10.3f} {c.comm_s * 1e3:>10.3f} {c.compute_s * 1e3:>11.3f} "
                         f"{c.exposed_s * 1e3:>16.3f}")
        return "\n".join(lines + [self.reason])

    __repr__ = __str__


def candidate(s, prog, rates, local, share) -> Candidate:
    p = predict(prog, rates, local, share)
    m = p.summary()
    return Candidate(s, p.total_s, m["communication_s"], m["gemm_s"] + m["compute_s"], m["exposed_communication_s"])


def _kinds(prog) -> str:
    kinds = sorted({str(i.op) for i, _ in unroll(prog.instrs) if i.op in COMMUNICATION})
    return " and ".join(kinds) or "communication"


def reason(best: Candidate, ok: list, rates, kinds: str, streams: int = 2, label: str | None = None) -> str:
    """One sentence: why `best` is (or, fixed, what it does; `label` names its loops)."""
    s = label or f"S={best.s or 1}"
    if streams == 1 and (best.s or 1) == 1 and len(ok) > 1:
        return f"{s}: with streams=1 every chunk's steps run on one stream, one after another, so nothing overlaps"
    if rates.serial:
        return (f"{s}: with the {rates.name} rates steps run one after another as they are issued (NumPy devices), "
                "so nothing overlaps; fewer steps cost less")
    if not best.comm_s > 0:
        return f"{s}: no communication to hide; more chunks only add steps and smaller GEMMs"
    hidden = 1 - best.exposed_s / best.comm_s
    one = next((c for c in ok if (c.s or 1) == 1), None)
    if (best.s or 1) == 1 and len(ok) > 1:
        runner = min((c for c in ok if c is not best), key=lambda c: c.total_s)
        return (f"{s}: pipelining does not pay here: the best pipelined S={runner.s} is predicted "
                f"{runner.total_s / best.total_s - 1:.1%} slower (its per-chunk steps, smaller GEMMs and GEMM slowdown "
                f"beside the {kinds} cost more than the {best.comm_s * 1e3:.3f} ms of it they would hide)")
    gain = f"; S=1 is predicted {one.total_s / best.total_s - 1:.1%} slower" if one is not None and one is not best else ""
    if (faster := min(ok, key=lambda c: c.total_s)).total_s < best.total_s:
        gain += (f"; S={faster.s} is only {1 - faster.total_s / best.total_s:.2%} faster (within the {AUTO_MARGIN:.0%} "
                 "margin: fewer chunks are kept)")
    return (f"{s}: hides {math.floor(hidden * 1000) / 10:g}% of the {kinds} ({best.exposed_s * 1e3:.3f} of "
            f"{best.comm_s * 1e3:.3f} ms exposed){gain}")


def choose(ok: list, margin: float = AUTO_MARGIN) -> Candidate:
    """The fewest chunks predicted within `margin` of the fastest (ok: S ascending)."""
    fastest = min(c.total_s for c in ok)
    return next(c for c in ok if c.total_s * (1 - margin) <= fastest)


def _auto(i) -> bool:
    sched = schedule.of(i)
    return sched is not None and sched.chunks == "auto"


def auto_extents(prog) -> list:
    """The extent of every axis the traced program streams with chunks="auto"."""
    return [i.outs[0].type.shape[schedule.axis_of(i)] for i in walk(prog.instrs) if _auto(i)]


def with_chunks(prog, s: int):
    """The traced program with S = s wherever it says chunks="auto"."""
    return prog.with_instrs([replace(i, attrs=scheduled(i.attrs, replace(schedule.of(i), chunks=s))) if _auto(i) else i
                             for i in prog.instrs], f"chunks={s}")


def candidates_for(extents) -> list:
    g = math.gcd(*extents)
    return [s for s in range(1, MAX_AUTO_CHUNKS + 1) if g % s == 0]


def compile_best(traced, machine) -> tuple:
    """(program, Explanation or None): the traced program compiled; with chunks="auto", the
    fastest candidate's.  machine() gives (rates, local, share), called only when "auto" is used."""
    extents = auto_extents(traced)
    if not extents:
        return compile_program(traced), None
    rates, local, share = machine()
    mesh, streams = traced.mesh, traced.streams
    cands, progs = [], {}
    for s in candidates_for(extents):
        try:
            prog = compile_program(with_chunks(traced, s))
        except ValueError as e:
            if s == 1:
                raise
            cands.append(Candidate(s, error=str(e)))
            continue
        progs[s] = prog
        cands.append(candidate(s, prog, rates, local, share))
    ok = [c for c in cands if c.error is None]
    best = choose(ok)
    if mesh.nprocs > 1:  # every rank must run the same plan: rank 0's choice (from its rates) holds
        s = faults.allgather_object(best.s, f"choosing chunks='auto' for {traced.name!r}")[0]
        best = next(c for c in ok if c.s == s)
    why = reason(best, ok, rates, _kinds(progs[best.s]), streams)
    if len(ok) == 1 and len(cands) > 1:
        why += f"; no other S up to {MAX_AUTO_CHUNKS} divides the streamed extents into devices x chunks"
    why = Explanation(traced.name, rates.name, tuple(cands), best.s, True, why)
    log.info("chunks='auto' for %s: S=%d of %s, predicted %.3f ms (%s rates): %s", traced.name, best.s,
             [c.s for c in ok], best.total_s * 1e3, rates.name, why.reason)
    return progs[best.s], why


def explain_plan(prog, rates, local, share) -> Explanation:
    """A plan compiled without "auto": its one candidate, the S of its stream loops."""
    loops = sorted({i.attrs["extent"] for i in prog.instrs if i.op == Op.FOR})
    c = candidate(loops[0] if len(loops) == 1 else None, prog, rates, local, share)
    label = "S=" + ", ".join(map(str, loops)) if loops else "no stream loop"
    return Explanation(prog.name, rates.name, (c,), c.s, False, reason(c, [c], rates, _kinds(prog), label=label),
                       tuple(loops))
