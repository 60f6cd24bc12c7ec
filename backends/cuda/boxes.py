"""DynamicSlice and DynamicUpdateSlice on GPUs: a box copied at starts that live on the device.

One generated kernel per (rank, starts, extents), one thread per element of the box: each thread
reads the run-time starts from their device buffers (no device-to-host read: the step stays
asynchronous and may be captured in a CUDA graph), wraps a negative one and clamps it so that the
box fits (elementwise_numpy.box_slices's rule, jax.lax's), and moves its one element between the box
of the larger array and the box-shaped one, strides honoured on both sides (a raw CuPy array indexed
with a multi-index).  Elements are moved as they are: any dtype, bfloat16 as its uint16 bits, no
temporaries.  An update of the whole of a 0-d array is a plain copy."""
from __future__ import annotations

import math

import cupy

from shardfuse.backends.cuda.box_source import source


def kernel(kernels, box, outer, inner, update, start_dtypes):
    """The box-copy kernel (Kernels.cached: compiled at its first use) of these starts and extents; the
    starts' dtypes (int32 / int64) are spelled out (CuPy's type placeholders are single letters)."""
    def make():
        starts = "".join(f", raw {dt} s{k}_" for k, dt in enumerate(start_dtypes))
        return cupy.ElementwiseKernel(f"raw T src{starts}", "raw T dst", source(box, outer, inner, update),
                                      f"sf_{'update' if update else 'dynamic'}_slice{len(box)}")
    return kernels.cached(("box", tuple(box), tuple(outer), tuple(inner), update, tuple(start_dtypes)), make)


def bind_box(dev, kernels, src, starts, out, box, stream, update):
    """Step: update: out's box = src (bind_update_slice); else out = src's box (bind_dynamic_slice).  The
    0-d starts are viewed as (1,) arrays (views: nothing is allocated when the step runs)."""
    outer, inner = (out.shape, src.shape) if update else (src.shape, out.shape)
    n = math.prod(inner)
    if not box:  # (0-d: the box is the whole array)
        return dev.per_device((src, out), stream, lambda j, x, o: cupy.copyto(o, x))
    kern = kernel(kernels, box, outer, inner, update, [s.dtype for s in starts])

    def step(j, x, *rest):
        *s, o = rest
        if n:
            kern(x, *(v.reshape(1) for v in s), o, size=n)
    return dev.per_device((src, *starts, out), stream, step)
