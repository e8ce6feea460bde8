// Rowwise CUDA quantizers (quant_rows_cuda.cu): blocks along the contiguous last dim need no
// shared-memory tile, so each thread reads its own blocks with 16-byte loads and writes its codes
// with one vector store. quant_cuda.cu validates the arguments, allocates the outputs and routes
// here; every other mode (columnwise, RHT, stochastic rounding, fused MXFP8) stays there.
// The amax ops of convert_cuda.cu call in here too.
#pragma once

#include <ATen/ATen.h>

namespace qtensor {

// NVFP4 rowwise of the contiguous, 16-byte aligned [M, K] x2 (K % 16 == 0): plain (fourover6 0)
// or 4over6 (1 MAE, 2 MSE); amax is a scalar or one per row. q [M, K/2], s [M, K/16] uint8.
void nvfp4_rows_cuda(const at::Tensor& x2, const at::Tensor& amax, int64_t fourover6, int64_t bound,
                     at::Tensor& q, at::Tensor& s);

// NVFP4 rowwise codes under one scale per 16x16 tile (block_2d, round to nearest) of x2 [M, K]
// (M % 16 == 0, K % 16 == 0), one tensor amax: plain (fourover6 0) or 4over6 (1 MAE, 2 MSE).
// q [M, K/2], s [M, K/16] uint8.
void nvfp4_rows_2d_cuda(const at::Tensor& x2, const at::Tensor& amax, int64_t fourover6, int64_t bound,
                        at::Tensor& q, at::Tensor& s);

// MXFP8 rowwise of x2 (K % 32 == 0): q [M, K] and s [M, K/32] uint8, any shape with those numels.
void mxfp8_rows_cuda(const at::Tensor& x2, int64_t rule, at::Tensor& q, at::Tensor& s);

// max |x| of x2 into out (fp32, zero-initialised): one value, or one per row of x2.
void amax_rows_cuda(const at::Tensor& x2, bool per_row, at::Tensor& out);

// quant_cuda.cu's: the one max |rht16| over the 16-runs down the columns of the bf16 x2 [M, K]
// (M % 16 == 0, K % 16 == 0) into out (fp32 scalar, zero-initialised), by the tile kernel, whose
// cp.async ring keeps the loads in flight while the runs are transformed.
void rht_amax_tiles_cuda(const at::Tensor& x2, at::Tensor& out);

}  // namespace qtensor
