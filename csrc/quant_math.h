// The per-element and per-block math of the formats (docs/formats.md), shared by the CPU and the
// CUDA kernels so both are the same code. Every function reproduces the reference in
// qtensor/formats bit for bit: fp32 operations in the reference's order, no contraction into FMA
// (the build passes -ffp-contract=off / --fmad=false), NaN handled the way torch handles it.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define QT_HD __host__ __device__ __forceinline__
#else
#define QT_HD inline
#endif

namespace qtensor {

constexpr int kNvBlock = 16;  // NVFP4 block (and 2D tile side)
constexpr int kMxBlock = 32;  // MXFP8 / MXFP4 block

QT_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

QT_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

QT_HD bool is_nan(float v) { return v != v; }
QT_HD float abs_f(float v) { return u2f(f2u(v) & 0x7FFFFFFFu); }
QT_HD uint32_t sign_bit(float v) { return f2u(v) >> 31; }
// torch.clamp(max=m): NaN passes through (fminf would drop it).
QT_HD float clamp_max(float v, float m) { return v > m ? m : v; }
// torch.amax: once a NaN is seen the max is NaN.
QT_HD float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

// r(1/6) (0x3E2AAAAB) and r(1/448) (0x3B124925), docs/formats.md, NVFP4 step 4 and "MXFP8".
QT_HD float recip6() { return u2f(0x3E2AAAABu); }
QT_HD float recip448() { return u2f(0x3B124925u); }

// ---- element codecs --------------------------------------------------------------------------

// v.clamp(-448, 448).to(float8_e4m3fn): c10's round-to-nearest-even conversion, NaN keeps its
// sign (0x7F | sign), as torch does on either device.
QT_HD uint8_t e4m3_bits(float v) {
  v = v > 448.f ? 448.f : (v < -448.f ? -448.f : v);
  uint32_t b = f2u(v);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  uint8_t r;
  if (b >= (1087u << 20)) {
    r = 0x7F;
  } else if (b < (121u << 23)) {  // below 2**-6: E4M3 subnormal, rounded by an fp32 add
    const float t = u2f(b) + u2f(141u << 23);
    r = static_cast<uint8_t>(f2u(t) - (141u << 23));
  } else {
    const uint32_t odd = (b >> 20) & 1u;
    b += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + odd;
    r = static_cast<uint8_t>(b >> 20);
  }
  return r | static_cast<uint8_t>(sign >> 24);
}

// e4m3_bits of a scale that is not negative (or is NaN, whose byte may then be 0x7F or 0xFF,
// both NaN): on the GPU the satfinite nearest-even conversion, which is clamp-then-round, in one
// instruction instead of the integer rounding above.
QT_HD uint8_t e4m3_scale_bits(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(v));
  return static_cast<uint8_t>(r & 0xFFu);
#else
  return e4m3_bits(v);
#endif
}

QT_HD float e4m3_value(uint8_t b) {
  const uint32_t s = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
  if (e == 15u && m == 7u) return u2f(s | 0x7FC00000u);
  if (e == 0u) return u2f(s | f2u(static_cast<float>(m) * 0.001953125f));  // m * 2**-9
  return u2f(s | ((e + 120u) << 23) | (m << 20));
}

// e4m3_value in fewer instructions for the bytes a scale takes (non-negative, or NaN): a normal
// byte's fp32 bits are (b << 20) + (120 << 23); a subnormal one's value m 2**-9 is the same bits
// with exponent 121, minus 2**-6 (exact). Other bytes go the general way.
QT_HD float e4m3_scale_value(uint8_t b) {
  if (b >= 0x7Fu) return e4m3_value(b);
  const uint32_t u = static_cast<uint32_t>(b) << 20;
  return b < 8u ? u2f(u + (121u << 23)) - 0x1p-6f : u2f(u + (120u << 23));
}

// |v| rounded to nearest-even on the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6.
// (a + 2**(22+e)) - 2**(22+e) rounds a to the grid step of its binade (0.5 below 2, then 1, 2);
// NaN and inf become 8 first and saturate to 6 (the hardware's NaN rule: code 7).
QT_HD float e2m1_round_abs(float a) {
  a = a < 8.f ? a : 8.f;
  const uint32_t e = f2u(a) >> 23;
  const float magic = u2f(((e > 127u ? e : 127u) + 22u) << 23);
  const float r = (a + magic) - magic;
  return r < 6.f ? r : 6.f;
}

// Code (0..7) of a non-negative grid value.
QT_HD uint32_t e2m1_code_abs(float r) {
  return r < 2.f ? static_cast<uint32_t>(r * 2.f) : (f2u(r) >> 22) - 252u;
}

QT_HD float e2m1_value(uint32_t code) {
  const uint32_t c = code & 7u;
  const float a = c < 2u ? 0.5f * static_cast<float>(c) : u2f((((c >> 1) + 126u) << 23) | ((c & 1u) << 22));
  return (code & 8u) ? -a : a;
}

// Sign bit of the code: the input's sign, except NaN (code 7, as the hardware cast gives).
QT_HD uint32_t e2m1_sign(float v) { return is_nan(v) ? 0u : sign_bit(v); }

// Code of |v| from its bits (sign cleared), fewer instructions than rounding then coding: from 1
// up, nearest-even at mantissa bit 22 (1 mantissa bit, carries into the exponent), then
// saturate at code 7 (inf and NaN land there too); below 1 the grid step is 0.5: two compares.
QT_HD uint32_t e2m1_code_bits(uint32_t b) {
  const uint32_t hi = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u;
  const uint32_t lo = (b > 0x3E800000u ? 1u : 0u) + (b >= 0x3F400000u ? 1u : 0u);
  return b >= 0x3F800000u ? (hi < 7u ? hi : 7u) : lo;
}

QT_HD uint32_t e2m1_encode(float v) {
  const uint32_t b = f2u(v), a = b & 0x7FFFFFFFu;
  return e2m1_code_bits(a) | (a <= 0x7F800000u ? (b >> 31) << 3 : 0u);
}

// ---- stochastic rounding ---------------------------------------------------------------------

// The 8 random bits of element `index` (row-major index in the quantized matrix): with the counter
// c = (offset + index) mod 2**32, one 32-bit hash h = mix32((c >> 2) XOR mix32(seed mod 2**32))
// serves four consecutive counters, and c's low two bits pick its byte, (h >> 8 (c & 3)) & 0xFF.
// qtensor/formats/nvfp4.py sr_bits computes the same in torch. The multipliers are below 2**31 so
// the torch version's int64 products stay exact.
QT_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x1B873593u;
  x ^= x >> 16;
  return x;
}

// The hash of counter's group of four, and the byte of it that counter takes.
QT_HD uint32_t sr_group_bits(uint32_t key, uint32_t counter) { return mix32((counter >> 2) ^ key); }
QT_HD uint32_t sr_byte(uint32_t group_bits, uint32_t counter) { return (group_bits >> (8u * (counter & 3u))) & 0xFFu; }

QT_HD uint32_t sr_bits(uint32_t key, uint32_t counter) { return sr_byte(sr_group_bits(key, counter), counter); }

// u = r8 / 256. q is the grid point g at or below |v|, or the next one up, g + step(|v|), when
// |v| - g >= (1 - u) step(|v|): the floor onto the grid of t = |v| + u step(|v|) taken exactly,
// capped at 6. Sign kept; NaN gives code 7. From |v|'s bits, with no floor and no rounding:
// - From 1 up the step is the first mantissa bit of |v|'s binade (0.5 in [1, 2), 1 in [2, 4),
//   2 from 4), and the bits below it are |v| - g. Adding r8 << 14 adds exactly u step, and the
//   integer add carries into bit 22 (or into the exponent) exactly when |v| - g >= (1 - u) step.
//   The bits above 21 are then the code plus 252 (1 -> 254, 1.5 -> 255, ... 6 -> 259); from 8 up,
//   and for inf, they pass 259 and take the cap.
// - Below 1 the step is 0.5 and g is 0 or 0.5: the code counts the thresholds 0.5 - u / 2 and
//   1 - u / 2 that |v| reaches, both floats ((256 - r8) 2**-9 and (512 - r8) 2**-9).
QT_HD uint32_t e2m1_encode_sr(float v, uint32_t r8) {
  const uint32_t b = f2u(v) & 0x7FFFFFFFu;
  uint32_t code;
  if (b >= 0x3F800000u) {
    const uint32_t q = (b + (r8 << 14)) >> 22;
    code = (q < 259u ? q : 259u) - 252u;
  } else {
    const float a = u2f(b);
    code = (a >= static_cast<float>(256u - r8) * 0x1p-9f ? 1u : 0u) +
           (a >= static_cast<float>(512u - r8) * 0x1p-9f ? 1u : 0u);
  }
  if (is_nan(v)) return 7u;
  return code | (sign_bit(v) << 3);
}

// ---- random Hadamard transform ----------------------------------------------------------------

QT_HD float bf16_round(float f) {  // c10's float -> bfloat16, nearest-even, NaN -> 0x7FC0
  if (is_nan(f)) return u2f(0x7FC00000u);
  uint32_t u = f2u(f);
  u += ((u >> 16) & 1u) + 0x7FFFu;
  return u2f(u & 0xFFFF0000u);
}

constexpr uint32_t kRhtNegative = 0xD7E8u;  // bit i set where RHT_SIGNS[i] == -1

// d := d @ diag(s) H16 (the sign vector RHT_SIGNS, then the Sylvester butterfly), in the
// precision of F: the reference's fp64, or fp32 where the caller has shown the sums exact.
template <typename F>
QT_HD void signed_hadamard16(F* d) {
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if ((kRhtNegative >> i) & 1u) d[i] = -d[i];
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const F a = d[i], b = d[i + h];
      d[i] = a + b;
      d[i + h] = a - b;
    }
  }
}

// v := bf16(v @ diag(s) H16 / 4) on 16 values. The butterfly sums in fp64 like the reference
// (exact while a run's magnitudes span less than 2**45), then rounds fp64 -> fp32 -> bf16 as
// torch's double -> bfloat16 conversion does.
QT_HD void rht16(float* v) {
  double d[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = static_cast<double>(v[i]);
  signed_hadamard16(d);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = bf16_round(static_cast<float>(d[i] * 0.25));
}

// Where an fp32 butterfly of a run (signed_hadamard16<float>, no quarter: S = 4 y) may round,
// its results still fix most of the reference's: each fp32 sum is within rht_sum_error_bound of
// the reference's fp64 sum, and where both ends of that interval round to the same bf16, so does
// the reference. The bound: stage s (1..4) of the butterfly rounds a partial sum below
// 2**s * 2**(fmax - 126) (fmax the run's largest exponent field) by at most half its ulp,
// 2**(s - 1) * 2**(fmax - 150), and each output takes one partial sum of every stage with
// coefficient +-1: 15 * 2**(fmax - 150) in all. The reference's own fp64 rounding (spreads past
// 2**45) adds under 2**-28 of that; 2**(fmax - 146) covers both. Both roundings, fp64 -> fp32 and
// fp32 -> bf16, are monotone, so the reference's bf16(fp32(S)) lies between those of the ends.
// A result pinned this way is at least the bound in magnitude (ends of different signs round
// apart), so with fmax >= 24 it is a normal 4 x bf16(y): bf16(fp32(S / 4)) = bf16(fp32(S)) / 4.
// fmax <= 249 keeps every sum finite.
QT_HD bool rht_bound_applies(uint32_t fmax) { return fmax >= 24u && fmax <= 249u; }
QT_HD float rht_sum_error_bound(uint32_t fmax) { return u2f((fmax - 19u) << 23); }  // 2**(fmax - 146)
QT_HD bool rht_rounding_pinned(float s, float bound) {
  return f2u(bf16_round(s - bound)) == f2u(bf16_round(s + bound));
}

// ---- NVFP4 -----------------------------------------------------------------------------------

struct NvScale {
  float amax;      // A
  float s_enc;     // min(r(6B / A), FLT_MAX), 1 when A == 0
  float s_dec;     // r(1 / S_enc)
  float s_enc_c6;  // r(S_enc * r(1/6)), the factor of step 4
};

QT_HD NvScale nv_scale(float amax, int bound) {
  float s = static_cast<float>(6 * bound) / amax;
  s = clamp_max(s, FLT_MAX);
  if (amax == 0.f || s == 0.f) s = 1.f;
  return NvScale{amax, s, 1.f / s, s * recip6()};
}

// enc_b = min(r(1 / r(s_b * S_dec)), FLT_MAX)
QT_HD float nv_block_enc(uint8_t s_b, float s_dec) {
  return clamp_max(1.f / (e4m3_scale_value(s_b) * s_dec), FLT_MAX);
}

// 4over6 candidates: base = r(r(b_amax / 6) * S_enc); s6 = e4m3(min(base, 448)),
// s4 = e4m3(min(r(1.5 base), 448)).
QT_HD void fourover6_candidates(float b_amax, const NvScale& ts, uint8_t* s6, uint8_t* s4) {
  const float base = (b_amax / 6.f) * ts.s_enc;
  *s6 = e4m3_scale_bits(clamp_max(base, 448.f));
  *s4 = e4m3_scale_bits(clamp_max(1.5f * base, 448.f));
}

// ---- MXFP8 -----------------------------------------------------------------------------------

// UE8M0 code of a block amax; rule 0 = RCEIL (hardware default), 1 = FLOOR (OCP MX).
QT_HD uint32_t mx_scale_code(float amax, int rule) {
  int code;
  if (rule == 0) {
    const uint32_t b = f2u(amax * recip448());
    code = static_cast<int>((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u ? 1 : 0);
  } else {
    const uint32_t b = f2u(amax);
    const int exp = static_cast<int>((b >> 23) & 0xFFu);
    const uint32_t mant = b & 0x7FFFFFu;
    int log2v;
    if (exp > 0) {
      log2v = exp - 127;
    } else {  // subnormal: the leading mantissa bit; a zero amax is handled below
      int lead = 0;
      for (uint32_t m = mant > 0u ? mant : 1u; m > 1u; m >>= 1) ++lead;
      log2v = lead - 149;
    }
    code = log2v - 8 + 127;
    code = code < 0 ? 0 : code;
  }
  code = code > 254 ? 254 : code;
  if (amax == 0.f) code = 0;
  if (!(abs_f(amax) <= FLT_MAX)) code = 255;  // inf or NaN
  return static_cast<uint32_t>(code);
}

// Exact fp32 2**e for e in [-127, 127].
QT_HD float pow2f(int e) { return e >= -126 ? u2f(static_cast<uint32_t>(e + 127) << 23) : u2f(0x00400000u); }

// The data multiplier 2**(127 - code); code 255 gives NaN.
QT_HD float mx_inv_scale(uint32_t code) {
  if (code == 255u) return u2f(0x7FC00000u);
  int e = 127 - static_cast<int>(code);
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return pow2f(e);
}

// The biased exponent of mx_inv_scale(code), 254 - code, for the codes a finite amax gives:
// amax <= FLT_MAX < 2**128 puts r(amax / 448) below 2**120, so RCEIL codes are at most 247, and
// FLOOR codes at most 127 - 8 + 127 = 246; 2**(127 - code) is then a normal number (checked on
// every pattern by check_lanes). Code 255 (a NaN or inf amax) gives 255, which marks its block.
QT_HD uint32_t mx_inv_exponent(uint32_t code) { return (254u - code) & 0xFFu; }

QT_HD float mx_scale_value(uint8_t code) {
  if (code == 255u) return u2f(0x7FC00000u);
  int e = static_cast<int>(code) - 127;
  return pow2f(e < -127 ? -127 : e);
}

// ---- MXFP4 -----------------------------------------------------------------------------------

// e = clamp(ceil(log2(amax / 6)), -126, 125) from the amax bits; zero, subnormal and
// non-finite amaxes give -126.
QT_HD int mxfp4_exponent(float amax) {
  const uint32_t b = f2u(amax);
  const int exp = static_cast<int>((b >> 23) & 0xFFu);
  if (exp == 0 || exp == 255) return -126;
  int e = exp - 129 + ((b & 0x7FFFFFu) > 0x400000u ? 1 : 0);
  return e < -126 ? -126 : (e > 125 ? 125 : e);
}

// sign(w) e2m1(min(|w| 2**-e, 6)) 2**e as fp32 (NaN blocks are poisoned by the caller).
QT_HD float mxfp4_project(float w, int e) {
  const float scaled = clamp_max(abs_f(w) * pow2f(-e), 6.f);
  const float q = e2m1_round_abs(scaled);
  const float v = q * pow2f(e);
  return e2m1_sign(sign_bit(w) ? -scaled : scaled) ? -v : v;
}

// ---- scale layout -----------------------------------------------------------------------------

// Byte offset of compact scale (row, col) in the swizzled layout (docs/formats.md, "Scale
// layouts"): 512-byte tiles over (row / 128, col / 4) in row-major order, padded columns `pcols`.
QT_HD int64_t swizzle_offset(int64_t row, int64_t col, int64_t pcols) {
  const int64_t tile = (row / 128) * (pcols / 4) + col / 4;
  return tile * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + col % 4;
}

}  // namespace qtensor
