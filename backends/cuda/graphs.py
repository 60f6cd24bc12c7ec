"""Graph mode (`sf.jit(..., graph=True)`): a bound plan captured as CUDA graphs and replayed.
Graphs read the caller's own input buffers (no copy-in) and write the plan's own outputs: the
next call overwrites them."""
from __future__ import annotations

import contextlib
import gc

from collections import OrderedDict

import cupy
from cupy.cuda import runtime

from shardfuse.backends.protocol import is_placeholder


class GraphPlan:
    """A plan captured as CUDA graphs, one per GPU of this process, and replayed.

    No copy-in: a graph reads the call's own input buffers, so graphs are cached per tuple of
    input pointers (every input on every local device).  The first call with a new tuple
    captures one (host work of about a plan's eager issue, nothing runs twice); at most
    MAX_GRAPHS are kept, the least recently used dropped.  Outputs, per-call buffers and
    scratch are the plan's own and shared by every graph: the next call overwrites them.
    The eager warm-up (kernel compilation, cuBLAS and NCCL set-up) runs once per plan, on the
    plan's own input buffers (`inputs`) filled with random finite values.  Nothing is
    allocated during replay.
    """

    MAX_GRAPHS = 8  # graphs kept per plan: one per set of input buffers a caller alternates between

    def __init__(self, dev, plan):
        """plan: the bound plan's protocol.BoundPlan (its steps and slots)."""
        self.dev = dev
        self.steps, self.n_inputs = plan.steps, len(plan.inputs)
        self.static = list(plan.slots)
        self.inputs = []  # the plan's own input buffers: the warm-up's, and usable as inputs too
        for k, (shape, dtype, devices) in enumerate(plan.inputs):
            self.static[k] = dev.empty(shape, dtype, devices)
            self.inputs.append(self.static[k])
        for slot, shape, dtype, devices in plan.per_call:
            self.static[slot] = dev.empty(shape, dtype, devices)
        for bufs in self.inputs:
            for x in bufs:
                if not is_placeholder(x):  # (a device outside the input's stage holds one)
                    dev.fill_random(x)
        for step in self.steps:
            step(self.static)
        dev.synchronize()
        self._mains = [(o, dev.main_of[o]) for o in dev.gpus]
        self.graphs = OrderedDict()  # input pointers -> (one graph per GPU, memory they hold)
        self.captures = 0

    def __call__(self, bufs):
        key = []
        for b in bufs[:self.n_inputs]:  # (pieces.SplitViews give their addresses without making views)
            pointers = getattr(b, "pointers", None)
            key += pointers() if pointers is not None else [x.data.ptr for x in b]
        key = tuple(key)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(bufs, key)
        else:
            self.graphs.move_to_end(key)
        for g, (_, m) in zip(entry[0], self._mains):
            g.launch(m)
        return self.static

    def _capture(self, bufs, key):
        dev = self.dev
        if len(self.graphs) >= self.MAX_GRAPHS:
            # the dropped graph may still be running: its held memory goes back to the pool only
            # after it has finished
            dev.synchronize()
            self.graphs.popitem(last=False)
        table = list(self.static)
        table[:self.n_inputs] = bufs[:self.n_inputs]
        # Anything CuPy allocates while capturing comes from blocks this graph keeps for its
        # lifetime: the replayed graph keeps using them, so the pool must never hand them out.
        held = []
        pool = cupy.get_default_memory_pool()

        def keep(size):
            mem = pool.malloc(size)
            held.append(mem)
            return mem

        # thread-local capture: each GPU's main stream records its own graph, all in this thread
        mode = runtime.streamCaptureModeThreadLocal
        started = []
        with cupy.cuda.using_allocator(keep), _without_cub(), _without_collection():
            try:
                for o, m in self._mains:
                    with cupy.cuda.Device(o):
                        m.begin_capture(mode)
                    started.append((o, m))
                for step in self.steps:
                    step(table)
            except BaseException:
                for o, m in started:
                    try:
                        with cupy.cuda.Device(o):
                            m.end_capture()
                    except Exception:
                        pass  # the capture is already invalid; the step's error is the one to see
                raise
            graphs = []
            for o, m in self._mains:
                with cupy.cuda.Device(o):
                    graphs.append(m.end_capture())
        for g, (o, m) in zip(graphs, self._mains):
            with cupy.cuda.Device(o):
                g.upload(m)
        self.captures += 1
        entry = self.graphs[key] = (graphs, held)
        return entry


@contextlib.contextmanager
def _without_collection():
    """No Python garbage collection while capturing: a collected object's finalizer may call CUDA
    (an earlier plan's graph destroyed: cudaGraphExecDestroy), which invalidates the capture (seen on
    an H100 and an H200, 2026-12-05: test_graph_equals_eager failing at random parameters).  What
    is garbage already goes first, as torch.cuda.graph does."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _without_cub():
    """CuPy's CUB reductions (cupy.sum of a contiguous input) allocate their temporary storage
    with cudaMalloc-backed calls a capture refuses (cudaErrorStreamCaptureUnsupported, the
    tensor-parallel stage's Sum on an H100, 2026-12-05): while capturing, CuPy's own reduction
    kernels run instead, which write into the given out= buffer."""
    from cupy._core import _accelerator

    saved = (list(_accelerator.get_reduction_accelerators()), list(_accelerator.get_routine_accelerators()))
    _accelerator.set_reduction_accelerators([])
    _accelerator.set_routine_accelerators([])
    try:
        yield
    finally:
        _accelerator.set_reduction_accelerators(saved[0])
        _accelerator.set_routine_accelerators(saved[1])

