// CUDA kernels of the qtensor ops that are not quantizers: amax (one, per row, per column, after
// RHT), NVFP4 and MXFP8 dequantization, the MXFP4 projection, and the block-scale swizzle. The
// math is quant_math.h, shared with the CPU kernels; built with --fmad=false like quant_cuda.cu.
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

// ---- amax ---------------------------------------------------------------------------------------

constexpr int kAmaxPanels = 2;  // 16-row panels per warp: 32 rows (enough blocks to fill 132 SMs)

// The warp of these kernels' first CTAs that takes the input's last panels (the amax walks back:
// quant_rows_cuda.cu), of `col_groups` warps a band of 16*kAmaxPanels rows; -1 past the last.
__device__ __forceinline__ int64_t amax_warp_back(int64_t M, int64_t col_groups) {
  const int64_t warps = (M + 16 * kAmaxPanels - 1) / (16 * kAmaxPanels) * col_groups;
  return warps - 1 - ((static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5);
}

// One warp covers 16*kAmaxPanels rows x (32 lanes x one 16-byte vector) columns. mode 0: one
// amax; 1: per input row; 2: per input column (the columnwise per-row amax). Non-negative floats
// order like their bits, and NaN's bits (after abs) sit above inf, so atomicMax on the bits is
// torch.amax, NaN included.
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t M, int64_t K, int mode,
                                                        unsigned* out) {
  constexpr int kN = Vec<T>::kN;
  const int lane = threadIdx.x & 31;
  const int64_t col_groups = (K + 32 * kN - 1) / (32 * kN);
  const int64_t warp = amax_warp_back(M, col_groups);
  if (warp < 0) return;  // whole warp: uniform
  const int64_t r0 = (warp / col_groups) * 16 * kAmaxPanels;
  const int64_t k = (warp % col_groups) * 32 * kN + lane * kN;
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
      raw[i] = (kin && rb + i < M) ? __ldg(reinterpret_cast<const uint4*>(x + (rb + i) * K + k))
                                   : make_uint4(0u, 0u, 0u, 0u);
    float rmax[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) rmax[i] = 0.f;
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

// The amax after RHT (columnwise: 16-runs down each column) of fp16 and fp32 inputs, and per
// column (bf16's one amax runs in quant_cuda.cu's tile kernel, rht_amax_tiles_cuda). Lane l of a
// warp takes columns 2l and 2l+1 of 64, one 4- or 8-byte word per row, so that a lane holds 16
// words and one 16-run at a time in registers (with 8 columns a lane, the fp64 fallback's
// registers left one CTA per SM).
// mode 0: one amax; 2: one per input column.
template <typename T>
__global__ void __launch_bounds__(kThreads) rht_amax_kernel(const T* x, int64_t M, int64_t K, int mode,
                                                            unsigned* out) {
  using Word = typename PairWord<T>::Word;
  const int lane = threadIdx.x & 31;
  const int64_t col_groups = (K + 63) / 64;
  const int64_t warp = amax_warp_back(M, col_groups);
  if (warp < 0) return;  // whole warp: uniform
  const int64_t r0 = (warp / col_groups) * 16 * kAmaxPanels;
  const int64_t k = (warp % col_groups) * 64 + 2 * lane;
  const bool kin = k < K;  // K % 16 == 0: both columns or neither
  float cmax[2] = {0.f, 0.f};
  for (int p = 0; p < kAmaxPanels; ++p) {
    const int64_t rb = r0 + p * 16;
    if (rb >= M) break;
    // One address per panel and a row stride in words: a whole panel (every one but the last
    // of a ragged M) loads without a bound test per row. Rows past M read as zeros, whose
    // transform is zero, so they leave the maxima alone.
    Word raw[16];
    const Word* src = reinterpret_cast<const Word*>(x + rb * K + k);
    const int64_t row_words = K / 2;
    if (kin && rb + 16 <= M) {
#pragma unroll
      for (int i = 0; i < 16; ++i) raw[i] = __ldg(src + i * row_words);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) raw[i] = (kin && rb + i < M) ? __ldg(src + i * row_words) : Word{};
    }
    if constexpr (std::is_same_v<T, at::BFloat16>) {  // both runs at once, packed maxima
      const uint32_t m = rht16x2_bf16_absmax(raw);
      cmax[0] = nan_max(cmax[0], u2f(m << 16));
      cmax[1] = nan_max(cmax[1], u2f(m & 0xFFFF0000u));
    } else {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = c ? PairWord<T>::hi(raw[i]) : PairWord<T>::lo(raw[i]);
        rht16(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) cmax[c] = nan_max(cmax[c], abs_f(v[i]));
      }
    }
  }
  if (mode == 2) {
    if (kin) {
      atomicMax(out + k, f2u(cmax[0]));
      atomicMax(out + k + 1, f2u(cmax[1]));
    }
  } else {
    float gmax = nan_max(cmax[0], cmax[1]);
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
  at::Tensor out = per_row ? at::empty({s.R}, x.options().dtype(at::kFloat))
                           : at::empty({}, x.options().dtype(at::kFloat));
  const at::Tensor x2 = as_aligned_2d(x);
  const int mode = !per_row ? 0 : (columnwise ? 2 : 1);
  // Every kernel below but the per-input-row one takes atomic maxima of the bits, from 0 (the
  // bits of every |x| are >= 0). They start from a memset of the output, one driver call, rather
  // than at::zeros, whose fill kernel costs a dispatch and a launch: at a kernel of some 20 us
  // that host time is what a call waits for. The per-input-row kernel writes each row once.
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (rht || mode != 1)
    C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr<float>(), 0, sizeof(float) * out.numel(), stream));
  if (!rht && mode != 2) {  // one amax or one per input row: streamed, no 16-row panels
    amax_rows_cuda(x2, per_row, out);
    return out;
  }
  if (rht && mode == 0 && x.scalar_type() == at::kBFloat16) {  // the gradients' scale: the tile kernel
    rht_amax_tiles_cuda(x2, out);
    return out;
  }
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = Vec<T>::kN;
    const int64_t panels = (s.M + 16 * kAmaxPanels - 1) / (16 * kAmaxPanels);
    const int64_t warps = panels * (rht ? (s.K + 63) / 64 : (s.K + 32 * kN - 1) / (32 * kN));
    const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
    auto* o = reinterpret_cast<unsigned*>(out.data_ptr<float>());
    if (rht) rht_amax_kernel<T><<<blocks, kThreads, 0, stream>>>(x2.const_data_ptr<T>(), s.M, s.K, mode, o);
    else amax_kernel<T><<<blocks, kThreads, 0, stream>>>(x2.const_data_ptr<T>(), s.M, s.K, mode, o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---- dequantize, MXFP4, swizzle -----------------------------------------------------------------


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
  m.impl("nvfp4_dequantize", &nvfp4_dequantize_cuda);
  m.impl("mxfp8_dequantize", &mxfp8_dequantize_cuda);
  m.impl("mxfp4_fake_quantize", &mxfp4_fake_quantize_cuda);
  m.impl("swizzle_scale", &swizzle_scale_cuda);
  m.impl("unswizzle_scale", &unswizzle_scale_cuda);
}

}  // namespace qtensor
