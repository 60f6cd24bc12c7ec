"""libs.Prebound, the virtual devices' gather launch with its arguments set in place, on any
machine: what cuLaunchKernel would be given (read back through the argument array's pointers,
as the driver reads them), with a recording stand-in for the launch.  The real launch runs in
tests/test_gpu.py (every all-gather of D = 2, 4, 8 virtual devices on one GPU, against NumPy)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from shardfuse.backends.cuda.libs import Prebound

pytestmark = pytest.mark.gpu  # part of the GPU run (benchmarks/gpu_first.sh); runs anywhere


def test_each_launch_passes_that_calls_values_through_the_one_argument_array():
    seen = []

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        args = (ctypes.c_void_p * 5).from_address(params)  # void** kernelParams, as the driver reads it
        seen.append((fn, (gx, gy, gz), (bx, by, bz), shared, stream, extra,
                     [ctypes.c_uint64.from_address(p).value for p in args]))

    function = SimpleNamespace(ptr=0xF00)
    k = Prebound(function, 5, launch)
    k(12, 256, [1 << 40, 2, 3, 4, 2**64 - 1], 77)
    k(1, 128, [5, 6, 7, 8, 9], 78)  # new values, the same arrays
    assert seen == [(0xF00, (12, 1, 1), (256, 1, 1), 0, 77, 0, [1 << 40, 2, 3, 4, 2**64 - 1]),
                    (0xF00, (1, 1, 1), (128, 1, 1), 0, 78, 0, [5, 6, 7, 8, 9])]
    assert k.function is function  # kept alive with the launch (it holds the loaded module)
