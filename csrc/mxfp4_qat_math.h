// MXFP4 weight QAT: the per-block math of the fused projection + quantize ops, shared by the CPU
// (mxfp4_qat.cpp) and CUDA (mxfp4_qat_cuda.cu) kernels. It composes quant_math.h's codecs in the
// order of the reference qtensor/qat/convert.py (docs/formats.md, "MXFP4 fake quantization"),
// bit for bit.
#pragma once

#include "quant_math.h"

namespace qtensor {

constexpr int kFbTile = 128;     // FP8 block-scaling tile side
constexpr int kMxShift = 6;      // direct MXFP8 rowwise: code = e + 127 - 6 (q * 64 <= 384)
constexpr uint8_t kE4m3NaN = 0x7F;  // e4m3 byte of the positive NaN a poisoned block holds

// The MXFP4 decomposition of one element given its block exponent: the signed E2M1 value q
// (fp32, -0 kept) such that the projection is q * 2**e. Same operations as mxfp4_project.
QT_HD float mx4_q(float w, int e) {
  const float scaled = clamp_max(abs_f(w) * pow2f(-e), 6.f);
  const float q = e2m1_round_abs(scaled);
  return e2m1_sign(sign_bit(w) ? -scaled : scaled) ? -q : q;
}

// A block is poisoned when its amax is NaN or inf (the reference's non-finite rule).
QT_HD bool mx4_bad(float amax) { return !(amax <= FLT_MAX); }

// Direct MXFP8 rowwise scale code of a block: max(e + 121, 0), 255 when poisoned.
QT_HD uint32_t mx4_direct_code(int e, bool bad) {
  if (bad) return 255u;
  const int c = e + 127 - kMxShift;
  return c < 0 ? 0u : static_cast<uint32_t>(c);
}

// Direct MXFP8 rowwise payload: e4m3(q * 2**(e + 127 - code)); below code 0 the payload absorbs
// the remaining factor (q * 2**(e + 127) <= 192, exact).
QT_HD uint8_t mx4_direct_payload(float q, int e, uint32_t code) {
  if (code == 255u) return kE4m3NaN;
  return e4m3_bits(q * pow2f(e + 127 - static_cast<int>(code)));
}

// Tile exponent of the direct FP8 128x128 conversion: max(max e - 6, -127).
QT_HD int fb_tile_exponent(int max_e) {
  const int t = max_e - kMxShift;
  return t < -127 ? -127 : t;
}

// Direct FP8 128x128 payload: e4m3(q * 2**(e - t)); shifts below -30 round every |q| <= 6 to a
// signed zero anyway, so they are clamped there (as the reference does) to stay in range.
QT_HD uint8_t fb_direct_payload(float q, int e, int t) {
  int s = e - t;
  s = s < -30 ? -30 : s;
  return e4m3_bits(q * pow2f(s));
}

// Host-quantizer payload of a projected value v under a power-of-two code (projection mode).
QT_HD uint8_t host_payload(float v, uint32_t code) {
  if (code == 255u) return kE4m3NaN;
  return e4m3_bits(v * mx_inv_scale(code));
}

}  // namespace qtensor
