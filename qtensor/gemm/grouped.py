"""Grouped GEMM for MoE experts: `torch._grouped_mm` on quantized operands.

out[rows of expert e] = a[rows of e] @ b[e], where expert e owns token rows
[offs[e-1], offs[e]) (offs int32 [E], cumulative, offs[-1] <= T; an expert may own none). The
left operand is [T, K] (bf16, or quantized rowwise, NVFP4 row-scaled included), the right one
[E, K, N] quantized columnwise (a rowwise [E, N, K] expert weight's `.transpose(-1, -2)`), bias
[E, N]. Rows past offs[-1] are zero. The epilogue is the dense reference's, per expert: the left
factor of a row-scaled operand is per token, the right one per expert (and column).
"""

from __future__ import annotations

import torch

from qtensor.backends import GemmBackend
from qtensor.ops import gemm_ops
from qtensor.gemm.dense import dense_sides, operands, plan
from qtensor.tensors.base import QuantizedTensor

aten = torch.ops.aten


def _check(a_op, b_op, offs, bias) -> None:
    if a_op.dim() != 2 or b_op.dim() != 3:
        raise ValueError(
            "Quantized grouped GEMM takes tokens [T, K] x expert weights [E, K, N] (the MoE "
            f"forward); got {tuple(a_op.shape)} x {tuple(b_op.shape)}."
        )
    if offs is None or offs.dim() != 1 or offs.dtype != torch.int32 or len(offs) != b_op.shape[0]:
        raise ValueError(
            f"offs must be int32 [E] with E = {b_op.shape[0]} cumulative row ends; got "
            f"{None if offs is None else (offs.dtype, tuple(offs.shape))}."
        )
    if a_op.shape[1] != b_op.shape[1]:
        raise ValueError(f"K differs: {tuple(a_op.shape)} x {tuple(b_op.shape)}.")
    if bias is not None and tuple(bias.shape) != (b_op.shape[0], b_op.shape[2]):
        raise ValueError(
            f"grouped bias must be [E, N] = {(b_op.shape[0], b_op.shape[2])}; got "
            f"{tuple(bias.shape)}."
        )


def _grouped_sides(a_op, b_op):
    """(format, a [T, K*], b [E, N, K*]) as the grouped ops take them (rows along K)."""
    fmt, a, b, _ = dense_sides(a_op, b_op)
    return fmt, a, b


def grouped_mm_reference(a_op, b_op, offs, bias, out_dtype) -> torch.Tensor:
    """Per expert: exact fp32 units, matmul, the dense epilogue on that expert's rows."""
    fmt, a, b = _grouped_sides(a_op, b_op)
    return gemm_ops.reference_grouped_mm(fmt, a, b, offs, bias, out_dtype)


def grouped_plan(a_op, b_op, bias, out_dtype) -> GemmBackend:
    """The backend of a grouped product: the layer's planner on the grouped sides."""
    return plan(a_op, b_op, bias, out_dtype, _grouped_sides(a_op, b_op), grouped=True)


def grouped_mm(a, b, offs, bias=None, out_dtype=None) -> torch.Tensor:
    """torch._grouped_mm(a [T, K], b [E, K, N], offs) with quantized operands: the qtensor
    grouped op of the operands' format ([Note: GEMM ops])."""
    a_op, b_op = operands(a, b)
    _check(a_op, b_op, offs, bias)
    out_dtype = out_dtype or a.dtype
    fmt, sa, sb = _grouped_sides(a_op, b_op)
    if not sb.quantized:
        raise TypeError(
            "Quantized grouped GEMM needs quantized expert weights (the right operand); got a "
            f"{type(b_op).__name__}."
        )
    args = gemm_ops.grouped_args(fmt, sa, sb, offs, bias, out_dtype)
    backend = grouped_plan(a_op, b_op, bias, out_dtype)
    if backend is GemmBackend.TRITON or sa.data.device.type in ("cpu", "meta"):
        return gemm_ops.call(f"{fmt}_grouped_mm", *args)
    return gemm_ops.reference_grouped_mm(fmt, sa, sb, offs, bias, out_dtype)


@QuantizedTensor.implements(aten._grouped_mm.default)
def _grouped_mm(func, args, kwargs):
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    return grouped_mm(a, b, offs, bias, out_dtype)


# Handled at the torch level too (before autograd), as F.linear is: the grouped op's own
# autograd then gives a high-precision activation its gradient. Below autograd, aten's formula
# would multiply the gradient by the rowwise expert weights, which the op cannot take.
QuantizedTensor._function_table[torch._grouped_mm] = grouped_mm
