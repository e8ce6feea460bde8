// CPU kernels of the quantized products (qtensor/ops/gemm_ops.py calls them):
// - cpu_units: the exact fp32 "unit" values of a quantized operand ([Note: emulated GEMM] in
//   qtensor/gemm/dense.py), bit for bit those of the reference (qtensor/ops/gemm_operands.py
//   `units`), for the products that multiply them with torch.matmul;
// - cpu_weight_mm: acc [M, N] = x [M, K] @ units(W)^T in fp32 for a float activation x and a
//   quantized weight W [N, K] (rows along K), the weight decoded in registers as it streams,
//   never written out. Equal to the reference up to the order of the fp32 additions.
//
// Formats (the decode GEMM's codes): 0 NVFP4 (E2M1 codes two a byte, element 2j in the low
// nibble; an E4M3 scale per 16), 1 MXFP4 (the same codes; a UE8M0 scale code per 32), 2 MXFP8
// (E4M3 bytes; a UE8M0 scale code per 32). A unit is value(q) * s: the product of two exact fp32
// values, rounded once, so it is the reference's value whatever computes it (the only rounding
// is an MX block past fp32's range, which becomes inf in both; a NaN scale gives NaN units).
//
// Accumulation order of cpu_weight_mm, fixed and the same on every CPU: output (m, n) sums its
// products in 16 lanes, lane l taking k = l, l + 16, l + 32, ... in order, and then the lanes
// by halves (l + 8, then + 4, + 2, + 1). It depends on K alone: a row's result does not depend
// on the other rows of x or W, on the threads or on the instruction set.
//
// Each kernel is compiled for AVX-512 (F, BW, DQ, VL), AVX2 with FMA and the baseline, chosen
// once at load (`cpu_isa`). All three compute the same operations in the same order, with an
// explicit fused multiply-add (std::fma on the baseline; the build forbids contraction
// elsewhere), and give the same bits, NaN sign and payload aside.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "checks.h"
#include "quant_math.h"

namespace qtensor {
namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

#define QT_GEMM_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QT_GEMM_X86 1
#endif

enum Fmt { kNvfp4 = 0, kMxfp4 = 1, kMxfp8 = 2 };
// Instruction sets a kernel is compiled for: AVX-512 permutes a 16-entry table in one
// instruction; AVX2 permutes 8 magnitudes per half and sets the sign; the baseline looks each
// code up.
enum Isa { kBase = 0, kAvx2 = 1, kAvx512 = 2 };

constexpr f32x16 kE2M1Signed = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
constexpr f32x8 kE2M1Magnitude = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

// Scale bytes to fp32: E4M3 (quant_math.h e4m3_value) and UE8M0 (2**(c - 127), the exponent
// field itself; c = 0 is the subnormal 2**-127 and 255 is NaN), one table each, built at load.
struct ScaleTables {
  float e4m3[256], ue8m0[256];
  ScaleTables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = e4m3_value(static_cast<uint8_t>(c));
      ue8m0[c] = c == 255 ? u2f(0x7FC00000u) : u2f(c ? static_cast<uint32_t>(c) << 23 : 0x00400000u);
    }
  }
};
const ScaleTables kScales;


// 16 lanes as two halves of 8, one AVX2 register each (gemm_cpu_lanes.h `Lanes`).
struct Pair8 {
  f32x8 h[2];
};

// Operand views: x fp32 [M, K] (row stride ldx), W's bytes [N, .] and scale bytes [N, .].
struct Operands {
  const float* x;
  int64_t ldx;
  const uint8_t* w;
  int64_t ldw;
  const uint8_t* s;
  int64_t lds;
  int64_t K;
  float* out;  // [M, N], row stride ldo
  int64_t ldo;
};

// The kernels, once per instruction set (gemm_cpu_lanes.h); each namespace's entry points
// weight_rows_entry and units_rows_entry, indexed by the instruction set in the tables below.
namespace base {
constexpr int ISA = kBase;
#include "gemm_cpu_lanes.h"
}  // namespace base
// The target of every function in a namespace: GCC's target pragma, or Clang's attribute
// region (Clang ignores the pragma).
#if defined(QT_GEMM_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
constexpr int ISA = kAvx2;
#include "gemm_cpu_lanes.h"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
#endif
namespace avx512 {
constexpr int ISA = kAvx512;
#include "gemm_cpu_lanes.h"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

// The instruction set of this CPU, read once.
int cpu_isa() {
#if defined(QT_GEMM_X86)
  static const int isa = [] {
    __builtin_cpu_init();
    // The features the target pragmas below name (GCC 11 and Clang 17 know no level names).
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512vl");
    return static_cast<int>(avx512 ? kAvx512 : avx2 ? kAvx2 : kBase);
  }();
  return isa;
#else
  return kBase;
#endif
}

const char* const kIsaName[3] = {"baseline", "AVX2 + FMA", "AVX-512 (F, BW, DQ, VL)"};

// Each op's entry point per instruction set (the baseline's wherever the others are not built).
using UnitsRows = void (*)(int, const Operands&, int64_t, int64_t);
using WeightRows = void (*)(int, const Operands&, int64_t, int64_t, int64_t);
#if defined(QT_GEMM_X86)
constexpr UnitsRows kUnitsRows[3] = {base::units_rows_entry, avx2::units_rows_entry,
                                     avx512::units_rows_entry};
constexpr WeightRows kWeightRows[3] = {base::weight_rows_entry, avx2::weight_rows_entry,
                                       avx512::weight_rows_entry};
#else
constexpr UnitsRows kUnitsRows[3] = {base::units_rows_entry, base::units_rows_entry,
                                     base::units_rows_entry};
constexpr WeightRows kWeightRows[3] = {base::weight_rows_entry, base::weight_rows_entry,
                                       base::weight_rows_entry};
#endif

// The instruction set a call runs: the CPU's own (isa -1), or one it supports (tests run each).
int run_isa(const char* op, int64_t isa) {
  TORCH_CHECK(isa >= -1 && isa <= cpu_isa(), op, ": isa is -1 (this CPU's best) or 0 .. ",
              num(cpu_isa()), " (baseline .. ", kIsaName[cpu_isa()], ", what this CPU runs); got ",
              num(isa), ".");
  return isa < 0 ? cpu_isa() : static_cast<int>(isa);
}

// ---- argument checks ---------------------------------------------------------------------------

// Elements per scale byte, and per data byte (2 for the packed E2M1 codes).
constexpr int64_t kBlock[3] = {16, 32, 32};
constexpr int64_t kPerByte[3] = {2, 2, 1};
const char* const kName[3] = {"NVFP4", "MXFP4", "MXFP8"};

// W's bytes [N, K / per_byte] and scale bytes [N, K / block], one byte an element, rows
// contiguous. Returns K.
int64_t check_weight(const char* op, const at::Tensor& w, const at::Tensor& s, int64_t fmt) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2, op, ": fmt is 0 (NVFP4), 1 (MXFP4) or 2 (MXFP8); got ",
              num(fmt), ".");
  TORCH_CHECK(w.device().is_cpu() && s.device().is_cpu(), op,
              ": runs on CPU tensors; got the data on ", w.device().str(), " and the scales on ",
              s.device().str(), ".");
  TORCH_CHECK(w.dim() == 2 && s.dim() == 2 && w.element_size() == 1 && s.element_size() == 1,
              op, ": the ", kName[fmt], " operand is 2-D bytes [N, K*] with 2-D scale bytes; got ",
              "data ", shape_str(w), " of ", w.scalar_type(), " and scales ", shape_str(s), " of ",
              s.scalar_type(), ".");
  const int64_t K = w.size(1) * kPerByte[fmt];
  TORCH_CHECK(K % kBlock[fmt] == 0, op, ": ", kName[fmt], " data ", shape_str(w), " holds K = ",
              num(K), " elements a row; K must be a multiple of the block, ", num(kBlock[fmt]),
              ".");
  TORCH_CHECK(s.size(0) == w.size(0) && s.size(1) * kBlock[fmt] == K, op, ": ",
              kName[fmt], " data ", shape_str(w), " needs scales [", num(w.size(0)), ", ",
              num(K / kBlock[fmt]), "] (one per ", num(kBlock[fmt]), " elements); got ",
              shape_str(s), ".");
  return K;
}

Operands weight_operands(const at::Tensor& w, const at::Tensor& s, int64_t K) {
  Operands o{};
  o.w = static_cast<const uint8_t*>(w.const_data_ptr());
  o.ldw = w.stride(0);
  o.s = static_cast<const uint8_t*>(s.const_data_ptr());
  o.lds = s.stride(0);
  o.K = K;
  return o;
}

// ---- the ops -----------------------------------------------------------------------------------

at::Tensor cpu_units(const at::Tensor& data, const at::Tensor& scale, int64_t fmt, int64_t isa_arg) {
  const char* op = "qtensor::cpu_units";
  const int isa = run_isa(op, isa_arg);
  const at::Tensor w = data.contiguous(), s = scale.contiguous();
  const int64_t K = check_weight(op, w, s, fmt);
  at::Tensor out = at::empty({w.size(0), K}, w.options().dtype(at::kFloat));
  Operands o = weight_operands(w, s, K);
  o.out = out.data_ptr<float>();
  o.ldo = K;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  const UnitsRows rows = kUnitsRows[isa];
  at::parallel_for(0, w.size(0), grain, [&](int64_t lo, int64_t hi) {
    rows(static_cast<int>(fmt), o, lo, hi);
  });
  return out;
}

at::Tensor cpu_weight_mm(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                         int64_t fmt, int64_t isa_arg) {
  const char* op = "qtensor::cpu_weight_mm";
  const int isa = run_isa(op, isa_arg);
  const at::Tensor w = data.contiguous(), s = scale.contiguous();
  const int64_t K = check_weight(op, w, s, fmt);
  TORCH_CHECK(x.device().is_cpu(), op, ": runs on CPU tensors; got x on ", x.device().str(), ".");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x is [M, K = ", num(K), "]; got ",
              shape_str(x), ".");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": x is float32, bfloat16 or float16; got ", dt, ".");
  // Every bf16 and fp16 value is exact in fp32: the activation is widened once.
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  Operands o = weight_operands(w, s, K);
  o.x = x32.const_data_ptr<float>();
  o.ldx = K;
  o.out = out.data_ptr<float>();
  o.ldo = N;
  // Weight rows a task: about 64 KB of weight bytes, in whole tiles of 4 rows.
  const int64_t row_bytes = std::max<int64_t>(w.size(1), 1);
  const int64_t grain = std::max<int64_t>(4, (65536 / row_bytes + 3) / 4 * 4);
  const WeightRows rows = kWeightRows[isa];
  at::parallel_for(0, (N + 3) / 4, std::max<int64_t>(1, grain / 4), [&](int64_t lo, int64_t hi) {
    rows(static_cast<int>(fmt), o, M, lo * 4, std::min(hi * 4, N));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CPU, m) {
  m.impl("cpu_units", &cpu_units);
  m.impl("cpu_weight_mm", &cpu_weight_mm);
}

// No tensor argument, so no backend key: the kernel every dispatch reaches.
TORCH_LIBRARY_IMPL(qtensor, CompositeExplicitAutograd, m) {
  m.impl("cpu_gemm_isa", []() -> int64_t { return cpu_isa(); });
}

}  // namespace qtensor
