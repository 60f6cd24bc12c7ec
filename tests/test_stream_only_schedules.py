"""sf.stream only schedules (README, "Layout rule"): on a value whose placement an annotation
states (sf.shard / sf.replicate, before or after the stream), adding sf.stream changes no
placement and no communication; it only asks for the value to be produced chunk by chunk.

Each program is compiled with and without its sf.stream: the output placements are equal, and so
are the collectives apart from the loop (each collective kind and team once, however many chunks
repeat it); both run and agree with NumPy in float64 on random inputs.  On a 1-D mesh and on a
2x2 ("dp", "tp") mesh.

A stream annotation ALONE on an op's result (no placement stated) states replicated, as every
first annotation inside jit does (the decision, pinned below): the seed example
`sf.stream(a @ b, axis=0)` is the pipelined AllGather+GEMM because of it.
"""
from __future__ import annotations

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.ops import COMMUNICATION, Op

MESHES = {"1d": ((4,), ("DIDx",)), "2x2": ((2, 2), ("dp", "tp"))}


def _mesh(kind):
    shape, names = MESHES[kind]
    return sf.DeviceMesh(shape, names, backend="numpy")


def _collectives(instrs) -> list:
    """(kind, team) of each collective in program order, a loop's body counted once."""
    out = []
    for i in instrs:
        if i.op == Op.FOR:
            out += _collectives(i.body)
        elif i.op in COMMUNICATION:
            kind = i.attrs["kind"].lower() if i.op == Op.TRANSFER else str(i.op)
            out.append((kind, i.attrs.get("team")))
    return sorted(out, key=repr)


def _has_loop(plan) -> bool:
    return any(i.op == Op.FOR for i in plan.program.instrs)


def _gelu(x):
    """GELU, tanh form (shardfuse's)."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


# name -> (mesh, input shapes, body: the op chain, place: the stated placement of its result, stream axis,
# chunks, NumPy's result).  The streamed variants put sf.stream outside `place` and inside it.
CASES = {
    "elementwise, rows stay sharded": ("1d", [(8, 6)], lambda x: sf.exp(sf.shard(x, 0)) * 2.0 + 1.0,
                                       lambda v: sf.shard(v, 0), 0, 2, lambda x: np.exp(x) * 2.0 + 1.0),
    "elementwise, moved to columns": ("1d", [(8, 8)], lambda x: sf.exp(sf.shard(x, 0)) - 1.0,
                                      lambda v: sf.shard(v, 1), 0, 2, lambda x: np.exp(x) - 1.0),
    "elementwise, replicated": ("1d", [(16, 6)], lambda x: sf.exp(sf.shard(x, 0)) * x,
                                sf.replicate, 0, 4, lambda x: np.exp(x) * x),
    "matmul, seed form (replicated)": ("1d", [(8, 4, 6), (6, 5)], lambda a, b: sf.shard(a, 1) @ b,
                                       sf.replicate, 0, None, lambda a, b: a @ b),
    "matmul, column-parallel": ("1d", [(8, 6), (6, 8)], lambda a, b: a @ sf.shard(b, 1),
                                lambda v: sf.shard(v, 1), 0, 2, lambda a, b: a @ b),
    "matmul, row-parallel, output rows sharded": ("1d", [(8, 8), (8, 6)],
                                                   lambda a, b: sf.shard(a, 1) @ sf.shard(b, 0),
                                                   lambda v: sf.shard(v, 0), 0, 2, lambda a, b: a @ b),
    "reduction, sharded": ("1d", [(8, 4, 8)], lambda x: sf.shard(x, 2).sum(1),
                           lambda v: sf.shard(v, 0), 0, 2, lambda x: x.sum(1)),
    "reduction over the sharded axis": ("1d", [(8, 8)], lambda x: sf.shard(x, 1).sum(1),
                                        sf.replicate, 0, 2, lambda x: x.sum(1)),
    "2x2: elementwise, dp rows": ("2x2", [(8, 6)], lambda x: sf.exp(sf.shard(x, 0, over="dp")) * 3.0,
                                  lambda v: sf.shard(v, 0, over="dp"), 0, 2, lambda x: np.exp(x) * 3.0),
    "2x2: megatron pair, tp only": ("2x2", [(8, 6), (6, 8), (8, 6)],
                                    lambda x, w1, w2: sf.gelu(sf.shard(x, 0, over="dp") @ sf.shard(w1, 1, over="tp"))
                                    @ sf.shard(w2, 0, over="tp"),
                                    lambda v: sf.shard(v, 0, over="dp"), 0, 2, lambda x, w1, w2: _gelu(x @ w1) @ w2),
    "2x2: matmul, (dp, tp) output": ("2x2", [(8, 6), (6, 8)],
                                     lambda a, b: sf.shard(a, 0, over="dp") @ sf.shard(b, 1, over="tp"),
                                     lambda v: sf.shard(sf.shard(v, 0, over="dp"), 1, over="tp"), 0, 2,
                                     lambda a, b: a @ b),
    "2x2: reduction": ("2x2", [(4, 8, 6)], lambda x: sf.shard(sf.shard(x, 0, over="dp"), 2, over="tp").sum(2),
                       lambda v: sf.shard(v, 0, over="dp"), 1, 2, lambda x: x.sum(2)),
}


def _variants(body, place, axis, chunks):
    """The program without the stream, with sf.stream around the placement, and inside it."""
    return {
        "plain": lambda *a: place(body(*a)),
        "stream outside": lambda *a: sf.stream(place(body(*a)), axis, chunks=chunks),
        "stream inside": lambda *a: place(sf.stream(body(*a), axis, chunks=chunks)),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stream_on_a_stated_placement_only_schedules(name):
    kind, shapes, body, place, axis, chunks, ref = CASES[name]
    mesh = _mesh(kind)
    rng = np.random.default_rng(sorted(CASES).index(name))
    args = [rng.standard_normal(s) for s in shapes]
    fns = {k: sf.jit(f, mesh=mesh) for k, f in _variants(body, place, axis, chunks).items()}
    plans = {k: f.lower(*args) for k, f in fns.items()}
    outs = {k: f(*args) for k, f in fns.items()}
    plain = outs["plain"]
    for k in ("stream outside", "stream inside"):
        assert _has_loop(plans[k]), (name, k, str(plans[k]))
        assert outs[k].placements == plain.placements, (name, k, outs[k].placements, plain.placements)
        assert _collectives(plans[k].program.instrs) == _collectives(plans["plain"].program.instrs), \
            (name, k, str(plans["plain"]), str(plans[k]))
        np.testing.assert_allclose(outs[k].gather(), plain.gather(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(plain.gather(), ref(*args), rtol=1e-10, atol=1e-10)


def test_a_stream_alone_states_replicated():
    """The decision (README, "Layout rule"): sf.stream as the only annotation on a value states, as
    every first annotation inside jit does, the value's layout from replicated (nvFuser's: a tensor
    with no DID axis is replicated), so the seed `sf.stream(a @ b, axis=0)` is the pipelined
    AllGather+GEMM.  To stream a value where propagation would place it, state the placement
    (the CASES above).  A new-user probe expected the placement to stay propagation's; leaving it
    there would make the seed a local GEMM in chunks, which no user of the seed example wants."""
    mesh = _mesh("1d")
    x = np.random.default_rng(2).standard_normal((8, 4))
    f = sf.jit(lambda v: sf.stream(sf.exp(sf.shard(v, 0)), axis=0, chunks=2), mesh=mesh)
    out = f(x)
    assert out.placements == (sf.Replicate(),)
    assert f.lower(x).collectives() == {"allgather": 2}
    np.testing.assert_allclose(out.gather(), np.exp(x), rtol=1e-12)
    stated = sf.jit(lambda v: sf.stream(sf.shard(sf.exp(sf.shard(v, 0)), 0), axis=0, chunks=2), mesh=mesh)
    assert stated(x).placements == (sf.Shard(0),) and stated.lower(x).collectives() == {}
