"""MXFP4 fake quantization for weight QAT: E2M1 values with a power-of-two scale per 1x32 block.

The pure-torch reference. `fake_quantize` returns the weight training must see, exactly the
values an MXFP4 deployment decodes to; its gradient is straight-through. Non-finite blocks are
poisoned: every element of a block holding NaN or +-Inf becomes NaN, so a diverged weight never
trains on as a finite grid point.
"""

from __future__ import annotations

import torch

from qtensor.formats.elements import e2m1_decode, e2m1_encode, f32_exponent_bits, pow2_f32

BLOCK = 32


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
