"""Stream: which stream of a device a host step issues on (nvFuser's Stream in its host IR).

`MAIN` is the stream a plan starts and ends on (the backend's own stream, fenced with the
caller's); `Stream(k)` is worker k of the backend's pool.  Inside a stream loop a pass names
the worker by a loop index expression, `Stream(Idx("i", 2))` (chunk i on worker i % 2), which
`at(env)` resolves for one loop step: the executor, the cost model and a profile see resolved
streams only.  Streams compare by value, so passes ask `s == MAIN`, never a spelling.

Two spellings, one for each reader: `repr` is how a plan prints it (`SetCurrentStream
Stream(i % 2)`, `RecordEvent main`), `str` its short name, which names its track in a
profile (`stream 0`, `stream main`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, repr=False)
class Stream:
    # None: the main stream; an int: that worker; or a loop index expression (ir.Idx, anything
    # with .eval(env)) that picks a worker per loop step
    index: object = None

    @property
    def is_main(self) -> bool:
        return self.index is None

    def at(self, env: dict) -> "Stream":
        """This stream at one loop step (env: the loop variables): main or a numbered worker."""
        if self.index is None or isinstance(self.index, int):
            return self
        return Stream(self.index.eval(env))

    def __repr__(self):
        return "main" if self.index is None else f"Stream({self.index})"

    def __str__(self):
        return "main" if self.index is None else str(self.index)


MAIN = Stream()
