"""MXFP4: E2M1 values with a power-of-two (UE8M0) scale per 1x32 block.

The pure-torch reference, for weight QAT and for MXFP4 bytes. `fake_quantize` returns the
weight training must see, exactly the values an MXFP4 deployment decodes to; its gradient is
straight-through. Non-finite blocks are poisoned: every element of a block holding NaN or +-Inf
becomes NaN, so a diverged weight never trains on as a finite grid point.

[Note: MXFP4 storage] (docs/formats.md, "MXFP4"): the bytes of gpt-oss checkpoints and of
qtensor.qat.export_weight. Per 1x32 block along the last dim:
    qdata  uint8 [..., K/2]    two E2M1 codes a byte, element 2j in the low nibble (a
                               checkpoint's NAME_blocks [..., K/32, 16] is the same bytes)
    scale  uint8 [..., K/32]   the UE8M0 code c = e + 127 of the block exponent e; the block
                               decodes to value(q) * 2**(c - 127); c = 255 is NaN
`quantize` writes code 255 for a block holding NaN or +-Inf, so the bytes decode to exactly
`fake_quantize_values` (finite blocks never get it: e <= 125, c <= 252).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from qtensor.formats.elements import (e2m1_decode, e2m1_encode, f32_exponent_bits, pack_fp4,
                                      pow2_f32, unpack_fp4)
from qtensor.formats.fields import check_field_types

BLOCK = 32
SCALE_BIAS = 127  # UE8M0: code c means 2**(c - 127)
NAN_CODE = 255  # the UE8M0 NaN


@dataclasses.dataclass(frozen=True)
class MXFP4Spec:
    """How to quantize one MXFP4 operand. The scale rule is fixed (`block_exponent`, the rule
    QAT trains against and gpt-oss checkpoints decode with). Validated at construction."""

    # Blocks of 32 along dim -2 (the right operand of a GEMM reducing over that dim) instead of
    # along the last dim.
    columnwise: bool = False

    def __post_init__(self):
        check_field_types(self)


class MXFP4Data(NamedTuple):
    qdata: torch.Tensor  # uint8 [..., K/2], packed E2M1 codes
    scale: torch.Tensor  # uint8 [..., K/32], UE8M0 codes


def check_shape(shape: torch.Size) -> None:
    if len(shape) < 1 or any(s == 0 for s in shape) or shape[-1] % BLOCK:
        raise ValueError(
            f"MXFP4 needs a non-empty tensor with the last dim divisible by {BLOCK}; "
            f"got shape {tuple(shape)}."
        )


def block_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """e = clamp(ceil(log2(amax / 6)), -126, 125) from the bits of the fp32 amax (int32).

    Zero, subnormal and non-finite amaxes give -126.
    """
    exp, mant = f32_exponent_bits(block_amax)
    e = exp - 129 + (mant > 0x400000).int()
    special = (exp == 0) | (exp == 255)
    return torch.where(special, torch.full_like(e, -126), e.clamp(-126, 125))


def decompose(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes [..., K] uint8, block exponents [..., K/32] int32) of w."""
    check_shape(w.shape)
    wf = w.to(torch.float32)
    blocks = wf.reshape(*wf.shape[:-1], wf.shape[-1] // BLOCK, BLOCK)
    e = block_exponent(blocks.abs().amax(-1))
    scaled = (blocks.abs() * pow2_f32(-e)[..., None]).clamp(max=6.0)  # exact: power of two
    codes = e2m1_encode(torch.where(torch.signbit(blocks), -scaled, scaled))
    return codes.reshape(wf.shape), e


def compose(codes: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """fp32 values of an MXFP4 decomposition: value(q) * 2**e."""
    vals = e2m1_decode(codes)
    blocks = vals.reshape(*vals.shape[:-1], vals.shape[-1] // BLOCK, BLOCK)
    return (blocks * pow2_f32(e)[..., None]).reshape(vals.shape)


def fake_quantize_values(w: torch.Tensor) -> torch.Tensor:
    """The projected weight in w's dtype; non-finite blocks become NaN."""
    codes, e = decompose(w)
    out = compose(codes, e)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    bad = ~torch.isfinite(blocks).all(-1, keepdim=True)
    out = out.reshape(blocks.shape).masked_fill(bad, float("nan")).reshape(w.shape)
    return out.to(w.dtype)


class _FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return fake_quantize_values(w)

    @staticmethod
    def backward(ctx, grad):
        return grad


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 projection of w (bf16 or fp32) with a straight-through gradient."""
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(
            f"MXFP4 fake quantization takes bf16 or fp32 weights; got {w.dtype}. fp16 cannot "
            "hold the MXFP4 grid (2**-127 .. 6 * 2**125); keep master weights in bf16 or fp32."
        )
    return _FakeQuantizeSTE.apply(w)


# ---- bytes ([Note: MXFP4 storage]) ----------------------------------------------------------


def quantize(x: torch.Tensor) -> MXFP4Data:
    """MXFP4 bytes of x (any float dtype) in 1x32 blocks along its last dim: the codes and
    exponents of `decompose`, scale code 255 for a block holding NaN or +-Inf."""
    codes, e = decompose(x)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    bad = ~torch.isfinite(blocks).all(-1)
    scale = torch.where(bad, torch.full_like(e, NAN_CODE), e + SCALE_BIAS).to(torch.uint8)
    return MXFP4Data(pack_fp4(codes), scale)


def scale_exponents(scale: torch.Tensor) -> torch.Tensor:
    """int32 block exponents c - 127 of UE8M0 codes (code 255 gives 127: mask it with NaN)."""
    return scale.to(torch.int32).clamp(max=NAN_CODE - 1) - SCALE_BIAS


def dequantize(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values [..., K] of MXFP4 bytes: value(q) * 2**(c - 127), exact (at most 2
    significant bits times a power of two in [2**-127, 2**127]); code 255 blocks are NaN."""
    codes = unpack_fp4(qdata)
    out = compose(codes, scale_exponents(scale))
    blocks = out.reshape(*out.shape[:-1], out.shape[-1] // BLOCK, BLOCK)
    nan = (scale == NAN_CODE)[..., None]
    return blocks.masked_fill(nan, float("nan")).reshape(out.shape)
