"""The GEMMs of the virtual devices of one GPU as one strided-batched cublasLtMatmul.

Virtual devices of a GPU issue each step in turn on the same stream, so a step's GEMM is one
library call per device, each ~9 us of host (issue 14's step_cost).  Where the devices' operands
lie at constant distances one batched call does the same work: Devices.empty packs a GPU's
pieces in one allocation, pieces.local_pieces cuts an inner axis of an argument from one copy,
and a replicated operand is one shared buffer (distance 0).  A caller's sf.Array may hold its
pieces anywhere, so the distances are read at call time; each triple seen binds its batched
call once, and pointers that are not evenly spaced take the per-device calls.  Plain Python (the
CUDA parts come in as arguments), so the dispatch is tested anywhere."""
from __future__ import annotations

import operator

from shardfuse.backends.cuda.libs import check

_REFUSED = object()  # a spacing cuBLASLt refused to batch: per-device calls
MAX_SPACINGS = 8  # batched calls bound per step: binding makes three cuBLASLt layouts
REFUSALS = (7, 15)  # CUBLAS_STATUS_INVALID_VALUE, NOT_SUPPORTED: this algorithm cannot run the batch


def spacing(ptrs) -> int | None:
    """The constant non-negative distance between consecutive pointers, else None (compared as
    whole lists, in C: this runs for every operand of every step)."""
    first, step = ptrs[0], ptrs[1] - ptrs[0]
    if step > 0:
        return step if ptrs == list(range(first, first + step * len(ptrs), step)) else None
    return 0 if step == 0 and ptrs.count(first) == len(ptrs) else None


_PTR = operator.attrgetter("data.ptr")


def _pointers(offsets):
    """ptrs(buffers): each device's buffer pointer plus its offset; where every device has the
    same offset, the bare pointers (their spacing is the same) with the offset left to the caller."""
    if len(set(offsets)) == 1:
        return lambda xs: list(map(_PTR, xs)), offsets[0]
    return lambda xs: [p + o for p, o in zip(map(_PTR, xs), offsets)], 0


def one_gpu_step(each_device, bind_batched, matmul, slots, offsets, item, c_bytes, what, align=1):
    """The step of one GEMM per device of one GPU: one batched call when the operands are evenly
    spaced, else each_device(bufs).  bind_batched((sa, sb, sc) in elements) -> (matmul's ctypes
    arguments, pa, pb, pc: the base pointers to set in them, what must outlive them).  slots and
    per-device byte offsets are the operands' (first, second, out); c_bytes: one output matrix's
    extent (the outputs of a batch must not overlap); align: the bytes the algorithm needs every
    pointer to be a multiple of (other pointers take each_device, which handles them).  A
    batched call that cuBLASLt refuses at its first call (REFUSALS: the per-device algorithm
    cannot run it, e.g. for want of workspace) is not tried again for that spacing; any other
    error status raises."""
    s1, s2, so = slots
    (ptrs_a, xa), (ptrs_b, xb), (ptrs_c, xc) = (_pointers(tuple(o[k] for o in offsets)) for k in range(3))
    bound: dict = {}  # spacing -> the bound call, or _REFUSED
    mask = align - 1

    def step(bufs):
        pa, pb, pc = ptrs_a(bufs[s1]), ptrs_b(bufs[s2]), ptrs_c(bufs[so])
        a0, b0, c0 = pa[0] + xa, pb[0] + xb, pc[0] + xc
        if (a0 | b0 | c0) & mask:  # (with the spacings' check below: every pointer aligned)
            return each_device(bufs)
        key = (spacing(pa), spacing(pb), spacing(pc))
        call = bound.get(key)
        new = call is None
        if new:
            # (two devices' pointers are always evenly spaced: buffers allocated anew each call
            # would bind a call per call, so after MAX_SPACINGS the unseen ones are not bound)
            if None in key or key[2] < c_bytes or any(s % item or s & mask for s in key) \
                    or len(bound) >= MAX_SPACINGS:
                return each_device(bufs)
            call = bound[key] = bind_batched(tuple(s // item for s in key))
        if call is _REFUSED:
            return each_device(bufs)
        args, a, b, c, _ = call
        a.value, b.value, c.value = a0, b0, c0
        st = matmul(*args)
        if st in REFUSALS and new:
            bound[key] = _REFUSED
            return each_device(bufs)
        if st:
            check(st, f"{what}, batched over {len(pa)} devices")
    return step


def nested_batch_step(each_device, batched, slots, offsets, strides, count, what):
    """The step of a strided batch of `count` GEMMs on each device of one GPU (a chunk of rows
    sharded and streamed: the natural layout's [D * m, K] pieces) as ONE strided-batched call of
    count * devices GEMMs, where each operand's devices lie exactly one whole batch apart
    (spacing == count * its batch stride; a shared operand: both 0), which is how Devices.empty
    packs a GPU's pieces; else each_device(bufs).  slots and per-device byte offsets are the
    operands' (first, second, out); strides: their batch strides in bytes; batched(a, b, c,
    total) makes the call and returns cuBLAS' status."""
    (ptrs_a, xa), (ptrs_b, xb), (ptrs_c, xc) = (_pointers(tuple(o[k] for o in offsets)) for k in range(3))
    s1, s2, so = slots
    want = tuple(count * s for s in strides)
    total = count * len(offsets)
    if want[2] <= 0:  # outputs one batch apart cannot overlap; a zero output stride is not a batch
        return each_device

    def step(bufs):
        pa, pb, pc = ptrs_a(bufs[s1]), ptrs_b(bufs[s2]), ptrs_c(bufs[so])
        if (spacing(pa), spacing(pb), spacing(pc)) != want:
            return each_device(bufs)
        st = batched(pa[0] + xa, pb[0] + xb, pc[0] + xc, total)
        if st:
            check(st, f"{what}, batched over {len(pa)} devices")
    return step

