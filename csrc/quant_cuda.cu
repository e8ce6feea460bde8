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
#include "cuda_vec.cuh"
#include "quant_math.h"
#include "quant_rows.h"

namespace qtensor {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;  // tile side, elements

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

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CUDA, m) {
  m.impl("nvfp4_quantize", &nvfp4_quantize_cuda);
  m.impl("mxfp8_quantize", &mxfp8_quantize_cuda);
  m.impl("hybrid_quantize", &hybrid_quantize_cuda);
}

}  // namespace qtensor
