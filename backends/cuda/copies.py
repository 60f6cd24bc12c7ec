"""Copies between strided views on the GPU: DMA where the copy engine can move them (one block,
or rows of contiguous elements at fixed pitches: a 2-D copy), else a CuPy copy kernel; and
`piece`, the caller's array as a contiguous buffer on a local device.

One pitch analysis (`_split`: the contiguous inner run and the axes outside it) serves both
uses, each with its own rule of what the 2-D copy may take."""
from __future__ import annotations

import cupy
from cupy.cuda import driver, runtime

from shardfuse.backends.cuda.devices import offsets_bytes
from shardfuse.backends.cuda.libs import D2D, ITEM, Prebound

MAX_PITCH = 2**31 - 1  # memcpy2D takes pitches up to the device's memPitch (2^31 - 1 bytes on current GPUs)


def _split(shape, strides, unit):
    """(width, outer): the extent of the contiguous inner axes times `unit` (strides in units of
    1, or bytes with unit the item size), and the (extent, stride) of the axes outside them that
    are not of extent 1."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    width, k = unit, len(dims)
    while k and dims[k - 1][1] == width:
        width *= dims[k - 1][0]
        k -= 1
    return width, dims[:k]


def blocks(x):
    """(height, width, pitch) in bytes when the CuPy array x is `height` equal C-contiguous blocks
    of `width` bytes, `pitch` bytes apart, else None."""
    width, outer = _split(x.shape, x.strides, x.itemsize)
    if len(outer) != 1 or not width <= outer[0][1] < MAX_PITCH:
        return None
    return outer[0][0], width, outer[0][1]


def two_strides(x):
    """(a, sa, c, sc, width) in bytes when the CuPy array x is a x c equal C-contiguous blocks of
    `width` bytes, block (i, k) at i * sa + k * sc (positive strides), else None."""
    width, outer = _split(x.shape, x.strides, x.itemsize)
    if len(outer) != 2 or min(s for _, s in outer) <= 0:
        return None
    (a, sa), (c, sc) = outer
    return a, sa, c, sc, width


def as_rows(ref):
    """(rows, width, pitch) in elements when ref is rows of contiguous elements at a fixed pitch."""
    width, outer = _split(ref.shape, ref.strides, 1)
    if not outer:
        return (1, width, width)
    if width == 1:
        return None
    # the remaining dims must nest into one pitch, a positive one (memcpy2D's pitches are unsigned;
    # a reversed axis, x[::-1], has a negative stride: the copy kernel moves it)
    n, s = outer[-1]
    if s <= 0:
        return None
    rows = n
    for m, t in reversed(outer[:-1]):
        if t != rows * s:
            return None
        rows *= m
    return (rows, width, s)


def dma_copy(src, dst):
    """copy(dst_ptr, src_ptr, stream_ptr) for Refs of one shape that a DMA copy can move: both
    one block, or both rows of contiguous elements at fixed pitches (a 2-D copy); else None."""
    item = ITEM[src.dtype]
    if src.is_contiguous() and dst.is_contiguous():
        nbytes = src.size * item
        return lambda d, s, st: runtime.memcpyAsync(d, s, nbytes, D2D, st)
    rows = as_rows(src), as_rows(dst)
    if None not in rows and rows[0][:2] == rows[1][:2]:
        (h, w, sp), (_, _, dp) = rows
        return lambda d, s, st: runtime.memcpy2DAsync(d, dp * item, s, sp * item, w * item, h, D2D, st)
    return None


def bind_copy(dev, src, dst, stream, devices=None):
    """Step: dst[...] = src on local devices `devices` (positions j; None: all), a DMA copy per
    device where one can move it, else a copy kernel."""
    if src.shape != dst.shape:
        raise ValueError(f"copy {src.shape} -> {dst.shape}")
    copy = dma_copy(src, dst)
    if copy is None:
        def body(j, x, o):
            o[...] = x
        return dev.per_device((src, dst), stream, body, devices)
    js = range(len(dev.ordinals)) if devices is None else devices
    streams = [(j, dev.stream(j, stream).ptr) for j in js]
    so, do = offsets_bytes(src), offsets_bytes(dst)
    ss, ds = src.slot, dst.slot

    def step(bufs):
        S, D = bufs[ss], bufs[ds]
        for j, sp in streams:
            copy(D[j].data.ptr + do[j], S[j].data.ptr + so[j], sp)
    return step


def piece(dev, kernels, x, j):
    """x (a CuPy array of this process, e.g. a slice of adopt's result) as a C-contiguous
    buffer on local device j: x itself when it already is one there (zero copy), else a
    device-side copy on main of j's GPU (a peer copy from another GPU).  `kernels`: the
    backend's kernels.Kernels."""
    o, src = dev.ordinals[j], x.data.device_id  # (not x.device: a Device object made per call)
    if src == o:
        if x.flags.c_contiguous:
            return x
        main = dev.main_of[o]
        with cupy.cuda.Device(o), main:
            rows = blocks(x)
            if rows is None:
                out = _strided_blocks(kernels, x, o, main)  # (None where not blocks at two strides)
                return cupy.ascontiguousarray(x) if out is None else out
            # equal contiguous blocks a pitch apart (a device's piece of the seed layout
            # [S, D, M/(S*D), K]: S blocks): one 2-D copy on the copy engine, not a kernel
            height, width, pitch = rows
            out = cupy.empty(x.shape, x.dtype)
            runtime.memcpy2DAsync(out.data.ptr, width, x.data.ptr, pitch, width, height,
                                  runtime.memcpyDeviceToDevice, main.ptr)
            return out
    if src not in dev.main_of:
        raise ValueError(f"cupy_nccl: a piece on GPU {src}, this process' devices are on GPUs {dev.gpus}")
    src_main, dst_main = dev.main_of[src], dev.main_of[o]
    with cupy.cuda.Device(src), src_main:
        c = cupy.ascontiguousarray(x)
    with cupy.cuda.Device(o), dst_main:
        out = cupy.empty(x.shape, x.dtype)
    ready, done = dev.fence[src][1], dev.fence[o][1]
    runtime.eventRecord(ready.ptr, src_main.ptr)  # the copy reads what main of the source wrote
    runtime.streamWaitEvent(dst_main.ptr, ready.ptr, 0)
    runtime.memcpyPeerAsync(out.data.ptr, o, c.data.ptr, src, c.nbytes, dst_main.ptr)
    # c may be a temporary that goes back to the source GPU's pool on return: main there
    # must not reuse it before the copy has read it
    runtime.eventRecord(done.ptr, dst_main.ptr)
    runtime.streamWaitEvent(src_main.ptr, done.ptr, 0)
    return out


def _strided_blocks(kernels, x, o, main):
    """x as a new contiguous buffer on GPU o, by one pre-bound kernel launch on `main` when x
    is blocks at two strides (copies.two_strides; kernels.strided_blocks), else None."""
    got = two_strides(x)
    if got is None or x.size == 0:  # (no launch of an empty grid)
        return None
    a, sa, c, sc, width = got
    out = cupy.empty(x.shape, x.dtype)
    vector = not (x.data.ptr | out.data.ptr | sa | sc | width) & 15  # (16-byte units where all allow)
    unit = 16 if vector else 1
    launch = kernels.cached(("strided_blocks", o, vector), lambda: Prebound(
        kernels.strided_blocks(vector).kernel, 7, driver.launchKernel))  # (compiled for GPU o: current here)
    total = a * c * width // unit
    launch(min(4096, -(-total // 256)), 256,
           (x.data.ptr, out.data.ptr, c, width // unit, sa // unit, sc // unit, total), main.ptr)
    return out
