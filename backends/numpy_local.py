"""NumPy devices in one process: every local device is a set of NumPy buffers.

Collectives are done in memory across the local devices of each team.  Streams and events
are trivial here (steps run in issue order, which is a valid schedule of any plan), but the
plan and the executor are the same ones the GPU backend runs.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from shardfuse.backends.elementwise_numpy import (ELEMENTWISE, box_slices, evaluate, evaluate_rows, row_schedule,
                                                  scatter_add_rows, schedule, summer, take_rows)
from shardfuse.backends.protocol import is_placeholder
from shardfuse.dtypes import np_dtype, poison_value
from shardfuse.ops import Reduce


def accumulator(dtype) -> np.dtype:
    """The dtype the devices' pieces of a sum are added in: float64 for floats (rounded once), the
    integers' own dtype (exact, wrapping as NumPy's: an int64 sum through float64 lost 2**53 + 1, a probe)."""
    return np.dtype(dtype) if np.dtype(dtype).kind in "iub" else np.dtype(np.float64)

POISON = os.environ.get("SHARDFUSE_POISON") == "1"  # fill new buffers with NaN (tests)


def _QUIET(step):
    """step with floating-point warnings off: x / 0 is inf as on a GPU and in JAX, with no
    RuntimeWarning from inside a compiled step, where the user's line is not to be found (an
    errstate made per call: one instance is not to be entered by two threads at once)."""
    def run(bufs):
        with np.errstate(all="ignore"):
            step(bufs)
    return run


class NumpyLocalBackend:
    name = "numpy"
    ordinals = None  # host memory

    def __init__(self, mesh):
        self.mesh = mesh
        self.local_devices = mesh.local_devices
        self.local_index = {d: j for j, d in enumerate(self.local_devices)}

    # ---- buffers ----------------------------------------------------------------------
    def empty(self, shape, dtype, devices=None):
        dt = np_dtype(dtype)
        fill = poison_value(dtype) if POISON else 0
        spare = None
        out = []
        for j in range(len(self.local_devices)):
            if devices is None or j in devices:
                out.append(np.full(shape, fill, dt) if POISON else np.empty(shape, dt))
                continue
            if spare is None:  # (read-only: a step writing a device's buffer it was not made for fails here)
                spare = np.broadcast_to(np.full((), fill, dt), tuple(shape))
            out.append(spare)
        return out

    def to_device(self, pieces):
        return [np.array(p, copy=True) for p in pieces]

    def to_host(self, bufs):
        return [np.array(b, copy=True) for b in bufs]

    def ascontiguous(self, x):  # (NumPy's of a 0-d array is 1-d: an unpickled step count came back [1], a probe)
        return np.ascontiguousarray(x).reshape(np.shape(x))

    def copy(self, x):
        return np.array(x, copy=True, order="C")

    # ---- the caller's arrays and streams ------------------------------------------------
    def adopt(self, x, info=None, fenced=None):
        """A whole call argument as a host array (device arrays are copied: these devices live
        in host memory).  NumPy arrays are not copied.  (`fenced`: no streams here.)"""
        from shardfuse.interop import to_numpy

        return to_numpy(x)

    def piece(self, x, j):
        """x as local device j's contiguous buffer: x itself when it already is one (no copy)."""
        return np.ascontiguousarray(x)

    def fence_in(self, stream_ptr):
        """Steps run on the host in issue order: nothing to wait for."""

    def fence_out(self, stream_ptr):
        """Every call has finished when it returns: nothing to order."""

    def view(self, bufs, ref, j):
        base = bufs[ref.slot][j]
        strides = tuple(s * base.itemsize for s in ref.strides)
        if not ref.offsets[j] and base.strides == strides and base.shape == tuple(ref.shape):
            return base  # (the whole buffer: as_strided would cost a few microseconds for the same view)
        if is_placeholder(base):  # (its one element, read-only)
            return np.lib.stride_tricks.as_strided(base, ref.shape, (0,) * len(ref.shape), writeable=False)
        return np.lib.stride_tricks.as_strided(base.reshape(-1)[ref.offsets[j]:], ref.shape, strides)

    def _views(self, bufs, ref):
        return [self.view(bufs, ref, j) for j in range(len(self.local_devices))]

    def _on(self, devices):
        """The positions j a compute step runs on (protocol: None is every local device)."""
        return tuple(range(len(self.local_devices))) if devices is None else tuple(devices)

    # ---- compute: each step on its devices only ------------------------------------------
    def bind_matmul(self, a, b, out, stream, devices=None):
        js, view = self._on(devices), self.view

        def step(bufs):
            for j in js:
                np.matmul(view(bufs, a, j), view(bufs, b, j), out=view(bufs, out, j))
        return step

    def bind_elementwise(self, op, a, b, out, stream, scalar=None, devices=None):
        fn, js, view = ELEMENTWISE[op], self._on(devices), self.view

        @_QUIET
        def step(bufs):
            for j in js:
                fn(np, view(bufs, a, j), scalar if b is None else view(bufs, b, j), view(bufs, out, j))
        return step

    def bind_fused(self, expr, ins, out, stream, devices=None):
        js, view = self._on(devices), self.view
        steps = schedule(expr, len(ins))
        temps = {j: [np.empty(out.shape, np_dtype(dt)) for *_, dt in steps[:-1]] for j in js}  # (one call at a time)

        @_QUIET
        def step(bufs):
            for j in js:
                evaluate(np, steps, [view(bufs, r, j) for r in ins] + temps[j] + [view(bufs, out, j)])
        return step

    def bind_sum(self, a, axis, out, stream, scale=1.0, devices=None):
        js, view, total = self._on(devices), self.view, summer(out.dtype, axis, scale)

        def step(bufs):
            for j in js:
                total(view(bufs, a, j), view(bufs, out, j))
        return step

    def bind_fused_sum(self, expr, ins, axis, out, stream, scale=1.0, devices=None):
        """expr evaluated as bind_fused evaluates it, into a buffer of this step's own (made now),
        then summed as bind_sum sums: bit for bit the unfused steps' result."""
        js, view, total = self._on(devices), self.view, summer(out.dtype, axis, scale)
        steps, shape = schedule(expr, len(ins)), np.broadcast_shapes(*(r.shape for r in ins))
        temps = {j: [np.empty(shape, np_dtype(dt)) for *_, dt in steps] for j in js}  # (one call at a time)

        @_QUIET
        def step(bufs):
            for j in js:
                evaluate(np, steps, [view(bufs, r, j) for r in ins] + temps[j])
                total(temps[j][-1], view(bufs, out, j))
        return step

    def bind_fused_rows(self, expr, ins, out, stream, devices=None, more=(), more_outs=()):
        """expr (and each of more) evaluated op by op on whole arrays (elementwise_numpy.row_schedule),
        each reduction as the unfused step reduces, into buffers of this step's own (made now), the
        results copied into out (and more_outs): bit for bit the unfused steps' results."""
        js, view, outs = self._on(devices), self.view, (out, *more_outs)
        steps, roots = row_schedule((expr, *more), [r.shape for r in ins])
        temps = {j: [np.empty(shape, np_dtype(dt)) for *_, dt, shape in steps] for j in js}  # (one call at a time)

        @_QUIET
        def step(bufs):
            for j in js:
                slots = [view(bufs, r, j) for r in ins] + temps[j]
                evaluate_rows(np, steps, slots)
                for r, k in zip(outs, roots):
                    view(bufs, r, j)[...] = slots[k].reshape(r.shape)
        return step

    def bind_take(self, table, ids, rows, out, stream, vocab, devices=None):
        js, view = self._on(devices), self.view

        def step(bufs):
            for j in js:
                take_rows(np, view(bufs, table, j), view(bufs, ids, j), view(bufs, rows, j), vocab, view(bufs, out, j))
        return step

    def bind_scatter_add(self, values, ids, rows, out, stream, vocab, devices=None):
        js, view = self._on(devices), self.view

        def step(bufs):
            for j in js:
                scatter_add_rows(view(bufs, values, j), view(bufs, ids, j), view(bufs, rows, j), vocab,
                                 view(bufs, out, j))
        return step

    def bind_dynamic_slice(self, operand, starts, out, box, stream, devices=None):
        js, view = self._on(devices), self.view

        def step(bufs):
            for j in js:
                x, o = view(bufs, operand, j), view(bufs, out, j)
                o[...] = x[box_slices(box, [view(bufs, s, j) for s in starts], x.shape, o.shape)]
        return step

    def bind_update_slice(self, update, starts, out, box, stream, devices=None):
        js, view = self._on(devices), self.view

        def step(bufs):
            for j in js:
                u, o = view(bufs, update, j), view(bufs, out, j)
                o[box_slices(box, [view(bufs, s, j) for s in starts], o.shape, u.shape)] = u
        return step

    def bind_copy(self, src, dst, stream, devices=None):
        js, view = self._on(devices), self.view

        def step(bufs):
            for j in js:
                view(bufs, dst, j)[...] = view(bufs, src, j)
        return step

    # ---- streams: steps run in issue order, so ordering needs no work --------------------
    def new_event(self, timing=False):
        return None

    def event_ms(self, start, end):
        raise NotImplementedError("the NumPy backends run steps on the host: time them with host clocks")

    def bind_record(self, event, stream):
        return None

    def bind_wait_event(self, event, stream):
        return None

    def bind_join(self, waiter, waitee):
        return None

    def describe(self) -> dict:
        """What reports print about this backend."""
        return {"backend": self.name, "devices": len(self.local_devices), "numpy": np.__version__,
                "processes": self.mesh.nprocs}

    def memory_stats(self) -> dict:
        """Nothing is held beside the plans' buffers (no workspaces or library handles)."""
        return {"workspace_bytes": 0, "handles": 0}

    def stream(self, j=0):
        """Steps run on the host, in issue order: there is no stream."""
        return None

    def synchronize(self):
        pass

    def capture(self, plan):
        raise NotImplementedError("graph mode needs the cupy backend")

    # ---- collectives: (start, wait); in memory, across the local devices of each team ------
    submesh_teams = True  # collectives may run within a sub-mesh: team = (sub-mesh, axis name)

    def _local_teams(self, team):
        mesh, name = team if isinstance(team, tuple) else (self.mesh, team)
        return [[self.local_index[d] for d in t] for t in mesh.teams(name)]

    def bind_allgather(self, send, recv, team, stream):
        teams = self._local_teams(team)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            for t in teams:
                for j in t:
                    for rank, q in enumerate(t):
                        r[j][rank] = s[q]
        return start, None

    def bind_allreduce(self, send, recv, team, stream, op=Reduce.SUM):
        teams = self._local_teams(team)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)
            for t in teams:
                # (reduce, not sum(): sum starts from the int 0, and 0 + -0.0 lost a -0.0's sign, a fuzzer)
                total = functools.reduce(np.add if op == Reduce.SUM else np.maximum if op == Reduce.MAX else np.minimum,
                                         [s[q].astype(accumulator(s[q].dtype)) if op == Reduce.SUM else s[q] for q in t])
                for j in t:
                    r[j][...] = total
        return start, None

    def bind_transfers(self, pairs, stream):
        """Point-to-point copies (src device, send ref, dst device, recv ref), all local here."""
        idx = self.local_index

        def start(bufs):
            for s, sref, d, rref in pairs:
                self.view(bufs, rref, idx[d])[...] = self.view(bufs, sref, idx[s])
        return start, None

    def bind_sendrecv(self, send, recv, team, shift, stream):
        teams = self._local_teams(team)

        def start(bufs):  # rank r sends to r + shift, receives from r - shift
            s, r = self._views(bufs, send), self._views(bufs, recv)
            for t in teams:
                blocks = [s[q].copy() for q in t]
                for rank, j in enumerate(t):
                    r[j][...] = blocks[(rank - shift) % len(t)]
        return start, None

    def bind_alltoall(self, send, recv, team, stream):
        teams = self._local_teams(team)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)  # both [D, ...]: block per peer
            for t in teams:
                for rank, j in enumerate(t):
                    for peer, q in enumerate(t):
                        r[j][peer] = s[q][rank]
        return start, None

    def bind_reduce_scatter(self, send, recv, team, stream):
        teams = self._local_teams(team)

        def start(bufs):
            s, r = self._views(bufs, send), self._views(bufs, recv)  # send: [D, *recv]
            for t in teams:
                total = functools.reduce(np.add, [s[q].astype(accumulator(s[q].dtype)) for q in t])  # (-0.0 kept)
                for rank, j in enumerate(t):
                    r[j][...] = total[rank]
        return start, None
