"""sf.grad, sf.value_and_grad, sf.vjp: JAX's API and semantics over shardfuse's programs.

Inside an sf.jit function they trace the differentiated function into the caller's program and
append its backward there (shardfuse.autodiff), so `sf.jit(sf.value_and_grad(loss))` is one plan
holding forward and backward.  Outside jit, on sf.Arrays or plain arrays, each is compiled with
sf.jit on the arrays' mesh (or the mesh of the jitted function it differentiates) and run, as
JAX runs grad eagerly.  Arguments and results are pytrees (a model's parameters as one dict).

Each gradient has its primal's layout: the layout the argument arrived in (a weight sharded S(1)
over tp gets a gradient S(1) over tp; a weight replicated over a data-parallel axis gets its
gradient summed over that axis), JAX's and DTensor's rule.

`remat=` chooses what the weight gradient of a streamed AllGather+GEMM reads: "regather" (the
default) gathers the forward's input again in the backward, Megatron's choice (less memory);
"keep" reads the input the forward gathered, kept chunk by chunk as its loop gathers it (one
Allgather fewer per gathered input, that input held from the forward to the backward), what a
`jax.checkpoint` policy that saves it does.
"""
from __future__ import annotations

import inspect
from collections import defaultdict

from shardfuse import tree
from shardfuse.array import Array
from shardfuse.autodiff import backward, check_remat, differentiable, full_like
from shardfuse.autodiff_layouts import pin, whole
from shardfuse.ir import TensorType
from shardfuse.jit import Jitted
from shardfuse.layout import Layout
from shardfuse.plan_cache import PlanCache
from shardfuse.ops import Op
from shardfuse.traced import Traced, describe

P = inspect.Parameter


def _traced_leaves(args) -> list:
    return [x for x in tree.leaves(args) if isinstance(x, Traced)]


def _mesh_options(fn, args, what: str) -> tuple:
    """(mesh, streams, graph) to compile with outside jit: the jitted function's, else the mesh
    of the sf.Arrays among the arguments."""
    if isinstance(fn, Jitted):
        return fn.mesh, fn.streams, fn.graph
    meshes = {a.mesh for a in tree.leaves(args) if isinstance(a, Array)}
    if len(meshes) > 1 and len({m.root for m in meshes}) == 1:  # (pipeline stages' arrays: their whole mesh, a probe)
        meshes = {next(iter(meshes)).root}
    if len(meshes) != 1:
        raise ValueError(f"{what} outside sf.jit compiles for the mesh of its sf.Array arguments, and "
                         f"{'none is an sf.Array' if not meshes else f'they are on {len(meshes)} meshes'}: pass "
                         f"sf.Arrays of one mesh, or write sf.jit({what}(f), mesh=mesh)")
    return meshes.pop(), 4, False


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _signature(fn):
    return inspect.signature(fn.fn if isinstance(fn, Jitted) else fn)


class _Forward:
    """A traced call of fn on primals made fresh values, its instructions kept for the backward."""

    def __init__(self, fn, primals: tuple, wrt: list, what: str, has_aux: bool, remat: str = "regather",
                 origins: list | None = None, kwargs: dict | None = None):
        self.remat = remat
        kwargs = kwargs or {}
        self.builder = wrt[0].builder if wrt else _traced_leaves((primals, kwargs))[0].builder
        self.wrt, self.origins = wrt, origins or wrt
        self.builder.fresh.update(x.value for x in wrt)
        start = len(self.builder.instrs)
        out = fn(*primals, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"{what}(has_aux=True): {_name(fn)} must return a pair (output, aux), got "
                                f"{type(out).__name__}")
            out, self.aux = out
        self.out = out
        self.instrs = list(self.builder.instrs[start:])

    def cotangents(self, outs: list, cts: list) -> list:
        """The cotangent of each primal in wrt, in its input's layout (zeros where none reaches it)."""
        grads = backward(self.builder, self.instrs, [x.value for x in self.wrt], [o.value for o in outs], cts,
                         self.remat)
        readers = defaultdict(list)  # (value -> the forward's instructions reading it: once for every primal)
        for i in self.instrs:
            for v in i.ins:
                readers[v].append(i)
        res = []
        for x, orig, g in zip(self.wrt, self.origins, grads):
            g = full_like(x, 0.0) if g is None else g
            lay = self._layout_of(orig, x, readers) if self.builder.producer.get(orig.value) is None else None
            res.append(g if lay is None else pin(g, lay, "d" + orig.value.name))
        return res

    def _layout_of(self, orig, x, readers):
        """The layout of a program input's gradient: the layout it arrived in (an sf.Array's); for
        a plain array, the one the function states for it where every use is the same annotation,
        of it or of a cast of it (a weight sharded by the function keeps that sharding), else
        replicated, as JAX places a NumPy argument (so an update step returns each parameter in the
        layout it came in)."""
        if orig.value.type.layout is not None:
            return whole(orig.value.type.layout)
        # (through casts, as fold_annotations places the input: a float32 master weight's bfloat16 copy
        # sharded over tp keeps the weight so)
        # (and through the layers w[k] of a stacked weight, sf.lax.scan's reads: their annotations, the
        # leading axis whole, as fold_annotations places the stack)
        uses, todo = [], [(i, 0) for i in readers[x.value]]
        while todo:
            i, lead = todo.pop()
            if i.op == Op.ASTYPE:
                todo += [(j, lead) for j in readers[i.outs[0]]]
            elif _a_layer(i, readers):
                todo += [(j, lead + 1) for r in readers[i.outs[0]] for j in readers[r.outs[0]]]
            else:
                uses.append((i, lead))
        # (an annotation read by none is a step of composed ones, sf.shard(sf.shard(w, 0, "dp"), 1, "tp"): each
        # annotates w itself, the last with the whole layout, a probe: the gradient came back replicated)
        returned = {t.value for t in _traced_leaves(self.out)}
        live = [(i, lead) for i, lead in uses if not (i.op == Op.SET and i.attrs.get("annotation") and
                                                      not readers[i.outs[0]] and i.outs[0] not in returned)]
        uses = live or uses
        stated = {(None,) * lead + i.outs[0].type.layout.axes for i, lead in uses
                  if i.op == Op.SET and i.attrs.get("annotation")}
        if len(stated) == 1 and all(i.op == Op.SET and not i.outs[0].type.layout.partial for i, _ in uses):
            return Layout(stated.pop(), mesh=next(iter(uses))[0].outs[0].type.layout.mesh)
        return Layout.replicated(orig.ndim).on(self.builder.mesh)


def _a_layer(i, readers) -> bool:
    """i slices one layer w[k] off a stack (extent 1 along axis 0), read only by reshapes dropping that axis."""
    shape = i.outs[0].type.shape if i.op == Op.SLICE_ARRAY else None
    return (shape is not None and shape[:1] == (1,) and shape[1:] == i.ins[0].type.shape[1:] and
            all(r.op == Op.RESHAPE and r.outs[0].type.shape == shape[1:] for r in readers[i.outs[0]]))


def _fresh(x: Traced) -> Traced:
    """A primal as a value of its own (a view), as JAX's new tracer: inside a traced function the
    differentiated function's uses of the primal are told from uses of the same array it closes
    over (grad of lambda z: x * z at z = x is x, not 2x)."""
    return x.builder.emit(Op.RESHAPE, (x,), TensorType(x.shape, x.dtype_name), x.value.name, shape=x.shape, primal=True)


def _check_primals(leaves, what, where):
    for x in leaves:
        if not isinstance(x, Traced):
            raise TypeError(f"{what}: {where} holds a {type(x).__name__}; gradients are taken with respect to arrays "
                            "(pass it as an array, or leave it out of argnums)")
        if not differentiable(x.dtype_name):
            raise TypeError(f"{what}: {where} is {describe(x)} of dtype {x.dtype_name}: gradients are taken with "
                            "respect to float arrays only (as JAX's); leave integer and boolean arguments out of argnums")


class _Grad:
    """sf.grad / sf.value_and_grad of fn."""

    def __init__(self, fn, argnums, has_aux, with_value, remat):
        self.what = "sf.value_and_grad" if with_value else "sf.grad"
        check_remat(remat, self.what)
        if not callable(fn):
            raise TypeError(f"sf.grad differentiates a function, got {type(fn).__name__}")
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        if not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
            raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
        self.fn, self.argnums, self.nums, self.has_aux, self.with_value = fn, argnums, nums, has_aux, with_value
        self.remat = remat
        self.__name__ = f"{'value_and_grad' if with_value else 'grad'}_{_name(fn)}"
        self.fn_signature = _signature(fn)
        self.__signature__ = _positional_up_to(self.fn_signature, max(nums))
        self._compiled = PlanCache(64)  # (mesh, streams, graph[, keyword names and values]) -> the sf.jit of this

    def __repr__(self):
        return f"{self.what}({_name(self.fn)}, argnums={self.argnums!r})"

    def __call__(self, *args, **kwargs):
        """fn's gradient at these arguments: those at argnums differentiated, keyword arguments
        passed to fn as they are and never differentiated (JAX's rule)."""
        self._check_call(args, kwargs)
        if _traced_leaves((args, kwargs)):
            return self._traced(args, kwargs)
        key = _mesh_options(self.fn, (args, kwargs), self.what)
        if not kwargs:
            return self._compiled.get(key, lambda: Jitted(self, *key))(*args)
        arrays = [k for k, v in kwargs.items() if not _python_value(v)]
        fixed = tuple((k, type(v), v) for k, v in kwargs.items() if k not in arrays)
        jitted = self._compiled.get(key + (len(args), tuple(arrays), fixed),
                                    lambda: Jitted(Keywords(self, len(args), arrays, fixed), *key))
        return jitted(*args, *(kwargs[k] for k in arrays))

    def _check_call(self, args, kwargs):
        """Python's binding of fn's arguments, and JAX's rule that argnums index the positional
        arguments given (a parameter in argnums given by keyword is refused, never differentiated)."""
        try:
            self.fn_signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.__name__}(): {e}") from None
        n = len(args)
        if all(-n <= k < n for k in self.nums):
            return
        params = [p for p in self.fn_signature.parameters.values()
                  if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        named = [params[k].name for k in self.nums if 0 <= k < len(params) and params[k].name in kwargs]
        hint = (f"; {', '.join(named)} given by keyword: pass {'it' if len(named) == 1 else 'them'} positionally"
                if named else "")
        least = max(k if k >= 0 else -k - 1 for k in self.nums) + 1
        raise TypeError(f"{self.what}(argnums={self.argnums!r}) of {_name(self.fn)}: differentiating with respect to "
                        f"argnums={self.argnums!r} requires at least {least} positional arguments to be passed by the "
                        f"caller, but got only {n} (as JAX's: argnums index positional arguments, keyword arguments "
                        f"are never differentiated){hint}")

    def _nested(self, leaves) -> bool:
        """Whether this gradient is taken inside a traced function (whose code may hold the primals
        too), not as the function sf.jit traces (whose primals nothing else holds)."""
        entry = leaves[0].builder.entry if leaves else None
        return bool(leaves) and entry is not self and not (isinstance(entry, Keywords) and entry.grad is self)

    def _traced(self, args, kwargs):
        trees = [tree.flatten(args[k]) for k in self.nums]
        wrt, origins, args = [], [], list(args)
        for k, (leaves, td) in zip(self.nums, trees):
            _check_primals(leaves, self.what, f"argument {k}")
            fresh = [_fresh(x) for x in leaves] if self._nested(leaves) else leaves
            wrt, origins, args[k] = wrt + fresh, origins + leaves, td.unflatten(fresh)
        fwd = _Forward(self.fn, tuple(args), wrt, self.what, self.has_aux, self.remat, origins, kwargs)
        out = fwd.out
        if not isinstance(out, Traced) or out.shape != () or not differentiable(out.dtype_name):
            got = describe(out) if isinstance(out, Traced) else type(out).__name__
            raise TypeError(f"{self.what}: {_name(self.fn)} must return a float scalar (shape ()), got {got}; for "
                            "other outputs use sf.vjp")
        grads = iter(fwd.cotangents([out], [full_like(out, 1.0)]))
        per_arg = [td.unflatten([next(grads) for _ in leaves]) for leaves, td in trees]
        g = per_arg[0] if isinstance(self.argnums, int) else tuple(per_arg)
        value = (out, fwd.aux) if self.has_aux else out
        if self.with_value:
            return value, g
        return (g, fwd.aux) if self.has_aux else g


def _positional_up_to(sig, last: int):
    """sig with its parameters up to position `last` positional-only: a gradient function takes the
    arguments it differentiates positionally (so sf.jit binding keywords refuses them, as JAX does)."""
    params = list(sig.parameters.values())
    if last < 0 or any(p.kind == P.VAR_POSITIONAL for p in params[:last + 1]):
        return sig
    head = [p.replace(kind=P.POSITIONAL_ONLY) if p.kind == P.POSITIONAL_OR_KEYWORD else p for p in params[:last + 1]]
    return sig.replace(parameters=head + params[last + 1:])


def _python_value(v) -> bool:
    """Whether a keyword argument is a Python value (a Python number, string, None, or a tuple of them),
    which eager sf.grad fixes into the function it compiles, as JAX's eager grad sees it: a head
    count or `causal=True` stays a Python value (one plan per value)."""
    try:
        hash(v)
    except TypeError:
        return False
    return all(x is None or type(x) in (bool, int, float, complex, str) for x in tree.leaves(v))  # (NumPy's: arrays)


class Keywords:
    """A gradient function called outside jit with keyword arguments, as the function of positional
    arguments that sf.jit compiles: the keyword arguments that are arrays follow the positional
    ones as inputs (never differentiated), the Python values are fixed."""

    def __init__(self, grad: _Grad, nargs: int, arrays: list, fixed: tuple):
        self.grad, self.nargs, self.arrays, self.fixed = grad, nargs, list(arrays), {k: v for k, _, v in fixed}
        params = [p for p in grad.fn_signature.parameters.values() if p.kind in (P.POSITIONAL_ONLY,
                                                                                  P.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in params[:nargs]] + [f"arg{k}" for k in range(len(params), nargs)]
        self.__name__ = grad.__name__
        self.__signature__ = inspect.Signature([P(n, P.POSITIONAL_ONLY) for n in names + self.arrays])

    def __call__(self, *flat):
        args, arrays = flat[:self.nargs], flat[self.nargs:]
        return self.grad(*args, **dict(zip(self.arrays, arrays)), **self.fixed)


def grad(fn, argnums=0, has_aux=False, remat="regather"):
    """The gradient of fn (which returns a float scalar) with respect to argument `argnums` (an
    int, or a tuple of them: a tuple of gradients), as jax.grad: a function of fn's arguments
    returning gradients with the arguments' structure and layouts.  has_aux=True: fn returns
    (loss, aux) and the result is (gradient, aux).  remat="regather" (default): a streamed
    AllGather+GEMM's weight gradient gathers its input again; "keep": it reads the input the
    forward gathered (one Allgather fewer, more memory held; the module docstring)."""
    return _Grad(fn, argnums, has_aux, with_value=False, remat=remat)


def value_and_grad(fn, argnums=0, has_aux=False, remat="regather"):
    """(fn's value, its gradient), as jax.value_and_grad: one forward, one backward; remat as sf.grad's."""
    return _Grad(fn, argnums, has_aux, with_value=True, remat=remat)


def vjp(fn, *primals, has_aux=False, remat="regather"):
    """(fn(*primals), vjp_fn), as jax.vjp: vjp_fn(cotangent), the cotangent with the structure of
    fn's output, returns a tuple with a cotangent per primal (None for an integer or boolean one,
    where JAX gives float0 zeros).  Inside sf.jit the backward is
    appended to the program; outside, vjp_fn runs a plan that computes the forward again (the
    primals are kept, never the activations).  remat as sf.grad's (outside jit: in the pullback's
    plan, which computes the forward again)."""
    check_remat(remat, "sf.vjp")
    if _traced_leaves(primals):
        return _vjp_traced(fn, primals, has_aux, remat)
    key = _mesh_options(fn, primals, "sf.vjp")
    fwd, pullback = _compiled_vjp(fn, has_aux, key, remat)
    out = fwd(*primals)

    def vjp_fn(cotangent):
        grads = pullback(primals, cotangent)
        return grads if isinstance(grads, tuple) else (grads,)
    return (out[0], vjp_fn, out[1]) if has_aux else (out, vjp_fn)


# (fn, has_aux, remat, (mesh, options)) -> (forward, pullback), jitted.  Bounded, not weakly keyed by
# fn: the pair holds fn (and the mesh), so a WeakKeyDictionary's entry would keep its key alive for ever.
VJP_PLANS = PlanCache(64)


def _compiled_vjp(fn, has_aux, key, remat):
    """(fn's forward, its pullback) as sf.jit functions, made once per function and mesh (their
    plans once per input specs), so sf.vjp in a loop compiles nothing after its first call."""
    return VJP_PLANS.get((fn, has_aux, remat, key), lambda: (fn if isinstance(fn, Jitted) else Jitted(fn, *key),
                                                              Jitted(Pullback(fn, has_aux, remat), *key)))


def _vjp_traced(fn, primals, has_aux, remat="regather", nested=True):
    leaves, in_tree = tree.flatten(primals)
    for x in leaves:
        if not isinstance(x, Traced):
            raise TypeError(f"sf.vjp: a primal is a {type(x).__name__}; it takes arrays (and pytrees of them)")
    origins = [x for x in leaves if differentiable(x.dtype_name)]  # (integer and boolean primals: cotangent None)
    fresh = {id(x): _fresh(x) if nested else x for x in origins}
    wrt = [fresh[id(x)] for x in origins]
    primals = in_tree.unflatten([fresh.get(id(x), x) for x in leaves])
    fwd = _Forward(fn, primals, wrt, "sf.vjp", has_aux, remat, origins)
    out_leaves, out_tree = tree.flatten(fwd.out)

    def vjp_fn(cotangent):
        cts, ct_tree = tree.flatten(cotangent)
        if ct_tree != out_tree:
            raise ValueError(f"vjp_fn: the cotangent must have the structure of {_name(fn)}'s output {out_tree}, "
                             f"got {ct_tree}")
        cts = [o.builder.constant(c) if isinstance(o, Traced) else c for o, c in zip(out_leaves, cts)]  # (NumPy: JAX's)
        for o, c in zip(out_leaves, cts):
            if not isinstance(c, Traced) or c.shape != o.shape or c.dtype_name != o.dtype_name:
                got = describe(c) if isinstance(c, Traced) else type(c).__name__
                raise ValueError(f"vjp_fn: the cotangent of {describe(o)} must be an array of shape {o.shape} and "
                                 f"dtype {o.dtype_name}, got {got}")
        grads = iter(fwd.cotangents(out_leaves, cts))
        return tuple(in_tree.unflatten([next(grads) if differentiable(x.dtype_name) else None for x in leaves]))
    return (fwd.out, vjp_fn, fwd.aux) if has_aux else (fwd.out, vjp_fn)


class Pullback:
    """(primals, cotangent) -> vjp_fn(cotangent): what sf.vjp's vjp_fn compiles outside jit.  `keep`: per
    leaf of the primals, whether its cotangent is wanted (None where it is not: the plan never computes
    it; the torch bridge's NumPy masks and numbers, a README probe)."""

    def __init__(self, fn, has_aux, remat="regather", keep=None):
        self.fn, self.has_aux, self.remat, self.keep = fn, has_aux, remat, keep
        self.__name__ = f"vjp_{_name(fn)}"

    def __call__(self, primals, cotangent):
        res = _vjp_traced(self.fn, tuple(primals), self.has_aux, self.remat, nested=False)[1](cotangent)
        if self.keep is None:
            return res
        leaves, td = tree.flatten(res, is_leaf=lambda g: g is None)
        return td.unflatten([g if k else None for g, k in zip(leaves, self.keep)])


def eval_shape(fn, *args, mesh=None, **kwargs):
    """jax.eval_shape: the sf.TensorSpec (shape, dtype, layout) of each of fn's results for these
    arguments (arrays, sf.Arrays, sf.TensorSpecs or (shape, dtype) tuples, pytrees of them), in the
    result's structure, from the compiled plan: nothing runs.  mesh: the mesh fn's annotations name
    (default: a jitted fn's own, else one NumPy device)."""
    from shardfuse.mesh import DeviceMesh

    if isinstance(fn, Jitted) and mesh in (None, fn.mesh):  # (its own plan: its mesh, static arguments, shardings)
        return fn.lower(*args, **kwargs).output_specs
    return Jitted(fn, mesh or DeviceMesh(1, backend="numpy")).lower(*args, **kwargs).output_specs
