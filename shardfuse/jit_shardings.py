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


def constrained(fn, mesh, in_shardings, out_shardings):
    """fn with its positional arguments placed by in_shardings and its result by out_shardings (fn
    itself where both are None); the wrapper keeps fn's signature (inspect follows __wrapped__)."""
    if in_shardings is None and out_shardings is None:
        return fn
    if in_shardings is not None and not isinstance(in_shardings, (tuple, list)):
        raise TypeError(f"sf.jit in_shardings= takes a tuple with one entry per positional argument (None: as it "
                        f"comes; each what sf.distribute takes, e.g. (('dp', None), None)), got {in_shardings!r}")

    @functools.wraps(fn)
    def placed(*args, **kwargs):
        from shardfuse.api import distribute  # (api builds on the tracing that imports this module)

        if in_shardings is not None:
            if len(in_shardings) != len(args):
                raise TypeError(f"sf.jit({getattr(fn, '__name__', 'fn')}): in_shardings has {len(in_shardings)} "
                                f"entries for {len(args)} positional arguments (one each, None for as it comes)")
            args = tuple(a if s is None else distribute(a, mesh, s) for a, s in zip(args, in_shardings))
        out = fn(*args, **kwargs)
        return out if out_shardings is None else distribute(out, mesh, out_shardings)
    return placed

