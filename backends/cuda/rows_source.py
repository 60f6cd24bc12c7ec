"""The CUDA source of a FusedRows step (passes/fuse_rows.py): one kernel per group, a warp per row
where rows are many and at most a few thousand elements long, else a thread block per row (rows:
the product of the leading axes).  Each reduction level is one sweep of the row in a strided loop
(every elementwise node recomputed from the operands in each sweep: a row of a few thousand
elements stays in L1 / L2) ending in a reduction over the row's threads (warp shuffles; in a block,
then one value per warp in shared memory, combined by every thread in the same order; either way
all threads hold the same bits); the last sweep writes the result.  Operands broadcast by strides: each operand's
offset in a row comes from the row's leading indices and its own strides (0 on a broadcast axis),
baked into the source with the shapes, so a kernel is made per group, dtypes and layout.

Each node is rounded to its dtype as the unfused step stored it: bfloat16 through its bits
(csource.BF16_PREAMBLE), float16 through PTX conversions (cvt.rn: no CuPy float16 type, which
a kernel defines only where a parameter is float16); sums accumulate in float (double for
float64) and are scaled there, max / min exactly, NaN kept as NumPy keeps it.  No CuPy import:
the source is built and read on machines without a GPU (tests/test_fused_rows.py)."""
from __future__ import annotations

import functools
import hashlib
import math

from shardfuse.backends.cuda.csource import BF16_PREAMBLE, INLINE, literal
from shardfuse.ops import Op

# per reduction node: (its combine, its reductions over a row's threads: (a block's, a warp's), the start of a row's value)
_KIND = {Op.REDUCE_MAX: ("sf_max", ("block_max", "warp_max"), float("-inf")),
         Op.REDUCE_MIN: ("sf_min", ("block_min", "warp_min"), float("inf")),
         Op.SUM: ("sf_add", ("block_sum", "warp_sum"), 0.0)}
# rows up to this long take a warp each (eight rows per block of 256 threads) where there are at least
# WARP_ROWS_FROM of them: no __syncthreads, and each lane keeps n / 32 loads in flight per sweep (a block
# per row of 2048 elements, 4 per thread, was bound by latency: 9x slower than memory on an H100)
WARP_ROW_MAX, WARP_ROWS_FROM, WARP_BLOCK = 4096, 1024, 256
PTR = {"bfloat16": "unsigned short", "float16": "unsigned short", "float32": "float", "float64": "double",
        "bool": "bool"}
_LOAD = {"bfloat16": "bf2f({})", "float16": "h2f({})"}
STORE = {"bfloat16": "f2bf((float)({}))", "float16": "f2h((float)({}))", "float32": "(float)({})",
          "float64": "(double)({})", "bool": "({})"}

PREAMBLE = BF16_PREAMBLE + r"""
__device__ inline float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ inline unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ inline unsigned short d2h(double f) { unsigned short h; asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(f)); return h; }
template <typename T> __device__ inline T sf_max(T a, T b) { return (b > a || b != b) ? b : a; }
template <typename T> __device__ inline T sf_min(T a, T b) { return (b < a || b != b) ? b : a; }
template <typename T> __device__ inline T sf_add(T a, T b) { return a + b; }
#define SF_BLOCK_REDUCE(NAME, OP) \
template <typename T> __device__ T NAME(T v, double* red) { \
    for (int o = 16; o > 0; o >>= 1) v = OP(v, (T)__shfl_xor_sync(0xffffffffu, v, o)); \
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, n = (blockDim.x + 31) >> 5; \
    if (lane == 0) red[w] = (double)v; \
    __syncthreads(); \
    T t = (T)red[0]; \
    for (int k = 1; k < n; ++k) t = OP(t, (T)red[k]); \
    __syncthreads(); \
    return t; \
}
SF_BLOCK_REDUCE(block_sum, sf_add)
SF_BLOCK_REDUCE(block_max, sf_max)
SF_BLOCK_REDUCE(block_min, sf_min)
/* a row of one warp: lane 0's value to every lane (max of +0 and -0 depends on the order) */
#define SF_WARP_REDUCE(NAME, OP) \
template <typename T> __device__ T NAME(T v) { \
    for (int o = 16; o > 0; o >>= 1) v = OP(v, (T)__shfl_xor_sync(0xffffffffu, v, o)); \
    return (T)__shfl_sync(0xffffffffu, v, 0); \
}
SF_WARP_REDUCE(warp_sum, sf_add)
SF_WARP_REDUCE(warp_max, sf_max)
SF_WARP_REDUCE(warp_min, sf_min)
"""


def _round(dtype, f, v) -> str:
    """v (of C type f) rounded to dtype, held as float (double for float64)."""
    if dtype == "bfloat16":
        return f"bf2f(f2bf((float)({v})))"
    if dtype == "float16":
        return f"h2f(d2h((double)({v})))" if f == "double" else f"h2f(f2h((float)({v})))"
    return {"float64": "(double)({})", "bool": "({})"}.get(dtype, "(float)({})").format(v)


def _levels(expr, out=None) -> dict:
    """{reduction node: its level}: 1 + the deepest level among the reductions inside its argument."""
    out = {} if out is None else out

    def depth(e):
        if e.op is None:
            return 0
        if e in out:
            return out[e]
        d = max((depth(a) for a in e.args), default=0)
        if e.op in _KIND:
            out[e] = d = d + 1
        return d
    depth(expr)
    return out


class Emitter:
    """C statements for nodes at column c of the current row (flat_source: at the element, every
    column stride 0 and each operand's offset its own), each equal node once (memo)."""

    def __init__(self, in_dtypes, col_strides, known):
        self.in_dtypes, self.col_strides = in_dtypes, col_strides
        self.memo, self.lines = dict(known), []

    def __call__(self, e) -> str:
        if e in self.memo:
            return self.memo[e]
        if e.op is None:
            cs = self.col_strides[e.arg]
            at = f"x{e.arg}[o{e.arg}{f' + c * {cs}LL' if cs else ''}]"
            self.memo[e] = _LOAD.get(self.in_dtypes[e.arg], "{}").format(at)
            return self.memo[e]
        args = [(self(a), a.dtype) for a in e.args]
        f = "double" if "float64" in (e.dtype, *(d for _, d in args)) else "float"
        name = f"t{len(self.lines)}"
        scope = [f"bool {n} = {c};" if d == "bool" else f"{f} {n} = ({f})({c});" for n, (c, d) in zip("ab", args)]
        if e.value is not None:
            scope.append(f"{f} s = ({f}){literal(e.value)};")
        value = INLINE[e.op].replace("F", f)
        if e.dtype == "bool":
            value = f"(({value}) != 0)" if e.op == Op.ASTYPE else f"({value})"
        held = {"float64": "double", "bool": "bool"}.get(e.dtype, "float")
        self.lines.append(f"{held} {name}; {{ {' '.join(scope)} {name} = {_round(e.dtype, f, value)}; }}")
        self.memo[e] = name
        return name


def aligned(shape, strides, row) -> tuple:
    """Strides (elements) of an operand along each axis of the row shape: 0 where it broadcasts."""
    pad = len(row) - len(shape)
    return tuple(0 if k < pad or shape[k - pad] == 1 else strides[k - pad] for k in range(len(row)))


def threads_for(n) -> int:
    """Threads of a row's block: about 4 elements each, a whole number of warps, 32 to 512."""
    return min(512, max(32, 1 << max(0, math.ceil(math.log2(max(1, -(-n // 4)))))))


# a sweep of the row by its threads (lane: the thread's place among them; TEAM: their number)
_SWEEP = "#pragma unroll 4\nfor (long long c = lane; c < {n}LL; c += TEAM) {{ {body} }}"


def _sweeps(levels, in_dtypes, cols, n, warp) -> tuple:
    """(statements, {reduction node: its per-row variable}): one strided sweep of the row per level,
    accumulating that level's reductions, each then combined over the row's threads and rounded."""
    body, known = [], {}
    for level in range(1, max(levels.values(), default=0) + 1):
        nodes = [e for e, lv in levels.items() if lv == level]
        emit = Emitter(in_dtypes, cols, known)
        accs, steps = [], []
        for j, e in enumerate(nodes):
            acc = "double" if e.dtype == "float64" else "float"
            combine, _, start = _KIND[e.op]
            accs.append(f"{acc} acc{level}_{j} = ({acc}){literal(start)};")
            v = emit(e.args[0])
            steps.append(f"acc{level}_{j} = {combine}(acc{level}_{j}, ({acc})({v}));")
        body += accs + [_SWEEP.format(n=n, body=" ".join(emit.lines + steps))]
        for j, e in enumerate(nodes):
            acc = "double" if e.dtype == "float64" else "float"
            block, lanes = _KIND[e.op][1]
            total = f"{lanes}(acc{level}_{j})" if warp else f"{block}(acc{level}_{j}, red)"
            if e.value is not None:
                total = f"({total} * ({acc}){literal(e.value)})"
            name = f"r{len(known)}"
            body.append(f"{'double' if e.dtype == 'float64' else 'float'} {name} = {_round(e.dtype, acc, total)};")
            known[e] = name
    return body, known


def _stores(results, in_dtypes, cols, known, n) -> list:
    """The statements writing each result ((Expr, dtype, per element?, column stride), result k into
    y{k} at its row offset oy{k}): those per element in one last sweep, those per row by thread 0."""
    body = []
    for each in (True, False):
        emit = Emitter(in_dtypes, cols, known)
        stores = [f"y{k}[oy{k}{f' + c * {cs}LL' if each else ''}] = {STORE[dt].format(emit(e))};"
                  for k, (e, dt, per_element, cs) in enumerate(results) if per_element == each]
        if stores and each:
            body.append(_SWEEP.format(n=n, body=" ".join(emit.lines + stores)))
        elif stores:
            body.append(f"if (lane == 0) {{ const long long c = 0; {' '.join(emit.lines + stores)} }}")
    return body


@functools.lru_cache(maxsize=512)
def source(expr, in_dtypes, in_layouts, out, more=(), warp=None) -> tuple:
    """(CUDA source, kernel name, threads per block, blocks) of the FusedRows step expr over operands
    of in_dtypes with in_layouts ((shape, strides) each, in elements), writing out = (dtype, shape,
    strides): per element where its shape is the rows', else one value per row; and each of `more`
    ((Expr, (dtype, shape, strides)) each: the step's further results) likewise.  A row takes a
    warp where `warp` (by default: rows of at most WARP_ROW_MAX, at least WARP_ROWS_FROM of them),
    else a block of threads_for(n) threads."""
    width = max(len(sh) for sh, _ in in_layouts)
    row = tuple(max(sh[k - width + len(sh)] if k >= width - len(sh) else 1 for sh, _ in in_layouts) for k in range(width))
    n, lead = row[-1], row[:-1]
    ins = [aligned(sh, st, row) for sh, st in in_layouts]
    outs = [(expr, out), *more]
    ys = [aligned(shape, st, row) if len(shape) == len(row) else tuple(st) + (0,) for _, (_, shape, st) in outs]
    levels = {}
    for e, _ in outs:
        _levels(e, levels)
    body = ["long long rem = row, ix;"] + [f"long long o{k} = 0;" for k in range(len(ins))]
    body += [f"long long oy{k} = 0;" for k in range(len(ys))]
    for d in reversed(range(len(lead))):
        if lead[d] == 1:
            continue
        adds = "".join(f" o{k} += ix * {s[d]}LL;" for k, s in enumerate(ins) if s[d])
        adds += "".join(f" oy{k} += ix * {y[d]}LL;" for k, y in enumerate(ys) if y[d])
        body.append(f"ix = rem % {lead[d]}LL; rem /= {lead[d]}LL;{adds}")
    cols = [s[-1] for s in ins]
    rows = math.prod(lead)
    if warp is None:
        warp = n <= WARP_ROW_MAX and rows >= WARP_ROWS_FROM
    sweeps, known = _sweeps(levels, in_dtypes, cols, n, warp)
    results = [(e, dt, tuple(shape) == row, y[-1]) for (e, (dt, shape, _)), y in zip(outs, ys)]
    body += sweeps + _stores(results, in_dtypes, cols, known, n)
    params = [f"const {PTR[d]}* __restrict__ x{k}" for k, d in enumerate(in_dtypes)]
    params += [f"{PTR[dt]}* __restrict__ y{k}" for k, (_, (dt, _, _)) in enumerate(outs)]
    # (a thread's row and place in it: by blockDim, so any whole number of warps per block runs it)
    team = "32" if warp else "(int)blockDim.x"
    text = (f"#define TEAM {team}\nextern \"C\" __global__ void NAME({', '.join(params)}) {{\n"
            f"{'' if warp else '    __shared__ double red[32];'}\n    const int lane = threadIdx.x % TEAM, per = blockDim.x / TEAM;\n"
            f"    for (long long row = (long long)blockIdx.x * per + threadIdx.x / TEAM; row < {rows}LL;"
            f" row += (long long)gridDim.x * per) {{\n        " + "\n        ".join(body) + "\n    }\n}\n#undef TEAM\n")
    name = "sf_rows_" + hashlib.sha1(text.encode()).hexdigest()[:16]
    threads = WARP_BLOCK if warp else threads_for(n)
    blocks = min(-(-rows // (threads // 32 if warp else 1)), 2**31 - 1)  # (past the grid's limit a block takes several)
    return PREAMBLE + text.replace("NAME", name, 1), name, threads, blocks
