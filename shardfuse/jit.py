"""sf.jit: trace a function once per input specs, compile it to a plan, run the plan."""
from __future__ import annotations

import functools
import inspect
import os

from shardfuse.array import Array, spec_of
from shardfuse.interop import array_info
from shardfuse.ir import Program, TensorType, Value
from shardfuse.passes import compile_program
from shardfuse.passes.verify import COLLECTIVES
from shardfuse.trace import Builder, TensorSpec, Traced


class Plan:
    """A compiled host program, bound lazily to the mesh's backend."""

    def __init__(self, program: Program, graph: bool = False):
        self.program = program
        self.graph = graph
        self._exe = None

    def __str__(self):
        return str(self.program)

    __repr__ = __str__

    def collectives(self) -> dict:
        """How many collectives of each kind one call issues (loops unrolled, guards applied)."""
        from shardfuse.executor import _holds

        counts: dict = {}

        def visit(instrs, env):
            for i in instrs:
                if "when" in i.attrs and not _holds(i.attrs["when"], env):
                    continue
                if i.op in COLLECTIVES:
                    key = i.attrs["kind"].lower() if i.op == "transfer" else i.op
                    counts[key] = counts.get(key, 0) + 1
                if i.op == "for":
                    for it in range(i.attrs["extent"]):
                        visit(i.body, {**env, i.attrs["var"]: it})

        visit(self.program.instrs, {})
        return counts

    @property
    def executable(self):
        if self._exe is None:
            from shardfuse.executor import Executable

            self._exe = Executable(self.program, self.program.mesh.backend, graph=self.graph)
        return self._exe

    def __call__(self, *args, stream=None, infos=None):
        return self.executable(*args, stream=stream, infos=infos)


def trace(fn, mesh, specs, streams=4, name=None) -> Program:
    builder = Builder(mesh)
    params = list(inspect.signature(fn).parameters)
    if len(params) != len(specs):
        raise TypeError(f"{fn.__name__} takes {len(params)} arguments, got {len(specs)}")
    inputs = []
    for pname, spec in zip(params, specs):
        v = Value(builder.namer(pname), TensorType(spec.shape, spec.dtype, spec.layout))
        inputs.append(v)
    result = fn(*(Traced(builder, v) for v in inputs))
    results = result if isinstance(result, tuple) else (result,)
    for r in results:
        if not isinstance(r, Traced):
            raise TypeError(f"{fn.__name__} must return traced values, got {type(r).__name__}")
    return Program(name or fn.__name__, mesh, tuple(inputs), tuple(r.value for r in results),
                   tuple(builder.instrs), streams, ("trace",))


class Jitted:
    def __init__(self, fn, mesh, streams=4, graph=False):
        if mesh is None:
            raise ValueError("sf.jit needs a mesh: sf.jit(mesh=sf.DeviceMesh(n))")
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be a positive int, got {streams!r}")
        self.fn, self.mesh, self.streams, self.graph = fn, mesh, streams, graph
        self._plans: dict = {}
        self._dispatch: dict = {}  # argument key -> plan (see __call__)
        functools.update_wrapper(self, fn)

    def lower(self, *specs) -> Plan:
        specs = tuple(s if isinstance(s, TensorSpec) else TensorSpec(*s) for s in specs)
        plan = self._plans.get(specs)
        if plan is None:
            prog = compile_program(trace(self.fn, self.mesh, specs, self.streams))
            plan = self._plans[specs] = Plan(prog, self.graph)
            if os.environ.get("SHARDFUSE_DUMP") == "plan":
                print(plan, flush=True)
        return plan

    def __call__(self, *args, stream=None):
        """Run on the mesh.  stream=: the CUDA stream the caller issues on (CuPy or torch stream,
        `__cuda_stream__` object); default CuPy's current stream.  The call waits for it
        device-side and it waits for the outputs."""
        # hot path: the plan for these argument kinds, found by a cheap key (no TensorSpec built)
        infos = tuple(None if isinstance(a, Array) else array_info(a) for a in args)
        key = tuple((a.shape, a.dtype_name, a.sharding, a.mesh) if i is None else (i.shape, i.dtype)
                    for a, i in zip(args, infos))
        plan = self._dispatch.get(key)
        if plan is None:
            plan = self._dispatch[key] = self.lower(*(spec_of(a, self.mesh) for a in args))
        return plan(*args, stream=stream, infos=infos)


def jit(fn=None, *, mesh=None, streams: int = 4, graph: bool = False):
    """Compile `fn` for `mesh`: ``@sf.jit(mesh=mesh, streams=4)``."""
    if fn is None:
        return lambda f: Jitted(f, mesh, streams, graph)
    return Jitted(fn, mesh, streams, graph)
