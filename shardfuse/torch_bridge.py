"""sf.torch_function: a jitted function as a function of torch tensors with one autograd node,
for users who train in PyTorch (torch is optional: imported when this is called).

The forward runs the function's plan; the node's backward runs the plan of its vjp (sf.vjp's
pullback, compiled once per input specs: it computes the forward again rather than keeping the
activations, the least memory).  Tensors go in without a copy where the layout allows (CUDA
tensors are read on the caller's current stream) and results come back through DLPack.
"""
from __future__ import annotations

from shardfuse.jit import Jitted
from shardfuse.transforms import Pullback


def _tensor(x, torch):
    """An sf.Array result as a torch tensor (DLPack, no copy, where this process holds it whole)."""
    if not x.sharding.partial and all(tuple(s.shape) == x.shape for s in x.shards):
        return torch.from_dlpack(x)
    return torch.from_dlpack(x.full_array())


def torch_function(fn, mesh=None):
    """fn (an sf.jit function, or a function and mesh=) as a function of torch tensors whose
    result records one autograd node: `loss = sf.torch_function(layer)(x, w); loss.backward()`
    gives w.grad from the compiled backward.  Takes and returns tensors (a tuple of them for
    several results); integer and boolean inputs get no gradient."""
    import torch

    jitted = fn if isinstance(fn, Jitted) else Jitted(fn, mesh)
    pullback = Jitted(Pullback(jitted.fn, False), jitted.mesh, jitted.streams)

    def stream_of(tensors):
        cuda = [t for t in tensors if t.is_cuda]
        return torch.cuda.current_stream(cuda[0].device) if cuda else None

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            out = jitted(*tensors, stream=stream_of(tensors))
            ctx.save_for_backward(*tensors)
            ctx.several = isinstance(out, tuple)
            outs = tuple(_tensor(o, torch) for o in (out if ctx.several else (out,)))
            ctx.output_shapes = [(o.shape, o.dtype, o.device) for o in outs]  # (zeros for unused results)
            return outs if ctx.several else outs[0]

        @staticmethod
        def backward(ctx, *grads):
            primals = ctx.saved_tensors
            outs = ctx.output_shapes
            cts = tuple(torch.zeros(s, dtype=d, device=dev) if g is None else g.contiguous()
                        for g, (s, d, dev) in zip(grads, outs))
            res = pullback(primals, cts if ctx.several else cts[0], stream=stream_of(primals))
            res = res if isinstance(res, tuple) else (res,)
            return tuple(_tensor(g, torch) if t.is_floating_point() else None for g, t in zip(res, primals))

    def call(*tensors):
        for k, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"sf.torch_function({jitted.__name__}): argument {k} is a {type(t).__name__}; "
                                "it takes torch tensors")
        return Node.apply(*tensors)

    call.__name__ = f"torch_{jitted.__name__}"
    return call
