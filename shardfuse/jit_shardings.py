"""sf.jit's in_shardings= and out_shardings= (JAX's): where a jitted function's arguments and results
live, stated once at the jit instead of as annotations inside the function.

Each is what sf.distribute takes (a JAX-style spec per tensor axis such as ("dp", None), DTensor
placements, a plan's Layout; for a pytree, one for every leaf or a pytree of them in its
structure), applied to the traced values as sf.distribute applies one inside sf.jit (JAX's
with_sharding_constraint): the plan reshards an argument that comes in another layout, and an
annotated argument's gradient takes its layout too.  in_shardings holds one entry per positional
argument (None: as it comes), as JAX's tuple does; out_shardings one for the result (None: as the
compiler places it).
"""
from __future__ import annotations

import functools

from shardfuse.layout import Layout
from shardfuse.placements import PartitionSpec, Replicate, Shard


def constrained(fn, mesh, in_shardings, out_shardings, static_argnums=()):
    """fn with its positional arguments placed by in_shardings and its result by out_shardings (fn
    itself where both are None); the wrapper keeps fn's signature (inspect follows __wrapped__).
    in_shardings: one entry per positional argument that is not static (JAX's count), or one Layout /
    list of DTensor placements or sf.P(...) for all of them (as JAX broadcasts one sharding)."""
    if in_shardings is None and out_shardings is None:
        return fn
    one = isinstance(in_shardings, (Layout, PartitionSpec)) or isinstance(in_shardings, list) and in_shardings and \
        all(isinstance(p, (Shard, Replicate)) for p in in_shardings)
    if in_shardings is not None and not one and not isinstance(in_shardings, (tuple, list)):
        raise TypeError(f"sf.jit in_shardings= takes a tuple with one entry per positional argument (None: as it "
                        f"comes; each what sf.distribute takes, e.g. (('dp', None), None)), got {in_shardings!r}")
    static = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums or ())

    @functools.wraps(fn)
    def placed(*args, **kwargs):
        from shardfuse.api import distribute  # (api builds on the tracing that imports this module)

        if in_shardings is not None:
            dynamic = [k for k in range(len(args)) if k not in static]
            specs = [in_shardings] * len(dynamic) if one else list(in_shardings)
            if len(specs) > len(dynamic):
                raise TypeError(f"sf.jit({getattr(fn, '__name__', 'fn')}): in_shardings has {len(specs)} entries "
                                f"for {len(dynamic)} positional arguments that are not static (one each, None for as "
                                "it comes)")
            where = dict(zip(dynamic, specs))  # (arguments after the entries, by keyword too: as they come)
            args = tuple(a if where.get(k) is None else distribute(a, mesh, where[k]) for k, a in enumerate(args))
        out = fn(*args, **kwargs)  # (a NumPy array returned and placed here: an sf.Array, which trace captures)
        return out if out_shardings is None else distribute(out, mesh, out_shardings)
    return placed

