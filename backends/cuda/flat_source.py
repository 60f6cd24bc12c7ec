"""The CUDA source of a Fused step (passes/fuse.py) as one RawKernel over the flat index of its
result, the shapes and every operand's strides baked in: axes along which every array is laid
out contiguously merged first, each remaining index recovered by division by a constant (a
multiply and a shift), and a broadcast operand read through stride 0.  CuPy's ElementwiseKernel,
which this replaces for results of one axis or more, takes shapes and strides as arguments and
divides by them at run time for every element.  Each node is computed and rounded exactly as in
a row group (rows_source.Emitter), so the values are the unfused steps' bit for bit where the
math library agrees.  No CuPy import: the source is built and read on machines without a GPU
(tests/test_flat_kernel_on_host.py compiles it with g++ and runs it on host threads)."""
from __future__ import annotations

import functools
import hashlib
import math

from shardfuse.backends.cuda.rows_source import PREAMBLE, PTR, STORE, Emitter, aligned

THREADS = 256


def merged_axes(shape, strides_of) -> tuple:
    """(shape, [strides of each array]) with axes of extent 1 dropped and each axis merged into the
    next where every array steps over it as one run with the next (stride == next stride * extent)."""
    keep = [d for d, n in enumerate(shape) if n != 1]
    shape, strides_of = [shape[d] for d in keep], [[st[d] for d in keep] for st in strides_of]
    d = len(shape) - 2
    while d >= 0:
        if all(st[d] == st[d + 1] * shape[d + 1] for st in strides_of):
            shape[d:d + 2] = [shape[d] * shape[d + 1]]
            for st in strides_of:
                st[d:d + 2] = [st[d + 1]]
        d -= 1
    return tuple(shape), [tuple(st) for st in strides_of]


@functools.lru_cache(maxsize=512)
def source(expr, in_dtypes, in_layouts, out) -> tuple:
    """(CUDA source, kernel name, threads per block, blocks) of the Fused step expr over operands of
    in_dtypes with in_layouts ((shape, strides) each, in elements, broadcasting to out's shape),
    writing out = (dtype, shape, strides); out's shape has one axis or more."""
    dtype, shape, out_strides = out
    arrays = [aligned(sh, st, shape) for sh, st in in_layouts] + [tuple(out_strides)]
    axes, strides_of = merged_axes(tuple(shape), arrays)
    total = math.prod(shape)
    body = ["long long rem = i, ix;"] + [f"long long o{k} = 0;" for k in range(len(arrays))]
    for d in reversed(range(len(axes))):
        adds = "".join(f" o{k} += ix * {st[d]}LL;" for k, st in enumerate(strides_of) if st[d])
        body.append(f"ix = rem % {axes[d]}LL; rem /= {axes[d]}LL;{adds}" if d else f"ix = rem;{adds}")
    emit = Emitter(in_dtypes, [0] * len(in_dtypes), {})
    value = emit(expr)
    body += emit.lines + [f"y[o{len(in_layouts)}] = {STORE[dtype].format(value)};"]
    params = [f"const {PTR[d]}* __restrict__ x{k}" for k, d in enumerate(in_dtypes)] + [f"{PTR[dtype]}* __restrict__ y"]
    text = (f"extern \"C\" __global__ void NAME({', '.join(params)}) {{\n"
            f"    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {total}LL;"
            f" i += (long long)gridDim.x * blockDim.x) {{\n        " + "\n        ".join(body) + "\n    }\n}\n")
    name = "sf_flat_" + hashlib.sha1(text.encode()).hexdigest()[:16]
    blocks = min(-(-total // THREADS), 2**31 - 1)  # (past the grid's limit a thread takes several elements)
    return PREAMBLE + text.replace("NAME", name, 1), name, THREADS, blocks
