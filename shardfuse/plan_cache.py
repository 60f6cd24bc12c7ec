"""PlanCache: the one least-recently-used table of compiled plans.

Three places keep plans compiled once and reused: a jitted function's plans per input specs
(jit.py), the one-op plans of operations outside jit per mesh (array_ops.py), and sf.vjp's
jitted forward and pullback per function (transforms.py).  A plan holds its buffers, so each
table is bounded: the least recently used plan goes when a new one would pass `max_plans`.

Thread-safe: `get` compiles under the cache's lock (two threads asking for one new plan compile
it once).  A caller that keeps a table of its own beside the cache (sf.jit's dispatch table)
passes its lock, so both change together, and `on_evict` to forget an evicted plan there.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any, Callable


class PlanCache:
    def __init__(self, max_plans: int, lock=None, on_evict: Callable[[Any, Any], None] | None = None,
                 stats: dict | None = None):
        self.max_plans = max_plans
        self.lock = threading.RLock() if lock is None else lock
        self.on_evict = on_evict  # (key, plan) of each plan dropped, called under the lock
        # "compiled": plans made; "reused": lookups that found one.  Several caches may count into
        # one dict (array_ops: one cache per mesh, one report).
        self.stats = {"compiled": 0, "reused": 0} if stats is None else stats
        self.plans: OrderedDict = OrderedDict()  # key -> plan, least recently used first
        self.scalars: dict = {}  # array_ops.binary: (op, side, operand spec) -> the Python floats baked there

    def get(self, key, make: Callable[[], Any]):
        """The plan for `key`, now the most recently used: the one kept, else make()'s, kept."""
        with self.lock:
            plan = self.plans.get(key)
            if plan is not None:
                self.plans.move_to_end(key)
                self.stats["reused"] += 1
                return plan
            plan = make()
            self.plans[key] = plan
            self.stats["compiled"] += 1
            while len(self.plans) > self.max_plans:
                old_key, old = self.plans.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(old_key, old)
            return plan

    def touch(self, key) -> None:
        """A use of the plan kept for `key` found another way (sf.jit's dispatch table): it is
        now the most recently used."""
        with self.lock:
            if key in self.plans:  # (another thread may have evicted it since it was found)
                self.plans.move_to_end(key)
            self.stats["reused"] += 1

    def holds(self, key) -> bool:
        """Whether a plan is kept for `key` now."""
        with self.lock:
            return key in self.plans

    def snapshot(self) -> dict:
        """key -> plan, least recently used first (a copy)."""
        with self.lock:
            return dict(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def info(self) -> dict:
        """How many plans are kept, the bound, and the counts (like functools' cache_info)."""
        return {"plans": len(self.plans), "max_plans": self.max_plans, **self.stats}


def serving_plan(cached: dict, specs: tuple):
    """A plan of `cached` ({argument specs: plan}, sf.jit's) that serves `specs` as they are, or None:
    one compiled for plain arrays (specs without a layout) where each of `specs` is the same but
    for a layout, and that layout is the one the plan chose for that input.  A training step called
    with NumPy arrays, then with its own results (sf.Arrays in the layouts its plan gave them), so
    compiles once; a fresh compile for the second specs would trace the same function again with
    those layouts stated (seconds for a model) into the plan it already has."""
    for known, plan in cached.items():
        # (the arrays the function captured are the program's last inputs, which the plan passes itself:
        # an argmax's or a mask's np.arange made every step compile twice)
        inputs, mesh = plan.program.inputs[:len(plan.program.inputs) - len(plan.program.constants)], plan.program.mesh
        if len(known) != len(specs) or len(inputs) != len(specs):
            continue
        if all(s == k or (k.layout is None and s.layout is not None and _same(s.layout, v.type.layout, mesh)
                          and (s.shape, s.dtype, s.weak) == (k.shape, k.dtype, k.weak))
               for s, k, v in zip(specs, known, inputs)):
            return plan
    return None


def _same(a, b, mesh) -> bool:
    """Layouts equal, a mesh of None being the program's whole mesh (an sf.Array's spec says None)."""
    whole = lambda lay: lay if lay.mesh is not mesh else dataclasses.replace(lay, mesh=None)  # noqa: E731
    return a == b or (b is not None and whole(a) == whole(b))
