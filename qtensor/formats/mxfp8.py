"""MXFP8: E4M3 data with one UE8M0 (power-of-two) scale per 32 elements.

The pure-torch reference and single source of truth for MXFP8 bytes. Rowwise blocks are 1x32
along the last dim, with `scale` [M, K/32]; columnwise blocks are 32x1 along dim 0 of the 2-D
input, the data keeps the input's layout and `scale` is [M/32, K]. Scale codes are
float8_e8m0fnu: code c means 2**(c - 127), 255 is NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch

from qtensor.formats.elements import e4m3, f32_exponent_bits, f32_from_bits, pow2_f32
from qtensor.formats.fields import check_field_types, either

BLOCK = 32
ScaleRule = Literal["rceil", "floor"]
SCALE_RULES = ("rceil", "floor")  # the values MXFP8Spec.scale_rule may take
# r(1/448) in fp32 (0x3B124925); amax * r(1/448) is the unrounded scale of the RCEIL rule. A
# Python float with that exact value, so torch.compile's fake tensors never meet a real one.
RECIP_448 = f32_from_bits(0x3B124925).item()


@dataclasses.dataclass(frozen=True)
class MXFP8Spec:
    """How to quantize one MXFP8 operand. Validated at construction."""

    # "rceil": scale = amax/448 rounded up to a power of two (hardware default, never saturates);
    # "floor": the OCP MX rule 2**(floor(log2 amax) - 8), which may saturate the top elements.
    scale_rule: ScaleRule = "rceil"
    # Blocks of 32 along dim 0 (the operand of a GEMM reducing over dim 0) instead of the last dim.
    columnwise: bool = False

    def __post_init__(self):
        check_field_types(self)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be {either(SCALE_RULES)}; got {self.scale_rule!r}.")


class MXFP8Data(NamedTuple):
    qdata: torch.Tensor  # float8_e4m3fn, the input's shape
    scale: torch.Tensor  # float8_e8m0fnu, [M, K/32] rowwise or [M/32, K] columnwise


def check_shape(shape: torch.Size, spec: MXFP8Spec) -> None:
    """Raise if `shape` cannot be quantized with `spec`, naming the rule."""
    if len(shape) < 1 or any(s == 0 for s in shape):
        raise ValueError(f"MXFP8 needs a non-empty tensor; got shape {tuple(shape)}.")
    if spec.columnwise:
        if len(shape) != 2 or shape[0] % BLOCK:
            raise ValueError(
                f"MXFP8 columnwise needs a 2-D tensor with dim 0 divisible by {BLOCK}; "
                f"got shape {tuple(shape)}."
            )
    elif shape[-1] % BLOCK:
        raise ValueError(
            f"MXFP8 needs the last dim divisible by {BLOCK}; got shape {tuple(shape)}. "
            "Pad the features or exclude this tensor."
        )


def scale_codes(block_amax: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """UE8M0 codes (int32 0..255) for fp32 block amaxes; amax 0 gives 0, non-finite gives 255."""
    if rule == "rceil":
        exp, mant = f32_exponent_bits(block_amax * RECIP_448)
        # Round the fp32 value up to a power of two on its bits: exponent field + (mantissa != 0).
        # A nonzero subnormal value therefore gets code 1 (2**-126), never code 0; this is the
        # rule of the golden vectors and of the bit-level hardware conversion.
        code = exp + (mant != 0).int()
    else:
        exp, mant = f32_exponent_bits(block_amax)
        # floor(log2 amax) - 8 + 127, with subnormal amaxes' exponent from their leading bit.
        sub_log2 = torch.floor(torch.log2(mant.clamp(min=1).double())).int() - 149
        log2 = torch.where(exp > 0, exp - 127, sub_log2)
        code = (log2 - 8 + 127).clamp(min=0)
    code = code.clamp(max=254)
    code = torch.where(block_amax == 0, torch.zeros_like(code), code)
    return torch.where(torch.isfinite(block_amax), code, torch.full_like(code, 255))


def quantize_rows(xf: torch.Tensor, rule: ScaleRule) -> MXFP8Data:
    """1x32 blocks along the last dim of fp32 x [..., K]."""
    data, codes = _quantize_rows(xf, rule)
    return MXFP8Data(data, e8m0(codes))


def _quantize_rows(xf: torch.Tensor, rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data, int32 scale codes) of 1x32 blocks along the last dim."""
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)
    codes = scale_codes(blocks.abs().amax(-1), rule)
    return encode_blocks(blocks, codes[..., None]).reshape(xf.shape), codes


def encode_blocks(blocks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """e4m3(x * 2**(127 - code)) with int32 codes broadcast over `blocks`; code 255 poisons
    its block with NaN. Shared with FP8 block scaling (formats/fp8_block.py)."""
    inv = pow2_f32((127 - codes).clamp(-127, 127))
    inv = torch.where(codes == 255, torch.full_like(inv, float("nan")), inv)
    return e4m3(blocks * inv)


def e8m0(codes: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu scales from int32 codes.

    An exact value conversion (2**(code - 127), NaN for 255), not a bitcast of the codes, and
    done last (after any transpose): CPU Inductor has no C++ type for e8m0, so it can neither
    bitcast nor copy one inside a kernel; a conversion runs as an eager op. Same bytes.
    """
    return scale_values_from_codes(codes).to(torch.float8_e8m0fnu)


def quantize(x: torch.Tensor, spec: MXFP8Spec) -> MXFP8Data:
    """Quantize x (any float dtype) to MXFP8 bytes per docs/formats.md."""
    check_shape(x.shape, spec)
    xf = x.to(torch.float32)
    if not spec.columnwise:
        return quantize_rows(xf, spec.scale_rule)
    data, codes = _quantize_rows(xf.t(), spec.scale_rule)
    return MXFP8Data(data.t().contiguous(), e8m0(codes.t().contiguous()))


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 2**(code - 127) of UE8M0 codes; code 255 decodes to NaN."""
    # A value conversion (exact for every code), not a bitcast to uint8: see quantize_rows. The
    # NaN of code 255 is rebuilt so its bits stay 0x7FC00000, as they were with the bitcast.
    val = scale.to(torch.float32)
    return torch.where(torch.isnan(val), torch.full_like(val, float("nan")), val)


def scale_values_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """fp32 2**(code - 127) of int32 UE8M0 codes; code 255 gives NaN."""
    val = pow2_f32((codes - 127).clamp(-127, 127))
    return torch.where(codes == 255, torch.full_like(val, float("nan")), val)


def dequantize(
    qdata: torch.Tensor, scale: torch.Tensor, columnwise: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode to the input's layout: e4m3 value * 2**(code - 127), exact in fp32."""
    s = scale_values(scale)
    if columnwise:
        s = s.repeat_interleave(BLOCK, dim=-2)
    else:
        s = s.repeat_interleave(BLOCK, dim=-1)
    return (qdata.float() * s).to(dtype)
