"""Backends: small classes that run the executor's steps on one kind of device.

Each implements the same protocol (see numpy_local.NumpyLocalBackend, the reference):
buffers (empty / to_device / to_host / view), compute steps (matmul, elementwise, sum, copy),
collectives as start/wait step pairs (allgather, allreduce, reduce_scatter), and stream
ordering (new_event, record, wait_event, join).  Every bind_* method takes Refs and a
stream and returns a step: a callable of the per-call buffer table.  Backends never see the IR.
"""


def make_backend(mesh):
    if mesh.backend_name == "cupy":
        from shardfuse.backends.cupy_nccl import CupyNcclBackend

        return CupyNcclBackend(mesh)
    if mesh.nprocs > 1:
        from shardfuse.backends.numpy_mpi import NumpyMPIBackend

        return NumpyMPIBackend(mesh)
    from shardfuse.backends.numpy_local import NumpyLocalBackend

    return NumpyLocalBackend(mesh)
