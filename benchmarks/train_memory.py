"""The layer's training step as benchmarks/layer_vs_torch.py --train compiles it, planned on one NumPy
device (CPU, nothing allocated): plan.memory() and its largest buffers, slab by slab (issue 32).

    python benchmarks/train_memory.py                        # hidden 4096, 32 heads, seq 2048, batch 4, bf16, fused
    SHARDFUSE_FUSE=0 python benchmarks/train_memory.py       # one step per op
    python benchmarks/train_memory.py --hidden 256 --seq 128  # every buffer / 256 (tests/test_train_memory.py)
    python benchmarks/train_memory.py --gpt-layers 4 --hidden 1024 --heads 16 --seq 1024 [--checkpoint]
                                      # value_and_grad of gpt_loss (vocab 4096), each layer sf.checkpoint'ed or not
"""
from __future__ import annotations

import argparse

import shardfuse as sf
from shardfuse.ops import Op
from shardfuse.passes.reuse import nbytes
from shardfuse.transformer import PARAMS, adam_step, gpt_loss


def specs(hidden, seq, batch, dtype):
    h = hidden
    shapes = {"wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h), "w1": (h, 4 * h), "w2": (4 * h, h), "b1": (4 * h,)}
    p = {k: sf.TensorSpec(shapes.get(k, (h,)), dtype) for k in PARAMS}
    x = sf.TensorSpec((batch, seq, h), dtype)
    return p, dict(p), dict(p), x, x


def gpt_specs(layers, vocab, hidden, seq, batch, dtype):
    """(parameters, ids, labels) specs of gpt_loss: a dict of `layers` layer dicts as specs() makes."""
    p = {"wte": sf.TensorSpec((vocab, hidden), dtype), "wpe": sf.TensorSpec((seq, hidden), dtype),
         "lnf_w": sf.TensorSpec((hidden,), dtype), "lnf_b": sf.TensorSpec((hidden,), dtype),
         "head": sf.TensorSpec((hidden, vocab), dtype),
         "layers": [specs(hidden, seq, batch, dtype)[0] for _ in range(layers)]}
    ids = sf.TensorSpec((batch, seq), "int32")
    return p, ids, ids


def slabs(prog):
    """(bytes, slab or '-', members) of every buffer made once, largest first."""
    groups, rows = {}, []
    for i in prog.instrs:
        if i.op == Op.ALLOCATE and not i.attrs.get("per_call"):
            if "slab" in i.attrs:
                groups.setdefault(i.attrs["slab"], []).append(i.outs[0])
            else:
                rows.append((nbytes(i.outs[0], prog.mesh) * i.attrs.get("pool", 1), "-", [i.outs[0]]))
    rows += [(max(nbytes(v, prog.mesh) for v in vs), k, vs) for k, vs in groups.items()]
    return sorted(rows, key=lambda r: -r[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=12, help="how many of the largest slabs to list")
    ap.add_argument("--gpt-layers", type=int, default=0, help="plan a GPT's value_and_grad of this many layers instead")
    ap.add_argument("--vocab", type=int, default=4096, help="the GPT's vocabulary (with --gpt-layers)")
    ap.add_argument("--checkpoint", action="store_true", help="each GPT layer under sf.checkpoint")
    args = ap.parse_args()
    mesh = sf.DeviceMesh(1, backend="numpy")
    if args.gpt_layers:
        step = sf.value_and_grad(lambda p, i, t: gpt_loss(p, i, t, args.heads, checkpoint=args.checkpoint))
        plan = sf.jit(step, mesh=mesh).lower(*gpt_specs(args.gpt_layers, args.vocab, args.hidden, args.seq,
                                                        args.batch, args.dtype))
    else:
        plan = sf.jit(adam_step(args.heads), mesh=mesh, donate_argnums=(0, 1, 2)).lower(
            *specs(args.hidden, args.seq, args.batch, args.dtype))
    m = plan.memory()
    print(f"{f'GPT of {args.gpt_layers} layers ' if args.gpt_layers else ''}"
          f"{'checkpointed ' if args.checkpoint else ''}"
          f"hidden={args.hidden} heads={args.heads} seq={args.seq} batch={args.batch} {args.dtype}: "
          + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in m.items()))
    for b, k, vs in slabs(plan.program)[:args.top]:
        names = ", ".join(f"{v.name} {v.type.dtype}{list(v.type.shape)}" for v in vs)
        print(f"  {b / 2**30:6.3f} GiB  slab {k}: {names[:160]}")


if __name__ == "__main__":
    main()
