"""The transformer layer on one GPU against torch, back to back in one process (issues 29 item 4,
31 item 9, 32 item 7): forward, and a training step (forward, backward, Adam), of
sf.nn.transformer_layer against the same layer in torch eager written with the same primitive
ops, torch with F.layer_norm / F.scaled_dot_product_attention / F.gelu, and torch.compile of the
eager layer.  Median of --repeat calls timed with CUDA events on torch's stream; peak memory from
torch's allocator and CuPy's pool.  Prints one table; --json for one JSON object.

    python benchmarks/layer_vs_torch.py                      # hidden 4096, 32 heads, seq 2048, batch 4, bf16
    python benchmarks/layer_vs_torch.py --batch 1 --train    # the training step too
    SHARDFUSE_FUSE=0 python benchmarks/layer_vs_torch.py     # one step per op (fused elementwise chains by default)
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import shardfuse as sf
from shardfuse.transformer import adam_step, init_params, transformer_layer

NAMES = ("ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "bo", "ln2_w", "ln2_b", "w1", "b1", "w2", "b2")


def torch_layer_primitive(p, x, heads):
    """The layer as shardfuse computes it, op by op, in torch eager (norms and softmax in float32)."""
    b, s, h = x.shape

    def ln(t, w, c):
        t32 = t.float()
        d = t32 - t32.mean(-1, keepdim=True)
        return (d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w.float() + c.float()).to(t.dtype)

    def split(t):
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)

    y = ln(x, p["ln1_w"], p["ln1_b"])
    q, k, v = (split(y @ p[w]) for w in ("wq", "wk", "wv"))
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(h // heads))
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    scores = torch.where(mask, scores, -0.7 * torch.finfo(scores.dtype).max).float()
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    attn = (e / e.sum(-1, keepdim=True)).to(x.dtype)
    o = (attn @ v).transpose(1, 2).reshape(b, s, h)
    x = x + (o @ p["wo"] + p["bo"])
    z = ln(x, p["ln2_w"], p["ln2_b"]) @ p["w1"] + p["b1"]
    z = 0.5 * z * (1 + torch.tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    return x + (z @ p["w2"] + p["b2"])


def torch_layer_fused(p, x, heads):
    """The same layer with torch's fused kernels (F.layer_norm, SDPA, F.gelu)."""
    b, s, h = x.shape
    y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
    q, k, v = ((y @ p[w]).reshape(b, s, heads, h // heads).transpose(1, 2) for w in ("wq", "wk", "wv"))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
    x = x + (o @ p["wo"] + p["bo"])
    z = F.gelu(F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"]) @ p["w1"] + p["b1"], approximate="tanh")
    return x + (z @ p["w2"] + p["b2"])


def timed(fn, repeat, warmup=2):
    """Median milliseconds of fn() over `repeat` calls, CUDA events on torch's current stream
    (host clocks with --cpu, the smoke test)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _adam_torch(params):
    return torch.optim.Adam(list(params.values()), lr=1e-4, foreach=True)


def _free(args):
    """Give back what the last measurement held (CuPy's pool, torch's cache) before the next."""
    import gc

    gc.collect()
    if not args.cpu:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()


def _attempt(errors, name, fn):
    """fn(), or None with its error kept (an out-of-memory shows as such in the table)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (a benchmark reports, it does not stop)
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None


def run(args):
    dev = torch.device("cpu" if args.cpu else "cuda")
    rng = np.random.default_rng(0)
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    p64 = init_params(rng, args.hidden, "float32")
    params = {k: torch.tensor(v, device=dev).to(dt) for k, v in p64.items()}
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=dt)
    mesh = sf.DeviceMesh(1, backend="numpy" if args.cpu else "cupy")
    stream = None if args.cpu else torch.cuda.current_stream()
    rows, mem, errors = {}, {}, {}

    def peak(fn):
        if args.cpu:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30

    with torch.no_grad():
        want = torch_layer_primitive(params, x, args.heads)
        for name, f in (("torch eager (same ops)", torch_layer_primitive), ("torch fused (SDPA)", torch_layer_fused)):
            mem[name] = _attempt(errors, name, lambda: peak(lambda: f(params, x, args.heads)))
            rows[name] = _attempt(errors, name, lambda: timed(lambda: f(params, x, args.heads), args.repeat))
        if args.compile:
            compiled = torch.compile(torch_layer_primitive)
            rows["torch.compile (same ops)"] = _attempt(
                errors, "torch.compile", lambda: timed(lambda: compiled(params, x, args.heads), args.repeat, warmup=3))
    _free(args)
    err = None
    for name, graph in (("shardfuse eager", False),) + ((("shardfuse graph", True),) if args.graph else ()):
        ours = sf.jit(lambda p, x: transformer_layer(p, x, args.heads), mesh=mesh, graph=graph)
        got = _attempt(errors, name, lambda: ours(params, x, stream=stream))
        if got is not None:
            err = float((torch.from_dlpack(got).float() - want.float()).norm() / want.float().norm())
            rows[name] = _attempt(errors, name, lambda: timed(lambda: ours(params, x, stream=stream), args.repeat))
            mem[name] = _pool_gib(args)
        del ours, got
        _free(args)
    out = {"config": vars(args), "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "forward_ms": rows,
           "forward_peak_gib": mem, "relative_error_vs_torch": err, "errors": errors}
    if args.train:
        out.update(train(args, params, x, mesh, stream, errors))
    return out


def train(args, params, x, mesh, stream, errors):
    t = torch.randn_like(x)
    rows, mem = {}, {}
    tp = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = _adam_torch(tp)

    def torch_step(f):
        opt.zero_grad(set_to_none=True)
        loss = ((f(tp, x, args.heads) - t) ** 2).float().mean()
        loss.backward()
        opt.step()
    for name, f in (("torch eager (same ops)", torch_layer_primitive), ("torch fused (SDPA)", torch_layer_fused)):
        if not args.cpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        rows[name] = _attempt(errors, "train " + name, lambda: timed(lambda: torch_step(f), args.repeat))
        mem[name] = None if args.cpu else torch.cuda.max_memory_allocated() / 2**30
    del tp, opt
    _free(args)
    step = sf.jit(adam_step(args.heads), mesh=mesh, donate_argnums=(0, 1, 2))
    state = [{k: v.clone() for k, v in params.items()}, {k: torch.zeros_like(v) for k, v in params.items()},
             {k: torch.zeros_like(v) for k, v in params.items()}]

    def ours():
        p, m, v, loss = step(*state, x, t, stream=stream)
        state[:] = [p, m, v]
    rows["shardfuse eager"] = _attempt(errors, "train shardfuse", lambda: timed(ours, args.repeat))
    mem["shardfuse eager"] = _pool_gib(args)
    return {"train_step_ms": rows, "train_peak_gib": mem}


def _pool_gib(args):
    """What CuPy's memory pool holds (the plans' buffers, workspaces), GiB."""
    if args.cpu:
        return None
    import cupy

    return cupy.get_default_memory_pool().total_bytes() / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--train", action="store_true", help="time a training step too (forward, backward, Adam)")
    ap.add_argument("--graph", action="store_true", help="shardfuse with CUDA graphs too")
    ap.add_argument("--compile", action="store_true", help="torch.compile of the eager layer too (slow to compile)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="a smoke test on NumPy devices and CPU torch (small sizes)")
    args = ap.parse_args()
    t0 = time.time()
    out = run(args)
    out["wall_s"] = time.time() - t0
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['device']}  hidden={args.hidden} heads={args.heads} seq={args.seq} batch={args.batch} {args.dtype}")
    rel = out["relative_error_vs_torch"]
    print(f"relative error of shardfuse's forward vs torch eager: {'-' if rel is None else f'{rel:.2e}'}")
    for what in ("forward", "train_step"):
        if f"{what}_ms" not in out:
            continue
        peaks = out.get(f"{what}_peak_gib", out.get("forward_peak_gib", {})) if what == "forward" else out["train_peak_gib"]
        base = out[f"{what}_ms"].get("torch eager (same ops)")
        for name, ms in out[f"{what}_ms"].items():
            gib = peaks.get(name)
            speed = "" if ms is None or not base else f"{ms:9.2f} ms  {ms / base:5.2f}x torch eager"
            print(f"  {what:10s} {name:26s} {speed or 'failed':>34s}" + (f"  peak {gib:6.2f} GiB" if gib else ""))
    for name, e in out["errors"].items():
        print(f"  error: {name}: {e}")


if __name__ == "__main__":
    main()
