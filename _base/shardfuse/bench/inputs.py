"""The bench's inputs, placed through the public API only, and the check of its results.

Global A [M, K] and B [K, N], several sets rotated over runs (fresh random values, never zeros),
the same on every process; the float64 reference C = A @ B; the relative error of a result.
"""
from __future__ import annotations

import numpy as np

import shardfuse as sf
from shardfuse.dtypes import np_dtype


def xp_of(x):
    """The array module of x: CuPy for CuPy arrays, else NumPy."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def f64(x):
    """x as float64, NumPy or CuPy; bfloat16 (ml_dtypes, or its 16-bit pattern as CuPy holds it)
    through its bits, since CuPy has no bfloat16 arithmetic."""
    if x.dtype.itemsize == 2 and x.dtype.kind != "f":
        bits = x.view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def rel_err(got, ref):
    """Relative Frobenius error of a result (any shape holding ref's values in its row order)."""
    if got is None or ref is None:
        return None
    xp = xp_of(ref)
    g = f64(xp.asarray(got)).reshape(ref.shape)
    return float(xp.linalg.norm(g - ref) / xp.linalg.norm(ref))


def nbytes(shape, dtype):
    return int(np.prod(shape)) * np_dtype(dtype).itemsize


def whole(c):
    """A replicated result's value as this process holds it (any local piece is all of it)."""
    return c.addressable_shards[0].data


class Inputs:
    """Input sets, rotated over runs: global A [M, K] and B [K, N], the same on every process.

    `raw` holds them as the backend keeps values (NumPy; or CuPy, made on the device on the
    caller's stream, bfloat16 as its uint16 bits); `user` holds the same memory as a user would
    hand it over: NumPy arrays, torch CUDA tensors when torch imports, else CuPy arrays (bfloat16
    as an ml_dtypes.bfloat16 view).  Their sf.Arrays are placed from `user` through the public
    API on first use and reused (the plan alone)."""

    def __init__(self, mesh, m, k, n, dtype, sets, seed, torch=None, cuda=False):
        self.mesh, self.dtype, self.torch = mesh, dtype, torch
        self.cuda = cuda  # values on the device (CuPy), made there
        self.m, self.k, self.n, self.d = m, k, n, mesh.size
        self.over = mesh.axis_names[-1]
        self.one_piece = len(mesh.local_devices) == 1  # a replicated result is then this process' one piece
        rng = np.random.default_rng(seed)  # global arrays: the same seed on every process
        self.raw = [(self._rand(rng, (m, k)), self._rand(rng, (k, n))) for _ in range(sets)]
        self.user = [(self._user(a), self._user(b)) for a, b in self.raw]
        self._placed = {}

    def _rand(self, rng, shape):
        if not self.cuda:
            return rng.standard_normal(shape).astype(np_dtype(self.dtype))
        import cupy

        cupy.random.seed(int(rng.integers(2**31)))
        r = cupy.random.standard_normal(shape, dtype=np.float32)
        if self.dtype == "bfloat16":
            return (r.view(np.uint32) >> 16).astype(np.uint16)
        return r.astype(self.dtype)

    def _user(self, x):
        if not self.cuda:
            return x
        bf16 = self.dtype == "bfloat16"
        if self.torch is None:
            return x.view(np_dtype("bfloat16")) if bf16 else x
        t = self.torch
        return t.from_dlpack(x.view(np.int16)).view(t.bfloat16) if bf16 else t.from_dlpack(x)

    def a_seed(self, r, chunks):
        """Set r's A as the user's [S, D, M/(S*D), K] (the seed's global shape; a view, rows in
        A's order)."""
        a = self.user[r % len(self.user)][0]
        return a.reshape(chunks, self.d, self.m // (chunks * self.d), self.k)

    def b(self, r):
        return self.user[r % len(self.user)][1]

    def _place(self, key, make):
        if key not in self._placed:
            self._placed[key] = make()
        return self._placed[key]

    def a_array(self, r, chunks):
        """Set r's seed A, sharded on axis 1 (placed on the first use, then reused)."""
        r %= len(self.user)
        return self._place(("a", r, chunks), lambda: sf.shard(self.a_seed(r, chunks), axis=1, over=self.over,
                                                              mesh=self.mesh))

    def b_array(self, r):
        r %= len(self.user)
        return self._place(("b", r), lambda: sf.replicate(self.b(r), mesh=self.mesh))

    def a_full(self, r):
        """Set r's whole A [M, K], replicated (the GEMM alone's operand)."""
        r %= len(self.user)
        return self._place(("A", r), lambda: sf.replicate(self.user[r][0], mesh=self.mesh))

    def reference(self):
        """float64 C = A @ B of set 0, [M, N] (on the GPU on CUDA)."""
        a, b = self.raw[0]
        return xp_of(a).matmul(f64(a), f64(b))

    def out(self, c):
        """A replicated result taken out as a user takes it, as a device array and without a copy:
        torch.from_dlpack where this process holds it whole in one piece (else its first local
        piece: each is all of it), or to_local() / that piece as the backend's own array."""
        if self.torch is None:
            return c.to_local() if self.one_piece else whole(c)
        t = self.torch
        if self.one_piece:
            return t.from_dlpack(c)
        piece = whole(c)
        if piece.dtype == np.uint16:  # bfloat16 bits (CuPy has no bfloat16)
            return t.from_dlpack(piece.view(np.int16)).view(t.bfloat16)
        return t.from_dlpack(piece)

    def as_raw(self, x):
        """A user-side result as NumPy or CuPy, for the check."""
        if self.torch is None:
            return x
        import cupy

        return cupy.from_dlpack(x.view(self.torch.int16) if x.dtype == self.torch.bfloat16 else x)
