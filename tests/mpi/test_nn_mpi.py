"""sf.nn under mpiexec (the bodies of tests/test_nn.py on the NumPy-over-MPI backend): every
function on a 1-D mesh of 4 (tp), replicated and with the reduced axis sharded, inside sf.jit and
on sf.Arrays; the 2x2 dp x tp mesh (under -n 2 a process' two devices lie in two dp teams); and
the transformer block on both meshes (its Allreduces are over tp only).  Every rank runs every test in the same order, with the same seeds."""
from __future__ import annotations

import numpy as np
import pytest

import test_nn as tn

KINDS = ["1d", "2d"]


SHARDED = [(name, kind, jit) for name in sorted(tn.CASES) for kind in KINDS for jit in (True, False)
           if jit or tn.CASES[name][5]]


@pytest.mark.parametrize("name, kind, jit", SHARDED, ids=[f"{n}-{k}-{'jit' if j else 'eager'}" for n, k, j in SHARDED])
def test_case_sharded(name, kind, jit):
    tn.check_case(name, tn.mesh_of(kind), tn.SHARDED[kind] if tn.CASES[name][4] is tn.ROW_LAYOUTS
                  else tn.HEADS[kind], "float64", jit, np.random.default_rng(0))


@pytest.mark.parametrize("name", ["softmax", "layer_norm", "attention bool mask", "cross_entropy_onehot"])
def test_case_replicated_float32(name):
    tn.check_case(name, tn.mesh_of("1d"), "R", "float32", True, np.random.default_rng(1))


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_transformer_block(kind):
    tn.check_block(tn.mesh_of(kind), "float64", np.random.default_rng(9))
