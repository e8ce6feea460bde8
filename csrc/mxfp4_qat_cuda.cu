// MXFP4 weight QAT, CUDA: fused projection + host quantization from one read of the weight.
// Schemas in registration.cpp; reference qtensor/qat/convert.py; math mxfp4_qat_math.h (shared
// with mxfp4_qat.cpp). Built with --fmad=false, so every fp32 operation rounds like the reference.
//
// Layout of the work: a lane holds 4 consecutive elements of a row, so 8 lanes hold one 32-wide
// MXFP4 block and a warp one 128-wide row segment; block amaxes are 8-lane shuffle reductions.
//   mxfp8 kernel: a CTA covers 32 rows x 128 columns. Rowwise bytes go out straight from
//     registers; w^ is staged in shared memory (16 KiB) for the 32x1 columnwise amaxes.
//   fp8_block kernel: a CTA covers one 128x128 tile, 16 rows per warp kept in registers; the tile
//     exponent / amax is a CTA reduction, then the payloads are written.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "mxfp4_qat_math.h"

namespace qtensor {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSeg = 128;  // columns per CTA row segment (4 MXFP4 blocks)
constexpr unsigned kFull = 0xFFFFFFFFu;

__device__ __forceinline__ void load4(const float* p, float* o) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void load4(const at::BFloat16* p, float* o) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xFFFF0000u);
  o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xFFFF0000u);
}

__device__ __forceinline__ uint32_t pack4(const uint8_t* b) {
  return uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
}

// 8-lane (one MXFP4 block) reductions.
__device__ __forceinline__ float group_amax(float m) {
  for (int o = 1; o < 8; o <<= 1) m = nan_max(m, __shfl_xor_sync(kFull, m, o));
  return m;
}

// Decompose a lane's 4 elements: q values, block exponent, poison flag, projected values.
struct Lane4 {
  float q[4], v[4];
  int e;
  bool bad;
};

__device__ __forceinline__ Lane4 decompose4(const float* w) {
  Lane4 r;
  float m = 0.f;
  for (int i = 0; i < 4; ++i) m = nan_max(m, abs_f(w[i]));
  m = group_amax(m);
  r.e = mxfp4_exponent(m);
  r.bad = mx4_bad(m);
  for (int i = 0; i < 4; ++i) {
    r.q[i] = mx4_q(w[i], r.e);
    r.v[i] = r.bad ? __uint_as_float(0x7FC00000u) : r.q[i] * pow2f(r.e);
  }
  return r;
}

// ---- MXFP8 host ----------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) mxfp8_kernel(const T* __restrict__ w, int64_t N,
                                                         int64_t K, bool direct, bool rowwise,
                                                         bool columnwise, uint8_t* rq, uint8_t* rs,
                                                         uint8_t* cq, uint8_t* cs) {
  __shared__ float tile[32][kSeg + 1];
  __shared__ uint32_t col_code[kSeg];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = int64_t(blockIdx.y) * 32, c0 = int64_t(blockIdx.x) * kSeg;
  const int64_t col = c0 + lane * 4;
  const bool active = col < K;  // K % 32 == 0, so whole 8-lane groups are in or out
  for (int rr = warp; rr < 32; rr += kWarps) {
    const int64_t r = r0 + rr;
    if (r >= N) break;  // rowwise-only launches allow N % 32 != 0 (uniform per warp)
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (active) load4(w + r * K + col, x);
    const Lane4 d = decompose4(x);
    float m = 0.f;
    for (int i = 0; i < 4; ++i) m = nan_max(m, abs_f(d.v[i]));
    m = group_amax(m);
    if (columnwise)
      for (int i = 0; i < 4; ++i) tile[rr][lane * 4 + i] = d.v[i];
    if (!rowwise || !active) continue;
    const uint32_t code = direct ? mx4_direct_code(d.e, d.bad) : mx_scale_code(m, 0);
    uint8_t b[4];
    for (int i = 0; i < 4; ++i)
      b[i] = direct ? mx4_direct_payload(d.q[i], d.e, code) : host_payload(d.v[i], code);
    *reinterpret_cast<uint32_t*>(rq + r * K + col) = pack4(b);
    if (lane % 8 == 0) rs[r * (K / kMxBlock) + col / kMxBlock] = static_cast<uint8_t>(code);
  }
  if (!columnwise) return;
  __syncthreads();
  if (threadIdx.x < kSeg && c0 + threadIdx.x < K) {
    float m = 0.f;
    for (int rr = 0; rr < 32; ++rr) m = nan_max(m, abs_f(tile[rr][threadIdx.x]));
    col_code[threadIdx.x] = mx_scale_code(m, 0);
    cs[(r0 / 32) * K + c0 + threadIdx.x] = static_cast<uint8_t>(col_code[threadIdx.x]);
  }
  __syncthreads();
  if (!active) return;
  for (int rr = warp; rr < 32; rr += kWarps) {
    uint8_t b[4];
    for (int i = 0; i < 4; ++i) b[i] = host_payload(tile[rr][lane * 4 + i], col_code[lane * 4 + i]);
    *reinterpret_cast<uint32_t*>(cq + (r0 + rr) * K + col) = pack4(b);
  }
}

// ---- FP8 128x128 host ----------------------------------------------------------------------------

constexpr int kRowsPerWarp = kFbTile / kWarps;  // 16

template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_block_kernel(const T* __restrict__ w, int64_t K,
                                                             bool direct, uint8_t* q_out,
                                                             float* s_out) {
  __shared__ int s_max_e[kWarps];
  __shared__ int s_bad[kWarps];
  __shared__ float s_amax[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t tr = blockIdx.y, tc = blockIdx.x;
  const int64_t col = tc * kFbTile + lane * 4;
  float x[kRowsPerWarp][4];
  int max_e = -126, bad = 0;
  float amax_hat = 0.f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = tr * kFbTile + warp * kRowsPerWarp + i;
    load4(w + r * K + col, x[i]);
    const Lane4 d = decompose4(x[i]);
    max_e = d.e > max_e ? d.e : max_e;
    bad |= d.bad;
    for (int j = 0; j < 4; ++j) amax_hat = nan_max(amax_hat, abs_f(d.v[j]));
  }
  for (int o = 16; o >= 1; o >>= 1) {
    max_e = max(max_e, __shfl_xor_sync(kFull, max_e, o));
    bad |= __shfl_xor_sync(kFull, bad, o);
    amax_hat = nan_max(amax_hat, __shfl_xor_sync(kFull, amax_hat, o));
  }
  if (lane == 0) {
    s_max_e[warp] = max_e;
    s_bad[warp] = bad;
    s_amax[warp] = amax_hat;
  }
  __syncthreads();
  max_e = s_max_e[0];
  bad = s_bad[0];
  amax_hat = s_amax[0];
  for (int i = 1; i < kWarps; ++i) {
    max_e = max(max_e, s_max_e[i]);
    bad |= s_bad[i];
    amax_hat = nan_max(amax_hat, s_amax[i]);
  }
  const int t = fb_tile_exponent(max_e);
  const uint32_t code = mx_scale_code(amax_hat, 0);
  if (threadIdx.x == 0) {
    s_out[tr * gridDim.x + tc] = bad ? __uint_as_float(0x7FC00000u)
                                     : (direct ? pow2f(t) : mx_scale_value(static_cast<uint8_t>(code)));
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = tr * kFbTile + warp * kRowsPerWarp + i;
    const Lane4 d = decompose4(x[i]);
    uint8_t b[4];
    for (int j = 0; j < 4; ++j) {
      b[j] = bad ? kE4m3NaN
                 : (direct ? fb_direct_payload(d.q[j], d.e, t) : host_payload(d.v[j], code));
    }
    *reinterpret_cast<uint32_t*>(q_out + r * K + col) = pack4(b);
  }
}

// ---- host wrappers -------------------------------------------------------------------------------


// The vector loads need 16-byte aligned rows; a view at an odd storage offset is copied.
at::Tensor aligned_contiguous(const at::Tensor& w) {
  at::Tensor c = w.contiguous();
  return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 ? c.clone() : c;
}

template <typename F>
void with_dtype(const at::Tensor& w, F&& f) {
  if (w.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mxfp4_qat_mxfp8_cuda(
    const at::Tensor& w_in, bool direct, bool rowwise, bool columnwise) {
  check_qat_weight(w_in, columnwise ? kMxBlock : 1, kMxBlock, "qtensor.mxfp4_qat_mxfp8");
  const c10::cuda::CUDAGuard guard(w_in.device());
  const at::Tensor w = aligned_contiguous(w_in);
  const int64_t N = w.size(0), K = w.size(1);
  auto u8 = w.options().dtype(at::kByte);
  at::Tensor rq = rowwise ? at::empty({N, K}, u8) : at::empty({0}, u8);
  at::Tensor rs = rowwise ? at::empty({N, K / kMxBlock}, u8) : at::empty({0}, u8);
  at::Tensor cq = columnwise ? at::empty({N, K}, u8) : at::empty({0}, u8);
  at::Tensor cs = columnwise ? at::empty({N / kMxBlock, K}, u8) : at::empty({0}, u8);
  const dim3 grid((K + kSeg - 1) / kSeg, (N + 31) / 32);
  if (N > 0 && K > 0 && (rowwise || columnwise)) {
    with_dtype(w, [&](auto tag) {
      using T = decltype(tag);
      mxfp8_kernel<T><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          w.const_data_ptr<T>(), N, K, direct, rowwise, columnwise, rq.data_ptr<uint8_t>(),
          rs.data_ptr<uint8_t>(), cq.data_ptr<uint8_t>(), cs.data_ptr<uint8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {rq.view(at::kFloat8_e4m3fn), rs.view(at::kFloat8_e8m0fnu),
          cq.view(at::kFloat8_e4m3fn), cs.view(at::kFloat8_e8m0fnu)};
}

std::tuple<at::Tensor, at::Tensor> mxfp4_qat_fp8_block_cuda(const at::Tensor& w_in, bool direct) {
  check_qat_weight(w_in, kFbTile, kFbTile, "qtensor.mxfp4_qat_fp8_block");
  const c10::cuda::CUDAGuard guard(w_in.device());
  const at::Tensor w = aligned_contiguous(w_in);
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor qd = at::empty({N, K}, w.options().dtype(at::kByte));
  at::Tensor sc = at::empty({N / kFbTile, K / kFbTile}, w.options().dtype(at::kFloat));
  const dim3 grid(K / kFbTile, N / kFbTile);
  with_dtype(w, [&](auto tag) {
    using T = decltype(tag);
    fp8_block_kernel<T><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        w.const_data_ptr<T>(), K, direct, qd.data_ptr<uint8_t>(), sc.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {qd.view(at::kFloat8_e4m3fn), sc};
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CUDA, m) {
  m.impl("mxfp4_qat_mxfp8", &mxfp4_qat_mxfp8_cuda);
  m.impl("mxfp4_qat_fp8_block", &mxfp4_qat_fp8_block_cuda);
}

}  // namespace qtensor
