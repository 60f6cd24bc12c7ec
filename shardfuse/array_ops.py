"""Operations on sf.Array outside sf.jit, as on a jax.Array or a DTensor: ``x + y``, ``2 * x``,
``-x``, ``abs(x)``, ``x @ w``, ``x ** 2``, ``x < y`` (and ``==``: elementwise, as JAX's), ``np.exp(x)``,
``np.sqrt(x)``, ``sf.where(c, x, y)``, ``x.astype(dtype)``, ``x.sum / mean / max / min / var / std /
argmax / argmin(axis, keepdims=)``, ``x.clip(lo, hi)``, ``x // y``, ``x % y``, ``len(x)``, ``x[i]``, ``x[a:b]``, ``x[..., j]``.

Each op runs as a one-op plan: the op traced on the array's mesh exactly as sf.jit traces it,
compiled once per op, scalar and input specs (shapes, dtypes, layouts), and kept on the mesh (the
least recently used of MAX_PLANS dropped).  So the collectives are those the op issues inside
sf.jit, and a result has the layout sharding propagation gives it there: ``x + y`` of two S(0)
arrays is S(0) with no communication; ``a @ b`` contracting a sharded axis is all-reduced to a
replicated result.  Plain arrays (NumPy, CuPy, torch) beside an sf.Array are replicated global
values, as in a call of a jitted function.  Every op is one plan call: a loop of many small ops
runs faster as one sf.jit function.  Under mpiexec every op is collective.  NumPy's functions
that shardfuse has (np.transpose, np.reshape, np.ones_like, ...) are such ops too; any other is
refused (a TypeError), never run on a silently gathered copy: np.asarray(x) gathers explicitly.
"""
from __future__ import annotations

import math
import operator
import threading

import numpy as np

from shardfuse import constants, trace
from shardfuse.executor import Executable
from shardfuse.interop import array_info
from shardfuse.ir import TensorType
from shardfuse.layout import Layout
from shardfuse.numpy_methods import NumpyMethods, c_order, cast_to
from shardfuse.ops import Op
from shardfuse.passes import compile_program
from shardfuse.plan_cache import PlanCache
from shardfuse.stage_arrays import on_root
from shardfuse.spec import TensorSpec, check_divides, reduced_axes
from shardfuse.traced import NUMPY, SHAPE_OPS, Traced, is_weak_scalar, numpy_name
from shardfuse.shape_ops import array_getitem, expand_index, getitem as shape_getitem
from shardfuse.traced_numpy import absolute
from shardfuse.update_slice import int_getitem

MAX_PLANS = 256  # one-op plans kept per mesh (a plan holds its buffers)
STATS = {"compiled": 0, "reused": 0}  # across meshes (every mesh's PlanCache counts here): cache_info()
_LOCK = threading.Lock()  # every mesh's cache, shared by threads (each plan call takes its own lock)


def cache_info() -> dict:
    """How many one-op plans were compiled and how many calls reused one (like functools')."""
    return dict(STATS, max_plans=MAX_PLANS)


def cached_programs(mesh) -> list:
    """The one-op plans kept for `mesh` (programs, least recently used first)."""
    plans = mesh.op_plan_cache
    if plans is None:
        return []
    return [exe.prog for exe in plans.snapshot().values()]


def _plans_of(mesh) -> PlanCache:
    """The one-op plans of `mesh`: a PlanCache this module makes and alone fills, kept in the mesh object's
    declared `op_plan_cache`, not in a table here weakly keyed by the mesh (a plan reaches its mesh, and a
    weak key's value that reaches it keeps it alive for ever: mesh.py says why; test_architecture's test_9)."""
    with _LOCK:
        plans = mesh.op_plan_cache
        if plans is None:
            plans = mesh.op_plan_cache = PlanCache(MAX_PLANS, _LOCK, stats=STATS)
        return plans


def run(fn, args: tuple, key, name: str):
    """fn(*args) as a one-op plan on the mesh of the sf.Arrays among args (plain arrays:
    replicated inputs), compiled once per key and input specs; the result an sf.Array.  Inside a
    traced function, traced into it instead: the sf.Arrays are its constants (shardfuse.constants)."""
    builder = constants.active()
    if builder is not None:
        return fn(*(builder.constant(a) for a in args))
    arrays = [a for a in args if isinstance(a, ArrayOps)]
    root = next((b.mesh for b in arrays if b.mesh.is_root and b.mesh.nprocs == 1), None)
    if root is not None and any(b.mesh != root and b.mesh.root is root for b in arrays):  # (a stage's array beside
        args = tuple(on_root(a, root) for a in args)  # the whole mesh's: as the whole mesh's, living on the stage)
        arrays = [a for a in args if isinstance(a, ArrayOps)]
    mesh = arrays[0].mesh
    for b in arrays[1:]:
        if b.mesh != mesh:
            raise ValueError(f"{name}: the operands live on different meshes, {mesh} and {b.mesh}; place both on "
                             "one mesh (sf.distribute), or move one inside sf.jit with sf.to_mesh")
    if mesh.nprocs > 1 and not mesh.is_root:  # (every rank alike, before any communication)
        raise NotImplementedError(f"{name} of an sf.Array placed on the sub-mesh {mesh} under MPI: operations outside "
                                  "sf.jit run on whole meshes there; jit on the whole mesh and place the value on the "
                                  "sub-mesh inside it (sf.to_mesh, or sf.shard / sf.replicate with mesh=)")
    specs = tuple(a.spec if isinstance(a, ArrayOps) else TensorSpec(*_shape_dtype(a), weak=type(a) is float)
                  for a in args)  # (a Python float passed as an operand: weak, as sf.jit's argument)
    exe = _plans_of(mesh).get((key, specs), lambda: Executable(
        compile_program(trace.trace(fn, mesh, specs, streams=1, name=name))))
    ((lay, shards, whole),) = exe(*args, *exe.prog.constants)  # (constants: made from shapes alone, as np.arange(n))
    v = exe.prog.outputs[0]
    out = type(arrays[0])(mesh, v.type.shape, v.type.dtype, lay, shards, whole)
    out.weak = bool(exe.prog.weak_outputs)  # (a weak 0-d value's op with a Python scalar stays weak, as inside jit)
    return out


def _shape_dtype(a) -> tuple:
    info = array_info(a)
    return info.shape, info.dtype


def reshard(x, layout: Layout):
    """x with `layout` on its mesh (redistribute, full_array, indexing): a one-op `set`."""
    for ax, over in layout.sharded_axes().items():
        check_divides(x.shape, ax, over, layout.home(x.mesh))  # (the reshard table's own refusal says less)

    def redistribute(v):
        lay = layout.on(layout.home(v.builder.mesh))  # (an sf.Array's layout, on the mesh it names)
        return v.builder.emit(Op.SET, (v,), TensorType(v.shape, v.dtype_name, lay), v.value.name, annotation=True)

    return run(redistribute, (x,), (Op.SET, layout), "redistribute")


def _is_operand(a) -> bool:  # (a NumPy scalar is static, as a Python one: np.prod(x.shape) an extent, a probe)
    return isinstance(a, ArrayOps) or not isinstance(a, np.generic) and any(
        hasattr(a, k) for k in ("__array__", "__dlpack__", "__cuda_array_interface__"))


def constant_key(c):
    """A constant baked into a one-op plan, as a key: floats by their bits (-0.0 and 0.0 compare equal
    but are other plans; NaN, unequal to itself, would never find its plan), anything else as it is."""
    if isinstance(c, (list, tuple)):  # (x.reshape([4, 2]): a list keys as a tuple, type kept, a probe)
        return type(c).__name__, tuple(constant_key(v) for v in c)
    return float(c).hex() if isinstance(c, (float, np.floating)) else c


BAKED_FLOATS = 4  # distinct Python floats baked into one op's plans before it takes them as an operand


def _varies(fn, side, x, c) -> bool:
    """Whether the float c (Python's, or NumPy's: eager Adam's bias corrections, a probe) beside sf.Array x at fn's
    operand `side` is one of more than BAKED_FLOATS values met there: then a 0-d operand, one plan for every value."""
    if not isinstance(c, (float, np.floating)) or fn not in (operator.add, operator.sub, operator.mul, operator.truediv):
        return False
    seen = _plans_of(x.mesh).scalars
    met = seen.setdefault((fn, side, x.spec), set())
    if len(met) <= BAKED_FLOATS:
        met.add(constant_key(c))
    if len(seen) > MAX_PLANS:  # (bounded as the plans are)
        seen.clear()
    return len(met) > BAKED_FLOATS


def binary(fn, a, b):
    """fn(a, b) (an operator), one operand an sf.Array; the other an sf.Array, a plain array or a scalar
    (baked into the plan, as inside sf.jit; a Python float that keeps changing at + - * /: an operand)."""
    name = fn.__name__
    if is_weak_scalar(b) and fn is not operator.matmul:  # (keyed with its type: 1, 1.0 and True differ)
        if _varies(fn, 1, a, b):  # (a NumPy scalar as a 0-d array: strong, as NumPy 2 takes it)
            return run(lambda x, s: fn(x, s), (a, np.asarray(b) if isinstance(b, np.generic) else b), (fn, 1, "operand"), name)
        return run(lambda x: fn(x, b), (a,), (fn, 1, type(b).__name__, constant_key(b)), name)
    if is_weak_scalar(a) and fn is not operator.matmul:
        if _varies(fn, 0, b, a):
            return run(lambda s, x: fn(s, x), (np.asarray(a) if isinstance(a, np.generic) else a, b), (fn, 0, "operand"), name)
        return run(lambda x: fn(a, x), (b,), (fn, 0, type(a).__name__, constant_key(a)), name)
    if not (_is_operand(a) and _is_operand(b)):
        return NotImplemented
    # a plain array beside an sf.Array on a sub-mesh is replicated on that sub-mesh, not the whole
    sub = next((v.sharding.mesh for v in (a, b) if isinstance(v, ArrayOps) and v.sharding.mesh), None)
    if sub is not None and not (isinstance(a, ArrayOps) and isinstance(b, ArrayOps)):
        plain = 1 if isinstance(a, ArrayOps) else 0  # which operand is the plain array

        def on_sub(x, y):
            if plain == 1:
                y = trace.replicate(y, mesh=sub)
            else:
                x = trace.replicate(x, mesh=sub)
            return fn(x, y)
        return run(on_sub, (a, b), (fn, "on_sub_mesh", plain), name)
    return run(lambda x, y: fn(x, y), (a, b), (fn,), name)


def unary(fn, x):
    return run(lambda v: fn(v), (x,), (fn,), fn.__name__)


def apply(fn, args, name):
    """fn(*args) as a one-op plan (sf.where, sf.sqrt, ... on sf.Arrays): sf.Arrays and plain arrays
    among args are its inputs; anything else (scalars, dtypes, axes) is baked in, and keyed."""
    pos = [k for k, a in enumerate(args) if _is_operand(a)]
    consts = tuple((k, type(a).__name__, constant_key(a)) for k, a in enumerate(args) if k not in pos)

    def traced(*values):
        full = list(args)
        for k, v in zip(pos, values):
            full[k] = v
        return fn(*full)
    return run(traced, tuple(args[k] for k in pos), (fn, tuple(pos), consts), name)


def _binary_methods(fn):
    return (lambda self, other: binary(fn, self, other)), (lambda self, other: binary(fn, other, self))


_REDUCTIONS = {np.sum: Traced.sum, np.mean: Traced.mean, np.max: Traced.max, np.amax: Traced.max, np.min: Traced.min,
               np.amin: Traced.min}


def reduce(x, axis, method, out, dtype=None, keepdims=False, where=None, initial=None, **rest):
    """x.sum / mean / max / min(axis, keepdims=) (method: Traced's), the traced reduction of each axis; sum,
    mean dtype= and where= (a mask, an operand of the plan), max, min initial= and where=, as NumPy's."""
    what, summed = method.__name__, method in (Traced.sum, Traced.mean)
    bad = [*rest, *["out"] * (out is not None), *["dtype"] * (not summed and dtype is not None),
           *["initial"] * (method is Traced.mean and initial is not None)]  # (NumPy's max takes no dtype=)
    if bad:
        raise TypeError(f"sf.Array.{what} with {', '.join(k + '=' for k in bad)} is not supported (a new sf.Array)")
    axes = tuple(sorted(reduced_axes(axis, x.ndim, x.shape)))  # (one plan per set of axes)
    keepdims, dt = bool(keepdims), None if dtype is None else np.dtype(dtype).name
    extra = {**({} if dt is None else {"dtype": dt}), **({} if initial is None else {"initial": initial})}

    def reduction(v, *mask):  # (a mean of means: each scaled before it is rounded)
        return method(v, axes, keepdims=keepdims, **extra, **({"where": mask[0]} if mask else {}))

    args = (x,) if where is None else (x, where)
    key = (Op.SUM, axes, what, keepdims, dt, where is not None, None if initial is None else repr(initial))  # (NaN equal to NaN)
    return run(reduction, args, key, what)


_on_host = lambda a: np.asarray(a) if isinstance(a, ArrayOps) else a  # noqa: E731
_HOST = (np.allclose, np.array_equal, np.array_equiv, np.isclose)  # (a test's comparisons, as of jax.Arrays: a probe)


def host_or_refused(func, args, kwargs):
    """np.allclose / array_equal / array_equiv / isclose of sf.Arrays on their host copies (np.asarray: collective
    under mpiexec); any other NumPy function shardfuse lacks refused, saying what to write."""
    if func in _HOST:  # (keywords too: an sf.Array there sent NumPy back here, a review)
        return func(*map(_on_host, args), **{k: _on_host(a) for k, a in kwargs.items()})
    name = numpy_name(func)
    raise TypeError(f"{name} is not supported on sf.Arrays: shardfuse runs the NumPy functions it has as sharded ops "
                    "(np.where, np.sum, np.einsum, np.take, ...: the README's list) and never gathers silently; for "
                    f"NumPy's result on the global value write {name}(np.asarray(x), ...) (a host copy on every "
                    "process: collective under mpiexec)")


def _hashable(key):
    """An index as a cache key (a slice is unhashable before Python 3.12)."""
    key = key if isinstance(key, tuple) else (key,)
    return tuple((slice, k.start, k.stop, k.step) if isinstance(k, slice) else (type(k).__name__, k) for k in key)


def getitem(x, key):
    """x[key], as inside sf.jit (shape_ops.getitem) in a one-op plan (an integer array in the key,
    NumPy's or an sf.Array: sf.take's lookup along its axis).  Basic indexing: axes the key
    cuts are first made whole on every device (an Allgather where such an axis is sharded, printed
    in the plan), then each device takes its box (a view, copied into the result); axes the key
    leaves whole keep their sharding.  So ``x[..., j]`` of a row-sharded x stays row-sharded
    without communication, and ``x[i]`` or ``x[a:b]`` of it is gathered to a replicated result."""
    what = f"indexing an sf.Array of shape {x.shape}"
    got = array_getitem(x, key, what, getitem)  # (a NumPy or sf.Array of ids: np.take's lookup, as inside jit)
    if got is not None:
        return got
    plan = int_getitem(x, expand_index(key, x.shape, what))  # (refused before any plan; x[:, t]: one for every t)
    return plan if plan is not None else run(lambda v: shape_getitem(v, key), (x,), ("getitem", _hashable(key)), "getitem")


class ArrayOps(NumpyMethods):
    """The operators, NumPy ufuncs, reductions and indexing of sf.Array (see the module docstring);
    x.var / std / clip / argmax / argmin as on traced values (numpy_methods.py), each a one-op plan."""

    __slots__ = ()

    __add__, __radd__ = _binary_methods(operator.add)
    __sub__, __rsub__ = _binary_methods(operator.sub)
    __mul__, __rmul__ = _binary_methods(operator.mul)
    __truediv__, __rtruediv__ = _binary_methods(operator.truediv)
    __matmul__, __rmatmul__ = _binary_methods(operator.matmul)

    __pow__, __rpow__ = _binary_methods(operator.pow)
    __floordiv__, __rfloordiv__ = _binary_methods(operator.floordiv)
    __mod__, __rmod__ = _binary_methods(operator.mod)
    __and__, __rand__ = _binary_methods(operator.and_)  # (logical of booleans, bitwise of integers: logical.py)
    __or__, __ror__ = _binary_methods(operator.or_)
    __xor__, __rxor__ = _binary_methods(operator.xor)
    # comparisons: elementwise boolean sf.Arrays, as jax.Array's (c < x is x > c: Python reflects)
    __lt__, __le__ = _binary_methods(operator.lt)[0], _binary_methods(operator.le)[0]
    __gt__, __ge__ = _binary_methods(operator.gt)[0], _binary_methods(operator.ge)[0]
    __eq__, __ne__ = _binary_methods(operator.eq)[0], _binary_methods(operator.ne)[0]
    __hash__ = object.__hash__  # (still a dict key / set member by identity)

    def __invert__(self):
        return unary(operator.invert, self)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        """This array in another dtype (float16, bfloat16, float32, float64, int32, int64, bool): a
        local cast on every device, the sharding kept (NumPy's casting= checked)."""
        return apply(Traced.astype, (self, cast_to(self.dtype.name, dtype, casting)), "x.astype")  # (one fn: one plan)

    def transpose(self, *axes):
        """The axes permuted (NumPy's x.transpose; no axes: reversed), the sharding moving with them:
        a view on every device, no communication."""
        return apply(Traced.transpose, (self, *axes), "x.transpose")

    T = property(lambda self: self.transpose())

    def swapaxes(self, axis1, axis2):
        return apply(Traced.swapaxes, (self, axis1, axis2), "x.swapaxes")

    def reshape(self, *shape, order="C"):
        """NumPy's x.reshape, as inside sf.jit (refused where it would cross a sharded axis's boundary)."""
        c_order("x.reshape", order)
        return apply(Traced.reshape, (self, *shape), "x.reshape")

    def one_op(self, fn, args, name):
        """fn(*args) as a one-op plan (sf.where, sf.sqrt, ... outside sf.jit): see apply."""
        return apply(fn, args, name)

    def __array_function__(self, func, types, args, kwargs):
        """NumPy's functions shardfuse has (the NUMPY table: np.where, np.sum, np.transpose,
        np.reshape, np.expand_dims, np.dot, np.concatenate, np.ones_like, np.take, ...) run as
        one-op plans, as inside sf.jit, and return sf.Arrays; any other is refused, never silently
        gathered (under mpiexec that is a collective): np.asarray(x) or x.gather() give NumPy's value."""
        if func in _REDUCTIONS and isinstance(args[0], ArrayOps):
            return getattr(args[0], _REDUCTIONS[func].__name__)(*args[1:], **kwargs)
        fn = NUMPY.get(func)
        return host_or_refused(func, args, kwargs) if fn is None else fn(*args, **kwargs)

    def __neg__(self):
        return unary(operator.neg, self)

    def __abs__(self):
        return unary(absolute, self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """np.exp(x), np.add(x, y), ...: the ufuncs shardfuse has ops for; others are refused."""
        fn = NUMPY.get(ufunc) if method == "__call__" and not kwargs else None
        if fn is None:
            what = f"np.{ufunc.__name__}"
            if method != "__call__":
                what += f".{method}"
            if kwargs:
                what += f" with {', '.join(k + '=' for k in kwargs)}"
            ufuncs = ", ".join("np." + u.__name__ for u in NUMPY if isinstance(u, np.ufunc))
            raise TypeError(f"{what} on an sf.Array is not supported; shardfuse has {ufuncs}, the operators "
                            "+ - * / // % @ & | ^ ~, abs(), x.sum(axis), x.mean(axis), x.var / std / argmax / argmin(axis), "
                            "x.clip and indexing (np.asarray(x): the gathered NumPy value)")
        return fn(*inputs) if ufunc.nout > 1 else binary(fn, *inputs) if ufunc.nin == 2 else unary(fn, inputs[0])

    def sum(self, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None, **rest):
        """The sum over `axis` (an int, a tuple of them, or None: all), as a one-op plan (NumPy's argument order)."""
        return reduce(self, axis, Traced.sum, out, dtype, keepdims, where, initial, **rest)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False, **rest):
        """The mean over `axis` (an int, a tuple of them, or None: all), as a one-op plan."""
        return reduce(self, axis, Traced.mean, out, dtype, keepdims, **rest)

    def max(self, axis=None, out=None, keepdims=False, initial=None, where=None, **rest):
        """The largest element over `axis`, as a one-op plan (a sharded axis is gathered first)."""
        return reduce(self, axis, Traced.max, out, None, keepdims, where, initial, **rest)

    def min(self, axis=None, out=None, keepdims=False, initial=None, where=None, **rest):
        """The smallest element over `axis`, as a one-op plan (a sharded axis is gathered first)."""
        return reduce(self, axis, Traced.min, out, None, keepdims, where, initial, **rest)

    size = property(lambda self: math.prod(self.shape))  # (the number of elements, as NumPy's)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d sf.Array")
        return self.shape[0]

    def __getitem__(self, key):
        return getitem(self, key)

    at = property(lambda self: SHAPE_OPS["at"](self))  # x.at[idx].set(v), as inside jit (shardfuse/update_slice.py)

    def __setitem__(self, key, value):  # (sf.Arrays are immutable: the error says what to write)
        SHAPE_OPS["setitem"](self, key, value)

    def __bool__(self):
        """As NumPy: the truth of a one-element array (gathered: collective), ambiguous otherwise."""
        return bool(self._one_element(ValueError, f"the truth value of an sf.Array of shape {self.shape} is "
                                      "ambiguous; use np.asarray(x).any() or .all() (the gathered value)"))

    def __float__(self):
        return float(self._one_element(TypeError, f"float() of an sf.Array of shape {self.shape}: only one "
                                       "element converts; use np.asarray(x) (the gathered value)"))

    def __int__(self):
        return int(self._one_element(TypeError, f"int() of an sf.Array of shape {self.shape}: only one "
                                     "element converts; use np.asarray(x) (the gathered value)"))

    def item(self):
        """The one element as a Python scalar, as NumPy's and torch's x.item() (`loss.item()`): read
        as float() reads it (locally where replicated, else gathered: collective under mpiexec)."""
        return self._one_element(ValueError, f"item() of an sf.Array of shape {self.shape}: can only convert an "
                                 "array of size 1 to a Python scalar; use np.asarray(x) (the gathered value)").item()

    def _one_element(self, error, message):
        """The value of a one-element array, gathered (a collective under mpiexec unless replicated), as NumPy's."""
        if math.prod(self.shape) != 1:
            raise error(message)
        return self.gather().reshape(())
