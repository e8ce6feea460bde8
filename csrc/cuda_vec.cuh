// Device-side helpers shared by the CUDA kernels of quant_cuda.cu, convert_cuda.cu and
// quant_rows_cuda.cu: 16-byte vectors of each input dtype (widened to fp32 exactly, and rounded
// back), MXFP8 bytes, RHT's exact fp32 butterfly, and the aligned 2-D view of an input. The dtype dispatch is checks.h's.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>

#include "checks.h"
#include "quant_math.h"
#include "quant_rows_math.h"

namespace qtensor {

constexpr unsigned kFull = 0xFFFFFFFFu;

// ---- 16-byte vectors of each input dtype --------------------------------------------------------

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void unpack(uint4 v, float* o) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
  }
  __device__ static void pack(const float* f, float* dst) {
    *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
  }
};
template <>
struct Vec<at::BFloat16> {
  static constexpr int kN = 8;
  __device__ static void unpack(uint4 v, float* o) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = __uint_as_float(w[i] << 16);
      o[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
  __device__ static void pack(const float* f, at::BFloat16* dst) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = (f2u(bf16_round(f[2 * i])) >> 16) | (f2u(bf16_round(f[2 * i + 1])) & 0xFFFF0000u);
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <>
struct Vec<at::Half> {
  static constexpr int kN = 8;
  __device__ static void unpack(uint4 v, float* o) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xFFFFu)));
      o[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
  __device__ static void pack(const float* f, at::Half* dst) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = __half_as_ushort(__float2half_rn(f[2 * i])) |
             (static_cast<unsigned>(__half_as_ushort(__float2half_rn(f[2 * i + 1]))) << 16);
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// Two adjacent elements in one word (4 bytes of a 16-bit dtype, 8 of fp32), widened exactly: the
// column pairs of the tile kernel and of the RHT amax.
template <typename T>
struct PairWord;
template <>
struct PairWord<float> {
  using Word = float2;
  __device__ static float lo(Word w) { return w.x; }
  __device__ static float hi(Word w) { return w.y; }
};
template <>
struct PairWord<at::BFloat16> {
  using Word = uint32_t;
  __device__ static float lo(Word w) { return __uint_as_float(w << 16); }
  __device__ static float hi(Word w) { return __uint_as_float(w & 0xFFFF0000u); }
};
template <>
struct PairWord<at::Half> {
  using Word = uint32_t;
  __device__ static float lo(Word w) { return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu))); }
  __device__ static float hi(Word w) { return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))); }
};

// Running max of |element| bits over one 16-byte word; 16-bit formats keep two 16-bit maxima.
template <typename T>
__device__ __forceinline__ uint32_t absmax_word(uint32_t m, uint4 r) {
  if constexpr (sizeof(T) == 4) {
    m = max(m, max(r.x & 0x7FFFFFFFu, r.y & 0x7FFFFFFFu));
    return max(m, max(r.z & 0x7FFFFFFFu, r.w & 0x7FFFFFFFu));
  } else {
    m = __vmaxu2(m, __vmaxu2(r.x & 0x7FFF7FFFu, r.y & 0x7FFF7FFFu));
    return __vmaxu2(m, __vmaxu2(r.z & 0x7FFF7FFFu, r.w & 0x7FFF7FFFu));
  }
}

// The largest v of a CTA of WARPS whole warps, on its thread 0 (0 on the others); every thread
// calls it, and scratch holds a word a warp. The amax kernels issue one atomic a CTA with it:
// the atomics of one address are served one after another at the kernel's end.
template <int WARPS>
__device__ __forceinline__ uint32_t cta_max(uint32_t v, uint32_t* scratch) {
  v = __reduce_max_sync(kFull, v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x >= 32) return 0u;
  return __reduce_max_sync(kFull, threadIdx.x < WARPS ? scratch[threadIdx.x] : 0u);
}

// fp32 bits of the running max (exact widening: bf16 by a shift, fp16 by the conversion).
template <typename T>
__device__ __forceinline__ uint32_t absmax_bits(uint32_t m) {
  if constexpr (sizeof(T) == 4) {
    return m;
  } else {
    const uint32_t h = max(m & 0xFFFFu, m >> 16);
    if constexpr (std::is_same_v<T, at::BFloat16>) return h << 16;
    else return f2u(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
}

// Two E4M3 bytes of products that are not NaN: the hardware's satfinite nearest-even conversion
// is clamp-then-round (e4m3_bits) there.
__device__ __forceinline__ unsigned e4m3x2_nonan(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return e4m3_bits(lo) | (static_cast<unsigned>(e4m3_bits(hi)) << 8);
#endif
}

// The 16 E4M3 bytes of half an MXFP8 block v at its scale code. A finite block amax gives a finite
// multiplier and no NaN product; a NaN or inf amax gives code 255, every byte of it 0x7F.
__device__ __forceinline__ uint4 mx_e4m3x16(const float* v, uint32_t code) {
  if (code == 255u) return make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
  const float inv = mx_inv_scale(code);
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = e4m3x2_nonan(v[4 * i] * inv, v[4 * i + 1] * inv) |
           (e4m3x2_nonan(v[4 * i + 2] * inv, v[4 * i + 3] * inv) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Sixteen fp32 values to dst in T, rounded to nearest-even, with 16-byte stores.
template <typename T>
__device__ __forceinline__ void store16(T* dst, const float* v) {
#pragma unroll
  for (int i = 0; i < 16; i += Vec<T>::kN) Vec<T>::pack(v + i, dst + i);
}

// ---- RHT with an fp32 butterfly where it is exact ------------------------------------------------

// The reference sums the 16-point transform in fp64. On bf16 inputs an fp32 butterfly gives the
// same exact sums y when the run's nonzero magnitudes are close: every partial sum is an integer
// multiple of the smallest value's last bit, 2**(fmin - 134) (fmin its exponent field, subnormals
// counted as 1), and below 16 * 2**(fmax - 126); that takes fmax - fmin + 12 <= 24 bits, so fmax
// <= fmin + 12 suffices. The kernels keep bf16(y), four times the result bf16(y / 4), and fold the
// quarter into the block factor: that needs bf16(y / 4) normal or zero (a nonzero |y| is at least
// 2**(fmin - 134), so fmin >= 10) and bf16(y) finite (|y| < 2**(fmax - 122), so fmax <= 249).
// Bf16Range tracks two runs at once, one per 16-bit half of packed bf16 pairs: the max magnitude
// bits, and the min of (magnitude bits - 1) with a zero dropping out. That min is kept on
// a + 0x7FFF per half, read as signed 16-bit: a zero gives 0x7FFF (the largest), a nonzero a gives
// 0x8000 + a - 1 (negative, ordered by a), and no carry crosses the halves since a <= 0x7FFF.
// (From a - 1, a power of two's exponent reads one low: the test errs to the fp64 side.)
struct Bf16Range {
  uint32_t hi = 0u, lo = 0x7FFF7FFFu;
  __device__ __forceinline__ void add(uint32_t w) {
    const uint32_t a = w & 0x7FFF7FFFu;
    hi = __vmaxu2(hi, a);
    lo = __vmins2(lo, a + 0x7FFF7FFFu);
  }
  __device__ __forceinline__ bool f32_exact(int half) const {
    const uint32_t fmax = (hi >> (16 * half + 7)) & 0xFFu;
    // (lo ^ 0x8000) per half is min(a - 1), 0xFFFF when the run is all zeros
    const uint32_t fmin = ((lo ^ 0x80008000u) >> (16 * half + 7)) & 0xFFu;
    return fmax <= 249u && fmin >= 10u && fmax <= fmin + 12u;
  }
  // Whether rht_sum_error_bound applies to the run, and the bound (meaningless where not).
  __device__ __forceinline__ bool bounded(int half) const {
    return rht_bound_applies((hi >> (16 * half + 7)) & 0xFFu);
  }
  __device__ __forceinline__ float sum_error_bound(int half) const {
    return rht_sum_error_bound((hi >> (16 * half + 7)) & 0xFFu);
  }
  // Bit h set where run h is left open: a result of it moved (a bit of bf16x2_moved's return in
  // half h) or the bound does not apply to it.
  __device__ __forceinline__ uint32_t open_runs(uint32_t moved) const {
    return ((moved & 0xFFFFu) != 0u || !bounded(0) ? 1u : 0u) |
           ((moved >> 16) != 0u || !bounded(1) ? 2u : 0u);
  }
};

// The bf16 bits of (lo, hi), nearest-even, packed (lo in the low half): one conversion for both.
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// The bits where an end of the interval (lo -+ e_lo, hi -+ e_hi) rounds to another bf16 than r, the
// packed bf16 of (lo, hi): zero in a half where the bound pins that result (rht_rounding_pinned).
__device__ __forceinline__ uint32_t bf16x2_moved(float lo, float hi, float e_lo, float e_hi,
                                                 uint32_t r) {
  return (bf16x2_bits(lo - e_lo, hi - e_hi) ^ r) | (bf16x2_bits(lo + e_lo, hi + e_hi) ^ r);
}

// The range of both runs of packed pairs w, and the runs widened to fp32 (exact).
__device__ __forceinline__ Bf16Range bf16x2_range(const uint32_t* w) {
  Bf16Range range;
#pragma unroll
  for (int i = 0; i < 16; ++i) range.add(w[i]);
  return range;
}
__device__ __forceinline__ void bf16x2_widen(const uint32_t* w, float (*v)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[0][i] = u2f(w[i] << 16);
    v[1][i] = u2f(w[i] & 0xFFFF0000u);
  }
}

// The fp32 butterfly of two bf16 16-runs held as packed pairs (run 0 in the low halves of
// w[0..15], run 1 in the high halves), in place, each result pair rounded by one conversion: w
// becomes 4 x rht16 of each run, exactly, where the run's range passes Bf16Range::f32_exact.
// Other runs' results may be off; with kPin each result is also tested against its run's error
// bound (Bf16Range::sum_error_bound: rht_rounding_pinned, on both runs by one conversion of each
// end), and bit h of the return is set where some result of run h is not pinned, or the bound does
// not apply. Those runs are to be replaced (rht16_lanes); the pinned ones are exact.
template <bool kPin = false>
__device__ __forceinline__ uint32_t rht16x2_bf16_x4(uint32_t* w, const Bf16Range& range = {}) {
  float v[2][16];
  bf16x2_widen(w, v);
  signed_hadamard16(v[0]);
  signed_hadamard16(v[1]);
  float e[2] = {0.f, 0.f};
  if constexpr (kPin) {
    e[0] = range.sum_error_bound(0);
    e[1] = range.sum_error_bound(1);
  }
  uint32_t moved = 0u;  // bits where an end of the interval rounds away from the result
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    w[i] = bf16x2_bits(v[0][i], v[1][i]);
    if constexpr (kPin) moved |= bf16x2_moved(v[0][i], v[1][i], e[0], e[1], w[i]);
  }
  if constexpr (!kPin) return 0u;
  return range.open_runs(moved);
}

// ---- RHT in fp64, one run over 16 lanes ------------------------------------------------------------

// rht16 of a run held one element a lane: lane i of each half-warp (i = lane % 16) holds element
// i and gets element i of the result. The same fp64 operations in the same order (each
// butterfly's a + b in the lane of a, a - b in the lane of b), so the same bits: a lane of the
// upper half of a pair adds its own value negated to its partner's. Every lane takes part.
__device__ __forceinline__ float rht16_lanes(float x) {
  const int i = threadIdx.x & 15;
  double d = static_cast<double>(x);
  if ((kRhtNegative >> i) & 1u) d = -d;
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
    const double o = __shfl_xor_sync(kFull, d, h);
    d = o + ((i & h) ? -d : d);
  }
  return bf16_round(static_cast<float>(d * 0.25));
}

// The runs a warp's fp32 butterflies cannot take (bit l of slow0 / slow1: lane l's run 0 / run 1,
// from a ballot), through rht16_lanes two at a time, one a half-warp: in each round every lane
// calls round(a, b) with the runs of lanes 0-15 (a) and 16-31 (b), each as 32 h + l for run h of
// lane l, b = -1 when none is left. The two runs of a round belong to different lanes. A run
// taking 16 lanes for about 4 instructions a butterfly step, in place of one lane for 226 while
// the other 31 wait, costs a warp far less: with Gaussian data about one run in 200 needs fp64,
// and the warp that holds one waits for it. The loop is uniform over the warp.
template <typename Round>
__device__ __forceinline__ void for_slow_runs(uint32_t slow0, uint32_t slow1, Round&& round) {
  uint64_t pending = slow0 | (static_cast<uint64_t>(slow1) << 32);
  while (pending != 0u) {
    const int a = __ffsll(static_cast<long long>(pending)) - 1;
    pending &= pending - 1u;
    const uint64_t others = pending & ~(uint64_t{1} << (a ^ 32));  // not a's lane's other run
    int b = -1;
    if (others != 0u) {
      b = __ffsll(static_cast<long long>(others)) - 1;
      pending &= ~(uint64_t{1} << b);
    }
    round(a, b);
  }
}

// prmt's selector that puts the low 16 bits of its second operand into half h of its first.
__device__ __forceinline__ uint32_t half_selector(int h) { return h ? 0x5410u : 0x3254u; }

// The max |result| of the RHT of two bf16 16-runs held as packed pairs (as rht16x2_bf16_x4
// holds them), packed the same way, exactly that of rht16 on each run. bf16(y / 4) is monotone
// in |y|, so over a run whose fp32 sums are exact it is bf16(max |y| / 4), one rounding a run.
// Over a run whose sums may round, the fp32 max is within the run's error bound of the
// reference's max |S| (each sum is), and it is the same where the bound pins its rounding
// (rht_rounding_pinned). The other runs of the warp go through rht16_lanes (each lane of the
// half-warp gets its element from the owner's word by a shuffle) and a max over the 16 lanes.
// Every lane of the warp calls it.
__device__ __forceinline__ uint32_t rht16x2_bf16_absmax(const uint32_t* w) {
  const Bf16Range range = bf16x2_range(w);
  uint32_t slow0 = __ballot_sync(kFull, !range.f32_exact(0));
  uint32_t slow1 = __ballot_sync(kFull, !range.f32_exact(1));
  float v[2][16];
  bf16x2_widen(w, v);
  signed_hadamard16(v[0]);
  signed_hadamard16(v[1]);
  float m0 = 0.f, m1 = 0.f;  // fmaxf's NaN rule does not matter: NaN runs are never f32-exact
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    m0 = fmaxf(m0, fabsf(v[0][i]));
    m1 = fmaxf(m1, fabsf(v[1][i]));
  }
  uint32_t m = bf16x2_bits(m0 * 0.25f, m1 * 0.25f);
  if ((slow0 | slow1) != 0u) {
    const float e0 = range.sum_error_bound(0), e1 = range.sum_error_bound(1);
    const uint32_t open = range.open_runs(bf16x2_moved(m0, m1, e0, e1, bf16x2_bits(m0, m1)));
    slow0 &= __ballot_sync(kFull, (open & 1u) != 0u);
    slow1 &= __ballot_sync(kFull, (open & 2u) != 0u);
  }
  const int lane = threadIdx.x & 31, i = lane & 15;
  for_slow_runs(slow0, slow1, [&](int a, int b) {
    const int run = lane < 16 ? a : (b < 0 ? a : b);
    float x = 0.f;
#pragma unroll
    for (int s = 0; s < 16; ++s) {
      const uint32_t t = __shfl_sync(kFull, w[s], run & 31);
      if (s == i) x = u2f(run >= 32 ? t & 0xFFFF0000u : t << 16);
    }
    uint32_t r = f2u(rht16_lanes(x)) & 0x7FFF0000u;  // |result| bits, NaN above inf
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) r = max(r, __shfl_xor_sync(kFull, r, o));
    const bool own_b = b >= 0 && lane == (b & 31);
    const uint32_t got = __shfl_sync(kFull, r, own_b ? 16 : 0) >> 16;
    if (lane == (a & 31)) m = prmt(m, got, half_selector(a >> 5));
    if (own_b) m = prmt(m, got, half_selector(b >> 5));
  });
  return m;
}

// A contiguous, 16-byte aligned [M, K] view of x (a copy only when x is not already one).
inline at::Tensor as_aligned_2d(const at::Tensor& x) {
  at::Tensor c = x.reshape({-1, x.size(-1)}).contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

}  // namespace qtensor
