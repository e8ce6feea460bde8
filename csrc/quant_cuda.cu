// CUDA kernels of every qtensor op. Quantization reads the input once, in 64x64 tiles staged in
// shared memory, and writes every output asked for from that one read: NVFP4 rowwise or
// columnwise (1D/2D, 4over6, RHT, stochastic rounding), MXFP8 rowwise and/or columnwise, and the
// hybrid gradient cast (MXFP8 rowwise + NVFP4 columnwise). The math is quant_math.h, shared with
// the CPU kernels; built with --fmad=false so every fp32 operation rounds like the reference.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "quant_math.h"
#include "quant_rows.h"

namespace qtensor {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;  // tile side, elements
constexpr unsigned kFull = 0xFFFFFFFFu;

template <typename F>
void dispatch_float(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, ".");
  }
}

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

// Two E4M3 bytes (lo in the low byte): the hardware's satfinite nearest-even conversion equals
// clamp-then-round; a NaN product is canonical on the GPU, which torch encodes as 0x7F.
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  unsigned out = r;
  if (is_nan(lo)) out = (out & 0xFF00u) | 0x7Fu;
  if (is_nan(hi)) out = (out & 0x00FFu) | 0x7F00u;
  return out;
#else
  return e4m3_bits(is_nan(lo) ? u2f(0x7FC00000u) : lo) |
         (static_cast<unsigned>(e4m3_bits(is_nan(hi) ? u2f(0x7FC00000u) : hi)) << 8);
#endif
}

// r(n / d) for the constant d = 6B with its reciprocal rd: one product and two FMAs give the
// correctly rounded quotient (Markstein) away from under/overflow, where the true division runs.
__device__ __forceinline__ float div_6b(float n, float d, float rd) {
  const float an = abs_f(n);
  if (an >= 0x1p-100f && an <= 0x1p100f) {
    const float q0 = n * rd;
    const float r = __fmaf_rn(-q0, d, n);
    return __fmaf_rn(r, rd, q0);
  }
  return n / d;
}

// ---- fused tile quantizer ----------------------------------------------------------------------

struct TileArgs {
  const void* x;
  int64_t M, K;
  // NVFP4
  const float* amax;
  bool row_scaled, nv_col, nv_2d, nv_rht, nv_sr;
  int nv_4o6, bound;
  const int64_t* sr_state;  // stochastic rounding's (seed, offset) in device memory, or nullptr
  uint8_t *nv_q, *nv_s;
  // MXFP8
  int rule;
  uint8_t *mxr_q, *mxr_s, *mxc_q, *mxc_s;
};

// Error of one 4over6 candidate on a 16-element block, and its packed codes.
__device__ __forceinline__ float candidate(const float* v, uint8_t s, const NvScale& ts, float six_b,
                                           float r6b, bool mse, uint2* codes) {
  const float enc = nv_block_enc(s, ts.s_dec);
  const float sf = e4m3_value(s);
  float err = 0.f;
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float p = v[i] * enc;
    const float r = e2m1_round_abs(abs_f(p));
    const unsigned sg = e2m1_sign(p);
    w[i >> 3] |= (e2m1_code_abs(r) | (sg << 3)) << (4 * (i & 7));
    float val = div_6b((r * sf) * ts.amax, six_b, r6b);
    if (sg) val = -val;
    const float d = val - v[i];
    err = err + (mse ? d * d : abs_f(d));
  }
  *codes = make_uint2(w[0], w[1]);
  return err;
}

template <bool FOUR_OVER_SIX>
__device__ __forceinline__ void nv_phase(const TileArgs& a, float (*tile)[kTile + 1], int64_t m0,
                                         int64_t k0) {
  const int t = threadIdx.x;
  // 2D groups 16 consecutive lanes on the 16 rows of one 16x16 tile, for shuffle reductions.
  const int lr = a.nv_2d ? (t & 15) + 16 * (t >> 6) : t >> 2;
  const int blk = a.nv_2d ? (t >> 4) & 3 : t & 3;
  float v[16];
  int64_t qrow, qcol0, R, C;
  if (!a.nv_col) {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = tile[lr][blk * 16 + i];
    qrow = m0 + lr; qcol0 = k0 + blk * 16; R = a.M; C = a.K;
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = tile[blk * 16 + i][lr];
    qrow = k0 + lr; qcol0 = m0 + blk * 16; R = a.K; C = a.M;
  }
  const bool valid = qrow < R && qcol0 < C;
  if (a.nv_rht) rht16(v);
  float bam = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) bam = nan_max(bam, abs_f(v[i]));
  if (a.nv_2d) {
#pragma unroll
    for (int o = 8; o >= 1; o >>= 1) bam = nan_max(bam, __shfl_xor_sync(kFull, bam, o));
  }
  const NvScale ts = nv_scale(a.row_scaled ? (valid ? a.amax[qrow] : 0.f) : a.amax[0], a.bound);
  uint8_t sb;
  uint2 codes;
  if constexpr (FOUR_OVER_SIX) {
    uint8_t s6, s4;
    fourover6_candidates(bam, ts, &s6, &s4);
    const float six_b = static_cast<float>(6 * a.bound), r6b = 1.f / six_b;
    uint2 c6, c4;
    float e6 = candidate(v, s6, ts, six_b, r6b, a.nv_4o6 == 2, &c6);
    float e4 = candidate(v, s4, ts, six_b, r6b, a.nv_4o6 == 2, &c4);
    if (a.nv_2d) {  // the reference's tree over the tile's 16 row errors: +8, +4, +2, +1
#pragma unroll
      for (int o = 8; o >= 1; o >>= 1) {
        e6 = e6 + __shfl_down_sync(kFull, e6, o, 16);
        e4 = e4 + __shfl_down_sync(kFull, e4, o, 16);
      }
      e6 = __shfl_sync(kFull, e6, 0, 16);
      e4 = __shfl_sync(kFull, e4, 0, 16);
    }
    const bool map4 = e4 < e6;
    sb = map4 ? s4 : s6;
    codes = map4 ? c4 : c6;
  } else {
    sb = e4m3_bits(bam * ts.s_enc_c6);
    const float enc = nv_block_enc(sb, ts.s_dec);
    uint32_t key = 0u, base = 0u;
    if (a.nv_sr) {  // read here, on the device: the host never syncs on the state
      key = mix32(static_cast<uint32_t>(a.sr_state[0]));
      base = static_cast<uint32_t>(qrow * C + qcol0) + static_cast<uint32_t>(a.sr_state[1]);
    }
    unsigned w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float p = v[i] * enc;
      const unsigned c = a.nv_sr ? e2m1_encode_sr(p, sr_bits(key, base + i)) : e2m1_encode(p);
      w[i >> 3] |= c << (4 * (i & 7));
    }
    codes = make_uint2(w[0], w[1]);
  }
  if (valid) {
    *reinterpret_cast<uint2*>(a.nv_q + qrow * (C / 2) + qcol0 / 2) = codes;
    a.nv_s[qrow * (C / 16) + qcol0 / 16] = sb;
  }
}

__device__ __forceinline__ uint4 e4m3x16(const float* v, float inv) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = e4m3x2(v[4 * i] * inv, v[4 * i + 1] * inv) |
           (e4m3x2(v[4 * i + 2] * inv, v[4 * i + 3] * inv) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void mx_row_phase(const TileArgs& a, float (*tile)[kTile + 1], int64_t m0,
                                             int64_t k0) {
  const int t = threadIdx.x, r = t >> 2, h = t & 3;  // a quarter row = half a 32-block
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = tile[r][h * 16 + i];
  float am = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) am = nan_max(am, abs_f(v[i]));
  am = nan_max(am, __shfl_xor_sync(kFull, am, 1));
  const uint32_t code = mx_scale_code(am, a.rule);
  const uint4 bytes = e4m3x16(v, mx_inv_scale(code));
  const int64_t row = m0 + r, col = k0 + h * 16;
  if (row < a.M && col < a.K) {
    *reinterpret_cast<uint4*>(a.mxr_q + row * a.K + col) = bytes;
    if ((h & 1) == 0) a.mxr_s[row * (a.K / 32) + col / 32] = static_cast<uint8_t>(code);
  }
}

__device__ __forceinline__ void mx_col_phase(const TileArgs& a, float (*tile)[kTile + 1],
                                             float (*part)[kTile], float (*inv)[kTile], int64_t m0,
                                             int64_t k0) {
  const int t = threadIdx.x;
  {
    const int k = t & 63, g = t >> 6;  // 16 rows of one column
    float am = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) am = nan_max(am, abs_f(tile[g * 16 + i][k]));
    part[g][k] = am;
  }
  __syncthreads();
  if (t < 128) {
    const int k = t & 63, b = t >> 6;
    const uint32_t code = mx_scale_code(nan_max(part[2 * b][k], part[2 * b + 1][k]), a.rule);
    inv[b][k] = mx_inv_scale(code);
    if (m0 + 32 * b < a.M && k0 + k < a.K) a.mxc_s[(m0 / 32 + b) * a.K + k0 + k] = static_cast<uint8_t>(code);
  }
  __syncthreads();
  const int r = t >> 2, q = (t & 3) * 16;
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = q + 4 * i;
    w[i] = e4m3x2(tile[r][c] * inv[r >> 5][c], tile[r][c + 1] * inv[r >> 5][c + 1]) |
           (e4m3x2(tile[r][c + 2] * inv[r >> 5][c + 2], tile[r][c + 3] * inv[r >> 5][c + 3]) << 16);
  }
  if (m0 + r < a.M && k0 + q < a.K)
    *reinterpret_cast<uint4*>(a.mxc_q + (m0 + r) * a.K + k0 + q) = make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T, bool NV, bool FOUR_OVER_SIX, bool MXR, bool MXC>
__global__ void __launch_bounds__(kThreads) tile_kernel(TileArgs a) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ float part[MXC ? 4 : 1][kTile];
  __shared__ float inv[MXC ? 2 : 1][kTile];
  constexpr int kN = Vec<T>::kN, kPerRow = kTile / kN, kLoads = kTile * kPerRow / kThreads;
  const int64_t tiles_k = (a.K + kTile - 1) / kTile;
  const int64_t m0 = (blockIdx.x / tiles_k) * kTile, k0 = (blockIdx.x % tiles_k) * kTile;
  const T* x = static_cast<const T*>(a.x);
  uint4 raw[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {  // all loads in flight before the first use
    const int idx = threadIdx.x + l * kThreads, r = idx / kPerRow, c = (idx % kPerRow) * kN;
    raw[l] = (m0 + r < a.M && k0 + c < a.K)
                 ? __ldcs(reinterpret_cast<const uint4*>(x + (m0 + r) * a.K + k0 + c))
                 : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int idx = threadIdx.x + l * kThreads, r = idx / kPerRow, c = (idx % kPerRow) * kN;
    float f[kN];
    Vec<T>::unpack(raw[l], f);
#pragma unroll
    for (int i = 0; i < kN; ++i) tile[r][c + i] = f[i];
  }
  __syncthreads();
  if constexpr (MXR) mx_row_phase(a, tile, m0, k0);
  if constexpr (MXC) mx_col_phase(a, tile, part, inv, m0, k0);
  if constexpr (NV) nv_phase<FOUR_OVER_SIX>(a, tile, m0, k0);
}

template <typename T, bool NV, bool FOUR_OVER_SIX, bool MXR, bool MXC>
void launch_tiles(const TileArgs& a) {
  const int64_t tiles = ((a.M + kTile - 1) / kTile) * ((a.K + kTile - 1) / kTile);
  tile_kernel<T, NV, FOUR_OVER_SIX, MXR, MXC>
      <<<tiles, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A contiguous, 16-byte aligned [M, K] view of x (a copy only when x is not already one).
at::Tensor as_aligned_2d(const at::Tensor& x) {
  at::Tensor c = x.reshape({-1, x.size(-1)}).contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

void run_tiles(const at::Tensor& x2, TileArgs& a, bool nv, bool mxr, bool mxc) {
  a.x = x2.data_ptr();
  a.M = x2.size(0);
  a.K = x2.size(1);
  dispatch_float(x2.scalar_type(), "qtensor quantize", [&](auto tag) {
    using T = decltype(tag);
    if (nv && a.nv_4o6) {
      TORCH_CHECK(!mxr && !mxc, "qtensor: 4over6 is not fused with MXFP8 outputs.");
      launch_tiles<T, true, true, false, false>(a);
    } else if (nv && mxr) {
      launch_tiles<T, true, false, true, false>(a);
    } else if (nv) {
      launch_tiles<T, true, false, false, false>(a);
    } else if (mxr && mxc) {
      launch_tiles<T, false, false, true, true>(a);
    } else if (mxr) {
      launch_tiles<T, false, false, true, false>(a);
    } else {
      launch_tiles<T, false, false, false, true>(a);
    }
  });
}

TileArgs nv_args(const at::Tensor& amax, bool columnwise, bool block_2d, int64_t fourover6,
                 int64_t bound, bool rht, bool stochastic, const int64_t* sr_state,
                 at::Tensor& q, at::Tensor& s) {
  TileArgs a{};
  a.amax = amax.data_ptr<float>();
  a.row_scaled = amax.dim() == 1;
  a.nv_col = columnwise;
  a.nv_2d = block_2d;
  a.nv_rht = rht;
  a.nv_sr = stochastic;
  a.nv_4o6 = static_cast<int>(fourover6);
  a.bound = static_cast<int>(bound);
  a.sr_state = sr_state;
  a.nv_q = q.data_ptr<uint8_t>();
  a.nv_s = s.data_ptr<uint8_t>();
  return a;
}

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize_cuda(const at::Tensor& x, const at::Tensor& amax,
                                                       bool columnwise, bool block_2d,
                                                       int64_t fourover6, int64_t bound, bool rht,
                                                       bool stochastic,
                                                       const std::optional<at::Tensor>& sr_state) {
  const char* op = "qtensor.nvfp4_quantize";
  const NvShape s = nv_shape(x, columnwise, block_2d, op);
  check_nv_options(fourover6, bound, columnwise, rht, stochastic, block_2d, amax.dim() == 1, op);
  check_nv_amax(x, amax, s, op);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty({s.R, s.C / 2}, x.options().dtype(at::kByte));
  at::Tensor sc = at::empty({s.R, s.C / 16}, x.options().dtype(at::kByte));
  const at::Tensor a = amax.contiguous();
  const int64_t* sr = sr_state_ptr(x, stochastic, sr_state, op);
  if (!columnwise && !block_2d && !rht && !stochastic) {  // 1x16 rowwise blocks: no tile needed
    nvfp4_rows_cuda(as_aligned_2d(x), a, fourover6, bound, q, sc);
    return {q, sc.view(at::kFloat8_e4m3fn)};
  }
  TileArgs args = nv_args(a, columnwise, block_2d, fourover6, bound, rht, stochastic, sr, q, sc);
  run_tiles(as_aligned_2d(x), args, true, false, false);
  return {q, sc.view(at::kFloat8_e4m3fn)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mxfp8_quantize_cuda(
    const at::Tensor& x, int64_t rule, bool rowwise, bool columnwise) {
  const char* op = "qtensor.mxfp8_quantize";
  check_mx_shape(x, rowwise, columnwise, op);
  check_scale_rule(rule, op);
  TORCH_CHECK(x.size(-1) % 16 == 0, op, ": the CUDA kernel reads 16-element rows; got shape ",
              shape_str(x), ". Use the reference for this shape.");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t K = x.size(-1), M = x.numel() / K;
  const auto bytes = x.options().dtype(at::kByte);
  at::Tensor rq = at::empty({0}, bytes), rs = at::empty({0}, bytes);
  at::Tensor cq = at::empty({0}, bytes), cs = at::empty({0}, bytes);
  TileArgs a{};
  a.rule = static_cast<int>(rule);
  if (rowwise) {
    rq = at::empty(x.sizes(), bytes);
    auto ss = x.sizes().vec();
    ss.back() = K / 32;
    rs = at::empty(ss, bytes);
    a.mxr_q = rq.data_ptr<uint8_t>();
    a.mxr_s = rs.data_ptr<uint8_t>();
  }
  if (columnwise) {
    cq = at::empty(x.sizes(), bytes);
    cs = at::empty({M / 32, K}, bytes);
    a.mxc_q = cq.data_ptr<uint8_t>();
    a.mxc_s = cs.data_ptr<uint8_t>();
  }
  if (rowwise && !columnwise) mxfp8_rows_cuda(as_aligned_2d(x), rule, rq, rs);  // no tile needed
  else run_tiles(as_aligned_2d(x), a, false, rowwise, columnwise);
  return {rq.view(at::kFloat8_e4m3fn), rs.view(at::kFloat8_e8m0fnu), cq.view(at::kFloat8_e4m3fn),
          cs.view(at::kFloat8_e8m0fnu)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hybrid_quantize_cuda(
    const at::Tensor& x, const at::Tensor& amax, int64_t rule, int64_t fourover6, int64_t bound,
    bool rht, bool stochastic, const std::optional<at::Tensor>& sr_state) {
  const char* op = "qtensor.hybrid_quantize";
  TORCH_CHECK(x.dim() == 2, op, " takes a 2-D gradient [M, K]; got shape ", shape_str(x), ".");
  check_mx_shape(x, true, false, op);
  check_scale_rule(rule, op);
  const NvShape s = nv_shape(x, true, false, op);
  check_nv_options(fourover6, bound, true, rht, stochastic, false, amax.dim() == 1, op);
  check_nv_amax(x, amax, s, op);
  if (fourover6) {  // 4over6's register budget does not fit beside the MXFP8 phase: two passes
    auto mx = mxfp8_quantize_cuda(x, rule, true, false);
    auto nv = nvfp4_quantize_cuda(x, amax, true, false, fourover6, bound, rht, stochastic, sr_state);
    return {std::get<0>(mx), std::get<1>(mx), std::get<0>(nv), std::get<1>(nv)};
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto bytes = x.options().dtype(at::kByte);
  at::Tensor rq = at::empty(x.sizes(), bytes), rs = at::empty({s.M, s.K / 32}, bytes);
  at::Tensor q = at::empty({s.R, s.C / 2}, bytes), sc = at::empty({s.R, s.C / 16}, bytes);
  const at::Tensor a = amax.contiguous();
  const int64_t* sr = sr_state_ptr(x, stochastic, sr_state, op);
  TileArgs args = nv_args(a, true, false, 0, bound, rht, stochastic, sr, q, sc);
  args.rule = static_cast<int>(rule);
  args.mxr_q = rq.data_ptr<uint8_t>();
  args.mxr_s = rs.data_ptr<uint8_t>();
  run_tiles(as_aligned_2d(x), args, true, true, false);
  return {rq.view(at::kFloat8_e4m3fn), rs.view(at::kFloat8_e8m0fnu), q, sc.view(at::kFloat8_e4m3fn)};
}

// ---- amax ---------------------------------------------------------------------------------------

constexpr int kAmaxPanels = 2;  // 16-row panels per warp: 32 rows (enough blocks to fill 132 SMs)

// One warp covers 16*kAmaxPanels rows x (32 lanes x one 16-byte vector) columns. mode 0: one
// amax; 1: per input row; 2: per input column (the columnwise per-row amax). Non-negative floats
// order like their bits, and NaN's bits (after abs) sit above inf, so atomicMax on the bits is
// torch.amax, NaN included.
template <typename T, bool RHT>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t M, int64_t K, int mode,
                                                        unsigned* out) {
  constexpr int kN = Vec<T>::kN;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t col_groups = (K + 32 * kN - 1) / (32 * kN);
  const int64_t r0 = (warp / col_groups) * 16 * kAmaxPanels;
  const int64_t k = (warp % col_groups) * 32 * kN + lane * kN;
  if (r0 >= M) return;  // whole warp: uniform
  const bool kin = k < K;
  float gmax = 0.f, cmax[kN];
#pragma unroll
  for (int c = 0; c < kN; ++c) cmax[c] = 0.f;
  for (int p = 0; p < kAmaxPanels; ++p) {
    const int64_t rb = r0 + p * 16;
    if (rb >= M) break;
    uint4 raw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      raw[i] = (kin && rb + i < M) ? __ldcs(reinterpret_cast<const uint4*>(x + (rb + i) * K + k))
                                   : make_uint4(0u, 0u, 0u, 0u);
    float rmax[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) rmax[i] = 0.f;
    if constexpr (RHT) {
#pragma unroll
      for (int c = 0; c < kN; ++c) {
        float v[16], f[kN];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          Vec<T>::unpack(raw[i], f);
          v[i] = f[c];
        }
        rht16(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) cmax[c] = nan_max(cmax[c], abs_f(v[i]));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float f[kN];
        Vec<T>::unpack(raw[i], f);
#pragma unroll
        for (int c = 0; c < kN; ++c) {
          rmax[i] = nan_max(rmax[i], abs_f(f[c]));
          cmax[c] = nan_max(cmax[c], abs_f(f[c]));
        }
      }
    }
    if (mode == 1) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float m = rmax[i];
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) m = nan_max(m, __shfl_xor_sync(kFull, m, o));
        if (lane == 0 && rb + i < M) atomicMax(out + rb + i, f2u(m));
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kN; ++c) gmax = nan_max(gmax, cmax[c]);
  if (mode == 2) {
#pragma unroll
    for (int c = 0; c < kN; ++c)
      if (kin) atomicMax(out + k + c, f2u(cmax[c]));
  } else if (mode == 0) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) gmax = nan_max(gmax, __shfl_xor_sync(kFull, gmax, o));
    if (lane == 0) atomicMax(out, f2u(gmax));
  }
}

at::Tensor amax_cuda(const at::Tensor& x, bool columnwise, bool rht, bool per_row) {
  const char* op = "qtensor.amax";
  const NvShape s = nv_shape(x, columnwise, false, op);
  TORCH_CHECK(!rht || columnwise, op, ": RHT applies only to columnwise operands.");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = per_row ? at::zeros({s.R}, x.options().dtype(at::kFloat))
                           : at::zeros({}, x.options().dtype(at::kFloat));
  const at::Tensor x2 = as_aligned_2d(x);
  const int mode = !per_row ? 0 : (columnwise ? 2 : 1);
  if (!rht && mode != 2) {  // one amax or one per input row: streamed, no 16-row panels
    amax_rows_cuda(x2, per_row, out);
    return out;
  }
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = Vec<T>::kN;
    const int64_t warps = ((s.M + 16 * kAmaxPanels - 1) / (16 * kAmaxPanels)) *
                          ((s.K + 32 * kN - 1) / (32 * kN));
    const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
    auto* o = reinterpret_cast<unsigned*>(out.data_ptr<float>());
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (rht) amax_kernel<T, true><<<blocks, kThreads, 0, stream>>>(x2.const_data_ptr<T>(), s.M, s.K, mode, o);
    else amax_kernel<T, false><<<blocks, kThreads, 0, stream>>>(x2.const_data_ptr<T>(), s.M, s.K, mode, o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---- dequantize, MXFP4, swizzle -----------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void store16(T* dst, const float* v) {
#pragma unroll
  for (int i = 0; i < 16; i += Vec<T>::kN) Vec<T>::pack(v + i, dst + i);
}

template <typename T>
__global__ void nv_dequant_kernel(const uint8_t* q, const uint8_t* s, const float* amax, bool per_row,
                                  float inv6b, int64_t R, int64_t C, T* out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= R * (C / 16)) return;
  const int64_t row = b / (C / 16);
  const float f = (e4m3_value(s[b]) * amax[per_row ? row : 0]) * inv6b;
  const uint2 w = *reinterpret_cast<const uint2*>(q + b * 8);
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = e2m1_value(((i < 8 ? w.x : w.y) >> (4 * (i & 7))) & 15u) * f;
  store16(out + b * 16, v);
}

template <typename T>
__global__ void mx_dequant_kernel(const uint8_t* q, const uint8_t* s, bool columnwise, int64_t M,
                                  int64_t K, T* out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // 16 elements
  if (c >= M * K / 16) return;
  const int64_t row = (c * 16) / K, col = (c * 16) % K;
  const uint4 w = *reinterpret_cast<const uint4*>(q + c * 16);
  const unsigned words[4] = {w.x, w.y, w.z, w.w};
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint8_t code = columnwise ? s[(row / 32) * K + col + i] : s[row * (K / 32) + (col + i) / 32];
    v[i] = e4m3_value(static_cast<uint8_t>(words[i >> 2] >> (8 * (i & 3)))) * mx_scale_value(code);
  }
  store16(out + c * 16, v);
}

template <typename T>
__global__ void mxfp4_kernel(const T* w, int64_t n, T* out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // 16 elements
  const bool in = c * 16 < n;
  constexpr int kN = Vec<T>::kN;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; i += kN) {
    const uint4 raw = in ? *reinterpret_cast<const uint4*>(w + c * 16 + i) : make_uint4(0u, 0u, 0u, 0u);
    Vec<T>::unpack(raw, v + i);
  }
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = nan_max(m, abs_f(v[i]));
  m = nan_max(m, __shfl_xor_sync(kFull, m, 1));  // the other half of the 32-block
  const int e = mxfp4_exponent(m);
  const bool bad = !(m <= FLT_MAX);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = bad ? u2f(0x7FC00000u) : mxfp4_project(v[i], e);
  if (in) store16(out + c * 16, v);
}

__global__ void swizzle_kernel(const uint8_t* in, int64_t rows, int64_t cols, int64_t pcols,
                               bool forward, uint8_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols, o = swizzle_offset(r, c, pcols);
  if (forward) out[o] = in[i];
  else out[i] = in[o];
}

int64_t blocks_for(int64_t n, int threads) { return (n + threads - 1) / threads; }

at::Tensor nvfp4_dequantize_cuda(const at::Tensor& qdata, const at::Tensor& scale,
                                 const at::Tensor& amax, int64_t bound, at::ScalarType dtype) {
  const char* op = "qtensor.nvfp4_dequantize";
  check_nv_dequant(qdata, scale, amax, bound, op);
  check_out_dtype(dtype, op);
  const c10::cuda::CUDAGuard guard(qdata.device());
  const int64_t R = qdata.size(0), C = qdata.size(1) * 2;
  at::Tensor out = at::empty({R, C}, qdata.options().dtype(dtype));
  const at::Tensor q = qdata.contiguous(), s = scale.contiguous().view(at::kByte), a = amax.contiguous();
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    nv_dequant_kernel<T><<<blocks_for(R * (C / 16), 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        q.const_data_ptr<uint8_t>(), s.const_data_ptr<uint8_t>(), a.const_data_ptr<float>(),
        amax.dim() == 1, 1.f / static_cast<float>(6 * bound), R, C, out.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor mxfp8_dequantize_cuda(const at::Tensor& qdata, const at::Tensor& scale, bool columnwise,
                                 at::ScalarType dtype) {
  const char* op = "qtensor.mxfp8_dequantize";
  check_mx_dequant(qdata, scale, columnwise, op);
  check_out_dtype(dtype, op);
  TORCH_CHECK(qdata.size(-1) % 16 == 0, op, ": the CUDA kernel needs the last dim divisible by 16; got ",
              shape_str(qdata), ".");
  const c10::cuda::CUDAGuard guard(qdata.device());
  const at::Tensor q = as_aligned_2d(qdata.view(at::kByte)), s = scale.contiguous().view(at::kByte);
  at::Tensor out = at::empty(qdata.sizes(), qdata.options().dtype(dtype));
  const int64_t K = qdata.size(-1), M = qdata.numel() / K;
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    mx_dequant_kernel<T><<<blocks_for(M * K / 16, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        q.const_data_ptr<uint8_t>(), s.const_data_ptr<uint8_t>(), columnwise, M, K, out.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor mxfp4_fake_quantize_cuda(const at::Tensor& w) {
  const char* op = "qtensor.mxfp4_fake_quantize";
  check_mxfp4_input(w, op);
  const c10::cuda::CUDAGuard guard(w.device());
  const at::Tensor wc = as_aligned_2d(w);
  at::Tensor out = at::empty(w.sizes(), w.options());
  dispatch_float(w.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    mxfp4_kernel<T><<<blocks_for(w.numel() / 16, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        wc.const_data_ptr<T>(), w.numel(), out.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor swizzle_cuda(const at::Tensor& scale, bool forward, int64_t rows, int64_t cols) {
  const c10::cuda::CUDAGuard guard(scale.device());
  const int64_t pr = round_up(rows, 128), pc = round_up(cols, 4);
  const at::Tensor s = scale.contiguous().view(at::kByte);
  at::Tensor out = forward ? at::zeros({pr, pc}, s.options()) : at::empty({rows, cols}, s.options());
  swizzle_kernel<<<blocks_for(rows * cols, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      s.const_data_ptr<uint8_t>(), rows, cols, pc, forward, out.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out.view(scale.scalar_type());
}

at::Tensor swizzle_scale_cuda(const at::Tensor& scale) {
  check_scale_bytes(scale, "qtensor.swizzle_scale");
  return swizzle_cuda(scale, true, scale.size(0), scale.size(1));
}

at::Tensor unswizzle_scale_cuda(const at::Tensor& scale, int64_t rows, int64_t cols) {
  const char* op = "qtensor.unswizzle_scale";
  check_scale_bytes(scale, op);
  TORCH_CHECK(scale.size(0) == round_up(rows, 128) && scale.size(1) == round_up(cols, 4), op,
              ": a swizzled scale of ", num(rows), "x", num(cols), " is ", num(round_up(rows, 128)), "x",
              num(round_up(cols, 4)), " (rows padded to 128, columns to 4); got ", shape_str(scale),
              ".");
  return swizzle_cuda(scale, false, rows, cols);
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CUDA, m) {
  m.impl("amax", &amax_cuda);
  m.impl("nvfp4_quantize", &nvfp4_quantize_cuda);
  m.impl("mxfp8_quantize", &mxfp8_quantize_cuda);
  m.impl("hybrid_quantize", &hybrid_quantize_cuda);
  m.impl("nvfp4_dequantize", &nvfp4_dequantize_cuda);
  m.impl("mxfp8_dequantize", &mxfp8_dequantize_cuda);
  m.impl("mxfp4_fake_quantize", &mxfp4_fake_quantize_cuda);
  m.impl("swizzle_scale", &swizzle_scale_cuda);
  m.impl("unswizzle_scale", &unswizzle_scale_cuda);
}

}  // namespace qtensor
