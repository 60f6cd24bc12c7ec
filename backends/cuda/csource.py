"""The C side of the generated CUDA kernels, with no CuPy import (so the sources the backend
generates can be built and read on a machine without a GPU): bfloat16's conversions, each op as
one C expression (INLINE), and each dtype's kernel parameter type and C type."""
from __future__ import annotations

from shardfuse.ops import Op

BF16_PREAMBLE = r"""
__device__ inline float bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ inline unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"""


def literal(v) -> str:
    """A scalar as a C double literal (exact: repr round-trips; infinities and NaN by their bits)."""
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        bits = {"inf": "0x7ff0000000000000LL", "-inf": "0xfff0000000000000LL"}.get(str(v), "0x7ff8000000000000LL")
        return f"__longlong_as_double({bits})"
    return repr(v)


# The ops as one C expression each, over operands a, b and the scalar s, computed in type F (float;
# double where a float64 takes part): the one-kernel form of a step where a bfloat16 takes part,
# read and written as its uint16 bits inline (no float32 scratch buffers, one launch)
_GELU_C = "(F)0.5 * a * ((F)1 + tanh((F)0.7978845608028654 * (a + (F)0.044715 * a * a * a)))"
_SIGMOID_C = "(a >= 0 ? (F)1 / ((F)1 + exp(-a)) : exp(a) / ((F)1 + exp(a)))"
# (isinf / isfinite by arithmetic: a - a is NaN for an infinity and for NaN, 0 for every finite a)
_MATH_C = {
    Op.SIN: "sin(a)", Op.COS: "cos(a)", Op.LOG1P: "log1p(a)", Op.EXPM1: "expm1(a)", Op.ERF: "erf(a)",
    Op.GELU_ERF: "((F)0.5 * a * erfc(-a * (F)0.7071067811865476))", Op.FLOOR: "floor(a)", Op.CEIL: "ceil(a)",
    Op.ROUND: "rint(a)", Op.TRUNC: "trunc(a)",
    Op.SIGN: "(a > (F)0 ? (F)1 : (a < (F)0 ? (F)-1 : (a == (F)0 ? (F)0 : a)))",
    Op.ISNAN: "(a != a)", Op.ISINF: "(a == a && a - a != a - a)", Op.ISFINITE: "(a - a == a - a)",
    Op.TAN: "tan(a)", Op.ARCSIN: "asin(a)", Op.ARCCOS: "acos(a)", Op.ARCTAN: "atan(a)", Op.SINH: "sinh(a)",
    Op.COSH: "cosh(a)", Op.ARCSINH: "asinh(a)", Op.ARCCOSH: "acosh(a)", Op.ARCTANH: "atanh(a)", Op.LOG2: "log2(a)",
    Op.LOG10: "log10(a)", Op.EXP2: "exp2(a)", Op.CBRT: "cbrt(a)",
    Op.ARCTAN2: "atan2(a, b)", Op.HYPOT: "hypot(a, b)", Op.COPYSIGN: "copysign(a, b)",
}
INLINE = {
    Op.ADD: "a + b", Op.SUB: "a - b", Op.MUL: "a * b", Op.DIV: "a / b", Op.NEG: "-a",
    Op.SCALE: "a * s", Op.DIV_SCALAR: "a / s", Op.ADD_SCALAR: "a + s", Op.RDIV: "s / a",
    Op.EXP: "exp(a)", Op.TANH: "tanh(a)", Op.SQRT: "sqrt(a)", Op.RSQRT: "(F)1 / sqrt(a)", Op.LOG: "log(a)",
    Op.RELU: "((a > (F)0 || a != a) ? a : (F)0)", Op.GELU: _GELU_C, Op.SIGMOID: _SIGMOID_C,
    Op.SILU: f"(a * {_SIGMOID_C})", Op.POW: "pow(a, s)", Op.RPOW: "pow(s, a)", Op.POWER: "pow(a, b)",
    Op.MAXIMUM: "((a > b || a != a) ? a : b)", Op.MINIMUM: "((a < b || a != a) ? a : b)",
    Op.MAXIMUM_SCALAR: "((a > s || a != a) ? a : s)", Op.MINIMUM_SCALAR: "((a < s || a != a) ? a : s)",
    Op.LT: "a < b", Op.LE: "a <= b", Op.GT: "a > b", Op.GE: "a >= b", Op.EQ: "a == b", Op.NE: "a != b",
    Op.LT_SCALAR: "a < s", Op.LE_SCALAR: "a <= s", Op.GT_SCALAR: "a > s", Op.GE_SCALAR: "a >= s",
    Op.EQ_SCALAR: "a == s", Op.NE_SCALAR: "a != s",
    Op.WHERE_THEN: "(a ? b : (F)-0.0)", Op.WHERE_ELSE: "(a ? (F)-0.0 : b)",
    Op.FILL_THEN: "(a ? s : (F)-0.0)", Op.FILL_ELSE: "(a ? (F)-0.0 : s)", Op.FULL_LIKE: "s", Op.ASTYPE: "a",
    **_MATH_C,
}
# each dtype's type name as a kernel parameter (bfloat16 as its uint16 bits), and its C type
PARAM_TYPES = {"float16": "float16", "float32": "float32", "float64": "float64", "int32": "int32",
               "int64": "int64", "bool": "bool", "bfloat16": "uint16"}
C_TYPES = {"float16": "float16", "float32": "float", "float64": "double", "int32": "int", "int64": "long long"}
