"""GEMMs through cuBLAS (ctypes: CuPy's own wrappers refuse graph capture).

A plain GEMM is one cublasLtMatmul with descriptors and algorithm chosen at bind time (the
fastest of up to SHARDFUSE_GEMM_TUNE heuristic candidates, timed on scratch operands;
SHARDFUSE_GEMM=ex: cublasGemmEx); batched ones are cublasGemmStridedBatchedEx.  One handle and
one workspace per (GPU, stream), so GEMMs on concurrent streams never share a workspace (virtual
devices on one stream run in turn, so they may).  Batch dims that nest into the rows are folded
into one GEMM, one more is a strided batch, further outer ones are looped at bind time; views
cuBLAS cannot read are staged through scratch.  The virtual devices of one GPU run a step's
GEMMs as one strided-batched call where their operands allow (gemm_shared.py; plans and tuning
in lt_plans.py).  Everything but the per-call base pointers is resolved at bind time.  float32
runs without TF32 unless SHARDFUSE_TF32=1 (or CUPY_TF32=1).
"""
from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np

import cupy
from cupy.cuda import runtime

from shardfuse.backends.cuda import gemm_shared
from shardfuse.backends.cuda.devices import offsets_bytes
from shardfuse.backends.cuda.gemm_layout import gemm_layout
from shardfuse.backends.cuda.lt_plans import alignment, fastest, lt_layouts, lt_plan
from shardfuse.backends.cuda.libs import (COMPUTE_32F, COMPUTE_32F_TF32, COMPUTE_64F, COMPUTE_SCALE, CUDA_T,
                                          GEMM_DEFAULT, ITEM, OP_N, Cublas, CublasLt, check)
from shardfuse.backends.protocol import Ref, contiguous_strides

TF32 = os.environ.get("SHARDFUSE_TF32", os.environ.get("CUPY_TF32", "0")) == "1"
WORKSPACE = int(os.environ.get("SHARDFUSE_CUBLAS_WORKSPACE", str(32 << 20)))  # bytes per handle
GEMM_API = os.environ.get("SHARDFUSE_GEMM", "lt")  # "lt": cublasLtMatmul with a bind-time algorithm; "ex": cublasGemmEx
# cuBLASLt: time the heuristic's first candidates on scratch buffers at bind time and keep the
# fastest (its first choice was seen 8% slower than PyTorch's GEMM for bf16 8192^3); 0: take the first
GEMM_TUNE = int(os.environ.get("SHARDFUSE_GEMM_TUNE", "8"))


# ---- handles and workspaces ------------------------------------------------------------------
class Handles:
    """cuBLAS handles, one per (GPU, stream) with a workspace of its own, and one cuBLASLt handle
    per GPU (its calls use the workspace of the cuBLAS handle of their stream)."""

    def __init__(self, dev):
        self.dev = dev
        self.api = GEMM_API
        self.cublas = None  # the ctypes bindings, loaded at the first GEMM
        self.lt = None
        self.handles = {}  # (GPU, stream key) -> cuBLAS handle
        self.ws_ptr = {}  # (GPU, stream key) -> that handle's workspace (cuBLASLt calls use it too)
        self.workspaces = []
        self.workspace_bytes = 0
        self.lt_handles = {}  # GPU -> cuBLASLt handle

    def lib(self):
        if self.cublas is None:
            self.cublas = Cublas()
        return self.cublas

    def handle(self, j, stream):
        o = self.dev.ordinals[j]
        key = (o, stream)
        h = self.handles.get(key)
        if h is None:
            cb = self.lib()
            with cupy.cuda.Device(o):
                hp = ctypes.c_void_p()
                check(cb.create(ctypes.byref(hp)), "cublasCreate")
                check(cb.set_stream(hp, ctypes.c_void_p(self.dev.gpu_stream(o, stream).ptr)), "cublasSetStream")
                ws = cupy.empty(WORKSPACE, np.uint8)
                self.workspaces.append(ws)
                self.workspace_bytes += WORKSPACE
                check(cb.set_workspace(hp, ctypes.c_void_p(ws.data.ptr), WORKSPACE), "cublasSetWorkspace")
            self.ws_ptr[key] = ws.data.ptr
            h = self.handles[key] = hp.value
        return h

    def lt_lib(self):
        if self.lt is None:
            self.lt = CublasLt()
        return self.lt

    def lt_handle(self, ordinal):
        h = self.lt_handles.get(ordinal)
        if h is None:
            hp = ctypes.c_void_p()
            with cupy.cuda.Device(ordinal):
                check(self.lt.Create(ctypes.byref(hp)), "cublasLtCreate")
            h = self.lt_handles[ordinal] = hp.value
        return h


# ---- GEMM steps ------------------------------------------------------------------------------
def bind_matmul(dev, pool, a, b, out, stream, tune=GEMM_TUNE, devices=None):
    """Step: out = a @ b on local devices `devices` (positions j; None: all).  `tune`: how many
    cuBLASLt candidates to time (SHARDFUSE_GEMM_TUNE)."""
    js = tuple(range(len(dev.ordinals))) if devices is None else tuple(devices)
    lay = gemm_layout(a, b, out)
    pre, post = [], []
    if lay is None:  # stage operands cuBLAS cannot read in place through contiguous scratch
        def staged(ref):
            buf = dev.empty(ref.shape, ref.dtype, devices)  # (on the step's devices only)
            return Ref(-1, (0,) * len(dev.ordinals), ref.shape, contiguous_strides(ref.shape), ref.dtype), buf

        x, y, o = a, b, out
        if gemm_layout(a, b, out) is None:
            x, xa = staged(a)
            pre.append((a, xa))
            y, yb = staged(b)
            pre.append((b, yb))
            if gemm_layout(x, y, out) is None:
                o, ob = staged(out)
                post.append((out, ob))
        lay = gemm_layout(x, y, o)
        if lay is None:
            raise NotImplementedError(f"cupy_nccl: matmul {a.shape} @ {b.shape} -> {out.shape}: no cuBLAS layout")
        gemm = bind_gemm(dev, pool, x, y, o, stream, lay, {id(x): pre and pre[0][1], id(y): pre and pre[1][1],
                                                           id(o): post and post[0][1]}, tune, js)
        copies_in = [_stage_copy(dev, src, buf, stream, True, js) for src, buf in pre]
        copies_out = [_stage_copy(dev, dst, buf, stream, False, js) for dst, buf in post]

        def step(bufs):
            for c in copies_in:
                c(bufs)
            gemm(bufs)
            for c in copies_out:
                c(bufs)
        return step
    return bind_gemm(dev, pool, a, b, out, stream, lay, {}, tune, js)


def _stage_copy(dev, ref, buf, stream, into, js):
    streams = [(j, dev.stream(j, stream)) for j in js]

    def step(bufs):
        for j, s in streams:
            with cupy.cuda.Device(dev.ordinals[j]), s:
                v = dev.view(bufs, ref, j)
                if into:
                    buf[j][...] = v
                else:
                    v[...] = buf[j]
    return step


def bind_gemm(dev, pool, a, b, out, stream, lay, fixed, tune, js):
    """The step of cuBLAS calls of layout `lay` (gemm_layout's) on local devices js (positions j);
    `fixed` maps id(ref) of a staged operand to its scratch buffers (fixed pointers instead of a
    slot)."""
    m, n, k, opa, lda, opb, ldb, ldc, swap, inner, outer = lay
    dt = out.dtype
    if not (a.dtype == b.dtype == dt):
        raise TypeError(f"cupy_nccl: matmul dtypes {a.dtype} @ {b.dtype} -> {dt}")
    if dt == "float64":
        comp, one, zero = COMPUTE_64F, ctypes.c_double(1.0), ctypes.c_double(0.0)
    else:
        comp = COMPUTE_32F_TF32 if (dt == "float32" and TF32) else COMPUTE_32F
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    item = ITEM[dt]
    first, second = (b, a) if swap else (a, b)
    if swap:
        outer = [(ob * item, oa * item, oc * item) for (oa, ob, oc) in outer]
    else:
        outer = [(oa * item, ob * item, oc * item) for (oa, ob, oc) in outer]
    cb = pool.lib()
    nd = len(js)
    handles = [pool.handle(j, stream) for j in js]  # (one per device of js, in its order)

    def source(ref):  # (slot, byte offsets) or (None, fixed pointers) of a staged operand
        buf = fixed.get(id(ref))
        if buf:
            return None, [x.data.ptr for x in buf]
        return ref.slot, offsets_bytes(ref)

    (s1, o1), (s2, o2), (so, oo) = source(first), source(second), source(out)
    # everything a step needs, resolved now; alpha/beta (keep) must outlive the step
    g = SimpleNamespace(dims=(m, n, k, opa, lda, opb, ldb, ldc), inner=inner, outer=outer, dt=dt, item=item,
                        ctype=CUDA_T[dt], comp=comp, alpha=ctypes.addressof(one), beta=ctypes.addressof(zero),
                        keep=(one, zero), src=(s1, o1, s2, o2, so, oo), ptrs=_pointers(s1, o1, s2, o2, so, oo),
                        handles=handles, ords=dev.ordinals, multi=not dev.one_gpu, nd=nd, js=js,
                        whole=nd == len(dev.ordinals))  # whole: every local device (one batch can serve them)
    if inner is None and pool.api == "lt" and len(outer) == 1 and None not in (s1, s2, so):
        step = _lt_step(dev, pool, g, stream, tune, _ex_step(g, cb.gemm))
        if step is not None:
            return step
    if inner is None:
        return _ex_step(g, cb.gemm)
    return _batched_step(g, cb)


def _pointers(s1, o1, s2, o2, so, oo):
    """ptrs(bufs, j): the three operands' pointers on device j."""
    if s1 is None or s2 is None or so is None:
        def ptrs(bufs, j):
            return ((o1[j] if s1 is None else bufs[s1][j].data.ptr + o1[j]),
                    (o2[j] if s2 is None else bufs[s2][j].data.ptr + o2[j]),
                    (oo[j] if so is None else bufs[so][j].data.ptr + oo[j]))
    else:
        def ptrs(bufs, j):
            return bufs[s1][j].data.ptr + o1[j], bufs[s2][j].data.ptr + o2[j], bufs[so][j].data.ptr + oo[j]
    return ptrs


def _lt_step(dev, pool, g, stream, tune_count, unaligned):
    """One pre-bound cublasLtMatmul per device, tuned once per GPU (virtual devices of a GPU share
    its plan), or None when cuBLASLt has no algorithm.  The algorithm is chosen for pointers at
    the alignment of the operands' offsets (odd sizes put chunks anywhere); a call whose base
    pointers are less aligned (a caller's array may start anywhere) runs `unaligned` instead:
    cublasGemmEx, which reads any pointer."""
    lt = pool.lt_lib()
    m, n, k, opa, lda, opb, ldb, ldc = g.dims
    alpha, beta, item, dt, keep = g.alpha, g.beta, g.item, g.dt, g.keep
    s1, o1, s2, o2, so, oo = g.src
    d1, d2, d3 = g.outer[0]
    plans, calls = {}, []  # GPU -> its cuBLASLt plan; per device of js: (j, GPU, pa, pb, pc, args, offsets)
    align = alignment(*(x + d for j in g.js for x, d in ((o1[j], d1), (o2[j], d2), (oo[j], d3))))
    mask = align - 1
    for j in g.js:
        o = g.ords[j]
        lh, ws, sp = pool.lt_handle(o), pool.ws_ptr[(o, stream)], dev.stream(j, stream).ptr
        if o not in plans:
            with cupy.cuda.Device(o):
                plans[o] = _lt_plan_for(lt, lh, ws, sp, o, g, tune_count, align)
            if plans[o] is None:
                return None
        args, pa, pb, pc = _prebound(lh, plans[o], alpha, beta, ws, sp)
        calls.append((j, o, pa, pb, pc, args, (o1[j] + d1, o2[j] + d2, oo[j] + d3)))
    mm, what, held = lt.MatmulPrebound, f"cublasLtMatmul (m={m} n={n} k={k} {dt})", (keep, plans)
    if g.nd == 1:  # the hot path, kept short: one device, one GEMM
        ((j0, _, pa, pb, pc, args, (x1, x2, x3)),) = calls

        def step(bufs, _keep=held):
            a, b, c = bufs[s1][j0].data.ptr + x1, bufs[s2][j0].data.ptr + x2, bufs[so][j0].data.ptr + x3
            if (a | b | c) & mask:
                return unaligned(bufs)
            pa.value, pb.value, pc.value = a, b, c
            st = mm(*args)
            if st:
                check(st, what)
        return step
    multi = g.multi  # several GPUs: each call on its own GPU; virtual devices of one GPU in turn

    def step(bufs, _keep=held):
        A, B, C = bufs[s1], bufs[s2], bufs[so]
        for j, o, pa, pb, pc, args, (x1, x2, x3) in calls:
            if multi:
                runtime.setDevice(o)
            a, b, c = A[j].data.ptr + x1, B[j].data.ptr + x2, C[j].data.ptr + x3
            if (a | b | c) & mask:  # (the devices before j compute their product again: the same values)
                return unaligned(bufs)
            pa.value, pb.value, pc.value = a, b, c
            st = mm(*args)
            if st:
                check(st, f"{what}, device {j}")
    if multi or not g.whole:
        return step
    # virtual devices of one GPU: one strided-batched call where their operands allow
    o = g.ords[0]
    lh, ws, sp = pool.lt_handle(o), pool.ws_ptr[(o, stream)], dev.stream(0, stream).ptr

    def bind_batched(strides):
        # the per-device plan's descriptor and algorithm over batched layouts: each matrix is
        # computed as by the per-device call (eager and graph replay agree to the bit), and
        # nothing is tuned or synchronised, so this may bind inside a graph capture too
        desc, _, _, _, algo, _ = plan = plans[o]
        keep = []
        lays = lt_layouts(lt, g.ctype, opa, opb, m, n, k, lda, ldb, ldc, keep, (g.nd,) + strides)
        return (*_prebound(lh, (desc, *lays, algo, None), alpha, beta, ws, sp), (keep, plan, held))

    return gemm_shared.one_gpu_step(step, bind_batched, mm, (s1, s2, so), [c[6] for c in calls], item,
                                    ldc * n * item, what, align)


def _prebound(lh, plan, alpha, beta, ws, sp):
    """cublasLtMatmul's arguments as ctypes objects, made once (a call only sets the values of
    the three data pointers pa, pb, pc): (args, pa, pb, pc).  The plan's objects are kept alive
    by whoever holds `plan`."""
    desc, la, lb, lc, algo, _ = plan
    pa, pb, pc = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    args = tuple([ctypes.c_void_p(x) for x in (lh, desc, alpha)] + [
        pa, ctypes.c_void_p(la), pb, ctypes.c_void_p(lb), ctypes.c_void_p(beta), pc, ctypes.c_void_p(lc), pc,
        ctypes.c_void_p(lc), ctypes.c_void_p(algo), ctypes.c_void_p(ws), ctypes.c_size_t(WORKSPACE),
        ctypes.c_void_p(sp)])
    return args, pa, pb, pc


def _lt_plan_for(lt, lh, ws, sp, ordinal, g, tune_count, align):
    """The cuBLASLt plan (lt_plan's) of g's problem on one GPU for pointers that are multiples of
    `align` bytes, its algorithm tuned there."""
    m, n, k, opa, lda, opb, ldb, ldc = g.dims
    alpha, beta, item = g.alpha, g.beta, g.item
    sizes = (lda * (k if opa == OP_N else m), ldb * (n if opb == OP_N else k), ldc * n)

    def tune(desc, la, lb, lc, algos):
        return fastest(lambda algo, p: lt.Matmul(lh, desc, alpha, p[0], la, p[1], lb, beta, p[2], lc, p[2], lc,
                                                  algo, ws, WORKSPACE, sp), algos, sizes, item, sp)

    return lt_plan(lt, lh, ordinal, g.comp, COMPUTE_SCALE[g.comp], g.ctype, opa, opb, m, n, k, lda, ldb, ldc,
                   WORKSPACE, tune=tune if tune_count > 1 else None, count=tune_count, align=align)


def _ex_step(g, fn):
    """cublasGemmEx: one call per device and outer batch offset."""
    m, n, k, opa, lda, opb, ldb, ldc = g.dims
    alpha, beta, ctype, comp, dt, keep = g.alpha, g.beta, g.ctype, g.comp, g.dt, g.keep
    s1, o1, s2, o2, so, oo = g.src
    handles, outer = g.handles, g.outer
    if g.nd == 1 and len(outer) == 1 and s1 is not None and s2 is not None and so is not None:
        # the common case, kept short: one device, one GEMM
        h0, (d1, d2, d3), j0 = handles[0], outer[0], g.js[0]
        o1_, o2_, oo_ = o1[j0] + d1, o2[j0] + d2, oo[j0] + d3

        def step(bufs, _keep=keep):
            st = fn(h0, opa, opb, m, n, k, alpha, bufs[s1][j0].data.ptr + o1_, ctype, lda,
                    bufs[s2][j0].data.ptr + o2_, ctype, ldb, beta, bufs[so][j0].data.ptr + oo_, ctype, ldc,
                    comp, GEMM_DEFAULT)
            if st:
                check(st, f"cublasGemmEx (m={m} n={n} k={k} {dt})")
        return step

    return _each_device(g, lambda h, a, b, c: fn(h, opa, opb, m, n, k, alpha, a, ctype, lda, b, ctype, ldb, beta, c,
                                                 ctype, ldc, comp, GEMM_DEFAULT),
                        f"cublasGemmEx (m={m} n={n} k={k} {dt})")


def _each_device(g, call, what):
    """The step that calls call(handle, a, b, c) per local device of g.js and outer batch offset."""
    handles, outer, ords, multi, ptrs = list(zip(g.js, g.handles)), g.outer, g.ords, g.multi, g.ptrs

    def step(bufs, _keep=g.keep):
        for j, h in handles:
            if multi:
                runtime.setDevice(ords[j])
            p1, p2, p3 = ptrs(bufs, j)
            for d1, d2, d3 in outer:
                st = call(h, p1 + d1, p2 + d2, p3 + d3)
                if st:
                    check(st, what)
    return step


def _batched_step(g, cb):
    """cublasGemmStridedBatchedEx: the inner batch in one call, per device and outer offset (the
    virtual devices of one GPU in one call where they allow)."""
    fn = cb.gemm_batched
    m, n, k, opa, lda, opb, ldb, ldc = g.dims
    alpha, beta, ctype, comp, dt = g.alpha, g.beta, g.ctype, g.comp, g.dt
    cnt, sa, sb, sc = g.inner
    what = f"cublasGemmStridedBatchedEx (m={m} n={n} k={k} batch={cnt} {dt})"
    each = _each_device(g, lambda h, a, b, c: fn(h, opa, opb, m, n, k, alpha, a, ctype, lda, sa, b, ctype, ldb, sb,
                                                 beta, c, ctype, ldc, sc, cnt, comp, GEMM_DEFAULT), what)
    s1, o1, s2, o2, so, oo = g.src
    if g.multi or not g.whole or g.nd == 1 or len(g.outer) != 1 or None in (s1, s2, so):
        return each
    # virtual devices of one GPU: their batches as one batch where they lie one batch apart, the
    # call's arguments built once (only the three base pointers are set per call)
    (d1, d2, d3), item = g.outer[0], g.item
    offsets = [(o1[j] + d1, o2[j] + d2, oo[j] + d3) for j in g.js]
    pa, pb, pc = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    i, ll = ctypes.c_int, ctypes.c_longlong
    args = (ctypes.c_void_p(g.handles[0]), i(opa), i(opb), i(m), i(n), i(k), ctypes.c_void_p(alpha), pa, i(ctype),
            i(lda), ll(sa), pb, i(ctype), i(ldb), ll(sb), ctypes.c_void_p(beta), pc, i(ctype), i(ldc), ll(sc),
            i(cnt * len(offsets)), i(comp), i(GEMM_DEFAULT))
    call = cb.gemm_batched_prebound

    def batched(a, b, c, total, _keep=g.keep):
        pa.value, pb.value, pc.value = a, b, c
        return call(*args)

    return gemm_shared.nested_batch_step(each, batched, (s1, s2, so), offsets, (sa * item, sb * item, sc * item),
                                         cnt, what)
