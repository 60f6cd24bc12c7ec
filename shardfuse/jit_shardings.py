"""sf.jit's options checked (check_options, check_rates), and its in_shardings= and out_shardings= (JAX's): where a jitted function's arguments and results
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

import numpy as np

from shardfuse.cost import Rates
from shardfuse.layout import Layout
from shardfuse.mesh import DeviceMesh
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



def check_options(fn, mesh, streams, graph) -> None:
    """sf.jit's function, mesh, streams= and graph=, each what it must be, else an error saying so."""
    if not callable(fn):
        raise TypeError(f"sf.jit compiles a function, got {type(fn).__name__}")
    if mesh is None:
        raise ValueError("sf.jit needs a mesh: sf.jit(mesh=sf.DeviceMesh(n))")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"sf.jit mesh= must be an sf.DeviceMesh, got {type(mesh).__name__}")
    if isinstance(streams, (bool, np.bool_)) or not isinstance(streams, (int, np.integer)):
        raise TypeError(f"streams must be a positive int (the size of the stream pool), got {streams!r} "
                        f"({type(streams).__name__})")
    if streams < 1:
        raise ValueError(f"streams must be a positive int, got {streams}")
    if not isinstance(graph, (bool, np.bool_)):
        raise TypeError(f"graph must be True or False, got {graph!r} ({type(graph).__name__})")
    if graph and mesh.backend_name != "cupy":
        raise NotImplementedError(f"graph=True captures CUDA graphs: it needs the cupy backend, and {mesh} runs on "
                                  f"{mesh.backend_name}")
    if not mesh.is_root and mesh.nprocs > 1:
        raise NotImplementedError(
            f"sf.jit on the sub-mesh {mesh} under MPI ({mesh.nprocs} processes) is not supported: jit on its "
            f"whole mesh {mesh.root} and place values on the sub-mesh inside the function "
            "(sf.shard(x, axis, mesh=sub), sf.replicate(x, mesh=sub), sf.to_mesh)")


def check_rates(rates) -> None:
    if rates is not None and not isinstance(rates, (Rates, str)):
        raise TypeError(f"sf.jit rates= must be a shardfuse.cost.Rates or a name of cost.DEFAULTS, got "
                        f"{type(rates).__name__}")
