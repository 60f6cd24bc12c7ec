"""Every entry of the resharding table, on virtual meshes (tests/mpi/ runs them under mpiexec)."""
import numpy as np
import pytest

import shardfuse as sf
from cases import RESHARD_TABLE, reshard_case
from shardfuse.ops import Op


@pytest.mark.parametrize("entry", sorted(RESHARD_TABLE))
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_reshard_entry(d, entry):
    reshard_case(sf.DeviceMesh(d, backend="numpy"), entry)


def test_alltoall_plan_text():
    mesh = sf.DeviceMesh(4, backend="numpy")
    f = sf.jit(lambda x: sf.shard(sf.shard(x, axis=0) * 2.0, axis=1), mesh=mesh)
    text = str(f.lower(sf.TensorSpec((8, 12, 5), "float64")))
    # rank r's send is block r of axis 1 of its [2, 12, 5] piece: strided, so the plan stages it,
    # stored as the AllToAll reads it (4 blocks of axis 1, block r first); the receive is contiguous
    assert text.splitlines()[2:7] == [
        "  x_moved = Allocate f64[8, 12:DIDx, 5]  (once)",
        "  x_staged = Allocate f64[8:DIDx, 12, 5]  (once, as 4 blocks of axis 1)",
        "  Copy x_staged <- x",
        "  a2a = AllToAll x_moved <- x_staged, team=DIDx, axis=0, to_axis=1",
        "  Wait a2a",
    ]


def test_a_pending_sum_cannot_be_made_by_resharding():
    from shardfuse.layout import Layout
    from shardfuse.passes.lower import reshard_steps

    with pytest.raises(ValueError, match=r"cannot reshard \('R',\) -> \('P',\) over DIDx"):
        reshard_steps(Layout((None,)), Layout((None,), ("DIDx",)), sf.DeviceMesh(2, backend="numpy"))


def test_a_pending_row_sum_times_a_sharded_value_reduces_the_sum():
    """x * y.sum(-1) with x and y sharded over tp along that axis: the [rows, 1] sums are reduced
    (one Allreduce) and the product stays sharded, as log_softmax's backward needs with vocab-parallel
    logits; it gathered x, multiplied on every device and reduce-scattered the [rows, vocab] product."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    x, y = r.standard_normal((8, 64)), r.standard_normal((8, 64))

    def f(x, y):
        x, y = sf.shard(x, axis=1, over="tp"), sf.shard(y, axis=1, over="tp")
        return sf.shard(x * y.sum(-1, keepdims=True), axis=1, over="tp")
    fn = sf.jit(f, mesh=mesh)
    plan = fn.lower(x, y)
    assert plan.collectives() == {"allreduce": 1}, plan
    reduced = [i for i in plan.program.walk() if i.op == Op.ALLREDUCE]
    assert reduced[0].into.type.shape == (8, 1), plan
    np.testing.assert_allclose(np.asarray(fn(x, y)), x * y.sum(-1, keepdims=True), rtol=1e-12)


def test_a_vocab_parallel_log_softmax_loss_gathers_no_vocab_sized_value_before_its_gradient():
    """The JAX cross-entropy -take_along_axis(log_softmax(logits), labels) on logits over tp (a
    probe's): its gradient's only Allgathers are of the gradient itself, into the argument's layout."""
    mesh = sf.DeviceMesh((2,), ("tp",), backend="numpy")
    r = np.random.default_rng()
    logits, labels = r.standard_normal((4, 8, 32)), r.integers(0, 32, (4, 8))

    def loss(l, y):
        lp = sf.nn.log_softmax(sf.shard(l, axis=2, over="tp"))
        return -np.take_along_axis(lp, y[..., None], -1).mean()
    fn = sf.jit(sf.value_and_grad(loss), mesh=mesh)
    plan = fn.lower(logits, labels)
    assert plan.collectives().get("allgather", 0) <= 1 and "reduce_scatter" not in plan.collectives(), plan
    value, grad = fn(logits, labels)
    lse = np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(float(value), -np.take_along_axis(logits - lse, labels[..., None], -1).mean(), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(grad), (np.exp(logits - lse) - np.eye(32)[labels]) / 32, atol=1e-14)


def test_a_sum_pending_over_two_mesh_axes_reduces_only_the_clashing_one():
    """(a @ b) pending over dp and tp, times x sharded over tp: only tp's sums are reduced before
    the product (a ReduceScatter), dp's stay pending into the scalar's sum (a review: the whole
    product was also Allreduced over dp)."""
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    r = np.random.default_rng()
    a, b, x = r.standard_normal((64, 32)), r.standard_normal((32, 256)), r.standard_normal((64, 256))

    def f(a, b, x):
        p = sf.shard(a, axis=1, over=("dp", "tp")) @ sf.shard(b, axis=0, over=("dp", "tp"))
        return (p * sf.shard(x, axis=1, over="tp")).sum()
    fn = sf.jit(f, mesh=mesh)
    plan = fn.lower(a, b, x)
    big = [i for i in plan.program.walk() if i.op in (Op.ALLREDUCE, Op.ALLGATHER) and i.into.type.shape != ()]
    assert not big, plan
    np.testing.assert_allclose(float(fn(a, b, x)), ((a @ b) * x).sum(), rtol=1e-10)
