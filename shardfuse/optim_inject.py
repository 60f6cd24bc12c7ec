"""sf.optim.inject_hyperparams (optax's): an optimizer factory's numeric arguments held in its state, where a
caller reads the rates each update used and may change them (shardfuse/optim.py re-exports it)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import numpy as np

from shardfuse import tree
from shardfuse.dtypes import normalize_dtype, np_dtype
from shardfuse.ops import Op
from shardfuse.optim_base import GradientTransformation
from shardfuse.traced import Traced


class InjectHyperparamsState(NamedTuple):
    """optax's: the step count (0-d int32), the hyperparameters of the last update (numbers, or 0-d arrays: a caller
    may change them in the state, as optax's), and the inner optimizer's state."""
    count: Any
    hyperparams: Any
    inner_state: Any


def inject_hyperparams(inner_factory: Callable, static_args=(), hyperparam_dtype=None) -> Callable:
    """optax.inject_hyperparams: inner_factory's numeric arguments, given or default (numbers, and schedules of the
    step count), kept in the state's hyperparams, which the next update reads (a schedule's, evaluated at the
    count, wins): `opt = sf.optim.inject_hyperparams(sf.optim.adamw)(learning_rate=sched, weight_decay=0.1)`; then
    `state.hyperparams["learning_rate"]` is the rate the last update used.  With hyperparam_dtype, floats are held
    in it (optax's); else a number stays a Python number, weakly typed inside sf.jit as a number is, so the
    updates and moments are the plain optimizer's to the bit (optax casts it to the parameters' dtype: bfloat16
    would round Adam's b2 = 0.999 to 1 and divide by zero), and a schedule's value is float32 (or the parameters'
    wider float); bools, ints of arguments whose default is an int, and mask= (a pytree or a function of the
    parameters, never a schedule: optax would call it with the count) stay Python values (static)."""
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    fixed_dtype = None if hyperparam_dtype is None else np_dtype(normalize_dtype(hyperparam_dtype))

    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        numeric, fixed = {}, {}
        for k, v in bound.arguments.items():
            default = signature.parameters[k].default
            hyper = k not in static and k != "mask" and (callable(v) or _is_number(v) and not (
                isinstance(v, (int, np.integer)) and isinstance(default, int) and not isinstance(default, bool)))
            (numeric if hyper else fixed)[k] = v

        def dtype_of(params):  # (a schedule's: the parameters' widest float, at least float32)
            floats = [np.dtype(x.dtype) for x in tree.leaves(params) if np.dtype(x.dtype).kind == "f"]
            return fixed_dtype or max(floats + [np.dtype(np.float32)], key=lambda d: d.itemsize)

        def values(count, held, dtype):  # (a schedule's value at count; a number's as the state holds it)
            return {k: _as(v(count), dtype) if callable(v) else _weak_if_float64(held[k]) if fixed_dtype is None else
                    _as(held[k], fixed_dtype) for k, v in numeric.items()}

        def inner(hp):  # (the learning rate as a schedule: _in_dtype casts it to each update's dtype)
            given = {k: (lambda count, v=v: v) if k == "learning_rate" else v for k, v in hp.items()}
            return inner_factory(**fixed, **given)

        def init(params):
            zero = np.zeros((), np.int32)
            hp = values(zero, {k: v for k, v in numeric.items() if not callable(v)}, dtype_of(params))
            return InjectHyperparamsState(zero, hp, inner(hp).init(params))

        def update(updates, state, params=None):
            hp = values(state.count, state.hyperparams, dtype_of(params if params is not None else updates))
            new, inner_state = inner(hp).update(updates, state.inner_state, params)
            return new, InjectHyperparamsState((state.count + 1).astype(np.int32), hp, inner_state)
        return GradientTransformation(init, update)
    return wrapped


def _as(v, dtype):
    """A hyperparameter's float value in dtype (ints kept: optax's _convert_floats)."""
    kind = np.dtype(v.dtype).kind if hasattr(v, "dtype") else "i" if isinstance(v, int) else "f"
    if kind in "iu":
        return np.asarray(v) if isinstance(v, (int, np.generic)) else v
    return np.asarray(v, dtype) if isinstance(v, (float, np.generic, np.ndarray)) else v.astype(dtype)


def _weak_if_float64(v):
    """A held float64 hyperparameter as a weak number, a Python float is: the state holds a Python float as a
    weak 0-d float64, which a checkpoint through NumPy (np.asarray, np.savez) makes a strong float64 array, and
    its product with float32 moments was then float64, silently (a training probe: a resumed run drifted)."""
    if getattr(v, "shape", None) != () or np.dtype(getattr(v, "dtype", np.float32)) != np.float64 or getattr(
            v, "weak", False) or not hasattr(v, "dtype"):
        return v
    if isinstance(v, Traced):
        if v.value in v.builder.weak:
            return v
        w = v.unary_op(Op.ASTYPE, "float64")
        v.builder.weak.add(w.value)
        return w
    return float(v)  # (a NumPy 0-d array, a NumPy float64, a replicated 0-d sf.Array: read on this process)


def _is_number(v) -> bool:
    """A number, or a 0-d array of one (NumPy's or an sf.Array: optax keeps arrays too, a review)."""
    if isinstance(v, (bool, np.bool_)):
        return False
    return isinstance(v, (int, float, np.integer, np.floating)) or getattr(v, "shape", None) == () and \
        np.dtype(v.dtype).kind in "iuf" and (isinstance(v, np.ndarray) or hasattr(type(v), "one_op"))
