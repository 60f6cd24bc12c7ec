"""shardfuse: sharding annotations compiled into stream-scheduled host programs.

    import shardfuse as sf
    mesh = sf.DeviceMesh(4)
    @sf.jit(mesh=mesh, streams=4)
    def ag_matmul(a, b):
        a = sf.shard(a, axis=1, over="DIDx")
        return sf.stream(a @ b, axis=0)
    print(ag_matmul.lower(sf.TensorSpec((8, 4, 16, 32)), sf.TensorSpec((32, 24))))
"""
from importlib.metadata import PackageNotFoundError, version as _version

from shardfuse.api import distribute, replicate, shard
from shardfuse.array import Array
from shardfuse.spmd import from_local, make_array_from_single_device_arrays
from shardfuse.faults import CollectiveTimeoutError, RankLeftError, RankMismatchError
from shardfuse.jit import Plan, jit
from shardfuse.layout import Layout
from shardfuse.mesh import DeviceMesh
from shardfuse.placements import Partial, PartitionSpec, Replicate, Shard, StridedShard

P = PartitionSpec  # (JAX's short name)
from shardfuse.spec import TensorSpec
from shardfuse.take import scatter_add, take
from shardfuse.update_slice import dynamic_slice, dynamic_update_slice
from shardfuse.visualize import visualize_sharding
from shardfuse import lax, nn, optim, random, transformer, tree
from shardfuse.autodiff import stop_gradient

nn.transformer_layer = transformer.transformer_layer  # (sf.nn's block; in its own module: it is built from sf.nn)
from shardfuse.trace import stream, to_mesh
from shardfuse.traced import ConcretizationError
from shardfuse.transforms import eval_shape, grad, value_and_grad, vjp
from shardfuse.vmap import vmap
from shardfuse.custom_vjp import custom_vjp
from shardfuse.checkpoint import checkpoint
from shardfuse.torch_bridge import torch_function
from shardfuse.shape_ops import concatenate, split, stack
from shardfuse.traced_numpy import (exp, linear, log, logical_not, maximum, minimum, relu, rsqrt, sigmoid, silu,
                                    sqrt, tanh, where)
from shardfuse.numpy_math import cos, erf, expm1, gelu, log1p, sin, top_k  # (and np.sign, np.sort, ...: NUMPY)
from shardfuse.logical import logical_and, logical_or, logical_xor  # (and np.bitwise_*, np.any / all: NUMPY)
from shardfuse import numpy_shapes  # noqa: F401 (np.ravel, np.squeeze, np.expand_dims, np.ones_like, ...: NUMPY)
from shardfuse import numpy_einsum  # noqa: F401 (np.einsum, np.tensordot: NUMPY)
from shardfuse import numpy_broadcast  # noqa: F401 (np.broadcast_to, np.repeat, np.tile, np.outer, np.power, ...: NUMPY)
from shardfuse import numpy_compose  # noqa: F401 (np.prod, np.cumprod, np.pad, np.diff, np.fmax, ...: NUMPY)
from shardfuse import numpy_stats  # noqa: F401 (np.nanmean, np.average, np.trace, ...: NUMPY)
from shardfuse import numpy_quantiles  # noqa: F401 (np.median, np.quantile, np.nanmedian, ...: NUMPY)
from shardfuse import numpy_search  # noqa: F401 (np.searchsorted, np.digitize, np.isin, np.interp: NUMPY)
from shardfuse import numpy_joins  # noqa: F401 (np.hstack, np.vstack, np.atleast_2d, np.unstack, ...: NUMPY)

__all__ = ["Array", "DeviceMesh", "Layout", "P", "PartitionSpec", "Partial", "Replicate", "Shard", "StridedShard", "Plan", "TensorSpec", "from_local", "make_array_from_single_device_arrays", "jit", "eval_shape", "replicate", "shard", "stream", "to_mesh",
           "exp", "gelu", "linear", "relu", "tanh", "sqrt", "rsqrt", "log", "sigmoid", "silu", "maximum", "minimum",
           "where", "logical_not", "logical_and", "logical_or", "logical_xor", take.__name__, scatter_add.__name__, dynamic_update_slice.__name__, dynamic_slice.__name__, "concatenate", "split", "stack", *(f.__name__ for f in (sin, cos, log1p, expm1, erf, top_k)), "lax", "nn", "optim", "random", "tree", "stop_gradient", "grad", "value_and_grad",
           "vjp", "vmap", "custom_vjp", "checkpoint", "torch_function", "visualize_sharding", "distribute",
           "CollectiveTimeoutError", "ConcretizationError", "RankLeftError", "RankMismatchError"]

try:
    __version__ = _version("shardfuse")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
