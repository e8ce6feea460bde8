// Cheaper forms of the NVFP4 element math for the rowwise kernels (quant_rows_cuda.cu), valid on
// a stated domain where they equal the general functions of quant_math.h bit for bit. They are
// __host__ __device__ so a host program can compare them with those functions exhaustively
// (every non-NaN fp32 pattern for the E2M1 code; every E4M3 scale for the 4over6 values).
#pragma once

#include "quant_math.h"

namespace qtensor {

// E2M1 code (0..7) of a non-negative, non-NaN fp32 given by its bits b: equals
// e2m1_code_bits(b) on all 2**31 - 2**23 + 1 such patterns (checked exhaustively), in 7
// instructions on the GPU (min, shift-add, max, lea, imad, fadd, iadd). Clamping b at 6.0 first
// saturates (inf included). Below 2 the grid step is 0.5, in [2, 4) it is 1, in [4, 6] 2: adding
// magic = 2**(22 + idx) (idx 0, 1, 2 by the binade, from the exponent) rounds to that step
// nearest-even in one fp32 add, and the number of steps above magic, plus 2 idx, is the code
// (0.5 steps below 2 count codes 0..4; 2 + 1 -> 5, 4 + 2 -> 6 + ...).
QT_HD uint32_t e2m1_code_nonan(uint32_t b) {
  b = b < 0x40C00000u ? b : 0x40C00000u;
  const int e = static_cast<int>(b >> 23) - 127;
  const uint32_t idx = e > 0 ? static_cast<uint32_t>(e) : 0u;
  const uint32_t magic = 0x4A800000u + (idx << 23);
  const uint32_t base = 0x4A800000u + idx * 0x7FFFFEu;  // magic - 2 idx
  return f2u(u2f(b) + u2f(magic)) - base;
}

// The same code from three fused multiply-adds. The grids of the three binades index a as
// 2a (step 0.5 in [0, 2)), a + 2 (step 1 in [2, 4)) and a / 2 + 4 (step 2 in [4, 6]); the code is
// the lower envelope of the three, each rounded nearest-even by one fused add to 2**23 + o (o
// even, so the tie rule sees the index's own parity), capped at 7 (saturation, inf included).
// Equal to e2m1_code_bits on the same patterns (checked exhaustively by check_lanes). On the GPU
// the three FMAs run on the FP32 pipe, which the NVFP4 kernels leave mostly idle, in place of
// four integer instructions on the integer pipe, which issues at half the rate and bounds them.
// The envelope's bits, 2**23 + the code before the cap.
QT_HD uint32_t e2m1_envelope(float a) {
  const uint32_t c1 = f2u(fmaf(a, 2.f, 0x1p23f));
  const uint32_t c2 = f2u(fmaf(a, 1.f, 0x1p23f + 2.f));
  const uint32_t c3 = f2u(fmaf(a, 0.5f, 0x1p23f + 4.f));
  const uint32_t m = c1 < c2 ? c1 : c2;
  return m < c3 ? m : c3;
}
QT_HD uint32_t e2m1_code_fma(float a) {
  const uint32_t m = e2m1_envelope(a);
  return (m < 0x4B000007u ? m : 0x4B000007u) - 0x4B000000u;
}

// e2m1_code_fma for 0 <= a <= 6.5 without the cap: there a / 2 + 4 <= 7.25 rounds to at most 7,
// so the envelope never exceeds code 7 (checked on every such pattern by check_lanes).
QT_HD uint32_t e2m1_code_fma_small(float a) { return e2m1_envelope(a) - 0x4B000000u; }

// The E2M1 code of a non-negative, non-NaN product a in the kernels' fast paths: the FMA form on
// the GPU, the integer form on the CPU (where fmaf without hardware FMA is a library call).
// SMALL: the caller has shown a <= 6.5, and the GPU form drops its cap.
template <bool SMALL = false>
QT_HD uint32_t e2m1_code_fast(float a) {
#if defined(__CUDA_ARCH__)
  return SMALL ? e2m1_code_fma_small(a) : e2m1_code_fma(a);
#else
  return e2m1_code_nonan(f2u(a));
#endif
}

// The 4over6 error of one candidate needs |value(c)| * sf * A / 6B, rounded as the reference:
// r(r(value(c) * sf * A) / 6B) (value(c) * sf is exact: at most 2 + 4 significant bits). As
// value(c) = 2**k q with q in {1, 1.5}, that is 2**k r(r(q sf A) / 6B) while nothing
// underflows or overflows, so two divisions per candidate replace sixteen. Fo6Values holds the
// bits for the code c: (c << 22) + e[c & 1] for c >= 2, e0 for c = 1 (half of V_1), 0 for 0.
struct Fo6Values {
  uint32_t e0, e1;
};

// The domain where the exponent shift is exact: A in [2**-60, 2**60] and sf in [2**-9, 448]
// put every r(q sf A) / 6B and its 2**k multiples (k in -1..2) far inside the normal range.
// A NaN fails the comparisons. Outside it the caller computes the general way.
QT_HD bool fo6_fast_domain(float amax, float sf) {
  return amax >= 0x1p-60f && amax <= 0x1p60f && sf >= 0x1p-9f && sf <= 448.f;
}

QT_HD Fo6Values fo6_values(float sf, float amax, float six_b) {
  const float v1 = (sf * amax) / six_b;            // q = 1
  const float v15 = ((1.5f * sf) * amax) / six_b;  // q = 1.5: 1.5 sf is exact
  // c = 2 + 2j + m has value 2**j (1 + m/2): bits(V_m) + j << 23 = (c << 22) + bits(V_m) - (2 + m) << 22.
  return Fo6Values{f2u(v1) - (2u << 22), f2u(v15) - (3u << 22)};
}

QT_HD float fo6_value(uint32_t c, const Fo6Values& t) {
  const uint32_t big = (c << 22) + ((c & 1u) ? t.e1 : t.e0);
  return u2f(c >= 2u ? big : (c == 1u ? t.e0 : 0u));
}

// ---- whole blocks (the rowwise kernels call these; a host program checks them against the
// tile kernel's per-block code) --------------------------------------------------------------------

QT_HD uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

struct Codes {  // 16 E2M1 nibbles, element 2j in the low nibble of byte j
  uint32_t x, y;
};

// max |v| as fp32: non-negative floats order like their bits and NaN's bits lie above inf, so an
// integer max is torch.amax on the values (a NaN block gives a NaN; its payload is not contract).
QT_HD float absmax16(const float* v) {
  uint32_t m = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = umax(m, f2u(v[i]) & 0x7FFFFFFFu);
  return u2f(m);
}

// Sign bits of 16 elements at bit 3 of their nibbles (the E2M1 sign), two words of 8.
// Elements i and i + 4 of each half share one shift: their sign bits, gathered at bits 15 and
// 31, move to 4i + 3 and 4i + 19 (disjoint bits: the adds are ors).
QT_HD Codes sign_nibbles(const float* v) {
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t pair = ((f2u(v[8 * h + i]) >> 16) & 0x8000u) | (f2u(v[8 * h + i + 4]) & 0x80000000u);
      w[h] += pair >> (12 - 4 * i);
    }
  }
  return Codes{w[0], w[1]};
}

// prmt.b32 in its default mode: byte i of the result is byte (n & 7) of the pair (b:a), n the
// i-th selector nibble, or that byte's sign bit copied to all 8 bits when n & 8.
QT_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t x = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0u;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (sel >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(x >> (8 * (n & 7u))) & 0xFFu;
    if (n & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

// sign_nibbles of 16 bf16 or fp16 elements from their packed words, element 2k in the low half
// of w[k]: element 2k's sign is the top bit of byte 1 of w[k], element 2k + 1's of byte 3. For
// each code word, two permutes spread those bytes' signs into byte masks (elements 0, 2, 1, 3
// and 4, 6, 5, 7), two more gather the even and the odd elements, and bit 3 / bit 7 of each byte
// is kept: 4 permutes and 2 masks a word instead of two shifts and a merge per element pair.
QT_HD Codes sign_nibbles_packed(const uint32_t* w) {
  uint32_t out[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = prmt(w[4 * h], w[4 * h + 1], 0xFBD9u), hi = prmt(w[4 * h + 2], w[4 * h + 3], 0xFBD9u);
    out[h] = (prmt(lo, hi, 0x5410u) & 0x08080808u) | (prmt(lo, hi, 0x7632u) & 0x80808080u);
  }
  return Codes{out[0], out[1]};
}

// sign_nibbles of two 16-element runs held as packed bf16 or fp16 pairs, run 0 in the low halves
// of w[0..15] and run 1 in the high halves (two columns of a tile): element i of run r has its
// sign at bit 15 + 16 r of w[i]. For each half of the runs, four permutes spread the signs of
// elements 0, 2 | 4, 6 and 1, 3 | 5, 7 of both runs into byte masks, four more gather each run's
// even and odd elements, and bit 3 / bit 7 of each byte is kept: 12 instructions for 16 elements.
QT_HD void sign_nibbles_cols(const uint32_t* w, Codes* run0, Codes* run1) {
  uint32_t out[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t* p = w + 8 * h;
    const uint32_t e0 = prmt(p[0], p[2], 0xFBD9u), e1 = prmt(p[4], p[6], 0xFBD9u);
    const uint32_t o0 = prmt(p[1], p[3], 0xFBD9u), o1 = prmt(p[5], p[7], 0xFBD9u);
    out[0][h] = (prmt(e0, e1, 0x5410u) & 0x08080808u) | (prmt(o0, o1, 0x5410u) & 0x80808080u);
    out[1][h] = (prmt(e0, e1, 0x7632u) & 0x08080808u) | (prmt(o0, o1, 0x7632u) & 0x80808080u);
  }
  *run0 = Codes{out[0][0], out[0][1]};
  *run1 = Codes{out[1][0], out[1][1]};
}

// Codes of one block at the block factor enc, as e2m1_encode(v * enc). Where no product can be
// NaN (no NaN input, 0 < enc <= FLT_MAX), |v * enc| = |v| * enc and its sign is v's, so the
// NaN-free code (equal to e2m1_code_bits on every non-NaN pattern, checked exhaustively) and v's
// sign bits give the same nibbles; otherwise the general encoder runs. Codes and signs occupy
// disjoint bits, so each code is added onto the sign word: one shift-and-add per element.
// Every product is at most r(bam * enc) (rounding is monotone), which is at most 6.5 for any block
// whose scale byte is a normal E4M3 number (about 6 / (1 - 2**-4)): such blocks take the code
// without its cap; a subnormal scale (or an encode scale at FLT_MAX) keeps the cap.
template <bool SMALL>
QT_HD Codes nv_codes_nonan(const float* v, Codes w, float enc) {
#pragma unroll
  for (int i = 0; i < 8; ++i) w.x += e2m1_code_fast<SMALL>(fabsf(v[i]) * enc) << (4 * i);
#pragma unroll
  for (int i = 0; i < 8; ++i) w.y += e2m1_code_fast<SMALL>(fabsf(v[i + 8]) * enc) << (4 * i);
  return w;
}
// `signs` is sign_nibbles(v), which the caller may have formed from packed words.
QT_HD Codes nv_codes(const float* v, Codes signs, float bam, float enc) {
  if (f2u(bam) <= 0x7F800000u && enc > 0.f)
    return bam * enc <= 6.5f ? nv_codes_nonan<true>(v, signs, enc) : nv_codes_nonan<false>(v, signs, enc);
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i >> 3] |= e2m1_encode(v[i] * enc) << (4 * (i & 7));
  return Codes{w[0], w[1]};
}
QT_HD Codes nv_codes(const float* v, float bam, float enc) { return nv_codes(v, sign_nibbles(v), bam, enc); }

// ---- stochastic rounding in fewer instructions ------------------------------------------------

// The counter hash of a block's 16 elements at once. Their counters are c0 + i with c0 a multiple
// of 16, so their four hash inputs are k0 + g = k0 | g (k0 = c0 >> 2, a multiple of 4, g < 4),
// and y = (k0 | g) ^ key differs between them only in bits 0..1: the first step of mix32,
// y ^ (y >> 16), is then z ^ g with z = sr_block_key(key, c0).
QT_HD uint32_t sr_block_key(uint32_t key, uint32_t c0) {
  const uint32_t y = (c0 >> 2) ^ key;
  return y ^ (y >> 16);
}

// The rest of mix32 on x = z ^ g: the hash whose bytes are the random bits of elements 4g..4g+3.
// sr_group_hash(sr_block_key(key, c0) ^ g) >> 8j & 0xFF == sr_bits(key, c0 + 4g + j) (checked by
// check_lanes).
QT_HD uint32_t sr_group_hash(uint32_t x) {
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x1B873593u;
  return x ^ (x >> 16);
}

// Two fp32 values to packed fp16 bits rounded toward zero (lo in the low half), for lo, hi >= 0 and
// not NaN: one conversion on the GPU. The host form is that conversion's arithmetic: from 2**-14 up
// the top 10 mantissa bits under the exponent rebiased, below it the integer part of x * 2**24
// (fp16's subnormals), past the largest finite 65504 (toward zero) 0x7BFF, inf 0x7C00.
QT_HD uint32_t f16x2_rz(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  const auto one = [](float x) -> uint32_t {
    const uint32_t b = f2u(x);
    if (b >= 0x7F800000u) return 0x7C00u;
    if (b >= 0x47800000u) return 0x7BFFu;
    if (b >= 0x38800000u) return (b >> 13) - (112u << 10);
    const uint32_t e = b >> 23;
    return e < 103u ? 0u : ((b & 0x7FFFFFu) | 0x800000u) >> (126u - e);
  };
  return one(lo) | (one(hi) << 16);
#endif
}

// Per 16-bit half, the unsigned min (one instruction on sm_90).
QT_HD uint32_t min_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vminu2(a, b);
#else
  const uint32_t alo = a & 0xFFFFu, blo = b & 0xFFFFu, ahi = a >> 16, bhi = b >> 16;
  return (alo < blo ? alo : blo) | ((ahi < bhi ? ahi : bhi) << 16);
#endif
}

// The E2M1 grid as fp16 positions. Read as an integer, the fp16 bit pattern of a * 2**-14 is a
// linear position on each stretch of the grid: below 2 (a * 2**-14 below 2**-13: fp16's
// subnormals and its first binade, one fixed point) it is 1024 a, on [2, 4) 2048 + 512 (a - 2),
// on [4, 8) 3072 + 256 (a - 4). Every grid point is then a multiple of 512 (code k at 512 k:
// 0.5 -> 512, 2 -> 2048, 6 -> 3584) and every grid step 512 units wide. Rounding toward zero
// gives the integer part of the position, and stochastic rounding's step up (|v| - g >=
// (1 - u) step, u = r8 / 256) is floor(position) + 2 r8 >= the next multiple of 512: both
// sides are integers. So the code is (floor(position) + 2 r8) >> 9, capped at 4095 (code 7:
// 6 and up), with no float comparison: one conversion for two elements, an add and a min per
// pair. fp16's largest finite (past which rounding toward zero stays) and inf are above the cap,
// and a position plus 2 r8 stays below 2**15, so the two halves of a word never carry into each
// other.
// The kernel scales the product itself: |v| * (enc * 2**-14) is r(|v| enc) * 2**-14 exactly
// whenever enc * 2**-14 is a normal float (enc >= 2**-112) and the result is too; a result below
// that (|v| enc below 2**-112) has position 0 either way, as does every a below 2**-9 with any r8.

// The positions of a0 and a1 (a * 2**-14 each, a0 in the low half) plus 2 r8 each (r2 holds each
// half's r8), capped at 4095: each half's code at its bits 9..11, zeros above.
QT_HD uint32_t sr_positions(float a0, float a1, uint32_t r2) {
  return min_u16x2(f16x2_rz(a0, a1) + r2 + r2, 0x0FFF0FFFu);
}

// Stochastic-rounding codes of one block, e2m1_encode_sr(v[i] * enc, sr_bits(key, c0 + i)), where
// no product can be NaN (no NaN input, 2**-112 <= enc <= FLT_MAX) and c0 % 16 == 0: the product's
// sign is v's, so the sign nibbles (`signs`, sign_nibbles(v)) come from v and the codes are or-ed
// onto them. Group g's hash holds the random bytes of elements 4g..4g+3; elements 4g and 4g + 2
// share a word (the hash's bytes 0 and 2, by one permute, zeros between), 4g + 1 and 4g + 3
// another (bytes 1 and 3). A code word then gathers byte 1 of each half (the code at its bits 1..3)
// from two words of even elements and two of odd ones, and shifts and masks them into nibbles.
QT_HD Codes nv_codes_sr(const float* v, Codes signs, float enc, uint32_t key, uint32_t c0) {
  const float e = enc * 0x1p-14f;
  const uint32_t z = sr_block_key(key, c0);
  uint32_t even[4], odd[4];  // sr_positions of group g's (4g, 4g + 2) and (4g + 1, 4g + 3)
#pragma unroll
  for (uint32_t g = 0; g < 4; ++g) {
    const uint32_t h = sr_group_hash(z ^ g);
    const uint32_t r02 = prmt(h, 0u, 0x4240u), r13 = prmt(h, 0u, 0x4341u);
    const float* b = v + 4 * g;
    even[g] = sr_positions(fabsf(b[0]) * e, fabsf(b[2]) * e, r02);
    odd[g] = sr_positions(fabsf(b[1]) * e, fabsf(b[3]) * e, r13);
  }
  uint32_t words[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t y = prmt(even[2 * k], even[2 * k + 1], 0x7531u);  // elements 0, 2, 4, 6 of the word
    const uint32_t o = prmt(odd[2 * k], odd[2 * k + 1], 0x7531u);    // elements 1, 3, 5, 7
    words[k] = (k ? signs.y : signs.x) | ((y >> 1) & 0x07070707u) | ((o << 3) & 0x70707070u);
  }
  return Codes{words[0], words[1]};
}

// 4over6 error of candidate scale s and its codes, the general way (any amax, any scale): the
// tile kernel's candidate() with the reference's true division by 6B.
template <bool MSE>
QT_HD float fo6_error_general(const float* v, uint8_t s, const NvScale& ts, float six_b, Codes* codes) {
  const float enc = nv_block_enc(s, ts.s_dec);
  const float sf = e4m3_scale_value(s);
  float err = 0.f;
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float p = v[i] * enc;
    const float r = e2m1_round_abs(abs_f(p));
    const unsigned sg = e2m1_sign(p);
    w[i >> 3] |= (e2m1_code_abs(r) | (sg << 3)) << (4 * (i & 7));
    float val = ((r * sf) * ts.amax) / six_b;
    if (sg) val = -val;
    const float d = val - v[i];
    err = err + (MSE ? d * d : abs_f(d));
  }
  *codes = Codes{w[0], w[1]};
  return err;
}

// The same in fo6_fast_domain with a finite block: there enc > 0, so v * enc is never NaN and
// its sign is v's; then val - v = sign(v) (|val| - |v|) exactly, and |d| and d * d only see
// |val| - |v|. |val| comes from the code by an exponent shift (fo6_value, checked for every
// scale byte). The sum runs element 0..15 like the reference. Codes without sign bits. bam is
// max |v[i]|: where r(bam * enc) <= 6.5 the codes skip their cap (as in nv_codes).
template <bool MSE, bool SMALL>
QT_HD float fo6_error_fast_at(const float* v, float enc, const Fo6Values& t, Codes* codes) {
  float err = 0.f;
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float a = fabsf(v[i]);
    const uint32_t c = e2m1_code_fast<SMALL>(a * enc);
    w[i >> 3] += c << (4 * (i & 7));  // codes 0..7 in disjoint nibbles: + is |, one shift-and-add
    const float d = fo6_value(c, t) - a;
    err = err + (MSE ? d * d : fabsf(d));
  }
  *codes = Codes{w[0], w[1]};
  return err;
}
template <bool MSE>
QT_HD float fo6_error_fast(const float* v, float bam, float sf, const NvScale& ts, float six_b,
                           Codes* codes) {
  const float enc = clamp_max(1.f / (sf * ts.s_dec), FLT_MAX);  // nv_block_enc of sf's byte
  const Fo6Values t = fo6_values(sf, ts.amax, six_b);
  return bam * enc <= 6.5f ? fo6_error_fast_at<MSE, true>(v, enc, t, codes)
                           : fo6_error_fast_at<MSE, false>(v, enc, t, codes);
}

// ---- 4over6 with value tables (the CUDA kernels' form) ----------------------------------------

// r(b / 6) for b = 0 and 2**-125 <= b <= FLT_MAX: the product with r(1/6), then one fused
// correction by the remainder b - 6q (exact there). Equal to the division on every such pattern
// (check_lanes); below 2**-125 the remainder can round, and the callers divide.
QT_HD float div6(float b) {
  const float q = b * recip6();
  return fmaf(fmaf(-q, 6.f, b), recip6(), q);
}

// fourover6_candidates for a block amax in [2**-125, FLT_MAX] (div6's domain).
QT_HD void fourover6_candidates_fast(float b_amax, const NvScale& ts, uint8_t* s6, uint8_t* s4) {
  const float base = div6(b_amax) * ts.s_enc;
  *s6 = e4m3_scale_bits(clamp_max(base, 448.f));
  *s4 = e4m3_scale_bits(clamp_max(1.5f * base, 448.f));
}

// The envelope's bits (2**23 + code) for 0 <= a <= 4.5 from the two lower grids alone: from 4 to
// 4.5, a + 2 already rounds to 6 (4.5 is a tie, to even). Equal to e2m1_code_bits on every such
// pattern (check_lanes). The map-to-4 candidate of a block with a normal scale byte keeps its
// products below 4 (1 + 2**-4) and takes this form.
QT_HD uint32_t e2m1_envelope_low(float a) {
  const uint32_t c1 = f2u(fmaf(a, 2.f, 0x1p23f));
  const uint32_t c2 = f2u(fmaf(a, 1.f, 0x1p23f + 2.f));
  return c1 < c2 ? c1 : c2;
}

// Envelope bits of a product a >= 0 (not NaN): SMALL (a <= 6.5, or 4.5 with LOW) without the cap,
// else capped at code 7 as e2m1_code_fma.
template <bool SMALL, bool LOW>
QT_HD uint32_t e2m1_code_bits_fma(float a) {
  if constexpr (SMALL && LOW) return e2m1_envelope_low(a);
  const uint32_t m = e2m1_envelope(a);
  if constexpr (SMALL) return m;
  return m < 0x4B000007u ? m : 0x4B000007u;
}

// A thread's value table of one 4over6 candidate: entry c (at col[c * STRIDE]) is |value| of code
// c, fo6_value(c, t). Kept in shared memory, one column per thread (a warp's lanes in distinct
// banks), so that each element looks its value up in one load instead of selecting it. Entry 0
// is 0 for every candidate: the owner writes it once (fo6_zero), each fill writes codes 1..7.
QT_HD void fo6_zero(float* col) {
  col[0] = 0.f;
}
template <int STRIDE>
QT_HD void fo6_fill(float* col, const Fo6Values& t) {
#pragma unroll
  for (uint32_t c = 1; c < 8u; ++c) col[c * STRIDE] = fo6_value(c, t);
}

// Entry c of a table, addressed by the envelope bits m = 2**23 + c: (m - 2**23 bits) * STRIDE.
template <int STRIDE>
QT_HD float fo6_lookup(const float* col, uint32_t m) {
  return col[static_cast<uint32_t>(m - 0x4B000000u) * STRIDE];
}

struct Fo6Pair {  // both candidates of one 16-value row: errors and codes (no sign bits)
  float e6, e4;
  Codes c6, c4;
};

// Both candidates' errors and codes on one row of a block, from their block factors and value
// tables: fo6_error_fast_at for each, with the value looked up. SMALL: r(bam * enc6) <= 6.5 and
// r(bam * enc4) <= 4.5, so every product is too (rounding is monotone) and the codes skip their
// cap and, for map-to-4, the top grid; else both take the capped code.
template <bool MSE, bool SMALL, int STRIDE>
QT_HD Fo6Pair fo6_row_tab(const float* v, float enc6, float enc4, const float* col6, const float* col4) {
  Fo6Pair r{0.f, 0.f, {0u, 0u}, {0u, 0u}};
  unsigned w6[2] = {0u, 0u}, w4[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float a = fabsf(v[i]);
    const uint32_t m6 = e2m1_code_bits_fma<SMALL, false>(a * enc6);
    const uint32_t m4 = e2m1_code_bits_fma<SMALL, true>(a * enc4);
    w6[i >> 3] += (m6 - 0x4B000000u) << (4 * (i & 7));
    w4[i >> 3] += (m4 - 0x4B000000u) << (4 * (i & 7));
    const float d6 = fo6_lookup<STRIDE>(col6, m6) - a, d4 = fo6_lookup<STRIDE>(col4, m4) - a;
    r.e6 = r.e6 + (MSE ? d6 * d6 : fabsf(d6));
    r.e4 = r.e4 + (MSE ? d4 * d4 : fabsf(d4));
  }
  r.c6 = Codes{w6[0], w6[1]};
  r.c4 = Codes{w4[0], w4[1]};
  return r;
}

// What the 4over6 kernels keep per scale byte under one tensor scale: the block factor and the
// candidate values; e0 == 0 marks a byte outside fo6_fast_domain (its blocks go the general way).
struct alignas(16) Fo6Byte {
  float enc;
  Fo6Values t;
};

QT_HD Fo6Byte fo6_byte(uint8_t s, const NvScale& ts, float six_b) {
  const float sf = e4m3_scale_value(s);
  if (!fo6_fast_domain(ts.amax, sf)) return Fo6Byte{nv_block_enc(s, ts.s_dec), Fo6Values{0u, 0u}};
  return Fo6Byte{nv_block_enc(s, ts.s_dec), fo6_values(sf, ts.amax, six_b)};
}

// True on every lane of the warp that takes part (on the host: the lane's own value). The
// choice it feeds is between two exact forms, so a partial warp only costs time.
QT_HD bool warp_all(bool p) {
#if defined(__CUDA_ARCH__)
  return __all_sync(__activemask(), p);
#else
  return p;
#endif
}

// One 4over6 block: both candidates, map-to-4 where its error is strictly lower (ties and NaN
// errors keep map-to-6). Equal candidate bytes give equal errors, so the map-to-6 codes directly.
template <bool MSE>
QT_HD uint8_t fo6_block(const float* v, float bam, const NvScale& ts, float six_b, Codes* codes) {
  uint8_t s6, s4;
  fourover6_candidates(bam, ts, &s6, &s4);
  if (s6 == s4) {
    *codes = nv_codes(v, bam, nv_block_enc(s6, ts.s_dec));
    return s6;
  }
  const float sf6 = e4m3_scale_value(s6), sf4 = e4m3_scale_value(s4);
  Codes c6, c4;
  float e6, e4;
  if (f2u(bam) < 0x7F800000u && fo6_fast_domain(ts.amax, sf6) && fo6_fast_domain(ts.amax, sf4)) {
    e6 = fo6_error_fast<MSE>(v, bam, sf6, ts, six_b, &c6);
    e4 = fo6_error_fast<MSE>(v, bam, sf4, ts, six_b, &c4);
    const Codes sg = sign_nibbles(v);
    c6 = Codes{c6.x | sg.x, c6.y | sg.y};
    c4 = Codes{c4.x | sg.x, c4.y | sg.y};
  } else {
    e6 = fo6_error_general<MSE>(v, s6, ts, six_b, &c6);
    e4 = fo6_error_general<MSE>(v, s4, ts, six_b, &c4);
  }
  const bool map4 = e4 < e6;
  *codes = map4 ? c4 : c6;
  return map4 ? s4 : s6;
}

// The 4over6 error of candidate byte s on one row of a block, summed element 0..15 as the
// reference does, with its codes: the exponent-shift form where it is proven equal (a finite row,
// fo6_fast_domain), else the general one.
template <bool MSE>
QT_HD float fo6_row_error(const float* v, uint8_t s, const NvScale& ts, float six_b, Codes* codes) {
  const float sf = e4m3_scale_value(s), bam = absmax16(v);
  if (f2u(bam) < 0x7F800000u && fo6_fast_domain(ts.amax, sf)) {
    const float e = fo6_error_fast<MSE>(v, bam, sf, ts, six_b, codes);
    const Codes sg = sign_nibbles(v);
    *codes = Codes{codes->x | sg.x, codes->y | sg.y};
    return e;
  }
  return fo6_error_general<MSE>(v, s, ts, six_b, codes);
}

// The two 4over6 candidates of a block (or of a 16x16 tile, whose rows share them) with amax bam,
// and how its rows are evaluated: through the value tables where bam is in div6's domain and both
// bytes are in fo6_fast_domain (`tab`: the block factors and values come from `bytes`, fo6_byte
// of all 256 under ts, and this thread's columns col6 / col4 are filled here, once for all its
// rows), else by fo6_row_error. `small` is fo6_row_tab's form, chosen for the whole warp (its
// lanes that take the tables).
struct Fo6Cand {
  uint8_t s6, s4;
  bool tab, small;
  float enc6, enc4;
};

template <int STRIDE>
QT_HD Fo6Cand fo6_prepare(float bam, const NvScale& ts, const Fo6Byte* bytes, float* col6, float* col4) {
  Fo6Cand c{0u, 0u, false, false, 0.f, 0.f};
  bool small = true;
  const uint32_t bb = f2u(bam);
  if (bb >= 0x01000000u && bb < 0x7F800000u) {
    fourover6_candidates_fast(bam, ts, &c.s6, &c.s4);
    const Fo6Byte b6 = bytes[c.s6], b4 = bytes[c.s4];
    c.tab = b6.t.e0 != 0u && b4.t.e0 != 0u;
    if (c.tab) {
      fo6_fill<STRIDE>(col6, b6.t);
      fo6_fill<STRIDE>(col4, b4.t);
      c.enc6 = b6.enc;
      c.enc4 = b4.enc;
      small = bam * c.enc6 <= 6.5f && bam * c.enc4 <= 4.5f;
    }
  } else {
    fourover6_candidates(bam, ts, &c.s6, &c.s4);
  }
  c.small = warp_all(small);
  return c;
}

// The common case of a 4over6 block: both candidates through the value tables, in fo6_row_tab's
// small form. The kernels evaluate it in a loop of its own and leave the other cases (the capped
// form, the general evaluation, equal candidates) to fo6_pair or fo6_block_tab after it, so that
// the instructions their rows run stay contiguous instead of lying among the rare cases' (whose
// fetches otherwise stalled the kernels).
QT_HD bool fo6_common(const Fo6Cand& c) { return c.tab && c.small; }

// fo6_pair through the tables in the form SMALL.
template <bool MSE, bool SMALL, int STRIDE>
QT_HD Fo6Pair fo6_pair_tab(const Fo6Cand& c, const float* v, const float* col6, const float* col4,
                           const uint32_t* words16) {
  Fo6Pair r = fo6_row_tab<MSE, SMALL, STRIDE>(v, c.enc6, c.enc4, col6, col4);
  const Codes sg = words16 ? sign_nibbles_packed(words16) : sign_nibbles(v);
  r.c6 = Codes{r.c6.x | sg.x, r.c6.y | sg.y};
  r.c4 = Codes{r.c4.x | sg.x, r.c4.y | sg.y};
  return r;
}

// Both candidates' errors and signed codes on one 16-value row (words16: the row's packed 16-bit
// words, for the sign nibbles, or nullptr).
template <bool MSE, int STRIDE>
QT_HD Fo6Pair fo6_pair(const Fo6Cand& c, const float* v, const NvScale& ts, float six_b, const float* col6,
                       const float* col4, const uint32_t* words16 = nullptr) {
  Fo6Pair r;
  if (c.tab) {
    r = c.small ? fo6_pair_tab<MSE, true, STRIDE>(c, v, col6, col4, words16)
                : fo6_pair_tab<MSE, false, STRIDE>(c, v, col6, col4, words16);
  } else {
    r.e6 = fo6_row_error<MSE>(v, c.s6, ts, six_b, &r.c6);
    r.e4 = fo6_row_error<MSE>(v, c.s4, ts, six_b, &r.c4);
  }
  return r;
}

// Map-to-4 where its error is strictly lower (ties and NaN errors keep map-to-6).
QT_HD uint8_t fo6_choose(const Fo6Cand& c, const Fo6Pair& r, Codes* codes) {
  const bool map4 = r.e4 < r.e6;
  *codes = map4 ? r.c4 : r.c6;
  return map4 ? c.s4 : c.s6;
}

// fo6_block's bytes through fo6_prepare and fo6_pair: equal candidates take the plain codes,
// otherwise map-to-4 wins where its error is strictly lower.
template <bool MSE, int STRIDE>
QT_HD uint8_t fo6_block_tab(const float* v, float bam, const NvScale& ts, float six_b, const Fo6Byte* bytes,
                            float* col6, float* col4, Codes* codes, const uint32_t* words16 = nullptr) {
  const Fo6Cand c = fo6_prepare<STRIDE>(bam, ts, bytes, col6, col4);
  if (c.s6 == c.s4) {
    *codes = nv_codes(v, bam, bytes[c.s6].enc);
    return c.s6;
  }
  return fo6_choose(c, fo6_pair<MSE, STRIDE>(c, v, ts, six_b, col6, col4, words16), codes);
}

}  // namespace qtensor
