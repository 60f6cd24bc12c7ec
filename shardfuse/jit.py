"""sf.jit: trace a function once per input specs, compile it to a plan (shardfuse.plan), run the plan."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, overload
import logging
import os
import threading
import time

import numpy as np

from shardfuse.array import WEAK_TYPES, Array, spec_of
from shardfuse.stage_arrays import on_root
from shardfuse.plan import Plan  # noqa: F401 (sf.jit's plans; shardfuse.jit.Plan as before)
from shardfuse.interop import array_info
from shardfuse import tree
from shardfuse.autochunks import compile_best
from shardfuse.autodiff_layouts import drop_hints
from shardfuse.cost import Rates
from shardfuse.rates import machine
from shardfuse.mesh import DeviceMesh, as_int
from shardfuse.plan_cache import PlanCache, serving_plan
from shardfuse.spec import TensorSpec, is_spec_tuple
from shardfuse.jit_shardings import check_options, check_rates, constrained
from shardfuse.static_args import donated_positions, dynamic_position, split_static, static_names, with_static
from shardfuse.trace import input_names, trace
from shardfuse.traced import Traced
from shardfuse.ir import same_program
from shardfuse.ops import Op


log = logging.getLogger("shardfuse")  # compile decisions (plans built, evicted); silent unless configured


MAX_PLANS = 64  # compiled plans a jitted function keeps by default (the least recently used go)
_NUMBERS = (bool, int, float, complex, np.generic)  # Python and NumPy scalars: not arrays, as pytree leaves
_GENERAL = (dict, list, tuple, Traced)  # arguments the hot path leaves to the general one (pytrees, inlining)


class Jitted:
    """A function compiled for a mesh: one plan per input specs, the `max_plans` most recently
    used kept (a plan holds its buffers; an evicted one is compiled again when next needed)."""

    def __init__(self, fn, mesh, streams=4, graph=False, max_plans=MAX_PLANS, rates=None, donate_argnums=(),
                 static_argnums=(), static_argnames=(), donate_argnames=()):
        check_options(fn, mesh, streams, graph)
        self.fn, self.mesh, self.streams, self.graph = fn, mesh, int(streams), bool(graph)
        self.donate_argnums = donated_positions(fn, donate_argnums, donate_argnames)
        if self.donate_argnums and self.graph:
            raise NotImplementedError("sf.jit(donate_argnums=..., graph=True): a CUDA graph writes the buffers it "
                                      "captured, so its results cannot take the arguments' buffers; use graph=False")
        self.max_plans = as_int(max_plans, "sf.jit max_plans=", minimum=1)
        check_rates(rates)
        self.rates = rates  # for chunks="auto" and plan.explain(): None = calibrated, else built-in defaults
        self._tables = threading.RLock()  # both tables, for threads calling at once (a call runs outside it)
        self._plans = PlanCache(self.max_plans, self._tables, self._evicted)  # input specs -> plan
        self._dispatch: dict = {}  # argument key -> (input specs, plan) (see __call__)
        self._trees: dict = {}  # arguments' pytree structure -> the sf.jit of fn as a function of their leaves
        self._static = static_names(fn, static_argnums, static_argnames)  # (names of fn's static parameters)
        self._statics = PlanCache(self.max_plans, self._tables)  # static values -> the sf.jit of fn with them
        functools.update_wrapper(self, fn, updated=())  # (not fn.__dict__: a FlatFunction's fields would shadow ours)
        if not hasattr(self, "__name__"):  # (a functools.partial, a callable object: messages and nesting name it)
            inner = getattr(fn, "func", None)
            self.__name__ = f"partial({getattr(inner, '__name__', 'fn')})" if inner else type(fn).__name__

    def __repr__(self):
        return (f"sf.jit({self.__name__}, mesh={self.mesh!r}, streams={self.streams}, graph={self.graph}; "
                f"{len(self.cached_plans())} plan(s) compiled)")

    def cached_plans(self) -> dict:
        """The compiled plans kept, by input specs, least recently used first (a copy); for
        pytree arguments, by (their structure, the leaves' specs), each structure's apart; with
        static arguments, by (their values, ...).  A plan that also serves other specs (a step called
        with NumPy arrays, then with its own results: plan_cache.serving_plan) is kept under both
        keys, one plan object, compiled once: count distinct plans with len({id(p) for p in ...})."""
        out = self._plans.snapshot()
        for td, child in list(self._trees.items()):
            out.update({(td, specs): plan for specs, plan in child.cached_plans().items()})
        for key, child in self._statics.snapshot().items():
            out.update({(key, specs): plan for specs, plan in child.cached_plans().items()})
        return out

    def bind_static(self, args, kwargs) -> tuple:
        """(the sf.jit of fn with the static values among args / kwargs fixed, the other args, kwargs);
        self and them as they are where fn has no static parameter."""
        if not self._static:
            return self, args, kwargs
        key, args, kwargs = split_static(self.fn, self._static, args, kwargs)
        return self._with_static(key), args, kwargs

    def _with_static(self, key) -> "Jitted":
        """The sf.jit of fn with its static parameters fixed to `key`'s values (made once per key)."""
        def make():
            donated = tuple(dynamic_position(self.fn, self._static, k) for k in self.donate_argnums)
            return Jitted(with_static(self.fn, key), self.mesh, self.streams, self.graph, self.max_plans, self.rates,
                          donated)
        return self._statics.get(key, make)

    def cache_info(self) -> dict:
        """How many plans are kept (distinct: one serving its own results counts once) and how many
        argument kinds map to them (both bounded by max_plans, per pytree structure), like functools'
        cache_info; the plans of pytree arguments and of static values are kept by their own sf.jit
        functions, counted here too (as cached_plans lists them)."""
        trees, statics = list(self._trees.values()), list(self._statics.snapshot().values())
        children = [c.cache_info() for c in trees + statics]
        info = {"plans": len({id(p) for p in self._plans.snapshot().values()}) + sum(c["plans"] for c in children),
                "dispatch": len(self._dispatch) + sum(c["dispatch"] for c in children), "max_plans": self.max_plans}
        if self._static:
            info["static_values"] = len(statics)
        return info

    def lower(self, *specs: Any, **named: Any) -> Plan:
        """The plan for these inputs: TensorSpecs, (shape, dtype[, sharding]) tuples, or the
        arrays themselves (as JAX's .lower takes either), by keyword too as the function takes them."""
        target, specs = self._resolve(specs, "lower", named)
        with target._tables:
            plan = target._lower(specs)
        if target is not self and not self._static:  # (pytree arguments: keywords bound as this function binds them)
            plan.positional = self.positional
        return plan

    def trace(self, *specs: Any):
        """The traced program for these inputs, before any pass (JAX's make_jaxpr): the ops, the
        layouts the annotations state and the schedules sf.stream asks for.  Printable."""
        target, specs = self._resolve(specs, "trace")
        fn = target.fn if isinstance(target.fn, tree.FlatFunction) else tree.FlatFunction(target.fn)
        return trace(fn, target.mesh, specs, target.streams)

    def _resolve(self, specs, what, named=None) -> tuple:
        """(the sf.jit that compiles these inputs: this one, its static values' or its pytree
        structure's, and their TensorSpecs) for lower(*specs, **named) / trace(*specs)."""
        for s in specs:  # (a shape alone, (16, 8), would read 8 as a dtype)
            if isinstance(s, tuple) and len(s) >= 2 and all(isinstance(n, (int, np.integer)) for n in s):
                raise TypeError(f"{self.__name__}.{what} takes TensorSpecs, (shape, dtype[, sharding]) tuples or "
                                f"arrays; got {s!r}: for a shape, write ({s!r}, 'float32')")
        if self._static:  # (JAX's f.lower(x, 4): the static values where the function takes them)
            target, specs, named = self.bind_static(specs, named or {})
            return target._resolve(specs, what, named)
        specs = self.positional(specs, named) if named else specs
        if any(tree.is_container(s) and not is_spec_tuple(s) for s in specs):  # pytrees of specs or arrays
            leaves, in_tree = tree.flatten(specs, is_leaf=lambda x: x is not specs and is_spec_tuple(x))
            return self._for_tree(in_tree)._resolve(tuple(leaves), what)
        return self, tuple(s if isinstance(s, TensorSpec) else TensorSpec(*s) if isinstance(s, tuple)
                           else spec_of(s, self.mesh) for s in specs)

    def _for_tree(self, in_tree) -> "Jitted":
        """The sf.jit of fn as a function of the leaves of arguments of this structure (made once)."""
        with self._tables:
            child = self._trees.get(in_tree)
            if child is None:
                flat = tree.FlatFunction(self.fn, in_tree, input_names(self.fn, len(in_tree.children)))
                starts = [sum(c.num_leaves for c in in_tree.children[:k]) for k in range(len(in_tree.children) + 1)]
                leaves = tuple(j for k in self.donate_argnums if k < len(in_tree.children)
                               for j in range(starts[k], starts[k + 1]))
                child = self._trees[in_tree] = Jitted(flat, self.mesh, self.streams, self.graph, self.max_plans,
                                                      self.rates, leaves)
            return child

    def _lower(self, specs: tuple) -> Plan:
        return self._plans.get(specs, lambda: serving_plan(self._plans.snapshot(), specs) or self._compile(specs))

    def _compile(self, specs: tuple) -> Plan:
        t0 = time.perf_counter()
        fn = self.fn if isinstance(self.fn, tree.FlatFunction) else tree.FlatFunction(self.fn)
        traced = trace(fn, self.mesh, specs, self.streams)  # once per input signature, "auto" or not
        if self.donate_argnums:
            if max(self.donate_argnums) >= len(specs):
                raise ValueError(f"{self.__name__}: donate_argnums={self.donate_argnums} names argument "
                                 f"{max(self.donate_argnums)}, but the call gave {len(specs)}")
            traced = dataclasses.replace(traced, donated=self.donate_argnums)
        try:
            prog, why = compile_best(traced, lambda: machine(self.mesh, self.rates))
        except ValueError:
            plain = drop_hints(traced)  # a backward's schedule is a hint: without it, or the refusal
            if plain is None:
                raise
            prog, why = compile_best(plain, lambda: machine(self.mesh, self.rates))
        # a step called with plain arrays, then with its own results (replicated sf.Arrays): two specs,
        # one program; one plan serves both, so its buffers are bound once (issue 32: not twice a step's)
        plan = next((p for p in self._plans.snapshot().values() if same_program(p.program, prog)), None)
        if plan is None:
            plan = Plan(prog, self.graph, why, self.rates)
            plan.out_tree = fn.out_tree  # (the structure of fn's result, set as it was traced just now)
            plan.in_tree = fn.in_tree  # (the arguments' pytree structure, None where they are arrays)
            plan.positional = self.positional  # (plan(x=...) binds keywords as the jitted function does)
        if log.isEnabledFor(logging.INFO):
            loops = [i.attrs["extent"] for i in prog.instrs if i.op == Op.FOR]
            log.info("compiled plan %r for %s in %.1f ms: %d instructions, stream loops of %s chunks, "
                     "collectives per call %s, %d folded into views", prog.name,
                     ", ".join(str(v.type) for v in prog.inputs), (time.perf_counter() - t0) * 1e3, len(prog.instrs),
                     loops or "no", plan.collectives() or "none", str(prog).count("folded="))
        if os.environ.get("SHARDFUSE_DUMP") == "plan" and self.mesh.rank == 0:  # (the ranks' plans agree: checked)
            print(plan, flush=True)
        return plan

    def _evicted(self, specs, old: Plan) -> None:
        """The plan cache dropped `old`, kept for `specs` and least recently used: the dispatch table
        forgets the argument kinds of those specs (not of other specs the same plan serves)."""
        log.info("plan cache of %s full (max_plans=%d): dropped the least recently used plan", self.__name__,
                 self.max_plans)
        for k in [k for k, (s, _) in self._dispatch.items() if s == specs]:
            del self._dispatch[k]

    def __call__(self, *args: Any, stream: Any = None, **kwargs: Any) -> Any:
        """Run on the mesh.  stream=: the CUDA stream the caller issues on (CuPy or torch stream,
        `__cuda_stream__` object); default CuPy's current stream.  The call waits for it
        device-side and it waits for the outputs.

        Called on traced values, inside another sf.jit function, the function is inlined: traced
        into the caller's program (as JAX does); its streams= and graph= are the caller's then."""
        if not (kwargs or self._static):  # hot path: the plan for these argument kinds, by a cheap key
            infos, key = self._dispatch_key(args)
            if key is not None:
                hit = self._dispatch.get(key)  # (one dict read: atomic, no lock; touch takes the tables' lock)
                if hit is None:
                    hit = self._first_call(key, args, infos)
                else:
                    self._plans.touch(hit[0])
                return hit[1].run_flat(args, stream, infos, checked=True)
        if self._static and not any(isinstance(a, Traced) for a in tree.leaves((args, kwargs))):
            target, args, kwargs = self.bind_static(args, kwargs)
            return target(*args, stream=stream, **kwargs)
        if any(isinstance(a, Traced) for a in tree.leaves((args, kwargs))):
            return self._inline(args, kwargs, stream)
        if kwargs:
            args = self.positional(args, kwargs)
        if any(isinstance(a, (dict, list, tuple)) or a is None for a in args):  # pytrees of arrays
            leaves, in_tree = tree.flatten(args)
            if any(isinstance(x, _NUMBERS) for x in leaves):
                self._refuse_numbers(args)
            return self._for_tree(in_tree)(*leaves, stream=stream)
        if any(isinstance(a, Array) and a.mesh is not self.mesh and a.mesh.root is self.mesh for a in args):
            args = tuple(on_root(a, self.mesh) for a in args)  # (a stage's sf.Array as the whole mesh's)
        return self(*args, stream=stream)

    def _dispatch_key(self, args) -> tuple:
        """(infos, key) of flat array arguments: array_info of each plain one (None for an
        sf.Array), and the dispatch table's key; (None, None) for pytrees and traced values."""
        infos, key = [], []
        for a in args:
            if isinstance(a, Array):
                if a.mesh is not self.mesh and a.mesh.root is self.mesh:
                    return None, None  # (placed on a stage: the general path takes it as the whole mesh's)
                infos.append(None)
                key.append((a.shape, a.dtype_name, a.sharding, a.mesh, a.weak))
                continue
            if a is None or isinstance(a, _GENERAL):
                return None, None
            try:
                i = array_info(a, calling=True)
            except (TypeError, ValueError, OverflowError) as e:
                if any(isinstance(v, Traced) for v in args):  # (a Python value beside traced ones: inlined)
                    return None, None
                raise self._argument_error(args, e) from None
            infos.append(i)  # (the key: 2.0 and np.float64(2.0) weak or not; device and contiguity as checked)
            key.append((i.shape, i.dtype, type(a) in WEAK_TYPES, i.device, i.contiguous))
        return tuple(infos), tuple(key)

    def _first_call(self, key, args, infos) -> tuple:
        """The dispatch entry (specs, plan) of a new key, its arguments checked against the plan once."""
        with self._tables:
            hit = self._dispatch.get(key)
            if hit is not None:
                return hit
            self._refuse_other_meshes(args)
            specs = tuple(spec_of(a, self.mesh) for a in args)
            plan = self._lower(specs)
        plan.check(args, infos)  # (binds the plan on its first call: outside the tables' lock)
        with self._tables:
            if self._plans.holds(specs):  # (not evicted meanwhile by another thread)
                if len(self._dispatch) > 64 * self.max_plans:  # (keys of one specs differ in contiguity: bounded)
                    self._dispatch.clear()
                self._dispatch[key] = (specs, plan)
        return specs, plan

    def _refuse_numbers(self, args):
        """A list or tuple of numbers only is data meant as one array (NumPy would read it so), which
        sf.jit does not guess: say what to write.  Numbers beside arrays or in a dict (an optimizer
        state's step count) are leaves, as in JAX: a Python number a weak 0-d value, a NumPy one 0-d."""
        names = input_names(self.fn, len(args))
        for k, (name, a) in enumerate(zip(names, args)):
            leaves = tree.leaves(a)
            numbers = [x for x in leaves if isinstance(x, _NUMBERS)]
            if numbers and isinstance(a, (list, tuple)) and len(numbers) == len(leaves):
                raise TypeError(f"{self.__name__}(): argument {name} (position {k}) is a {type(a).__name__} holding "
                                f"Python numbers ({numbers[0]!r}, ...): sf.jit takes arrays, and pytrees (dicts, lists, "
                                f"tuples) of arrays; for one array write np.asarray({name})")

    def _refuse_other_meshes(self, args):
        """An sf.Array on another mesh, named by its parameter (as the other argument errors are)."""
        for k, (name, a) in enumerate(zip(input_names(self.fn, len(args)), args)):
            if isinstance(a, Array) and a.mesh != self.mesh:
                raise ValueError(f"{self.__name__}(): argument {name} (position {k}) is an sf.Array on {a.mesh}, but "
                                 f"the function is compiled for {self.mesh}: place it on that mesh (sf.distribute, "
                                 "sf.shard(x, ..., mesh=)), or jit the function on its mesh")

    def _argument_error(self, args, error):
        """`error` (array_info's, for one of args) naming the parameter it is about."""
        names = list(inspect.signature(self.fn).parameters)
        names += [f"#{k}" for k in range(len(names), len(args))]
        for k, a in enumerate(args):
            try:
                isinstance(a, Array) or array_info(a)
            except type(error):
                return type(error)(f"{self.__name__}(): argument {names[k]} (position {k}): {error}")
        return error

    def positional(self, args, kwargs) -> tuple:
        """Arrays given by keyword, bound as Python binds them, as the positional arguments the
        plan takes (its inputs are the leading parameters given; later ones keep their defaults)."""
        try:
            bound = inspect.signature(self.fn).bind_partial(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.__name__}(): {e}") from None
        params = inspect.signature(self.fn).parameters
        extra = [n for n in bound.arguments if params[n].kind in (params[n].KEYWORD_ONLY, params[n].VAR_KEYWORD)]
        if extra:
            raise TypeError(f"{self.__name__}(): {', '.join(extra)} given, but a keyword-only (or **) parameter is no "
                            "traced input: sf.jit traces the arrays of the leading parameters; fix other values "
                            f"before jitting, e.g. sf.jit(functools.partial({self.__name__}, {extra[0]}=...), mesh=...)")
        names = list(params)
        given = [n for n in names if n in bound.arguments]
        if given != names[:len(given)]:
            skipped = [n for n in names[:names.index(given[-1])] if n not in bound.arguments]
            raise TypeError(f"{self.__name__}(): {', '.join(skipped)} not given, but a later parameter is: the traced "
                            "inputs are the leading parameters (a skipped one would keep a Python default in "
                            "the middle of them)")
        return tuple(bound.arguments[n] for n in given)

    def _inline(self, args, kwargs, stream):
        """fn traced into the program of its traced arguments (a jitted function called inside
        another): the arguments go to fn as they are; Python values stay constants."""
        builders = {a.builder for a in tree.leaves((args, kwargs)) if isinstance(a, Traced)}  # (pytrees too)
        name = self.__name__
        if len(builders) != 1:
            raise TypeError(f"{name}(): traced arguments of {len(builders)} different sf.jit functions")
        builder = builders.pop()
        if stream is not None:
            raise TypeError(f"{name}(): stream= is for calls on arrays; inside a traced function the caller's "
                            "plan decides the streams")
        if builder.mesh != self.mesh:
            raise ValueError(f"{name} is compiled for {self.mesh}, but is called inside a function traced for "
                             f"{builder.mesh}: inlining needs the same mesh")
        args = tuple(builder.constant(a) for a in args)  # NumPy arrays: constants of the caller's program
        kwargs = {k: builder.constant(a) for k, a in kwargs.items()}
        for k, a in enumerate(list(args) + list(kwargs.values())):
            if isinstance(a, Traced):
                continue
            if isinstance(a, Array) or hasattr(a, "__array__") or hasattr(a, "__dlpack__") \
                    or hasattr(a, "__cuda_array_interface__"):
                raise TypeError(f"{name}() called inside a traced function on a {type(a).__name__}: such arrays are "
                                "not captured as constants (NumPy arrays and sf.Arrays are); make it an input of the outer "
                                "sf.jit function")
        return self.fn(*args, **kwargs)


@overload
def jit(fn: Callable, *, mesh: DeviceMesh | None = None, streams: int = 4, graph: bool = False,
        max_plans: int = MAX_PLANS, rates: Rates | str | None = None, donate_argnums=(), static_argnums=(),
        static_argnames=(), donate_argnames=(), in_shardings=None, out_shardings=None) -> Jitted: ...


@overload
def jit(fn: None = None, *, mesh: DeviceMesh | None = None, streams: int = 4, graph: bool = False,
        max_plans: int = MAX_PLANS, rates: Rates | str | None = None, donate_argnums=(), static_argnums=(),
        static_argnames=(), donate_argnames=(), in_shardings=None,
        out_shardings=None) -> Callable[[Callable], Jitted]: ...


def jit(fn: Callable | None = None, *, mesh: DeviceMesh | None = None, streams: int = 4, graph: bool = False,
        max_plans: int = MAX_PLANS, rates: Rates | str | None = None, donate_argnums=(), static_argnums=(),
        static_argnames=(), donate_argnames=(), in_shardings=None,
        out_shardings=None) -> Jitted | Callable[[Callable], Jitted]:
    """Compile `fn` for `mesh`: ``@sf.jit(mesh=mesh, streams=4)``.  `max_plans`: how many compiled
    plans (one per input shapes, dtypes and layouts) it keeps, the least recently used dropped.
    `rates`: what sf.stream(chunks="auto") and plan.explain() predict with (a cost.Rates, or
    "h200" / "numpy/cpu"); default the cache `shardfuse calibrate` wrote, else built-in defaults.
    `donate_argnums`: arguments (an int or a tuple; for a pytree argument, all its leaves) whose
    buffers results may take, as JAX's: `new_w = w - lr * g` written into w's buffer (the plan
    prints it), and a donated sf.Array raises on any later use.  A result takes a donated buffer
    only where the plan has read it already; otherwise it gets its own, and no result ever
    aliases an argument that was not donated; `donate_argnames` names them instead (JAX's, the two
    may be combined).  `static_argnums` / `static_argnames`: parameters
    that are Python values (hashable), as JAX's: each set of their values compiles its own plans.
    `in_shardings` / `out_shardings`: where the arguments and results live (jit_shardings.constrained)."""
    if fn is None:
        return lambda f: jit(f, mesh=mesh, streams=streams, graph=graph, max_plans=max_plans, rates=rates,
                             donate_argnums=donate_argnums, static_argnums=static_argnums, static_argnames=static_argnames,
                             donate_argnames=donate_argnames, in_shardings=in_shardings, out_shardings=out_shardings)
    return Jitted(constrained(fn, mesh, in_shardings, out_shardings, static_argnums), mesh, streams, graph, max_plans,
                  rates, donate_argnums, static_argnums, static_argnames, donate_argnames)


