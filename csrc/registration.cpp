// Every op schema of qtensor's kernels, defined once. Implementations: quant_cpu.cpp (CPU),
// quant_cuda.cu and convert_cuda.cu (CUDA); fake (meta) implementations for torch.compile:
// qtensor/ops/quant.py.
//
// Conventions. NVFP4 ops work on the quantized matrix: the input flattened to [M, K], or its
// transpose [K, M] when `columnwise`; a 1-D `amax` means one amax per row of that matrix.
// fourover6: 0 off, 1 MAE, 2 MSE. scale_rule: 0 RCEIL, 1 FLOOR. Stochastic rounding draws the 8
// bits of element i (row-major in the quantized matrix) from (seed, offset + i): quant_math.h
// `sr_bits`, the same function as qtensor/formats/nvfp4.py `sr_bits`. (seed, offset) is the int64
// tensor `sr_state` [2] on x's device, read inside the kernel (None when not stochastic), so a
// compiled graph passes a buffer it advances in place instead of Python ints.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import qtensor._C` loads this library, whose static initializers register the ops below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(qtensor, m) {
  // max|x| as fp32: a scalar, or one per row of the quantized matrix (per_row); with rht the
  // 16-runs along dim 0 are Hadamard-transformed (and rounded to bf16) first.
  m.def("amax(Tensor x, bool columnwise, bool rht, bool per_row) -> Tensor");
  // NVFP4 codes uint8 [R, C/2] and E4M3 block scales [R, C/16] given the amax: a scalar, one per
  // row (row-scaled), or for a plain columnwise cast one per block [R, C/16]. `walk` picks the
  // CUDA columnwise kernel's tile walk for tests and benchmarks (0: chosen by the shape, 2: pairs
  // of tile rows, 4: strips of four, in the bf16 casts of their own kernel); the bytes are the same.
  m.def(
      "nvfp4_quantize(Tensor x, Tensor amax, bool columnwise, bool block_2d, int fourover6, "
      "int e4m3_bound, bool rht, bool stochastic, Tensor? sr_state, int walk=0) -> (Tensor, Tensor)");
  // MXFP8 (rowwise data, rowwise scale, columnwise data, columnwise scale) from one read; a side
  // not asked for comes back as empty tensors.
  m.def(
      "mxfp8_quantize(Tensor x, int scale_rule, bool rowwise, bool columnwise) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  // The gradient cast of the dgrad-in-MXFP8 recipe from one read of x [M, K]: MXFP8 rowwise
  // (data, scale) and NVFP4 columnwise (codes, scales) given the columnwise amax. `walk` picks the
  // CUDA kernel's tile walk for tests and benchmarks (0: chosen by the shape, 2: pairs, 4: quads
  // of 16-bit inputs); the bytes are the same. With 4over6 the cast runs as two passes, an MXFP8
  // and an NVFP4 one, with the NVFP4 cast's chosen walk, and takes walk 0 only.
  m.def(
      "hybrid_quantize(Tensor x, Tensor amax, int scale_rule, int fourover6, int e4m3_bound, "
      "bool rht, bool stochastic, Tensor? sr_state, int walk=0) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "nvfp4_dequantize(Tensor qdata, Tensor scale, Tensor amax, int e4m3_bound, "
      "ScalarType dtype) -> Tensor");
  m.def("mxfp8_dequantize(Tensor qdata, Tensor scale, bool columnwise, ScalarType dtype) -> Tensor");
  // MXFP4 projection values (non-finite blocks become NaN); autograd is straight-through.
  m.def("mxfp4_fake_quantize(Tensor w) -> Tensor");
  // Compact [rows, cols] scales <-> the 128x4-tiled layout of block-scaled GEMMs.
  m.def("swizzle_scale(Tensor scale) -> Tensor");
  m.def("unswizzle_scale(Tensor scale, int rows, int cols) -> Tensor");
  // MXFP4 weight QAT (mxfp4_qat.cpp, mxfp4_qat_cuda.cu; reference qtensor/qat/convert.py): the
  // fused projection + host quantization of a weight [N, K]. MXFP8 rowwise and columnwise
  // (data, scale) pairs, empty where not asked; FP8 128x128 (data, fp32 tile scales).
  m.def(
      "mxfp4_qat_mxfp8(Tensor w, bool direct, bool rowwise, bool columnwise) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def("mxfp4_qat_fp8_block(Tensor w, bool direct) -> (Tensor, Tensor)");
  // Weight-only decode GEMM (decode_gemm_cuda.cu; layout qtensor/formats/decode_layout.py):
  // out [M, N] = epilogue(x [M <= 64, K] @ W^T) for a weight [N, K] packed in the decode layout,
  // fmt 0 NVFP4 (amax, inv = r(1 / (6 B))), 1 MXFP4, 2 MXFP8; splits 0 lets the kernel choose;
  // tile 0 lets it choose its tile, 1 asks for the m16n8k16 tiles, 2 and 3 for the warpgroup
  // tile of 64 or 128 weight rows a CTA (33-64 rows, sm_90a); pdl lets a launch of up to 8
  // rows (16 with NVFP4) overlap the end of the previous kernel on the stream (it waits for that
  // kernel before reading x).
  m.def(
      "decode_gemm(Tensor x, Tensor w, Tensor s, Tensor? amax, Tensor? bias, int fmt, int n, "
      "int k, float inv, int splits, ScalarType out_dtype, int tile=0, bool pdl=True) -> Tensor");
  // The canonical (codes, scales) uint8 bytes of a weight [N, K] in the decode layout: the
  // inverse of qtensor/formats/decode_layout.pack (CUDA only; the reference is its `unpack`).
  m.def("decode_unpack(Tensor w, Tensor s, int fmt, int n, int k) -> (Tensor, Tensor)");
  // CPU kernels of the quantized products (gemm_cpu.cpp; CPU only). fmt as for decode_gemm
  // (0 NVFP4, 1 MXFP4, 2 MXFP8); data and scales as bytes [N, K*] and [N, K / block]. cpu_units:
  // the exact fp32 unit values [N, K] of the operand (qtensor/ops/gemm_operands.py `units`, bit
  // for bit); cpu_weight_mm: fp32 x [M, K] @ units^T [M, N] with the weight decoded in
  // registers, up to the order of the fp32 additions. isa -1 runs the CPU's best instruction
  // set; 0 (baseline), 1 (AVX2) or 2 (AVX-512) one it supports, for the tests: all give the
  // same bits.
  m.def("cpu_units(Tensor data, Tensor scale, int fmt, int isa=-1) -> Tensor");
  m.def("cpu_weight_mm(Tensor x, Tensor data, Tensor scale, int fmt, int isa=-1) -> Tensor");
  // The instruction set the CPU kernels run by default (-1 above): 0, 1 or 2.
  m.def("cpu_gemm_isa() -> int");
}
