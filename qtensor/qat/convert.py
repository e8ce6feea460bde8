"""MXFP4 weight -> host bytes, by projection or directly: the composite-torch reference.

[Note: two conversion modes]
The weight a QAT step trains with is the MXFP4 projection w^ = value(q) * 2**e of the master
weight (qtensor/formats/mxfp4.py; docs/formats.md, "MXFP4 fake quantization"). The host recipe
then needs that weight in its own bytes, and there are two ways to get them:
- projection: w^ materialized in the weight's dtype, then the host's ordinary quantizer
  (MXFP8 1x32 RCEIL, or FP8 128x128 power-of-two tiles). Every w^ is a grid point, so both
  encodings are decoded-value exact (MXFP8 always; 128x128 while the tile's block-exponent
  spread is at most 14, see below).
- direct: the decomposition (q, e) written straight into the host bytes:
  MXFP8 rowwise  code = max(e + 121, 0), payload e4m3(q * 2**(e + 127 - code)): the fixed
                 shift of 6 (q * 64 <= 384), and below code 0 the payload absorbs the rest
                 (q * 2**(e+127) <= 192). The bytes are invertible back to (q, e).
  MXFP8 columnwise  a fresh 32x1 quantization of w^ (its blocks cut across 32 MXFP4 blocks).
  FP8 128x128    tile scale 2**t, t = max(max e - 6, -127); payload e4m3(q * 2**(e - t)).
                 q * 2**(e - t) keeps its lowest bit (2**(e - t - 1) for q in {0.5, 1.5, 3})
                 while e - t - 1 >= -9, the smallest E4M3 subnormal: exact for a spread
                 max e - e <= 14, first loss at 15.
The bytes of the two modes may differ (a block whose largest code is 3 gets RCEIL code e + 120
by projection, e + 121 directly) but they decode to the same values wherever both are exact, so
every GEMM on them gives the same bits. A non-finite block poisons: its MXFP8 scale code is 255
(NaN), its 128x128 tile scale NaN, exactly as projection then quantization gives.
"""

from __future__ import annotations

import torch

from qtensor.formats import fp8_block, mxfp4, mxfp8
from qtensor.formats.elements import e2m1_decode, e4m3, pow2_f32
from qtensor.formats.fp8_block import FP8BlockData, FP8BlockSpec
from qtensor.formats.mxfp8 import MXFP8Data, MXFP8Spec

# MXFP8 rowwise code of a direct conversion: e - 6 + 127 (E4M3's 448 holds 6 * 2**6 = 384).
MXFP8_SHIFT = 6
FP8_TILE_SHIFT = 6
_NAN_CODE = 255


def project(w: torch.Tensor) -> torch.Tensor:
    """The MXFP4 projection w^ in w's dtype (no gradient): the reference, unchanged."""
    return mxfp4.fake_quantize_values(w)


def _nonfinite_blocks(w: torch.Tensor) -> torch.Tensor:
    """[..., K/32] bool: blocks of w holding NaN or +-Inf."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // mxfp4.BLOCK, mxfp4.BLOCK)
    return ~torch.isfinite(blocks).all(-1)


def _q_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 E2M1 values as [..., K/32, 32] blocks."""
    v = e2m1_decode(codes)
    return v.reshape(*v.shape[:-1], v.shape[-1] // mxfp4.BLOCK, mxfp4.BLOCK)


# ---- MXFP8 host ---------------------------------------------------------------------------


def mxfp8_rowwise(w: torch.Tensor, direct: bool) -> MXFP8Data:
    """MXFP8 1x32 rowwise bytes of the projected weight (RCEIL host rule, or the direct lift)."""
    if not direct:
        return mxfp8.quantize(project(w), MXFP8Spec())
    codes, e = mxfp4.decompose(w)
    code = (e + 127 - MXFP8_SHIFT).clamp(min=0)
    bad = _nonfinite_blocks(w)
    code = torch.where(bad, torch.full_like(code, _NAN_CODE), code)
    lifted = _q_values(codes) * pow2_f32(e + 127 - code)[..., None]
    payload = e4m3(lifted.masked_fill(bad[..., None], float("nan")))
    return MXFP8Data(payload.reshape(w.shape), code.to(torch.uint8).view(torch.float8_e8m0fnu))


def mxfp8_columnwise(w: torch.Tensor, direct: bool) -> MXFP8Data:
    """MXFP8 32x1 columnwise bytes of w^: a fresh quantization in both modes.

    The direct mode starts from the decomposition instead of the materialized projection; the
    fp32 values are the same, so the bytes are the host quantizer's, bit for bit.
    """
    if not direct:
        return mxfp8.quantize(project(w), MXFP8Spec(columnwise=True))
    codes, e = mxfp4.decompose(w)
    w_hat = mxfp4.compose(codes, e)
    bad = _nonfinite_blocks(w)
    w_hat = w_hat.reshape(*bad.shape, mxfp4.BLOCK).masked_fill(bad[..., None], float("nan"))
    return mxfp8.quantize(w_hat.reshape(w.shape), MXFP8Spec(columnwise=True))


# ---- FP8 128x128 host -----------------------------------------------------------------------


def fp8_block_tile_exponent(e: torch.Tensor) -> torch.Tensor:
    """t = max(max e - 6, -127) per 128x128 tile of block exponents e [N, K/32] -> [N/128, K/128]."""
    n, kb = e.shape
    per = fp8_block.BLOCK // mxfp4.BLOCK  # 4 MXFP4 blocks across one tile
    tiles = e.reshape(n // fp8_block.BLOCK, fp8_block.BLOCK, kb // per, per)
    return (tiles.amax(dim=(1, 3)) - FP8_TILE_SHIFT).clamp(min=-127)


def fp8_block_weight(w: torch.Tensor, direct: bool) -> FP8BlockData:
    """FP8 128x128 bytes of the projected weight (host quantizer, or per-tile exponent folding)."""
    spec = FP8BlockSpec("128x128")
    if not direct:
        return fp8_block.quantize(project(w), spec)
    fp8_block.check_shape(w.shape, spec)
    codes, e = mxfp4.decompose(w)
    t = fp8_block_tile_exponent(e)
    t_el = t.repeat_interleave(fp8_block.BLOCK, 0).repeat_interleave(4, 1)  # [N, K/32]
    # q * 2**(e - t): below 2**-30 every |q| <= 6 rounds to (signed) zero in E4M3 anyway, so
    # clamping the shift there keeps pow2_f32 in range without changing a byte.
    shift = (e - t_el).clamp(min=-30)
    folded = (_q_values(codes) * pow2_f32(shift)[..., None]).reshape(w.shape)
    bad = _nonfinite_blocks(w).reshape(t.shape[0], fp8_block.BLOCK, t.shape[1], 4).any(dim=(1, 3))
    bad_el = bad.repeat_interleave(fp8_block.BLOCK, 0).repeat_interleave(fp8_block.BLOCK, 1)
    payload = e4m3(folded.masked_fill(bad_el, float("nan")))
    return FP8BlockData(payload, pow2_f32(t).masked_fill(bad, float("nan")))
