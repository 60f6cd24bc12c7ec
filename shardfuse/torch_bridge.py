"""sf.torch_function: a jitted function as a function of torch tensors with one autograd node,
for users who train in PyTorch (torch is optional: imported when this is called).

The forward runs the function's plan; the node's backward runs the plan of its vjp (sf.vjp's
pullback, compiled once per input specs: it computes the forward again rather than keeping the
activations, the least memory).  Tensors go in without a copy where the layout allows (CUDA
tensors are read on the caller's current stream) and results come back through DLPack.
Arguments and results may be pytrees of tensors (a model's parameters as one dict), as sf.jit's.
"""
from __future__ import annotations

from shardfuse import tree
from shardfuse.jit import Jitted
from shardfuse.transforms import Pullback, eval_shape


def _tensor(x, torch):
    """An sf.Array result as a torch tensor (DLPack, no copy, where this process holds it whole)."""
    if x.sharding.partial or any(tuple(s.shape) != x.shape for s in x.shards):
        x = x.full_array()
    return torch.from_dlpack(x)  # (bfloat16 too: sf.Array.__dlpack__ hands torch its bits)


def torch_function(fn, mesh=None):
    """fn (an sf.jit function, or a function and mesh=) as a function of torch tensors whose
    result records one autograd node: `loss = sf.torch_function(layer)(x, w); loss.backward()`
    gives w.grad from the compiled backward.  Takes tensors and pytrees of them (dicts, lists,
    tuples: `f(params, x)` with params a dict of tensors), positionally or by keyword
    (`f(params, x=x)`), and returns a tensor, or the pytree of tensors fn returns; integer and
    boolean inputs get no gradient.  Python numbers and NumPy arrays among the arguments go to fn
    as sf.jit takes them, with no gradient, and fn's static arguments (sf.jit's static_argnums /
    static_argnames: `causal=True`) as Python values.  `f.lower(*args)` and `f.lower_backward(*args)`
    give the forward's plan and the backward's (printable; `.collectives()`)."""
    import torch

    jitted = fn if isinstance(fn, Jitted) else Jitted(fn, mesh)
    pullbacks = _Pullbacks()

    def stream_of(tensors):
        cuda = [t for t in tensors if t.is_cuda]
        return torch.cuda.current_stream(cuda[0].device) if cuda else None

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, target, in_tree, fixed, result, *tensors):
            out = target(*in_tree.unflatten(_merged(fixed, tensors)), stream=stream_of(tensors))
            ctx.save_for_backward(*tensors)
            outs, result["tree"] = tree.flatten(out)
            outs = tuple(_tensor(o, torch) for o in outs)
            ctx.target, ctx.in_tree, ctx.fixed, ctx.out_tree = target, in_tree, fixed, result["tree"]
            ctx.output_shapes = [(o.shape, o.dtype, o.device) for o in outs]  # (zeros for unused results)
            return outs

        @staticmethod
        def backward(ctx, *grads):
            tensors = ctx.saved_tensors
            cts = [torch.zeros(s, dtype=d, device=dev) if g is None else g.contiguous()
                   for g, (s, d, dev) in zip(grads, ctx.output_shapes)]
            with torch.no_grad():  # (as forward runs: the primals are read for values)
                res = pullbacks[ctx.target, tuple(v is None for v in ctx.fixed)](
                    ctx.in_tree.unflatten(_merged(ctx.fixed, tensors)), ctx.out_tree.unflatten(cts),
                    stream=stream_of(tensors))
            res, _ = tree.flatten(res, is_leaf=lambda g: g is None)  # (an integer input's cotangent: None)
            res = [_tensor(g, torch) if t.is_floating_point() else None
                   for g, t in zip((g for g, v in zip(res, ctx.fixed) if v is None), tensors)]
            if torch.is_grad_enabled():  # (create_graph=True: the pullback ran compiled, recording nothing, so
                res = [None if g is None else Unrecorded.apply(g, *tensors) for g in res]  # say so, when reached)
            return (None, None, None, None) + tuple(res)

    class Unrecorded(torch.autograd.Function):
        """g, as a function of the primals (so a second derivative reaches it), whose derivative says that
        the compiled backward recorded no graph."""
        @staticmethod
        def forward(ctx, g, *primals):
            return g.view_as(g)

        @staticmethod
        def backward(ctx, _):
            raise RuntimeError(f"sf.torch_function({jitted.__name__}): no second derivative: its backward is a "
                               "compiled pullback that records no autograd graph (torch.autograd.grad(..., "
                               "create_graph=True) gives first derivatives only)")

    def call(*args, **kwargs):
        target, args, kwargs = jitted.bind_static(args, kwargs)  # (static values: the sf.jit with them fixed)
        if kwargs:  # (bound to the jitted function's parameters, as sf.jit binds them)
            args = target.positional(args, kwargs)
        leaves, in_tree = tree.flatten(args)
        # (numbers and NumPy arrays go to the function as sf.jit takes them, with no gradient: a scale, a mask)
        fixed = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        result = {}
        outs = Node.apply(target, in_tree, fixed, result, *(v for v in leaves if isinstance(v, torch.Tensor)))
        return result["tree"].unflatten(outs)

    call.__name__ = f"torch_{jitted.__name__}"
    call.lower, call.lower_backward = _lowering(jitted, pullbacks)
    return call


def _merged(fixed, tensors):
    """The leaves: the tensors in order where `fixed` holds None, its values elsewhere."""
    it = iter(tensors)
    return [next(it) if v is None else v for v in fixed]


class _Pullbacks(dict):
    """(the sf.jit with its static values fixed, which leaves are tensors) -> the sf.jit of its pullback,
    computing the tensors' cotangents only (made at first use)."""

    def __missing__(self, key):
        target, keep = key
        made = self[key] = Jitted(Pullback(target.fn, False, keep=keep), target.mesh, target.streams)
        return made


def _lowering(jitted, pullbacks):
    """(lower, lower_backward) of a bridged function: its forward's plan and its backward's."""
    def lower(*args, **kwargs):
        """The forward's plan for these arguments (printable, plan.collectives()), as sf.jit's lower."""
        target, args, kwargs = jitted.bind_static(args, kwargs)
        return target.lower(*args, **kwargs)

    def lower_backward(*args, **kwargs):
        """The plan the node's backward runs for these arguments: the compiled vjp (the forward again,
        then the pullback), its cotangents shaped as the forward's results."""
        target, args, kwargs = jitted.bind_static(args, kwargs)
        args = target.positional(args, kwargs) if kwargs else args
        keep = tuple(getattr(v, "requires_grad", None) is not None for v in tree.leaves(args))  # (the tensors)
        return pullbacks[target, keep].lower(tuple(args), eval_shape(target, *args))
    return lower, lower_backward
