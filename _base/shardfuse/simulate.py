"""`shardfuse simulate`: a plan's predicted timeline on D GPUs, from published figures.

The plan is compiled on a NumPy mesh of D virtual devices from TensorSpecs (nothing is computed
or allocated) and predicted by the cost model with a GPU's built-in rates (--gpu), or with the
rates `shardfuse calibrate` measured (--rates), one process per GPU.  Cases: the seed (A [M, K]
sharded on rows, B [K, N] replicated, C = A @ B streamed along its rows: AllGather+GEMM), or with
--mlp the Megatron-style MLP block (shardfuse.mlp; tokens = M, hidden = K, N unused).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import shardfuse as sf
from shardfuse import autochunks
from shardfuse.cost import DEFAULTS, Rates, predict
from shardfuse.mesh import as_int
from shardfuse.mlp import mlp_block
from shardfuse.trace import trace
from shardfuse.timeline import output_file

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64",
               **{n: n for n in ("bfloat16", "float16", "float32", "float64")}}


def parser():
    p = argparse.ArgumentParser(prog="shardfuse simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="D, the GPUs (default 8)")
    p.add_argument("--gpu", default="h200", choices=sorted(DEFAULTS), help="built-in rates to predict with")
    p.add_argument("--rates", default=None, help="a rates JSON file instead (a `shardfuse calibrate` cache file)")
    p.add_argument("--m", type=int, default=32768, help="M, all of A's rows, as in shardfuse demo and bench (with --mlp: tokens)")
    p.add_argument("--k", type=int, default=32768, help="columns of A (with --mlp: the hidden size)")
    p.add_argument("--n", type=int, default=8192, help="columns of B (unused with --mlp)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_NAMES))
    p.add_argument("--chunks", default="auto", help="S, or auto (the cost model chooses)")
    p.add_argument("--streams", type=int, default=4, help="worker streams")
    p.add_argument("--mlp", nargs="?", const="sp", default=None, choices=["sp", "tp"],
                   help="the MLP block instead: sp (sequence parallel, the default) or tp")
    p.add_argument("--png", type=output_file, default=None, help="the predicted timeline as a Gantt chart (needs matplotlib)")
    p.add_argument("--trace", type=output_file, default=None, help="the predicted timeline as a Chrome trace / Perfetto JSON")
    return p


def _numbers(args) -> dict:
    """The numeric options, checked: a ValueError (one line on the command line) for a bad one."""
    out = {n: as_int(getattr(args, n), f"--{n}", minimum=1) for n in ("devices", "m", "k", "n", "streams")}
    if args.chunks != "auto" and not (args.chunks.isdigit() and int(args.chunks) > 0):
        raise ValueError(f"--chunks must be a positive int or auto, got {args.chunks!r}")
    return {**out, "chunks": args.chunks if args.chunks == "auto" else int(args.chunks)}


def seed(mesh, chunks, streams):
    """The seed in its natural layout: C = A @ B streamed along its rows, A sharded on rows."""
    def ag_gemm(a, b):
        return sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=chunks)
    return sf.jit(ag_gemm, mesh=mesh, streams=streams)


def case(mesh, nums, dtype, mlp):
    """(jitted function, input specs) of the case to simulate."""
    m, k, n, s = nums["m"], nums["k"], nums["n"], nums["chunks"]
    if mlp:
        shapes = [(m, k), (k, 4 * k), (4 * k,), (4 * k, k), (k,)]
        return mlp_block(mesh, mlp, chunks=s, streams=nums["streams"]), [sf.TensorSpec(x, dtype) for x in shapes]
    return seed(mesh, s, nums["streams"]), [sf.TensorSpec((m, k), dtype), sf.TensorSpec((k, n), dtype)]


def load_rates(args) -> Rates:
    """--gpu's built-in rates, or those of a --rates file (a calibrate cache file, or Rates.to_json's dict)."""
    try:
        doc = DEFAULTS[args.gpu].to_json() if args.rates is None else json.loads(Path(args.rates).read_text())
        return Rates.from_json(doc.get("rates", doc))
    except (OSError, AttributeError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"--rates {args.rates}: not a rates file ({type(e).__name__}: {e})") from None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    nums, dtype, rates = _numbers(args), DTYPE_NAMES[args.dtype], load_rates(args)
    mesh = sf.DeviceMesh(nums["devices"], backend="numpy")
    f, specs = case(mesh, nums, dtype, args.mlp)
    machine = (rates, 1, 1)  # one process per GPU: each issues its own steps, computes on its own engine
    prog, why = autochunks.compile_best(trace(f.fn, mesh, specs, nums["streams"]), lambda: machine)
    why = why or autochunks.explain_plan(prog, *machine)
    pred = predict(prog, *machine)
    name = f"MLP block ({args.mlp})" if args.mlp else "seed AllGather+GEMM"
    print(f"simulated {name}: D={nums['devices']} x {rates.name} (one process per GPU), m={nums['m']} k={nums['k']}"
          + ("" if args.mlp else f" n={nums['n']}") + f" {dtype}, chunks={nums['chunks']}, streams={nums['streams']}")
    print(why)
    timeline = pred.timeline()
    s = timeline.summary()  # the steps' figures, as the chart's title and shardfuse profile give them
    print(f"predicted total {pred.total_s * 1e3:.3f} ms (the steps span {s['total_s'] * 1e3:.3f} ms, the rest is host "
          f"work outside them): communication {s['communication_s'] * 1e3:.3f} ms (exposed "
          f"{s['exposed_communication_s'] * 1e3:.3f}), GEMMs {s['gemm_s'] * 1e3:.3f} ms, other compute "
          f"{s['compute_s'] * 1e3:.3f} ms, overlap efficiency {s['overlap_efficiency']:.2f} over the steps' span; "
          f"collectives per call {sf.Plan(prog).collectives() or 'none'}")
    if args.trace:
        timeline.to_chrome_trace(args.trace)
        print(f"trace: {args.trace}")
    if args.png:
        timeline.plot(path=args.png)
        print(f"chart: {args.png}")
    return 0
