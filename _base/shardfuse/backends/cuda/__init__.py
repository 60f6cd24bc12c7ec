"""The CUDA parts of the cupy backend, one concern each, assembled by cupy_nccl.CupyNcclBackend:
libs (ctypes bindings, enums), devices (the one shared state), gemm, copies, kernels,
collectives and graphs.  None of them imports the backend class."""
