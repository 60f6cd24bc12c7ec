"""The backend protocol: what the executor (and graphs, jit, array, bench) may ask of a backend.

A backend runs steps on one kind of device for the devices of this process.  It never sees the
IR: the executor hands it `Ref`s (strided views of numbered buffer slots), streams and teams,
and gets back steps, callables of the per-call buffer table (`bufs[slot][device]`), bound once
and called on every run.  Collectives are bound as a (start, wait) pair of steps.  A bind_*
method may return None for a step it has nothing to do for (NumPy's events; a wait where the
start already completed): the executor leaves it out.

A step runs on the devices of the values it computes (shardfuse/steps.py, devices_of), so a
pipeline stage's steps run on its sub-mesh only.  Compute steps and copies take `devices`: the
positions j (into local_devices, a slot's buffers and Ref.offsets) of the local devices to run
on, None for all; a device left out computes nothing (its buffers of that value are placeholders
that nobody reads).  Communication runs where its team (between meshes, its pairs of devices)
says; it is bound on every process, since setting a team up may itself be collective.  Events
and joins order a GPU's streams, for all its devices.  The executor does not bind a compute step
that has none of this process' devices, and leaves any such step out of this process' list.

Communication (collectives, sends and receives, moves between meshes) reads and writes
contiguous views only: the compiler stages any other view through a scratch buffer, with a
Copy printed in the plan (passes/contiguity.py), so a backend never copies behind the plan.

`numpy_local.NumpyLocalBackend` is the reference implementation; `tests/test_architecture.py`
checks that every backend defines every member below with the same parameters, and that no
module reads a backend attribute that is not listed here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol, Union, runtime_checkable

from shardfuse import strides
from shardfuse.strides import contiguous_strides, reshape_strides  # noqa: F401 (part of the protocol)
from shardfuse.ops import Reduce
from shardfuse.streams import MAIN, Stream  # noqa: F401 (part of the protocol)

# ---- streams, teams, steps -------------------------------------------------------------------
# A step's stream is a streams.Stream: MAIN (the backend's own stream, fenced with the caller's)
# or Stream(k), worker k of 0 .. streams - 1 (`stream.index`); compared by value, hashable.
# A collective runs over a mesh axis of the program's mesh (its name), or, for a value on a
# sub-mesh, (sub-mesh, axis name) on backends whose `submesh_teams` is True.
Team = Union[str, tuple]
Step = Callable[[list], None]  # called with the per-call buffer table; returns nothing

@dataclass(frozen=True)
class Ref:
    """A strided view of a slot's buffer on each local device, in elements."""

    slot: int
    offsets: tuple  # one per local device
    shape: tuple
    strides: tuple
    dtype: str

    @property
    def size(self) -> int:
        n = 1
        for e in self.shape:
            n *= e
        return n

    def is_contiguous(self) -> bool:
        """C-contiguous, ignoring axes of extent 1 (their strides never matter)."""
        return strides.is_contiguous(self.shape, self.strides)

def rank_major(ref: Ref, axis: int, d: int) -> Ref:
    """The view [D, ...] of a gathered / to-be-scattered axis: rank r's block first."""
    shape, st = strides.rank_major(ref.shape, ref.strides, axis, d)
    return replace(ref, shape=shape, strides=st)

def block(ref: Ref, k: int) -> Ref:
    """Block k of a rank-major [D, ...] view."""
    return Ref(ref.slot, tuple(o + k * ref.strides[0] for o in ref.offsets), ref.shape[1:], ref.strides[1:], ref.dtype)


def is_placeholder(x) -> bool:
    """Whether buffer x is one of Backend.empty's placeholders (one element broadcast: no stride), which
    views read as that element and nothing writes."""
    return x.size > 1 and not any(x.strides)


@dataclass(frozen=True)
class BoundPlan:
    """A bound plan as a backend may see it (`capture`): its steps and buffer slots, never the IR."""

    steps: tuple  # the Steps of one call, in issue order
    slots: tuple  # per slot: its persistent buffers (one per local device), or None (an input, or made per call)
    inputs: tuple  # (shape, dtype, devices) of each input's slot, slots 0 .. len(inputs) - 1 (devices: empty's)
    per_call: tuple  # (slot, shape, dtype, devices) of each buffer made at every call (the outputs; devices: Backend.empty's)

# ---- the protocol ----------------------------------------------------------------------------
@runtime_checkable
class Backend(Protocol):
    name: str  # "numpy" or "cupy": what users and reports call it
    local_devices: tuple  # this process' global device ids, in mesh order
    submesh_teams: bool  # whether collectives may run within a sub-mesh (Team as a tuple)
    # the GPU of each local device; None: the devices live in host memory and steps run on the
    # host as they are issued (no streams: a call has no caller's stream to fence with)
    ordinals: tuple | None

    # buffers and host data
    def empty(self, shape, dtype, devices=None):
        """One buffer per local device (poisoned with NaN when SHARDFUSE_POISON=1); with `devices`
        (positions j), a buffer on those only and a placeholder elsewhere: one element broadcast to
        `shape`, no memory, never read (read-only where the array module can say so)."""
    def to_device(self, pieces): """Host pieces (one per local device) as device buffers."""
    def to_host(self, bufs): """Device buffers as host NumPy arrays (a copy, or the buffer itself on NumPy)."""
    def ascontiguous(self, x): """x itself when C-contiguous, else a contiguous copy on its device."""
    def copy(self, x): """A new contiguous buffer on x's device holding x (a donated argument the caller still owns)."""
    def adopt(self, x, info=None, fenced=None): """A caller's array (host or device) as this backend's buffer for one device."""
    def piece(self, x, j): """Piece of a caller's array for local device j (a view where it can be)."""
    def view(self, bufs, ref, j): """The array that `ref` names on local device j, as a strided view of bufs."""

    # ordering with the caller
    def fence_in(self, stream_ptr): """The plan's streams wait (device-side) for the caller's stream."""
    def fence_out(self, stream_ptr): """The caller's stream waits (device-side) for the plan's work."""
    def synchronize(self): """Block the host until every stream of this backend is idle."""
    def stream(self, j=0): """Local device j's main stream (a CuPy Stream; None where steps run on the host)."""

    # compute steps, on local devices `devices` (positions j; None: all of them)
    def bind_matmul(self, a, b, out, stream, devices=None): """Step: out = a @ b (batched over leading axes)."""
    def bind_elementwise(self, op, a, b, out, stream, scalar=None, devices=None): """Step: out = op(a[, b]); op an ops.Op of ops.ELEMENTWISE."""
    def bind_fused(self, expr, ins, out, stream, devices=None): """Step: out = expr(ins), an ops.Expr of elementwise ops: one pass."""
    def bind_sum(self, a, axis, out, stream, scale=1.0, devices=None): """Step: out = a.sum(axis) * scale, 16-bit summed in float32."""
    def bind_fused_sum(self, expr, ins, axis, out, stream, scale=1.0, devices=None): """Step: out = expr(ins).sum(axis) * scale, as bind_sum sums; expr's result (its operands' broadcast shape) never written."""
    def bind_fused_rows(self, expr, ins, out, stream, devices=None, more=(), more_outs=()): """Step: out = expr(ins), an ops.Expr whose reduction nodes reduce the last axis, keeping it (passes/fuse_rows.py), and more_outs[k] = more[k](ins): one pass per row."""
    def bind_copy(self, src, dst, stream, devices=None): """Step: dst[...] = src (any strides)."""
    def bind_take(self, table, ids, rows, out, stream, vocab, devices=None): """Step: out = the table's rows ids (elementwise_numpy.take_rows)."""
    def bind_scatter_add(self, values, ids, rows, out, stream, vocab, devices=None): """Step: out = zeros, then out[ids[t]] += values[t] (elementwise_numpy.scatter_add_rows)."""
    def bind_dynamic_slice(self, operand, starts, out, box, stream, devices=None): """Step: out = operand's box of out's extents at `box` (per axis a start, or None: the next of the 0-d `starts`, read on the device when it runs; elementwise_numpy.box_slices)."""
    def bind_update_slice(self, update, starts, out, box, stream, devices=None): """Step: out's box of update's extents at `box` (as bind_dynamic_slice's) = update; the rest of out untouched."""

    # streams and events
    def new_event(self, timing=False): """A fresh event handle (one per GPU; timing=True: usable by event_ms)."""
    def event_ms(self, start, end): """Per GPU, milliseconds from event start to end (both recorded and completed)."""
    def bind_record(self, event, stream): """Step: record `event` on `stream`."""
    def bind_wait_event(self, event, stream): """Step: `stream` waits (device-side) for `event`."""
    def bind_join(self, waiter, waitee): """Step: stream `waiter` waits (device-side) for all work issued on `waitee`."""

    # communication: (start, wait) step pairs over a team; send / recv contiguous
    def bind_allgather(self, send, recv, team, stream): """recv [D, ...] rank-major gets every rank's send."""
    def bind_allreduce(self, send, recv, team, stream, op=Reduce.SUM): """recv = the sum (op="max" / "min": the max, min; NaN as NumPy's) of every rank's send."""
    def bind_reduce_scatter(self, send, recv, team, stream): """recv = block r of the sum of the rank-major sends [D, ...]."""
    def bind_alltoall(self, send, recv, team, stream): """Block q of rank r's send [D, ...] lands in block r of rank q's recv."""
    def bind_sendrecv(self, send, recv, team, shift, stream): """Rank r sends to r + shift and receives from r - shift."""
    def bind_transfers(self, pairs, stream): """Point-to-point copies (src device, send, dst device, recv) between meshes."""

    # whole plans
    def capture(self, plan): """A replayable graph of a BoundPlan, or raise NotImplementedError."""

    # reports (so no module reads a backend's private state)
    def describe(self) -> dict: """Name, devices, library versions: for reports and bench tables."""
    def memory_stats(self) -> dict: """Bytes held by this backend beside the plans' buffers (workspaces, pools, handles)."""
