"""Grouped GEMM for MoE experts: `torch._grouped_mm` on quantized operands.

out[rows of expert e] = a[rows of e] @ b[e], where expert e owns token rows
[offs[e-1], offs[e]) (offs int32 [E], cumulative, offs[-1] <= T; an expert may own none). The
left operand is [T, K] (bf16, or quantized rowwise, NVFP4 row-scaled included), the right one
[E, K, N] quantized columnwise (a rowwise [E, N, K] expert weight's `.transpose(-1, -2)`), bias
[E, N]. Rows past offs[-1] are zero. The epilogue is the dense reference's, per expert: the left
factor of a row-scaled operand is per token, the right one per expert (and column).
"""

from __future__ import annotations

import itertools

import torch

from qtensor.backends import GemmBackend
from qtensor.ops import gemm_k, gemm_ops
from qtensor.ops.gemm_operands import MXFP8, NVFP4, Side
from qtensor.gemm.dense import (
    _check_pair,
    _format,
    _rows_side,
    _side,
    _transposed_part,
    dense_sides,
    operands,
    plan,
    product_backend,
    quantized_mm_t,
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


def _k_parts(a_parts, b_parts):
    """(format, a sides, b sides, first pair) of the experts holding parts, as the ops take them
    (rows along K: a_e.t()'s rows, b_e's columns), the first pair checked; None where a part
    cannot multiply that way (then each expert runs its own product)."""
    first, a_sides, b_sides = None, [], []
    for a, b in zip(a_parts, b_parts):
        if a is None:
            continue
        a_op, b_op = _transposed_part(a, "left"), _side(b, "right")
        if a_op is None or not isinstance(a_op, QuantizedTensor) or \
                not isinstance(b_op, QuantizedTensor):
            return None
        if first is None:
            _check_pair(a_op, b_op)
            first = (a_op, b_op)
        a_sides.append(_rows_side(a_op, False))
        b_sides.append(_rows_side(b_op, False))
    if first is None or _format(*first) not in (NVFP4, MXFP8):
        return None
    return _format(*first), a_sides, b_sides, first


def _cat(fmt: str, sides, parts) -> Side:
    """The experts' sides side by side along K; an NVFP4 amax stacked per expert ([E], or
    [E, R] for row-scaled parts), 0 for an expert without parts."""
    first = sides[0]
    data = torch.cat([s.data for s in sides], dim=1)
    # As bytes: CUDA has no cat for float8_e8m0fnu (the MXFP8 scales).
    scale = torch.cat([s.scale.view(torch.uint8) for s in sides], dim=1).view(first.scale.dtype)
    if fmt != NVFP4:
        return Side(data, scale)
    zero, it = first.amax.new_zeros(first.amax.shape), iter(sides)
    amax = torch.stack([zero if p is None else next(it).amax for p in parts])
    bounds = {s.bound for s in sides}
    if len(bounds) != 1:
        raise ValueError(f"the experts' operands have different E4M3 bounds {sorted(bounds)}.")
    return Side(data, scale, amax, first.bound)


def expert_offsets(counts, device) -> torch.Tensor:
    """The grouped ops' int32 [E] cumulative ends of host counts, copied to the device without a
    host sync (a pageable copy would wait for the queue); traced, a constant of the graph."""
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        return ends.pin_memory().to(device, non_blocking=True)
    return ends.to(device)


def grouped_mm_k(a_parts, b_parts, out_dtype) -> torch.Tensor:
    """[E, M, N]: out[e] = a_e.t() @ b_e for expert e's a_e [m_e, M] and b_e [m_e, N], a grouped
    linear's weight gradients (dY_e^T @ X_e); zeros for an expert whose parts are None. The
    experts' K ranges come from the parts' own token counts (whole blocks of their format).

    Each pair multiplies as quantized_mm_t(a_e, b_e, a_t=True) would (the columnwise parts),
    but all in one product grouped along K ([Note: grouped along K]): the parts' bytes put side
    by side, each expert's amax kept. On the CPU out[e] is bitwise that expert's own product;
    on the GPU it equals it up to the order of the fp32 sums. Parts that cannot be put side by
    side (high precision, another format, the native scaled_mm backend) run expert by expert.
    """
    if len(a_parts) != len(b_parts):
        raise ValueError(f"grouped_mm_k needs one (a, b) pair per expert; got {len(a_parts)} "
                         f"and {len(b_parts)} parts.")
    counts = []
    for e, (a, b) in enumerate(zip(a_parts, b_parts)):
        if (a is None) != (b is None) or (a is not None and a.shape[0] != b.shape[0]):
            raise ValueError(
                f"grouped_mm_k: expert {e}'s parts must both be None or hold the same tokens; "
                f"got {None if a is None else tuple(a.shape)} and "
                f"{None if b is None else tuple(b.shape)}.")
        counts.append(0 if a is None else a.shape[0])
    found = _k_parts(a_parts, b_parts)
    backend = None if found is None else plan(*found[3], None, out_dtype)
    if found is None or backend is GemmBackend.SCALED_MM:
        return _each_expert(a_parts, b_parts, out_dtype)
    fmt, a_sides, b_sides, _ = found
    a, b = _cat(fmt, a_sides, a_parts), _cat(fmt, b_sides, a_parts)
    offs = expert_offsets(counts, a.data.device)
    if backend is GemmBackend.TRITON or a.data.device.type in ("cpu", "meta"):
        return gemm_k.grouped_mm_k(fmt, a, b, offs, out_dtype)
    return gemm_k.reference_grouped_mm_k(fmt, a, b, offs, out_dtype)


def grouped_mm_k_sides(fmt: str, a: Side, b: Side, offs, out_dtype, like) -> torch.Tensor:
    """The product grouped along K of operands already side by side (a grouped linear's experts
    cast at once), offs on whole blocks of the format as the caller's counts guarantee (the CUDA
    kernel relies on it unchecked); `like`: a quantized tensor of the layer whose GEMM backend
    the product takes (the emulated one runs the reference on the GPU, as the planner's grouped
    products do)."""
    if product_backend(like, like) is GemmBackend.EMULATED and a.data.device.type == "cuda":
        return gemm_k.reference_grouped_mm_k(fmt, a, b, offs, out_dtype)
    return gemm_k.grouped_mm_k(fmt, a, b, offs, out_dtype)


def _each_expert(a_parts, b_parts, out_dtype) -> torch.Tensor:
    if all(a is None for a in a_parts):
        raise ValueError("grouped_mm_k: no expert holds operands, so the output's shape is "
                         "unknown; skip the product when no expert has rows.")
    outs = [None if a is None else quantized_mm_t(a, b, out_dtype=out_dtype, a_t=True)
            for a, b in zip(a_parts, b_parts)]
    like = next(o for o in outs if o is not None)
    return torch.stack([torch.zeros_like(like) if o is None else o for o in outs])


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
