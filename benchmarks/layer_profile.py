"""Where the transformer layer's time goes on one GPU: plan.profile() of the forward (and, with
--train, of the value_and_grad step), the steps summed by instruction kind, the largest first.

    python benchmarks/layer_profile.py [--train] [--batch 4]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch

import shardfuse as sf
from shardfuse.transformer import init_params, transformer_layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="a smoke test on a NumPy device")
    args = ap.parse_args()
    dev = "cpu" if args.cpu else "cuda"
    p = {k: torch.tensor(v, device=dev).to(torch.bfloat16)
         for k, v in init_params(np.random.default_rng(0), args.hidden, "float32").items()}
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=torch.bfloat16)
    mesh = sf.DeviceMesh(1, backend="numpy" if args.cpu else "cupy")
    if args.train:
        fn = sf.jit(sf.value_and_grad(lambda p, x: (transformer_layer(p, x, args.heads) ** 2).mean()), mesh=mesh)
    else:
        fn = sf.jit(lambda p, x: transformer_layer(p, x, args.heads), mesh=mesh)
    plan = fn.lower(p, x)
    fn(p, x)
    tl = plan.profile(p, x, repeat=2)
    by_kind, by_text = defaultdict(float), defaultdict(float)
    for e in tl.events:
        if e.call != 1:
            continue
        by_kind[e.text.split()[0]] += e.duration
        by_text[e.text] += e.duration
    total = sum(by_kind.values())
    print(f"{'train step' if args.train else 'forward'}: {total * 1e3:.2f} ms in steps, {len(tl.events) // 2} steps")
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {t * 1e3:8.2f} ms  {k}")
    print("largest steps:")
    for k, t in sorted(by_text.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {t * 1e3:8.2f} ms  {k[:110]}")


if __name__ == "__main__":
    main()
