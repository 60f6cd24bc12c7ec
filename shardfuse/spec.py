"""What a caller says about an array: TensorSpec (shape, dtype, layout) and the checks of the
axis, chunk and mesh-axis arguments of the annotations, all raised before anything runs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardfuse.dtypes import normalize_dtype
from shardfuse.layout import Layout, axis_entry, shard_count
from shardfuse.mesh import as_int


def normalize_over(over, mesh):
    """A mesh axis name, or an ordered tuple of them (one tensor axis sharded over several mesh
    axes, the first outermost, as JAX's `P(("dp", "tp"))`): the Layout entry, checked.  None:
    the mesh's last (innermost) axis, the default of sf.shard (DIDx on an unnamed mesh)."""
    if over is None:
        over = mesh.axis_names[-1]
    names = (over,) if isinstance(over, str) else tuple(over) if isinstance(over, (tuple, list)) else None
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"over= takes a mesh axis name or a tuple of distinct ones (mesh axes "
                         f"{mesh.axis_names}), got {over!r}")
    for n in names:
        mesh.axis_index(n)  # an unknown mesh axis name fails here
    return axis_entry(names)


def check_divides(shape, ax: int, over, mesh, of: str = "") -> None:
    """The one check that a mesh axis (or tuple of them) can shard tensor axis `ax` evenly (`of`: the
    value it is about, named in the error: a traced value's name and shape)."""
    n = shard_count(normalize_over(over, mesh), mesh)  # raises for unknown mesh axis names
    if shape[ax] % n:
        raise ValueError(f"cannot shard axis {ax} of extent {shape[ax]}{f' of {of}' if of else ''} over {over}: "
                         f"the mesh axis has {n} devices, which does not divide {shape[ax]} (shards are even: pad "
                         f"the axis to {-(-shape[ax] // n) * n}, as Megatron pads a vocabulary, or shard another axis)")


def check_axis(axis) -> int:
    """An axis argument as a Python int: ints and NumPy integers, never bools (axis=True is not
    axis 1), floats or strings."""
    if isinstance(axis, int) and not isinstance(axis, bool):
        return axis
    return as_int(axis, "axis")


def normalize_axis(axis: int, ndim: int, shape) -> int:
    axis = check_axis(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis!r} out of range for a {ndim}-D value of shape {tuple(shape)}")
    return axis % ndim


def check_chunks(chunks):
    """sf.stream's chunks=: None or a positive int (NumPy integers too; never bools or floats)."""
    return None if chunks is None else as_int(chunks, "sf.stream chunks=", minimum=1)


def resolve_chunks(chunks, algorithm: str):
    """sf.stream's chunks=: None, a positive int, or "auto" (kept in the traced program: sf.jit
    compiles it once per candidate S, autochunks.py)."""
    if isinstance(chunks, str) and chunks != "auto":
        raise TypeError(f'sf.stream chunks= must be an int or "auto", got {chunks!r} (str)')
    if not (isinstance(chunks, str) and chunks == "auto"):
        return check_chunks(chunks)
    if algorithm == "ring":
        raise ValueError("chunks='auto' chooses S for algorithm='collective'; the ring's chunks are the D shards of "
                         "the axis (give chunks=D, or omit chunks)")
    return "auto"


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a global array; `layout` None means "as the function annotates it".
    `weak`: a Python scalar's (JAX's weak type): beside an array it takes the array's dtype
    where its kind (bool < int < float) is not higher, as a Python scalar constant does."""

    shape: tuple
    dtype: str = "float32"
    layout: Layout | None = None
    weak: bool = False

    def __post_init__(self):
        shape = self.shape
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
            shape = (shape,)
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise TypeError(f"TensorSpec shape must be a tuple of ints, got {shape!r} ({type(shape).__name__})")
        try:
            shape = tuple(as_int(s, "a TensorSpec extent", minimum=0) for s in shape)
        except (TypeError, ValueError) as e:
            raise type(e)(f"TensorSpec shape {tuple(self.shape)!r}: {e}") from None
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.weak, bool) or (self.weak and shape != ()):
            raise TypeError(f"TensorSpec weak= is True only for a Python scalar's 0-d spec (shape ()), got "
                            f"weak={self.weak!r} with shape {shape}")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise TypeError(f"TensorSpec layout must be a Layout or None, got {type(self.layout).__name__}")
        if self.layout is not None and self.layout.ndim != len(shape):
            raise ValueError(f"TensorSpec layout {self.layout} has {self.layout.ndim} axes, the shape {shape} "
                             f"has {len(shape)}")
        # hashed once: sf.jit's plan cache is keyed by a tuple of specs, one per argument leaf
        object.__setattr__(self, "_hash", hash((shape, self.dtype, self.layout, self.weak)))

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # (by its fields: a str hash differs between processes, so _hash is made anew)
        return TensorSpec, (self.shape, self.dtype, self.layout, self.weak)


def reduced_axes(axis, ndim: int, shape) -> tuple:
    """The axes a reduction's axis= names, distinct and in range: every axis for None, one int, or a tuple."""
    axes = tuple(range(ndim)) if axis is None else axis if isinstance(axis, tuple) else (axis,)
    axes = tuple(normalize_axis(a, ndim, shape) for a in axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"duplicate value in axis={axis!r}")
    return axes


def is_spec_tuple(x) -> bool:
    """A (shape, dtype[, sharding]) tuple, which lower() reads as one TensorSpec, not as a pytree."""
    if type(x) is not tuple or len(x) not in (2, 3) or not isinstance(x[1], (str, np.dtype, type)):
        return False
    shape = x[0] if isinstance(x[0], (tuple, list)) else (x[0],)  # (read element by element: an optax state's
    return all(isinstance(n, (int, np.integer)) for n in shape)    # tuple of named tuples broke np.atleast_1d)
