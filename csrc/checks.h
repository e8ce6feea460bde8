// Argument checks shared by the CPU and CUDA implementations: every op validates its inputs here
// before any kernel runs, and each error names the rule, the value seen and the remedy.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

namespace qtensor {

// Integers enter error messages as strings: on the GPU machine's toolchain, streaming an int64
// into c10::str from this extension crashed in libstdc++ (std::ostream::_M_insert<long>, seen
// under cuda-gdb), while strings stream fine. Flags are spelled as two strings for the same
// reason; csrc/tools/check_messages.py (run by the tests) finds a number streamed as it is.
inline std::string num(int64_t v) { return std::to_string(v); }

// "[a, b, c]" built by hand, for the same reason.
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// f(T{}) for the float dtype t of an op's input (fp32, bf16, fp16), else the op's error.
template <typename F>
void dispatch_float(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, ".");
  }
}

// MXFP4 QAT weights: bf16 or fp32, 2-D [N, K] with N and K multiples of the host's block.
inline void check_qat_weight(const at::Tensor& w, int64_t rows_mult, int64_t cols_mult,
                             const char* op) {
  const auto dt = w.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op,
              ": MXFP4 QAT converts bf16 or fp32 weights; got ", dt,
              ". fp16 cannot hold the MXFP4 grid (2**-127 .. 6 * 2**125).");
  TORCH_CHECK(w.dim() == 2 && w.size(0) % rows_mult == 0 && w.size(1) % cols_mult == 0, op,
              ": needs a 2-D weight [N, K] with N divisible by ", num(rows_mult), " and K by ",
              num(cols_mult), "; got shape ", shape_str(w), ". Exclude this layer from QAT.");
}

// Shape of the quantized NVFP4 matrix: the input flattened to [M, K]; rowwise R = M, C = K,
// columnwise (blocks along dim 0) R = K, C = M.
struct NvShape {
  int64_t M, K, R, C;
};

inline void check_float_input(const at::Tensor& x, const char* op) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              " quantizes float32, bfloat16 or float16 tensors; got ", dt,
              ". Convert with .to(torch.bfloat16) first.");
  TORCH_CHECK(x.dim() >= 1 && x.numel() > 0, op, " needs a non-empty tensor; got shape ",
              shape_str(x), ".");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* what) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", what, " must be on the input's device ",
              a.device(), "; got ", b.device(), ". Move it with .to(x.device).");
}

inline NvShape nv_shape(const at::Tensor& x, bool columnwise, bool block_2d, const char* op) {
  check_float_input(x, op);
  const int64_t K = x.size(-1);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(K % 16 == 0, op, ": NVFP4 needs the last dim divisible by 16; got shape ",
              shape_str(x), ". Pad the features or exclude this tensor.");
  TORCH_CHECK(!(columnwise || block_2d) || M % 16 == 0, op, ": NVFP4 ",
              columnwise ? "columnwise blocks run along dim 0" : "2D tiles are 16x16",
              ", so the flattened leading dims must be divisible by 16; got shape ", shape_str(x), ".");
  return columnwise ? NvShape{M, K, K, M} : NvShape{M, K, M, K};
}

inline void check_nv_options(int64_t fourover6, int64_t bound, bool columnwise, bool rht,
                             bool stochastic, bool block_2d, bool row_scaled, const char* op) {
  TORCH_CHECK(bound == 448 || bound == 256, op, ": e4m3_bound must be 448 or 256; got ", num(bound), ".");
  TORCH_CHECK(fourover6 >= 0 && fourover6 <= 2, op,
              ": fourover6 is 0 (off), 1 (MAE) or 2 (MSE); got ", num(fourover6), ".");
  TORCH_CHECK(!(fourover6 && (rht || stochastic)), op,
              ": 4over6 excludes RHT and stochastic rounding; turn one of them off.");
  TORCH_CHECK(!rht || columnwise, op,
              ": RHT applies only to columnwise (wgrad) operands; set columnwise=True or rht=False.");
  TORCH_CHECK(!(row_scaled && (block_2d || rht || stochastic)), op,
              ": a per-row amax excludes block_2d, rht and stochastic rounding.");
}

// Stochastic rounding's state: int64 (seed, offset) on the input's device, read by the kernel
// itself (a CUDA kernel reads it from device memory: no host sync, and a compiled graph can
// advance it in place). nullptr when rounding to nearest.
inline const int64_t* sr_state_ptr(const at::Tensor& x, bool stochastic,
                                   const std::optional<at::Tensor>& sr_state, const char* op) {
  if (!stochastic) return nullptr;
  TORCH_CHECK(sr_state.has_value() && sr_state->defined(), op,
              ": stochastic rounding needs sr_state, an int64 tensor (seed, offset); got None. "
              "Pass one, or set stochastic=False.");
  const at::Tensor& st = *sr_state;
  check_same_device(x, st, op, "sr_state");
  TORCH_CHECK(st.scalar_type() == at::kLong && st.numel() == 2 && st.is_contiguous(), op,
              ": sr_state must be a contiguous int64 tensor of 2 elements (seed, offset); got ",
              st.scalar_type(), " ", shape_str(st), ".");
  return st.const_data_ptr<int64_t>();
}

inline void check_nv_amax(const at::Tensor& x, const at::Tensor& amax, const NvShape& s,
                          const char* op) {
  check_same_device(x, amax, op, "amax");
  TORCH_CHECK(amax.scalar_type() == at::kFloat, op, ": amax must be float32; got ",
              amax.scalar_type(), ".");
  TORCH_CHECK(amax.dim() == 0 || (amax.dim() == 1 && amax.size(0) == s.R) ||
                  (amax.dim() == 2 && amax.size(0) == s.R && amax.size(1) == s.C / 16),
              op, ": amax must be a scalar, one value per quantized row (", num(s.R),
              ") or one per block [", num(s.R), ", ", num(s.C / 16), "]; got shape ", shape_str(amax), ".");
}

// A per-block amax ([R, C/16]: each block quantized with its own, e.g. the experts' parts of one
// gradient) is taken by the plain columnwise cast only.
inline void check_nv_block_amax(const at::Tensor& amax, bool columnwise, int64_t fourover6, const char* op) {
  TORCH_CHECK(amax.dim() != 2 || (columnwise && fourover6 == 0), op,
              ": a per-block amax [R, C/16] is taken by the columnwise cast without 4over6; got columnwise=",
              (columnwise ? "true" : "false"), ", fourover6 ", num(fourover6), ".");
}

inline void check_mx_shape(const at::Tensor& x, bool rowwise, bool columnwise, const char* op) {
  check_float_input(x, op);
  TORCH_CHECK(rowwise || columnwise, op, ": ask for at least one of rowwise and columnwise.");
  TORCH_CHECK(!rowwise || x.size(-1) % 32 == 0, op,
              ": MXFP8 needs the last dim divisible by 32; got shape ", shape_str(x),
              ". Pad the features or exclude this tensor.");
  TORCH_CHECK(!columnwise || (x.dim() == 2 && x.size(0) % 32 == 0), op,
              ": MXFP8 columnwise needs a 2-D tensor with dim 0 divisible by 32; got shape ",
              shape_str(x), ".");
}

inline void check_scale_rule(int64_t rule, const char* op) {
  TORCH_CHECK(rule == 0 || rule == 1, op, ": scale_rule is 0 (rceil) or 1 (floor); got ", num(rule), ".");
}

inline void check_out_dtype(at::ScalarType dt, const char* op) {
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              " decodes to float32, bfloat16 or float16; got ", dt, ".");
}

inline void check_nv_dequant(const at::Tensor& q, const at::Tensor& s, const at::Tensor& amax,
                             int64_t bound, const char* op) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, op,
              ": qdata must be 2-D uint8 [R, C/2]; got ", q.scalar_type(), " ", shape_str(q), ".");
  TORCH_CHECK(s.dim() == 2 && s.size(0) == q.size(0) && s.size(1) * 8 == q.size(1) &&
                  s.scalar_type() == at::kFloat8_e4m3fn,
              op, ": scale must be float8_e4m3fn [R, C/16] for qdata ", shape_str(q), "; got ",
              s.scalar_type(), " ", shape_str(s), ".");
  TORCH_CHECK(amax.scalar_type() == at::kFloat &&
                  (amax.dim() == 0 || (amax.dim() == 1 && amax.size(0) == q.size(0))),
              op, ": amax must be float32, a scalar or one per row; got ", amax.scalar_type(), " ",
              shape_str(amax), ".");
  TORCH_CHECK(bound == 448 || bound == 256, op, ": e4m3_bound must be 448 or 256; got ", num(bound), ".");
  check_same_device(q, s, op, "scale");
  check_same_device(q, amax, op, "amax");
}

inline void check_mx_dequant(const at::Tensor& q, const at::Tensor& s, bool columnwise,
                             const char* op) {
  TORCH_CHECK(q.dim() >= 1 && q.scalar_type() == at::kFloat8_e4m3fn, op,
              ": qdata must be float8_e4m3fn; got ", q.scalar_type(), ".");
  TORCH_CHECK(s.scalar_type() == at::kFloat8_e8m0fnu && s.dim() == q.dim(), op,
              ": scale must be float8_e8m0fnu with qdata's rank; got ", s.scalar_type(), " ",
              shape_str(s), ".");
  const int64_t d = columnwise ? q.dim() - 2 : q.dim() - 1;
  TORCH_CHECK(d >= 0, op, ": columnwise MXFP8 data is at least 2-D; got ", shape_str(q), ".");
  for (int64_t i = 0; i < q.dim(); ++i) {
    const int64_t want = i == d ? q.size(i) / 32 : q.size(i);
    TORCH_CHECK(s.size(i) == want && (i != d || q.size(i) % 32 == 0), op, ": scale shape ",
                shape_str(s), " does not match qdata ", shape_str(q), " with 32-element blocks along dim ",
                num(d), ".");
  }
  check_same_device(q, s, op, "scale");
}

inline void check_mxfp4_input(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat, op,
              " takes bf16 or fp32 weights; got ", w.scalar_type(),
              ". fp16 cannot hold the MXFP4 grid.");
  TORCH_CHECK(w.dim() >= 1 && w.numel() > 0 && w.size(-1) % 32 == 0, op,
              " needs a non-empty tensor with the last dim divisible by 32; got shape ", shape_str(w), ".");
}

inline void check_scale_bytes(const at::Tensor& s, const char* op) {
  TORCH_CHECK(s.dim() == 2 && s.element_size() == 1, op,
              ": scales must be a 2-D tensor of 1-byte elements (E4M3 or UE8M0); got ",
              s.scalar_type(), " ", shape_str(s), ".");
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace qtensor
