"""The CUDA source of Fused steps (backends/cuda/flat_source.py) run on the host, by the g++ harness
of tests/test_rows_kernel_on_host.py (one block of HOST_THREADS host threads takes every element in
its grid-stride loop), against the NumPy backend's evaluation of the same expression
(elementwise_numpy.schedule / evaluate, node by node in each node's dtype).  The expressions are the
Fused steps sf.jit makes of a bias + GELU, a masked and cast score, and GELU written op by op; each
is run over operands laid out contiguously, broadcast (stride 0), transposed and sliced, and into
a strided result, so the flat index's division into axes, the merged axes and every operand's
offset are checked without a GPU (tests/test_gpu.py runs the kernels on one)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.cuda import flat_source
from shardfuse.backends.elementwise_numpy import evaluate, schedule
from shardfuse.dtypes import np_dtype
from shardfuse.ops import Op
from test_rows_kernel_on_host import HOST_THREADS, TOL, compiled

# (rows of 33: a thread per element; of 64: VEC elements per thread, flat_source.vector_path)
SHAPE, VECTOR_SHAPE = (4, 6, 33), (2, 3, 64)
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def gelu_formula(x):
    return x * 0.5 * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# name: (fn, operands as (shape of the case's shape, dtype or None for the case's dtype))
FUNCTIONS = {
    "bias gelu": (lambda x, b: sf.nn.gelu(x + b), [(lambda s: s, None), (lambda s: s[-1:], None)]),
    "masked score": (lambda x, m, y: sf.where(m, x * 0.125, -1e4).astype("float32") + y,
                     [(lambda s: s, None), (lambda s: (1, *s[1:]), "bool"), (lambda s: s, "float32")]),
    "gelu formula": (gelu_formula, [(lambda s: s, None)]),
}
# how each full-shape operand is laid out: a NumPy view of that shape over a larger base
LAYOUTS = {
    "contiguous": lambda a: a,
    "transposed": lambda a: np.ascontiguousarray(a.transpose(2, 1, 0)).transpose(2, 1, 0),
    "sliced": lambda a: np.concatenate([a, a], axis=-1)[..., ::2],
    # (one element past an aligned start: the vector path's loads and stores go element by element)
    "misaligned": lambda a: np.concatenate([a.ravel()[:1], a.ravel()])[1:].reshape(a.shape),
}


def fused_steps(fn, args) -> list:
    plan = sf.jit(fn, mesh=sf.DeviceMesh(1, backend="numpy")).lower(*args)
    steps = [i for i in plan.program.walk() if i.op == Op.FUSED]
    assert steps, plan
    return steps


def operands(r, spec):
    """Fresh random arrays of (shape, dtype) each: masks about 60% True, floats standard normal."""
    return [r.random(shape) < 0.6 if dt == "bool" else r.standard_normal(shape).astype(np_dtype(dt)) for shape, dt in spec]


def layout(a):
    """((shape, strides in elements), the view's address)."""
    return (a.shape, tuple(s // a.itemsize for s in a.strides)), a.ctypes.data


def numpy_result(expr, views, dtype, shape):
    steps = schedule(expr, len(views))
    slots = list(views) + [np.empty(shape, np_dtype(dt)) for *_, dt in steps]
    with np.errstate(all="ignore"):
        evaluate(np, steps, slots)
    return slots[-1].astype(dtype)


def test_axes_merge_where_every_array_runs_on():
    contiguous = (198, 33, 1)
    assert flat_source.merged_axes(SHAPE, [contiguous, contiguous]) == ((792,), [(1,), (1,)])
    assert flat_source.merged_axes(SHAPE, [contiguous, (0, 0, 1)]) == ((24, 33), [(33, 1), (0, 1)])
    assert flat_source.merged_axes(SHAPE, [contiguous, (1, 4, 24)]) == (SHAPE, [contiguous, (1, 4, 24)])
    assert flat_source.merged_axes((1, 5, 1), [(5, 1, 1)]) == ((5,), [(1,)])


def test_one_run_compiles_once_for_every_size():
    """A step whose arrays merge into one run has one source for every size (the count is the
    kernel's parameter); a broadcast along a row keeps its row's length baked in (a division by it)."""
    r = np.random.default_rng(0)
    step = (fused_steps(lambda a, b: sf.nn.gelu(a * b + 1.0), operands(r, [(SHAPE, "float32")] * 2)))[0]
    expr = step.attrs["expr"]

    def kernel(shape, b_shape):
        laid = ((shape, tuple(int(np.prod(shape[d + 1:])) for d in range(len(shape)))),
                (b_shape, tuple(int(np.prod(b_shape[d + 1:])) for d in range(len(b_shape)))))
        return flat_source.source(expr, ("float32", "float32"), laid, ("float32", shape, laid[0][1]))
    vec = flat_source.VEC
    for small, large, counts in [((4, 33), (1001, 65), (132, 65065)), ((4, 2 * vec), (999, 8 * vec), (8, 999 * 8))]:
        a, b = kernel(small, small), kernel(large, large)
        assert a[:3] == b[:3] and (a[4], b[4]) == counts
    assert kernel((4, 33), (33,))[0] != kernel((4, 34), (34,))[0]


def test_vector_path_where_each_run_starts_at_a_whole_vec():
    vec = flat_source.VEC
    assert flat_source.vector_path((3, 8 * vec), [(8 * vec, 1), (0, 1), (0, 0), (8 * vec, 1)])
    assert not flat_source.vector_path((3, 8 * vec), [(8 * vec + 1, 1), (8 * vec, 1)])  # (rows of a wider array)
    assert not flat_source.vector_path((3, 8 * vec + 1), [(8 * vec + 1, 1), (8 * vec + 1, 1)])
    assert not flat_source.vector_path((8 * vec, 3), [(1, 8 * vec), (3, 1)])  # (an operand read across)
    assert not flat_source.vector_path((8 * vec,), [(1,), (2,)])  # (a strided result)


@pytest.mark.parametrize("shape", [SHAPE, VECTOR_SHAPE])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_kernels_on_the_host_equal_numpy(name, dtype, shape, tmp_path):
    fn, spec = FUNCTIONS[name]
    r = np.random.default_rng()
    seed = r.bit_generator.state["state"]["state"]
    cases = []
    for step in fused_steps(fn, operands(r, [(of(shape), dt or dtype) for of, dt in spec])):  # (float16: two)
        expr, out_dtype = step.attrs["expr"], step.into.type.dtype
        ins = [(v.type.shape, v.type.dtype) for v in step.ins]  # (the step's operands: a baked constant too)
        for how, place in LAYOUTS.items():
            views = [place(a) if a.shape == shape else a for a in operands(r, ins)]
            base = np.full(shape + (2,), np.nan, np_dtype(out_dtype))
            out = base[..., 1] if how == "sliced" else base[..., 0].copy()  # (a strided result, or a contiguous one)
            if how == "misaligned":
                out = np.full(out.size + 1, np.nan, out.dtype)[1:].reshape(shape)
            laid = [layout(v) for v in views]
            src, kname, threads, blocks, count = flat_source.source(
                expr, tuple(v.dtype.name for v in views), tuple(lay for lay, _ in laid),
                (out_dtype, shape, layout(out)[0][1]))
            # (rows of 64, or every operand whole: 792 elements in one run)
            vector = how in ("contiguous", "misaligned") and (shape == VECTOR_SHAPE or all(v.shape == shape for v in views))
            assert ("sf_vec<" in src) == vector, (how, shape)
            each = flat_source.VEC if vector else 1
            assert count == int(np.prod(shape)) // each and threads == flat_source.THREADS
            assert blocks == -(-count // threads)
            cases.append((how, expr, views, laid, out, src, kname, np.array(count, np.int64)))
    lib = compiled(list(dict.fromkeys((src, kname) for *_, src, kname, _ in cases)), tmp_path)
    for how, expr, views, laid, out, _, kname, count in cases:
        ptrs = [p for _, p in laid] + [out.ctypes.data, count.ctypes.data]
        getattr(lib, f"launch_{kname}")((ctypes.c_void_p * len(ptrs))(*ptrs), HOST_THREADS)
        want = numpy_result(expr, views, out.dtype, shape).astype(np.float64)
        got = out.astype(np.float64)
        assert not np.isnan(got).any(), f"seed {seed}: unwritten elements ({name}, {how})"
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= TOL[dtype], f"seed {seed}: {err:.2e} from NumPy's evaluation ({name}, {how}, {dtype})"
