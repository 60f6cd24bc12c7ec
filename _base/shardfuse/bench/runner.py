"""What the bench times (Variant) and the one loop that times it (run), with its three schedules.

Every timing goes through `run`: a run waits for an idle device, stamps, issues its calls with
no synchronisation between them (host issue time measured around each call), stamps after every
call or only after the last, and returns the GPU time between stamps.  The schedules are runs of
different shapes:

* idle (`idle_rounds`): one call per run, in round robin over the variants;
* back to back (`back_to_back`): runs of many calls of one variant, round robin over the variants;
* alternating pairs (`alternating`): first, second, first, ... in one run, stamped on the
  caller's stream after every call, for the ratio of their GPU times under the same clocks.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np


@dataclass(eq=False)
class Variant:
    """One thing to time: fn() runs it; before(r) prepares call r (outside the timed region);
    check() runs it on input set 0 and returns the result (A's row order), or is None."""

    name: str
    fn: Callable[[], None]
    before: Optional[Callable[[int], None]] = None
    s: Optional[int] = None
    streams: Optional[int] = None
    check: Optional[Callable[[], Any]] = None
    kind: str = "plan"
    flops: bool = True
    fenced_fn: Optional[Callable[[], None]] = None  # a bare baseline fenced with the caller's stream, as plan calls are
    stream: Any = None  # the stream its stamps go on (None: the caller's)
    plan_alone: Optional["Variant"] = None  # user path: the variant timing the same plan alone
    exe: Any = None  # a plan's variant: its executable
    state: Optional[dict] = None  # and its call state
    gpu: list = field(default_factory=list)  # idle: ms per call
    host: list = field(default_factory=list)  # idle: host us per call
    gpu_b2b: list = field(default_factory=list)  # back to back: ms per call, one per run
    host_b2b: list = field(default_factory=list)  # back to back: host us per call


@dataclass(frozen=True)
class Schedule:
    """The shape of one run: `calls` rounds over its variants; a stamp after every call (`each`)
    or only after the last; stamps on the variant's own stream, or on the caller's stream with
    every call fenced with it (`on_caller`, needed where several variants share a run)."""

    calls: int
    each: bool
    on_caller: bool = False


IDLE = Schedule(calls=1, each=True)


def run(clock, group, schedule, first=0, mpi=None):
    """One run of `group` (variants called in turn) on an idle device; call i prepares with
    before(first + i // len(group)).  Returns (GPU ms between consecutive stamps, host us per call)."""
    if len(group) > 1 and not schedule.on_caller:
        raise ValueError("variants sharing a run are stamped on the caller's stream (on_caller=True)")
    stream = None if schedule.on_caller else group[0].stream
    n = schedule.calls * len(group)
    stamps = clock.stamps(n + 1 if schedule.each else 2)
    calls = [(v.fenced_fn or v.fn) if schedule.on_caller else v.fn for v in group]

    def prepare(i):
        v = group[i % len(group)]
        if v.before is not None:
            v.before(first + i // len(group))
    if n:
        prepare(0)  # before the device is idle and the first stamp: outside the timed region
    if mpi is not None:
        mpi.Barrier()
    clock.idle(stream)
    clock.stamp(stamps, 0, stream)
    host = []
    for i in range(n):
        if i:
            prepare(i)
        t0 = time.perf_counter()
        calls[i % len(group)]()
        t1 = time.perf_counter()
        if schedule.each:
            clock.stamp(stamps, i + 1, stream)
        host.append((t1 - t0) * 1e6)
    if not schedule.each:
        clock.stamp(stamps, 1, stream)
    gpu = [clock.between(a, b) for a, b in zip(stamps, stamps[1:])]
    clock.idle(stream)
    return gpu, host


class Progress:
    """Progress of the long loops on stderr (stdout keeps the table or the JSON): a bar redrawn
    in place on a terminal, else a line when a phase starts and ends (CI logs stay short)."""

    WIDTH = 30

    def __init__(self, enabled: bool, stream=None):
        self.enabled, self.out = enabled, stream or sys.stderr
        self.tty = enabled and self.out.isatty()
        self.label, self.total, self.done, self.t0 = "", 0, 0, 0.0

    def start(self, label: str, total: int):
        self.label, self.total, self.done, self.t0 = label, max(total, 1), 0, time.perf_counter()
        if self.enabled and not self.tty:
            print(f"shardfuse bench: {label} ({total} runs) ...", file=self.out, flush=True)
        self.tick(0)

    def tick(self, n: int = 1):
        self.done += n
        if self.tty:
            full = self.WIDTH * self.done // self.total
            print(f"\r{self.label:<40} [{'#' * full}{'.' * (self.WIDTH - full)}] {self.done}/{self.total} "
                  f"{time.perf_counter() - self.t0:6.1f} s", end="", file=self.out, flush=True)

    def finish(self):
        if self.enabled:
            end = "\n" if self.tty else ""
            print(f"{end}shardfuse bench: {self.label} done in {time.perf_counter() - self.t0:.1f} s", file=self.out,
                  flush=True)


QUIET = Progress(False)


def idle_rounds(clock, variants, warmup, repeat, mpi=None, progress=QUIET):
    """Each call alone on an idle device, round robin (every repetition runs each variant once,
    so slow drifts of clocks, power and temperature hit all of them alike); repetition r uses
    input set r.  Appends to v.gpu and v.host after the warm-up."""
    progress.start(f"idle rounds, {len(variants)} variants", (warmup + repeat) * len(variants))
    for rep in range(warmup + repeat):
        for v in variants:
            progress.tick()
            gpu, host = run(clock, (v,), IDLE, rep, mpi)
            if rep >= warmup:
                v.gpu += gpu
                v.host += host
    progress.finish()


def back_to_back(clock, variants, calls, rounds, mpi=None, progress=QUIET):
    """`rounds` runs of `calls` calls of each variant, round robin over the variants: host issue
    time per call (v.host_b2b) and GPU time per call over each run (v.gpu_b2b; host work the GPU
    hides behind earlier calls does not count)."""
    if not calls:
        return
    progress.start(f"back to back, {calls} calls a run", rounds * len(variants))
    for _ in range(rounds):
        for v in variants:
            progress.tick()
            gpu, host = run(clock, (v,), Schedule(calls=calls, each=False), 0, mpi)
            v.host_b2b += host
            v.gpu_b2b.append(gpu[0] / calls)
    progress.finish()


def alternating(clock, first, second, pairs, mpi=None):
    """second's median GPU time per call over first's, the two called alternately back to back
    with a stamp on the caller's stream after each call.  Calls are fenced with that stream, so
    the time between two stamps is the call between them; the host runs ahead of the GPU, so
    host work is hidden as in a user's loop."""
    gpu, _ = run(clock, (first, second), Schedule(calls=pairs, each=True, on_caller=True), 0, mpi)
    return float(np.median(gpu[1::2]) / np.median(gpu[0::2]))


@dataclass
class Context:
    """What every suite needs: the options, the mesh, its clock, the MPI communicator (under
    mpiexec), the log, and on CUDA the caller's stream as torch's (the user path passes it)."""

    args: Any
    mesh: Any
    clock: Any
    cuda: bool
    log: Callable[[str], None]
    mpi: Any = None
    torch_stream: Any = None
    progress: Progress = QUIET
