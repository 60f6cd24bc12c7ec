"""Bytes each device makes for a two-stage pipeline's training step (value_and_grad of a 4-layer MLP, stage 0
on devices 0-1, stage 1 on 2-3, NumPy devices: nothing runs): plan.memory() and the buffers the executor
really made per device (placeholders, one element broadcast, not counted).  Run: python
benchmarks/stage_memory.py LABEL."""
import numpy as np, shardfuse as sf, sys
mesh = sf.DeviceMesh(4, backend="numpy")
s0, s1 = mesh.submesh([0, 1]), mesh.submesh([2, 3])
B, H = 256, 1024
def loss(params, x):
    w0, w1, w2, w3 = params
    h = sf.gelu(sf.shard(x, axis=0, mesh=s0) @ sf.replicate(w0, mesh=s0))
    h = sf.gelu(h @ sf.replicate(w1, mesh=s0))
    h = sf.to_mesh(h, s1, axis=0)
    h = sf.gelu(h @ sf.replicate(w2, mesh=s1))
    return (h @ sf.replicate(w3, mesh=s1)).sum()
step = sf.jit(sf.value_and_grad(loss), mesh=mesh)
rng = np.random.default_rng(0)
params = [rng.standard_normal((H, H)).astype(np.float32) / 32 for _ in range(4)]
x = rng.standard_normal((B, H)).astype(np.float32)
plan = step.lower(params, x)
exe = plan.executable
made = [0] * 4
for bufs in exe.slot_templates[len(exe.prog.inputs):]:
    for j, b in enumerate(bufs or ()):
        made[j] += 0 if (b.size > 1 and not any(b.strides)) else b.nbytes
print(sys.argv[1], "memory():", plan.memory(), "made per device (MB):", [round(m / 1e6, 2) for m in made])
