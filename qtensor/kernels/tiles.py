"""Device functions shared by the quantized GEMM kernels: exact decode, K loop, epilogue.

[Note: exact decode in registers]
A tile is loaded as packed codes and compact scales and decoded in registers to bf16 *unit
values* (docs/gemm.md), the same numbers the emulated reference multiplies in fp32:
- NVFP4: `value(q) * s_b`. The E2M1 code goes to fp16 bits by placing its sign at bit 15 and
  its 3 magnitude bits at bits 11..9, which reads as `value(q) * 2**-14` (code 1, the subnormal
  0.5, lands on fp16's subnormal 2**-15); the scale is multiplied by 2**14 to cancel it. The
  product has at most 6 significant bits and lies in [2**-10, 2688], so it is exact in bf16.
- MXFP8: `e4m3 * 2**(code - 127)`, exact in bf16 while the result stays a bf16 normal, i.e.
  for every block whose scale code is at least 10 (block amax >= 2**-108); below that the
  reference's fp32 keeps subnormal bits that bf16 drops.
- A high-precision operand must already be bf16 (it is multiplied as it is); that is also how
  large products run, on operands decoded to bf16 once by qgemm.decode_bf16.
Every product of two bf16 unit values is exact in fp32 and the tensor cores accumulate in fp32,
so the only difference from the reference is the order of the fp32 additions.

NVFP4 tiles are never interleaved back into element order: the low nibbles (even k) and the high
nibbles (odd k) of a byte tile are two half tiles, and the product is
`dot(a_even, b_even) + dot(a_odd, b_odd)`; a bf16 left operand is loaded as its even and odd
columns. A 16-element block is 8 bytes, so byte column j uses scale column j // 8.
"""

from __future__ import annotations

import triton
import triton.language as tl

HP: tl.constexpr = tl.constexpr(0)  # bf16 [R, K], multiplied as it is
NVFP4: tl.constexpr = tl.constexpr(1)  # packed E2M1 codes [R, K/2] + E4M3 scales [R, K/16]
MXFP8: tl.constexpr = tl.constexpr(2)  # E4M3 data [R, K] + UE8M0 codes (uint8) [R, K/32]


@triton.jit
def e2m1_times(codes, scale):
    """bf16 value(code) * scale for uint8 codes 0..15 and fp32 E4M3 scales (exact)."""
    c = codes.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    v = bits.to(tl.float16, bitcast=True).to(tl.float32)  # value(code) * 2**-14, exact
    return (v * (scale * 16384.0)).to(tl.bfloat16)


@triton.jit
def repeat_cols(s, R: tl.constexpr, C: tl.constexpr, REP: tl.constexpr):
    """[R, C] -> [R, C * REP], each column repeated REP times (a register broadcast)."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, C, REP)), (R, C * REP))


@triton.jit
def load_nvfp4(q_ptr, s_ptr, rows, rmask, kb0, k_end, s_r, s_k, ss_r, ss_k,
               R: tl.constexpr, BKH: tl.constexpr):
    """(even, odd) bf16 half tiles [R, BKH] of an NVFP4 operand from byte column kb0 on.

    The scales are loaded compact ([R, BKH / 8], one vector load per row) and repeated in
    registers, rather than gathered once per byte.
    """
    kb = kb0 + tl.arange(0, BKH)
    m = rmask[:, None] & (kb < k_end)[None, :]
    byte = tl.load(q_ptr + rows[:, None] * s_r + kb[None, :] * s_k, mask=m, other=0)
    kblk = kb0 // 8 + tl.arange(0, BKH // 8)
    ms = rmask[:, None] & (kblk < k_end // 8)[None, :]
    sc = tl.load(s_ptr + rows[:, None] * ss_r + kblk[None, :] * ss_k, mask=ms, other=0.0)
    sf = repeat_cols(sc.to(tl.float32), R, BKH // 8, 8)
    return e2m1_times(byte & 15, sf), e2m1_times(byte >> 4, sf)


@triton.jit
def ue8m0_value(code):
    """fp32 2**(code - 127) of int32 UE8M0 codes: 0 is 2**-127, 255 is NaN (docs/formats.md)."""
    v = (code << 23).to(tl.float32, bitcast=True)
    tiny = tl.full(code.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True)
    v = tl.where(code == 0, tiny, v)
    return tl.where(code == 255, float("nan"), v)


@triton.jit
def load_mxfp8(q_ptr, s_ptr, rows, rmask, k0, k_end, s_r, s_k, ss_r, ss_k,
               R: tl.constexpr, BK: tl.constexpr):
    """bf16 tile [R, BK] of an MXFP8 operand from element column k0 on (scales compact)."""
    k = k0 + tl.arange(0, BK)
    m = rmask[:, None] & (k < k_end)[None, :]
    q = tl.load(q_ptr + rows[:, None] * s_r + k[None, :] * s_k, mask=m, other=0.0)
    kblk = k0 // 32 + tl.arange(0, BK // 32)
    ms = rmask[:, None] & (kblk < k_end // 32)[None, :]
    code = tl.load(s_ptr + rows[:, None] * ss_r + kblk[None, :] * ss_k, mask=ms, other=127)
    scale = repeat_cols(ue8m0_value(code.to(tl.int32)), R, BK // 32, 32)
    return (q.to(tl.float32) * scale).to(tl.bfloat16)


@triton.jit
def mainloop(
    a_ptr, as_ptr, a_r, a_k, as_r, as_k, rows_a, amask,
    b_ptr, bs_ptr, b_r, b_k, bs_r, bs_k, rows_b, bmask,
    k_lo, k_hi,
    FMT_A: tl.constexpr, FMT_B: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """fp32 acc [BM, BN] = sum over k in [k_lo, k_hi) of A[rows_a, k] * B[rows_b, k]."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if FMT_B == NVFP4:
        kh_end = k_hi // 2
        for kk in range(k_lo // 2, kh_end, BK // 2):
            b_ev, b_od = load_nvfp4(b_ptr, bs_ptr, rows_b, bmask, kk, kh_end, b_r, b_k, bs_r,
                                    bs_k, BN, BK // 2)
            if FMT_A == NVFP4:
                a_ev, a_od = load_nvfp4(a_ptr, as_ptr, rows_a, amask, kk, kh_end, a_r, a_k,
                                        as_r, as_k, BM, BK // 2)
            else:
                # One contiguous load, split into even and odd columns in registers.
                k = 2 * kk + tl.arange(0, BK)
                m = amask[:, None] & (k < k_hi)[None, :]
                a = tl.load(a_ptr + rows_a[:, None] * a_r + k[None, :] * a_k, mask=m, other=0.0)
                a_ev, a_od = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            acc = tl.dot(a_ev, tl.trans(b_ev), acc)
            acc = tl.dot(a_od, tl.trans(b_od), acc)
    else:
        for kk in range(k_lo, k_hi, BK):
            if FMT_B == MXFP8:
                b = load_mxfp8(b_ptr, bs_ptr, rows_b, bmask, kk, k_hi, b_r, b_k, bs_r, bs_k,
                               BN, BK)
            else:
                k = kk + tl.arange(0, BK)
                m = bmask[:, None] & (k < k_hi)[None, :]
                b = tl.load(b_ptr + rows_b[:, None] * b_r + k[None, :] * b_k, mask=m, other=0.0)
            if FMT_A == MXFP8:
                a = load_mxfp8(a_ptr, as_ptr, rows_a, amask, kk, k_hi, a_r, a_k, as_r, as_k,
                               BM, BK)
            elif FMT_A == HP:
                k = kk + tl.arange(0, BK)
                m = amask[:, None] & (k < k_hi)[None, :]
                a = tl.load(a_ptr + rows_a[:, None] * a_r + k[None, :] * a_k, mask=m, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def epilogue(
    acc, rows, cols, rmask, cmask, left_ptr, left_r, inv, right_ptr, right_c, bias_ptr,
    LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """acc * left, then * amax_b[col], then + bias[col]: the reference's order, unfused.

    left is `inv` (LEFT == 1) or `amax_a[row] * inv` (LEFT == 2), both in fp32 as the reference
    forms them. Kernels run with enable_fp_fusion=False so no multiply and add fuse into an FMA.
    """
    if LEFT == 1:
        acc = acc * inv
    if LEFT == 2:
        amax = tl.load(left_ptr + rows * left_r, mask=rmask, other=0.0)
        acc = acc * (amax * inv)[:, None]
    if HAS_RIGHT:
        acc = acc * tl.load(right_ptr + cols * right_c, mask=cmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return acc
