"""FP8 block scaling (DeepSeek-style): E4M3 data, one fp32 power-of-two scale per block.

The pure-torch reference and single source of truth for these bytes. Two block shapes:
- "1x128" for activations and gradients: 128 consecutive elements along the last dim
  (rowwise, scale [..., K/128]), or along dim 0 of a 2-D tensor (columnwise, the operand of a
  GEMM that reduces over dim 0; data keeps the input's layout, scale [M/128, K]).
- "128x128" for weights: one scale per square tile of a 2-D tensor, scale [N/128, K/128]. A
  square tile has no row/column distinction: the transpose of the bytes is the transpose of the
  tensor, so one encoding serves fprop and dgrad.

Scale rule [Note: FP8 block scale]: the decode scale is amax/448 rounded up to a power of two,
computed exactly as the MXFP8 RCEIL scale code (docs/formats.md, "MXFP8") and stored as its fp32
value 2**(code - 127). Power-of-two scales are the Transformer Engine default for this recipe
(power_2_scale) and what makes an MXFP4 weight land on E4M3 exactly (docs/qat.md). An all-zero
block gets 2**-127 (code 0); a non-finite block gets a NaN scale. Data `e4m3(x * 2**(127-code))`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch

from qtensor.formats import mxfp8

BLOCK = 128
BlockShape = Literal["1x128", "128x128"]


@dataclasses.dataclass(frozen=True)
class FP8BlockSpec:
    """How to quantize one FP8 block-scaled operand. Validated at construction."""

    # "1x128": activations / gradients; "128x128": weights (2-D only).
    block: BlockShape = "1x128"
    # 1x128 blocks along dim 0 instead of the last dim (wgrad operands). Not for 128x128.
    columnwise: bool = False

    def __post_init__(self):
        if self.block not in ("1x128", "128x128"):
            raise ValueError(f"FP8 block must be '1x128' or '128x128'; got {self.block!r}.")
        if self.block == "128x128" and self.columnwise:
            raise ValueError(
                "128x128 tiles have no columnwise form (the transpose of the bytes is the "
                "transposed tensor); use columnwise=False."
            )


class FP8BlockData(NamedTuple):
    qdata: torch.Tensor  # float8_e4m3fn, the input's shape and layout
    scale: torch.Tensor  # float32 powers of two: [..., K/128], [M/128, K] or [N/128, K/128]


def check_shape(shape: torch.Size, spec: FP8BlockSpec) -> None:
    """Raise if `shape` cannot be quantized with `spec`, naming the rule."""
    if len(shape) < 1 or any(s == 0 for s in shape):
        raise ValueError(f"FP8 block scaling needs a non-empty tensor; got shape {tuple(shape)}.")
    two_d = spec.block == "128x128" or spec.columnwise
    if two_d and (len(shape) != 2 or shape[0] % BLOCK):
        raise ValueError(
            f"FP8 {spec.block} {'columnwise ' if spec.columnwise else ''}needs a 2-D tensor with "
            f"dim 0 divisible by {BLOCK}; got shape {tuple(shape)}."
        )
    if not spec.columnwise and shape[-1] % BLOCK:
        raise ValueError(
            f"FP8 {spec.block} needs the last dim divisible by {BLOCK}; got shape "
            f"{tuple(shape)}. Pad the features or exclude this tensor."
        )


def scale_codes(block_amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponent codes (int32, 2**(code-127)) of fp32 block amaxes: the MXFP8 RCEIL rule."""
    return mxfp8.scale_codes(block_amax, "rceil")


def quantize(x: torch.Tensor, spec: FP8BlockSpec) -> FP8BlockData:
    """Quantize x (any float dtype) to FP8 block-scaled bytes per the note above."""
    check_shape(x.shape, spec)
    xf = x.to(torch.float32)
    if spec.block == "128x128":
        n, k = xf.shape
        tiles = xf.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        codes = scale_codes(tiles.abs().amax(dim=(1, 3)))  # [N/128, K/128]
        data = mxfp8.encode_blocks(tiles, codes[:, None, :, None]).reshape(n, k)
        return FP8BlockData(data, code_values(codes))
    if spec.columnwise:
        data, scale = quantize(xf.t(), FP8BlockSpec("1x128"))
        return FP8BlockData(data.t().contiguous(), scale.t().contiguous())
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)
    codes = scale_codes(blocks.abs().amax(-1))
    data = mxfp8.encode_blocks(blocks, codes[..., None]).reshape(xf.shape)
    return FP8BlockData(data, code_values(codes))


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 2**(code-127); code 255 is NaN (the MXFP8 code values, stored as fp32)."""
    return mxfp8.scale_values_from_codes(codes)


def expand_scale(scale: torch.Tensor, shape: torch.Size, spec: FP8BlockSpec) -> torch.Tensor:
    """The per-element fp32 scale of a tensor of `shape` (for decoding)."""
    if spec.block == "128x128":
        return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    dim = 0 if spec.columnwise else -1
    return scale.repeat_interleave(BLOCK, dim)


def dequantize(
    qdata: torch.Tensor, scale: torch.Tensor, spec: FP8BlockSpec, dtype=torch.float32
) -> torch.Tensor:
    """Decode: e4m3 value * scale, exact in fp32 (both factors are exact, the scale is 2**k)."""
    return (qdata.float() * expand_scale(scale, qdata.shape, spec)).to(dtype)
