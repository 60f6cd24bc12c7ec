"""Timeline: what the steps of a plan did, on a time axis, per device and stream (plan.profile).

Each event is one executed step: its process rank, call, step index (its place in the plan's
list of steps, shardfuse/steps.py: a prediction numbers them alike), the devices it ran on (a
pipeline stage's steps on that stage's devices only: steps.devices_of), stream, the
instruction as `print(plan)` shows it, its kind (communication, GEMM, other compute, copy,
stream) and its start and end in seconds from the first step.  Out: Chrome trace / Perfetto JSON
(`to_chrome_trace`), a matplotlib Gantt chart (`plot`), and the summary figures of `summary()`.
"""
from __future__ import annotations

import argparse
import functools
import io
import json
import os
import time
from dataclasses import asdict, dataclass

from shardfuse.backends.protocol import MAIN
from shardfuse.interop import stream_ptr
from shardfuse.steps import KINDS

COLORS = {"communication": "tab:orange", "gemm": "tab:blue", "compute": "tab:green", "copies": "tab:gray",
          "stream": "tab:purple"}


@dataclass(frozen=True)
class Event:
    rank: int
    call: int
    step: int
    devices: tuple
    stream: str
    text: str
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def output_file(path: str) -> str:
    """argparse type of a trace or chart a command writes: its directory must exist, checked
    before the command does any work (a file that cannot be written must not fail a run at its end)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not path:
        raise argparse.ArgumentTypeError("an empty file name")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{path}: {parent} is not a directory" if os.path.exists(parent) else
                                         f"{path}: the directory {parent} does not exist")
    if not os.access(path, os.W_OK) if os.path.exists(path) else not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path} is not writable" if os.path.exists(path) else
                                         f"{path}: the directory {parent} is not writable")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory: give a file name")
    return path


class Timeline:
    def __init__(self, events, plan_name: str = "plan"):
        self.events = sorted(events, key=lambda e: (e.start, e.rank, e.step))
        self.plan_name = plan_name

    @classmethod
    def from_records(cls, exe, records, rank: int = 0):
        """From profile_steps' (call, k, start, end, devices) records: k is a step of exe.steps."""
        t0 = min((r[2] for r in records), default=0.0)
        events = []
        for call, k, start, end, devices in records:
            s = exe.steps[k]
            events.append(Event(rank, call, s.index, devices, str(s.stream), s.text, s.kind, start - t0, end - t0))
        return cls(events, exe.prog.name)

    def __len__(self):
        return len(self.events)

    def __repr__(self):
        s, ranks = self.summary(), len({e.rank for e in self.events})
        where = f" of {ranks} ranks" if ranks > 1 else ""  # (events: every rank's; the figures: one device's)
        return (f"Timeline({self.plan_name!r}: {len(self.events)} steps{where}; device {s['device']}: {s['steps']} "
                f"steps, total {s['total_s'] * 1e3:.3f} ms, communication {s['communication_s'] * 1e3:.3f} ms, "
                f"overlap efficiency {s['overlap_efficiency']:.2f})")

    # ---- figures ----------------------------------------------------------------------------
    def summary(self, call: int | None = None) -> dict:
        """Figures of one device: steps, the executed steps that ran on it (len(timeline) counts
        every rank's); total_s, first start to last end; communication_s / gemm_s / ...: the time
        during which some step of that kind runs (overlapping steps on other streams count
        once); exposed_communication_s: communication time when no GEMM, other compute or copy runs
        on that device; overlap_efficiency = max(T_comm, T_work) / T_total, T_work the time some GEMM,
        compute or copy runs (1.0: perfect overlap; a plan of copies alone is not 0.0, a probe).
        Communication hides only behind its own device's compute, and ranks' clocks are not
        aligned, so a timeline of several devices or ranks gives its slowest one's figures (the
        largest total), `device` naming it as (rank, device).  call=k: that profiled call's alone
        (profile(repeat=N) records N; their spans are what predict() gives for one)."""
        per: dict = {}
        events = self.events if call is None else [e for e in self.events if e.call == call]
        if call is not None and not events and self.events:  # (an all-zero "perfect" report of no call, a probe)
            calls = sorted({e.call for e in self.events})
            raise ValueError(f"summary(call={call!r}): this timeline recorded calls {calls[0]}..{calls[-1]}")
        for e in events:
            for d in e.devices:
                per.setdefault((e.rank, d), []).append(e)
        figures, device = max(((_figures(ev), key) for key, ev in per.items()), key=lambda f: f[0]["total_s"],
                              default=(_figures([]), None))
        return {"steps": len(per.get(device, ())), **figures, "device": device}  # (that device's, not all ranks')

    # ---- out ----------------------------------------------------------------------------------
    def to_chrome_trace(self, path=None) -> dict:
        """Chrome trace / Perfetto JSON: a process per (rank, device), a thread per stream; times
        in microseconds.  Written to `path` when given; the dict is returned either way."""
        trace = []
        pids, tids = {}, {}  # integer ids, named by metadata events (Perfetto shows string tids by number)
        for e in self.events:
            for d in e.devices:
                pid = pids.setdefault((e.rank, d), len(pids))
                tid = tids.setdefault((pid, e.stream), len(tids))
                trace.append({"name": e.text, "cat": e.kind, "ph": "X", "ts": e.start * 1e6, "dur": e.duration * 1e6,
                              "pid": pid, "tid": tid, "args": {"call": e.call, "step": e.step}})
        for (rank, d), pid in pids.items():
            trace.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {rank} device {d}"}})
        for (pid, stream), tid in tids.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"stream {stream}"}})
        doc = {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"plan": self.plan_name}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc

    def to_dicts(self) -> list:
        return [asdict(e) for e in self.events]

    def plot(self, ax=None, path=None):
        """A Gantt chart: a row per (rank, device, stream), each device's main stream first, steps
        coloured by kind.  Returns the matplotlib Figure, which shows once, inline, as a notebook
        cell's last value, with or without `%matplotlib inline` (it has a `_repr_png_`, and it is
        not registered with pyplot, so the inline backend does not show it again); written to
        `path` (e.g. a PNG) when given.  With `ax=`, the chart is drawn there and that Figure returned."""
        try:
            from matplotlib.patches import Patch
        except ImportError:  # (an optional extra)
            raise ImportError("Timeline.plot needs matplotlib: pip install -e \".[plot]\"") from None
        rows = sorted({(e.rank, d, e.stream) for e in self.events for d in e.devices}, key=_row_order)
        index = {r: k for k, r in enumerate(rows)}
        if ax is None:
            ax = _inline_figure()(figsize=(10, 0.5 + 0.4 * max(1, len(rows)))).subplots()
        bars: dict = {}  # (row, kind) -> [(start ms, width ms)]: one artist each, not one per step
        for e in self.events:
            for d in e.devices:
                bars.setdefault((index[(e.rank, d, e.stream)], e.kind), []).append((e.start * 1e3, e.duration * 1e3))
        for (row, kind), spans in bars.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), color=COLORS[kind], linewidth=0)
        ax.set_yticks(range(len(rows)), [f"rank {r} dev {d} stream {s}" for r, d, s in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)  # the first device's main stream on top, as Nsight Systems orders them
        ax.set_xlabel("ms")
        ax.set_title(overlap_title(self.plan_name, self.summary()))
        used = [k for k in KINDS if any(e.kind == k for e in self.events)]
        ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in used], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize="small")
        if path is not None:
            ax.figure.savefig(path, bbox_inches="tight")
        return ax.figure


@functools.cache
def _inline_figure():
    """A matplotlib Figure that Jupyter shows as a PNG (made at the first plot: matplotlib is an
    optional extra).  IPython asks a value's type printers first (`%matplotlib inline` registers
    one for Figure) and `_repr_png_` only where there is none, so it shows once either way."""
    from matplotlib.figure import Figure

    class InlineFigure(Figure):
        def _repr_png_(self):
            out = io.BytesIO()
            self.savefig(out, format="png", bbox_inches="tight")
            return out.getvalue()

    return InlineFigure


def profile_steps(exe, args, repeat: int = 1, nvtx: bool = False) -> list:
    """Run a bound plan `repeat` times, timing every step: [(call, step, start s, end s, devices)].
    On the NumPy backends host clocks around each step (the host runs it: its devices' work, one
    after another).  On GPUs a pair of CUDA events around each step, recorded on the step's own
    stream, so the profiled call issues the same kernels (plus the events) and overlap shows.
    nvtx=True: an NVTX range per call (the plan's name) and per step (its label), for nsys."""
    from shardfuse.pieces import check_args

    if exe.graph is not None:
        raise NotImplementedError("plan.profile runs eager plans (a graph replays as one launch)")
    push, pop = _ranges(nvtx)
    infos = check_args(exe.prog, args, exe.backend, exe.accepted)
    on_gpu = exe.backend.stream(0) is not None
    records: list = []
    ref = exe.backend.new_event(timing=True) if on_gpu else None  # recorded once: every call's times from it
    with exe.lock:
        for call in range(repeat):
            exe.check_ranks()
            push(exe.prog.name)
            try:  # a failing step must not leave Nsight's ranges open
                if on_gpu:
                    records += _gpu_call(exe, args, infos, call, ref, push, pop)
                else:
                    exe.run(args, infos, None, issue=lambda bufs: records.extend(_host_steps(exe, bufs, call, push, pop)))
            finally:
                pop()
    if not on_gpu:  # each step on this process' devices of it (a pipeline stage's steps on the stage's)
        t0 = min((r[2] for r in records), default=0.0)
        records = [(c, k, a - t0, b - t0, exe.steps[k].devices) for c, k, a, b in records]
    return records


def _ranges(on: bool):
    """(push, pop): nvtx's, so Nsight Systems names the ranges as the Timeline does, or no-ops.
    Imported only when asked for: nvtx is an optional extra."""
    if not on:
        return _noop, _noop
    try:
        import nvtx
    except ImportError:
        raise ImportError("plan.profile(nvtx=True) needs the nvtx package: pip install \"shardfuse[nvtx]\" "
                          "(or pip install nvtx)") from None
    return nvtx.push_range, nvtx.pop_range


def _noop(*_):
    pass


def _host_steps(exe, bufs, call, push, pop):
    clock, out = time.perf_counter, []
    for k, step in enumerate(exe.steps):
        push(step.text)  # outside the clocks: the ranges cost the measured intervals nothing
        try:
            t0 = clock()
            step.run(bufs)
            t1 = clock()
        finally:
            pop()
        out.append((call, k, t0, t1))
    return out


def _gpu_call(exe, args, infos, call, ref, push, pop):
    be = exe.backend
    marks = [(be.new_event(timing=True), be.new_event(timing=True)) for _ in exe.steps]
    first = be.bind_record(ref, MAIN) if call == 0 else (lambda bufs: None)
    around = [(s.text, be.bind_record(e0, s.stream), s.run, be.bind_record(e1, s.stream))
              for s, (e0, e1) in zip(exe.steps, marks)]

    def issue(bufs):
        first(bufs)
        for text, pre, step, post in around:
            push(text)  # outside the events, which time the GPU's work, not the host's
            try:
                pre(bufs)
                step(bufs)
                post(bufs)
            finally:
                pop()
    exe.run(args, infos, stream_ptr(None), issue=issue)  # (fenced with CuPy's current stream)
    be.synchronize()
    gpus = list(be.ordinals) if be.ordinals else [None]
    order = sorted(set(gpus), key=gpus.index)
    out = []
    for k, (e0, e1) in enumerate(marks):
        starts, ends = be.event_ms(ref, e0), be.event_ms(ref, e1)
        mine = exe.steps[k].devices  # (a pipeline stage's step: its GPUs only)
        for g, a, b in zip(order, starts, ends):
            devices = tuple(d for d, o in zip(be.local_devices, gpus) if o == g and d in mine)
            if devices:
                out.append((call, k, a / 1e3, b / 1e3, devices))
    return out


def _row_order(row):
    """(rank, device, main stream first, then workers by number): not "10" before "2"."""
    rank, device, stream = row
    return rank, device, stream != str(MAIN), int(stream) if stream.isdigit() else 0, stream


def _figures(ev) -> dict:
    """Timeline.summary's figures of one device's events."""
    total = max((e.end for e in ev), default=0.0) - min((e.start for e in ev), default=0.0)
    spans = {k: _union([(e.start, e.end) for e in ev if e.kind == k]) for k in KINDS}
    by_kind = {k: _covered(u) for k, u in spans.items()}
    busy = _union(spans["gemm"] + spans["compute"] + spans["copies"])  # (device work a transfer can hide behind)
    compute = _covered(busy)
    exposed = sum((_uncovered(iv, busy) for iv in spans["communication"]), 0.0)  # (concurrent ones count once)
    eff = max(by_kind["communication"], compute) / total if total > 0 else 1.0
    return {"total_s": total, "communication_s": by_kind["communication"], "gemm_s": by_kind["gemm"],
            "compute_s": by_kind["compute"], "copy_s": by_kind["copies"], "exposed_communication_s": exposed,
            "overlap_efficiency": eff}


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(intervals) -> float:
    return sum((b - a for a, b in intervals), 0.0)


def _uncovered(iv, covered) -> float:
    a, b = iv
    left = b - a
    for c, d in covered:
        left -= max(0.0, min(b, d) - max(a, c))
    return max(0.0, left)


def overlap_title(name, s) -> str:
    """The chart's title: the overlap efficiency, and how much of the communication ran behind compute (a
    DTensor probe read "0.95 overlap efficiency" of a one-stream plan as overlap: with little
    communication the efficiency is high whether or not any of it is hidden)."""
    comm = s["communication_s"]
    hidden = f"{1 - s['exposed_communication_s'] / comm:.0%} of communication hidden" if comm > 0 else "no communication"
    return f"{name}: {s['overlap_efficiency']:.2f} overlap efficiency, {hidden}"

