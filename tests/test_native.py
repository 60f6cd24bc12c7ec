"""Feels native (issue 16, first items): Python scalars on either side of + - * /, NumPy ufuncs on
traced values, the version, readable reprs."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import pytest

import shardfuse as sf

CASES = {
    "x + 2": (lambda x: x + 2, lambda x: x + 2), "2 + x": (lambda x: 2 + x, lambda x: 2 + x),
    "x - 2.5": (lambda x: x - 2.5, lambda x: x - 2.5), "2.5 - x": (lambda x: 2.5 - x, lambda x: 2.5 - x),
    "3 * x": (lambda x: 3 * x, lambda x: 3 * x), "x / 4": (lambda x: x / 4, lambda x: x / 4),
    "4 / x": (lambda x: 4 / x, lambda x: 4 / x), "np.float32(2) + x": (lambda x: np.float32(2) + x, lambda x: 2 + x),
    "np.exp(x)": (lambda x: np.exp(x), np.exp), "np.tanh(x)": (lambda x: np.tanh(x), np.tanh),
    "np.add(x, x)": (lambda x: np.add(x, x), lambda x: 2 * x),
    "np.matmul(x, x.T)": (lambda x: np.matmul(x, x.T), lambda x: x @ x.T), "np.negative(x)": (np.negative, np.negative),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("sharded", [False, True])
def test_scalars_and_numpy_functions_inside_jit(name, sharded):
    mesh = sf.DeviceMesh(2, backend="numpy")
    fn, ref = CASES[name]
    x = np.random.default_rng().uniform(0.5, 2.0, (4, 6))
    f = sf.jit((lambda x: fn(sf.shard(x, axis=0))) if sharded else fn, mesh=mesh)
    np.testing.assert_allclose(f(x).gather(), ref(x), rtol=1e-12)


def test_a_scalar_added_to_a_pending_sum_is_added_once():
    mesh = sf.DeviceMesh(2, backend="numpy")
    rng = np.random.default_rng()
    a, b = rng.standard_normal((4, 6)), rng.standard_normal((6, 3))
    f = sf.jit(lambda a, b: 1.0 - sf.shard(a, axis=1) @ sf.shard(b, axis=0), mesh=mesh)
    np.testing.assert_allclose(f(a, b).gather(), 1.0 - a @ b, rtol=1e-12)  # not 1.0 per device


def test_other_numpy_functions_and_bools_are_refused_with_what_to_write():
    mesh = sf.DeviceMesh(2, backend="numpy")
    with pytest.raises(TypeError, match=r"np\.fmod is not supported on traced shardfuse values \(inside sf\.jit\); "
                                        r"supported: .*np\.exp"):
        sf.jit(lambda x: np.fmod(x, 2.0), mesh=mesh)(np.ones((2, 2)))
    with pytest.raises(TypeError, match="both operands must be values"):
        sf.jit(lambda x: x + "1", mesh=mesh)(np.ones((2, 2)))


def test_version_and_reprs():
    try:
        installed = version("shardfuse")
    except PackageNotFoundError:  # run from a source tree never installed (the GPU machine's recipe)
        installed = "0+unknown"
    assert sf.__version__ == installed
    r = subprocess.run([sys.executable, "-m", "shardfuse", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"shardfuse {sf.__version__}"
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda x: x * 2.0, mesh=mesh)
    f(np.ones((2, 2)))
    assert repr(f) == "sf.jit(<lambda>, mesh=DeviceMesh(DIDx=2, backend=numpy), streams=4, graph=False; 1 plan(s) compiled)"


def test_every_public_name_has_a_docstring():
    missing = [n for n in sf.__all__ if not (getattr(getattr(sf, n), "__doc__", None) or "").strip()]
    assert not missing, f"no docstring: {missing}"


def test_backend_mistakes_fail_where_they_are_made():
    mesh = sf.DeviceMesh(2, backend="numpy")
    with pytest.raises(NotImplementedError, match="graph=True captures CUDA graphs: it needs the cupy backend"):
        sf.jit(lambda x: x * 2.0, mesh=mesh, graph=True)
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r'needs CuPy .*pip install -e "\.\[gpu\]"'):
            sf.DeviceMesh(2, backend="cupy")


def test_array_repr_names_its_placements_and_mesh_and_shows_small_values():
    """Its values where they are small and in this one process (a DTensor probe: a loss cell showed no
    number, where JAX's and DTensor's do); shape= where large or donated."""
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    a = sf.shard(np.arange(4.0).reshape(2, 2), axis=0, over="DIDy", mesh=mesh)
    where = "placements=('S(0)', 'R'), mesh=DeviceMesh(DIDy=2, DIDx=2, backend=numpy))"
    assert repr(a) == "sf.Array([[0., 1.],\n          [2., 3.]], dtype=float64, " + where
    assert repr(sf.jit(lambda x: x.sum(), mesh=mesh)(a)).startswith("sf.Array(6., dtype=float64, placements=('R', 'R')")
    big = sf.shard(np.ones((200, 100)), axis=0, over="DIDy", mesh=mesh)
    assert repr(big) == "sf.Array(shape=(200, 100), dtype=float64, " + where
    sf.jit(lambda x: x * 2, mesh=mesh, donate_argnums=0)(a)
    assert repr(a).startswith("sf.Array(shape=(2, 2), dtype=float64")


def test_under_a_launcher_without_mpi4py_the_error_says_what_to_install():
    code = ("import sys; sys.modules['mpi4py'] = None\n"  # as if mpi4py were not installed
            "import shardfuse as sf\nsf.DeviceMesh(2, backend='numpy')")
    env = {**__import__("os").environ, "PMI_RANK": "0", "PMI_SIZE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and 'needs mpi4py' in r.stderr and 'pip install -e ".[mpi]"' in r.stderr, r.stderr


def test_one_process_never_imports_mpi4py():
    code = "import sys\nimport numpy as np, shardfuse as sf\nm = sf.DeviceMesh(2, backend='numpy')\n" \
           "sf.jit(lambda x: sf.shard(x, 0) * 2.0, mesh=m)(np.ones((2, 2))).gather()\nprint('mpi4py' in sys.modules)"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                                                         "PMIX_RANK", "MPI_LOCALRANKID")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_visualize_sharding_shows_who_holds_which_block():
    mesh = sf.DeviceMesh((2, 2), backend="numpy")
    a = sf.shard(np.ones((8, 6)), axis=0, over="DIDy", mesh=mesh)
    pic = sf.visualize_sharding(a)
    assert pic.rows == [(0, 4), (4, 8)] and pic.cols == [(0, 6)] and pic.holders == [[[0, 1]], [[2, 3]]]
    assert "| 0,1 |  rows 0:4" in str(pic) and "| 2,3 |  rows 4:8" in str(pic)
    b = sf.shard(np.ones(8), axis=0, over=("DIDy", "DIDx"), mesh=mesh)  # 1-D, over both mesh axes
    assert sf.visualize_sharding(b).cols == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert sf.visualize_sharding(b).holders == [[[0], [1], [2], [3]]]
    assert "<table" in pic._repr_html_() and "S(0)" in a._repr_html_() and "<table" in a._repr_html_()
    with pytest.raises(ValueError, match="1 or 2 axes"):
        sf.visualize_sharding(sf.shard(np.ones((2, 2, 2)), axis=0, mesh=mesh))


def test_plan_html_counts_collectives_and_folds():
    one = sf.DeviceMesh(1, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=one)
    h = f.lower(np.ones((2, 1, 2, 3)), np.ones((3, 2)))._repr_html_()
    assert "collectives per call: none" in h and "1 one-device collective(s) folded" in h and "<pre" in h


def test_compile_and_bind_decisions_are_logged_not_printed(caplog, capsys):
    import logging

    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, max_plans=1)
    with caplog.at_level(logging.INFO, logger="shardfuse"):
        f(np.ones((4, 2, 3, 5)), np.ones((5, 2)))
        f(np.ones((2, 2, 3, 5)), np.ones((5, 2)))  # a second shape evicts the first plan
    text = caplog.text
    assert "compiled plan '<lambda>' for f64[4, 2:DIDx, 3, 5], f64[5, 2]" in text
    assert "stream loops of [4] chunks, collectives per call {'allgather': 4}" in text
    assert "bound plan '<lambda>' on numpy" in text and "dropped the least recently used plan" in text
    assert capsys.readouterr().out == ""  # the library prints nothing


def test_calls_by_keyword_bind_as_in_python():
    mesh = sf.DeviceMesh(2, backend="numpy")

    @sf.jit(mesh=mesh)
    def f(a, b, c=None):
        return a @ b if c is None else a @ b + c
    rng = np.random.default_rng()
    x, w, c = rng.standard_normal((4, 3)), rng.standard_normal((3, 2)), rng.standard_normal(2)
    np.testing.assert_allclose(f(x, b=w).gather(), x @ w, rtol=1e-12)
    np.testing.assert_allclose(f(b=w, a=x).gather(), x @ w, rtol=1e-12)
    np.testing.assert_allclose(f(a=x, b=w, c=c).gather(), x @ w + c, rtol=1e-12)
    with pytest.raises(TypeError, match="b not given, but a later parameter is"):
        f(x, c=c)
    with pytest.raises(TypeError, match="unexpected keyword argument 'd'"):
        f(x, w, d=1)
