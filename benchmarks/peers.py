"""AllGather+GEMM against its peers, on the same inputs, in one run (issue #5's harness).

One process per GPU under mpiexec (or one process for D = 1):

    mpiexec -n D python3 benchmarks/peers.py --m 8192 --k 8192 --n 8192 --dtype bfloat16 --chunks 1,2,4,8

Each rank holds A's row block [M/D, K] and the whole B [K, N], made once by PyTorch on its GPU.
Timed (CUDA events, warm-up, median), all on those very tensors:

* torch: `all_gather_into_tensor` then `torch.mm` (the unpipelined NCCL baseline);
* torch: `torch.distributed._symmetric_memory.fused_all_gather_matmul` (copy-engine based),
  reported as unavailable with the reason where this PyTorch or machine cannot run it;
* shardfuse: the unpipelined plan and the pipelined plan for each S (the seed layout
  [S, D, M/(S*D), K], and the natural layout x [M, K] sharded on rows), called as a user calls
  them: the torch tensors go in through the public API (`sf.from_local` for this rank's rows on
  every call, `sf.replicate` for B once; zero copy) and each result comes out through
  `torch.from_dlpack`, on torch's current stream.

Every result is compared with the torch baseline's product.  Prints a table on rank 0 (`--json`
for machines).  Keep the machine's NVLink multicast settings (NCCL_NVLS_ENABLE=0 and friends).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _world():
    if any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        from mpi4py import MPI

        c = MPI.COMM_WORLD
        return c, c.Get_rank(), c.Get_size()
    return None, 0, 1


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, stream_sync, warmup, repeat, event_pair):
    """Median milliseconds of fn() between two CUDA events (the caller's event factory)."""
    for _ in range(warmup):
        fn()
    stream_sync()
    times = []
    for _ in range(repeat):
        start, stop, elapsed = event_pair()
        start()
        fn()
        stop()
        times.append(elapsed())
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=8192, help="M: rows of A (all devices together)")
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--chunks", default="1,2,4,8")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    comm, rank, size = _world()
    import cupy
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", rank)))
    torch.cuda.set_device(local)
    cupy.cuda.Device(local).use()
    port = comm.bcast(_free_port() if rank == 0 else None) if comm else _free_port()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", local))
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    M, K, N, D = args.m, args.k, args.n, size
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    a = torch.randn(M // D, K, device="cuda", dtype=torch.float32, generator=gen).to(tdt)
    gen.manual_seed(99)  # B is replicated: the same on every rank
    b = torch.randn(K, N, device="cuda", dtype=torch.float32, generator=gen).to(tdt)
    torch.cuda.synchronize()

    def torch_events():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def stop():
            e.record()
            e.synchronize()
        return s.record, stop, lambda: s.elapsed_time(e)

    rows, results = [], {}
    a_full = torch.empty(M, K, device="cuda", dtype=tdt)
    c_ref = torch.empty(M, N, device="cuda", dtype=tdt)

    def ag_mm():
        dist.all_gather_into_tensor(a_full, a)
        torch.mm(a_full, b, out=c_ref)

    ms = timed(ag_mm, torch.cuda.synchronize, args.warmup, args.repeat, torch_events)
    ag_mm()
    torch.cuda.synchronize()
    ref = c_ref.float()
    rows.append({"name": "torch all_gather_into_tensor + mm", "ms": ms})
    t_ag = timed(lambda: dist.all_gather_into_tensor(a_full, a), torch.cuda.synchronize, args.warmup, args.repeat,
                 torch_events)
    t_mm = timed(lambda: torch.mm(a_full, b, out=c_ref), torch.cuda.synchronize, args.warmup, args.repeat,
                 torch_events)
    rows += [{"name": "torch all_gather alone", "ms": t_ag, "flops": False}, {"name": "torch mm alone", "ms": t_mm}]

    def rel(c):
        return float((c.float() - ref).norm() / ref.norm())

    try:
        from torch.distributed import _symmetric_memory as symm

        group = dist.group.WORLD.group_name
        import warnings

        with warnings.catch_warnings():  # needed by older PyTorch, a deprecated no-op in newer
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group)
        fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=group)  # noqa
        ms = timed(fused, torch.cuda.synchronize, args.warmup, args.repeat, torch_events)
        out = fused()[1][0]
        torch.cuda.synchronize()
        rows.append({"name": "torch fused_all_gather_matmul", "ms": ms, "rel_err_vs_torch": rel(out)})
    except Exception as e:  # not every PyTorch build or machine runs symmetric memory
        rows.append({"name": "torch fused_all_gather_matmul", "ms": None,
                     "unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})

    import shardfuse as sf
    from shardfuse.demo import seed_functions

    # shardfuse as a user calls it, on these very tensors (public API only, no copies): this
    # rank's rows A go in through sf.from_local on every call, the weight B is placed once, and
    # the result comes out through torch.from_dlpack.  Calls are ordered with torch's stream.
    mesh = sf.DeviceMesh(D, backend="cupy")
    ax = mesh.axis_names[-1]
    stream = torch.cuda.current_stream()
    pipelined, unpipelined = seed_functions(mesh, args.streams)  # the seed layout [S, D, M/(S*D), K]
    b_arr = sf.replicate(b, mesh=mesh)

    def seed_call(f, s):
        """f on A as this rank's piece [S, 1, M/(S*D), K] of the seed layout (a view of a)."""
        return lambda: torch.from_dlpack(f(sf.from_local(a.view(s, 1, M // (s * D), K), axis=1, over=ax, mesh=mesh),
                                           b_arr, stream=stream))

    def as_torch_order(c, s):
        """A result in torch's row order (rank-major).  The seed layout's rows are (chunk,
        device, row); torch's gathered rows are (device, chunk, row)."""
        if s is not None:
            c = c.reshape(s, D, M // (s * D), N).transpose(0, 1)
        return c.reshape(M, N)

    def natural(s):  # the natural layout: x [M, K] sharded on rows, S chunks
        f = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0, over=ax) @ w, axis=0, chunks=s), mesh=mesh,
                   streams=args.streams)
        return lambda: torch.from_dlpack(f(sf.from_local(a, axis=0, over=ax, mesh=mesh), b_arr, stream=stream))

    chunk_counts = [s for s in map(int, args.chunks.split(",")) if M % (s * D) == 0]
    cases = [("shardfuse seed unpipelined", seed_call(unpipelined, 1), 1, 1)]
    cases += [(f"shardfuse seed pipelined S={s}", seed_call(pipelined, s), s, s) for s in chunk_counts]
    cases += [(f"shardfuse natural pipelined S={s}", natural(s), s, None) for s in chunk_counts]
    torch.cuda.synchronize()
    for name, call, s, order in cases:
        ms = timed(call, torch.cuda.synchronize, args.warmup, args.repeat, torch_events)
        out = call()
        torch.cuda.synchronize()
        rows.append({"name": name, "S": s, "ms": ms, "rel_err_vs_torch": rel(as_torch_order(out, order))})

    flops = 2.0 * M * N * K
    for r in rows:
        if r.get("ms"):
            r["tflops_per_gpu"] = flops / D / (r["ms"] * 1e-3) / 1e12 if r.pop("flops", True) else None
            r["speedup_vs_torch_ag_mm"] = rows[0]["ms"] / r["ms"]
    env = {"D": D, "M": M, "K": K, "N": N, "dtype": args.dtype, "torch": torch.__version__, "cupy": cupy.__version__,
           "gpu": torch.cuda.get_device_name(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    if rank == 0:
        if args.json:
            print(json.dumps({"env": env, "rows": rows}))
        else:
            print(env)
            for r in rows:
                tf = f"{r['tflops_per_gpu']:.0f} TFLOP/s/GPU" if r.get("tflops_per_gpu") else ""
                extra = r.get("unavailable") or (f"{r['ms']:.3f} ms  {tf:>17}  "
                                                 f"x{r['speedup_vs_torch_ag_mm']:.3f} vs torch AG+mm" +
                                                 (f"  err {r['rel_err_vs_torch']:.1e}" if "rel_err_vs_torch" in r else ""))
                print(f"{r['name']:<36} {extra}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
