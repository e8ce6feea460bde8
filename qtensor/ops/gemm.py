"""Products of quantized tensors: the exact emulated reference every faster GEMM must match.

[Note: emulated GEMM]
Each operand enters as its exact "unit" values in fp32: NVFP4 `value(q) * s_b` (at most 5
significant bits), MXFP8 `e4m3 * 2**(code - 127)`, a high-precision operand as itself. The fp32
product `acc = units_a @ units_b` is what a bf16-tensor-core kernel with fp32 accumulation
computes, up to accumulation order. The epilogue then applies, in this order, in fp32:
    acc * (A_a * inv)  then  * A_b  then  + bias, then the cast to the output dtype,
where `inv = r(1 / (36 B_a B_b))` when both operands are NVFP4 (`r(1 / (6 B))` with one), A is
each NVFP4 operand's amax (a scalar, or a per-row vector for row-scaled operands: [M, 1] on the
left, [1, N] on the right; 1 for other formats) and B its E4M3 bound.

A left operand must have its blocks along its last dim (rowwise), a right operand along dim -2
(columnwise); a HybridTensor hands over the matching side. Both quantized operands must share
one format and, for NVFP4, the same RHT flag.
"""

from __future__ import annotations

import torch

from qtensor.formats.elements import fdiv
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import COLUMNWISE, ROWWISE
from qtensor.tensors.hybrid import HybridTensor
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor

aten = torch.ops.aten
_WANT = {"left": ROWWISE, "right": COLUMNWISE}


def _side(x, side: str):
    """The operand a GEMM multiplies on this side: a hybrid's matching half, else x itself."""
    if isinstance(x, HybridTensor):
        return x.rowwise if side == "left" else x.columnwise
    if isinstance(x, QuantizedTensor) and x.axis != _WANT[side]:
        raise ValueError(
            f"The {side} operand of a quantized GEMM needs its blocks along the reduction dim "
            f"({_WANT[side]}); got {x!r}. Quantize it with columnwise="
            f"{side == 'right'} or pass its transpose."
        )
    return x


def _check_pair(a, b) -> None:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        if type(a) is not type(b):
            raise TypeError(
                f"A GEMM needs both operands in one format; got {type(a).__name__} x "
                f"{type(b).__name__}. Use a HybridTensor to carry both formats."
            )
        if isinstance(a, NVFP4Tensor) and a.rht != b.rht:
            raise ValueError(
                "NVFP4 RHT must be applied to both GEMM operands or neither (it cancels only "
                f"in pairs); got rht={a.rht} x rht={b.rht}."
            )
    elif getattr(a, "rht", False) or getattr(b, "rht", False):
        raise ValueError("An RHT-transformed NVFP4 operand needs an RHT-transformed partner.")


def _units(x) -> torch.Tensor:
    return x.unit_values() if isinstance(x, QuantizedTensor) else x.float()


def _epilogue(acc, a, b, bias, out_dtype):
    nv_a, nv_b = isinstance(a, NVFP4Tensor), isinstance(b, NVFP4Tensor)
    if nv_a or nv_b:
        denom = (6.0 * a.e4m3_bound if nv_a else 1.0) * (6.0 * b.e4m3_bound if nv_b else 1.0)
        inv = fdiv(1.0, torch.tensor(denom, device=acc.device))
        left = a.amax_for("left") * inv if nv_a else inv
        acc = acc * left
        if nv_b:
            acc = acc * b.amax_for("right")
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def quantized_mm(a, b, bias=None, out_dtype=None) -> torch.Tensor:
    """a [.., M, K] @ b [.., K, N] (+ bias [N]) where either operand may be quantized."""
    a_op, b_op = _side(a, "left"), _side(b, "right")
    _check_pair(a_op, b_op)
    acc = torch.matmul(_units(a_op), _units(b_op))
    return _epilogue(acc, a_op, b_op, bias, out_dtype or a.dtype)


@QuantizedTensor.implements([aten.mm.default, aten.bmm.default, aten.matmul.default])
def _mm(func, args, kwargs):
    return quantized_mm(args[0], args[1])


@QuantizedTensor.implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args[:3]
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise ValueError("Quantized addmm supports beta=1 and alpha=1 only.")
    return quantized_mm(a, b, bias)


@QuantizedTensor.implements(aten.linear.default)
def _linear_dispatch(func, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return linear(x, w, bias)


def linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """F.linear with a quantized weight: quantizes x first when the weight carries an act_spec."""
    spec = getattr(weight, "act_spec", None)
    if spec is not None and not isinstance(x, QuantizedTensor):
        from qtensor.tensors.hybrid import quantize_spec

        # Activations are not checked for NaN/Inf: the check would cost a device sync per
        # layer; a non-finite activation poisons its amax and decodes to NaN instead.
        x = quantize_spec(x, spec, check_finite=False)
    lead, k = x.shape[:-1], x.shape[-1]
    out = quantized_mm(x.reshape(-1, k), weight.t(), bias, out_dtype=x.dtype)
    return out.reshape(*lead, out.shape[-1])


QuantizedTensor._function_table[torch.nn.functional.linear] = linear
