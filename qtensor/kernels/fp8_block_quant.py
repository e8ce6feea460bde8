"""FP8 1x128 block quantization on the GPU (Triton): the bytes of qtensor/formats/fp8_block.py.

One program quantizes a group of whole blocks: BR rows of one 128-element block along the last
dim (rowwise), or one 128-row block of BC columns (columnwise). Per block, exactly as the
reference ([Note: FP8 block scale] there; docs/formats.md):
- amax: the largest |x| as the largest magnitude bit pattern (non-negative fp32 values order as
  their bits); a block holding Inf or NaN is non-finite;
- code: the RCEIL rule on y = r(amax * r(1/448)), formed in fp64 (exact) and rounded once to
  fp32, so no flush of a subnormal product can change it: the biased exponent of y plus one
  when its mantissa is not zero, at most 254; 0 for an all-zero block; 255 (NaN scale) for a
  non-finite one;
- data: e4m3(x * 2**(127 - code)), clamped to +-448 and rounded to nearest even; a product that
  would be an fp32 subnormal lands on +-0 in E4M3 whether or not it was flushed. A non-finite
  block's bytes are all 0x7F (NaN), as the reference's NaN scale makes them on the GPU;
- scale: fp32 2**(code - 127) (the subnormal 2**-127 for code 0), NaN for code 255.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qtensor.formats import fp8_block, mxfp8

BLOCK = fp8_block.BLOCK


@triton.jit
def _pow2(e):
    """Exact fp32 2**e for int32 e in [-127, 127]."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, tl.full(e.shape, 0x00400000, tl.int32).to(
        tl.float32, bitcast=True))


@triton.jit
def _encode(x, recip, AXIS: tl.constexpr):
    """(uint8 E4M3 bytes of x, fp32 scale per block) with blocks along AXIS of fp32 x."""
    mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nonfinite = tl.max((mag >= 0x7F800000).to(tl.int32), axis=AXIS) > 0
    amax_bits = tl.max(mag, axis=AXIS)
    y = (amax_bits.to(tl.float32, bitcast=True).to(tl.float64) * recip).to(tl.float32)
    yb = y.to(tl.int32, bitcast=True)
    code = ((yb >> 23) & 0xFF) + ((yb & 0x7FFFFF) != 0).to(tl.int32)
    code = tl.minimum(code, 254)
    code = tl.where(amax_bits == 0, 0, code)
    inv = tl.expand_dims(_pow2(127 - code), AXIS)
    v = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    q = tl.where(tl.expand_dims(nonfinite, AXIS), 0x7F, q).to(tl.uint8)
    nan = tl.full(code.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(nonfinite, nan, _pow2(code - 127))
    return q, scale


@triton.jit
def _rows_kernel(x_ptr, q_ptr, s_ptr, R, x_r, q_r, s_r, recip, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    blk = tl.program_id(1)
    cols = blk * 128 + tl.arange(0, 128)
    rmask = rows < R
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_r + cols[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    q, scale = _encode(x, recip, 1)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * q_r + cols[None, :], q, mask=rmask[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * s_r + blk, scale, mask=rmask)


@triton.jit
def _cols_kernel(x_ptr, q_ptr, s_ptr, C, x_r, q_r, s_r, recip, BC: tl.constexpr):
    blk = tl.program_id(0)
    rows = blk * 128 + tl.arange(0, 128)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    offs = rows[:, None].to(tl.int64) * x_r + cols[None, :]
    x = tl.load(x_ptr + offs, mask=cmask[None, :], other=0.0).to(tl.float32)
    q, scale = _encode(x, recip, 0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * q_r + cols[None, :], q, mask=cmask[None, :])
    tl.store(s_ptr + blk * s_r + cols, scale, mask=cmask)


def quantize(x: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data in x's shape, fp32 scales) of a CUDA tensor x with 1x128 blocks along its last
    dim ([..., K/128] scales) or, columnwise, along dim 0 of a 2-D x ([M/128, K] scales). The
    caller has checked the shape (fp8_block.check_shape)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, cols = x2.shape
    q = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    if columnwise:
        s = torch.empty((rows // BLOCK, cols), dtype=torch.float32, device=x.device)
        bc = 64
        _cols_kernel[(rows // BLOCK, triton.cdiv(cols, bc))](
            x2, q, s, cols, x2.stride(0), q.stride(0), s.stride(0), mxfp8.RECIP_448, BC=bc,
            num_warps=8)
    else:
        s = torch.empty((rows, cols // BLOCK), dtype=torch.float32, device=x.device)
        br = 32
        _rows_kernel[(triton.cdiv(rows, br), cols // BLOCK)](
            x2, q, s, rows, x2.stride(0), q.stride(0), s.stride(0), mxfp8.RECIP_448, BR=br,
            num_warps=4)
    q = q.view(torch.float8_e4m3fn).reshape(x.shape)
    return q, (s if columnwise else s.reshape(*x.shape[:-1], cols // BLOCK))
