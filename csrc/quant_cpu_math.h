// CPU-only forms of the element math, written for SIMD lanes (quant_cpu.cpp includes this; the
// CUDA kernels never see it). Each lane function equals its quant_math.h counterpart bit for bit
// on every one of the 2**32 fp32 inputs, scalar and in 4 and 8 lanes, at SSE2 and AVX2 codegen
// (csrc/tools/check_lanes.cpp against e4m3_bits / e2m1_encode, e4m3_value_lanes on all 256
// bytes; tests/test_cpu_lanes.py runs its boundary sample in CI). They differ only in form: no branches, and every compare is a signed int32
// compare of a sign-cleared pattern (0 .. 0x7FFFFFFF orders the same signed and unsigned), as
// SSE2/AVX2 have signed 32-bit compares but no unsigned ones. The block helpers reuse the block
// logic of quant_rows_math.h (the CUDA rowwise kernels) and fall back to it outside its fast path.
// The header needs no torch (csrc/tools/check_lanes.cpp compiles it alone).
#pragma once

#include <cstdint>
#include <cstring>

#include "quant_math.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "quant_rows_math.h"

// The row functions of quant_cpu.cpp are compiled twice on x86-64 (GCC/Clang function
// multiversioning, chosen once at load time by the CPU): baseline SSE2, and AVX2, whose blends
// and signed min/max turn each select of the lane functions into one instruction. Same
// operations, same bits.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QT_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QT_CPU_CLONES
#endif
// The lane helpers below are forced inline so that each clone compiles them for its own target
// (an out-of-line copy would be baseline SSE2 and pass 32-byte vectors through memory).
#define QT_LANES inline __attribute__((always_inline))

namespace qtensor {

// Lanes as GCC/Clang vector extensions: the element functions below are written once for a
// scalar (int32_t, float) and for 4 or 8 lanes, so the kernels run them 8 elements at a time
// without relying on the auto-vectorizer, which left the 16- and 32-element block loops scalar
// (-fopt-info-vec: "loop nest containing two or more consecutive inner loops").
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef float vf4 __attribute__((vector_size(16)));
// Eight lanes: one AVX2 register in the AVX2 clones, two SSE2 registers in the baseline ones.
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf8 __attribute__((vector_size(32)));

QT_LANES int32_t as_i(float f) { return static_cast<int32_t>(f2u(f)); }
QT_LANES float as_f(int32_t i) { return u2f(static_cast<uint32_t>(i)); }
QT_LANES vi4 as_i(vf4 f) {
  vi4 r;
  std::memcpy(&r, &f, sizeof r);
  return r;
}
QT_LANES vf4 as_f(vi4 i) {
  vf4 r;
  std::memcpy(&r, &i, sizeof r);
  return r;
}
template <typename I>
QT_LANES I splat(int32_t v) {  // v in every lane
  return I{} + v;
}
QT_LANES vi8 as_i(vf8 f) {
  vi8 r;
  std::memcpy(&r, &f, sizeof r);
  return r;
}
QT_LANES vf8 as_f(vi8 i) {
  vf8 r;
  std::memcpy(&r, &i, sizeof r);
  return r;
}
QT_LANES vf8 load8(const float* p) {
  vf8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
QT_LANES vf4 load4(const float* p) {
  vf4 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// e4m3_bits(v) per lane: clamp |v| at 448 (0x43E00000; inf too), round the normal range by
// adding half an E4M3 ulp (2**19 in the fp32 pattern, minus one unless the kept lsb is odd:
// nearest-even), the subnormal range (below 2**-6) by the fp32 add of 2**14 whose ulp 2**-9 is
// the E4M3 subnormal step; NaN (pattern above 0x7F800000) gives 0x7F; the sign goes to bit 7.
// kNaN = false drops the NaN select for callers whose values are never NaN.
template <typename I, typename F, bool kNaN = true>
QT_LANES I e4m3_lanes(F v) {
  const I b = as_i(v);
  const I a = b & 0x7FFFFFFF;
  const I c = a < splat<I>(0x43E00000) ? a : splat<I>(0x43E00000);
  const I normal = (c - (120 << 23) + 0x7FFFF + ((c >> 20) & 1)) >> 20;
  const I sub = as_i(as_f(c) + 16384.f) - (141 << 23);
  I r = c < splat<I>(121 << 23) ? sub : normal;
  if (kNaN) r = a > splat<I>(0x7F800000) ? splat<I>(0x7F) : r;
  return r | ((b >> 24) & 0x80);
}

// e2m1_encode(v) per lane: |v| clamped at 6.0 (inf and NaN too: code 7); from 1.0 up
// nearest-even at mantissa bit 22 (the carry moves into the exponent), below 1.0 the grid step
// 0.5 is two compares (a true compare is -1 in a vector lane, 1 in a scalar); the sign nibble
// bit except for NaN.
template <typename I, typename F>
QT_LANES I e2m1_lanes(F v) {
  const I b = as_i(v);
  const I a = b & 0x7FFFFFFF;
  const I c = a < splat<I>(0x40C00000) ? a : splat<I>(0x40C00000);
  const I hi = ((c + 0x1FFFFF + ((c >> 22) & 1)) >> 22) - 252;
  const I lo = (c > splat<I>(0x3E800000) ? splat<I>(1) : splat<I>(0)) +
               (c >= splat<I>(0x3F400000) ? splat<I>(1) : splat<I>(0));
  const I code = c >= splat<I>(0x3F800000) ? hi : lo;
  const I sign = a <= splat<I>(0x7F800000) ? ((b >> 28) & 8) : splat<I>(0);
  return code | sign;
}

QT_LANES uint8_t e4m3_bits_vec(float v) { return static_cast<uint8_t>(e4m3_lanes<int32_t>(v)); }
QT_LANES uint8_t e2m1_encode_vec(float v) { return static_cast<uint8_t>(e2m1_lanes<int32_t>(v)); }

// max |v| over 4 * nvec values as the pattern of an fp32: non-negative floats order like their
// bits and every NaN lies above inf, so this is torch.amax up to a NaN's payload.
QT_LANES uint32_t absmax_bits(const float* v, int nvec) {
  vi4 m = vi4{};
  for (int k = 0; k < nvec; ++k) {
    const vi4 a = as_i(load4(v + 4 * k)) & 0x7FFFFFFF;
    m = a > m ? a : m;
  }
  const int32_t m01 = m[0] > m[1] ? m[0] : m[1], m23 = m[2] > m[3] ? m[2] : m[3];
  return static_cast<uint32_t>(m01 > m23 ? m01 : m23);
}

// Lanes 0..255 of c8[0..1] to 16 bytes (SSE2: two saturating packs, exact on 0..255).
QT_LANES void store_bytes16(const vi8* c8, uint8_t* q) {
  vi4 c[4];
  std::memcpy(c, c8, sizeof c);
#if defined(__SSE2__)
  const __m128i lo = _mm_packs_epi32(reinterpret_cast<__m128i>(c[0]), reinterpret_cast<__m128i>(c[1]));
  const __m128i hi = _mm_packs_epi32(reinterpret_cast<__m128i>(c[2]), reinterpret_cast<__m128i>(c[3]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_packus_epi16(lo, hi));
#else
  for (int i = 0; i < 16; ++i) q[i] = static_cast<uint8_t>(c[i >> 2][i & 3]);
#endif
}

// 16 codes (c[0..3], each 0..15) to 8 bytes, element 2j in the low nibble of byte j: as 16-bit
// lanes the packed bytes are e(2j) | e(2j+1) << 8, and (x | x >> 4) & 0xFF moves the high one
// down to bit 4.
QT_LANES void store_nibbles(const vi8* c8, uint8_t* q) {
  vi4 c[4];
  std::memcpy(c, c8, sizeof c);
#if defined(__SSE2__)
  const __m128i lo = _mm_packs_epi32(reinterpret_cast<__m128i>(c[0]), reinterpret_cast<__m128i>(c[1]));
  const __m128i hi = _mm_packs_epi32(reinterpret_cast<__m128i>(c[2]), reinterpret_cast<__m128i>(c[3]));
  const __m128i x = _mm_packus_epi16(lo, hi);
  const __m128i n = _mm_and_si128(_mm_or_si128(x, _mm_srli_epi16(x, 4)), _mm_set1_epi16(0xFF));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packus_epi16(n, n));
#else
  for (int j = 0; j < 8; ++j)
    q[j] = static_cast<uint8_t>(c[j >> 1][2 * (j & 1)] | (c[j >> 1][2 * (j & 1) + 1] << 4));
#endif
}

// e4m3_value of four bytes (lanes 0..255); m * 2**-9 of the subnormals via the exact magic
// conversion (2**23 + m) - 2**23.
QT_LANES vf4 e4m3_value_lanes(vi4 b) {
  const vi4 s = (b & 0x80) << 24, e = (b >> 3) & 0xF, m = b & 7;
  const vi4 normal = s | ((e + 120) << 23) | (m << 20);
  const vi4 sub = s | as_i((as_f(m | 0x4B000000) - 8388608.f) * 0.001953125f);
  const vi4 nan = s | 0x7FC00000;
  return as_f((e == 15) & (m == 7) ? nan : (e == 0 ? sub : normal));
}

// NVFP4 codes of one 16-element block at block factor enc: e2m1_encode(v * enc) per element.
QT_LANES void nv_block_codes(const float* v, float enc, uint8_t* q) {
  vi8 c[2];
  for (int k = 0; k < 2; ++k) c[k] = e2m1_lanes<vi8>(load8(v + 8 * k) * enc);
  store_nibbles(c, q);
}

// fo6_error_fast (quant_rows_math.h) four lanes at a time: the codes of |v| * enc (non-negative
// and never NaN in fo6_fast_domain with a finite block, so e2m1_lanes gives code_nonan's code),
// |value(c)| by the exponent shift of fo6_value, the 16 differences; then the error summed over
// elements 0..15 in order, as the reference does. Codes come back without sign bits.
template <bool MSE>
QT_LANES float fo6_error_lanes(const float* v, float sf, const NvScale& ts, float six_b, vi8* codes) {
  const float enc = clamp_max(1.f / (sf * ts.s_dec), FLT_MAX);  // nv_block_enc of sf's byte
  const Fo6Values t = fo6_values(sf, ts.amax, six_b);
  const vi8 e0 = splat<vi8>(static_cast<int32_t>(t.e0)), e1 = splat<vi8>(static_cast<int32_t>(t.e1));
  float d[16];
  for (int k = 0; k < 2; ++k) {
    const vf8 a = as_f(as_i(load8(v + 8 * k)) & 0x7FFFFFFF);
    const vi8 c = e2m1_lanes<vi8>(a * enc);
    const vi8 big = (c << 22) + ((c & 1) != 0 ? e1 : e0);
    const vi8 val = c >= 2 ? big : (c == 1 ? e0 : vi8{});
    vf8 dd = as_f(val) - a;
    dd = MSE ? dd * dd : as_f(as_i(dd) & 0x7FFFFFFF);
    std::memcpy(d + 8 * k, &dd, sizeof dd);
    codes[k] = c;
  }
  float err = 0.f;
  for (int i = 0; i < 16; ++i) err = err + d[i];
  return err;
}

// fo6_block (quant_rows_math.h) with its fast branch four lanes at a time: the scale byte of one
// 4over6 block and its 8 code bytes. Blocks outside the fast domain (non-finite, extreme amax or
// scale) take fo6_block itself.
template <bool MSE>
QT_LANES uint8_t fo6_block_lanes(const float* v, float bam, const NvScale& ts, float six_b, uint8_t* q) {
  uint8_t s6, s4;
  fourover6_candidates(bam, ts, &s6, &s4);
  if (s6 == s4) {
    nv_block_codes(v, nv_block_enc(s6, ts.s_dec), q);
    return s6;
  }
  const float sf6 = e4m3_value(s6), sf4 = e4m3_value(s4);
  if (!(f2u(bam) < 0x7F800000u && fo6_fast_domain(ts.amax, sf6) && fo6_fast_domain(ts.amax, sf4))) {
    Codes c;
    const uint8_t s = fo6_block<MSE>(v, bam, ts, six_b, &c);
    for (int j = 0; j < 4; ++j) q[j] = static_cast<uint8_t>(c.x >> (8 * j));
    for (int j = 0; j < 4; ++j) q[4 + j] = static_cast<uint8_t>(c.y >> (8 * j));
    return s;
  }
  vi8 c6[2], c4[2];
  const float e6 = fo6_error_lanes<MSE>(v, sf6, ts, six_b, c6);
  const float e4 = fo6_error_lanes<MSE>(v, sf4, ts, six_b, c4);
  const bool map4 = e4 < e6;  // ties and NaN errors keep map-to-6
  vi8* c = map4 ? c4 : c6;
  for (int k = 0; k < 2; ++k) c[k] |= (as_i(load8(v + 8 * k)) >> 28) & 8;  // v's sign bits
  store_nibbles(c, q);
  return map4 ? s4 : s6;
}

// MXFP8 data bytes of n (a multiple of 4) values: e4m3(v * inv), a NaN v kept as it is (x86
// returns the first NaN operand of a product, which the reference's `x * inv` relies on).
// n is a multiple of 16.
QT_LANES void mx_codes(const float* v, const float* inv, int64_t n, uint8_t* q) {
  for (int64_t k = 0; k < n; k += 16) {
    vi8 c[2];
    for (int l = 0; l < 2; ++l) {
      const vf8 x = load8(v + k + 8 * l);
      c[l] = e4m3_lanes<vi8>(x != x ? x : x * load8(inv + k + 8 * l));
    }
    store_bytes16(c, q + k);
  }
}

// A finite block (scale code below 255: every |v| <= its finite amax, inv a finite power of two)
// has no NaN product, so its lanes skip both NaN selects.
QT_LANES void mx_codes(const float* v, float inv, bool finite, int64_t n, uint8_t* q) {
  for (int64_t k = 0; k < n; k += 16) {
    vi8 c[2];
    for (int l = 0; l < 2; ++l) {
      const vf8 x = load8(v + k + 8 * l);
      c[l] = finite ? e4m3_lanes<vi8, vf8, false>(x * inv) : e4m3_lanes<vi8>(x != x ? x : x * inv);
    }
    store_bytes16(c, q + k);
  }
}

// Plain NVFP4 scales of four blocks at once, from their amaxes (fp32 patterns): the bytes
// e4m3_bits(amax * S_enc r(1/6)) and the block factors nv_block_enc(byte, S_dec).
QT_LANES vi4 nv_scale_lanes(vi4 bam, const NvScale& ts, vf4* enc) {
  const vi4 sb = e4m3_lanes<vi4>(as_f(bam) * ts.s_enc_c6);
  const vf4 r = 1.f / (e4m3_value_lanes(sb) * ts.s_dec);
  *enc = r > FLT_MAX ? vf4{} + FLT_MAX : r;  // clamp_max: NaN passes
  return sb;
}

}  // namespace qtensor
