"""The op vocabulary: every instruction of the IR names one `Op`, and every table that does
something per op (the printer and rule table in the compiler, the executor's binders, the
backends' elementwise kernels) is keyed by it.  At the bottom floor, beside dtypes and
layouts, so that backends can name ops without importing the IR.

A StrEnum: `Op.MATMUL == "matmul"` and it prints as `matmul`, so plans and error messages read
as before; but no module other than this one spells an op as a string.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import StrEnum


class Reduce(StrEnum):
    """How pending values combine (DTensor's Partial(reduce_op)): the operator of an Allreduce
    (ncclSum / ncclMax / ncclMin, MPI.SUM / MAX / MIN)."""
    SUM = "sum"
    MAX = "max"
    MIN = "min"


class Op(StrEnum):
    # array level: what tracing records, the passes rewrite
    SET = "set"  # a (re)sharding or a stream annotation: the value with another layout
    RESHAPE = "reshape"
    MATMUL = "matmul"
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    NEG = "neg"
    SCALE = "scale"  # x * a Python scalar
    DIV_SCALAR = "div_scalar"  # x / a Python scalar (not x * (1 / c): 1 / c may not fit x's dtype)
    ADD_SCALAR = "add_scalar"  # x + a Python scalar (not linear: a pending sum must be made whole first)
    RDIV = "rdiv"  # a Python scalar / x
    EXP = "exp"
    TANH = "tanh"
    RELU = "relu"
    GELU = "gelu"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    LOG = "log"
    SIGMOID = "sigmoid"
    SILU = "silu"  # x * sigmoid(x)
    POW = "pow"  # x ** a Python scalar
    RPOW = "rpow"  # a Python scalar ** x
    POWER = "power"  # x ** y of two float arrays (np.power; NumPy's NaN for a negative x and a non-integral y)
    ARCTAN2 = "arctan2"  # np.arctan2(y, x), NumPy's quadrants and signed zeros
    HYPOT = "hypot"  # sqrt(x**2 + y**2) without overflow (np.hypot)
    COPYSIGN = "copysign"  # |x| with y's sign bit (np.copysign; -0.0 and -NaN count as negative)
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    MAXIMUM_SCALAR = "maximum_scalar"
    MINIMUM_SCALAR = "minimum_scalar"
    FLOOR_DIVIDE = "floor_divide"  # x // y, NumPy's (floor of the quotient; integers stay integers)
    MOD = "mod"  # x % y, NumPy's remainder (the sign of y)
    # NumPy's unary math (shardfuse/numpy_math.py): results in the input's dtype, or boolean (ISNAN ...)
    SIN = "sin"
    COS = "cos"
    LOG1P = "log1p"
    EXPM1 = "expm1"
    ERF = "erf"  # jax.lax.erf, scipy.special.erf
    TAN = "tan"
    ARCSIN = "arcsin"
    ARCCOS = "arccos"
    ARCTAN = "arctan"
    SINH = "sinh"
    COSH = "cosh"
    ARCSINH = "arcsinh"
    ARCCOSH = "arccosh"
    ARCTANH = "arctanh"
    LOG2 = "log2"
    LOG10 = "log10"
    EXP2 = "exp2"
    CBRT = "cbrt"
    GELU_ERF = "gelu_erf"  # the exact GELU, x * Phi(x) = 0.5 x erfc(-x / sqrt 2) (GELU: the tanh form)
    SIGN = "sign"  # NumPy's: -1, 0 or 1 (0 for -0.0), NaN for NaN
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"  # to the nearest integer, halves to even (np.round with decimals=0, np.rint)
    TRUNC = "trunc"  # toward zero (np.trunc; -0.0 for -0.5, as NumPy's)
    ISNAN = "isnan"
    ISINF = "isinf"
    ISFINITE = "isfinite"
    # comparisons: boolean results (x op y, or x op a Python scalar)
    LT = "less"
    LE = "less_equal"
    GT = "greater"
    GE = "greater_equal"
    EQ = "equal"
    NE = "not_equal"
    LT_SCALAR = "less_scalar"
    LE_SCALAR = "less_equal_scalar"
    GT_SCALAR = "greater_scalar"
    GE_SCALAR = "greater_equal_scalar"
    EQ_SCALAR = "equal_scalar"
    NE_SCALAR = "not_equal_scalar"
    LOGICAL_NOT = "logical_not"
    # NumPy's bitwise ufuncs, of booleans (logical and / or / xor: masks) and integers alike; the
    # operands are of one dtype (tracing casts; a Python scalar is a full_like first)
    BITWISE_AND = "bitwise_and"
    BITWISE_OR = "bitwise_or"
    BITWISE_XOR = "bitwise_xor"
    INVERT = "invert"  # ~x of integers (of booleans: LOGICAL_NOT)
    # where(c, x, y) is the sum of two halves, each exact with the other's zero (-0.0 for floats:
    # x + -0.0 is x for every x, -0.0 and NaN included); the backend protocol passes two operands
    WHERE_THEN = "where_then"  # where(c, x, 0)
    WHERE_ELSE = "where_else"  # where(c, 0, x)
    FILL_THEN = "fill_then"  # where(c, a Python scalar, 0), in the output's dtype
    FILL_ELSE = "fill_else"  # where(c, 0, a Python scalar)
    ASTYPE = "astype"  # a cast to the output's dtype
    FULL_LIKE = "full_like"  # a Python scalar in every element, of the input's shape (autodiff's ones and zeros)
    # an Allreduce with max / min moves floats as order-preserving integer keys (NaN kept as NumPy
    # keeps it: backends/extrema.py); the scalar `value` is "max" or "min"
    ORDER_KEYS = "order_keys"
    FROM_ORDER_KEYS = "from_order_keys"
    # reductions of the last axis (tracing transposes the reduced axis there): bound and costed as
    # elementwise steps (one pass over the input, no attribute that a stream split renumbers)
    REDUCE_MAX = "reduce_max"
    REDUCE_MIN = "reduce_min"
    SUM = "sum"
    # the running sum of the last axis (np.cumsum: tracing transposes the summed axis there), which
    # must be whole; 16-bit floats summed in float32: bound and costed as an elementwise step
    CUMSUM = "cumsum"
    # the stable ascending order of the last axis (np.argsort(kind="stable")), int64, NaN last; and the
    # last axis permuted by such an order (out[..., j] = x[..., order[..., j]]: np.sort is x permuted by
    # its argsort), both with that axis whole
    ARGSORT = "argsort"
    PERMUTE = "permute"
    TRANSPOSE = "transpose"  # also a host-level view
    FUSED = "fused"  # a chain of elementwise ops as one step (attrs["expr"]: an Expr; passes/fuse.py)
    # the sum of a fused chain (attrs["expr"], over its operands) as a Sum sums (attrs "axis", "factor"):
    # the chain's result is never written (passes/fuse.py)
    FUSED_SUM = "fused_sum"
    # a group of steps that work row by row over the last axis (elementwise ones, and reductions of the
    # last axis with keepdims) as one step: attrs["expr"], an Expr whose reduction nodes (REDUCE_MAX,
    # REDUCE_MIN, SUM with its factor) hold one value per row (passes/fuse_rows.py)
    FUSED_ROWS = "fused_rows"
    TAKE = "take"  # take(table, ids, rows): rows ids of the table, zeros where this device holds none
    # scatter_add(values, ids, rows): out[vocab, ...] = 0, then out[ids[t]] += values[t] for every
    # position t (repeated ids accumulate) on the rows this device holds; take's transpose (its VJP)
    SCATTER_ADD = "scatter_add"
    # x[a:b, i, ...] of basic indexing, rank kept (an int index is an extent-1 box, then a reshape):
    # the box at static `begin` (per axis) with the output's shape, `step` (per axis) where one is
    # not 1; a sliced axis is whole on every device, so it is also a host-level view of the local piece
    SLICE_ARRAY = "slice_array"
    CONCAT = "concat"  # its inputs joined along `axis`: lowered to a Copy of each into a SliceArray of one buffer
    # dynamic_slice(x, *starts): the box of x at run-time starts (0-d int operands; `box` per axis: a static
    # start, or None for the next operand), negative from the end then clamped so it fits, as JAX's;
    # dynamic_update_slice(x, update, *starts): x with that box replaced by update, lowered to a Copy of x
    # into the result (none where x is donated: passes/donate.py) then a step that writes only the box
    DYNAMIC_SLICE = "dynamic_slice"
    DYNAMIC_UPDATE_SLICE = "dynamic_update_slice"
    # host level: buffers and their views
    ALLOCATE = "allocate"
    SLICE = "slice"
    SELECT = "select"
    VIEW = "view"
    SHARD_SLICE = "shard_slice"
    COPY = "copy"
    # host level: communication (each started, then waited for)
    ALLGATHER = "allgather"
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALLTOALL = "alltoall"
    SENDRECV = "sendrecv"
    TRANSFER = "transfer"  # a move between meshes (SendRecv, Broadcast, Scatter, Gather)
    WAIT = "wait"
    # host level: control and streams
    FOR = "for"
    GET_STREAM = "get_stream"
    SET_STREAM = "set_stream"
    SYNCHRONIZE = "synchronize"
    RECORD_EVENT = "record_event"
    WAIT_EVENT = "wait_event"


# NumPy's further float functions of one float (shardfuse/numpy_math.py), each its ufunc's name
MORE_MATH = frozenset({Op.TAN, Op.ARCSIN, Op.ARCCOS, Op.ARCTAN, Op.SINH, Op.COSH, Op.ARCSINH, Op.ARCCOSH,
                       Op.ARCTANH, Op.LOG2, Op.LOG10, Op.EXP2, Op.CBRT})
# NumPy's binary float functions, each its ufunc's name
FLOAT_BINARY = frozenset({Op.ARCTAN2, Op.HYPOT, Op.COPYSIGN})
COMPARE = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
COMPARE_SCALAR = frozenset({Op.LT_SCALAR, Op.LE_SCALAR, Op.GT_SCALAR, Op.GE_SCALAR, Op.EQ_SCALAR, Op.NE_SCALAR})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM, Op.WHERE_THEN, Op.WHERE_ELSE,
                    Op.FLOOR_DIVIDE, Op.MOD, Op.POWER, Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR}) | COMPARE | FLOAT_BINARY
NONLINEAR_UNARY = frozenset({Op.EXP, Op.TANH, Op.RELU, Op.GELU, Op.ADD_SCALAR, Op.RDIV, Op.SQRT, Op.RSQRT, Op.LOG,
                             Op.SIGMOID, Op.SILU, Op.POW, Op.RPOW, Op.MAXIMUM_SCALAR, Op.MINIMUM_SCALAR,
                             Op.LOGICAL_NOT, Op.FILL_THEN, Op.FILL_ELSE, Op.ASTYPE, Op.FULL_LIKE, Op.ORDER_KEYS,
                             Op.FROM_ORDER_KEYS, Op.INVERT, Op.SIN, Op.COS, Op.LOG1P, Op.EXPM1, Op.ERF,
                             Op.GELU_ERF, Op.SIGN, Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC, Op.ISNAN,
                             Op.ISINF, Op.ISFINITE}) | COMPARE_SCALAR | MORE_MATH
LINEAR_UNARY = frozenset({Op.NEG, Op.SCALE, Op.DIV_SCALAR})  # commute with a pending sum
LOCAL_REDUCTIONS = frozenset({Op.REDUCE_MAX, Op.REDUCE_MIN})  # of the last axis, which must be whole
LOCAL_SCANS = frozenset({Op.CUMSUM, Op.ARGSORT, Op.PERMUTE})  # along the last axis, which must be whole; the result
# of the (first) input's shape
# (a step per device like the elementwise ops: the executor binds these through bind_elementwise)
ELEMENTWISE = BINARY | NONLINEAR_UNARY | LINEAR_UNARY | LOCAL_REDUCTIONS | LOCAL_SCANS
# Steps that may write their result over an operand of its shape (passes/reuse.py): every backend
# reads element k of each operand before it writes element k (NumPy's where halves and fills write
# the result first, the order keys in two passes); a fused step is in place when its last op is.
IN_PLACE = ELEMENTWISE - LOCAL_REDUCTIONS - LOCAL_SCANS - {Op.WHERE_THEN, Op.WHERE_ELSE, Op.FILL_THEN, Op.FILL_ELSE,
                                                           Op.ORDER_KEYS, Op.FROM_ORDER_KEYS}
# Collectives: started by one step and completed by its Wait; each has a `team` (mesh axis).
COLLECTIVES = frozenset({Op.ALLGATHER, Op.ALLREDUCE, Op.REDUCE_SCATTER, Op.ALLTOALL, Op.SENDRECV})
COMMUNICATION = COLLECTIVES | {Op.TRANSFER}
# Views: a new Ref of an existing buffer, no step.
VIEWS = frozenset({Op.SLICE, Op.SELECT, Op.VIEW, Op.SHARD_SLICE, Op.TRANSPOSE, Op.SLICE_ARRAY})
STREAM_OPS = frozenset({Op.GET_STREAM, Op.SET_STREAM, Op.SYNCHRONIZE, Op.RECORD_EVENT, Op.WAIT_EVENT})
# Made only by lowering (a pass that builds them directly, like the ring, hands them on as they are).
HOST_ONLY = frozenset({Op.ALLOCATE, Op.SELECT, Op.SENDRECV, Op.WAIT, Op.FOR}) | STREAM_OPS
# What a final plan may hold: the executor binds exactly these.
HOST = (VIEWS | COMMUNICATION | ELEMENTWISE | STREAM_OPS
        | {Op.ALLOCATE, Op.COPY, Op.WAIT, Op.MATMUL, Op.SUM, Op.TAKE, Op.SCATTER_ADD, Op.FUSED, Op.FUSED_SUM, Op.FUSED_ROWS,
           Op.FOR})
# What tracing may record.
ARRAY = ELEMENTWISE | {Op.SET, Op.RESHAPE, Op.MATMUL, Op.SUM, Op.TRANSPOSE, Op.TAKE, Op.SCATTER_ADD, Op.SLICE_ARRAY,
         Op.CONCAT}
# the update-slice ops (shardfuse/update_slice.py): traced, and host steps writing into their buffer
HOST |= {Op.DYNAMIC_SLICE, Op.DYNAMIC_UPDATE_SLICE}
ARRAY |= {Op.DYNAMIC_SLICE, Op.DYNAMIC_UPDATE_SLICE}


def _value_key(v):
    """A scalar as Exprs compare it: a float by its bits (0.0 and -0.0 apart, a NaN equal to itself)."""
    return ("float", struct.pack("<d", v)) if isinstance(v, float) else v


@dataclass(frozen=True, eq=False)
class Expr:
    """The computation of a fused step (Op.FUSED, Op.FUSED_SUM, Op.FUSED_ROWS): an elementwise op of its
    arguments (Exprs) and scalar `value`, each node's result in its own `dtype` (rounded there, as the
    unfused steps were), or with op None the step's operand number `arg`.  In a FusedRows step a node
    may also reduce its argument over the last axis, keeping it (REDUCE_MAX, REDUCE_MIN, or SUM times
    `value`, its factor): one value per row.  Equal Exprs are one value (backends compute it once).
    Backends evaluate it (NumPy op by op, CuPy as one generated kernel)."""

    op: Op | None
    dtype: str
    args: tuple = ()
    value: object = None
    arg: int = -1
    key: tuple = field(init=False, repr=False)  # (compared by it, made once, hashed once: a node's hash is
    hashed: int = field(init=False, repr=False)  # O(1), not its tree's)

    def __post_init__(self):
        key = (self.op, self.dtype, self.args, _value_key(self.value), self.arg)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "hashed", hash(key))

    def __eq__(self, other):
        return self is other or (isinstance(other, Expr) and self.hashed == other.hashed and self.key == other.key)

    def __hash__(self):
        return self.hashed

    def __reduce__(self):  # (by its fields: a str hash differs between processes, so the key is made anew)
        return Expr, (self.op, self.dtype, self.args, self.value, self.arg)

    def __str__(self):
        if self.op is None:
            return f"#{self.arg}"
        inner = [str(a) for a in self.args] + ([] if self.value is None else [repr(self.value)])
        return f"{self.op}({', '.join(inner)})"

    def ops(self) -> set:
        return set() if self.op is None else {self.op}.union(*(a.ops() for a in self.args))
