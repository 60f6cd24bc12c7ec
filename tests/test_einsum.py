"""np.einsum and np.tensordot (shardfuse/numpy_einsum.py), inside sf.jit and on sf.Arrays outside it,
against NumPy in float64 on fresh random inputs (never zero), on a 1-D mesh of 4 and a 2x2 mesh with
the operands sharded on their first, last or contracted axes: the subscripts a transformer uses
("bsh,hd->bsd", "bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", the weight gradient "bsd,bsh->dh"), explicit,
implicit and "..." forms, broadcasting labels of extent 1, three operands, transposes and sums of
one operand, NumPy's result dtypes (integers and booleans too: no GEMM), the collectives the
lowering issues (none where the layouts fit, one Allreduce for a sharded contraction), and the
refusals.  Gradients: tests/test_grad.py; under mpiexec: tests/mpi/test_user_port_mpi.py."""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
import test_elementwise_ops as ew
from shardfuse.dtypes import np_dtype
from test_math_ops import TOL, inputs, mesh_of

# name -> (subscripts, operand shapes); every extent divides by 4 where an axis may be sharded
EINSUM = {
    "linear bsh,hd->bsd": ("bsh,hd->bsd", [(4, 8, 12), (12, 8)]),
    "scores bhqd,bhkd->bhqk": ("bhqd,bhkd->bhqk", [(2, 4, 8, 4), (2, 4, 8, 4)]),
    "values bhqk,bhkd->bhqd": ("bhqk,bhkd->bhqd", [(2, 4, 8, 8), (2, 4, 8, 4)]),
    "weight gradient bsd,bsh->dh": ("bsd,bsh->dh", [(4, 8, 12), (4, 8, 4)]),
    "matmul ij,jk": ("ij,jk", [(8, 12), (12, 4)]),
    "transposed ij,jk->ki": ("ij,jk->ki", [(8, 12), (12, 4)]),
    "ellipsis ...ij,...jk->...ik": ("...ij,...jk->...ik", [(4, 1, 8, 4), (2, 4, 8)]),
    "implicit ellipsis ...ij,jk": ("...ij,jk", [(4, 8, 12), (12, 4)]),
    "dot i,i": ("i,i", [(12,), (12,)]),
    "outer i,j->ij": ("i,j->ij", [(8,), (4,)]),
    "broadcast label ij,ij->ij": ("ij,ij->ij", [(8, 12), (1, 12)]),
    "extent 1 contracted ij,jk->ik": ("ij,jk->ik", [(8, 12), (1, 4)]),
    "three abc,cd,de->abe": ("abc,cd,de->abe", [(4, 8, 12), (12, 4), (4, 8)]),
    "two contracted abc,bcd->ad": ("abc,bcd->ad", [(8, 4, 12), (4, 12, 8)]),
    "free axes on both xab,ay,bz->xyz": ("xab,ay,bz->xyz", [(4, 8, 12), (8, 4), (12, 8)]),
    "batch and free abc,ad->bcd": ("abc,ad->bcd", [(8, 4, 12), (8, 4)]),
    "transpose ij->ji": ("ij->ji", [(8, 12)]),
    "sum ij->": ("ij->", [(8, 12)]),
    "row sums bij->bi": ("bij->bi", [(4, 8, 12)]),
    "implicit transpose ba": ("ba", [(8, 12)]),
    "mixed case aB,Bc": ("aB,Bc", [(8, 12), (12, 4)]),
    "diagonal ii->i": ("ii->i", [(8, 8)]),
    "trace ii": ("ii", [(8, 8)]),
    "batched diagonal bii->bi": ("bii->bi", [(4, 8, 8)]),
    "batched trace ...ii->...": ("...ii->...", [(4, 8, 8)]),
    "diagonal times a matrix ii,ij->j": ("ii,ij->j", [(8, 8), (8, 12)]),
    "three-way diagonal iii->i": ("iii->i", [(4, 4, 4)]),
    "diagonal kept apart jii->ij": ("jii->ij", [(4, 8, 8)]),
}
# how the operands are placed: a mesh, and per operand a spec (axes it would shard beyond its rank dropped)
LAYOUTS = {
    "1d R": (4, lambda shape: (None,) * len(shape)),
    "1d first": (4, lambda shape: ("DIDx",) + (None,) * (len(shape) - 1)),
    "1d last": (4, lambda shape: (None,) * (len(shape) - 1) + ("DIDx",)),
    "2d first two": ((2, 2), lambda shape: (("DIDy", "DIDx") + (None,) * len(shape))[:len(shape)]),
    "2d (y,x) first": ((2, 2), lambda shape: ((("DIDy", "DIDx"),) + (None,) * len(shape))[:len(shape)]),
}


def placed(x, mesh, spec_of):
    """x with spec_of(its shape), a mesh axis dropped where it does not divide the extent (an axis of 1)."""
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    spec = tuple(a if a is None or x.shape[k] % np.prod([sizes[n] for n in np.atleast_1d(a)]) == 0 else None
                 for k, a in enumerate(spec_of(x.shape)))
    return sf.distribute(x, mesh, spec)


def check_einsum(name, mesh, spec_of, jit, rng, dtype="float64"):
    """EINSUM[name] on operands placed by spec_of: NumPy's shape and dtype, its values in float64."""
    subscripts, shapes = EINSUM[name]
    xs = [inputs(False, dtype, rng, s) for s in shapes]
    args = [placed(x, mesh, spec_of) for x in xs]
    fn = lambda *v: np.einsum(subscripts, *v)  # noqa: E731
    got = (sf.jit(fn, mesh=mesh) if jit else fn)(*args)
    want = np.einsum(subscripts, *(x.astype(np.float64) if dtype != "bool" else x for x in xs))
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert got.dtype == np_dtype(dtype), (name, got.dtype)  # (the operands' own: NumPy's einsum promotes them)
    g = np.asarray(got.gather())
    if g.dtype.kind in "biu":
        np.testing.assert_array_equal(g, want.astype(g.dtype))
    else:  # (a contraction's error grows with its length)
        n = max(int(np.prod(s)) for s in shapes) ** 0.5
        np.testing.assert_allclose(g.astype(np.float64), want, rtol=TOL[dtype] * n, atol=TOL[dtype] * n)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(EINSUM))
def test_einsum_on_every_layout(name, layout, jit):
    shape, spec_of = LAYOUTS[layout]
    check_einsum(name, mesh_of(shape), spec_of, jit, np.random.default_rng(51))


@pytest.mark.parametrize("dtype", ew.DTYPES + ("int32", "int64", "bool"))
@pytest.mark.parametrize("name", ["linear bsh,hd->bsd", "scores bhqd,bhkd->bhqk", "two contracted abc,bcd->ad",
                                  "sum ij->", "outer i,j->ij", "three abc,cd,de->abe"])
def test_einsum_in_every_dtype(name, dtype):
    check_einsum(name, mesh_of(4), LAYOUTS["1d first"][1], True, np.random.default_rng(52), dtype)


def test_einsum_promotes_as_numpy():
    mesh = mesh_of(4)
    rng = np.random.default_rng(53)
    a, b = rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((12, 4)).astype(np.float16)
    got = np.einsum("ij,jk", sf.shard(a, axis=0, mesh=mesh), b)
    assert got.dtype == np.einsum("ij,jk", a, b).dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


# ---- what the lowering communicates --------------------------------------------------------------------
def _dp_tp():
    return sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")


def test_transformer_einsums_communicate_as_their_matmuls():
    mesh, rng = _dp_tp(), np.random.default_rng(54)
    x, w = rng.standard_normal((4, 8, 12)), rng.standard_normal((12, 8))
    f = sf.jit(lambda x, w: np.einsum("bsh,hd->bsd", sf.shard(x, axis=0, over="dp"), sf.shard(w, axis=1, over="tp")),
               mesh=mesh)
    traced = str(f.trace(x, w))
    assert traced.count("matmul(") == 1 and "transpose" not in traced.lower(), traced  # (x @ w as it is)
    assert f.lower(x, w).collectives() == {}
    assert f(x, w).sharding.axes == ("dp", None, "tp")
    row = sf.jit(lambda x, w: np.einsum("bsh,hd->bsd", sf.shard(x, axis=2, over="tp"), sf.shard(w, axis=0, over="tp")),
                 mesh=mesh)  # (Megatron's row-parallel layer: the contraction sharded, one Allreduce)
    assert row.lower(x, w).collectives() == {"allreduce": 1}
    np.testing.assert_allclose(np.asarray(row(x, w)), np.einsum("bsh,hd->bsd", x, w), rtol=1e-13, atol=1e-13)
    q, k = rng.standard_normal((2, 4, 8, 4)), rng.standard_normal((2, 4, 8, 4))
    att = sf.jit(lambda q, k: np.einsum("bhqd,bhkd->bhqk", sf.shard(q, axis=1, over="tp"),
                                        sf.shard(k, axis=1, over="tp")), mesh=mesh)
    assert att.lower(q, k).collectives() == {}  # (heads sharded: each device its heads)
    np.testing.assert_allclose(np.asarray(att(q, k)), np.einsum("bhqd,bhkd->bhqk", q, k), rtol=1e-13, atol=1e-13)


def test_weight_gradient_einsum_is_one_allreduce_over_dp():
    mesh, rng = _dp_tp(), np.random.default_rng(55)
    x, g = rng.standard_normal((4, 8, 12)), rng.standard_normal((4, 8, 4))
    f = sf.jit(lambda x, g: np.einsum("bsd,bsh->dh", sf.shard(x, axis=0, over="dp"), sf.shard(g, axis=0, over="dp")),
               mesh=mesh)
    assert f.lower(x, g).collectives() == {"allreduce": 1}
    np.testing.assert_allclose(np.asarray(f(x, g)), np.einsum("bsd,bsh->dh", x, g), rtol=1e-13, atol=1e-13)


# ---- tensordot -----------------------------------------------------------------------------------------
TENSORDOT = {
    "axes=2": ((4, 8, 12), (8, 12, 4), 2),
    "axes=1": ((4, 8, 12), (12, 4), 1),
    "axes=0 (outer)": ((4, 8), (4,), 0),
    "pairs": ((4, 8, 12), (12, 8, 4), ([1, 2], [1, 0])),
    "negative axes": ((4, 8, 12), (12, 4, 8), ([-1, 1], [0, -1])),
    "int pair": ((8, 12), (4, 12), (1, 1)),
}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(TENSORDOT))
def test_tensordot(name, layout, jit):
    sa, sb, axes = TENSORDOT[name]
    shape, spec_of = LAYOUTS[layout]
    mesh, rng = mesh_of(shape), np.random.default_rng(56)
    a, b = inputs(False, "float64", rng, sa), inputs(False, "float64", rng, sb)
    fn = lambda x, y: np.tensordot(x, y, axes)  # noqa: E731
    got = (sf.jit(fn, mesh=mesh) if jit else fn)(placed(a, mesh, spec_of), placed(b, mesh, spec_of))
    want = np.tensordot(a, b, axes)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got.gather()), want, rtol=1e-13, atol=1e-13)


# ---- refusals ------------------------------------------------------------------------------------------
REFUSED = [
    (lambda x: np.einsum("ii->i", x), ValueError, r"np.einsum\('ii->i'\): the repeated subscript 'i' has extents 8 "
                                                  r"and 12 in .* \(a diagonal needs them equal\)"),
    (lambda x: np.einsum(x, [0, 1]), TypeError, r"takes the subscripts as a string.*interleaved form"),
    (lambda x: np.einsum("ij", x, out=x), TypeError, r"np.einsum with out= is not supported"),
    (lambda x: np.einsum("ij,j", x, [1.0] * 12), TypeError, r"the operands must be arrays .* got list"),
    (lambda x: np.einsum("ij,jk", x, x), ValueError, r"np.einsum\('ij,jk'\): the subscript 'j' has extents 12 and 8"),
    (lambda x: np.einsum("ij,jk->il", x, x.T), ValueError, r"the output subscript 'l' appears in no operand"),
    (lambda x: np.einsum("ij->ii", x), ValueError, r"the output subscript 'i' appears more than once"),
    (lambda x: np.einsum("i", x), ValueError, r"operand 0 has 2 axes for the 1 subscripts 'i' \(no \.\.\."),
    (lambda x: np.einsum("i1", x), ValueError, r"invalid subscript '1' in operand 0"),
    (lambda x: np.einsum("ij", x, x), ValueError, r"1 operand subscripts for 2 operands"),
    (lambda x: np.einsum("i...->i", x), ValueError, r"broadcast axes \(\.\.\.\) but the output names no '\.\.\.'"),
    (lambda x: np.tensordot(x, x, 1), ValueError, r"np.tensordot: shape-mismatch for sum: axis 1 .* has 12 elements"),
    (lambda x: np.tensordot(x, x, ([0], [0, 1])), ValueError, r"np.tensordot: 1 axes of a for 2 of b"),
    (lambda x: np.tensordot(x, x, ([0, 0], [0, 0])), ValueError, r"np.tensordot: a repeated axis"),
]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("k", range(len(REFUSED)))
def test_refusals_say_what_is_wrong(k, jit):
    fn, error, match = REFUSED[k]
    mesh = mesh_of(4)
    xa = sf.shard(np.random.default_rng(57).standard_normal((8, 12)), axis=0, mesh=mesh)
    with pytest.raises(error, match=match):
        (sf.jit(fn, mesh=mesh) if jit else fn)(xa)

