// CPU-only forms of the element math that GCC auto-vectorizes (quant_cpu.cpp includes this; the
// CUDA kernels never see it). Each function equals its quant_math.h counterpart bit for bit on
// every one of the 2**32 fp32 inputs (checked exhaustively by a scratch host program comparing
// them with e4m3_bits / e2m1_encode). They differ only in form: no branches, and every compare
// is a signed int32 compare of a sign-cleared pattern (0 .. 0x7FFFFFFF orders the same as signed
// and unsigned), because SSE2 has signed 32-bit compares but no unsigned ones, so the unsigned
// forms of quant_math.h cost an extra xor per compare or do not vectorize at all.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "quant_math.h"

namespace qtensor {

// bf16 -> fp32 is the 16 bits shifted up (c10 does the same, one element per call); fp32 and
// fp16 use the ordinary conversion.
template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}
template <>
inline float to_f32(at::BFloat16 v) {
  return u2f(static_cast<uint32_t>(v.x) << 16);
}

// e4m3_bits(v): clamp |v| at 448 (0x43E00000; inf too), round the normal range by adding half an
// E4M3 ulp (2**19 in the fp32 pattern, minus one unless the kept lsb is odd: nearest-even), the
// subnormal range (below 2**-6) by the fp32 add of 2**14 whose ulp 2**-9 is the E4M3 subnormal
// step; NaN (pattern above 0x7F800000) gives 0x7F; the sign goes to bit 7.
inline uint8_t e4m3_bits_vec(float v) {
  const int32_t b = static_cast<int32_t>(f2u(v));
  const int32_t a = b & 0x7FFFFFFF;
  const int32_t c = a < 0x43E00000 ? a : 0x43E00000;
  const int32_t normal = (c - (120 << 23) + 0x7FFFF + ((c >> 20) & 1)) >> 20;
  const int32_t sub = static_cast<int32_t>(f2u(u2f(static_cast<uint32_t>(c)) + 16384.f)) - (141 << 23);
  int32_t r = c < (121 << 23) ? sub : normal;
  r = a > 0x7F800000 ? 0x7F : r;
  return static_cast<uint8_t>(r | ((b >> 24) & 0x80));
}

// e2m1_encode(v): |v| clamped at 6.0 (inf and NaN too: code 7); from 1.0 up nearest-even at
// mantissa bit 22 (the carry moves into the exponent), below 1.0 the grid step 0.5 is two
// compares; the sign nibble bit except for NaN.
inline uint8_t e2m1_encode_vec(float v) {
  const int32_t b = static_cast<int32_t>(f2u(v));
  const int32_t a = b & 0x7FFFFFFF;
  const int32_t c = a < 0x40C00000 ? a : 0x40C00000;
  const int32_t hi = ((c + 0x1FFFFF + ((c >> 22) & 1)) >> 22) - 252;
  const int32_t lo = (c > 0x3E800000 ? 1 : 0) + (c >= 0x3F400000 ? 1 : 0);
  const int32_t code = c >= 0x3F800000 ? hi : lo;
  const int32_t sign = a <= 0x7F800000 ? ((b >> 28) & 8) : 0;
  return static_cast<uint8_t>(code | sign);
}

// max |v| over n values as the pattern of an fp32: non-negative floats order like their bits
// and every NaN lies above inf, so this is torch.amax up to a NaN's payload.
inline uint32_t absmax_bits(const float* v, int n) {
  int32_t m = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t a = static_cast<int32_t>(f2u(v[i])) & 0x7FFFFFFF;
    m = a > m ? a : m;
  }
  return static_cast<uint32_t>(m);
}

}  // namespace qtensor
