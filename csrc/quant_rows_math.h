// Cheaper forms of the NVFP4 element math for the rowwise kernels (quant_rows_cuda.cu), valid on
// a stated domain where they equal the general functions of quant_math.h bit for bit. They are
// __host__ __device__ so a host program can compare them with those functions exhaustively
// (every non-NaN fp32 pattern for the E2M1 code; every E4M3 scale for the 4over6 values).
#pragma once

#include "quant_math.h"

namespace qtensor {

// E2M1 code (0..7) of a non-negative, non-NaN fp32 given by its bits b: equals
// e2m1_code_bits(b) on all 2**31 - 2**23 + 1 such patterns, in 8 integer/fp32 operations instead
// of about 11. Clamping b at 6.0 first saturates (inf included). Below 2 the fp32 add of 2**22
// (ulp 0.5) rounds 2|v| to an integer nearest-even: that integer is the code. From 1 up,
// e2m1_code_bits' 1-mantissa-bit rounding of max(b, 1.0) is the code. Each formula is >= the
// right code where it is wrong (round(2|v|) >= code from 1 up, and the code of 1.0 is 2 >= any
// code below 1), and they agree on [1, 2), so their minimum is the code everywhere.
QT_HD uint32_t e2m1_code_nonan(uint32_t b) {
  b = b < 0x40C00000u ? b : 0x40C00000u;
  const uint32_t lo = f2u(u2f(b) + 4194304.f) - 0x4A800000u;
  const uint32_t m = b > 0x3F800000u ? b : 0x3F800000u;
  const uint32_t hi = (m + (0x1FFFFFu - (252u << 22)) + ((m >> 22) & 1u)) >> 22;
  return lo < hi ? lo : hi;
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

}  // namespace qtensor
