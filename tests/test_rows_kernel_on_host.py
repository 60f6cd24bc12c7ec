"""The CUDA source of FusedRows steps (backends/cuda/rows_source.py) run on the host: the kernel's
text, its device preamble included (block reductions, bfloat16's bits), is compiled as C++20 by the
machine's g++ and run by one host thread per CUDA thread of a block of two warps (HOST_THREADS; on a
GPU rows_source.threads_for gives 32 to 512, or 256 for eight rows of a warp each), with
__syncthreads as a barrier of those threads and a warp shuffle as a write, a barrier of the warp and
a read of the partner's slot; one block takes every row in turn (gridDim 1), each kernel built both
ways (a block per row, and a warp per row: two rows at a time, each warp its own).  float16 goes through _Float16 where the device uses PTX's cvt.rn.  Each result is
compared with the NumPy backend's evaluation of the same expressions (elementwise_numpy.row_schedule).
What this checks without a GPU: each operand's offsets from the row index and its broadcast strides,
the strided sweeps per reduction level and the block reductions over several warps, every node's
rounding, sums' factors, per-element and per-row results, a step's further results; not the
device's memory model or its math library (the GPU tests, tests/test_gpu_fused_rows.py)."""
from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.cuda import rows_source
from shardfuse.backends.elementwise_numpy import evaluate_rows, row_schedule
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op
from shardfuse.strides import contiguous_strides
import test_fused_rows as tfr

HOST = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using namespace std;
struct Dim { unsigned x; };
static thread_local Dim threadIdx = {0};
static Dim blockIdx = {0}, blockDim = {32}, gridDim = {1};
static std::barrier<>* sf_bar = nullptr;
static std::barrier<>* sf_warp_bar[32];
static double sf_lanes[1024];
#define __global__
#define __device__
#define __restrict__
#define __shared__ static
static inline void __syncthreads() { sf_bar->arrive_and_wait(); }
template <typename T> static T sf_shuffle(T v, unsigned from) {  // (the warp's own barrier: warps of a
    std::barrier<>* bar = sf_warp_bar[threadIdx.x >> 5];       // block may take different rows)
    sf_lanes[threadIdx.x] = (double)v;
    bar->arrive_and_wait();
    T r = (T)sf_lanes[from];
    bar->arrive_and_wait();
    return r;
}
template <typename T> static T __shfl_xor_sync(unsigned, T v, int o) { return sf_shuffle(v, threadIdx.x ^ o); }
template <typename T> static T __shfl_sync(unsigned, T v, int lane) { return sf_shuffle(v, (threadIdx.x & ~31u) + lane); }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
static inline float h2f(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h; }
static inline unsigned short d2h(double f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h; }
""" + "\n".join(line for line in rows_source.PREAMBLE.splitlines() if "asm(" not in line)
# host threads per block: two warps (the kernel's loops and reductions take any whole number of warps;
# the GPU's 32 to 512 threads as OS threads meeting at every barrier would take minutes on two cores)
HOST_THREADS = 64
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}


def launcher(text, name) -> str:
    """A host function running kernel `name` on `threads` host threads, its pointers in an array."""
    params = re.search(rf"void {name}\((.*?)\) {{", text).group(1).split(", ")
    # (a pointer parameter from its slot; a value parameter, `const long long n`, read where its slot points)
    args = ", ".join(f"({p.split('* __restrict__')[0]}*)a[{k}]" if "*" in p else f"*({p.rsplit(' ', 1)[0]}*)a[{k}]"
                     for k, p in enumerate(params))
    return (f'extern "C" void launch_{name}(void** a, int threads) {{ std::barrier<> bar(threads); sf_bar = &bar; '
            f"std::vector<std::unique_ptr<std::barrier<>>> warps; for (int w = 0; w < threads / 32; ++w) "
            f"{{ warps.emplace_back(new std::barrier<>(32)); sf_warp_bar[w] = warps.back().get(); }} "
            f"blockDim.x = threads; std::vector<std::thread> ts; for (int t = 0; t < threads; ++t) "
            f"ts.emplace_back([=] {{ threadIdx.x = t; {name}({args}); }}); for (auto& th : ts) th.join(); }}")


def compiled(kernels, tmp_path):
    """The kernels ((source, name) each, their CUDA preamble left out) and their launchers, one library."""
    texts = [(src[len(rows_source.PREAMBLE):], name) for src, name in kernels]
    cpp = tmp_path / "rows.cpp"
    cpp.write_text(HOST + "\n" + "\n".join(t + "\n" + launcher(t, name) for t, name in texts))
    lib = tmp_path / "rows.so"
    # (-fsanitize=alignment: x86 reads misaligned vectors silently; a wrong alignment check on the vector
    # path would pass unseen, so a misaligned access aborts the run here, as it faults on a GPU)
    subprocess.run(["g++", "-std=c++20", "-O0", "-pthread", "-shared", "-fPIC", "-fsanitize=alignment",
                    "-fno-sanitize-recover=alignment", "-o", str(lib), str(cpp)], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(lib))


def run_on_host(lib, name, threads, arrays, results):
    """The kernel over contiguous arrays; its results ((dtype, shape) each: NaN where never written)."""
    outs = [np.full(shape, np.nan, np_dtype(dt)) for dt, shape in results]
    ptrs = [np.ascontiguousarray(a) for a in arrays] + outs
    getattr(lib, f"launch_{name}")((ctypes.c_void_p * len(ptrs))(*[a.ctypes.data for a in ptrs]), threads)
    return outs


def operand(r, v, shape):
    """Random values of v's dtype (a mask with column 0 set), of `shape`: floats in [0.25, 2.25).  (Not
    of either sign: an operand a step sums, such as a norm's squares, can then cancel to near 0, and
    a root of that sum magnifies the summation order's rounding past any fixed tolerance: a row of
    33 summing to 0.005 gave rsqrt 2.3e-5 apart in float32 between the warp's and NumPy's orders.)"""
    if v.type.dtype == "bool":
        m = r.random(shape) < 0.7
        m[..., 0] = True
        return m
    return (0.25 + 2 * r.random(shape)).astype(np_dtype(v.type.dtype))


def _with_rows(shape, n):
    """shape with its row length (the plans' ROW) made n."""
    return tuple(shape[:-1]) + (n if shape[-1] == ROW else shape[-1],)


def kernels_of(fn, dtype, r):
    """{n: [(step, layouts, source, name, results, exprs)]} of fn's FusedRows steps (planned over rows
    [2, 3, ROW]) for rows of each length n in LENGTHS, each as a block per row and as a warp per row:
    an Expr holds no shape, so one plan serves."""
    plan = sf.jit(fn, mesh=sf.DeviceMesh(1, backend="numpy")).lower(*tfr.make_args(fn, r, dtype, (2, 3, ROW)))
    steps = [i for i in plan.program.walk() if i.op == Op.FUSED_ROWS]
    assert len(steps) == tfr.CASES[fn], plan
    out = {}
    for n in LENGTHS:
        out[n] = []
        for i in steps:
            layouts = tuple((_with_rows(v.type.shape, n), contiguous_strides(_with_rows(v.type.shape, n))) for v in i.ins)
            results = [(v.type.dtype, _with_rows(v.type.shape, n)) for v in (i.into, *i.outs)]
            exprs = (i.attrs["expr"], *i.attrs.get("more", ()))
            specs = [(dt, shape, contiguous_strides(shape)) for dt, shape in results]
            for warp in (False, True):  # (a block per row, and a warp per row: rows_source's two shapes)
                src, name, threads, blocks = rows_source.source(exprs[0], tuple(v.type.dtype for v in i.ins), layouts,
                                                                specs[0], tuple(zip(exprs[1:], specs[1:])), warp=warp)
                assert (blocks, threads) == ((1, rows_source.WARP_BLOCK) if warp else (6, rows_source.threads_for(n)))
                out[n].append((i, layouts, src, name, results, exprs))
    return out


ROW, LENGTHS = 33, (1, 33, 1000)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(every case's kernels, {(fn, dtype): kernels by row length}, the library of all of them, the seed)."""
    r, seed = tfr.fresh_rng()
    made = {(fn, dtype): kernels_of(fn, dtype, r) for fn in tfr.CASES for dtype in tfr.DTYPES}
    every = dict.fromkeys((src, name) for by_n in made.values() for ks in by_n.values() for _, _, src, name, *_ in ks)
    return made, compiled(list(every), tmp_path_factory.mktemp("rows")), r, seed


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("fn", list(tfr.CASES), ids=lambda f: f.__name__)
def test_kernels_on_the_host_equal_numpy(fn, n, built):
    made, lib, r, seed = built
    if fn in (tfr.softmax_bwd, tfr.log_softmax_bwd):  # (a 16-bit forward's y and its cast: one step, two results)
        assert any(len(k[4]) == 2 for k in made[fn, "bfloat16"][n]), made[fn, "bfloat16"][n]
    for dtype in tfr.DTYPES:
        for i, layouts, _, name, results, exprs in made[fn, dtype][n]:
            arrays = [operand(r, v, shape) for v, (shape, _) in zip(i.ins, layouts)]
            got = run_on_host(lib, name, HOST_THREADS, arrays, results)
            sched, roots = row_schedule(exprs, [a.shape for a in arrays])
            slots = arrays + [np.empty(shape, np_dtype(dt)) for *_, dt, shape in sched]
            with np.errstate(invalid="ignore"):  # (a random operand where the group takes a square root: NaN both sides)
                evaluate_rows(np, sched, slots)
            for g, k, (_, shape) in zip(got, roots, results):
                want, g64 = slots[k].reshape(shape).astype(np.float64), g.astype(np.float64)
                assert np.array_equal(np.isnan(g64), np.isnan(want)), f"seed {seed}: NaN where NumPy has none ({i})"
                ok = ~np.isnan(want)
                err = np.linalg.norm(g64[ok] - want[ok]) / max(np.linalg.norm(want[ok]), 1e-300)
                assert err <= TOL[dtype], f"seed {seed}: {err:.2e} from NumPy's evaluation ({dtype}, n={n}):\n{i}"
