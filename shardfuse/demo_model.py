"""`shardfuse demo` (the command's entry: the seed and --mlp demos are shardfuse/demo.py's), and its
`--layer tp|sp|dp` and `--train`: the transformer layer with
Megatron's shardings, checked against its float64 NumPy reference; a 2-layer GPT's gradients
checked against central differences in float64, then a few Adam steps in one jitted step with
donated parameters."""
from __future__ import annotations

import warnings

import numpy as np

import shardfuse as sf
from shardfuse import tree
from shardfuse.demo import TOLERANCE, default_devices, parse_args, relative_error, run, seeded_rng, speaker
from shardfuse.dtypes import np_dtype
from shardfuse.transformer import gpt_loss, gpt_reference, init_gpt, init_params, layer_reference, transformer_layer

BATCH = 2  # the layer's and the GPT's batch (the dp mesh axis divides it)
LAYER_KW = {"tp": {"tp": "tp"}, "sp": {"tp": "tp", "sp": True}, "dp": {"tp": "tp", "sp": True, "dp": "dp"}}
GRAD_TOLERANCE = 1e-6  # central differences in float64: |numeric - analytic| <= this x (1 + |numeric|)


def model_mesh(args, dp=False):
    """A 1-D mesh ("tp",) of all devices, or with dp a 2-D ("dp", "tp") mesh of 2 x devices/2."""
    d = args.devices or default_devices(args.backend)
    if not dp:
        return sf.DeviceMesh((d,), ("tp",), backend=args.backend)
    if d % 2:
        raise ValueError(f"--layer dp needs an even number of devices (a 2 x {d}/2 dp x tp mesh), got {d}")
    return sf.DeviceMesh((2, d // 2), ("dp", "tp"), backend=args.backend)


def layer_sizes(args, tp) -> tuple[int, int]:
    """(batch, seq) of x from --m (all tokens, batch x seq; default batch x chunks x tp x 4).  With
    chunks the sequence is cut in chunks x tp pieces (sp) or chunks pieces (tp)."""
    pieces = args.chunks * tp
    m = args.m if args.m is not None else BATCH * pieces * 4
    if m % (BATCH * pieces):
        raise ValueError(f"--m is the layer's tokens, batch x seq with batch {BATCH}: {m} must be a multiple of "
                         f"{BATCH} x --chunks x tp devices = {BATCH} x {args.chunks} x {tp} = {BATCH * pieces}")
    if args.hidden % args.heads or args.heads % tp:
        raise ValueError(f"--heads {args.heads} must divide --hidden {args.hidden} and be a multiple of the "
                         f"{tp} tensor-parallel devices")
    return BATCH, m // BATCH


def layer_demo(args) -> int:
    mesh = model_mesh(args, dp=args.layer == "dp")
    tp = mesh.shape[-1]
    say = speaker(args, mesh)
    b, s = layer_sizes(args, tp)
    kw = dict(LAYER_KW[args.layer], chunks=args.chunks)
    rng, seed = seeded_rng(args, mesh, say)
    dt = np_dtype(args.dtype)
    params = {k: v.astype(dt) for k, v in init_params(rng, args.hidden, "float64", scale=0.3).items()}
    x = rng.standard_normal((b, s, args.hidden)).astype(dt)
    f = sf.jit(lambda p, x: transformer_layer(p, x, args.heads, **kw), mesh=mesh, streams=args.streams)
    plan = f.lower(params, x)
    say(f"{mesh}, transformer layer ({args.layer}: {', '.join(f'{k}={v}' for k, v in kw.items())}), "
        f"x[{b}, {s}, {args.hidden}], {args.heads} heads, {args.dtype}\n")
    say(plan, "\n")
    err = relative_error(np.asarray(f(params, x)), layer_reference(params, x, args.heads))
    ok = err <= TOLERANCE[args.dtype]
    say(f"check against the float64 NumPy layer: relative error {err:.2e} (tolerance {TOLERANCE[args.dtype]:.0e}) "
        f"-> {'OK' if ok else 'FAILED'}")
    say(f"collectives per call: {plan.collectives()}")
    return 0 if ok else 1


def _directional(loss_np, params, grads, rng, eps=1e-6):
    """(central difference of loss_np along a random direction of params, <grads, direction>)."""
    leaves, td = tree.flatten(params)
    dirs = [rng.standard_normal(np.shape(v)) for v in leaves]

    def at(t):
        return td.unflatten([v + t * d for v, d in zip(leaves, dirs)])
    numeric = (loss_np(at(eps)) - loss_np(at(-eps))) / (2 * eps)
    return numeric, sum(float(np.sum(np.asarray(g) * d)) for g, d in zip(tree.leaves(grads), dirs))


def adam_step(heads, kw, b1=0.9, b2=0.99, eps=1e-8):
    """One training step: the loss, its gradient, Adam's update, all shardfuse ops.  state is
    (params, m, v), lr_t the step's learning rate with Adam's bias corrections."""
    def step(state, ids, labels, lr_t):
        params, m, v = state
        loss, g = sf.value_and_grad(lambda p: gpt_loss(p, ids, labels, heads, **kw))(params)
        m = tree.tree_map(lambda a, d: b1 * a + (1 - b1) * d, m, g)
        v = tree.tree_map(lambda a, d: b2 * a + (1 - b2) * d * d, v, g)
        params = tree.tree_map(lambda w, a, c: w - lr_t * a / (np.sqrt(c) + eps), params, m, v)
        return (params, m, v), loss
    return step


def gpt_task(rng, vocab, seq):
    """Token ids [batch, seq] of a repeating pattern (a random period-4 cycle of tokens, each row
    starting elsewhere) and labels, the next token: learnable from the context."""
    cycle = rng.choice(vocab, 4, replace=False)
    starts = rng.integers(0, 4, BATCH)
    ids = np.stack([cycle[(s + np.arange(seq + 1)) % 4] for s in starts]).astype(np.int32)
    return ids[:, :-1].copy(), ids[:, 1:].copy()


def train_demo(args) -> int:
    mesh = model_mesh(args)
    tp = mesh.shape[-1]
    say = speaker(args, mesh)
    pieces = tp * args.chunks  # the sequence divides over tp x chunks (sp), the vocabulary over tp
    vocab, seq = 8 * tp, pieces * -(-16 // pieces)
    if args.hidden % args.heads or args.heads % tp:
        raise ValueError(f"--heads {args.heads} must divide --hidden {args.hidden} and be a multiple of the "
                         f"{tp} tensor-parallel devices")
    kw = {"tp": "tp", "sp": True, "chunks": args.chunks}
    rng, seed = seeded_rng(args, mesh, say)
    say(f"{mesh}, a 2-layer GPT (vocab {vocab}, hidden {args.hidden}, {args.heads} heads, seq {seq}, batch {BATCH}), "
        f"{', '.join(f'{k}={v}' for k, v in kw.items())}\n")
    ids, labels = gpt_task(rng, vocab, seq)
    p64 = init_gpt(rng, vocab, args.hidden, 2, seq, "float64", scale=0.3)
    grad_fn = sf.jit(sf.value_and_grad(lambda p, i, l: gpt_loss(p, i, l, args.heads, **kw)), mesh=mesh)
    value, grads = grad_fn(p64, ids, labels)
    ref = gpt_reference(p64, ids, labels, args.heads)
    numeric, analytic = _directional(lambda q: gpt_reference(q, ids, labels, args.heads), p64, grads, rng)
    ok = abs(float(value) - ref) <= 1e-10 * (1 + abs(ref)) and \
        abs(numeric - analytic) <= GRAD_TOLERANCE * (1 + abs(numeric))
    say(f"float64 loss {float(value):.12f} (NumPy reference {ref:.12f}); gradient along a random direction "
        f"{analytic:.10f}, central difference {numeric:.10f} -> {'OK' if ok else 'FAILED'}")
    losses = train_steps(args, mesh, kw, vocab, seq, rng, ids, labels, say)
    falling = losses[-1] < losses[0]
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} Adam steps -> {'OK' if falling else 'FAILED'}")
    return 0 if ok and falling else 1


def train_steps(args, mesh, kw, vocab, seq, rng, ids, labels, say) -> list[float]:
    """args.steps Adam steps of one jitted step whose state (params, m, v) is donated; the losses."""
    dt = np_dtype(args.dtype)
    params = init_gpt(rng, vocab, args.hidden, 2, seq, "float64", scale=0.1)
    params = tree.tree_map(lambda w: w.astype(dt), params)
    zeros = tree.tree_map(np.zeros_like, params)
    state = (params, zeros, tree.tree_map(np.zeros_like, params))
    train = sf.jit(adam_step(args.heads, kw), mesh=mesh, donate_argnums=0)
    # (the first state placed as the step returns it, as the README advises: NumPy arrays donated could not
    # be written in place, and every rank warned so, a README probe)
    with warnings.catch_warnings():  # (the plan for NumPy arguments, asked only for its output layouts, warns so)
        warnings.simplefilter("ignore")
        layouts = train.lower(state, ids, labels, np.asarray(args.lr, dt)).output_layouts[0]
    state = sf.distribute(state, mesh, layouts)
    losses = []
    for t in range(1, args.steps + 1):
        lr_t = np.asarray(args.lr * np.sqrt(1 - 0.99 ** t) / (1 - 0.9 ** t), dt)
        state, loss = train(state, ids, labels, lr_t)
        losses.append(float(loss))
        say(f"step {t}: loss {losses[-1]:.4f}")
    return losses


def main(argv=None) -> int:
    """`shardfuse demo [options]`: --layer and --train here, the seed and --mlp demos in demo.py."""
    args = parse_args(argv)
    if args.layer:
        return layer_demo(args)
    return train_demo(args) if args.train else run(args)
