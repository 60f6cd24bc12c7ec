"""sf.jit's static arguments (JAX's static_argnums / static_argnames): parameters that are Python
values, not arrays (a head count, `causal=True`, an activation's name).  Each distinct set of static
values is its own function of the remaining (array) parameters, jitted apart: its plans are keyed
by those values as JAX's are by their hash, and the function sees the values as Python values.
"""
from __future__ import annotations

import functools
import inspect

P = inspect.Parameter


def static_names(fn, argnums, argnames) -> tuple:
    """The names of fn's static parameters, in signature order, checked against its signature."""
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    if not argnums and not argnames:
        return ()
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    names = set()
    for k in argnums:
        if isinstance(k, bool) or not isinstance(k, int) or not -len(positional) <= k < len(positional):
            raise ValueError(f"static_argnums={argnums!r}: {k!r} names no positional parameter of "
                             f"{getattr(fn, '__name__', 'the function')}, which has {len(positional)}")
        names.add(positional[k].name)
    known = {p.name for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    for n in argnames:
        if n not in known:
            raise ValueError(f"static_argnames={argnames!r}: {getattr(fn, '__name__', 'the function')} has no "
                             f"parameter {n!r} (it has {', '.join(sorted(known))})")
        names.add(n)
    return tuple(p.name for p in params if p.name in names)


def split_static(fn, names: tuple, args: tuple, kwargs: dict):
    """(the static values as a key, the other arguments positionally, keyword-only ones by name):
    fn's arguments bound as Python binds them, a static parameter not given taking its default."""
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{getattr(fn, '__name__', 'the function')}(): {e}") from None
    key = []
    for n in names:
        v = bound.arguments.get(n, sig.parameters[n].default)  # (not given: its default)
        if v is P.empty:
            raise TypeError(f"{getattr(fn, '__name__', 'the function')}() missing its static argument {n!r}")
        try:
            hash(v)
        except TypeError:
            raise TypeError(f"static argument {n} must be hashable (as JAX's static_argnums), got "
                            f"{type(v).__name__} {v!r}: pass a tuple for a list, or make it an array input") from None
        key.append((n, type(v), v))  # (type too: 1 and True hash alike but may trace differently)
    positional, keywords, gap = [], {}, False
    for p in sig.parameters.values():
        if p.name in names:
            continue
        if p.name not in bound.arguments:
            gap = gap or p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)  # (left to its default)
        elif p.kind == P.VAR_POSITIONAL:
            positional += bound.arguments[p.name]
        elif p.kind == P.VAR_KEYWORD:
            keywords.update(bound.arguments[p.name])
        elif p.kind == P.KEYWORD_ONLY or gap:  # (after a parameter left to its default: by name)
            keywords[p.name] = bound.arguments[p.name]
        else:
            positional.append(bound.arguments[p.name])
    return tuple(key), tuple(positional), keywords


def with_static(fn, key: tuple):
    """fn with its static parameters fixed to the values in `key`: a function of the others (its
    signature says which, for naming the plan's inputs)."""
    fixed = {n: v for n, _, v in key}
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        given = iter(args)
        pos, kw, gap = [], {}, False
        for p in sig.parameters.values():
            if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
                v = fixed[p.name] if p.name in fixed else next(given, P.empty)
                if v is P.empty:
                    gap = True  # (left to its default: what follows goes by name)
                elif gap:
                    kw[p.name] = v
                else:
                    pos.append(v)
            elif p.kind == P.KEYWORD_ONLY and p.name in fixed:
                kw[p.name] = fixed[p.name]
        return fn(*pos, *given, **kw, **kwargs)

    bound.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in fixed])
    return bound


def dynamic_position(fn, names: tuple, k: int) -> int:
    """Where positional argument k of fn sits among the non-static ones (for donate_argnums)."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if k < len(params) and params[k].name in names:
        raise ValueError(f"donate_argnums names argument {k} ({params[k].name}), which is static: only arrays "
                         "are donated")
    return k - sum(p.name in names for p in params[:k])
