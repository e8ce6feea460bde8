// MXFP4 weight QAT, CPU: fused projection + host quantization from one read of the weight.
// Schemas in registration.cpp; reference qtensor/qat/convert.py; math mxfp4_qat_math.h.
//   mxfp4_qat_mxfp8: 32x32 tiles (one MXFP4 block per row of a tile), rowwise MXFP8 bytes
//     (projection: RCEIL of w^; direct: the fixed shift of 6) and columnwise MXFP8 bytes (a
//     fresh 32x1 RCEIL quantization of w^ in both modes).
//   mxfp4_qat_fp8_block: 128x128 tiles, one fp32 power-of-two scale each (projection: RCEIL of
//     the tile amax of w^; direct: per-tile exponent folding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "mxfp4_qat_math.h"

namespace qtensor {
namespace {

using Quad = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;


template <typename T>
void with_weight(const at::Tensor& w, const char* op, T&& f) {
  if (w.scalar_type() == at::kFloat) {
    f(w.const_data_ptr<float>());
  } else {
    f(w.const_data_ptr<at::BFloat16>());
  }
}

// One 32-element MXFP4 block of row `r` starting at column `c0`: q values, exponent, poison.
template <typename T>
void load_block(const T* p, int64_t K, int64_t r, int64_t c0, float* q, int* e, bool* bad) {
  float w[kMxBlock];
  float m = 0.f;
  for (int i = 0; i < kMxBlock; ++i) {
    w[i] = static_cast<float>(p[r * K + c0 + i]);
    m = nan_max(m, abs_f(w[i]));
  }
  *e = mxfp4_exponent(m);
  *bad = mx4_bad(m);
  for (int i = 0; i < kMxBlock; ++i) q[i] = mx4_q(w[i], *e);
}

Quad mxfp4_qat_mxfp8_cpu(const at::Tensor& w_in, bool direct, bool rowwise, bool columnwise) {
  const char* op = "qtensor.mxfp4_qat_mxfp8";
  check_qat_weight(w_in, columnwise ? kMxBlock : 1, kMxBlock, op);
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto u8 = w.options().dtype(at::kByte);
  // A side not asked for comes back as an empty 1-D tensor.
  at::Tensor rq = rowwise ? at::empty({N, K}, u8) : at::empty({0}, u8);
  at::Tensor rs = rowwise ? at::empty({N, K / kMxBlock}, u8) : at::empty({0}, u8);
  at::Tensor cq = columnwise ? at::empty({N, K}, u8) : at::empty({0}, u8);
  at::Tensor cs = columnwise ? at::empty({N / kMxBlock, K}, u8) : at::empty({0}, u8);
  uint8_t *rqp = rq.data_ptr<uint8_t>(), *rsp = rs.data_ptr<uint8_t>();
  uint8_t *cqp = cq.data_ptr<uint8_t>(), *csp = cs.data_ptr<uint8_t>();
  const int64_t row_groups = columnwise ? N / kMxBlock : N;
  const int group = columnwise ? kMxBlock : 1;
  with_weight(w, op, [&](auto p) {
    at::parallel_for(0, row_groups, 1, [&](int64_t gb, int64_t ge) {
      float v[kMxBlock][kMxBlock];  // w^ of one 32x32 tile (rows of the group, one block wide)
      for (int64_t g = gb; g < ge; ++g) {
        for (int64_t c0 = 0; c0 < K; c0 += kMxBlock) {
          for (int rr = 0; rr < group; ++rr) {
            const int64_t r = g * group + rr;
            float q[kMxBlock];
            int e;
            bool bad;
            load_block(p, K, r, c0, q, &e, &bad);
            float m = 0.f;
            for (int i = 0; i < kMxBlock; ++i) {
              v[rr][i] = bad ? u2f(0x7FC00000u) : q[i] * pow2f(e);
              m = nan_max(m, abs_f(v[rr][i]));
            }
            if (!rowwise) continue;
            const uint32_t code = direct ? mx4_direct_code(e, bad) : mx_scale_code(m, 0);
            rsp[r * (K / kMxBlock) + c0 / kMxBlock] = static_cast<uint8_t>(code);
            for (int i = 0; i < kMxBlock; ++i)
              rqp[r * K + c0 + i] = direct ? mx4_direct_payload(q[i], e, code)
                                           : host_payload(v[rr][i], code);
          }
          if (!columnwise) continue;
          for (int i = 0; i < kMxBlock; ++i) {  // column c0 + i over the group's 32 rows
            float m = 0.f;
            for (int rr = 0; rr < kMxBlock; ++rr) m = nan_max(m, abs_f(v[rr][i]));
            const uint32_t code = mx_scale_code(m, 0);
            csp[g * K + c0 + i] = static_cast<uint8_t>(code);
            for (int rr = 0; rr < kMxBlock; ++rr)
              cqp[(g * kMxBlock + rr) * K + c0 + i] = host_payload(v[rr][i], code);
          }
        }
      }
    });
  });
  return {rq.view(at::kFloat8_e4m3fn), rs.view(at::kFloat8_e8m0fnu),
          cq.view(at::kFloat8_e4m3fn), cs.view(at::kFloat8_e8m0fnu)};
}

// One 128x128 tile: decompose its 512 MXFP4 blocks, choose the tile scale, write the payloads.
template <typename T>
void fp8_block_tile(const T* p, int64_t K, int64_t tr, int64_t tc, bool direct, uint8_t* qo,
                    float* so) {
  constexpr int kBlocks = kFbTile / kMxBlock;
  std::vector<float> q(kFbTile * kFbTile), v(kFbTile * kFbTile);
  int e[kFbTile][kBlocks];
  int max_e = -126;
  bool bad_tile = false;
  float amax_hat = 0.f;
  for (int r = 0; r < kFbTile; ++r) {
    for (int b = 0; b < kBlocks; ++b) {
      float* qb = &q[r * kFbTile + b * kMxBlock];
      bool bad;
      load_block(p, K, tr * kFbTile + r, tc * kFbTile + b * kMxBlock, qb, &e[r][b], &bad);
      bad_tile |= bad;
      max_e = e[r][b] > max_e ? e[r][b] : max_e;
      for (int i = 0; i < kMxBlock; ++i) {
        const float val = bad ? u2f(0x7FC00000u) : qb[i] * pow2f(e[r][b]);
        v[r * kFbTile + b * kMxBlock + i] = val;
        amax_hat = nan_max(amax_hat, abs_f(val));
      }
    }
  }
  const int t = fb_tile_exponent(max_e);
  const uint32_t code = mx_scale_code(amax_hat, 0);
  *so = bad_tile ? u2f(0x7FC00000u) : (direct ? pow2f(t) : mx_scale_value(static_cast<uint8_t>(code)));
  for (int r = 0; r < kFbTile; ++r) {
    uint8_t* row = qo + (tr * kFbTile + r) * K + tc * kFbTile;
    for (int j = 0; j < kFbTile; ++j) {
      const int idx = r * kFbTile + j;
      if (bad_tile) {
        row[j] = kE4m3NaN;
      } else {
        row[j] = direct ? fb_direct_payload(q[idx], e[r][j / kMxBlock], t) : host_payload(v[idx], code);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> mxfp4_qat_fp8_block_cpu(const at::Tensor& w_in, bool direct) {
  const char* op = "qtensor.mxfp4_qat_fp8_block";
  check_qat_weight(w_in, kFbTile, kFbTile, op);
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), TN = N / kFbTile, TK = K / kFbTile;
  at::Tensor qd = at::empty({N, K}, w.options().dtype(at::kByte));
  at::Tensor sc = at::empty({TN, TK}, w.options().dtype(at::kFloat));
  uint8_t* qp = qd.data_ptr<uint8_t>();
  float* sp = sc.data_ptr<float>();
  with_weight(w, op, [&](auto p) {
    at::parallel_for(0, TN * TK, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) fp8_block_tile(p, K, t / TK, t % TK, direct, qp, sp + t);
    });
  });
  return {qd.view(at::kFloat8_e4m3fn), sc};
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CPU, m) {
  m.impl("mxfp4_qat_mxfp8", &mxfp4_qat_mxfp8_cpu);
  m.impl("mxfp4_qat_fp8_block", &mxfp4_qat_fp8_block_cpu);
}

}  // namespace qtensor
