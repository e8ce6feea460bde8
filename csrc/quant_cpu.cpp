// CPU kernels of every qtensor op: plain C++ loops over 16x16 tiles and 32-element blocks,
// parallel over rows with at::parallel_for. The math is quant_math.h, shared with CUDA; the
// rowwise NVFP4 and MXFP8 paths use its SIMD-lane forms (quant_cpu_math.h) and the block
// functions of quant_rows_math.h, all equal to the general functions bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "quant_cpu_math.h"
#include "quant_math.h"
#include "quant_rows_math.h"

namespace qtensor {

// bf16 -> fp32 is the 16 bits shifted up (c10 does the same, one element per call); fp32 and
// fp16 use the ordinary conversion. Forced inline so each row-function clone inlines it.
template <typename T>
QT_LANES float to_f32(T v) {
  return static_cast<float>(v);
}
template <>
QT_LANES float to_f32(at::BFloat16 v) {
  return u2f(static_cast<uint32_t>(v.x) << 16);
}

namespace {

// x86 returns the first NaN operand of a product, so the reference's `x * inv` keeps the sign of
// a NaN x (and its E4M3 byte is 0xFF for -NaN); spelled out so the compiler cannot swap operands.
inline float mul_keep_nan(float x, float inv) { return is_nan(x) ? x : x * inv; }

// Element (i, j) of the quantized matrix, over any strides of the input [M, K].
template <typename T>
struct QView {
  const T* p;
  int64_t sr, sc;
  float at(int64_t i, int64_t j) const { return to_f32(p[i * sr + j * sc]); }
};

template <typename T>
QView<T> q_view(const at::Tensor& x2, bool columnwise) {
  const T* p = x2.const_data_ptr<T>();
  return columnwise ? QView<T>{p, x2.stride(1), x2.stride(0)} : QView<T>{p, x2.stride(0), x2.stride(1)};
}

// Rows i0 .. i0+nr of the quantized matrix, columns j0 .. j0+16, as fp32 (RHT applied per run).
template <typename T>
void load_tile(const QView<T>& v, int64_t i0, int nr, int64_t j0, bool rht, float (*buf)[16]) {
  for (int r = 0; r < nr; ++r) {
    if (v.sc == 1) {  // rowwise contiguous rows: a plain converting copy the compiler vectorizes
      const T* p = v.p + (i0 + r) * v.sr + j0;
      for (int c = 0; c < 16; ++c) buf[r][c] = to_f32(p[c]);
    } else {
      for (int c = 0; c < 16; ++c) buf[r][c] = v.at(i0 + r, j0 + c);
    }
    if (rht) rht16(buf[r]);
  }
}

// ---- amax -------------------------------------------------------------------------------------

// max |p[i]| over n contiguous values: an int32 max of the sign-cleared patterns (vectorizes;
// NaN lies above inf, so a NaN anywhere gives a NaN).
template <typename T>
float absmax_run(const T* p, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = static_cast<int32_t>(f2u(to_f32(p[i]))) & 0x7FFFFFFF;
    m = a > m ? a : m;
  }
  return u2f(static_cast<uint32_t>(m));
}

template <typename T>
float flat_amax(const T* p, int64_t n) {
  return at::parallel_reduce(
      0, n, 1 << 16, 0.f,
      [&](int64_t b, int64_t e, float m) { return nan_max(m, absmax_run(p + b, e - b)); }, nan_max);
}

at::Tensor amax_cpu(const at::Tensor& x, bool columnwise, bool rht, bool per_row) {
  const char* op = "qtensor.amax";
  const NvShape s = nv_shape(x, columnwise, false, op);
  TORCH_CHECK(!rht || columnwise, op, ": RHT applies only to columnwise operands.");
  at::Tensor out = per_row ? at::zeros({s.R}, x.options().dtype(at::kFloat))
                           : at::zeros({}, x.options().dtype(at::kFloat));
  const at::Tensor x2 = x.reshape({s.M, s.K});
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    if (!per_row && !rht && x2.is_contiguous()) {
      out.fill_(flat_amax(x2.const_data_ptr<T>(), x2.numel()));
      return;
    }
    if (per_row && !columnwise && x2.stride(1) == 1) {  // rows along the contiguous last dim
      const T* p = x2.const_data_ptr<T>();
      float* o = out.data_ptr<float>();
      at::parallel_for(0, s.R, 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) o[i] = absmax_run(p + i * x2.stride(0), s.C);
      });
      return;
    }
    const auto v = q_view<T>(x2, columnwise);
    const int64_t ntiles = (s.R + 15) / 16;
    auto tile_rows = [&](int64_t t, float* m) {  // per-row max of quantized rows 16t .. 16t+15
      float buf[16][16];
      const int nr = static_cast<int>(std::min<int64_t>(16, s.R - t * 16));
      for (int r = 0; r < 16; ++r) m[r] = 0.f;
      for (int64_t jb = 0; jb < s.C / 16; ++jb) {
        load_tile(v, t * 16, nr, jb * 16, rht, buf);
        for (int r = 0; r < nr; ++r)
          for (int c = 0; c < 16; ++c) m[r] = nan_max(m[r], abs_f(buf[r][c]));
      }
      return nr;
    };
    if (per_row) {
      float* o = out.data_ptr<float>();
      at::parallel_for(0, ntiles, 1, [&](int64_t b, int64_t e) {
        float m[16];
        for (int64_t t = b; t < e; ++t) {
          const int nr = tile_rows(t, m);
          std::copy(m, m + nr, o + t * 16);
        }
      });
    } else {
      out.fill_(at::parallel_reduce(
          0, ntiles, 1, 0.f,
          [&](int64_t b, int64_t e, float acc) {
            float m[16];
            for (int64_t t = b; t < e; ++t) {
              const int nr = tile_rows(t, m);
              for (int r = 0; r < nr; ++r) acc = nan_max(acc, m[r]);
            }
            return acc;
          },
          nan_max));
    }
  });
  return out;
}

// ---- NVFP4 ------------------------------------------------------------------------------------

struct NvOpts {
  bool block_2d;
  int fourover6;  // 0 off, 1 MAE, 2 MSE
  int bound;
  bool sr;
  uint32_t key, offset;
};

// Input-domain error of one candidate scale on one 16-element row block (docs/formats.md,
// "Variants", 4over6).
float candidate_error(const float* x, uint8_t s, const NvScale& ts, float six_b, bool mse) {
  const float enc = nv_block_enc(s, ts.s_dec);
  const float sf = e4m3_value(s);
  float err = 0.f;
  for (int i = 0; i < 16; ++i) {
    const float v = x[i] * enc;
    float val = ((e2m1_round_abs(abs_f(v)) * sf) * ts.amax) / six_b;
    if (e2m1_sign(v)) val = -val;
    const float d = val - x[i];
    err = err + (mse ? d * d : abs_f(d));
  }
  return err;
}

void fourover6_scales(const float (*buf)[16], int nr, const float* bamax, const NvScale* ts,
                      const NvOpts& o, uint8_t* sb) {
  float e6[16], e4[16];
  uint8_t s6[16], s4[16];
  const float six_b = static_cast<float>(6 * o.bound);
  for (int r = 0; r < nr; ++r) {
    fourover6_candidates(bamax[r], ts[r], &s6[r], &s4[r]);
    e6[r] = candidate_error(buf[r], s6[r], ts[r], six_b, o.fourover6 == 2);
    e4[r] = candidate_error(buf[r], s4[r], ts[r], six_b, o.fourover6 == 2);
  }
  if (o.block_2d) {  // the 16 row errors of a tile, summed as a tree: +8, +4, +2, +1
    for (int h = 8; h >= 1; h >>= 1)
      for (int j = 0; j < h; ++j) {
        e6[j] = e6[j] + e6[j + h];
        e4[j] = e4[j] + e4[j + h];
      }
    for (int r = 0; r < nr; ++r) sb[r] = e4[0] < e6[0] ? s4[0] : s6[0];
    return;
  }
  for (int r = 0; r < nr; ++r) sb[r] = e4[r] < e6[r] ? s4[r] : s6[r];
}

// Quantize rows i0 .. i0+nr (column block jb) of the quantized matrix [R, C].
void quantize_tile(const float (*buf)[16], int nr, const NvScale* ts, const NvOpts& o, int64_t i0,
                   int64_t jb, int64_t C, uint8_t* qdata, uint8_t* scale) {
  float bamax[16];
  for (int r = 0; r < nr; ++r) {
    float m = 0.f;
    for (int c = 0; c < 16; ++c) m = nan_max(m, abs_f(buf[r][c]));
    bamax[r] = m;
  }
  if (o.block_2d) {
    float t = 0.f;
    for (int r = 0; r < nr; ++r) t = nan_max(t, bamax[r]);
    for (int r = 0; r < nr; ++r) bamax[r] = t;
  }
  uint8_t sb[16];
  if (o.fourover6) {
    fourover6_scales(buf, nr, bamax, ts, o, sb);
  } else {
    for (int r = 0; r < nr; ++r) sb[r] = e4m3_bits(bamax[r] * ts[r].s_enc_c6);
  }
  for (int r = 0; r < nr; ++r) {
    const int64_t i = i0 + r;
    const float enc = nv_block_enc(sb[r], ts[r].s_dec);
    uint8_t* q = qdata + i * (C / 2) + jb * 8;
    const uint32_t base = static_cast<uint32_t>(i * C + jb * 16) + o.offset;
    uint32_t codes[16];
    if (o.sr) {  // one hash per group of four counters (a block may start inside a group)
      uint32_t h = sr_group_bits(o.key, base);
      for (int c = 0; c < 16; ++c) {
        const uint32_t counter = base + static_cast<uint32_t>(c);
        if (c > 0 && (counter & 3u) == 0u) h = sr_group_bits(o.key, counter);
        codes[c] = e2m1_encode_sr(buf[r][c] * enc, sr_byte(h, counter));
      }
    } else {  // branch-free bit arithmetic: this loop vectorizes
      for (int c = 0; c < 16; ++c) codes[c] = e2m1_encode(buf[r][c] * enc);
    }
    for (int c = 0; c < 8; ++c) q[c] = static_cast<uint8_t>(codes[2 * c] | (codes[2 * c + 1] << 4));
    scale[i * (C / 16) + jb] = sb[r];
  }
}

// ---- NVFP4 rowwise: blocks along the contiguous last dim -------------------------------------
// Without 2D tiles, RHT or stochastic rounding a row needs no 16x16 tile: it is converted to fp32
// once, then each 16-element block gets its scale and codes from the block functions of the CUDA
// rowwise kernel (quant_rows_math.h) or the vectorizable encoder (quant_cpu_math.h).

// Plain NVFP4 of one fp32 row of C values into its C/2 code bytes and C/16 scale bytes; the
// scales of four blocks at a time (the divisions overlap), the rest one block at a time.
QT_CPU_CLONES void nv_row_plain(const float* v, int64_t C, const NvScale& ts, uint8_t* q, uint8_t* s) {
  const int64_t nb = C / 16, nb4 = nb & ~int64_t{3};
  for (int64_t jb = 0; jb < nb4; jb += 4) {
    const float* b = v + jb * 16;
    const vi4 bam{static_cast<int32_t>(absmax_bits(b, 4)), static_cast<int32_t>(absmax_bits(b + 16, 4)),
                  static_cast<int32_t>(absmax_bits(b + 32, 4)), static_cast<int32_t>(absmax_bits(b + 48, 4))};
    vf4 enc;
    const vi4 sb = nv_scale_lanes(bam, ts, &enc);
    for (int l = 0; l < 4; ++l) {
      nv_block_codes(b + 16 * l, enc[l], q + (jb + l) * 8);
      s[jb + l] = static_cast<uint8_t>(sb[l]);
    }
  }
  for (int64_t jb = nb4; jb < nb; ++jb) {
    const float* b = v + jb * 16;
    const uint8_t sb = e4m3_bits(u2f(absmax_bits(b, 4)) * ts.s_enc_c6);
    nv_block_codes(b, nv_block_enc(sb, ts.s_dec), q + jb * 8);
    s[jb] = sb;
  }
}

QT_CPU_CLONES void nv_row_fo6(const float* v, int64_t C, const NvScale& ts, float six_b, bool mse,
                              uint8_t* q, uint8_t* s) {
  for (int64_t jb = 0; jb < C / 16; ++jb) {
    const float* b = v + jb * 16;
    const float bam = u2f(absmax_bits(b, 4));
    s[jb] = mse ? fo6_block_lanes<true>(b, bam, ts, six_b, q + jb * 8)
                : fo6_block_lanes<false>(b, bam, ts, six_b, q + jb * 8);
  }
}

template <typename T>
void nv_rows(const at::Tensor& x2, const float* ap, bool row_scaled, const NvOpts& o, uint8_t* qp,
             uint8_t* sp) {
  const int64_t M = x2.size(0), C = x2.size(1), rs = x2.stride(0);
  const T* p = x2.const_data_ptr<T>();
  const NvScale ts0 = nv_scale(ap[0], o.bound);
  const float six_b = static_cast<float>(6 * o.bound);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    std::vector<float> buf(C);
    for (int64_t i = b; i < e; ++i) {
      const T* row = p + i * rs;
      for (int64_t j = 0; j < C; ++j) buf[j] = to_f32(row[j]);
      const NvScale ts = row_scaled ? nv_scale(ap[i], o.bound) : ts0;
      uint8_t* q = qp + i * (C / 2);
      uint8_t* s = sp + i * (C / 16);
      if (o.fourover6 == 0) {
        nv_row_plain(buf.data(), C, ts, q, s);
      } else {
        nv_row_fo6(buf.data(), C, ts, six_b, o.fourover6 == 2, q, s);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize_cpu(const at::Tensor& x, const at::Tensor& amax,
                                                      bool columnwise, bool block_2d,
                                                      int64_t fourover6, int64_t bound, bool rht,
                                                      bool stochastic,
                                                      const std::optional<at::Tensor>& sr_state, int64_t walk) {
  const char* op = "qtensor.nvfp4_quantize";
  TORCH_CHECK(walk == 0 || walk == 2 || walk == 4, op, " takes walk 0 (chosen), 2 (pairs) or 4 (strips); got ", num(walk),
              ".");  // the CPU kernels have no tile walk
  const NvShape s = nv_shape(x, columnwise, block_2d, op);
  const bool row_scaled = amax.dim() >= 1;  // per row, or per block (amax [R, C/16])
  const bool per_block = amax.dim() == 2;
  check_nv_options(fourover6, bound, columnwise, rht, stochastic, block_2d, row_scaled, op);
  check_nv_amax(x, amax, s, op);
  check_nv_block_amax(amax, columnwise, fourover6, op);
  at::Tensor qdata = at::empty({s.R, s.C / 2}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({s.R, s.C / 16}, x.options().dtype(at::kByte));
  const at::Tensor a = amax.contiguous();
  const float* ap = a.const_data_ptr<float>();
  const int64_t* sr = sr_state_ptr(x, stochastic, sr_state, op);
  const NvOpts o{block_2d, static_cast<int>(fourover6), static_cast<int>(bound), stochastic,
                 sr ? mix32(static_cast<uint32_t>(sr[0])) : 0u, sr ? static_cast<uint32_t>(sr[1]) : 0u};
  const NvScale ts0 = nv_scale(ap[0], o.bound);
  const at::Tensor x2 = x.reshape({s.M, s.K});
  uint8_t* qp = qdata.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  const bool rows = !columnwise && !block_2d && !rht && !stochastic && x2.stride(1) == 1;
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    if (rows) {
      nv_rows<T>(x2, ap, row_scaled, o, qp, sp);
      return;
    }
    const auto v = q_view<T>(x2, columnwise);
    at::parallel_for(0, (s.R + 15) / 16, 1, [&](int64_t b, int64_t e) {
      float buf[16][16];
      NvScale ts[16];
      for (int64_t t = b; t < e; ++t) {
        const int nr = static_cast<int>(std::min<int64_t>(16, s.R - t * 16));
        if (!per_block)
          for (int r = 0; r < nr; ++r) ts[r] = row_scaled ? nv_scale(ap[t * 16 + r], o.bound) : ts0;
        for (int64_t jb = 0; jb < s.C / 16; ++jb) {
          if (per_block)
            for (int r = 0; r < nr; ++r) ts[r] = nv_scale(ap[(t * 16 + r) * (s.C / 16) + jb], o.bound);
          load_tile(v, t * 16, nr, jb * 16, rht, buf);
          quantize_tile(buf, nr, ts, o, t * 16, jb, s.C, qp, sp);
        }
      }
    });
  });
  return {qdata, scale.view(at::kFloat8_e4m3fn)};
}

// ---- MXFP8 ------------------------------------------------------------------------------------

// MXFP8 rowwise of one fp32 row of K values: K bytes of data, K/32 scale codes.
QT_CPU_CLONES void mx_row(const float* v, int64_t K, int rule, uint8_t* q, uint8_t* s) {
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint32_t code = mx_scale_code(u2f(absmax_bits(v + kb * 32, 8)), rule);
    mx_codes(v + kb * 32, mx_inv_scale(code), code != 255u, 32, q + kb * 32);
    s[kb] = static_cast<uint8_t>(code);
  }
}

// One row of a columnwise block: element k scaled by inv[k].
QT_CPU_CLONES void mx_col_row(const float* v, const float* inv, int64_t K, uint8_t* q) {
  const int64_t K16 = K & ~int64_t{15};  // mx_codes takes groups of 16; the rest one by one
  mx_codes(v, inv, K16, q);
  for (int64_t k = K16; k < K; ++k) q[k] = e4m3_bits_vec(mul_keep_nan(v[k], inv[k]));
}

template <typename T>
void mx_rows(const T* x, int64_t M, int64_t K, int rule, uint8_t* q, uint8_t* s) {
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    std::vector<float> buf(K);
    for (int64_t row = b; row < e; ++row) {
      for (int64_t k = 0; k < K; ++k) buf[k] = to_f32(x[row * K + k]);
      mx_row(buf.data(), K, rule, q + row * K, s + row * (K / 32));
    }
  });
}

template <typename T>
void mx_cols(const T* x, int64_t M, int64_t K, int rule, uint8_t* q, uint8_t* s) {
  at::parallel_for(0, M / 32, 1, [&](int64_t b, int64_t e) {
    std::vector<int32_t> cm(K);  // column max |x| as sign-cleared fp32 patterns (NaN above inf)
    std::vector<float> inv(K), buf(32 * K);
    for (int64_t mb = b; mb < e; ++mb) {
      std::fill(cm.begin(), cm.end(), 0);
      for (int64_t r = 0; r < 32; ++r) {
        float* row = buf.data() + r * K;
        for (int64_t k = 0; k < K; ++k) row[k] = to_f32(x[(mb * 32 + r) * K + k]);
        for (int64_t k = 0; k < K; ++k) {
          const int32_t a = static_cast<int32_t>(f2u(row[k])) & 0x7FFFFFFF;
          cm[k] = a > cm[k] ? a : cm[k];
        }
      }
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t code = mx_scale_code(u2f(static_cast<uint32_t>(cm[k])), rule);
        s[mb * K + k] = static_cast<uint8_t>(code);
        inv[k] = mx_inv_scale(code);
      }
      for (int64_t r = 0; r < 32; ++r) mx_col_row(buf.data() + r * K, inv.data(), K, q + (mb * 32 + r) * K);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mxfp8_quantize_cpu(
    const at::Tensor& x, int64_t rule, bool rowwise, bool columnwise) {
  const char* op = "qtensor.mxfp8_quantize";
  check_mx_shape(x, rowwise, columnwise, op);
  check_scale_rule(rule, op);
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / K;
  const auto bytes = x.options().dtype(at::kByte);
  at::Tensor rq = at::empty({0}, bytes), rs = at::empty({0}, bytes);
  at::Tensor cq = at::empty({0}, bytes), cs = at::empty({0}, bytes);
  if (rowwise) {
    rq = at::empty(x.sizes(), bytes);
    auto ss = x.sizes().vec();
    ss.back() = K / 32;
    rs = at::empty(ss, bytes);
  }
  if (columnwise) {
    cq = at::empty(x.sizes(), bytes);
    cs = at::empty({M / 32, K}, bytes);
  }
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* p = xc.const_data_ptr<T>();
    if (rowwise) mx_rows(p, M, K, static_cast<int>(rule), rq.data_ptr<uint8_t>(), rs.data_ptr<uint8_t>());
    if (columnwise) mx_cols(p, M, K, static_cast<int>(rule), cq.data_ptr<uint8_t>(), cs.data_ptr<uint8_t>());
  });
  return {rq.view(at::kFloat8_e4m3fn), rs.view(at::kFloat8_e8m0fnu), cq.view(at::kFloat8_e4m3fn),
          cs.view(at::kFloat8_e8m0fnu)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hybrid_quantize_cpu(
    const at::Tensor& x, const at::Tensor& amax, int64_t rule, int64_t fourover6, int64_t bound,
    bool rht, bool stochastic, const std::optional<at::Tensor>& sr_state, int64_t walk) {
  TORCH_CHECK(x.dim() == 2, "qtensor.hybrid_quantize takes a 2-D gradient [M, K]; got shape ",
              shape_str(x), ".");
  TORCH_CHECK(walk == 0 || walk == 2 || walk == 4, "qtensor.hybrid_quantize takes walk 0 (chosen), 2 (pairs) or 4 "
              "(quads); got ", num(walk), ".");  // the CPU kernels have no tile walk
  TORCH_CHECK(walk == 0 || fourover6 == 0, "qtensor.hybrid_quantize with 4over6 runs as two casts, an MXFP8 and an "
              "NVFP4 one, and takes no tile walk; got walk ", num(walk), " with fourover6 ", num(fourover6),
              ". Pass walk 0.");  // the CUDA op's rule, kept on every device
  TORCH_CHECK(amax.dim() < 2, "qtensor.hybrid_quantize takes a scalar or per-row amax; got a per-block one of shape ",
              shape_str(amax), ". Quantize the NVFP4 side with nvfp4_quantize.");
  auto mx = mxfp8_quantize_cpu(x, rule, true, false);
  auto nv = nvfp4_quantize_cpu(x, amax, true, false, fourover6, bound, rht, stochastic, sr_state, 0);
  return {std::get<0>(mx), std::get<1>(mx), std::get<0>(nv), std::get<1>(nv)};
}

// ---- dequantize -------------------------------------------------------------------------------

at::Tensor nvfp4_dequantize_cpu(const at::Tensor& qdata, const at::Tensor& scale,
                                const at::Tensor& amax, int64_t bound, at::ScalarType dtype) {
  const char* op = "qtensor.nvfp4_dequantize";
  check_nv_dequant(qdata, scale, amax, bound, op);
  check_out_dtype(dtype, op);
  const int64_t R = qdata.size(0), C = qdata.size(1) * 2;
  at::Tensor out = at::empty({R, C}, qdata.options().dtype(dtype));
  const at::Tensor q = qdata.contiguous(), s = scale.contiguous().view(at::kByte), a = amax.contiguous();
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const uint8_t* sp = s.const_data_ptr<uint8_t>();
  const float* ap = a.const_data_ptr<float>();
  const float inv6b = 1.f / static_cast<float>(6 * bound);
  const bool per_row = amax.dim() == 1;
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
    at::parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float A = ap[per_row ? i : 0];
        for (int64_t jb = 0; jb < C / 16; ++jb) {
          const float f = (e4m3_value(sp[i * (C / 16) + jb]) * A) * inv6b;
          for (int c = 0; c < 16; ++c) {
            const uint8_t byte = qp[i * (C / 2) + jb * 8 + c / 2];
            o[i * C + jb * 16 + c] = static_cast<T>(e2m1_value((c & 1) ? byte >> 4 : byte & 15) * f);
          }
        }
      }
    });
  });
  return out;
}

at::Tensor mxfp8_dequantize_cpu(const at::Tensor& qdata, const at::Tensor& scale, bool columnwise,
                                at::ScalarType dtype) {
  const char* op = "qtensor.mxfp8_dequantize";
  check_mx_dequant(qdata, scale, columnwise, op);
  check_out_dtype(dtype, op);
  const at::Tensor q = qdata.contiguous().view(at::kByte), s = scale.contiguous().view(at::kByte);
  at::Tensor out = at::empty(qdata.sizes(), qdata.options().dtype(dtype));
  const int64_t K = qdata.size(-1), M = qdata.numel() / K;
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const uint8_t* sp = s.const_data_ptr<uint8_t>();
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t k = 0; k < K; ++k) {
          // Columnwise scales are [.., R/32, C]: row i of the flattened data uses scale row i/32.
          const uint8_t code = columnwise ? sp[(i / 32) * K + k] : sp[i * (K / 32) + k / 32];
          o[i * K + k] = static_cast<T>(e4m3_value(qp[i * K + k]) * mx_scale_value(code));
        }
    });
  });
  return out;
}

// ---- MXFP4 fake quantization ------------------------------------------------------------------

at::Tensor mxfp4_fake_quantize_cpu(const at::Tensor& w) {
  const char* op = "qtensor.mxfp4_fake_quantize";
  check_mxfp4_input(w, op);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty(w.sizes(), w.options());
  dispatch_float(w.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const T* p = wc.const_data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, w.numel() / 32, 256, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        float m = 0.f;
        for (int i = 0; i < 32; ++i) m = nan_max(m, abs_f(static_cast<float>(p[blk * 32 + i])));
        const int ex = mxfp4_exponent(m);
        const bool bad = !(m <= FLT_MAX);
        for (int i = 0; i < 32; ++i) {
          const float v = bad ? u2f(0x7FC00000u) : mxfp4_project(static_cast<float>(p[blk * 32 + i]), ex);
          o[blk * 32 + i] = static_cast<T>(v);
        }
      }
    });
  });
  return out;
}

// ---- scale layout -----------------------------------------------------------------------------

at::Tensor swizzle_scale_cpu(const at::Tensor& scale) {
  check_scale_bytes(scale, "qtensor.swizzle_scale");
  const int64_t rows = scale.size(0), cols = scale.size(1);
  const int64_t pr = round_up(rows, 128), pc = round_up(cols, 4);
  const at::Tensor s = scale.contiguous().view(at::kByte);
  at::Tensor out = at::zeros({pr, pc}, s.options());
  const uint8_t* sp = s.const_data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 128, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t c = 0; c < cols; ++c) o[swizzle_offset(r, c, pc)] = sp[r * cols + c];
  });
  return out.view(scale.scalar_type());
}

at::Tensor unswizzle_scale_cpu(const at::Tensor& scale, int64_t rows, int64_t cols) {
  const char* op = "qtensor.unswizzle_scale";
  check_scale_bytes(scale, op);
  const int64_t pr = round_up(rows, 128), pc = round_up(cols, 4);
  TORCH_CHECK(scale.size(0) == pr && scale.size(1) == pc, op, ": a swizzled scale of ", num(rows), "x",
              num(cols), " is ", num(pr), "x", num(pc), " (rows padded to 128, columns to 4); got ", shape_str(scale), ".");
  const at::Tensor s = scale.contiguous().view(at::kByte);
  at::Tensor out = at::empty({rows, cols}, s.options());
  const uint8_t* sp = s.const_data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 128, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t c = 0; c < cols; ++c) o[r * cols + c] = sp[swizzle_offset(r, c, pc)];
  });
  return out.view(scale.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CPU, m) {
  m.impl("amax", &amax_cpu);
  m.impl("nvfp4_quantize", &nvfp4_quantize_cpu);
  m.impl("mxfp8_quantize", &mxfp8_quantize_cpu);
  m.impl("hybrid_quantize", &hybrid_quantize_cpu);
  m.impl("nvfp4_dequantize", &nvfp4_dequantize_cpu);
  m.impl("mxfp8_dequantize", &mxfp8_dequantize_cpu);
  m.impl("mxfp4_fake_quantize", &mxfp4_fake_quantize_cpu);
  m.impl("swizzle_scale", &swizzle_scale_cpu);
  m.impl("unswizzle_scale", &unswizzle_scale_cpu);
}

}  // namespace qtensor
