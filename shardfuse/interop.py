"""Other libraries' arrays and streams: NumPy, CuPy, PyTorch, JAX, and anything that speaks
DLPack or the CUDA array interface.

Arrays come in through `array_info` (what a call or `sf.shard` checks before any work is
queued: shape, dtype, which GPU, contiguity) and `to_cupy` / `to_numpy` (the backends' views
of them).  Device arrays are never copied through the host: `to_cupy` is a zero-copy view, and
DLPack hands the producer's stream over (CuPy's `from_dlpack` passes its current stream, so the
producer makes that stream wait for its pending writes).

Streams come in through `stream_ptr`: a CuPy stream, a torch stream, an object with the
`__cuda_stream__` protocol, or a raw pointer.  None means CuPy's current stream (the legacy
default stream unless the caller set another), which is also PyTorch's default.
"""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np

from shardfuse.dtypes import DTYPES, TABLE, normalize_dtype, np_dtype
from shardfuse.strides import contiguous_strides

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


class ArrayInfo(NamedTuple):  # (a tuple: made on every call of the hot path, ~5x cheaper than a frozen dataclass)
    shape: tuple
    dtype: str  # canonical name: float16, bfloat16, float32, float64
    device: int | None  # CUDA ordinal, None for host memory
    contiguous: bool
    kind: str  # numpy, cupy, torch, jax, cuda_array_interface, dlpack

    def describe(self) -> str:
        where = "host" if self.device is None else f"GPU {self.device}"
        return f"{self.kind} array {self.dtype}{list(self.shape)} on {where}"


_KINDS: dict = {}  # type -> its top-level module's name (split on every call costs a microsecond)


def _module(x) -> str:
    t = type(x)
    kind = _KINDS.get(t)
    if kind is None:
        kind = _KINDS[t] = t.__module__.split(".")[0]
    return kind


def _is_torch(x) -> bool:
    return _module(x) == "torch"


def _is_jax(x) -> bool:
    return _module(x) in ("jax", "jaxlib")


_TORCH_NAMES: dict = {}  # torch dtype -> its name ("float16"): str(dtype) is ~0.5 us, paid twice per tensor


def _grad_enabled() -> bool:
    import torch
    return torch.is_grad_enabled()


def _torch_dtype(t) -> str:
    name = _TORCH_NAMES.get(t.dtype)
    if name is None:
        name = _TORCH_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    return name


def array_info(x, calling=False) -> ArrayInfo:
    """Shape, dtype, device and contiguity of a call argument, without touching its data.
    Raises ValueError / TypeError naming what was expected for anything shardfuse cannot take
    (calling: an argument of a compiled call, where a torch tensor that requires grad is refused)."""
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray:
            _check_subclass(x)
        return ArrayInfo(x.shape, normalize_dtype(x.dtype), None, x.flags.c_contiguous, "numpy")
    kind = _module(x)
    if kind == "cupy":  # (the memory pointer's device id: .device makes a Device object)
        return ArrayInfo(x.shape, normalize_dtype(x.dtype), x.data.device_id, x.flags.c_contiguous, "cupy")
    if kind == "torch":
        if x.is_cuda:  # (get_device: no torch.device object made)
            dev = x.get_device()
        elif x.device.type == "cpu":
            dev = None
        else:
            raise ValueError(f"a torch tensor on {x.device}: shardfuse takes CPU or CUDA tensors")
        if calling and x.requires_grad and _grad_enabled():  # (a compiled call cuts autograd: torch's .numpy()
            # refuses such a tensor too; placing one (sf.replicate(nn.Parameter)) reads its values, as detach())
            raise TypeError("a torch tensor that requires grad: a compiled function records no autograd graph; wrap "
                            "it with sf.torch_function(fn) for gradients, or pass x.detach() (or call under "
                            "torch.no_grad()) for values only")
        return ArrayInfo(tuple(x.shape), normalize_dtype(_torch_dtype(x)), dev, x.is_contiguous(), "torch")
    if kind in ("jax", "jaxlib"):
        devices = list(x.devices())
        if len(devices) != 1:
            raise ValueError(f"a JAX array on {len(devices)} devices: pass one placed on a single device "
                             "(shardfuse places it on the mesh itself)")
        d = devices[0]
        dev = None if d.platform == "cpu" else int(getattr(d, "local_hardware_id", None) or d.id)
        return ArrayInfo(tuple(x.shape), normalize_dtype(x.dtype.name), dev, True, "jax")
    if hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        shape = tuple(cai["shape"])
        dtype = normalize_dtype(np.dtype(cai["typestr"]))
        strides = cai.get("strides")
        item = np.dtype(cai["typestr"]).itemsize
        contiguous = strides is None or tuple(strides) == tuple(s * item for s in contiguous_strides(shape))
        return ArrayInfo(shape, dtype, _pointer_device(cai["data"][0]), contiguous, "cuda_array_interface")
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        if dev_type in (_DL_CPU, _DL_CUDA_HOST):
            return array_info(np.from_dlpack(x))
        if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            import cupy

            info = array_info(cupy.from_dlpack(x))
            return ArrayInfo(info.shape, info.dtype, int(dev_id), info.contiguous, "dlpack")
        raise ValueError(f"a DLPack array on device type {dev_type}: shardfuse takes host or CUDA memory")
    if isinstance(x, (list, tuple)) and not all(isinstance(e, (list, tuple, int, float, np.generic)) for e in x):
        raise TypeError(f"a {type(x).__name__} of {len(x)} items that are not all numbers: shardfuse takes one array "
                        "per argument, and would stack these into one (pass np.stack(...) if one array is meant)")
    if isinstance(x, (list, tuple, int, float)):
        return array_info(_from_python(x))
    if hasattr(x, "__array__"):
        return array_info(np.asarray(x))
    raise TypeError(f"expected an array (NumPy, CuPy, torch, JAX, DLPack or CUDA array interface), "
                    f"got {type(x).__name__}")


def _check_subclass(x):
    """NumPy subclasses: np.matrix (and memmaps, ...) are taken as the plain ndarray they view
    (to_numpy does so); a masked array is refused, since its mask would be dropped silently."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError("a NumPy masked array: shardfuse takes plain arrays and would drop the mask; pass "
                        "x.filled(value) (or np.asarray(x) to ignore the mask)")


def _from_python(x) -> np.ndarray:
    """A (nested) list, tuple or Python number as np.asarray makes it, checked: rectangular, and of
    a float type (Python floats are float64; lists of ints and bools are refused, not silently
    converted); a Python int or bool alone is int64 or bool (an sf.jit argument: weakly typed)."""
    if type(x) is int and not -2**63 <= x < 2**63:  # (np.asarray would make it uint64 or object)
        raise OverflowError(f"the Python int {x} is out of bounds for int64, the widest integer dtype shardfuse has "
                            "(NumPy 2 raises OverflowError too)")
    try:
        a = np.asarray(x)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"a {type(x).__name__} that is not a rectangular array of numbers: {e}") from None
    if a.dtype.kind != "f" and not (type(x) in (int, bool) and a.dtype.kind in "bi"):
        raise TypeError(f"a {type(x).__name__} of {a.dtype} values (np.asarray gives {a.dtype}{list(a.shape)}): "
                        f"expected floats, of a dtype in {DTYPES}; pass e.g. np.asarray(x, dtype=np.float32)")
    return a


def _native(x: np.ndarray) -> np.ndarray:
    """x as a plain ndarray in this machine's byte order (big-endian input, '>f8', is converted:
    the backends compute on it and MPI sends it in native order)."""
    if type(x) is not np.ndarray:
        _check_subclass(x)
        x = np.asarray(x)  # np.matrix and other subclasses: the ndarray they view, no copy
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return x


def _pointer_device(ptr: int) -> int:
    import cupy

    return cupy.cuda.runtime.pointerGetAttributes(ptr).device


def check_input(info: ArrayInfo, backend, what: str):
    """What a device array must be for the backend to take it as it is (zero copy, no silent
    cross-GPU copies): C-contiguous, and on a GPU of this process' devices.  Copying it behind the
    caller's back would hide a cost the caller can avoid."""
    if info.device is None:
        return
    if not info.contiguous:
        fix = {"torch": "x.contiguous()", "cupy": "cupy.ascontiguousarray(x)"}.get(info.kind, "a contiguous copy")
        raise ValueError(f"{what}: a non-contiguous {info.describe()}; shardfuse takes device arrays as they "
                         f"are (C-contiguous, zero copy): pass {fix}")
    ordinals = backend.ordinals
    if ordinals is not None and info.device not in ordinals:
        raise ValueError(f"{what}: a {info.describe()}, but this process' devices are on GPUs "
                         f"{sorted(set(ordinals))}")


def to_cupy(x):
    """A zero-copy CuPy view of a device array (bfloat16 as its uint16 bit pattern, since CuPy
    has no bfloat16).  DLPack makes CuPy's current stream wait for the producer's."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if _is_torch(x):
        return torch_view(x)
    if _is_jax(x):
        if x.dtype.name == "bfloat16":
            # CuPy cannot import a bfloat16 DLPack tensor; the bitcast is a device-side copy in JAX
            import jax

            x = jax.lax.bitcast_convert_type(x, np.uint16)
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    return cupy.from_dlpack(x)


_READY: dict = {}  # GPU ordinal -> a reusable cupy Event (a wait takes the event's state when queued)


def _torch_stream_ptr(dev: int) -> int:
    """torch's current stream on GPU dev, as a raw pointer (torch's private accessor costs well
    under a microsecond, torch.cuda.current_stream about ten)."""
    return _torch_stream_getter()(dev)


@functools.cache
def _torch_stream_getter():
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else lambda dev: torch.cuda.current_stream(dev).cuda_stream


def torch_view(t, consumer: int | None = None, fenced: int | None = None):
    """A CuPy view of a CUDA tensor's memory, built from its pointer, shape and strides (a few
    microseconds, against tens for a DLPack round trip), holding the tensor alive.  As DLPack
    would, it makes the consumer stream (a raw pointer; default CuPy's current stream) wait,
    device-side, for torch's current stream, where torch code has queued the tensor's writes;
    not when torch's current stream is `fenced` (a call's caller stream, which the call's main
    streams already wait for)."""
    cupy = _cupy()
    shape, store = tuple(t.shape), TABLE[_torch_dtype(t)].bits
    if 0 in shape:
        return cupy.empty(shape, store)
    dev, item = t.get_device(), t.element_size()
    if t.is_contiguous():  # the common case: no strides to convert, the span is the size
        span, strides = t.numel() * item, None
    else:
        span = (sum((n - 1) * s for n, s in zip(shape, t.stride())) + 1) * item
        strides = tuple(s * item for s in t.stride())
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), span, t, dev)
    view = cupy.ndarray(shape, store, cupy.cuda.MemoryPointer(mem, 0), strides=strides)
    producer = _torch_stream_ptr(dev)
    if consumer is None:
        consumer = cupy.cuda.get_current_stream().ptr
    if producer != consumer and producer != fenced:
        ev = _READY.get(dev)
        if ev is None:
            with cupy.cuda.Device(dev):
                ev = _READY[dev] = cupy.cuda.Event(disable_timing=True)
        cupy.cuda.runtime.eventRecord(ev.ptr, producer)
        cupy.cuda.runtime.streamWaitEvent(consumer, ev.ptr, 0)
    return view


def host_view(x, info: ArrayInfo | None):
    """x as NumPy where it is a host array of another library (a CPU torch tensor: its memory), for the
    ranks' comparison of host arguments (fault_messages.fingerprint reads NumPy only); else x."""
    return to_numpy(x) if info is not None and info.device is None and not isinstance(x, np.ndarray) else x


def to_numpy(x) -> np.ndarray:
    """A host NumPy array of x (a copy for device arrays; bfloat16 as ml_dtypes.bfloat16), a plain
    ndarray in native byte order (host arrays that already are one are not copied)."""
    if isinstance(x, np.ndarray):
        return x if type(x) is np.ndarray and x.dtype.isnative else _native(x)
    if isinstance(x, (list, tuple, int, float)):
        return _from_python(x)
    kind = _module(x)
    if kind == "cupy":
        import cupy

        return cupy.asnumpy(x)
    if kind == "torch":
        t = x.detach()
        if _torch_dtype(t) == "bfloat16":
            import torch

            return t.view(torch.int16).cpu().numpy().view(np_dtype("bfloat16"))
        return t.cpu().numpy()
    if hasattr(x, "__cuda_array_interface__") or (hasattr(x, "__dlpack_device__")
                                                   and x.__dlpack_device__()[0] in (_DL_CUDA, _DL_CUDA_MANAGED)):
        import cupy

        return cupy.asnumpy(to_cupy(x))
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array__"):
        return _native(np.from_dlpack(x))
    return _native(np.asarray(x))


@functools.cache
def _cupy():
    """CuPy, imported once (an import statement costs on every call of the hot path)."""
    import cupy

    return cupy


def stream_identity(ptr: int):
    """What a raw stream pointer names: itself, but the legacy default stream (0, DLPack's 1) is one
    per GPU and the per-thread default stream (2) one per GPU and thread: named with those."""
    if ptr in (0, 1):
        return 0, _cupy().cuda.runtime.getDevice()
    if ptr == 2:
        return 2, _cupy().cuda.runtime.getDevice(), threading.get_ident()
    return ptr


class Fence(NamedTuple):
    """Where a call left its outputs ordered: the caller's stream (its stream_identity) waits for
    them.  For outputs the plan's next call overwrites (graph mode), also the plan's executable
    and its count of calls then: the ordering holds only until its next call."""
    stream: object
    calls: int
    exe: object = None

    def covers(self, consumer: int) -> bool:
        """Whether a read on stream `consumer` (a pointer) is already ordered after the outputs."""
        return self.stream == stream_identity(consumer) and (self.exe is None or self.exe.calls == self.calls)


def stream_ptr(stream=None) -> int:
    """The raw CUDA stream pointer of a CuPy stream, a torch stream, a `__cuda_stream__` object or
    an int; None: CuPy's current stream."""
    if stream is None:
        return _cupy().cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        got = proto() if callable(proto) else proto
        return int(got[1] if isinstance(got, tuple) else got)
    for attr in ("ptr", "cuda_stream"):  # CuPy, torch
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"stream= expects a CuPy stream, a torch stream, an object with __cuda_stream__ or a "
                    f"pointer, got {type(stream).__name__}")
