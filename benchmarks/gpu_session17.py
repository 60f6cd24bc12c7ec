"""This session's CPU changes on the CuPy backend (seventeenth session, issue 29): max / min over several
axes share ties' gradient (jax_gradients.py), |x| at 0 has gradient +1, np.max with initial= / where=,
empty results (broadcast_to / repeat / tile by 0), against NumPy.  Prints one line per check."""
import numpy as np

import shardfuse as sf

mesh = sf.DeviceMesh(4, backend="cupy")
x = np.array([[1., 0., 1., 1.], [1., 1., 0., 1.]])
g = sf.jit(sf.grad(lambda a: a.max()), mesh=mesh)(sf.distribute(x, mesh, (None, "DIDx")))
tie = (x == x.max()) / (x == x.max()).sum()
print("ties over two axes", np.allclose(np.asarray(g.gather()), tie))
z = np.array([0.0, -0.0, 1.5, -2.0])
g = sf.jit(sf.grad(lambda a: np.abs(a).sum()), mesh=mesh)(sf.distribute(z, mesh, ("DIDx",)))
print("abs at 0", np.array_equal(np.asarray(g.gather()), [1.0, 1.0, 1.0, -1.0]))
r = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
m = r > 0
got = sf.jit(lambda a: np.max(a, axis=1, where=m, initial=-0.5), mesh=mesh)(sf.distribute(r, mesh, (None, "DIDx")))
print("max where initial", np.array_equal(np.asarray(got.gather()), np.max(r, axis=1, where=m, initial=-0.5)))
e = sf.jit(lambda a: np.tile(a, (0, 2)).shape + np.broadcast_to(a[:1], (0, 8)).shape, mesh=mesh)
got = sf.jit(lambda a: a.at[8:].add(1.0) * 2.0, mesh=mesh)(sf.distribute(r, mesh, ("DIDx", None)))
print("empty box add", np.array_equal(np.asarray(got.gather()), r * 2.0))
