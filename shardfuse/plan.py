"""A compiled plan: the host program sf.jit made, bound lazily to the mesh's backend and run on
sf.Arrays; printable, profiled, counted (collectives) and explained (the cost model)."""
from __future__ import annotations

import threading

import numpy as np

from shardfuse import tree
from shardfuse.stage_arrays import on_root
from shardfuse.array import Array
from shardfuse.autochunks import explain_plan
from shardfuse.cost import predict
from shardfuse.executor import Executable
from shardfuse.interop import array_info
from shardfuse.spec import TensorSpec
from shardfuse.ir import Program, unroll
from shardfuse.mesh import as_int
from shardfuse.passes.reuse import memory
from shardfuse.pieces import check_args
from shardfuse.ops import COMMUNICATION, Op
from shardfuse.rates import machine


class Plan:
    """A compiled host program, bound lazily to the mesh's backend."""

    def __init__(self, program: Program, graph: bool = False, explanation=None, rates=None):
        self.program = program
        self.graph = graph
        self._exe = None
        self._binding = threading.Lock()  # threads' first calls bind it once (binding may communicate)
        self._why, self._rates = explanation, rates  # chunks="auto"'s choice; the rates given to sf.jit
        self.out_tree = None  # the structure of the function's result where it is a pytree (tree.FlatFunction)
        self.in_tree = None  # the structure of its arguments where they are pytrees
        self.positional = None  # (args, kwargs) -> args, as the jitted function binds them (sf.jit sets it)
        self._const_infos = tuple(None if isinstance(c, Array) else array_info(c) for c in program.constants)
        # (input, dtype, its least and greatest value) per Python int argument a promotion narrows
        self._bounds = tuple((k, dt, int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for k, dt in program.weak_bounds)
        self._out_types = tuple((v.type.shape, v.type.dtype) for v in program.outputs)

    def __str__(self):
        return str(self.program)

    __repr__ = __str__

    def _repr_html_(self):
        """Jupyter: the program, the collectives one call issues, and what folded."""
        import html

        text = str(self.program)
        folded = text.count("folded=")
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(self.collectives().items())) or "none"
        return (f"<div><b>plan {html.escape(self.program.name)}</b>: collectives per call: {html.escape(counts)}; "
                f"{folded} one-device collective(s) folded into views"
                f"<pre style='font-size:smaller'>{html.escape(text)}</pre></div>")

    @property
    def input_layouts(self) -> tuple:
        """The Layout each argument is taken in, in the arguments' structure (JAX's
        compiled.input_shardings: a tuple, one per argument, pytrees as pytrees): a plain array is
        placed so; an sf.Array in another layout selects another plan."""
        args = self.program.inputs[:len(self.program.inputs) - len(self.program.constants)]
        layouts = tuple(v.type.layout for v in args)
        return self.in_tree.unflatten(layouts) if self.in_tree is not None else layouts

    @property
    def output_layouts(self):
        """The Layout of each result, in the result's structure (JAX's compiled.output_shardings): a
        training step's state comes back in these (its weights sharded as its annotations say), so
        `sf.distribute(w0, mesh, layout)` places a first state the steady-state plan takes at once."""
        layouts = tuple(v.type.layout for v in self.program.outputs)
        if self.out_tree is not None:
            return self.out_tree.unflatten(layouts)
        return layouts[0] if len(layouts) == 1 else layouts  # (as a call returns its arrays)

    @property
    def output_specs(self):
        """Each result's sf.TensorSpec (shape, dtype, layout; weak where a 0-d result is), in the result's
        structure: what sf.eval_shape gives (JAX's ShapeDtypeStruct)."""
        weak = set(self.program.weak_outputs)
        specs = tuple(TensorSpec(v.type.shape, v.type.dtype, v.type.layout, weak=k in weak)
                      for k, v in enumerate(self.program.outputs))
        if self.out_tree is not None:
            return self.out_tree.unflatten(specs)
        return specs[0] if len(specs) == 1 else specs

    def collectives(self) -> dict[str, int]:
        """How many collectives of each kind one call issues: the plan's communication steps as
        the executor binds them (ir.unroll: loops unrolled, guards applied)."""
        counts: dict = {}
        for i, _ in unroll(self.program.instrs):
            if i.op in COMMUNICATION:
                key = i.attrs["kind"].lower() if i.op == Op.TRANSFER else str(i.op)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def memory(self) -> dict:
        """Bytes of the plan's buffers on its most loaded device (passes/reuse.py, memory; a pipeline
        stage's buffers are made on its devices only): `persistent` (made once: scratch, pools,
        slabs), `unshared` (what those would be with no slab shared), `per_call` (the outputs, made
        at every call), `device` (which).  Inputs are the caller's and not counted."""
        return memory(self.program)

    def profile(self, *args, repeat: int = 1, nvtx: bool = False):
        """Run the plan `repeat` times and return its Timeline: every executed step with its
        device(s), stream, instruction text (as print(plan) shows it), start and end.  Under
        mpiexec every rank's steps, gathered on every rank (a collective call).  Host clocks on the
        NumPy backends, CUDA events around each step on GPUs (shardfuse/timeline.py).  nvtx=True
        also wraps each call and each step in an NVTX range named as the Timeline names them, so
        `nsys profile` shows the same names (the optional [nvtx] extra)."""
        from shardfuse import faults
        from shardfuse.timeline import Timeline, profile_steps

        repeat = as_int(repeat, "plan.profile repeat=", minimum=1)  # (0 would profile nothing, silently)
        if any(tree.is_container(a) for a in args):  # the jitted function's pytrees: their leaves
            args = tuple(tree.leaves(args))
        args = tuple(on_root(a, self.program.mesh) for a in args)  # (a stage's sf.Array, as a call takes it: a probe)
        exe, args = self.executable, self._with_constants(args, None)[0]  # (the constants: bound by the plan)
        timeline = Timeline.from_records(exe, profile_steps(exe, args, repeat, nvtx), rank=self.program.mesh.rank)
        mesh = self.program.mesh
        if mesh.nprocs > 1:
            parts = faults.allgather_object(timeline.events, f"gathering the profile of {self.program.name!r}")
            timeline = Timeline([e for part in parts for e in part], self.program.name)
        return timeline

    def explain(self):
        """The cost model's view of this plan: for chunks="auto", every candidate S with its
        predicted total, communication, compute and exposed communication, and why the chosen one
        won; for a plan with fixed chunks, its one line.  Printable (an Explanation)."""
        if self._why is None:
            self._why = explain_plan(self.program, *machine(self.program.mesh, self._rates))
        return self._why

    def predict(self):
        """The cost model's prediction of one call (cost.Prediction: .total_s, .timeline())."""
        return predict(self.program, *machine(self.program.mesh, self._rates))

    @property
    def executable(self):
        if self._exe is None:
            with self._binding:
                if self._exe is None:
                    self._exe = Executable(self.program, graph=self.graph)
        return self._exe

    def __call__(self, *args, stream=None, infos=None, **kwargs):
        """Run the plan: sf.Arrays in (or plain arrays, or the pytrees of them the jitted function
        took; by keyword too, as the jitted function takes them), sf.Arrays out (in the function's
        result structure)."""
        if kwargs:
            if self.positional is None:
                raise TypeError(f"plan {self.program.name!r} takes its arguments by position (it was not made by sf.jit)")
            args = self.positional(args, kwargs)
        if any(tree.is_container(a) for a in args):
            args = tuple(tree.leaves(args))
        args = tuple(on_root(a, self.program.mesh) for a in args)  # (a stage's sf.Array: as the whole mesh's)
        return self.run_flat(args, stream, infos)

    def _with_constants(self, args, infos) -> tuple:
        """The arguments and their infos followed by the arrays captured when traced (the last inputs)."""
        if not self.program.constants:
            return args, infos
        return args + self.program.constants, None if infos is None else infos + self._const_infos

    def check(self, args, infos) -> None:
        """Every argument (flat: the pytrees' leaves) against the plan's inputs, before any work."""
        args, infos = self._with_constants(args, infos)
        exe = self.executable
        check_args(self.program, args, exe.backend, exe.accepted, infos)

    def run_flat(self, args, stream=None, infos=None, checked=False):
        """The plan on flat arguments.  checked: sf.jit's dispatch table has checked arguments of
        these kinds against this plan (check) and gives their `infos`: not checked again."""
        if self._bounds:  # (Python int arguments an int32 promotion narrows: before any work)
            self.check_bounds(args)
        if self.program.constants:
            args, infos = self._with_constants(args, infos)
        exe = self._exe or self.executable
        if exe.donated:
            self._check_donated(args, exe.donated)
        if not checked:
            infos = check_args(self.program, args, exe.backend, exe.accepted, infos)
        outs, fenced = exe.call_checked(args, infos, stream)
        for k in exe.donated:
            if isinstance(args[k], Array):
                args[k].donated(f"{self.program.name}")
        mesh, owned = self.program.mesh, not self.graph
        arrays = tuple(Array(mesh, shape, dtype, lay, shards, whole, owned, fenced)
                       for (shape, dtype), (lay, shards, whole) in zip(self._out_types, outs))
        for k in self.program.weak_outputs:
            arrays[k].weak = True
        if self.out_tree is not None:
            return self.out_tree.unflatten(arrays)
        return arrays[0] if len(arrays) == 1 else arrays

    def check_bounds(self, args):
        """A Python int argument that a promotion casts to a narrower dtype (int32 x + s) must fit it:
        OverflowError naming it, as NumPy 2 and JAX raise for such a scalar, before any communication
        (every rank passes the same value, so every rank raises)."""
        for k, dtype, least, greatest in self._bounds:
            a = args[k]
            if isinstance(a, int) and not least <= a <= greatest:
                name = self.program.inputs[k].name
                raise OverflowError(f"{self.program.name}(): argument {name} is the Python int {a}, out of bounds for "
                                    f"{dtype}, the dtype it is promoted to beside {dtype} arrays (NumPy 2 and JAX "
                                    f"raise OverflowError too); for an int64 result pass np.int64({name}), or cast "
                                    "the arrays first")

    def _check_donated(self, args, donated):
        """A donated argument passed in another position too would be read after the result wrote it
        (an sf.Array's own buffers; a caller's plain array is copied for the result to write, as JAX
        copies each host leaf it places)."""
        for k in donated:
            for j, a in enumerate(args):
                if j != k and a is args[k] and isinstance(a, Array):
                    names = self.program.inputs[k].name, self.program.inputs[j].name  # (leaves of pytrees: state_0)
                    raise ValueError(f"{self.program.name}(): input {names[0]} is donated (donate_argnums) and also "
                                     f"passed as input {names[1]}: its buffer would be overwritten while read; pass a copy")
