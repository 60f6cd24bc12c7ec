"""Schedules: when a value is produced, apart from where it lives (shardfuse/sharding.py).

`sf.stream(x, axis, chunks=, algorithm=)` asks for x to be produced chunk by chunk along a tensor
axis.  That is a property of the instruction that produces x, as nvFuser puts ParallelType::Stream
on a loop domain, never of x's layout: the Schedule rides on the instruction (`attrs["schedule"]`),
from the annotation `set` that states it, to the op it is folded into (passes/annotations.py), to
the resharding `set`s after that op (passes/reshard.py) and the values made only to feed it
(passes/pipeline.py), until split_stream splits its axis and form_stream_loops makes the loop.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

KEY = "schedule"  # the instruction attribute that holds one


@dataclass(frozen=True)
class Schedule:
    axis: int  # the tensor axis of the output produced chunk by chunk
    chunks: int | str | None = None  # how many (an int, "auto", or None: one per index; the ring's: its D shards)
    algorithm: str = "collective"  # "collective": each chunk's input gathered; "ring": shards passed around

    @property
    def ring(self) -> bool:
        return self.algorithm == "ring"

    def on_axis(self, axis: int, chunks=None) -> "Schedule":
        """The same schedule along another axis (a split axis, a value that feeds this one)."""
        return replace(self, axis=axis, chunks=chunks)

    def __str__(self):
        extra = "" if self.chunks is None else f", chunks={self.chunks}"
        extra += "" if self.algorithm == "collective" else f", {self.algorithm}"
        return f"stream(axis={self.axis}{extra})"


def of(instr) -> Schedule | None:
    """The schedule of the instruction, or None: produced whole."""
    return instr.attrs.get(KEY)


def axis_of(instr) -> int | None:
    """The stream axis of instr's output, or None."""
    s = of(instr)
    return None if s is None else s.axis


def is_ring(instr) -> bool:
    """Whether instr is streamed with algorithm="ring"."""
    s = of(instr)
    return s is not None and s.ring


def scheduled(attrs: dict, schedule: Schedule | None) -> dict:
    """attrs with this schedule (None: without one)."""
    rest = {k: v for k, v in attrs.items() if k != KEY}
    return rest if schedule is None else {**rest, KEY: schedule}
