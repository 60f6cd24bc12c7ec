"""How long sf.jit takes to trace and compile a training step (the first call's wait), on NumPy
devices, and where the time goes: value_and_grad of sf.nn.transformer_layer, and of a small GPT
written as a JAX user writes one (np.* on traced values: its own layer norm, masked softmax and
cross-entropy; a new user's probe of 2026-12-06), both on a dp x tp mesh; the median of --repeat
compiles of a fresh sf.jit each, then one compile under cProfile with the passes summed
(compile_program's pipeline, shardfuse/passes).

    python benchmarks/compile_time.py [--repeat 5] [--hidden 64] [--layers 2]
"""
from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time

import numpy as np

import shardfuse as sf
from shardfuse.passes import PIPELINE
from shardfuse.transformer import init_params, transformer_layer


def step_fn(layers, heads):
    def loss(ps, x):
        for p in ps:
            x = transformer_layer(p, x, heads, tp="tp", dp="dp")
        return (x ** 2).mean()
    return sf.value_and_grad(loss)


def _layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b


def _block(lp, x, heads):
    b, s, d = x.shape
    h = _layer_norm(x, lp["ln1_w"], lp["ln1_b"])
    q, k, v = ((h @ sf.shard(lp[w], axis=1, over="tp")).reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)
               for w in ("wq", "wk", "wv"))
    scores = np.where(np.tril(np.ones((s, s), dtype=bool)), q @ k.swapaxes(-1, -2) / math.sqrt(d // heads), -np.inf)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    o = ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
    x = x + o @ sf.shard(lp["wo"], axis=0, over="tp") + lp["bo"]
    h = _layer_norm(x, lp["ln2_w"], lp["ln2_b"]) @ sf.shard(lp["w1"], axis=1, over="tp") + lp["b1"]
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return x + h @ sf.shard(lp["w2"], axis=0, over="tp") + lp["b2"]


def handwritten_step(layers, heads):
    """A GPT's loss as a JAX user writes it: vocab-parallel embedding and head, its own norms and
    softmax, cross-entropy by take_along_axis."""
    def loss(params, ids, labels):
        x = sf.shard(params["wte"], axis=0, over="tp")[sf.shard(ids, axis=0, over="dp")]
        for lp in params["layers"]:
            x = _block(lp, x, heads)
        logits = x @ sf.shard(params["head"], axis=1, over="tp")
        s = logits - logits.max(-1, keepdims=True)
        logp = s - np.log(np.exp(s).sum(-1, keepdims=True))
        return -np.take_along_axis(logp, labels[..., None], axis=-1).mean()
    return sf.value_and_grad(loss)


def timed(make, args, repeat, mesh, what):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = sf.jit(make(), mesh=mesh).lower(*args)
        times.append(time.perf_counter() - t0)
    print(f"{what}: compile median {np.median(times):.2f} s of {len(times)} ({', '.join(f'{t:.2f}' for t in times)}); "
          f"plan {len(str(plan).splitlines())} lines")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    mesh = sf.DeviceMesh((2, 2), ("dp", "tp"), backend="numpy")
    rng = np.random.default_rng(0)
    params = [init_params(rng, args.hidden, "float32") for _ in range(args.layers)]
    x = rng.standard_normal((4, 16, args.hidden)).astype(np.float32)
    what = f"{args.layers} layers, hidden {args.hidden}, dp=2 x tp=2"
    timed(lambda: step_fn(args.layers, args.heads), (params, x), args.repeat, mesh, f"sf.nn.transformer_layer, {what}")
    vocab = 64
    gpt = {"wte": rng.standard_normal((vocab, args.hidden)).astype(np.float32), "layers": params,
           "head": rng.standard_normal((args.hidden, vocab)).astype(np.float32)}
    ids = rng.integers(0, vocab, (4, 16)).astype(np.int32)
    timed(lambda: handwritten_step(args.layers, args.heads), (gpt, ids, ids), args.repeat, mesh,
          f"a hand-written GPT, {what}")
    prof = cProfile.Profile()
    prof.enable()
    sf.jit(handwritten_step(args.layers, args.heads), mesh=mesh).lower(gpt, ids, ids)
    prof.disable()
    stats = pstats.Stats(prof).stats
    names = {p.__name__ for p in PIPELINE}
    per_pass = {fn: v[3] for (_, _, fn), v in stats.items() if fn in names}  # (cumulative time of each pass)
    print("the hand-written GPT's passes under cProfile (cumulative s):")
    for name, t in sorted(per_pass.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {t:6.2f}  {name}")


if __name__ == "__main__":
    main()
