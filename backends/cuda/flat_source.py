"""The CUDA source of a Fused step (passes/fuse.py) as one RawKernel over the flat index of its
result, the shapes and every operand's strides baked in: axes along which every array is laid
out contiguously merged first, each remaining index recovered by division by a constant (a
multiply and a shift), and a broadcast operand read through stride 0.  The count of elements (or
of vectors) is a parameter, not baked: a step whose arrays merge into one axis (every operand
whole or a scalar, the common case) has one source for every size, so a model compiles it once
rather than once per shape.  CuPy's ElementwiseKernel,
which this replaces for results of one axis or more, takes shapes and strides as arguments and
divides by them at run time for every element.  Each node is computed and rounded exactly as in
a row group (rows_source.Emitter), so the values are the unfused steps' bit for bit where the
math library agrees.  No CuPy import: the source is built and read on machines without a GPU
(tests/test_flat_kernel_on_host.py compiles it with g++ and runs it on host threads).

Where the last merged axis is a whole number of VEC elements and every array runs along it (stride
1) or broadcasts over it (stride 0), a thread takes VEC consecutive elements: each operand's VEC as
one load of up to 16 bytes, the result as one store.  One 2-byte element per thread left an H100's
bf16 kernels at a quarter of its memory bandwidth (benchmarks/elementwise_probe.py).  The vector
access needs each running array's address aligned, which only the launch knows (a chunk's or a
device's view of a buffer starts anywhere): the kernel checks it and otherwise reads and writes
the same VEC elements one by one."""
from __future__ import annotations

import functools
import hashlib
import math

from shardfuse.backends.cuda.rows_source import PREAMBLE, PTR, STORE, Emitter, aligned


THREADS = 256
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "bool": 1}
VEC = 8  # elements per thread on the vector path (16 bytes of bfloat16 / float16)
# (a struct of VEC elements, aligned as one access of up to 16 bytes: the loads and stores the
# vector path makes; `alignas` rather than CUDA's __align__, so the host harness compiles it)
# (guarded: sources side by side in one file, as the host harness builds them, define it once)
VEC_PREAMBLE = """
#ifndef SF_VEC
#define SF_VEC
template <typename T, int N> struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) sf_vec { T v[N]; };
#endif
"""


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


def vector_path(axes, strides_of) -> bool:
    """Whether a thread can take VEC consecutive elements as one access per array: the last merged
    axis a whole number of VECs, every array's stride along it 1 (the last array, the result's,
    exactly 1) or 0, and each running array's other strides whole VECs (each run starts aligned
    wherever the array's first element is)."""
    if not axes or axes[-1] % VEC:
        return False
    runs = [st for st in strides_of if st[-1] == 1]
    return strides_of[-1][-1] == 1 and all(st[-1] in (0, 1) for st in strides_of) and \
        all(s % VEC == 0 for st in runs for s in st[:-1])


def _offsets(axes, strides_of) -> list:
    """Statements setting o{k}, array k's offset of flat index i, from i's index along each axis."""
    body = ["long long rem = i, ix;"] + [f"long long o{k} = 0;" for k in range(len(strides_of))]
    for d in reversed(range(len(axes))):
        adds = "".join(f" o{k} += ix * {st[d]}LL;" for k, st in enumerate(strides_of) if st[d])
        body.append(f"ix = rem % {axes[d]}LL; rem /= {axes[d]}LL;{adds}" if d else f"ix = rem;{adds}")
    return body


def _vector_body(value_lines, store, in_dtypes, out_dtype, runs) -> list:
    """Statements for the VEC elements from flat index i: each running operand k (in `runs`) into a
    local sf_vec a{k}, by one aligned load where `aligned`, else element by element, read through a
    pointer x{k} to it (hiding the parameter; a broadcast operand is read where it is); the results
    into r, stored likewise."""
    vec = lambda dt: f"sf_vec<{PTR[dt]}, {VEC}>"  # noqa: E731
    body = []
    for k in runs:
        body.append(f"{vec(in_dtypes[k])} a{k}; if (aligned) a{k} = *(const {vec(in_dtypes[k])}*)(x{k} + o{k}); "
                    f"else for (int c = 0; c < {VEC}; ++c) a{k}.v[c] = x{k}[o{k} + c];")
    hide = " ".join(f"const {PTR[in_dtypes[k]]}* x{k} = a{k}.v; const long long o{k} = 0;" for k in runs)
    body.append(f"{vec(out_dtype)} r; {{ {hide}\n        #pragma unroll\n        for (int c = 0; c < {VEC}; ++c) "
                f"{{ {' '.join(value_lines)} r.v[c] = {store}; }} }}")
    n = len(in_dtypes)
    body.append(f"if (aligned) *({vec(out_dtype)}*)(y + o{n}) = r; else for (int c = 0; c < {VEC}; ++c) y[o{n} + c] = r.v[c];")
    return body


@functools.lru_cache(maxsize=512)
def source(expr, in_dtypes, in_layouts, out) -> tuple:
    """(CUDA source, kernel name, threads per block, blocks, count) of the Fused step expr over operands of
    in_dtypes with in_layouts ((shape, strides) each, in elements, broadcasting to out's shape),
    writing out = (dtype, shape, strides); out's shape has one axis or more.  On the vector path
    (vector_path) a thread takes VEC elements.  The kernel's last parameter is count (long long n):
    the elements, or the vectors of VEC, it computes."""
    dtype, shape, out_strides = out
    arrays = [aligned(sh, st, shape) for sh, st in in_layouts] + [tuple(out_strides)]
    axes, strides_of = merged_axes(tuple(shape), arrays)
    total = math.prod(shape)
    params = [f"const {PTR[d]}* __restrict__ x{k}" for k, d in enumerate(in_dtypes)] + \
        [f"{PTR[dtype]}* __restrict__ y", "const long long n"]
    if vector_path(axes, strides_of):
        emit = Emitter(in_dtypes, [st[-1] for st in strides_of[:-1]], {})
        value = emit(expr)
        runs = [k for k, st in enumerate(strides_of[:-1]) if st[-1] == 1]
        sizes = [(k, min(16, VEC * ITEMSIZE[in_dtypes[k]])) for k in runs]
        check = " && ".join([f"(unsigned long long)x{k} % {a} == 0" for k, a in sizes] +
                            [f"(unsigned long long)y % {min(16, VEC * ITEMSIZE[dtype])} == 0"])
        body = [f"const long long i = v * {VEC}LL;"] + _offsets(axes, strides_of) + \
            _vector_body(emit.lines, STORE[dtype].format(value), in_dtypes, dtype, runs)
        head, index, count = f"    const bool aligned = {check};\n", "v", total // VEC
    else:
        emit = Emitter(in_dtypes, [0] * len(in_dtypes), {})
        value = emit(expr)
        body = _offsets(axes, strides_of) + emit.lines + [f"y[o{len(in_layouts)}] = {STORE[dtype].format(value)};"]
        head, index, count = "", "i", total
    text = (f"extern \"C\" __global__ void NAME({', '.join(params)}) {{\n{head}"
            f"    for (long long {index} = (long long)blockIdx.x * blockDim.x + threadIdx.x; {index} < n;"
            f" {index} += (long long)gridDim.x * blockDim.x) {{\n        " + "\n        ".join(body) + "\n    }\n}\n")
    name = "sf_flat_" + hashlib.sha1(text.encode()).hexdigest()[:16]
    blocks = min(-(-count // THREADS), 2**31 - 1)  # (past the grid's limit a thread takes several elements)
    return PREAMBLE + VEC_PREAMBLE + text.replace("NAME", name, 1), name, THREADS, blocks, count
