"""The CUDA box-copy kernel's body (backends/cuda/box_source.py), checked on a machine without a GPU:
compiled as C++ with g++ against a stand-in for CuPy's CArray (a raw array indexed by a multi-index or
by a flat C-order index, byte strides, as CuPy's carray.cuh declares them) and run over the box's
elements on strided buffers, against NumPy's strided views placing the box as
elementwise_numpy.box_slices does (negative starts from the end, then clamped).  The GPU itself runs it
in tests/test_gpu_update_slice.py."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from shardfuse.backends.cuda.box_source import source
from shardfuse.backends.elementwise_numpy import box_slices

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to compile the kernel's body")

CARRAY = r"""
#include <cstdio>
#include <cstddef>
template <typename T, int ndim> struct CArray {  // CuPy's CArray as kernels see it: byte strides
  T* data_; ptrdiff_t shape_[ndim]; ptrdiff_t strides_[ndim];
  template <typename Int> T& operator[](const Int (&idx)[ndim]) {
    char* p = reinterpret_cast<char*>(data_);
    for (int d = 0; d < ndim; ++d) p += strides_[d] * idx[d];
    return *reinterpret_cast<T*>(p);
  }
  T& operator[](ptrdiff_t i) {
    char* p = reinterpret_cast<char*>(data_);
    for (int d = ndim; --d > 0; ) { p += strides_[d] * (i % shape_[d]); i /= shape_[d]; }
    return *reinterpret_cast<T*>(p + strides_[0] * i);
  }
};
"""
C_TYPES = {"int32": "int", "int64": "long long"}


def _array(name, shape, strides, fill) -> str:
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return (f"static double {name}_b[{size}]; for (int q = 0; q < {size}; ++q) {name}_b[q] = {fill};\n"
            f"CArray<double, {len(shape)}> {name}; {name}.data_ = {name}_b;\n"
            + "".join(f"{name}.shape_[{d}] = {n}; {name}.strides_[{d}] = {s} * 8;\n"
                      for d, (n, s) in enumerate(zip(shape, strides))))


def run_kernel(tmp_path, box, outer, inner, update, starts, src_strides, dst_strides, start_dtype):
    """dst's buffer after the kernel ran over the box (src holds 0, 1, 2, ... in its buffer, dst -1)."""
    src_shape, dst_shape = (inner, outer) if update else (outer, inner)
    c = C_TYPES[start_dtype]
    params = [f"CArray<double, {len(box)}> src"] + [f"CArray<{c}, 1> s{k}_" for k in range(len(starts))]
    main = _array("src", src_shape, src_strides, "q") + _array("dst", dst_shape, dst_strides, "-1")
    for k, v in enumerate(starts):
        main += (f"static {c} v{k}[1] = {{{v}}}; CArray<{c}, 1> a{k}; a{k}.data_ = v{k}; a{k}.shape_[0] = 1;"
                 f" a{k}.strides_[0] = sizeof({c});\n")
    args = ", ".join(["src"] + [f"a{k}" for k in range(len(starts))] + ["dst"])
    size = 1 + sum((n - 1) * s for n, s in zip(dst_shape, dst_strides))
    prog = (CARRAY + f"void kern(long long i, {', '.join(params)}, CArray<double, {len(box)}> dst) {{\n"
            f"{source(box, outer, inner, update)}\n}}\nint main() {{\n{main}"
            f"for (long long i = 0; i < {int(np.prod(inner))}; ++i) kern(i, {args});\n"
            f"for (int q = 0; q < {size}; ++q) printf(\"%.1f\\n\", dst_b[q]);\nreturn 0;\n}}\n")
    (tmp_path / "k.cpp").write_text(prog)
    subprocess.run(["g++", "-std=c++14", "-o", str(tmp_path / "k"), str(tmp_path / "k.cpp")], check=True)
    out = subprocess.run([str(tmp_path / "k")], capture_output=True, text=True, check=True).stdout
    return np.array([float(v) for v in out.split()])


def expected(box, outer, inner, update, starts, src_strides, dst_strides):
    src_shape, dst_shape = (inner, outer) if update else (outer, inner)
    bufs = [np.arange(1 + sum((n - 1) * s for n, s in zip(src_shape, src_strides)), dtype=float),
            np.full(1 + sum((n - 1) * s for n, s in zip(dst_shape, dst_strides)), -1.0)]
    src, dst = (np.lib.stride_tricks.as_strided(b, shape, [s * 8 for s in st])
                for b, shape, st in zip(bufs, (src_shape, dst_shape), (src_strides, dst_strides)))
    where = box_slices(box, [np.asarray(s) for s in starts], outer, inner)
    if update:
        dst[where] = src
    else:
        dst[...] = src[where]
    return bufs[1]


CASES = {  # box, outer, inner, update, src strides, dst strides (elements)
    "update k into a cache (k a fused QKV's slice)": ((0, 0, None, 0), (2, 4, 6, 3), (2, 4, 1, 3), True,
                                                      (36, 9, 9, 1), (72, 18, 3, 1)),
    "read two positions": ((0, 0, None, 0), (2, 4, 6, 3), (2, 4, 2, 3), False, (72, 18, 3, 1), (24, 6, 3, 1)),
    "read from a transposed cache": ((0, 0, 0, None), (2, 4, 3, 6), (2, 4, 3, 2), False, (72, 18, 1, 3),
                                     (24, 6, 2, 1)),
    "two dynamic starts and a static one": ((None, 2, None), (5, 4, 6), (2, 2, 3), True, (6, 3, 1), (24, 6, 1)),
}


@pytest.mark.parametrize("start_dtype", ["int32", "int64"])
@pytest.mark.parametrize("t", [0, 3, 9, -1, -9])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_body_places_the_box(tmp_path, case, t, start_dtype):
    box, outer, inner, update, src_st, dst_st = CASES[case]
    starts = [t, -t][:sum(s is None for s in box)]
    got = run_kernel(tmp_path, box, outer, inner, update, starts, src_st, dst_st, start_dtype)
    np.testing.assert_array_equal(got, expected(box, outer, inner, update, starts, src_st, dst_st))
