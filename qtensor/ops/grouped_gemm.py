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
from qtensor.ops.gemm import (
    _kernel_operand,
    _units,
    apply_epilogue,
    epilogue_factors,
    kernel_epilogue,
    operands,
    product_backend,
    triton_problem,
)
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


def grouped_mm_reference(a_op, b_op, offs, bias, out_dtype) -> torch.Tensor:
    """Per expert: exact fp32 units, matmul, the dense epilogue on that expert's rows."""
    ends = offs.tolist()
    if any(e1 < e0 for e0, e1 in zip([0] + ends, ends)) or (ends and ends[-1] > a_op.shape[0]):
        raise ValueError(f"offs must be non-decreasing and at most T={a_op.shape[0]}; got {ends}.")
    ua, ub = _units(a_op), _units(b_op)
    left, right = epilogue_factors(a_op, b_op)
    out = torch.zeros(a_op.shape[0], b_op.shape[2], dtype=out_dtype, device=ub.device)
    start = 0
    for e, end in enumerate(ends):
        rows = slice(start, end)
        acc = ua[rows] @ ub[e]
        l_e = left[rows] if isinstance(left, torch.Tensor) and left.dim() else left
        r_e = right[e] if right is not None and right.dim() == 3 else right
        b_e = bias[e] if bias is not None else None
        out[rows] = apply_epilogue(acc, l_e, r_e, b_e, out_dtype)
        start = end
    return out


def _triton_grouped(a_op, b_op, offs, bias, out_dtype) -> torch.Tensor:
    """The operands are decoded to exact bf16 once (each weight is read by T / BM tiles), then
    the grouped bf16 kernel applies the per-expert epilogue."""
    from qtensor.kernels import grouped_qgemm, qgemm

    t, k, n = a_op.shape[0], a_op.shape[1], b_op.shape[2]
    a = qgemm.decode_bf16(_kernel_operand(a_op, "left", qgemm), t, k)
    b = qgemm.decode_bf16(_kernel_operand(b_op, "right", qgemm), n, k)
    return grouped_qgemm.grouped_qgemm(
        a, b, offs, kernel_epilogue(a_op, b_op, bias, qgemm), out_dtype=out_dtype, t=t, n=n, k=k
    )


def grouped_plan(a_op, b_op, bias, out_dtype) -> GemmBackend:
    """Triton when the operands ask for triton or scaled_mm (no native grouped call is wired)
    and the kernel takes them; the reference otherwise."""
    wants = product_backend(a_op, b_op)
    if wants is not GemmBackend.EMULATED and triton_problem(a_op, b_op, None, out_dtype) is None:
        return GemmBackend.TRITON
    return GemmBackend.EMULATED


def grouped_mm(a, b, offs, bias=None, out_dtype=None) -> torch.Tensor:
    """torch._grouped_mm(a [T, K], b [E, K, N], offs) with quantized operands."""
    a_op, b_op = operands(a, b)
    _check(a_op, b_op, offs, bias)
    out_dtype = out_dtype or a.dtype
    if grouped_plan(a_op, b_op, bias, out_dtype) is GemmBackend.TRITON:
        return _triton_grouped(a_op, b_op, offs, bias, out_dtype)
    return grouped_mm_reference(a_op, b_op, offs, bias, out_dtype)


@QuantizedTensor.implements(aten._grouped_mm.default)
def _grouped_mm(func, args, kwargs):
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    return grouped_mm(a, b, offs, bias, out_dtype)
