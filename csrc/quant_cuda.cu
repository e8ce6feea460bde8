// CUDA kernels of every qtensor quantizer that needs a 2-D tile: NVFP4 columnwise (1D, 2D,
// 4over6, RHT, stochastic rounding, row-scaled), NVFP4 rowwise with stochastic rounding (1D or
// 2D; round-to-nearest rowwise runs in quant_rows_cuda.cu), MXFP8 columnwise (alone or with
// rowwise), and the hybrid gradient cast (MXFP8 rowwise + NVFP4 columnwise). One persistent
// kernel reads the input once: each CTA walks its tiles (128 rows x 64 columns with NVFP4
// outputs, 64 x 128 for MXFP8 alone), copied into a ring of shared-memory stages while the tile
// before them is quantized (by the copy unit's tensor copies from sm_90 on, else by every
// thread's cp.async), and writes every output asked for from that one read. NVFP4 rowwise codes
// leave as whole sectors straight from registers (the lanes of one output row hold its
// consecutive blocks); NVFP4 columnwise codes and scales, and MXFP8 codes and row scales, are
// staged in shared memory and leave as whole rows of the tile, so that each store request carries
// as many bytes as the tile row holds (the NVFP4 columnwise kernels stage two tiles at a time,
// whose result rows make whole 128-byte lines, and the hybrid cast of 16-bit inputs, where the
// shape allows, four, two side by side, so that its MXFP8 rows are whole lines too; the
// MXFP8-only kernels' codes leave by the copy unit's tensor stores). The 1x16 / 1x32 and
// round-to-nearest 2D rowwise modes need no tile: quant_rows_cuda.cu. The math is quant_math.h
// and quant_rows_math.h, shared with the CPU kernels; built with --fmad=false so every fp32
// operation rounds like the reference.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <mutex>

#include "checks.h"
#include "cuda_vec.cuh"
#include "quant_math.h"
#include "quant_rows.h"
#include "quant_rows_math.h"
#include "tensor_copy.cuh"
#include "tensor_map.h"

namespace qtensor {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kRows = 128;     // tile rows: 8 NVFP4 blocks of 16 (a warp each), 4 MXFP8 blocks of 32
constexpr int kCols = 64;      // tile columns: 32 column pairs, a lane each
constexpr int kStages = 3;     // tiles in flight per CTA: the one quantized, two loading
// The MXFP8-only kernels take tiles of 64 rows x 128 columns (the same bytes): a tile row of their
// outputs, in the input's layout, is then a whole 128-byte line, stored by one request. Their
// stores, not the DRAM, bound them in 64-column tiles (each request a 32-byte sector).
constexpr int kMxRows = 64;
constexpr int kMxCols = 128;

// ---- shared-memory tiles ---------------------------------------------------------------------------

// A stage holds ROWS rows of COLS elements, unpadded, as column groups of 128 bytes: group g
// holds bytes 128g..128g+127 of every row (ROWS rows of 128 bytes), and the 16-byte chunk c of
// row r sits at chunk c ^ (r % 8) of its row there. That is the layout the copy unit writes with
// its 128-byte swizzle, one tensor copy a group (a box of 128 bytes x ROWS rows) into a stage at
// a 1024-byte boundary; rows of 128 bytes (16-bit NVFP4 tiles) are one group, row after row.
// The column-pair reads (a 4- or 8-byte word per lane, one row per instruction) and the 16-byte
// row reads of 8 consecutive rows (the rowwise phases) fall in distinct banks, and 3 stages of
// bf16 tiles leave room for 4 CTAs per SM.
template <typename T, int ROWS = kRows, int COLS = kCols>
struct Stage {
  static constexpr int kRows = ROWS, kCols = COLS;
  static constexpr int kRowBytes = COLS * static_cast<int>(sizeof(T));
  static constexpr int kBytes = ROWS * kRowBytes;
  static constexpr int kChunks = ROWS * kRowBytes / 16;  // 16-byte copies per tile
  static constexpr int kGroups = kRowBytes / 128;        // column groups: tensor copies per tile
  static constexpr int kGroupCols = 128 / static_cast<int>(sizeof(T));  // elements a group row
  static constexpr int kPitch = 128;  // bytes from a row to the next in its group
  static_assert(kChunks % kThreads == 0, "whole copies per thread");
  static_assert(kRowBytes % 128 == 0, "whole column groups");
  // Byte offset of byte `byte` of row r (an access never crosses its 16-byte chunk).
  __device__ static __forceinline__ int at(int r, int byte) {
    if constexpr (kGroups == 1) return r * kPitch + (((byte >> 4) ^ (r & 7)) << 4) + (byte & 15);
    else return (byte >> 7) * (ROWS * kPitch) + r * kPitch + ((((byte >> 4) & 7) ^ (r & 7)) << 4) + (byte & 15);
  }
};

// Out-of-range chunks are zero-filled (src-size 0) and never stored; their source address stays
// a valid one. K % 16 == 0 (checked by the ops) makes every chunk wholly in or out.
[[maybe_unused]] __device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// a * b in 64 bits from 32-bit factors (one wide multiply): the offsets of the tile kernels, whose
// positions are 32-bit (set_tile_input bounds the dimensions, launch_tiles the tile count).
__device__ __forceinline__ uint64_t wide(uint32_t a, uint32_t b) { return static_cast<uint64_t>(a) * b; }

template <typename S, typename T>
__device__ __forceinline__ void load_tile(const T* x, uint32_t M, uint32_t K, uint32_t m0, uint32_t k0,
                                          uint32_t stage) {
  // Thread t copies chunk t % kPerRow of rows t / kPerRow, + kRowStep, ...: one column offset,
  // one source offset stepped by kRowStep rows, and, in a tile past an edge of x, the rows left
  // compared (a whole tile, every one but the edges', takes no test at all).
  constexpr int kPerRow = S::kRowBytes / 16, kN = 16 / static_cast<int>(sizeof(T));
  constexpr int kRowStep = kThreads / kPerRow;
  const int r0 = threadIdx.x / kPerRow, c = threadIdx.x % kPerRow;
  const uint64_t step = wide(kRowStep, K);
  static_assert(kRowStep % 8 == 0, "the rows of one thread share their swizzle (and group)");
  const uint32_t dst = stage + S::at(r0, 16 * c);
  const uint32_t col = k0 + c * kN;
  uint64_t src = wide(m0 + r0, K) + col;  // an offset: the pointer is formed only in range
  if (m0 + S::kRows <= M && k0 + S::kCols <= K) {  // a whole tile (uniform): no test per chunk
#pragma unroll
    for (int l = 0; l < S::kChunks / kThreads; ++l)
      cp_async16(dst + l * kRowStep * S::kPitch, x + (src + l * step), true);
    return;
  }
  const int left = static_cast<int>(M - m0) - r0;  // M > m0
  const int rows = left < S::kRows ? left : S::kRows;  // > -kRowStep
  const bool col_ok = col < K;
#pragma unroll
  for (int l = 0; l < S::kChunks / kThreads; ++l, src += step) {
    const bool ok = col_ok && l * kRowStep < rows;
    cp_async16(dst + l * kRowStep * S::kPitch, ok ? x + src : x, ok);
  }
}

// Elements 2p and 2p+1 of tile row r, widened exactly; raw is the packed word of 16-bit inputs.
template <typename T>
__device__ __forceinline__ void load_pair(const unsigned char* tile, int r, int p, float& a, float& b, uint32_t& raw) {
  using W = PairWord<T>;
  constexpr int kBytes = static_cast<int>(sizeof(typename W::Word));
  const typename W::Word w = *reinterpret_cast<const typename W::Word*>(tile + Stage<T>::at(r, kBytes * p));
  a = W::lo(w);
  b = W::hi(w);
  if constexpr (sizeof(T) == 2) raw = w;
  else raw = 0u;
}

// The 16-byte words of sixteen consecutive elements of tile row r from column c0 (a multiple of
// 16), and those elements widened.
template <typename T>
__device__ __forceinline__ void load16_raw(const unsigned char* tile, int r, int c0, uint4* raw) {
#pragma unroll
  for (int i = 0; i < 16 / Vec<T>::kN; ++i)
    raw[i] = *reinterpret_cast<const uint4*>(tile + Stage<T>::at(r, c0 * static_cast<int>(sizeof(T)) + 16 * i));
}
template <typename T>
__device__ __forceinline__ void load16(const unsigned char* tile, int r, int c0, float* v) {
  constexpr int kN = Vec<T>::kN;
  uint4 raw[16 / kN];
  load16_raw<T>(tile, r, c0, raw);
#pragma unroll
  for (int i = 0; i < 16 / kN; ++i) Vec<T>::unpack(raw[i], v + i * kN);
}

// ---- the arguments ---------------------------------------------------------------------------------

// The options of an NVFP4 cast that pick its code path.
struct NvFlags {
  bool col, b2d, rht, sr, row_scaled;
};

// The general NVFP4 kernel reads its flags from its arguments and holds every path in one loop,
// more code than the instruction cache keeps. The casts of a training step (bf16) get kernels
// with their flags fixed, each holding its own path only.
enum NvMode : int {
  kNvAny,       // flags from the arguments
  kNvCol,       // columnwise: activations
  kNvColRhtSr,  // columnwise, RHT, stochastic rounding: gradients for wgrad
  kNvRowSr,     // rowwise, stochastic rounding: gradients for dgrad
  kNvCol2d,     // 2D, columnwise: weights (rowwise 2D runs in quant_rows_cuda.cu)
  kNvAmaxRht,   // no codes: the amax after RHT of the runs down the columns (bf16), for the scale
};

// The fixed flags of each mode but kNvAny, in NvMode's order (col, b2d, rht, sr, row_scaled).
constexpr NvFlags kNvModeFlags[] = {
    {},
    {true, false, false, false, false},
    {true, false, true, true, false},
    {false, false, false, true, false},
    {true, true, false, false, false},
    {true, false, true, false, false},
};

template <int MODE>
__device__ __forceinline__ NvFlags nv_flags(const NvFlags& f) {
  if constexpr (MODE == kNvAny) return f;
  else return kNvModeFlags[MODE];
}

// The quantizing mode whose fixed flags are f's, else kNvAny.
inline int nv_mode(const NvFlags& f) {
  for (int m = kNvAny + 1; m <= kNvCol2d; ++m) {
    const NvFlags& g = kNvModeFlags[m];
    if (g.col == f.col && g.b2d == f.b2d && g.rht == f.rht && g.sr == f.sr && g.row_scaled == f.row_scaled)
      return m;
  }
  return kNvAny;
}

struct TileArgs {
  const void* x;
  uint32_t M, K;  // at most 2**31 - 1 each (set_tile_input)
  // NVFP4
  const float* amax;
  uint32_t amax_rs, amax_bs;  // row-scaled amax: element row * amax_rs + block column * amax_bs
  NvFlags nv;
  int nv_4o6, bound;
  const int64_t* sr_state;  // stochastic rounding's (seed, offset) in device memory, or nullptr
  uint8_t *nv_q, *nv_s;
  unsigned* amax_out;  // kNvAmaxRht: the fp32 amax's bits, raised by atomicMax
  // MXFP8
  int rule;
  uint8_t *mxr_q, *mxr_s, *mxc_q, *mxc_s;
  int walk;  // read on the host: the NVFP4 columnwise walk if forced (2 or 4 tiles a unit), else 0 (launch_tiles)
  // The units taken so far past each CTA's first, zero at the launch, where the CTAs take their
  // next units as they go (launch_walk); nullptr where each walks every grid-th unit.
  unsigned* next_unit;
};

// ---- NVFP4 blocks ----------------------------------------------------------------------------------

// What the NVFP4 blocks of one CTA share, set up once before its first tile: the tensor scale,
// the block factor nv_block_enc of each of the 256 scale bytes under it (a shared-memory table,
// filled when one tensor scale serves every block: a look-up instead of a reciprocal per block),
// and stochastic rounding's key and counter base, read on the device so the host never syncs.
// 4over6 kernels add fo6_byte of each scale byte and this thread's value-table columns.
// Flags stay in the kernel's arguments (uniform registers), not here.
struct NvShared {
  NvScale ts;
  const float* enc_of;
  uint32_t key, base;
  const Fo6Byte* fo6;
  float *col6, *col4;
};

// Scale byte (*sb) and block factor of a block with amax bam: under the CTA's tensor scale, the
// factor from the table; under its own amax when the tensor is row-scaled (row `row`'s, or
// with a per-block amax the one of block column `blk` of that row; rows past `rows` are
// padding, amax 0).
__device__ __forceinline__ float nv_block_scale(const TileArgs& a, const NvShared& nv, bool row_scaled,
                                                uint32_t row, uint32_t rows, uint32_t blk, float bam,
                                                uint8_t* sb) {
  if (row_scaled) {
    const NvScale ts = nv_scale(row < rows ? a.amax[row * a.amax_rs + blk * a.amax_bs] : 0.f, a.bound);
    *sb = e4m3_scale_bits(bam * ts.s_enc_c6);
    return nv_block_enc(*sb, ts.s_dec);
  }
  *sb = e4m3_scale_bits(bam * nv.ts.s_enc_c6);
  return nv.enc_of[*sb];
}

// Codes of one block at its factor enc (plain or stochastic rounding); bam is its amax (the 16x16
// tile's in 2D). Stochastic rounding draws element i's bits at counter nv.base + offset + i; the
// offset is a multiple of 16, so the block's counters start on one whenever nv.base does (the
// training modules keep it at 0 and move the seed on), and nv_codes_sr hashes them in fewer steps
// (in its domain: no NaN, enc >= 2**-112); any other block takes the scalar e2m1_encode_sr.
// `signs` is sign_nibbles(v), which the caller may have formed from packed words.
__device__ __forceinline__ Codes nv_block_codes(const NvShared& nv, bool sr, const float* v, Codes signs, float bam,
                                                float enc, uint32_t offset) {
  if (!sr) return nv_codes(v, signs, bam, enc);
  const uint32_t base = nv.base + offset;
  if (f2u(bam) <= 0x7F800000u && enc >= 0x1p-112f && (base & 15u) == 0u)
    return nv_codes_sr(v, signs, enc, nv.key, base);
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i >> 3] |= e2m1_encode_sr(v[i] * enc, sr_bits(nv.key, base + i)) << (4 * (i & 7));
  return Codes{w[0], w[1]};
}

// Integer max of magnitude bits across the N lanes l ^ (STRIDE j), j < N (xor butterfly):
// torch.amax's order on non-negative floats, NaN above inf.
template <int STRIDE, int N>
__device__ __forceinline__ float lanes_absmax(float bam) {
  uint32_t b = f2u(bam);
#pragma unroll
  for (int o = STRIDE; o < STRIDE * N; o <<= 1) b = max(b, __shfl_xor_sync(kFull, b, o));
  return u2f(b);
}

// The first nb (at most sizeof(W)) of the scale bytes held in `bytes`, lowest first, to dst: one
// word store where all are whole and dst is aligned to the word, else byte by byte.
template <typename W>
__device__ __forceinline__ void store_scale_bytes(uint8_t* dst, W bytes, uint32_t nb) {
  constexpr int kN = static_cast<int>(sizeof(W));
  if (nb == kN && (reinterpret_cast<uintptr_t>(dst) & (kN - 1)) == 0) {
    *reinterpret_cast<W*>(dst) = bytes;
  } else {
    for (int b = 0; b < nb; ++b) dst[b] = static_cast<uint8_t>(bytes >> (8 * b));
  }
}

// ---- NVFP4 columnwise: the result is [K, M], blocks run down the input's columns -----------------

// One thread's columnwise outputs of a tile: the codes of its two blocks and their scale bytes.
struct NvColCodes {
  Codes q[2];
  uint8_t sb[2];
};

// Lane p takes columns 2p and 2p+1, warp w the 16 rows 16w.. of the tile: one block of each of
// two result rows. A 2D tile is 8 lanes (16 columns) of one warp. The codes and scales are staged
// (nv_pair_stage) with the pair's other tile, then leave as rows of the result.
template <typename T, int FO6>
__device__ __forceinline__ NvColCodes nv_col_codes(const TileArgs& a, const NvFlags& f, const unsigned char* tile,
                                                   const NvShared& nv, uint32_t m0, uint32_t k0) {
  const NvScale& ts_all = nv.ts;
  const int p = threadIdx.x & 31, w = threadIdx.x >> 5;
  const uint32_t R = a.K, C = a.M;
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  float v[2][16];
  float bam[2];    // max |v[c]|
  float unit[2] = {1.f, 1.f};  // v[c] * unit[c] are the run's values (0.25: v holds 4 x rht16)
  Codes signs[2];  // bf16: from the packed words, two runs at once
  bool packed_rht = false;  // bf16 RHT: both runs transformed on their packed pairs
  if constexpr (kBf16) packed_rht = f.rht;
  if (packed_rht) {
    uint32_t wd[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      wd[i] = *reinterpret_cast<const uint32_t*>(tile + Stage<T>::at(16 * w + i, 4 * p));
    const Bf16Range range = bf16x2_range(wd);
    uint32_t slow0 = __ballot_sync(kFull, !range.f32_exact(0));
    uint32_t slow1 = __ballot_sync(kFull, !range.f32_exact(1));
    if ((slow0 | slow1) == 0u) {
      rht16x2_bf16_x4(wd);
    } else {  // keep the runs whose results the error bound pins
      const uint32_t open = rht16x2_bf16_x4<true>(wd, range);
      slow0 &= __ballot_sync(kFull, (open & 1u) != 0u);
      slow1 &= __ballot_sync(kFull, (open & 2u) != 0u);
    }
    unit[0] = (slow0 >> p) & 1u ? 1.f : 0.25f;
    unit[1] = (slow1 >> p) & 1u ? 1.f : 0.25f;
    // The runs left, in fp64 over half-warps: element i of run h of lane l from the tile, and
    // lane l takes result i (rht16's, unit 1) into half h of wd[i].
    for_slow_runs(slow0, slow1, [&](int ra, int rb) {
      const int run = p < 16 ? ra : (rb < 0 ? ra : rb);
      const float x = u2f(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(
                              tile + Stage<T>::at(16 * w + (p & 15), 4 * (run & 31) + 2 * (run >> 5))))
                          << 16);
      const uint32_t r = f2u(rht16_lanes(x)) >> 16;
      const bool own_b = rb >= 0 && p == (rb & 31);
      const uint32_t sel = p == (ra & 31) ? half_selector(ra >> 5) : own_b ? half_selector(rb >> 5) : 0x3210u;
#pragma unroll
      for (int i = 0; i < 16; ++i) wd[i] = prmt(wd[i], __shfl_sync(kFull, r, (own_b ? 16 : 0) + i), sel);
    });
    sign_nibbles_cols(wd, &signs[0], &signs[1]);
    uint32_t m = 0u;  // both runs' max |result| bits, one per 16-bit half
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      m = __vmaxu2(m, wd[i] & 0x7FFF7FFFu);
      v[0][i] = u2f(wd[i] << 16);
      v[1][i] = u2f(wd[i] & 0xFFFF0000u);
    }
    bam[0] = u2f(m << 16);
    bam[1] = u2f(m & 0xFFFF0000u);
  } else {
    uint32_t pmax = 0u;  // bf16: both columns' max |element| bits, one per 16-bit half
    uint32_t raw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      load_pair<T>(tile, 16 * w + i, p, v[0][i], v[1][i], raw[i]);
      if constexpr (kBf16) pmax = __vmaxu2(pmax, raw[i] & 0x7FFF7FFFu);
    }
    if (f.rht) {  // fp16 / fp32: the reference's fp64 butterfly
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        rht16(v[c]);
        bam[c] = absmax16(v[c]);
      }
    } else if constexpr (kBf16) {
      bam[0] = u2f(pmax << 16);
      bam[1] = u2f(pmax & 0xFFFF0000u);
      sign_nibbles_cols(raw, &signs[0], &signs[1]);
    } else {
      bam[0] = absmax16(v[0]);
      bam[1] = absmax16(v[1]);
    }
    if constexpr (!kBf16) {  // fp16 / fp32 (bf16 with RHT took the packed branch): from the values
      signs[0] = sign_nibbles(v[0]);
      signs[1] = sign_nibbles(v[1]);
    }
  }
  const uint32_t qcol0 = m0 + 16 * w;
  // The blocks' amaxes (exact products: a run held times 4 has a max below 2**127 that is normal
  // or zero), over the 16x16 tile in 2D.
  float amax[2] = {bam[0] * unit[0], bam[1] * unit[1]};
  if (f.b2d) amax[0] = amax[1] = lanes_absmax<1, 8>(u2f(max(f2u(amax[0]), f2u(amax[1]))));
  uint8_t sb[2];
  Codes codes[2];
  if constexpr (FO6 == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t qrow = k0 + 2 * p + c;
      const float enc = nv_block_scale(a, nv, f.row_scaled, qrow, R, qcol0 >> 4, amax[c], &sb[c]);
      // The codes take v[c] * (enc * unit[c]), the same product as the values times enc wherever
      // enc * 0.25 is exact; below 2**-124 (huge inputs) v is brought to unit 1 instead, exactly
      // (the fp32 range test, or the error bound that pinned a run, kept its values normal or
      // zero). Their block max, for the cap test, is in v's unit.
      float venc = enc * unit[c];
      if (unit[c] != 1.f && enc < 0x1p-124f) {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[c][i] *= 0.25f;
        venc = enc;
        unit[c] = 1.f;
      }
      const float vmax = unit[c] == 1.f ? amax[c] : amax[c] * 4.f;
      codes[c] = nv_block_codes(nv, f.sr, v[c], signs[c], vmax, venc, qrow * C + qcol0);  // mod 2**32
    }
  } else {
    constexpr bool kMse = FO6 == 2;
    const float six_b = static_cast<float>(6 * a.bound);
    if (!f.b2d && f.row_scaled) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint32_t qrow = k0 + 2 * p + c;
        const NvScale ts = nv_scale(qrow < R ? a.amax[qrow] : 0.f, a.bound);
        sb[c] = fo6_block<kMse>(v[c], amax[c], ts, six_b, &codes[c]);
      }
    } else if (!f.b2d) {
#pragma unroll
      for (int c = 0; c < 2; ++c)
        sb[c] = fo6_block_tab<kMse, kThreads>(v[c], amax[c], ts_all, six_b, nv.fo6, nv.col6, nv.col4, &codes[c]);
    } else {  // one choice per 16x16 tile (2D excludes row scaling: one tensor scale)
      // Every lane of the warp runs the shuffles below (tiles of one warp may differ in whether
      // s6 == s4; equal candidates give equal errors, so the choice is then map-to-6 anyway).
      const Fo6Cand t = fo6_prepare<kThreads>(amax[0], ts_all, nv.fo6, nv.col6, nv.col4);
      const uint8_t s6 = t.s6, s4 = t.s4;
      Codes c6[2], c4[2];
      float e6[2], e4[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const Fo6Pair r = fo6_pair<kMse, kThreads>(t, v[c], ts_all, six_b, nv.col6, nv.col4);
        e6[c] = r.e6;
        e4[c] = r.e4;
        c6[c] = r.c6;
        c4[c] = r.c4;
      }
      // The reference's tree over the tile's 16 result rows r = 2 (p % 8) + c: r + 8 is lane
      // p + 4, r + 4 is p + 2, r + 2 is p + 1 (same c), and the last step adds c = 1 to c = 0.
#pragma unroll
      for (int o = 4; o >= 1; o >>= 1) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          e6[c] = e6[c] + __shfl_down_sync(kFull, e6[c], o, 8);
          e4[c] = e4[c] + __shfl_down_sync(kFull, e4[c], o, 8);
        }
      }
      const bool map4 = __shfl_sync(kFull, e4[0] + e4[1], 0, 8) < __shfl_sync(kFull, e6[0] + e6[1], 0, 8);
#pragma unroll
      for (int c = 0; c < 2; ++c) codes[c] = map4 ? c4[c] : c6[c];
      sb[0] = sb[1] = map4 ? s4 : s6;
    }
  }
  return NvColCodes{{codes[0], codes[1]}, {sb[0], sb[1]}};
}

// ---- NVFP4 columnwise by pairs of tiles --------------------------------------------------------------

// Tiles (2i, k) and (2i + 1, k) hold the two 64-byte halves of the 128-byte code lines of their
// 64 result rows. Stored by one tile each, 64-byte pieces of 64 rows, the codes made the
// columnwise cast's stores, not its reads or math, its largest cost. So the NVFP4 kernels walk
// the tiles by such pairs: the first tile's codes wait in registers, and both tiles' NVFP4
// outputs are staged in the second tile's stage once every thread has read it,
// then stored as whole 128-byte rows of codes and 16 scale bytes a row. The stage (16 KB) then
// holds 16 blocks x 64 result rows of codes (8-byte words, block-major; the rows of block b at
// row ^ pair_swizzle(b), so that the reads of a store phase, 4 rows x 8 block pairs, fall 2 a
// bank pair) and their scale bytes, block-major after them.
struct NvPairOut {
  static constexpr int kScales = 16 * 64 * 8;  // byte offset of the scale bytes
  __device__ static int pair_swizzle(int b) { return 4 * ((b >> 1) & 3); }
  __device__ static int word(int b, int r) { return b * 64 + (r ^ pair_swizzle(b)); }
};

// This thread's codes of tile `half` of the pair (block 8 half + w, result rows 2p and 2p + 1,
// adjacent under the swizzle) and their scale bytes, into the stage `out`.
__device__ __forceinline__ void nv_pair_stage(unsigned char* out, const NvColCodes& c, int half) {
  const int p = threadIdx.x & 31, b = 8 * half + (threadIdx.x >> 5);
  *reinterpret_cast<uint4*>(out + 8 * NvPairOut::word(b, 2 * p)) = make_uint4(c.q[0].x, c.q[0].y, c.q[1].x, c.q[1].y);
  *reinterpret_cast<uint16_t*>(out + NvPairOut::kScales + 64 * b + 2 * p) =
      static_cast<uint16_t>(c.sb[0] | (c.sb[1] << 8));
}

// What a pair's store does with its scale bytes: stores them (16 a result row); keeps them for
// the next pair of its strip; or stores the kept ones and its own (32 a result row).
constexpr int kPairScalesStored = 0, kPairScalesKept = 1, kStripScalesStored = 2;

// Result row rr's 16 scale bytes of the staged pair (one byte a block, block-major).
__device__ __forceinline__ uint4 pair_scale_row(const unsigned char* out, int rr) {
  const uint8_t* sc = out + NvPairOut::kScales + rr;
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int b = 0; b < 16; ++b) w[b >> 2] |= static_cast<uint32_t>(sc[64 * b]) << (8 * (b & 3));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first nb (at most 16) of 16 scale bytes to dst: one 16-byte store where all are whole and
// dst is aligned, else two 8-byte words or bytes (store_scale_bytes).
__device__ __forceinline__ void store_scale_x16(uint8_t* dst, uint4 v, uint32_t nb) {
  if (nb == 16 && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {  // one request a row, not two
    *reinterpret_cast<uint4*>(dst) = v;
  } else {
    store_scale_bytes(dst, (static_cast<uint64_t>(v.y) << 32) | v.x, nb < 8 ? nb : 8);
    if (nb > 8) store_scale_bytes(dst + 8, (static_cast<uint64_t>(v.w) << 32) | v.z, nb - 8);
  }
}

// The staged pair to the result [R, C]: its 64 result rows from r0, 16 blocks of 16 from c0 (the
// first tile's). Codes leave two blocks a thread, 8 threads a row, as one 16-byte store where the
// pair is whole and aligned. Scale bytes (`scales`): a row a thread, 16 bytes; or, for a strip's
// first pair, into `kept` (a row a thread, each read back by the thread that kept it); or, for its
// second, a row's 32 bytes by two threads (the kept ones and this pair's), so that each request of
// a warp carries one whole 32-byte sector where C % 512 == 0: a quarter of the pairs' requests.
__device__ __forceinline__ void nv_pair_store(const TileArgs& a, const unsigned char* out, uint32_t r0, uint32_t c0,
                                              uint32_t R, uint32_t C, int scales, uint4* kept) {
  const uint2* q = reinterpret_cast<const uint2*>(out);
  const int j = threadIdx.x & 7;  // blocks 2j, 2j + 1
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int rr = 32 * pass + (threadIdx.x >> 3);
    const uint32_t row = r0 + rr, col = c0 + 32 * j;
    if (row < R && col < C) {
      const uint2 lo = q[NvPairOut::word(2 * j, rr)], hi = q[NvPairOut::word(2 * j + 1, rr)];
      uint8_t* dst = a.nv_q + (wide(row, C / 2) + col / 2);
      if (col + 16 < C && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
      } else {
        *reinterpret_cast<uint2*>(dst) = lo;
        if (col + 16 < C) *reinterpret_cast<uint2*>(dst + 8) = hi;
      }
    }
  }
  if (scales == kStripScalesStored) {
    // Thread 2 rr + h: bytes 16 h.. of row rr's 32, from the strip's first column c0 - 2 * kRows.
    if (threadIdx.x < 128) {
      const int rr = threadIdx.x >> 1, h = threadIdx.x & 1;
      const uint32_t row = r0 + rr, first = c0 - 2 * kRows;
      const uint32_t nb = (C - first) / 16 < 32 ? (C - first) / 16 : 32;
      if (row < R && nb > 16u * h) {
        const uint4 v = h ? pair_scale_row(out, rr) : kept[rr];
        store_scale_x16(a.nv_s + (wide(row, C / 16) + first / 16 + 16u * h), v, nb - 16u * h < 16 ? nb - 16u * h : 16);
      }
    }
  } else {
    // Row rr by thread rr; a strip's first pair keeps row rr by thread 2 rr, which stores it.
    const bool keep = scales == kPairScalesKept;
    const int rr = keep ? threadIdx.x >> 1 : threadIdx.x;
    const uint32_t row = r0 + rr;
    if ((keep ? threadIdx.x < 128 && (threadIdx.x & 1) == 0 : threadIdx.x < 64) && row < R) {
      const uint4 v = pair_scale_row(out, rr);
      if (keep) {
        kept[rr] = v;
      } else {
        const uint32_t nb = (C - c0) / 16 < 16 ? (C - c0) / 16 : 16;
        store_scale_x16(a.nv_s + (wide(row, C / 16) + c0 / 16), v, nb);
      }
    }
  }
}

// ---- NVFP4 rowwise with stochastic rounding ---------------------------------------------------------

// Lane l of warp w takes column block l % 4 (16 columns) of the rows 16w + l / 4 and
// 16w + l / 4 + 8. The four lanes of a row hold its four blocks of the tile, so codes (8 bytes a
// block) leave as whole 32-byte sectors and scale bytes as 4 contiguous bytes, straight from
// registers. A 2D tile (16x16) is the 8 lanes of one l % 4, two rows each.
template <typename T>
__device__ __forceinline__ void nv_row_phase(const TileArgs& a, const NvFlags& f, const unsigned char* tile,
                                             const NvShared& nv, uint32_t m0, uint32_t k0) {
  const int l = threadIdx.x & 31, w = threadIdx.x >> 5, cb = l & 3, r0 = 16 * w + (l >> 2);
  const uint32_t R = a.M, C = a.K, col = k0 + 16 * cb;
  // Both blocks' amaxes first, on the packed words (a 2D tile needs both), then each block is
  // widened and encoded in turn: one block's 16 values live at a time.
  float bam[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    uint4 raw[16 / Vec<T>::kN];
    load16_raw<T>(tile, r0 + 8 * j, 16 * cb, raw);
    uint32_t m = 0u;
#pragma unroll
    for (int i = 0; i < 16 / Vec<T>::kN; ++i) m = absmax_word<T>(m, raw[i]);
    bam[j] = u2f(absmax_bits<T>(m));
  }
  if (f.b2d) bam[0] = bam[1] = lanes_absmax<4, 8>(u2f(max(f2u(bam[0]), f2u(bam[1]))));
  uint8_t sb[2];
  Codes codes[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float v[16];
    load16<T>(tile, r0 + 8 * j, 16 * cb, v);
    const uint32_t qrow = m0 + r0 + 8 * j;
    const float enc = nv_block_scale(a, nv, false, qrow, R, 0u, bam[j], &sb[j]);
    codes[j] = nv_block_codes(nv, f.sr, v, sign_nibbles(v), bam[j], enc, qrow * C + col);  // mod 2**32
  }
  // K % 16 == 0 makes a block wholly in or out, and aligns its 8 code bytes.
  if (col >= C) return;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t qrow = m0 + r0 + 8 * j;
    if (qrow < R) {
      *reinterpret_cast<uint2*>(a.nv_q + (wide(qrow, C / 2) + col / 2)) = make_uint2(codes[j].x, codes[j].y);
      a.nv_s[wide(qrow, C / 16) + col / 16] = sb[j];
    }
  }
}

// ---- MXFP8 ------------------------------------------------------------------------------------------

// Rowwise beside NVFP4 columnwise (the hybrid cast, 128 x 64 tiles). The codes and scales are
// staged in shared memory and leave after a barrier as rows of COLS code bytes and COLS / 32 scale
// bytes: stored straight from the lanes, each request would carry one 32-byte sector or one scale
// byte, and the L2's requests, not the DRAM, would bound the cast. COLS is one tile's 64 columns,
// or 128 where the walk takes two tiles of the same rows in turn (Walk's quads): whole 128-byte
// lines and 4 scale bytes a row, half the store requests. Chunk c (16 bytes) of row r is kept at
// c ^ ((r / 2) % 4) in 64-byte rows and at c ^ (r % 8) in 128-byte rows: the 8 rows of a staging
// phase (one chunk of 8 consecutive rows) and the one or two rows of a store phase then fall in
// distinct banks.
template <int COLS>
struct MxRowOut {
  static_assert(COLS == kCols || COLS == 2 * kCols, "one tile's columns or two");
  using ScaleWord = std::conditional_t<COLS == kCols, uint16_t, uint32_t>;
  uint4 q[kRows][COLS / 16];
  uint8_t s[kRows][COLS / 32];
  __device__ static int chunk(int r, int c) { return COLS == kCols ? c ^ ((r >> 1) & 3) : c ^ (r & 7); }
};

// One thread's MXFP8 rowwise outputs of a tile: 16 code bytes of each of two 32-blocks and their
// scale codes.
struct MxRowCodes {
  uint4 q[2];
  uint32_t code[2];
};

// Lanes l and l ^ 8 of warp w hold the two halves (h = l / 8 % 2) of the 32-blocks of row
// 16w + l % 8 + 8 (l / 16); one shuffle joins their amaxes. The 8 lanes of each phase of a
// 16-byte shared-memory read are 8 consecutive rows at one column, in distinct banks under the
// stage's swizzle.
__device__ __forceinline__ int mx_row_of_thread() {
  const int l = threadIdx.x & 31;
  return 16 * (threadIdx.x >> 5) + (l & 7) + 8 * (l >> 4);
}

template <typename T>
__device__ __forceinline__ MxRowCodes mx_row_codes(const TileArgs& a, const unsigned char* tile) {
  const int l = threadIdx.x & 31, r = mx_row_of_thread(), h = (l >> 3) & 1;
  MxRowCodes out;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    constexpr int kN = Vec<T>::kN;
    uint4 raw[16 / kN];
    load16_raw<T>(tile, r, 32 * j + 16 * h, raw);
    uint32_t am = 0u;  // max |element| bits on the packed words (NaN above inf), both halves
#pragma unroll
    for (int i = 0; i < 16 / kN; ++i) am = absmax_word<T>(am, raw[i]);
    am = absmax_bits<T>(am);
    am = max(am, __shfl_xor_sync(kFull, am, 8));
    float v[16];
#pragma unroll
    for (int i = 0; i < 16 / kN; ++i) Vec<T>::unpack(raw[i], v + i * kN);
    out.code[j] = mx_scale_code(u2f(am), a.rule);
    out.q[j] = mx_e4m3x16(v, out.code[j]);
  }
  return out;
}

// This thread's rowwise outputs of a tile into the staged rows: their 64 columns from column
// 64 side (side 1 only in 128-column rows, for the second tile of the same rows).
template <int COLS>
__device__ __forceinline__ void mx_row_stage(MxRowOut<COLS>& out, const MxRowCodes& c, uint32_t side) {
  const int r = mx_row_of_thread(), h = (threadIdx.x >> 3) & 1, c0 = 4 * static_cast<int>(side);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    out.q[r][out.chunk(r, c0 + 2 * j + h)] = c.q[j];
    if (h == 0) out.s[r][c0 / 2 + j] = static_cast<uint8_t>(c.code[j]);
  }
}

// The staged rowwise outputs of the rows m0.. from column k0, after a barrier: COLS / 16 threads a
// row, 16 bytes each (chunks past K are not stored: K % 16 == 0 makes each wholly in or out); a
// row's scale bytes as one word where they are whole and aligned (K % 32 == 0).
template <int COLS>
__device__ __forceinline__ void mx_row_store(const TileArgs& a, const MxRowOut<COLS>& out, uint32_t m0, uint32_t k0) {
  constexpr int kPerRow = COLS / 16, kRowsPerPass = kThreads / kPerRow, kScales = COLS / 32;
  const int c = threadIdx.x % kPerRow;
  const uint32_t col = k0 + 16 * c;
#pragma unroll
  for (int k = 0; k < kRows / kRowsPerPass; ++k) {
    const int r = kRowsPerPass * k + threadIdx.x / kPerRow;
    if (m0 + r < a.M && col < a.K)
      *reinterpret_cast<uint4*>(a.mxr_q + (wide(m0 + r, a.K) + col)) = out.q[r][out.chunk(r, c)];
  }
  if (threadIdx.x < kRows && m0 + threadIdx.x < a.M) {
    const int r = threadIdx.x;
    const uint32_t nb = (a.K - k0) / 32 < kScales ? (a.K - k0) / 32 : kScales;
    using W = typename MxRowOut<COLS>::ScaleWord;
    W bytes = 0;
#pragma unroll
    for (int b = 0; b < kScales; ++b) bytes |= static_cast<W>(static_cast<W>(out.s[r][b]) << (8 * b));
    store_scale_bytes(a.mxr_s + (wide(m0 + r, a.K / 32) + k0 / 32), bytes, nb);
  }
}

// Columnwise, alone or with rowwise (ROW), on 64 x 128 tiles from register patches: warp w takes
// the 32x32 patch at tile rows 32 (w / 4).., columns 32 (w % 4)..; lane l its 4 rows 4 (l / 4)..
// and 8 columns 8 (l % 4).., read once as 16-byte words (for 16-bit inputs every bank once per 8
// lanes under the stage's swizzle). A column's 32-block lies in the 8 lanes of one l % 4 and a
// row's in the 4 lanes of one l / 4, so both amaxes are warp reductions, without a shared-memory
// exchange. Each reduction step halves the words a lane keeps (a reduce-scatter), so lane l ends
// with the amax of column l / 4 of its 8 (and of row 2 (l % 2) + (l / 2) % 2 of its 4); it
// computes that block's scale code and the lanes gather back the exponent bytes of the
// multipliers (mx_inv_exponent). The codes and the row scales are staged in shared memory and
// leave as whole 128-byte rows; the column scales (32 consecutive bytes a warp) go straight out.
template <typename T>
struct MxPatch {
  static constexpr bool kWide = sizeof(T) == 4;
  static constexpr int kWords = kWide ? 8 : 4;  // words of one row's 8 columns
  static constexpr uint32_t kMag = kWide ? 0x7FFFFFFFu : 0x7FFF7FFFu;
  // Max of magnitude bits, per 16-bit half for 16-bit inputs (NaN above inf either way).
  __device__ static uint32_t max_bits(uint32_t a, uint32_t b) { return kWide ? max(a, b) : __vmaxu2(a, b); }
  // Element c (0..7) of a row's words, widened exactly.
  __device__ static float value(const uint32_t* w, int c) {
    if constexpr (kWide) return u2f(w[c]);
    else return (c & 1) ? PairWord<T>::hi(w[c / 2]) : PairWord<T>::lo(w[c / 2]);
  }
};

// One reduce-scatter of n words across lanes l ^ mask: a lane with the mask bit set keeps the
// upper n / 2 words, the other the lower; each kept word takes the max with its partner's.
template <typename P, int N>
__device__ __forceinline__ void mx_scatter_max(uint32_t* w, int mask, bool up) {
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const uint32_t send = up ? w[k] : w[k + N / 2], keep = up ? w[k + N / 2] : w[k];
    w[k] = P::max_bits(keep, __shfl_xor_sync(kFull, send, mask));
  }
}
// The last step for 16-bit words: the lane with the mask bit keeps the high halves.
__device__ __forceinline__ uint32_t mx_scatter_half(uint32_t w, int mask, bool up) {
  const uint32_t send = up ? (w & 0xFFFFu) : (w >> 16), keep = up ? (w >> 16) : (w & 0xFFFFu);
  return max(keep, __shfl_xor_sync(kFull, send, mask));
}

// Bytes 0xFF where e's byte is 0xFF (a NaN or inf block's exponent), 0 elsewhere.
__device__ __forceinline__ uint32_t mx_nan_bytes(uint32_t e) {
  uint32_t f = 0u;
#pragma unroll
  for (int b = 0; b < 4; ++b)
    if (((e >> (8 * b)) & 0xFFu) == 0xFFu) f |= 0xFFu << (8 * b);
  return f;
}

// Four E4M3 bytes of v[j] * m[j] (products that are not NaN but in blocks the caller marks).
__device__ __forceinline__ uint32_t mx_e4m3x4(const float* v, const float* m) {
  return e4m3x2_nonan(v[0] * m[0], v[1] * m[1]) | (e4m3x2_nonan(v[2] * m[2], v[3] * m[3]) << 16);
}

// The staged codes of one 64 x 128 tile where every thread stores them (code built without
// tensor copies; with them, mx_store_at), each direction (columnwise, then rowwise with ROW) as
// 8-byte words, word j of row r at j ^ 4 ((r / 4) % 4), so that the 16 lanes of a store phase
// (4 rows 4 apart, 4 words each) hit distinct banks. They take the tile's own stage once every
// patch is read (the stage is refilled only after the next tile's first barrier), which keeps
// four CTAs per SM.
template <bool ROW>
struct alignas(16) MxOut {
  uint2 q[ROW ? 2 : 1][kMxRows][kMxCols / 8];
  __device__ static int word(int r, int j) { return j ^ (((r >> 2) & 3) << 2); }
};

// The staged codes for the copy unit's stores (STORE): direction d's 64 x 128 bytes at 8192 d,
// row r at 128 r, its 16-byte chunk c at c ^ (r % 8): the maps' 128-byte swizzle.
__device__ __forceinline__ int mx_store_at(int d, int r, int byte) {
  return 8192 * d + 128 * r + ((((byte >> 4) ^ r) & 7) << 4) + (byte & 15);
}

// rs: the row scales of the tile, 4 a row (ROW). STORE: the staged codes leave by the copy unit
// (thread 0 issues the stores through q_map_c and q_map_r, and waits until they have read the
// stage before it refills it); else by every thread, as whole rows. The tensor stores took the
// threads' 16-byte stores and their proxy fence off the tile's end: 2.5 % (16384x8192) and 5 %
// (8192x5120) off both directions on an H100.
template <typename T, bool ROW, bool STORE>
__device__ __forceinline__ void mx_patch_phase(const TileArgs& a, unsigned char* tile, uint32_t* rs, uint32_t m0,
                                               uint32_t k0, const CUtensorMap* q_map_c, const CUtensorMap* q_map_r) {
  using P = MxPatch<T>;
  using S = Stage<T, kMxRows, kMxCols>;
  static_assert(sizeof(MxOut<ROW>) <= S::kBytes, "the staged codes fit in the tile's stage");
  MxOut<ROW>& out = *reinterpret_cast<MxOut<ROW>*>(tile);
  constexpr int kW = P::kWords;
  const int l = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int pr = 32 * (w >> 2), pc = 32 * (w & 3), c0 = pc + 8 * (l & 3), r0 = pr + 4 * (l >> 2);
  uint32_t x[4][kW];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < kW / 4; ++h) {
      const uint4 q = *reinterpret_cast<const uint4*>(tile + S::at(r0 + i, c0 * static_cast<int>(sizeof(T)) + 16 * h));
      x[i][4 * h] = q.x;
      x[i][4 * h + 1] = q.y;
      x[i][4 * h + 2] = q.z;
      x[i][4 * h + 3] = q.w;
    }
  }
  // Column maxima of the 4 rows and (ROW) row maxima over the 8 columns, from one masking of the
  // words before any shuffle (so the magnitudes die young and are not masked twice); then the
  // columns' across the 8 lanes of the column group (lane bits 4, 3, 2).
  uint32_t cm[kW], rm[kW / 2];
  {
    uint32_t mag[4][kW];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < kW; ++j) mag[i][j] = x[i][j] & P::kMag;
    }
#pragma unroll
    for (int j = 0; j < kW; ++j)
      cm[j] = P::max_bits(P::max_bits(mag[0][j], mag[1][j]), P::max_bits(mag[2][j], mag[3][j]));
    if constexpr (ROW && P::kWide) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t m = 0u;
#pragma unroll
        for (int j = 0; j < 8; ++j) m = max(m, mag[i][j]);
        rm[i] = m;
      }
    } else if constexpr (ROW) {
      uint32_t h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = __vmaxu2(__vmaxu2(mag[i][0], mag[i][1]), __vmaxu2(mag[i][2], mag[i][3]));
      // Rows 2k and 2k + 1 in the halves of one word: the max of each row's two halves.
#pragma unroll
      for (int k = 0; k < 2; ++k)
        rm[k] = __vmaxu2(__byte_perm(h[2 * k], h[2 * k + 1], 0x5410), __byte_perm(h[2 * k], h[2 * k + 1], 0x7632));
    }
  }
  mx_scatter_max<P, kW>(cm, 16, l & 16);
  mx_scatter_max<P, kW / 2>(cm, 8, l & 8);
  uint32_t col_bits;
  if constexpr (P::kWide) {
    mx_scatter_max<P, 2>(cm, 4, l & 4);
    col_bits = cm[0];
  } else {
    col_bits = mx_scatter_half(cm[0], 4, l & 4);
  }
  // Rows come whole in patches of 32 (M % 32 == 0), columns in groups of 8 (K % 16 == 0).
  const bool in = m0 + pr < a.M && k0 + c0 < a.K;
  const uint32_t ccode = mx_scale_code(u2f(absmax_bits<T>(col_bits)), a.rule);
  if (in) a.mxc_s[wide((m0 + pr) / 32, a.K) + (k0 + c0 + (l >> 2))] = static_cast<uint8_t>(ccode);
  uint32_t ec = mx_inv_exponent(ccode) << (8 * ((l >> 2) & 1));
  ec |= __shfl_xor_sync(kFull, ec, 4);
  ec <<= 16 * ((l >> 3) & 1);
  ec |= __shfl_xor_sync(kFull, ec, 8);
  const uint32_t other = __shfl_xor_sync(kFull, ec, 16);
  const uint32_t e_lo = (l & 16) ? other : ec, e_hi = (l & 16) ? ec : other;  // columns 0..3, 4..7
  uint32_t er = 0u, rcode = 0u;
  if constexpr (ROW) {
    // The row maxima across the 4 lanes of the row group (lane bits 0, 1).
    if constexpr (P::kWide) {
      mx_scatter_max<P, 4>(rm, 1, l & 1);
      mx_scatter_max<P, 2>(rm, 2, l & 2);
    } else {
      mx_scatter_max<P, 2>(rm, 1, l & 1);
      rm[0] = mx_scatter_half(rm[0], 2, l & 2);
    }
    const int own = 2 * (l & 1) + ((l >> 1) & 1);  // the row of the 4 whose amax this lane holds
    rcode = mx_scale_code(u2f(absmax_bits<T>(rm[0])), a.rule);
    reinterpret_cast<uint8_t*>(rs)[4 * (r0 + own) + (w & 3)] = static_cast<uint8_t>(rcode);
    er = mx_inv_exponent(rcode) << (8 * ((l >> 1) & 1));
    er |= __shfl_xor_sync(kFull, er, 2);
    er <<= 16 * (l & 1);
    er |= __shfl_xor_sync(kFull, er, 1);  // rows 0..3
  }
  // Blocks whose amax is NaN or inf (code 255, exponent byte 255) get 0x7F bytes, as
  // mx_e4m3x16 gives: rare, so the masks are formed only when the warp has one.
  const bool nan_blocks = __any_sync(kFull, ccode == 255u || (ROW && rcode == 255u));
  float mc[8];  // the columns' multipliers 2**(127 - code)
#pragma unroll
  for (int c = 0; c < 8; ++c) mc[c] = u2f((((c < 4 ? e_lo : e_hi) >> (8 * (c & 3))) & 0xFFu) << 23);
  const uint32_t f_lo = nan_blocks ? mx_nan_bytes(e_lo) : 0u, f_hi = nan_blocks ? mx_nan_bytes(e_hi) : 0u;
  const uint32_t f_row = ROW && nan_blocks ? mx_nan_bytes(er) : 0u;
  __syncthreads();  // every patch is read: the stage takes the codes
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = P::value(x[i], c);
    const int r = r0 + i, j = out.word(r, c0 / 8);
    const uint32_t q_lo = mx_e4m3x4(v, mc), q_hi = mx_e4m3x4(v + 4, mc + 4);
    const uint2 qc = make_uint2((q_lo & ~f_lo) | (0x7F7F7F7Fu & f_lo), (q_hi & ~f_hi) | (0x7F7F7F7Fu & f_hi));
    if constexpr (STORE) *reinterpret_cast<uint2*>(tile + mx_store_at(0, r, c0)) = qc;
    else out.q[0][r][j] = qc;
    if constexpr (ROW) {
      const float m = u2f(((er >> (8 * i)) & 0xFFu) << 23);
      const float mr[4] = {m, m, m, m};
      const uint32_t force = (f_row >> (8 * i)) & 0xFFu ? 0x7F7F7F7Fu : 0u, keep = ~force;
      const uint2 qr = make_uint2((mx_e4m3x4(v, mr) & keep) | force, (mx_e4m3x4(v + 4, mr) & keep) | force);
      if constexpr (STORE) *reinterpret_cast<uint2*>(tile + mx_store_at(1, r, c0)) = qr;
      else out.q[ROW ? 1 : 0][r][j] = qr;
    }
  }
  if constexpr (STORE) fence_proxy_async_smem();  // the staged codes, before the copy unit reads them
  __syncthreads();
  if constexpr (STORE) {
    if (threadIdx.x == 0) {
      tensor_store(q_map_c, static_cast<int>(k0), static_cast<int>(m0), smem_addr(tile));
      if constexpr (ROW) tensor_store(q_map_r, static_cast<int>(k0), static_cast<int>(m0), smem_addr(tile + 8192));
      bulk_commit();
    }
  }
  // Out as whole rows: 8 threads a row, 16 bytes (16 columns) each.
  constexpr int kPerRow = kMxCols / 16, kRowsPerPass = kThreads / kPerRow;
  const int cj = threadIdx.x % kPerRow;
  const uint32_t col = k0 + 16 * cj;
#pragma unroll
  for (int d = 0; d < (STORE ? 0 : ROW ? 2 : 1); ++d) {
    uint8_t* dst = d == 0 ? a.mxc_q : a.mxr_q;
#pragma unroll
    for (int k = 0; k < kMxRows / kRowsPerPass; ++k) {
      const int r = kRowsPerPass * k + threadIdx.x / kPerRow;
      // Words 2 cj and 2 cj + 1 stay adjacent under the swizzle (it flips bits 2 and 3).
      const uint4 q = *reinterpret_cast<const uint4*>(&out.q[d][r][out.word(r, 2 * cj)]);
      if (m0 + r < a.M && col < a.K) *reinterpret_cast<uint4*>(dst + (wide(m0 + r, a.K) + col)) = q;
    }
  }
  if constexpr (ROW) {
    // K % 32 == 0 here; a tile row's 4 scale bytes as one word where they are whole and aligned.
    if (threadIdx.x < kMxRows && m0 + threadIdx.x < a.M) {
      const uint32_t nb = (a.K - k0) / 32 < 4 ? (a.K - k0) / 32 : 4;
      store_scale_bytes(a.mxr_s + (wide(m0 + threadIdx.x, a.K / 32) + k0 / 32), rs[threadIdx.x], nb);
    }
  }
}

// ---- the amax after RHT ------------------------------------------------------------------------------

// Lane p of warp w transforms columns 2p and 2p+1 of tile rows 16w..16w+15 (bf16, packed pairs) and
// returns both runs' max |result| bits. Rows and columns past x's edges were zero-filled: their
// transform is zero.
__device__ __forceinline__ uint32_t rht_amax_phase(const unsigned char* tile) {
  using S = Stage<at::BFloat16>;
  const int p = threadIdx.x & 31, w = threadIdx.x >> 5;
  uint32_t wd[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) wd[i] = *reinterpret_cast<const uint32_t*>(tile + S::at(16 * w + i, 4 * p));
  return rht16x2_bf16_absmax(wd);
}

// ---- the tile walk ---------------------------------------------------------------------------------

// The grid step in tiles, as whole rows of tiles and the remainder.
struct TileStep {
  uint32_t rows, cols, tiles_k;
};

// Tile t as (row tile, column tile) of a grid tiles_k tiles wide, moved on by a TileStep.
struct TileWalk {
  uint32_t tm, tk;
  __device__ TileWalk(uint32_t t, uint32_t tiles_k) : tm(t / tiles_k), tk(t % tiles_k) {}
  __device__ static TileWalk at(uint32_t tm, uint32_t tk) {
    TileWalk w(0u, 1u);
    w.tm = tm;
    w.tk = tk;
    return w;
  }
  __device__ __forceinline__ void advance(const TileStep& by) {
    tm += by.rows;
    tk += by.cols;
    if (tk >= by.tiles_k) {
      tk -= by.tiles_k;
      ++tm;
    }
  }
};

// A CTA's sequence of tiles: units u, u + grid, ... of a grid of units `width` wide. A unit is
// ROWS x COLS tiles taken row by row: one tile; the pair (2 tm, tk), (2 tm + 1, tk); the strip of
// four tile rows (4 tm + i, tk); or the quad (2 tm, 2 tk), (2 tm, 2 tk + 1), (2 tm + 1, 2 tk),
// (2 tm + 1, 2 tk + 1), whose tiles 0 and 2, and 1 and 3, are pairs, and 0 and 1, and 2 and 3,
// the same rows side by side. `half` is the tile's place in its unit.
template <int ROWS, int COLS>
struct Walk {
  static_assert((ROWS == 1 || ROWS == 2 || ROWS == 4) && (COLS == 1 || (COLS == 2 && ROWS == 2)),
                "a tile, a pair, a strip or a quad");
  static constexpr uint32_t kTiles = ROWS * COLS;
  TileWalk unit;
  uint32_t u, half;
  __device__ Walk(uint32_t first, uint32_t width) : unit(first, width), u(first), half(0u) {}
  // The tile a stage holds, as fill() recorded it (where()).
  __device__ explicit Walk(uint4 w) : unit(TileWalk::at(w.y, w.z)), u(w.x), half(w.w) {}
  __device__ __forceinline__ uint4 where() const { return make_uint4(u, unit.tm, unit.tk, half); }
  __device__ __forceinline__ uint32_t tm() const { return ROWS * unit.tm + (COLS == 1 ? half : half >> 1); }
  __device__ __forceinline__ uint32_t tk() const { return COLS == 2 ? 2u * unit.tk + (half & 1u) : unit.tk; }
  __device__ __forceinline__ void advance(const TileStep& by, uint32_t step) {
    if (half + 1u < kTiles) {
      ++half;
      return;
    }
    half = 0u;
    unit.advance(by);
    u += step;
  }
  // On to the next tile, the next unit taken from *next (units `first` on are taken in turn;
  // past `units`, the walk stays there).
  __device__ __forceinline__ void take(unsigned* next, uint32_t first, uint32_t units, uint32_t width) {
    if (half + 1u < kTiles) {
      ++half;
      return;
    }
    if (u >= units) return;
    *this = Walk(first + atomicAdd(next, 1u), width);
  }
};

// ---- the kernel --------------------------------------------------------------------------------------

// The tiles of a kernel's walk unit (Walk): NVFP4 columnwise outputs leave by pairs of tiles
// (NvPairOut). The hybrid cast of 16-bit inputs may also walk quads (kQuadsOf), so that its MXFP8
// rows leave as whole 128-byte lines (MxRowOut<128>) too; its fp32 form keeps pairs, as 17 KB of
// staged rows would leave room for one CTA an SM.
template <bool NV, int MODE>
constexpr int kUnitOf = !NV || MODE == kNvAmaxRht ? 1 : 2;
template <typename T, bool NV, bool MXR>
constexpr bool kQuadsOf = NV && MXR && sizeof(T) == 2;
// The NVFP4 columnwise casts of their own mode (bf16) may also walk strips of four tile rows, so
// that a result row's scale bytes of two pairs leave as one whole 32-byte sector (nv_pair_store).
template <bool NV, bool MXR, int MODE>
constexpr bool kStripsOf = NV && !MXR && (MODE == kNvCol || MODE == kNvColRhtSr || MODE == kNvCol2d);
// A unit of UNIT tiles is a quad (2 x 2 tiles) in the hybrid cast, else a column of UNIT tiles:
// its tile rows and columns.
template <bool MXR, int UNIT>
constexpr int kUnitCols = MXR && UNIT == 4 ? 2 : 1;
template <bool MXR, int UNIT>
constexpr int kUnitRows = UNIT / kUnitCols<MXR, UNIT>;

// The kernels whose CTAs take their next units from a counter as they go (tile_kernel), where
// the launch's input has kTakeFrom elements or more: below that, the counter's zeroing (a memset
// launch, about 1 us of GPU time) cost more than the balance saved. The MXFP8 and hybrid casts
// gain 4-11 % from 2**26 elements (8192x8192); the NVFP4 columnwise casts alone 1-3 % at 2**27
// (16384x8192) and lost 2 % at 2**26. Not the general NVFP4 kernel (every flag's path, its
// 16-bit forms at their register cap).
template <bool NV, bool MXR, int MODE>
constexpr bool kTakesUnits = !(NV && !MXR && MODE == kNvAny);
template <bool NV, bool MXR>
constexpr int64_t kTakeFrom = int64_t{1} << (NV && !MXR ? 27 : 26);

// CTAs per SM the register budget is cut for: 4 for 16-bit inputs (3 stages of 16 KB and 64
// registers a thread fit 4 times; MXFP8 both directions among them, at 71 registers without the
// cut); 3 for the hybrid cast of a fixed mode (its staged MXFP8 rows leave room for three; 64
// registers bound it, and the quads' second held codes take more); 2 for the general hybrid
// kernel (every flag's path: it spills at 80 registers), for fp32 tiles (32 KB a stage) and for
// 4over6 (two candidates per block). The hybrid cast had run a ring of 4 stages
// at 3 CTAs an SM, within noise of 3 stages with its NVFP4 outputs by pairs.
template <typename T, bool NV, int FO6, bool MXR, int MODE>
constexpr int kMinCtas = sizeof(T) == 2 && FO6 == 0 ? (!(NV && MXR) ? 4 : MODE != kNvAny ? 3 : 2) : 2;

// The stage of a kernel: NVFP4 tiles are 128 x 64, the MXFP8-only ones 64 x 128.
template <typename T, bool NV>
using TileStage = Stage<T, NV ? kRows : kMxRows, NV ? kCols : kMxCols>;

// Tensor copies exist from sm_90 on; code built for an earlier target (the portable PTX) copies
// by cp.async, and leaves the kernel's map unused.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kTensorCopies = true;
#else
constexpr bool kTensorCopies = false;
#endif

template <typename T, bool NV, int FO6, bool MXR, bool MXC, int MODE, int UNIT>
__global__ void __launch_bounds__(kThreads, kMinCtas<T, NV, FO6, MXR, MODE>)
    tile_kernel(TileArgs a, uint32_t units, uint32_t tiles_m, uint32_t tiles_k,
                const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap q_map_c,
                const __grid_constant__ CUtensorMap q_map_r) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kRing = kStages;
  constexpr int kUnit = UNIT;
  static_assert(UNIT == kUnitOf<NV, MODE> || (UNIT == 4 && (kQuadsOf<T, NV, MXR> || kStripsOf<NV, MXR, MODE>)),
                "the kernel's walk unit");
  using W = Walk<kUnitRows<MXR, UNIT>, kUnitCols<MXR, UNIT>>;
  constexpr bool kQuads = MXR && UNIT == 4, kStrips = !MXR && UNIT == 4;
  __shared__ __align__(8) uint64_t landed[kRing];  // tensor copies: a stage's tile is in
  __shared__ uint4 stage_tile[kRing];  // the tile each stage holds (Walk::where), set by fill()
  __shared__ uint32_t mx_rs[MXC && MXR ? kMxRows : 1];
  __shared__ std::conditional_t<NV && MXR, MxRowOut<kQuads ? 2 * kCols : kCols>, char> mx_rows;
  __shared__ uint4 strip_scales[kStrips ? kCols : 1];  // the scale bytes of a strip's first pair
  __shared__ float enc_of[NV ? 256 : 1];
  __shared__ Fo6Byte fo6_bytes[FO6 ? 256 : 1];
  __shared__ float fo6_cols[2][FO6 ? 8 : 1][FO6 ? kThreads : 1];
  __shared__ uint32_t warp_max[MODE == kNvAmaxRht ? kThreads / 32 : 1];
  using S = TileStage<T, NV>;
  static_assert(NV || MXC, "MXFP8 rowwise alone runs in the rows kernel");
  const T* x = static_cast<const T*>(a.x);
  // With tensor copies one thread fills each stage by S::kGroups copies (a box of 128 bytes x
  // S::kRows rows each) that complete on the stage's `landed` barrier, and the stages start at
  // a 1024-byte boundary (the launch adds the slack), where the copy unit's 128-byte swizzle is
  // Stage's layout; otherwise every thread copies its 16-byte chunks by cp.async. The copy unit
  // takes the ring's refill off the 256 threads: its addresses, predicates and 16-byte copies.
  constexpr bool tma = kTensorCopies;
  const uint32_t dyn = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t base = tma ? (dyn + 1023u) & ~1023u : dyn;
  unsigned char* const stages = smem + (base - dyn);
  NvShared nv{NvScale{}, enc_of, 0u, 0u, fo6_bytes, &fo6_cols[0][0][threadIdx.x], &fo6_cols[1][0][threadIdx.x]};
  NvFlags f = nv_flags<MODE>(a.nv);
  if constexpr (FO6 != 0) f.rht = f.sr = false;  // 4over6 excludes both (check_nv_options)
  constexpr bool kAmax = MODE == kNvAmaxRht;
  uint32_t run_max = 0u;  // kAmax: the max |result| bits of this thread's runs, one per 16-bit half
  if constexpr (NV && !kAmax) {
    static_assert(kThreads == 256, "one scale byte a thread");
    if (!f.row_scaled) {
      nv.ts = nv_scale(a.amax[0], a.bound);
      enc_of[threadIdx.x] = nv_block_enc(static_cast<uint8_t>(threadIdx.x), nv.ts.s_dec);
      if constexpr (FO6 != 0) {
        fo6_bytes[threadIdx.x] = fo6_byte(static_cast<uint8_t>(threadIdx.x), nv.ts, static_cast<float>(6 * a.bound));
        fo6_zero(nv.col6);
        fo6_zero(nv.col4);
      }
    }
    if (FO6 == 0 && f.sr) {
      nv.key = mix32(static_cast<uint32_t>(a.sr_state[0]));
      nv.base = static_cast<uint32_t>(a.sr_state[1]);
    }
  }
  // The loop's first barrier orders the table's writes before any read.
  const uint32_t step = gridDim.x;
  // The tile coordinates advance by the grid without dividing (a division per tile and thread
  // cost about 5 instructions per element): `ahead` is the tile refilled, kRing - 1 tiles after
  // the one quantized, `cur`, whose place its stage records (stage_tile). Tile counts, positions
  // and their sums stay below 2**32 (set_tile_input, launch_tiles), so all of them are 32-bit;
  // byte offsets are formed by wide().
  const uint32_t width = kQuads ? (tiles_k + 1u) / 2u : tiles_k;  // of the grid of units
  const TileStep by{step / width, step % width, width};
  // Tile `at` into stage `slot`: by tensor copies from thread 0, else by every thread's cp.async
  // (a commit per slot, even an empty one, so that the groups count slots). A pair's or quad's
  // tiles past the last tile row or column (of an odd number of them) lie past x: their stages
  // keep what they held (the barrier's phase completes without copies), and the unit's stores
  // skip their rows and columns.
  auto fill = [&](int slot, const W& at) {
    const bool unit = at.u < units, in = unit && at.tm() < tiles_m && at.tk() < tiles_k;
    if (threadIdx.x == 0) stage_tile[slot] = at.where();  // a unit past the last ends the walk
    // The amax walks the tiles from the input's last to its first, so that the cast after it
    // finds its first tiles still in L2 ([Note: the amax walks back] in quant_rows_cuda.cu).
    const uint32_t tm = kAmax ? tiles_m - 1u - at.tm() : at.tm();
    const uint32_t tk = kAmax ? tiles_k - 1u - at.tk() : at.tk();
    if constexpr (tma) {
      if (unit && threadIdx.x == 0) {
        const uint32_t bar = smem_addr(&landed[slot]), dst = base + slot * S::kBytes;
        // The MXFP8 kernels' codes leave the stage by the copy unit: it has read them (the
        // newest store is the stage's, the tile before this one).
        if constexpr (MXC) bulk_wait_read<0>();
        if (in) {
          mbar_expect(bar, S::kBytes);  // boxes past the tensor's edges count in full, as zeros
#pragma unroll
          for (int g = 0; g < S::kGroups; ++g) {
            const int col = static_cast<int>(tk * S::kCols + g * S::kGroupCols);
            tensor_copy(dst + g * S::kRows * S::kPitch, &x_map, col, static_cast<int>(tm * S::kRows), bar);
          }
        } else {
          mbar_arrive(bar);
        }
      }
    } else {
      if (in) load_tile<S>(x, a.M, a.K, tm * S::kRows, tk * S::kCols, base + slot * S::kBytes);
      cp_async_commit();
    }
  };
  if constexpr (tma) {  // the barriers, before any copy or wait
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < kRing; ++s) mbar_init(smem_addr(&landed[s]), 1);
      mbar_init_fence();
      prefetch_map(&x_map);
    }
    __syncthreads();
  }
  // With tensor copies and a.next_unit, thread 0 takes each next unit from the launch's
  // counter as it refills (the units the CTAs take go to whichever CTA is ready: CTAs that walk
  // every grid-th unit finish at different times, and the SMs of the first wait idle); the other
  // threads read each stage's tile from stage_tile. A unit's tiles stay in one CTA, in order.
  W ahead(blockIdx.x, width);
  auto advance = [&] {
    if constexpr (tma && kTakesUnits<NV, MXR, MODE>) {
      if (a.next_unit != nullptr) {
        if (threadIdx.x == 0) ahead.take(a.next_unit, step, units, width);
        return;
      }
    }
    ahead.advance(by, step);
  };
#pragma unroll
  for (int s = 0; s < kRing - 1; ++s) {  // the ring's first tiles
    fill(s, ahead);
    advance();
  }
  __syncthreads();  // their stage_tile
  NvColCodes held{}, held1{};  // the codes of the pairs' first tiles (held1: a quad's second pair)
  int stage = 0;
  uint32_t parity = 0u;  // of the use of the stage's `landed` barrier that brings the tile
  for (;;) {
    // Set by thread 0 when it filled the stage, kRing - 1 tiles ago: before the last barrier.
    const W cur(stage_tile[stage]);
    if (cur.u >= units) break;
    if constexpr (tma) mbar_wait(smem_addr(&landed[stage]), parity);  // the tile has landed
    else cp_async_wait<kRing - 2>();  // this thread's copies of the tile have
    __syncthreads();  // (cp.async: everyone's have,) and the stage refilled next is read out
    const int refill = stage == 0 ? kRing - 1 : stage - 1;
    fill(refill, ahead);
    advance();
    unsigned char* tile = stages + stage * S::kBytes;
    const uint32_t m0 = cur.tm() * S::kRows, k0 = cur.tk() * S::kCols, half = cur.half;
    if constexpr (MXC) {
      mx_patch_phase<T, MXR, tma>(a, tile, mx_rs, m0, k0, &q_map_c, &q_map_r);
    } else if constexpr (kAmax) {
      run_max = __vmaxu2(run_max, rht_amax_phase(tile));
    } else if constexpr (NV) {
      if (MXR || f.col) {  // the hybrid cast (MXR) is columnwise: run_tiles checks
        const NvColCodes c = nv_col_codes<T, FO6>(a, f, tile, nv, m0, k0);
        if constexpr (kQuads) {
          // A quad: tiles 0 and 1 stage the MXFP8 rows of tile row 2 tm side by side, tiles 2 and 3
          // those of 2 tm + 1; tiles 0 and 2, and 1 and 3, are the NVFP4 pairs.
          mx_row_stage(mx_rows, mx_row_codes<T>(a, tile), half & 1u);
          if (half < 2u) {
            if (half == 0u) held = c;
            else held1 = c;
          }
          if (half != 0u) {
            // Behind the staged MXFP8 rows; from tile 2 on, every thread has also read the tile,
            // whose stage then takes the pair's NVFP4 outputs.
            __syncthreads();
            if (half & 1u) mx_row_store(a, mx_rows, m0, k0 - S::kCols);
          }
          if (half >= 2u) {
            if (half == 2u) nv_pair_stage(tile, held, 0);  // (a select of the two would take the stack)
            else nv_pair_stage(tile, held1, 0);
            nv_pair_stage(tile, c, 1);
            if constexpr (tma) fence_proxy_async_smem();
            __syncthreads();
            nv_pair_store(a, tile, k0, m0 - S::kRows, a.K, a.M, kPairScalesStored, nullptr);
          }
        } else {
          if constexpr (MXR) mx_row_stage(mx_rows, mx_row_codes<T>(a, tile), 0u);
          if ((half & 1u) == 0u) {  // a pair's first tile (a strip's tiles 0 and 2)
            held = c;
            if constexpr (MXR) {
              __syncthreads();  // behind the staged MXFP8 rows
              mx_row_store(a, mx_rows, m0, k0);
            }
          } else {
            // Every thread has read the tile (and staged its MXFP8 rows): the stage takes the pair's
            // NVFP4 outputs.
            __syncthreads();
            if constexpr (MXR) mx_row_store(a, mx_rows, m0, k0);
            nv_pair_stage(tile, held, 0);
            nv_pair_stage(tile, c, 1);
            // Those writes before the tensor copy that refills the stage (after the next CTA barrier).
            if constexpr (tma) fence_proxy_async_smem();
            __syncthreads();
            // A strip's first pair keeps its scale bytes for the second's, which stores both.
            const int scales = kStrips ? (half == 1u ? kPairScalesKept : kStripScalesStored) : kPairScalesStored;
            nv_pair_store(a, tile, k0, m0 - S::kRows, a.K, a.M, scales, strip_scales);
          }
        }
      } else if constexpr (FO6 == 0) {  // rowwise 4over6 runs in quant_rows_cuda.cu: run_tiles checks
        nv_row_phase<T>(a, f, tile, nv, m0, k0);
      }
    }
    stage = stage == kRing - 1 ? 0 : stage + 1;
    if (stage == 0) parity ^= 1u;
  }
  if constexpr (!tma) cp_async_wait<0>();
  if constexpr (tma && MXC) {
    if (threadIdx.x == 0) bulk_wait_read<0>();  // the last stores have read the stage
  }
  if constexpr (kAmax) {  // integer max of magnitude bits: torch.amax's order, NaN above inf
    const uint32_t cta = cta_max<kThreads / 32>(max(run_max & 0xFFFFu, run_max >> 16), warp_max);
    if (threadIdx.x == 0) atomicMax(a.amax_out, cta << 16);  // one atomic a CTA
  }
}

// The input's tensor map for the tile kernel's stages: boxes of one column group (128 bytes) x
// S::kRows rows, swizzled by 128 bytes (Stage's layout).
template <typename S, typename T>
CUtensorMap tile_input_map(const TileArgs& a) {
  return tensor_map({a.x,
                     {cuuint64_t{a.K}, cuuint64_t{a.M}},
                     cuuint64_t{a.K} * sizeof(T),
                     {static_cast<cuuint32_t>(S::kGroupCols), static_cast<cuuint32_t>(S::kRows)},
                     sizeof(T) == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT32,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B},
                    "qtensor: the tile quantizer's input");
}

// The map of MXFP8 codes [M, K] that the copy unit stores the staged tiles through: boxes of
// 128 bytes x 64 rows, swizzled by 128 bytes (mx_store_at).
CUtensorMap mx_codes_map(uint8_t* q, const TileArgs& a) {
  return tensor_map({q,
                     {cuuint64_t{a.K}, cuuint64_t{a.M}},
                     cuuint64_t{a.K},
                     {static_cast<cuuint32_t>(kMxCols), static_cast<cuuint32_t>(kMxRows)},
                     CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE},
                    "qtensor: the MXFP8 quantizer's codes");
}

// How the tile kernel runs on a device: the CTAs resident at once, and whether the code that
// runs there takes its stages by tensor copies (built for sm_90 or later; a newer device that
// runs the portable compute_80 PTX does not).
struct TileLaunch {
  int resident;
  bool copies;
};

// The persistent grid: as many CTAs as fit on the device at once (read once per device and
// kernel), each with the dynamic shared memory of its stages. Code with tensor copies gets the
// input's map and 1024 bytes of slack to align the stages to the swizzle's unit.
template <typename T, bool NV, int FO6, bool MXR, bool MXC, int MODE, int UNIT>
TileLaunch tile_launch() {
  using S = TileStage<T, NV>;
  static std::array<TileLaunch, 64> how{};
  static std::array<std::once_flag, 64> found;
  const int dev = c10::cuda::current_device();
  TORCH_CHECK(dev < static_cast<int>(how.size()), "qtensor: device index ", num(dev), " is out of range.");
  std::call_once(found[dev], [&] {
    auto kernel = tile_kernel<T, NV, FO6, MXR, MXC, MODE, UNIT>;
    cudaFuncAttributes fa{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    const bool copies = fa.ptxVersion >= 90;
    const int smem = kStages * S::kBytes + (copies ? 1024 : 0);
    int per_sm = 0, sms = 0;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    how[dev] = TileLaunch{std::max(per_sm, 1) * sms, copies};
  });
  return how[dev];
}

// The walk's units of UNIT tiles over tiles_m x tiles_k tiles (those past the last tile row or
// column, where the unit's rows or columns do not divide them, included).
template <bool MXR, int UNIT>
int64_t walk_units(int64_t tiles_m, int64_t tiles_k) {
  constexpr int64_t rows = kUnitRows<MXR, UNIT>, cols = kUnitCols<MXR, UNIT>;
  return (tiles_m + rows - 1) / rows * ((tiles_k + cols - 1) / cols);
}

// The tiles the busiest CTA of a launch walks: its units times their tiles.
template <bool MXR, int UNIT>
int64_t busiest_tiles(int64_t tiles_m, int64_t tiles_k, const TileLaunch& h) {
  const int64_t units = walk_units<MXR, UNIT>(tiles_m, tiles_k);
  const int64_t grid = std::min<int64_t>(units, h.resident);
  return UNIT * ((units + grid - 1) / grid);
}

template <typename T, bool NV, int FO6, bool MXR, bool MXC, int MODE, int UNIT>
void launch_walk(const TileArgs& a, int64_t tiles_m, int64_t tiles_k, const TileLaunch& h) {
  using S = TileStage<T, NV>;
  const int smem = kStages * S::kBytes + (h.copies ? 1024 : 0);
  static const CUtensorMap kNoMap{};
  CUtensorMap map = kNoMap, q_map_c = kNoMap, q_map_r = kNoMap;
  if (h.copies) {
    // A copy's column coordinate is signed 32-bit; the last tile's last group starts at most
    // kCols - kGroupCols columns past K - 1.
    constexpr uint32_t kIntMax = static_cast<uint32_t>(std::numeric_limits<int32_t>::max());
    TORCH_CHECK(a.K <= kIntMax - (S::kCols - S::kGroupCols), "qtensor: the CUDA tile quantizer takes at most 2**31 - ",
                num(1 + S::kCols - S::kGroupCols), " columns; got an input of ", num(a.M), "x", num(a.K),
                ". Quantize it in chunks.");
    map = tile_input_map<S, T>(a);
    if constexpr (MXC) {
      q_map_c = mx_codes_map(a.mxc_q, a);
      if constexpr (MXR) q_map_r = mx_codes_map(a.mxr_q, a);
    }
  }
  const int64_t units = walk_units<MXR, UNIT>(tiles_m, tiles_k);
  const int64_t grid = std::min<int64_t>(units, h.resident);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Where the CTAs walk more than one unit each of a large input, they take their next units from
  // a counter zeroed here (tile_kernel, kTakesUnits); the allocator keeps its bytes until the
  // launch's stream is past it.
  TileArgs args = a;
  at::Tensor next;
  if (kTakesUnits<NV, MXR, MODE> && h.copies && units > grid &&
      static_cast<int64_t>(a.M) * static_cast<int64_t>(a.K) >= kTakeFrom<NV, MXR>) {
    next = at::empty({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::cuda::current_device()));
    C10_CUDA_CHECK(cudaMemsetAsync(next.data_ptr(), 0, sizeof(int32_t), stream));
    args.next_unit = reinterpret_cast<unsigned*>(next.data_ptr<int32_t>());
  }
  tile_kernel<T, NV, FO6, MXR, MXC, MODE, UNIT><<<grid, kThreads, smem, stream>>>(
      args, static_cast<uint32_t>(units), static_cast<uint32_t>(tiles_m), static_cast<uint32_t>(tiles_k), map, q_map_c,
      q_map_r);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The hybrid cast's quads halve its MXFP8 row stores' requests, and the NVFP4 columnwise casts'
// strips their scale bytes' requests, but both make the walk's units twice as coarse: where the
// tiles do not share out evenly over the CTAs the busiest CTA walks more of them. Units of 4 are
// chosen where the busiest CTA walks at most kQuadSlack more tiles than with pairs (1 + kQuadSlack
// of the time). The hybrid cast's quads run 3-8 % faster than its pairs where they give the
// busiest CTA 5-9 % more tiles (8192x8192, 16384x5120, 8192x14336 at 3 CTAs an SM), and slower
// from about 14 % more (8192x5120).
constexpr double kQuadSlack = 0.10;

template <typename T, bool NV, int FO6, bool MXR, bool MXC, int MODE = kNvAny>
void launch_tiles(const TileArgs& a) {
  using S = TileStage<T, NV>;
  const int64_t tiles_k = (static_cast<int64_t>(a.K) + S::kCols - 1) / S::kCols;
  const int64_t tiles_m = (static_cast<int64_t>(a.M) + S::kRows - 1) / S::kRows;
  // The kernel walks its units in 32 bits: u + kStages * grid must stay below 2**32.
  TORCH_CHECK(tiles_m * tiles_k < (int64_t{1} << 30),
              "qtensor: the CUDA tile quantizer takes fewer than 2**30 tiles of ",
              num(S::kRows), "x", num(S::kCols), " elements; got an input of ", num(a.M), "x", num(a.K),
              ". Quantize it in row chunks.");
  constexpr int kUnit = kUnitOf<NV, MODE>;
  const TileLaunch h = tile_launch<T, NV, FO6, MXR, MXC, MODE, kUnit>();
  if constexpr (kQuadsOf<T, NV, MXR> || kStripsOf<NV, MXR, MODE>) {
    const TileLaunch hq = tile_launch<T, NV, FO6, MXR, MXC, MODE, 4>();
    const int64_t fours = busiest_tiles<MXR, 4>(tiles_m, tiles_k, hq);
    const int64_t pairs = busiest_tiles<MXR, kUnit>(tiles_m, tiles_k, h);
    if (a.walk == 4 || (a.walk == 0 && static_cast<double>(fours) <= (1.0 + kQuadSlack) * static_cast<double>(pairs)))
      return launch_walk<T, NV, FO6, MXR, MXC, MODE, 4>(a, tiles_m, tiles_k, hq);
  }
  launch_walk<T, NV, FO6, MXR, MXC, MODE, kUnit>(a, tiles_m, tiles_k, h);
}

// An NVFP4 cast without 4over6 (with MXFP8 rowwise beside it for the hybrid cast: mxr) by the
// kernel of its mode.
template <typename T>
void launch_nv_mode(const TileArgs& a, bool mxr) {
  const int mode = nv_mode(a.nv);
  if (mxr) {  // the hybrid cast: NVFP4 columnwise
    if (mode == kNvColRhtSr) launch_tiles<T, true, 0, true, false, kNvColRhtSr>(a);
    else if (mode == kNvCol) launch_tiles<T, true, 0, true, false, kNvCol>(a);
    else launch_tiles<T, true, 0, true, false>(a);
    return;
  }
  switch (mode) {
    case kNvCol: return launch_tiles<T, true, 0, false, false, kNvCol>(a);
    case kNvColRhtSr: return launch_tiles<T, true, 0, false, false, kNvColRhtSr>(a);
    case kNvRowSr: return launch_tiles<T, true, 0, false, false, kNvRowSr>(a);
    case kNvCol2d: return launch_tiles<T, true, 0, false, false, kNvCol2d>(a);
    default: return launch_tiles<T, true, 0, false, false>(a);
  }
}

// x2's pointer and dimensions into a, each dimension at most 2**31 - 1 (the kernels' 32-bit
// positions).
void set_tile_input(const at::Tensor& x2, TileArgs& a) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(x2.size(0) <= kMax && x2.size(1) <= kMax,
              "qtensor: the CUDA tile quantizer takes at most 2**31 - 1 rows and columns; got a [",
              num(x2.size(0)), ", ", num(x2.size(1)), "] input. Quantize it in row chunks.");
  a.x = x2.data_ptr();
  a.M = static_cast<uint32_t>(x2.size(0));
  a.K = static_cast<uint32_t>(x2.size(1));
}

void run_tiles(const at::Tensor& x2, TileArgs& a, bool nv, bool mxr, bool mxc) {
  set_tile_input(x2, a);
  dispatch_float(x2.scalar_type(), "qtensor quantize", [&](auto tag) {
    using T = decltype(tag);
    if (nv && a.nv_4o6) {
      TORCH_CHECK(!mxr && !mxc, "qtensor: 4over6 is not fused with MXFP8 outputs.");
      TORCH_CHECK(a.nv.col, "qtensor: the tile quantizer's 4over6 is columnwise; rowwise runs in the rows kernels.");
      if (a.nv_4o6 == 2) launch_tiles<T, true, 2, false, false>(a);
      else launch_tiles<T, true, 1, false, false>(a);
    } else if (nv) {
      TORCH_CHECK(!mxr || a.nv.col, "qtensor: MXFP8 rowwise is fused with NVFP4 columnwise only.");
      if constexpr (std::is_same_v<T, at::BFloat16>) launch_nv_mode<T>(a, mxr);
      else if (mxr) launch_tiles<T, true, 0, true, false>(a);
      else launch_tiles<T, true, 0, false, false>(a);
    } else if (mxr && mxc) {
      launch_tiles<T, false, 0, true, true>(a);
    } else {
      TORCH_CHECK(mxc && !mxr, "qtensor: MXFP8 rowwise alone runs in the rows kernel.");
      launch_tiles<T, false, 0, false, true>(a);
    }
  });
}

}  // namespace

void rht_amax_tiles_cuda(const at::Tensor& x2, at::Tensor& out) {
  TileArgs a{};
  set_tile_input(x2, a);
  a.amax_out = reinterpret_cast<unsigned*>(out.data_ptr<float>());
  launch_tiles<at::BFloat16, true, 0, false, false, kNvAmaxRht>(a);
}

namespace {

TileArgs nv_args(const at::Tensor& amax, bool columnwise, bool block_2d, int64_t fourover6,
                 int64_t bound, bool rht, bool stochastic, const int64_t* sr_state,
                 at::Tensor& q, at::Tensor& s) {
  TileArgs a{};
  a.amax = amax.data_ptr<float>();  // contiguous
  a.amax_rs = amax.dim() == 2 ? static_cast<uint32_t>(amax.size(1)) : 1u;
  a.amax_bs = amax.dim() == 2 ? 1u : 0u;
  a.nv = NvFlags{columnwise, block_2d, rht, stochastic, amax.dim() >= 1};
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
                                                       const std::optional<at::Tensor>& sr_state, int64_t walk) {
  const char* op = "qtensor.nvfp4_quantize";
  const NvShape s = nv_shape(x, columnwise, block_2d, op);
  check_nv_options(fourover6, bound, columnwise, rht, stochastic, block_2d, amax.dim() >= 1, op);
  check_nv_block_amax(amax, columnwise, fourover6, op);
  TORCH_CHECK(walk == 0 || walk == 2 || walk == 4, op, " takes walk 0 (chosen), 2 (pairs) or 4 (strips); got ", num(walk),
              ".");
  TORCH_CHECK(walk == 0 || columnwise, op, ": walk ", num(walk), " is a columnwise tile walk; the rowwise cast has none. "
              "Pass walk 0.");
  const int mode = nv_mode(NvFlags{columnwise, block_2d, rht, stochastic, amax.dim() >= 1});
  TORCH_CHECK(walk != 4 || (x.scalar_type() == at::kBFloat16 && fourover6 == 0 &&
                            (mode == kNvCol || mode == kNvColRhtSr || mode == kNvCol2d)),
              op, " walks strips in the bf16 columnwise casts of their own kernel only (plain, 2D, or RHT with "
              "stochastic rounding, without 4over6); got ", x.scalar_type(), ", fourover6 ", num(fourover6),
              ", rht ", (rht ? "true" : "false"), ", stochastic ", (stochastic ? "true" : "false"), ", block_2d ",
              (block_2d ? "true" : "false"), ". Pass walk 0 or 2.");
  check_nv_amax(x, amax, s, op);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty({s.R, s.C / 2}, x.options().dtype(at::kByte));
  at::Tensor sc = at::empty({s.R, s.C / 16}, x.options().dtype(at::kByte));
  const at::Tensor a = amax.contiguous();
  const int64_t* sr = sr_state_ptr(x, stochastic, sr_state, op);
  if (!columnwise && !stochastic) {  // rowwise, round to nearest (RHT is columnwise): no tile needed
    if (block_2d) nvfp4_rows_2d_cuda(as_aligned_2d(x), a, fourover6, bound, q, sc);  // one tensor amax
    else nvfp4_rows_cuda(as_aligned_2d(x), a, fourover6, bound, q, sc);
    return {q, sc.view(at::kFloat8_e4m3fn)};
  }
  TileArgs args = nv_args(a, columnwise, block_2d, fourover6, bound, rht, stochastic, sr, q, sc);
  args.walk = static_cast<int>(walk);
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
    bool rht, bool stochastic, const std::optional<at::Tensor>& sr_state, int64_t walk) {
  const char* op = "qtensor.hybrid_quantize";
  TORCH_CHECK(x.dim() == 2, op, " takes a 2-D gradient [M, K]; got shape ", shape_str(x), ".");
  TORCH_CHECK(walk == 0 || walk == 2 || walk == 4, op, " takes walk 0 (chosen), 2 (pairs) or 4 (quads); got ", num(walk),
              ".");
  TORCH_CHECK(walk != 4 || x.element_size() == 2, op, " walks quads of 16-bit inputs only; got ", x.scalar_type(),
              ". Pass walk 0 or 2.");
  TORCH_CHECK(walk == 0 || fourover6 == 0, op, " with 4over6 runs as two casts, an MXFP8 and an NVFP4 one, and "
              "takes no tile walk; got walk ", num(walk), " with fourover6 ", num(fourover6), ". Pass walk 0.");
  check_mx_shape(x, true, false, op);
  check_scale_rule(rule, op);
  const NvShape s = nv_shape(x, true, false, op);
  check_nv_options(fourover6, bound, true, rht, stochastic, false, amax.dim() == 1, op);
  check_nv_amax(x, amax, s, op);
  TORCH_CHECK(amax.dim() < 2, op, ": takes a scalar or per-row amax; got a per-block one of shape ", shape_str(amax),
              ". Quantize the NVFP4 side with nvfp4_quantize.");
  if (fourover6) {  // 4over6's register budget does not fit beside the MXFP8 phase: two passes
    auto mx = mxfp8_quantize_cuda(x, rule, true, false);
    auto nv = nvfp4_quantize_cuda(x, amax, true, false, fourover6, bound, rht, stochastic, sr_state, 0);
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
  args.walk = static_cast<int>(walk);
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
