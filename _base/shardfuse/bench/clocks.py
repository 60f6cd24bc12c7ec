"""The bench's clocks: one interface, read by the one timing loop (runner.run).

A clock marks points in a stream of calls and tells the time between two of them:

* `idle(stream)` blocks until nothing runs anywhere (the backend's streams, the caller's, `stream`);
* `stamps(n)` gives n stamps, made before a run so nothing is allocated between its calls;
* `stamp(stamps, k, stream)` sets stamp k where everything issued so far on `stream` (default: the
  caller's stream) has finished;
* `between(a, b)` is the milliseconds from stamp a to stamp b (waiting for b);
* `memory()` is (pool bytes held, device bytes in use), or None where there is no device.
"""
from __future__ import annotations

import time


def device_streams(backend) -> bool:
    """Whether the backend runs its steps on CUDA streams (events then time them, and the
    values live on the device); else the host runs the steps and wall time is the clock.
    The one place the bench tells the two apart."""
    return "cuda_runtime" in backend.describe()


def make_clock(backend, cuda: bool):
    return CudaClock(backend) if cuda else HostClock(backend)


class HostClock:
    """NumPy backends: the host runs the steps, so wall time is both GPU and host time."""

    def __init__(self, backend):
        self.backend = backend

    def idle(self, stream=None):
        self.backend.synchronize()

    def stamps(self, n):
        return [None] * n

    def stamp(self, stamps, k, stream=None):
        """Stamp k once everything issued so far has finished (the host runs the steps)."""
        self.backend.synchronize()
        stamps[k] = time.perf_counter()

    def between(self, a, b):
        return (b - a) * 1e3

    def memory(self):
        return None


class CudaClock:
    """CUDA events on the caller's stream (CuPy's current stream: every plan call is fenced
    with it), or on the stream a bare baseline issues on."""

    def __init__(self, backend):
        import cupy

        self.cupy, self.backend = cupy, backend
        self.pool = []  # events, reused from run to run (each run waits for its last one)

    def idle(self, stream=None):
        self.backend.synchronize()
        self.cupy.cuda.get_current_stream().synchronize()
        if stream is not None:
            stream.synchronize()

    def stamps(self, n):
        while len(self.pool) < n:
            self.pool.append(self.cupy.cuda.Event())
        return self.pool[:n]

    def stamp(self, stamps, k, stream=None):
        """Event k on the stream (default: the caller's), where the calls before it are fenced."""
        stamps[k].record(stream or self.cupy.cuda.get_current_stream())

    def between(self, a, b):
        b.synchronize()
        return self.cupy.cuda.get_elapsed_time(a, b)

    def memory(self):
        """(pool bytes held, device bytes in use)."""
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return self.cupy.get_default_memory_pool().total_bytes(), total - free


def caller_streams(cuda):
    """The caller's stream for the whole run: on CUDA a non-blocking CuPy stream (a context that
    makes it current) and, when torch imports, the same stream as torch's current stream
    (returned: the user path passes it as stream=); elsewhere nothing."""
    import contextlib

    if not cuda:
        return contextlib.nullcontext(), None
    import cupy

    caller = cupy.cuda.Stream(non_blocking=True)
    try:
        import torch
    except ImportError:
        return caller, None
    dev = torch.device("cuda", cupy.cuda.Device().id)
    torch.cuda.set_device(dev)
    ts = torch.cuda.ExternalStream(caller.ptr, device=dev)
    torch.cuda.set_stream(ts)
    return caller, ts
