"""The dispatch of the virtual devices' GEMMs (backends/cuda/gemm_shared.py), on any machine: when
the operands of a GPU's devices are evenly spaced one batched call runs, bound once per spacing;
otherwise, or where cuBLASLt refuses the batch, each device's own call.  The buffers here are
plain objects with a data pointer and the "calls" record what they were given: the real calls
run in tests/test_gpu.py (the seed at D = 2, 4, 8 on one GPU, against float64 NumPy)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.gpu  # part of the GPU run (benchmarks/gpu_first.sh); runs anywhere

from shardfuse.backends.cuda.gemm_shared import nested_batch_step, one_gpu_step, spacing


def buf(ptr):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


def test_spacing():
    assert spacing([100, 164, 228, 292]) == 64
    assert spacing([7, 7, 7]) == 0  # one shared buffer (a replicated operand)
    assert spacing([100, 164, 230]) is None
    assert spacing([300, 200, 100]) is None  # descending: left to the per-device calls


class Recorder:
    """each_device, bind_batched and matmul of one step, recording what they were given."""

    def __init__(self, status=0):
        self.each, self.binds, self.batched, self.status = 0, [], [], status

    def each_device(self, bufs):
        self.each += 1

    def bind_batched(self, strides):
        self.binds.append(strides)
        pa, pb, pc = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        return (pa, pb, pc), pa, pb, pc, None

    def matmul(self, pa, pb, pc):
        self.batched.append((pa.value, pb.value, pc.value))
        return self.status  # cuBLAS' status: 0 is success


def make(rec, offsets=((0, 0, 0),) * 4, item=2, c_bytes=64):
    return one_gpu_step(rec.each_device, rec.bind_batched, rec.matmul, (0, 1, 2), list(offsets), item, c_bytes,
                        "test GEMM")


def bufs(a, b, c):
    return [[buf(p) for p in a], [buf(p) for p in b], [buf(p) for p in c]]


def test_evenly_spaced_operands_take_one_batched_call_bound_once():
    rec = Recorder()
    step = make(rec)
    for base in (1000, 5000):  # new pointers, same distances: no new binding
        step(bufs([base + 128 * j for j in range(4)], [64] * 4, [90000 + 256 * j for j in range(4)]))
    assert rec.binds == [(64, 0, 128)]  # element strides (2-byte items)
    assert rec.batched == [(1000, 64, 90000), (5000, 64, 90000)] and rec.each == 0


def test_per_device_offsets_are_part_of_the_pointers():
    rec = Recorder()
    step = make(rec, offsets=[(32 * j, 0, 0) for j in range(4)])
    step(bufs([1000] * 4, [64] * 4, [90000 + 256 * j for j in range(4)]))  # one buffer, a slice per device
    assert rec.binds == [(16, 0, 128)] and rec.batched == [(1000, 64, 90000)]


@pytest.mark.parametrize("a, c", [
    ([1000, 1128, 1300, 1400], [90000 + 256 * j for j in range(4)]),  # A not evenly spaced
    ([1000 + 128 * j for j in range(4)], [90000] * 4),  # outputs would overlap
    ([1000 + 128 * j for j in range(4)], [90000 + 32 * j for j in range(4)]),  # closer than one output
    ([1000 + 3 * j for j in range(4)], [90000 + 256 * j for j in range(4)]),  # not whole elements apart
])
def test_operands_that_cannot_batch_take_the_per_device_calls(a, c):
    rec = Recorder()
    make(rec)(bufs(a, [64] * 4, c))
    assert rec.each == 1 and rec.binds == [] and rec.batched == []


def test_a_batch_cublaslt_refuses_at_its_first_call_is_not_tried_again():
    rec = Recorder(status=15)  # CUBLAS_STATUS_NOT_SUPPORTED
    step = make(rec)
    for _ in range(3):
        step(bufs([1000 + 128 * j for j in range(4)], [64] * 4, [90000 + 256 * j for j in range(4)]))
    assert rec.binds == [(64, 0, 128)] and len(rec.batched) == 1 and rec.each == 3


def test_an_error_at_the_first_batched_call_raises_rather_than_falling_back():
    rec = Recorder(status=13)  # CUBLAS_STATUS_EXECUTION_FAILED: not a refusal of the batch
    with pytest.raises(RuntimeError, match="cuBLAS status 13"):
        make(rec)(bufs([1000 + 128 * j for j in range(4)], [64] * 4, [90000 + 256 * j for j in range(4)]))


def test_outputs_exactly_one_matrix_apart_batch():
    rec = Recorder()
    make(rec, c_bytes=256)(bufs([1000 + 128 * j for j in range(4)], [64] * 4, [90000 + 256 * j for j in range(4)]))
    assert rec.binds == [(64, 0, 128)] and rec.each == 0


def test_a_batch_that_fails_after_it_ran_raises():
    rec = Recorder()
    step = make(rec)
    spaced = bufs([1000 + 128 * j for j in range(4)], [64] * 4, [90000 + 256 * j for j in range(4)])
    step(spaced)
    rec.status = 13  # CUBLAS_STATUS_EXECUTION_FAILED
    with pytest.raises(RuntimeError, match="test GEMM, batched over 4 devices failed with cuBLAS status 13"):
        step(spaced)


def test_distances_that_keep_changing_stop_binding_after_a_few():
    rec = Recorder()
    step = make(rec)
    for n in range(12):  # two devices: any two pointers are evenly spaced, here each call anew
        step([[buf(1000), buf(5000 + 64 * n)], [buf(64)] * 2, [buf(90000), buf(90256)]])
    assert len(rec.binds) == 8 and len(rec.batched) == 8 and rec.each == 4
    step([[buf(1000), buf(5000)], [buf(64)] * 2, [buf(90000), buf(90256)]])  # a spacing bound before
    assert len(rec.batched) == 9 and rec.each == 4


def test_pointers_less_aligned_than_the_algorithm_needs_take_the_per_device_calls():
    """A caller's array may start anywhere: a batch whose first pointers, or whose spacing, are not
    multiples of the algorithm's alignment is not issued (each_device handles such pointers)."""
    rec = Recorder()
    step = one_gpu_step(rec.each_device, rec.bind_batched, rec.matmul, (0, 1, 2), [(0, 0, 0)] * 4, 2, 64,
                        "test GEMM", align=256)
    step(bufs([1024 + 256 * j for j in range(4)], [512] * 4, [8192 + 256 * j for j in range(4)]))
    assert (rec.each, len(rec.batched)) == (0, 1)  # aligned: the batch
    step(bufs([1026 + 256 * j for j in range(4)], [512] * 4, [8192 + 256 * j for j in range(4)]))
    assert (rec.each, len(rec.batched)) == (1, 1)  # A starts 2 bytes off
    step(bufs([1024 + 384 * j for j in range(4)], [512] * 4, [8192 + 256 * j for j in range(4)]))
    assert (rec.each, len(rec.batched), len(rec.binds)) == (2, 1, 1)  # A's devices 384 bytes apart: not bound


# ---- a strided batch on each device (the natural layout: a chunk of rows sharded and streamed) ----
class NestedRecorder:
    def __init__(self, status=0):
        self.each, self.batched, self.status = 0, [], status

    def each_device(self, bufs):
        self.each += 1

    def batched_call(self, a, b, c, total):
        self.batched.append((a, b, c, total))
        return self.status


def nested(rec, strides=(128, 0, 256), count=8, offsets=((0, 0, 0),) * 4):
    return nested_batch_step(rec.each_device, rec.batched_call, (0, 1, 2), list(offsets), strides, count,
                             "test batch")


def test_devices_one_whole_batch_apart_are_one_batch_of_all_their_gemms():
    rec = NestedRecorder()
    step = nested(rec)  # 8 GEMMs a device; A 128 bytes a batch, a shared B, C 256 bytes a batch
    step(bufs([1000 + 8 * 128 * j for j in range(4)], [64] * 4, [90000 + 8 * 256 * j for j in range(4)]))
    assert rec.batched == [(1000, 64, 90000, 32)] and rec.each == 0


def test_per_device_offsets_take_part_in_the_nested_spacing():
    rec = NestedRecorder()  # one output buffer per device, each device's chunk at its own offset
    step = nested(rec, offsets=[(0, 0, 16 * j) for j in range(4)])
    step(bufs([1000 + 1024 * j for j in range(4)], [64] * 4, [90000 + 2048 * j - 16 * j for j in range(4)]))
    assert rec.batched == [(1000, 64, 90000, 32)]


@pytest.mark.parametrize("a, b, c", [
    ([1000 + 1000 * j for j in range(4)], [64] * 4, [90000 + 2048 * j for j in range(4)]),  # A not one batch apart
    ([1000 + 1024 * j for j in range(4)], [64 + 640 * j for j in range(4)], [90000 + 2048 * j for j in range(4)]),
    # B shared inside a device's batch but one copy per device: no single stride reads it
    ([1000 + 1024 * j for j in range(4)], [64] * 4, [90000] * 4),  # outputs would overlap
    ([1000, 2024, 5000, 4048], [64] * 4, [90000 + 2048 * j for j in range(4)]),  # not evenly spaced
])
def test_devices_not_one_batch_apart_take_their_own_batches(a, b, c):
    rec = NestedRecorder()
    nested(rec)(bufs(a, b, c))
    assert rec.each == 1 and rec.batched == []


def test_a_zero_output_stride_is_never_one_batch():
    rec = NestedRecorder()
    step = nested(rec, strides=(128, 0, 0))
    step(bufs([1000 + 1024 * j for j in range(4)], [64] * 4, [90000] * 4))
    assert rec.each == 1 and rec.batched == []


def test_an_error_of_the_nested_batch_raises():
    rec = NestedRecorder(status=13)
    with pytest.raises(RuntimeError, match="test batch, batched over 4 devices failed with cuBLAS status 13"):
        nested(rec)(bufs([1000 + 1024 * j for j in range(4)], [64] * 4, [90000 + 2048 * j for j in range(4)]))
