"""The CUDA source of FusedRows steps (backends/cuda/rows_source.py) run on the host: the kernel's
text is compiled as C++ by the machine's g++ with one thread per block (threadIdx 0, blockDim 1,
so each block reduction is its one value; the device's warp shuffles and shared memory are not
exercised here, the GPU tests do that), bfloat16 and float16 through the same bit conversions
(_Float16 for PTX's cvt.rn), and compared with the NumPy backend's evaluation of the same
expression (elementwise_numpy.row_schedule).  What this checks without a GPU: each operand's
offsets from the row index and its broadcast strides, the sweeps per reduction level, every node's
rounding to its dtype, sums' factors, per-element and per-row results."""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.cuda import rows_source
from shardfuse.backends.cuda.csource import BF16_PREAMBLE
from shardfuse.backends.elementwise_numpy import evaluate_rows, row_schedule
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op
from shardfuse.strides import contiguous_strides
import test_fused_rows as tfr

HOST = r"""
#include <cmath>
#include <cstring>
using namespace std;
struct Dim { unsigned x; };
static Dim threadIdx = {0}, blockIdx = {0}, blockDim = {1}, gridDim = {1};
#define __global__
#define __device__
#define __restrict__
#define __shared__ static
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
static inline float h2f(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h; }
static inline unsigned short d2h(double f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h; }
template <typename T> static inline T sf_max(T a, T b) { return (b > a || b != b) ? b : a; }
template <typename T> static inline T sf_min(T a, T b) { return (b < a || b != b) ? b : a; }
template <typename T> static inline T sf_add(T a, T b) { return a + b; }
template <typename T> static inline T block_sum(T v, double*) { return v; }
template <typename T> static inline T block_max(T v, double*) { return v; }
template <typename T> static inline T block_min(T v, double*) { return v; }
""" + BF16_PREAMBLE
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
_STORAGE = {"bfloat16": np.uint16, "float16": np.uint16}


def compiled(sources, tmp_path):
    """The kernels' texts (their CUDA preamble left out) in one host library."""
    cpp = tmp_path / "rows.cpp"
    cpp.write_text(HOST + "\n".join(s[len(rows_source.PREAMBLE):] for s in sources))
    lib = tmp_path / "rows.so"
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(lib), str(cpp)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def run_on_host(lib, name, arrays, results):
    """The kernel over contiguous arrays; its results ((dtype, shape) each: NaN where never written)."""
    outs = [np.full(shape, np.nan, np_dtype(dt)) for dt, shape in results]
    ptrs = [np.ascontiguousarray(a) for a in arrays] + outs
    getattr(lib, name)(*[ctypes.c_void_p(a.ctypes.data) for a in ptrs])
    return outs


def groups(fn, args):
    """The FusedRows steps of fn's plan on one NumPy device."""
    plan = sf.jit(fn, mesh=sf.DeviceMesh(1, backend="numpy")).lower(*args)
    return [i for i in plan.program.walk() if i.op == Op.FUSED_ROWS]


def operand(r, v):
    shape = v.type.shape
    if v.type.dtype == "bool":
        m = r.random(shape) < 0.7
        m[..., 0] = True
        return m
    return tfr.randn(r, shape, v.type.dtype)


@pytest.mark.parametrize("n", [1, 7, 33, 1000])
@pytest.mark.parametrize("dtype", tfr.DTYPES)
@pytest.mark.parametrize("fn", list(tfr.CASES), ids=lambda f: f.__name__)
def test_kernels_on_the_host_equal_numpy(fn, dtype, n, tmp_path):
    r, seed = tfr.fresh_rng()
    steps = groups(fn, tfr.make_args(fn, r, dtype, (2, 3, n)))
    assert len(steps) == tfr.CASES[fn] or (n == 1 and steps), steps  # (rows of 1: a norm's backward groups apart)
    made, more_seen = [], 0
    for i in steps:
        layouts = tuple((v.type.shape, contiguous_strides(v.type.shape)) for v in i.ins)
        results = [(v.type.dtype, v.type.shape) for v in (i.into, *i.outs)]
        exprs = (i.attrs["expr"], *i.attrs.get("more", ()))
        specs = [(dt, shape, contiguous_strides(shape)) for dt, shape in results]
        src, name, threads, rows = rows_source.source(exprs[0], tuple(v.type.dtype for v in i.ins), layouts, specs[0],
                                                      tuple(zip(exprs[1:], specs[1:])))
        assert rows == 6 and threads == rows_source.threads_for(n)
        made.append((i, src, name, results, exprs))
        more_seen += len(exprs) - 1
    if fn in (tfr.softmax_bwd, tfr.log_softmax_bwd) and dtype in ("float16", "bfloat16"):
        assert more_seen, "the forward's float32 y and its cast: one step writing both"
    lib = compiled([s for _, s, *_ in made], tmp_path)
    for i, _, name, results, exprs in made:
        arrays = [operand(r, v) for v in i.ins]
        got = run_on_host(lib, name, arrays, results)
        sched, roots = row_schedule(exprs, [a.shape for a in arrays])
        slots = arrays + [np.empty(shape, np_dtype(dt)) for *_, dt, shape in sched]
        evaluate_rows(np, sched, slots)
        for g, k, (_, shape) in zip(got, roots, results):
            want, g64 = slots[k].reshape(shape).astype(np.float64), g.astype(np.float64)
            assert np.array_equal(np.isnan(g64), np.isnan(want)), f"seed {seed}: NaN where NumPy has none ({i})"
            ok = ~np.isnan(want)
            err = np.linalg.norm(g64[ok] - want[ok]) / max(np.linalg.norm(want[ok]), 1e-300)
            assert err <= TOL[dtype], f"seed {seed}: {err:.2e} from NumPy's evaluation ({dtype}, n={n}):\n{i}"
