"""Host cost of each piece of the torch user path (issue 14): us per call of each operation
alone, median of 5 runs of 2000 calls, on one GPU.  Usage: python benchmarks/torch_interop_cost.py"""
import cupy
import numpy as np
import torch

import shardfuse as sf
from shardfuse import interop
from shardfuse.bench import host


def us(fn):
    return host.per_call_us(fn, torch.cuda.synchronize, 2000, 5)


mesh = sf.DeviceMesh(1, backend="cupy")
t = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.float16)
c = cupy.asarray(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float16))
f, a, b = host.seed(mesh, 1, True)
placed = sf.shard(a, axis=1, mesh=mesh)
res = f(placed, b)
ptr = cupy.cuda.get_current_stream().ptr
cases = {
    "torch.from_dlpack(cupy array)": lambda: torch.from_dlpack(c),
    "torch.from_dlpack(sf result)": lambda: torch.from_dlpack(res),
    "cupy __dlpack__(stream=None)": lambda: c.__dlpack__(),
    "cupy __dlpack__(stream=ptr)": lambda: c.__dlpack__(stream=ptr),
    "cupy __dlpack__(stream=-1)": lambda: c.__dlpack__(stream=-1),
    "torch.utils.dlpack.from_dlpack(cupy toDlpack())": lambda: torch.utils.dlpack.from_dlpack(c.toDlpack()),
    "sf result __dlpack__(stream=ptr)": lambda: res.__dlpack__(stream=ptr),
    "sf result __dlpack_device__()": lambda: res.__dlpack_device__(),
    "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    "interop.array_info(torch)": lambda: interop.array_info(t),
    "interop.torch_view(torch)": lambda: interop.torch_view(t),
    "cupy.from_dlpack(torch)": lambda: cupy.from_dlpack(t),
    "sf.shard(torch, axis=1)": lambda: sf.shard(t, axis=1, mesh=mesh),
    "sf.shard(cupy, axis=1)": lambda: sf.shard(a, axis=1, mesh=mesh),
    "graph plan, placed args": lambda: f(placed, b),
    "user path, cupy arrays (graph)": host.user_call(mesh, 1, True, False),
    "user path, torch tensors (graph)": host.user_call(mesh, 1, True, True),
    "t.data_ptr(); t.shape; t.stride()": lambda: (t.data_ptr(), t.shape, t.stride()),
    "cupy.ndarray over UnownedMemory": lambda: cupy.ndarray((16, 64), np.float16, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(t.data_ptr(), 2048, t, 0), 0)),
}
for name, fn in cases.items():
    print(f"{us(fn):8.2f} us  {name}", flush=True)
