"""sf.torch_function (issue 32): a jitted function inside torch autograd, checked against torch's
own autograd on the same layer (float64), with several results (one unused by the loss), an
integer input (no gradient), and a few Adam steps of torch's optimizer on both."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import shardfuse as sf
from shardfuse.mlp import mlp_block

MESH = sf.DeviceMesh((4,), ("tp",), backend="numpy")


def torch_mlp(x, w1, b1, w2, b2):
    return torch.nn.functional.gelu(x @ w1 + b1, approximate="tanh") @ w2 + b2


def _leaves(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8, 32), (32,), (32, 8), (8,)]
    return [torch.randn(s, dtype=torch.float64, generator=g, requires_grad=True) for s in shapes]


def _twins(seed):
    a = _leaves(seed)
    return a, [t.detach().clone().requires_grad_() for t in a]


@pytest.mark.parametrize("mode", ["sp", "tp"])
def test_mlp_block_matches_torch_autograd(mode):
    ours, theirs = _twins(0)
    y = sf.torch_function(mlp_block(MESH, mode, chunks=2))(*ours)
    z = torch_mlp(*theirs)
    torch.testing.assert_close(y, z, rtol=1e-12, atol=1e-12)
    (y.sin() * 3).sum().backward()
    (z.sin() * 3).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)


def test_several_results_one_unused_and_an_integer_input():
    def f(x, w, k):
        h = sf.shard(x, axis=0) @ w
        return np.tanh(h) * k.astype("float64"), h.sum(0)
    fn = sf.torch_function(sf.jit(f, mesh=MESH))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.tensor(3, dtype=torch.int64)
    y, s = fn(x, w, k)
    y.sum().backward()  # s is not used: its cotangent is zero
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.tanh(x2 @ w2) * 3).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, (x2 @ w2).sum(0).detach(), rtol=1e-12, atol=1e-12)


def test_adam_steps_agree_with_torch():
    ours, theirs = _twins(2)
    fn = sf.torch_function(mlp_block(MESH, "sp", chunks=2))
    opt_a, opt_b = torch.optim.Adam(ours[1:], lr=1e-2), torch.optim.Adam(theirs[1:], lr=1e-2)
    target = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(5):
        for opt, params, f in ((opt_a, ours, fn), (opt_b, theirs, torch_mlp)):
            opt.zero_grad()
            loss = ((f(*params) - target) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    np.testing.assert_allclose(losses[0::2], losses[1::2], rtol=1e-10)
    assert losses[-2] < losses[0]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_numbers_numpy_arrays_and_static_arguments_go_to_the_function():
    """A DTensor probe: the bridge refused anything but tensors, so `causal=True` (a static argument), a
    scale or a NumPy mask could not be passed.  They go to the function as sf.jit takes them, with no
    gradient; the tensors' gradients match torch's, and a new scale compiles no new plan."""
    mask = np.tril(np.ones((4, 4)))

    def f(x, w, scale, m, causal):
        s = (x @ w) * scale
        return ((s * m if causal else s) ** 2).sum()
    jitted = sf.jit(f, mesh=MESH, static_argnames="causal")
    bridged = sf.torch_function(jitted)
    x, w = _leaves(3)[0][:4, :4].detach(), _leaves(4)[1][:4, :4].detach().requires_grad_()
    for scale, causal in ((0.5, True), (2.0, True), (2.0, False)):
        w.grad = None
        loss = bridged(x, w, scale, mask, causal=causal)
        loss.backward()
        w2 = w.detach().clone().requires_grad_()
        s = (x @ w2) * scale
        want = ((s * torch.from_numpy(mask) if causal else s) ** 2).sum()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-13, atol=0)
        torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-12)
    assert jitted.cache_info()["static_values"] == 2  # (causal True and False; the scales share a plan)
    assert jitted.cache_info()["plans"] == 2


def test_a_dict_of_parameters_matches_torch_autograd():
    """A user's port keeps its parameters as one dict of tensors (sf.jit's pytrees): the bridge takes
    and returns pytrees, and each leaf gets its gradient."""
    g = torch.Generator().manual_seed(4)
    params = {"w1": torch.randn(8, 32, dtype=torch.float64, generator=g), "b1": torch.randn(32, dtype=torch.float64,
              generator=g), "w2": torch.randn(32, 8, dtype=torch.float64, generator=g)}
    for t in params.values():
        t.requires_grad_()
    twins = {k: t.detach().clone().requires_grad_() for k, t in params.items()}
    x = torch.randn(16, 8, dtype=torch.float64, generator=g)

    def model(p, x):
        h = sf.gelu(x @ sf.shard(p["w1"], axis=1) + sf.shard(p["b1"], axis=0))
        return {"y": h @ sf.shard(p["w2"], axis=0), "h_sum": h.sum()}
    out = sf.torch_function(sf.jit(model, mesh=MESH))(params, x)
    assert set(out) == {"y", "h_sum"}
    h = torch.nn.functional.gelu(x @ twins["w1"] + twins["b1"], approximate="tanh")
    torch.testing.assert_close(out["y"], h @ twins["w2"], rtol=1e-12, atol=1e-12)
    ((out["y"] ** 2).sum() + out["h_sum"]).backward()
    (((h @ twins["w2"]) ** 2).sum() + h.sum()).backward()
    for k in params:
        torch.testing.assert_close(params[k].grad, twins[k].grad, rtol=1e-10, atol=1e-10)


def test_bfloat16_results_on_numpy_devices():
    """NumPy's DLPack has no bfloat16: the bridge hands torch the bits, so bfloat16 works as on GPUs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=g).bfloat16()
    w = torch.randn(6, 4, generator=g).bfloat16().requires_grad_()
    y = sf.torch_function(sf.jit(lambda x, w: sf.shard(x, axis=0) @ w, mesh=MESH))(x, w)
    assert y.dtype == torch.bfloat16
    want = x.double() @ w.detach().double()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    r = torch.randn(8, 4, generator=g).bfloat16()
    (y.double() * r.double()).sum().backward()
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), x.double().T @ r.double(), rtol=2e-2, atol=5e-2)


def test_keyword_arguments_bind_as_in_sf_jit():
    """f(x, w=w) and f(w=w, x=x) are f(x, w): same result and gradients; a keyword-only
    parameter is refused with sf.jit's message."""
    def f(x, w):
        return np.tanh(sf.shard(x, axis=0) @ w).sum()
    fn = sf.torch_function(sf.jit(f, mesh=MESH))
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(8, 6, dtype=torch.float64, generator=g)
    w0 = torch.randn(6, 4, dtype=torch.float64, generator=g)
    grads = []
    for call in (lambda x, w: fn(x, w), lambda x, w: fn(x, w=w), lambda x, w: fn(w=w, x=x)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        call(x, w).backward()
        grads.append((x.grad, w.grad))
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    torch.tanh(x @ w).sum().backward()
    for gx, gw in grads:
        torch.testing.assert_close(gx, x.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, w.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="unexpected keyword argument 'v'"):
        fn(x0, v=w0)


def test_a_tensor_that_requires_grad_is_refused_by_a_plain_jit_and_taken_without_grad():
    """sf.jit records no autograd graph: a tensor that requires grad is refused while grad is on (as
    torch's .numpy() refuses it), with the two ways out; detached or under no_grad it runs."""
    f = sf.jit(lambda x: x * 2.0, mesh=MESH)
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match=r"requires grad.*sf.torch_function.*detach"):
        f(x)
    torch.testing.assert_close(torch.as_tensor(np.asarray(f(x.detach()))), x.detach() * 2)
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(np.asarray(f(x))), x.detach() * 2)


def test_a_second_derivative_says_it_is_not_recorded():
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    y = sf.torch_function(lambda x: (x * x).sum(), mesh=MESH)(x)
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    torch.testing.assert_close(g, 2 * x.detach())
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(g.sum(), x)


def test_placing_a_parameter_reads_its_values():
    """sf.replicate / sf.shard of an nn.Parameter place its values (a review: they were refused with
    the compiled call's error); only a compiled call refuses it."""
    m = sf.DeviceMesh(2, backend="numpy")
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    np.testing.assert_array_equal(np.asarray(sf.replicate(w, mesh=m)), w.detach().numpy())
    np.testing.assert_array_equal(np.asarray(sf.shard(w, axis=0, mesh=m)), w.detach().numpy())


def test_the_forward_and_backward_plans_are_printable():
    """A DTensor probe: a bridge user had no way to see the backward's plan or count its collectives."""
    def f(p, x):
        return ((x @ sf.shard(p["w"], axis=1, over="tp")) ** 2).sum()
    bridged = sf.torch_function(sf.jit(f, mesh=MESH))
    p, x = {"w": torch.ones(8, 16, dtype=torch.float64)}, torch.ones(4, 8, dtype=torch.float64)
    fwd, bwd = bridged.lower(p, x), bridged.lower_backward(p, x=x)
    assert fwd.collectives() == {"allreduce": 1} and "Matmul" in str(bwd)
    assert sum(bwd.collectives().values()) >= 1  # (the forward's sum again, then the backward's own)
    # (a NumPy argument gets no gradient, so the backward computes none for it: a README probe saw it computed)
    with_numpy = bridged.lower_backward(p, x.numpy())
    assert len(with_numpy.program.outputs) == 1 and len(bwd.program.outputs) == 2
