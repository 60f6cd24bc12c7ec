"""How a matmul of Refs maps onto cuBLAS calls (column-major, at most one strided batch per call):
plain Python, no CUDA, so the layout can be read and tested anywhere."""
from __future__ import annotations

from shardfuse.backends.cuda.libs import OP_N, OP_T


def _operand(p, r, s0, s1):
    """(op, ld) to read a (p x r) matrix with element strides (s0, s1) as cuBLAS (column-major) wants."""
    if s0 == 1 or p == 1:
        ld = s1 if r > 1 else max(p, 1)
        if ld >= max(1, p):
            return OP_N, ld
    if s1 == 1 or r == 1:
        ld = s0 if p > 1 else max(r, 1)
        if ld >= max(1, r):
            return OP_T, ld
    return None


def gemm_layout(a, b, out):
    """Plan a matmul of Refs as cuBLAS calls.

    Returns (m, n, k, opA, lda, opB, ldb, ldc, swap, inner, outer) where swap says the first
    cuBLAS operand is b (row-major output), inner is (count, strideA, strideB, strideC) or
    None, and outer is a list of (offA, offB, offC) element offsets (one cuBLAS call each).
    """
    ob = tuple(out.shape[:-2])
    nb = len(ob)

    def batch(ref):
        pad = nb - (len(ref.shape) - 2)
        return [0] * pad + [0 if n == 1 else s for n, s in zip(ref.shape[:-2], ref.strides[:-2])]

    ba, bb, bo = batch(a), batch(b), batch(out)
    if min(ba + bb + bo, default=0) < 0:  # a reversed batch axis (x[::-1]): the caller stages it contiguous
        return None                       # rather than trust cuBLAS(Lt) batch strides below zero (untested)
    M, K = a.shape[-2:]
    N = out.shape[-1]
    if b.shape[-2] != K or b.shape[-1] != N or out.shape[-2] != M:
        raise ValueError(f"matmul shapes {a.shape} @ {b.shape} -> {out.shape}")
    ars, acs = a.strides[-2:]
    brs, bcs = b.strides[-2:]
    ors, ocs = out.strides[-2:]
    dims = [(n, x, y, z) for n, x, y, z in zip(ob, ba, bb, bo) if n != 1]
    # fold batch dims into the rows when b is shared and a, out nest them above their rows
    while dims:
        n, x, y, z = dims[-1]
        rs_a, rs_o = (x, z) if M == 1 else (ars, ors)
        if y == 0 and x == M * rs_a and z == M * rs_o and (acs == 1 or K == 1) and (ocs == 1 or N == 1):
            M *= n
            ars, ors = rs_a, rs_o
            dims.pop()
        else:
            break
    if ocs == 1 or N == 1:  # row-major C: compute C^T = B^T A^T, column-major (N x M), ldc = row stride
        ldc = ors if M > 1 else max(N, 1)
        if ldc < max(1, N):
            return None
        pa, pb = _operand(N, K, bcs, brs), _operand(K, M, acs, ars)
        swap, m, n = True, N, M
    elif ors == 1 or M == 1:
        ldc = ocs if N > 1 else max(M, 1)
        pa, pb = _operand(M, K, ars, acs), _operand(K, N, brs, bcs)
        swap, m, n = False, M, N
    else:
        return None
    if pa is None or pb is None:
        return None
    inner = None
    if dims:
        cnt, x, y, z = dims[-1]
        inner = (cnt, y, x, z) if swap else (cnt, x, y, z)
        dims = dims[:-1]
    outer = [(0, 0, 0)]
    for cnt, x, y, z in dims:
        outer = [(oa + t * x, obb + t * y, oc + t * z) for (oa, obb, oc) in outer for t in range(cnt)]
    return m, n, K, pa[0], pa[1], pb[0], pb[1], ldc, swap, inner, outer
