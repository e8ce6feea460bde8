// Weight-only decode GEMM: out[M, N] = epilogue(x[M, K] @ W[N, K]^T) for a bf16 or fp16
// activation of at most 64 rows and an NVFP4, MXFP4 or MXFP8 weight stored in the decode layout
// (docs/decode.md; pack and unpack: qtensor/formats/decode_layout.py).
//
// [Note: decode GEMM]
// The weight streams once; everything else is arranged so that its decode costs fewer
// instructions per element than the memory leaves time for.
// - Layout. The weight is cut into super-tiles of 16 rows x 64 K. Within one, lane (g, t) of a
//   warp (g = lane / 4, t = lane % 4) owns rows g and g + 8 at K offsets [16t, 16t + 16): its 32
//   codes are one 16-byte vector (two for MXFP8), already in the order of the A fragments of
//   four m16n8k16 MMAs, and one NVFP4 block per row, so a lane needs two scales per super-tile.
//   The MMA's K slots are a permutation of physical K (slot j of subtile s is element
//   16t + 4s + ...), the same for the weight and the activation, so the activation a lane needs
//   is also contiguous: 16 elements, two 16-byte loads per 8 tokens.
// - Decode. A word of eight E2M1 codes becomes the four MMA registers that hold them, as bf16
//   bits of value * 2**-126 (2**-14 in fp16), by rotations and masks: the layout stores each
//   code bit where one of a register's few (rotation, mask) pieces picks it up, 9 instructions
//   per word in bf16, 7 of them on the integer ALU pipe (WORD_PIECES, [Note: decode layout]).
//   One bf16x2 multiply by F then gives value * scale. For NVFP4, F = s * 2**118 (bf16) or s *
//   2**7 (fp16), so the MMA multiplies (value * s) * 2**-8 (or 2**-7): exact, and exact again
//   after the epilogue's multiply by 2**8 (2**7), a power of two; the scale byte itself goes to
//   bf16 bits the same way (its value times 2**-120) and two multiplies by 2**119 make F. For
//   MXFP4 and MXFP8, F = 2**(code - 1) and 2**(code - 7) fold both factors into one multiply
//   while that power is a bf16 number (block scale codes up to 128 and 134); a super-tile
//   holding a larger code takes two multiplies, chosen by a warp vote so that no lane diverges.
//   A word of four E4M3 codes becomes two registers the same way (value * 2**-120), 5
//   instructions, 4 of them on the ALU pipe.
// - Products. Every weight value is exact in the MMA's type (at most 6 significant bits; MXFP8
//   as exact as bf16 holds it, as in the Triton kernels), the products are exact in fp32 and
//   the tensor cores accumulate in fp32: the result differs from the emulated reference
//   (qtensor/gemm/dense.py) only in the order of the fp32 additions, except where a product
//   (value * scale * x) * 2**-8 falls below fp32's normal range, 2**-126, i.e. for activations
//   below about 2**-108.
// - Split-K. A CTA is 4 consumer warps, each on R row tiles (64R rows in all), over one K
//   range, cut in whole stages; the S CTAs that split the K of those rows form a thread-block
//   cluster and sum their partial tiles through distributed shared memory, in rank order, so the
//   result is deterministic, the reduction needs no workspace, counter or second kernel, and the
//   epilogue runs once per element. S is the size whose clusters all fit at once (one wave) and
//   give each CTA the fewest stages, or a smaller size where that one leaves each CTA few
//   stages: the smallest that gives each CTA at most kSplitStages stages and makes at least
//   7/8 as many CTAs as SMs (pick_splits; a CTA's cluster barriers, reduction and epilogue do
//   not shrink with its K range); from 33 tokens, whose partial tiles are 8 times larger, at
//   most 2 where that leaves each CTA at most kWideStages stages. R is 2 for the 4-bit formats
//   from 9 tokens on weights of 2**27 elements or more (a warp's activation reads feed twice
//   the MMAs), else 1 (launch_r).
// - Streaming. A fifth warp fills a ring of kStages shared-memory stages of U super-tiles as the
//   consumers release them, by tensor copies (cp.async.bulk.tensor, through tensor maps the
//   launch makes): one for the weight of all the CTA's row tiles, one for their scales and one
//   per super-tile for the activation (a box of M rows x 64 elements, swizzled so that the
//   consumers' reads of 8 token rows fall in distinct banks). The copy unit takes about as long
//   for each copy whatever its size, so a stage costs U + 2 copies instead of one per row tile,
//   and the producer's lanes issue no activation copies; a `full` mbarrier per stage counts the
//   bytes in and an `empty` one counts the consumer warps out, so no warp waits at a CTA
//   barrier. Every stage is computed whole (a partial last stage is zero-filled); with up to 16
//   tokens a warp reads the next super-tile's operands into a second set of registers while its
//   MMAs run on this one, and its MMAs alternate between two accumulators. The decode's
//   instructions take about as long as the streaming (docs/decode.md, "Status"), so the
//   per-super-tile path holds only its shared loads, the decode and the MMAs.
// - The warpgroup tile (33-64 tokens, sm_90a; kTileAuto says where it is chosen). The four
//   consumer warps multiply as one warpgroup with wgmma: A is the activation in registers (a
//   warp's 16 tokens as the rows of the same fragments the m16n8k16 path reads as B), B the
//   decoded weights, which each warp stores with stmatrix into shared-memory tiles of 16 K slots
//   x 64 rows (its rows of every row-tile group). The K slots keep the layout's permutation on
//   both sides, so the products and their fp32 sums are those of the m16n8k16 path. Per
//   super-tile a warp decodes its weights while the previous super-tile's MMAs run, waits for
//   those MMAs (they read its activation registers asynchronously, and the one B buffer), meets
//   the other three at a named barrier, loads its activation, stores B, meets them again and
//   issues 4R asynchronous MMAs. Each warp reads only its own 16 tokens' activation, and one
//   instruction does the work of 32 m16n8k16 MMAs.
// - Launch. At decode sizes a launch's fixed part (its start, the first stage's wait on memory,
//   the reduction and the end) is as long as the streaming of a 4096x4096 weight, so the kernel
//   is launched to overlap the end of the previous kernel on the stream (programmatic dependent
//   launch, which CUDA graphs keep), where it measured faster: up to 16 tokens, and up to 32
//   but for small 4-bit weights. Until that kernel has completed, the producer only prefetches
//   the first kStages stages of its weight and scales into L2 (a hint: a write of that kernel
//   to those bytes would update the lines); it waits before its first copy (the activation may
//   be that kernel's output), and the consumers wait before the epilogue reads amax and bias
//   and writes the output (whose memory that kernel may still read). Once a CTA has streamed
//   its K range it lets the next kernel start, so that chained decode GEMMs (q, k, v; gate,
//   up) overlap too.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "tensor_copy.cuh"
#include "tensor_map.h"

namespace qtensor {
namespace {

namespace cg = cooperative_groups;

// Weight formats of the decode layout (qtensor/formats/decode_layout.py, FORMATS).
constexpr int kNvfp4 = 0, kMxfp4 = 1, kMxfp8 = 2;
constexpr int kWarps = 4;        // consumer warps per CTA
constexpr int kMaxSplits = 8;    // portable cluster size
constexpr int kSuperK = 64;      // K per super-tile
constexpr int kTileRows = 16;    // rows per super-tile

struct DecodeArgs {
  const uint16_t* x;       // [M, K] bf16 or fp16 bits, rows 16-byte aligned, ldx elements apart
  int64_t ldx;
  const uint4* w;          // [NT, KT, V, 32] 16-byte vectors (V = 1, or 2 for MXFP8)
  const uint16_t* s;       // [NT, KT, 32]: scale of row g (low byte) and of row g + 8
  const float* amax;       // NVFP4: 0-d or [N]; else null
  int64_t amax_stride;     // 0 for a per-tensor amax
  const void* bias;        // [N] or null
  at::ScalarType bias_dtype;
  void* out;               // [M, N]
  at::ScalarType out_dtype;
  int M, N, K, NT, KT;
  float ep_scale;          // the power of two the decode took out of the weight
  float inv;               // r(1 / (6 B)) for NVFP4 (multiplied when has_inv)
  bool has_inv;
  int bar_offset;           // shared-memory bytes before the stages' mbarriers
  // Tensor maps, made by the launch (which knows the stage): w and s as [NT] rows of 8-byte
  // elements, boxes of one stage's super-tiles of a CTA's row tiles (one copy each a stage);
  // x as [M] rows, boxes of one super-tile's 64 elements of every row (U copies a stage).
  CUtensorMap w_map, s_map, x_map;
};

// ---- decode --------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t rotr(uint32_t q, int n) { return __funnelshift_r(q, q, n); }

// A piece that takes only bits a left shift by n keeps: `(q << n) & mask`, which the compiler
// issues as an integer multiply on the FMA pipe (IMAD.SHL); with FMA false the same bits by a
// funnel shift on the integer ALU pipe (the same value, another register allocation).
template <bool FMA>
__device__ __forceinline__ uint32_t shl_piece(uint32_t q, int n, uint32_t mask) {
  return (FMA ? q << n : rotr(q, 32 - n)) & mask;
}

// The four A registers of one MMA (o = 2p + r: row g + 8r, K slots 2p + h) from its word of
// eight E2M1 codes, as bf16 (HALF: fp16) bits of value * 2**-126 (2**-14): the pieces of
// WORD_PIECES in qtensor/formats/decode_layout.py, each a rotation and a mask. The bf16 masks
// put the sign at bit 15 of a half and the exponent and mantissa bits at 8-6; fp16 wants them at
// 11-9, a rotation of 3 more, so each fp16 register takes one piece more. The layout places the
// bits so that three of the pieces are plain left shifts (shl_piece): with FMA, 7 of a bf16
// word's 9 instructions run on the integer ALU pipe, which issues a warp instruction every
// other cycle, instead of all 9.
template <bool HALF, bool FMA = true>
__device__ __forceinline__ void e2m1_regs(uint32_t q, uint32_t* a) {
  if constexpr (HALF) {
    constexpr uint32_t kSign = 0x80008000u, kMag = 0x0E000E00u;
    a[0] = (q & kSign) | (rotr(q, 29) & kMag);
    a[1] = (rotr(q, 4) & kSign) | (rotr(q, 1) & kMag);
    a[2] = shl_piece<FMA>(q, 6, kSign) | shl_piece<FMA>(q, 9, kMag);
    a[3] = shl_piece<FMA>(q, 2, kSign) | ((q >> 3) & 0x08000800u) | shl_piece<FMA>(q, 5, 0x06000600u);
  } else {
    constexpr uint32_t kPair = 0x81C081C0u;
    a[0] = q & kPair;
    a[1] = rotr(q, 4) & kPair;
    a[2] = shl_piece<FMA>(q, 6, kPair);
    a[3] = ((q >> 6) & 0x01000100u) | shl_piece<FMA>(q, 2, 0x80C080C0u);
  }
}

// The two A registers (rows g and g + 8) from a word of four E4M3 codes, as bf16 bits of
// value * 2**-120: sign at bit 15 of a half, exponent and mantissa at bits 10-4.
template <bool FMA = true>
__device__ __forceinline__ void e4m3_regs(uint32_t w, uint32_t* a) {
  a[0] = w & 0x87F087F0u;
  a[1] = (rotr(w, 8) & 0x07700770u) | shl_piece<FMA>(w, 4, 0x80808080u);
}

template <bool HALF>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (HALF) asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// bf16 2**(code - 127) of a UE8M0 code: 0 is 2**-127 (a bf16 subnormal), 255 is NaN.
__device__ __forceinline__ uint32_t ue8m0_bf16(uint32_t code) {
  return code == 0 ? 0x0040u : (code == 255 ? 0x7FC0u : code << 7);
}

// Bytes of v picked by `sel` (PRMT; selector nibbles 4-7 pick zero bytes).
__device__ __forceinline__ uint32_t prmt2(uint32_t v, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0u), "r"(sel));
  return d;
}

// Both halves of a pair from half `h` of v (0: low, 1: high).
__device__ __forceinline__ uint32_t splat_half(uint32_t v, int h) {
  uint32_t d;
  if (h) asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\nmov.b32 %0, {hi, hi};\n}\n" : "=r"(d) : "r"(v));
  else asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\nmov.b32 %0, {lo, lo};\n}\n" : "=r"(d) : "r"(v));
  return d;
}

// The multipliers of one super-tile for rows g (f[0]) and g + 8 (f[1]), from the two scale
// bytes sc (row g low); for a super-tile the warp takes in two multiplies, f2 holds the second
// pair and `two` is set (a warp vote: the same in every lane).
template <int FMT, bool HALF>
struct Factors {
  uint32_t f[2], f2[2];
  bool two;
  __device__ __forceinline__ void load(uint32_t sc) {
    two = false;
    // The two scale bytes to the low bytes of the halves: byte 0 -> bits 0-7, byte 1 -> 16-23.
    uint32_t p = prmt2(sc, 0x4140);
    if constexpr (FMT == kNvfp4) {
      // A non-negative E4M3 byte placed in a bf16 half (<< 4) is its value * 2**-120,
      // subnormals included; in an fp16 half (<< 7), its value * 2**-8. Powers of two then make
      // F = s * 2**118 (bf16) or s * 2**7 (fp16), exactly. pack refuses the scales this would
      // misread: NaN, and a set sign bit.
      if constexpr (HALF) {
        p = mul2<true>(p << 7, 0x78007800u);  // 2**15
      } else {
        p = mul2<false>(mul2<false>(p << 4, 0x7B007B00u), 0x7B007B00u);  // 2**119, twice
      }
    } else {
      constexpr uint32_t kFast = FMT == kMxfp4 ? 128 : 134;   // largest code of the one-multiply path
      constexpr uint32_t kBias = FMT == kMxfp4 ? 126 : 120;   // F = 2**(code + kBias - 127)
      two = __any_sync(0xFFFFFFFFu, max(sc & 0xFFu, sc >> 8) > kFast);
      if (!two) {
        p = (p + (kBias | (kBias << 16))) << 7;
      } else {
        constexpr uint32_t kFirst = FMT == kMxfp4 ? 0x7E807E80u : 0x7B807B80u;  // 2**126, 2**120
        const uint32_t q = ue8m0_bf16(sc & 0xFFu) | (ue8m0_bf16(sc >> 8) << 16);
        p = kFirst;
        f2[0] = splat_half(q, 0);
        f2[1] = splat_half(q, 1);
      }
    }
    f[0] = splat_half(p, 0);
    f[1] = splat_half(p, 1);
  }
  // Scaled register bits of row g + 8r. TWO: some row tile of the warp takes the super-tile in
  // two multiplies, this one if `two` (a predicated multiply); otherwise none does. The caller
  // branches on that once a super-tile, so that the common path holds one multiply a register
  // instead of two issued.
  template <bool TWO>
  __device__ __forceinline__ uint32_t apply(uint32_t bits, int r) const {
    const uint32_t v = mul2<HALF>(bits, f[r]);
    return TWO && two ? mul2<HALF>(v, f2[r]) : v;
  }
};

template <bool HALF>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (HALF) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---- warpgroup MMA (sm_90a) ----------------------------------------------------------------
// D[64 tokens, 64 weight rows] += A[64 tokens, 16 K slots] x B[16 K slots, 64 weight rows] per
// instruction, for the warpgroup tile ([Note: decode GEMM]).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QTENSOR_DECODE_WGMMA 1
#endif

// B tiles in shared memory: 16 K slots x 64 weight rows, K-major without swizzle, as 8 x 2 core
// matrices of 8 rows x 16 bytes (8 K slots): the two K halves of a row group 128 bytes apart
// (the leading-dimension offset), row groups 256 bytes apart (the stride offset).
constexpr int kBTile = 64 * 16 * 2;
constexpr uint32_t kBLead = 128, kBStride = 256;

__device__ __forceinline__ uint64_t b_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFFu) |
         (static_cast<uint64_t>(kBLead >> 4) << 16) | (static_cast<uint64_t>(kBStride >> 4) << 32);
}

// The four 8x8 matrices of a warp's m16n8k16 A fragment (rows g / g + 8 x K slots 0-7 / 8-15)
// to shared memory; lane i names row i % 8 of matrix i / 8.
__device__ __forceinline__ void stmatrix4(uint32_t addr, const uint32_t* a) {
#ifdef QTENSOR_DECODE_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]) : "memory");
#endif
}

// One m64n64k16 warpgroup MMA accumulating into d (fp32), A from registers, B by descriptor;
// AB is the PTX type of both operands.
#define QT_WGMMA_M64N64K16(AB)                                                               \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " "                            \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "              \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "    \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                           \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),  \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),           \
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),        \
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),        \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),        \
        "+f"(d[31])                                                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1))

template <bool HALF>
__device__ __forceinline__ void wgmma_n64(float* d, const uint32_t* a, uint64_t desc) {
#ifdef QTENSOR_DECODE_WGMMA
  if constexpr (HALF) QT_WGMMA_M64N64K16("f16");
  else QT_WGMMA_M64N64K16("bf16");
#endif
}
#undef QT_WGMMA_M64N64K16

__device__ __forceinline__ void wgmma_fence() {
#ifdef QTENSOR_DECODE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef QTENSOR_DECODE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef QTENSOR_DECODE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// The accumulators stay in place around asynchronous MMAs: no instruction the compiler moves
// across this reads or writes them.
__device__ __forceinline__ void fence_regs(float* d, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for the A registers an MMA reads asynchronously until the wait that completes it:
// touched after that wait, they stay allocated (and are not reused for temporaries) until then.
__device__ __forceinline__ void fence_regs(uint4* v, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i)
    asm volatile("" : "+r"(v[i].x), "+r"(v[i].y), "+r"(v[i].z), "+r"(v[i].w)::"memory");
}

template <typename T>
__device__ __forceinline__ float to_f32(const void* p, int64_t i) {
  return static_cast<float>(static_cast<const T*>(p)[i]);
}

__device__ __forceinline__ float load_float(const void* p, at::ScalarType t, int64_t i) {
  if (t == at::kFloat) return static_cast<const float*>(p)[i];
  if (t == at::kBFloat16) return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  return __half2float(__ushort_as_half(static_cast<const uint16_t*>(p)[i]));
}

__device__ __forceinline__ void store_float(void* p, at::ScalarType t, int64_t i, float v) {
  if (t == at::kFloat) static_cast<float*>(p)[i] = v;
  else if (t == at::kBFloat16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else static_cast<__half*>(p)[i] = __float2half_rn(v);
}

// The epilogue of output (tok, row) from its fp32 sum v: the power of two the decode took out
// of the weight, then NVFP4's r(1 / (6 B)) and amax, then the bias, in this order wherever it
// runs (the partial tiles' reduction or a CTA's registers), so that both give the same bits.
// amax and bias are the row's (1 and 0 where the launch has none).
__device__ __forceinline__ void store_out(const DecodeArgs& a, int tok, int row, float v,
                                          float amax, float bias) {
  float o = v * a.ep_scale;
  if (a.has_inv) o = o * a.inv;
  if (a.amax) o = o * amax;
  if (a.bias) o = o + bias;
  store_float(a.out, a.out_dtype, static_cast<int64_t>(tok) * a.N + row, o);
}
__device__ __forceinline__ float row_amax(const DecodeArgs& a, int row) {
  return a.amax ? a.amax[row * a.amax_stride] : 1.f;
}
__device__ __forceinline__ float row_bias(const DecodeArgs& a, int row) {
  return a.bias ? load_float(a.bias, a.bias_dtype, row) : 0.f;
}

// ---- bulk copies and barriers in shared memory (the rest: tensor_copy.cuh) ----------------

// A hint: `bytes` (a multiple of 16, 16-byte aligned) of global memory into L2. L2 is where every
// SM's writes meet, so a line prefetched before another kernel writes it is updated by that
// write: prefetching is safe before the previous kernel has finished.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// Programmatic dependent launch: wait until the kernel this launch may overlap has completed and
// its writes are visible (at once where there is none), and let the next one start.
__device__ __forceinline__ void wait_previous_kernel() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void let_next_kernel_start() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

// Accumulator chains: with one or two tiles of rows x tokens the four MMAs of a super-tile
// alternate between two accumulators, so that consecutive MMAs do not wait on each other; they
// are summed once at the end (fp32 additions in another order, within the bound of the
// reference).
template <int MT, int R>
constexpr int kChains = MT * R <= 2 ? 2 : 1;

// The operands of one super-tile for a warp's R row tiles: their weight vectors and scale pairs,
// and the lane's activation chunks (tokens 8i + g, 16 elements each as two vectors), read once
// for all R row tiles. Up to 16 tokens the consumer holds two: it reads the next super-tile's
// while the tensor cores work on this one, so that no warp waits on shared memory before its
// MMAs. With 64 tokens it holds half the activation chunks (subtiles 0 and 1) and reads the
// other half before subtile 2: 32 registers fewer keep three CTAs on an SM.
template <int FMT, int MT, int R, bool HALF>
struct Operands {
  static constexpr int V = FMT == kMxfp8 ? 2 : 1;
  static constexpr bool kHalves = MT >= 8;
  uint4 w[R][V];
  uint32_t sc[R];
  uint4 x[MT][2];

  // Super-tile u of the stage at `st`: row tile r's weight and scales at w_off and s_off, U
  // super-tiles further on for each r; its activation box at xs, token group i's first chunk at
  // x_off[i] and the second d1 bytes from it (the box's swizzle).
  template <int U>
  __device__ __forceinline__ void load(uint32_t st, int u, uint32_t w_off, uint32_t s_off, uint32_t xs,
                                       const uint32_t* x_off, int d1) {
    load_w<U>(st, u, w_off, s_off);
    load_x(xs, x_off, d1);
  }
  template <int U>
  __device__ __forceinline__ void load_w(uint32_t st, int u, uint32_t w_off, uint32_t s_off) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int v = 0; v < V; ++v) w[r][v] = lds128(st + w_off + ((r * U + u) * V + v) * 512);
      sc[r] = lds16(st + s_off + (r * U + u) * 64);
    }
  }
  __device__ __forceinline__ void load_x(uint32_t xs, const uint32_t* x_off, int d1) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < (kHalves ? 1 : 2); ++h)
        x[i][h] = lds128(xs + x_off[i] + h * d1);
  }

  // The four A registers of subtile s of row tile r (rows g and g + 8, the lane's K slots),
  // decoded and scaled: value * scale * 2**-8 (NVFP4 in bf16; [Note: decode GEMM]). FMA: the
  // decode's left shifts as multiplies (shl_piece); TWO: Factors::apply's.
  template <bool FMA, bool TWO>
  __device__ __forceinline__ void weight_regs(const Factors<FMT, HALF>& fac, int r, int s,
                                              uint32_t* a) const {
    if constexpr (FMT == kMxfp8) {
      // Subtile s: words 2s (registers 0, 1) and 2s + 1 (registers 2, 3) of the lane's 32 bytes.
      const uint4 v = w[r][s >> 1];
      e4m3_regs<FMA>((s & 1) ? v.z : v.x, a);
      e4m3_regs<FMA>((s & 1) ? v.w : v.y, a + 2);
    } else {
      const uint4 v = w[r][0];
      e2m1_regs<HALF, FMA>(s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w, a);
    }
#pragma unroll
    for (int o = 0; o < 4; ++o) a[o] = fac.template apply<TWO>(a[o], o & 1);
  }

  // The products into acc[r][subtile % chains][i]; with kHalves the activation's second half is
  // read from `half1` + x_off[i] (the super-tile's box + d1).
  __device__ __forceinline__ void mma_into(float (*acc)[kChains<MT, R>][MT][4], uint32_t half1,
                                           const uint32_t* x_off) {
    Factors<FMT, HALF> fac[R];
    bool two = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      fac[r].load(sc[r]);
      two = two || fac[r].two;
    }
    // With 64 tokens the branch's second copy of the body costs registers (spills): the second
    // multiply is predicated there instead.
    if constexpr (FMT == kNvfp4 || MT == 8) mma_scaled<FMT != kNvfp4>(acc, half1, x_off, fac);
    else if (two) mma_scaled<true>(acc, half1, x_off, fac);
    else mma_scaled<false>(acc, half1, x_off, fac);
  }
  template <bool TWO>
  __device__ __forceinline__ void mma_scaled(float (*acc)[kChains<MT, R>][MT][4], uint32_t half1,
                                             const uint32_t* x_off, const Factors<FMT, HALF>* fac) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if (kHalves && s == 2) {
#pragma unroll
        for (int i = 0; i < MT; ++i) x[i][0] = lds128(half1 + x_off[i]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        uint32_t a[4];
        weight_regs<true, TWO>(fac[r], r, s, a);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const uint4 xv = x[i][kHalves ? 0 : s >> 1];
          const uint32_t b0 = (s & 1) ? xv.z : xv.x, b1 = (s & 1) ? xv.w : xv.y;
          mma<HALF>(acc[r][s % kChains<MT, R>][i], a, b0, b1);
        }
      }
    }
  }
};

// Pipeline stages in shared memory: a stage is U super-tiles of K for the CTA's kWarps * R row
// tiles (64R rows).
constexpr int kStages = 3;

// One stage, in whole 1024-byte units: the activation's U boxes (one per super-tile) of TOK
// token rows x 128 bytes, as the tensor copy leaves them with the 128-byte swizzle (16-byte chunk
// c of row r at chunk c ^ (r % 8), so that the 8 token rows one shared-memory phase reads fall in
// different banks; rows past M hold whatever was there), then the CTA's row tiles' weight vectors
// and their scales.
template <int FMT, int U, int R>
struct Stage {
  static constexpr int V = FMT == kMxfp8 ? 2 : 1;
  static constexpr int kTiles = kWarps * R;  // row tiles of a CTA
  static constexpr int kW = kTiles * U * V * 512;
  static constexpr int kS = kTiles * U * 64;
  static constexpr int x_box(int tok) { return tok * 128; }
  static constexpr int w_at(int tok) { return U * x_box(tok); }
  static constexpr int bytes(int tok) { return (w_at(tok) + kW + kS + 1023) / 1024 * 1024; }
};

// U: super-tiles per stage (the weight bytes a stage holds are the same for every format).
// A fifth warp, the producer, fills a ring of kStages stages with tensor copies (the weight, the
// scales, a box of the activation per super-tile) as soon as the four consumer warps have
// released a stage: a stage's `full` mbarrier counts its bytes in, its `empty` mbarrier counts
// the consumers out, and no warp waits at a CTA barrier in the loop. Per super-tile a consumer
// thread issues only its decode: three shared loads, the scale and value decode, and the MMAs.
constexpr int kThreads = (kWarps + 1) * 32;

// Shared-memory bytes of the warpgroup tile's B tiles: a super-tile's 4 subtiles for each of the
// R row-tile groups.
template <int R>
constexpr int kBBytes = 4 * R * kBTile;

// Registers a thread, from the CTAs of five warps that must fit on an SM (the K split is sized
// by the clusters resident at once, so more resident CTAs allow a finer split): with 9-32 tokens
// 96 (four CTAs; left free, MX weights took 106-112 and three), with 64 on m16n8k16 128 (three),
// up to 8 tokens 64 for MXFP8 (six; free, 80 and four). The other kernels of up to 8 tokens stay
// free (56-72): bounded to seven CTAs, NVFP4 ran 3-4 % slower and MXFP4 5-8 % on 8192x8192.
// The warpgroup tile fits 5 - R (its B tiles take shared memory too).
template <int FMT, int MT, int R, bool WG>
constexpr int kMinCtas = WG ? 5 - R : MT == 8 ? 3 : MT == 1 ? (FMT == kMxfp8 ? 6 : 1) : 4;

// WG: the warpgroup tile (64 tokens, sm_90a only).
template <int FMT, int MT, bool HALF, int U, int R, bool WG>
__global__ void __launch_bounds__(kThreads, (kMinCtas<FMT, MT, R, WG>))
    decode_gemm_kernel(const __grid_constant__ DecodeArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters: sm_90 and newer (decode_mm never launches it on an older device)
#else
#ifndef QTENSOR_DECODE_WGMMA
  if constexpr (WG) __trap();  // the host launches it only where the sm_90a code runs
#endif
  using St = Stage<FMT, U, R>;
  constexpr int V = St::V, kTiles = St::kTiles;
  constexpr int TOK = 8 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = static_cast<int>(cluster.block_rank()), splits = static_cast<int>(cluster.num_blocks());
  // The K range of this rank, in whole stages of U super-tiles: only the last stage of the last
  // rank can be partial, and every stage is one straight-line block of U super-tiles.
  const int chunks = (a.KT + U - 1) / U;
  const int kb = (chunks * rank) / splits * U;
  const int ke = min(a.KT, (chunks * (rank + 1)) / splits * U);
  const int batches = (ke - kb + U - 1) / U;
  const int stage_bytes = St::bytes(TOK);
  constexpr int kWAt = St::w_at(TOK), kXBox = St::x_box(TOK);
  const int tiles = min(kTiles, a.NT - static_cast<int>(blockIdx.x) * kTiles);  // row tiles here
  const uint32_t base = smem_addr(smem);
  const uint32_t sbase = (base + 1023u) & ~1023u;  // the stages: swizzled boxes need 1024-byte units
  // The stages' barriers follow the stages and the partial tile (a.bar_offset, 8-byte aligned):
  // kStages `full` barriers (the producer's arrival with the copies' bytes), then kStages
  // `empty` barriers (one arrival per consumer warp).
  const uint32_t full = base + a.bar_offset, empty = full + 8 * kStages;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      mbar_init(full + 8 * i, 1);  // the producer's expect_tx
      mbar_init(empty + 8 * i, kWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // The producer fills stage j with super-tiles kb + jU .. of every row tile of the CTA that
  // exists (the last CTA may hold fewer than kTiles: its missing tiles' shared memory is left
  // as it is and their results, rows past N, are never written). Activation columns past K,
  // and those of a partial stage's missing super-tiles, arrive as zeros (the tensor copies fill
  // what lies outside the tensor with zeros): every stage is computed whole, its weight there is
  // zero padding, and a stale Inf or NaN would not vanish in the product.
  auto issue = [&](int j) {
    const int kt0 = kb + j * U;
    const uint32_t st = sbase + (j % kStages) * stage_bytes, bar = full + 8 * (j % kStages);
    // The stage was last read through the generic proxy; order that before the copies.
    fence_proxy_async_smem();
    // The weight and scales of the CTA's row tiles: one tensor copy each. A missing super-tile
    // (past KT) or row tile (past NT) arrives as zeros, so its decode is finite.
    if (lane == 0) {
      mbar_expect(bar, St::kW + St::kS + U * a.M * 128);
      tensor_copy(st + kWAt, &a.w_map, kt0 * V * 64, blockIdx.x * kTiles, bar);
      tensor_copy(st + kWAt + St::kW, &a.s_map, kt0 * 8, blockIdx.x * kTiles, bar);
      // The activation: a box of M rows x 64 elements a super-tile; columns past K arrive as
      // zeros.
#pragma unroll
      for (int u = 0; u < U; ++u) tensor_copy(st + u * kXBox, &a.x_map, (kt0 + u) * kSuperK, 0, bar);
    }
  };

  constexpr int C = kChains<MT, R>;
  float acc[R][C][MT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][c][i][e] = 0.f;

  if (warp == kWarps) {
    // The launch may overlap the end of the previous kernel ([Note: decode GEMM], "Launch"): the
    // first stages' weight and scales go to L2 meanwhile, and nothing is read from global memory
    // into the stages, nor written, before that kernel has completed.
    if (lane == 0) {
      prefetch_map(&a.w_map);
      prefetch_map(&a.s_map);
    }
    if (lane < tiles) {
      const int first = min(kStages * U, ke - kb);
      const int64_t tile = static_cast<int64_t>(blockIdx.x * kTiles + lane) * a.KT + kb;
      if (first > 0) {
        prefetch_l2(a.w + tile * V * 32, first * V * 512);
        prefetch_l2(a.s + tile * 32, first * 64);
      }
    }
    wait_previous_kernel();
    // The producer: stage j once the consumers have released its slot's previous use, j - kStages
    // (use u of a slot completes the empty barrier's phase u, of parity u % 2).
    for (int j = 0; j < batches; ++j) {
      if (j >= kStages) mbar_wait(empty + 8 * (j % kStages), ((j / kStages) - 1) & 1);
      issue(j);
    }
  }
  // This thread's offsets within a stage: its first row tile's weight vector and scale pair (the
  // warp's R row tiles follow each other), its activation.
  const uint32_t w_off = kWAt + (warp * R * U * V * 32 + lane) * 16;
  const uint32_t s_off = kWAt + St::kW + (warp * R * U * 32 + lane) * 2;
  // Token rows past M read what the box's memory holds: a token is one column of the MMA's B
  // operand (a row of the warpgroup tile's A), so they change only outputs the epilogue never
  // writes. Row 8i + g's chunks 2t and 2t + 1 (its 16 elements) lie at chunks 2t ^ g and
  // (2t + 1) ^ g: d1 bytes apart.
  const uint32_t x_chunk = ((2 * t) ^ (g & 6)) + (g & 1);
  const int d1 = (g & 1) ? -16 : 16;
  uint32_t x_off[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) x_off[i] = (8 * i + g) * 128 + x_chunk * 16;
  const bool consumer = warp < kWarps;
  // The warpgroup tile's accumulators: D[64 tokens][64 weight rows] of row-tile group r (the
  // four warps' row tile r), in the wgmma fragment: this warp's tokens 16 warp + g (+ 8).
  float wacc[R][32];
  if constexpr (WG) {
    static_assert(MT == 8, "the warpgroup tile takes 64 tokens");
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < 32; ++e) wacc[r][e] = 0.f;
    // A: tokens 16 warp + g and 16 warp + 8 + g, the rows g and g + 8 of this warp's fragments.
    uint32_t xw_off[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      xw_off[i] = (16 * warp + 8 * i + g) * 128 + x_chunk * 16;
    // B: after the stages, [4 subtiles][R] tiles. This lane's stmatrix row: matrix
    // lane / 8 is (row group 2 warp + its bit 0, K half its bit 1), row lane % 8.
    const uint32_t btiles = sbase + kStages * stage_bytes;
    const int mtx = lane >> 3;
    const uint32_t st_off =
        (2 * warp + (mtx & 1)) * kBStride + (mtx >> 1) * kBLead + (lane & 7) * 16;
    Operands<FMT, 2, R, HALF> wop;
    int slot = 0;
    uint32_t parity = 0;
    for (int j0 = consumer ? 0 : batches; j0 < batches; j0 += 2) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = j0 + h;
        if (j < batches) {
          const uint32_t st = sbase + slot * stage_bytes;
          mbar_wait(full + 8 * slot, parity);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            // The weights of this super-tile, decoded while this warpgroup's MMAs of the
            // previous one run.
            Operands<FMT, 2, R, HALF>& op = wop;
            op.template load_w<U>(st, u, w_off, s_off);
            Factors<FMT, HALF> fac[R];
#pragma unroll
            for (int r = 0; r < R; ++r) fac[r].load(op.sc[r]);
            // MX weights: the second multiply predicated, without a branch (which cost this
            // tile's registers: spills).
            uint32_t wa[4][R][4];
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
              for (int r = 0; r < R; ++r)
                op.template weight_regs<false, FMT != kNvfp4>(fac[r], r, s, wa[s][r]);
            // Those MMAs read the B tiles and, asynchronously, this warp's activation
            // registers: the compiler does not keep an A register from reuse until the MMA
            // completes (it reused them for the next loads), so the warp waits for its MMAs
            // before loading them, and the barrier makes every warp's part of them done
            // before B is stored over.
            wgmma_wait<0>();
            fence_regs(&wacc[0][0], R * 32);
            fence_regs(&op.x[0][0], 4);
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            op.load_x(st + u * kXBox, xw_off, d1);
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
              for (int r = 0; r < R; ++r)
                stmatrix4(btiles + (s * R + r) * kBTile + st_off, wa[s][r]);
            // The tensor cores read B through the async proxy, after all four warps stored it.
            fence_proxy_async_smem();
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              const uint4 x0 = op.x[0][s >> 1], x1 = op.x[1][s >> 1];
              const uint32_t xa[4] = {(s & 1) ? x0.z : x0.x, (s & 1) ? x1.z : x1.x,
                                      (s & 1) ? x0.w : x0.y, (s & 1) ? x1.w : x1.y};
#pragma unroll
              for (int r = 0; r < R; ++r)
                wgmma_n64<HALF>(wacc[r], xa, b_desc(btiles + (s * R + r) * kBTile));
            }
            wgmma_commit();
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + 8 * slot);  // its registers hold what it read
          slot = slot + 1 == kStages ? 0 : slot + 1;
          if (slot == 0) parity ^= 1u;
        }
      }
    }
    wgmma_wait<0>();
    fence_regs(&wacc[0][0], R * 32);
    fence_regs(&wop.x[0][0], 4);
  }
  // Up to 16 tokens, super-tile q (stage q / U, offset q % U) computes from ops[q % 2] while
  // super-tile q + 1 is read into ops[(q + 1) % 2], the last of a stage waiting for the next
  // stage first. With more tokens the second set of activation registers would cost CTAs per SM
  // (occupancy), so a super-tile is read, then computed. Two stages per iteration keep q % 2 a
  // constant of the unrolled code for any U.
  constexpr bool kPrefetch = MT <= 2;
  Operands<FMT, MT, R, HALF> ops[2];
  int slot = 0;
  uint32_t parity = 0;
  if (kPrefetch && consumer && batches > 0) {
    mbar_wait(full, 0);
    ops[0].template load<U>(sbase, 0, w_off, s_off, sbase, x_off, d1);
  }
  for (int j0 = consumer && !WG ? 0 : batches; j0 < batches; j0 += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = j0 + h;
      if (j < batches) {
        const uint32_t st = sbase + slot * stage_bytes;
        const int next = slot + 1 == kStages ? 0 : slot + 1;
        const uint32_t next_parity = next == 0 ? parity ^ 1u : parity;
        if (!kPrefetch) mbar_wait(full + 8 * slot, parity);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int q = h * U + u;
          if (!kPrefetch) {
            ops[q & 1].template load<U>(st, u, w_off, s_off, st + u * kXBox, x_off, d1);
          } else if (u + 1 < U) {
            ops[(q + 1) & 1].template load<U>(st, u + 1, w_off, s_off, st + (u + 1) * kXBox, x_off, d1);
          } else if (j + 1 < batches) {
            mbar_wait(full + 8 * next, next_parity);
            const uint32_t nst = sbase + next * stage_bytes;
            ops[(q + 1) & 1].template load<U>(nst, 0, w_off, s_off, nst, x_off, d1);
          }
          ops[q & 1].mma_into(acc, st + u * kXBox + d1, x_off);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * slot);  // this warp is done with the stage
        slot = next;
        parity = next_parity;
      }
    }
  }
  // The weight is streamed: the next kernel may start (where it was launched to overlap this
  // one); the consumers, which have read only shared memory so far, wait for the previous one
  // before the epilogue reads amax and bias and writes the output.
  let_next_kernel_start();
  wait_previous_kernel();
  // Each accumulator's chains summed into chain 0, in chain order, for both ways out below.
  if constexpr (!WG) {
    if (warp < kWarps) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int c = 1; c < C; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][0][i][e] += acc[r][c][i][e];
    }
  }
  // Up to 16 tokens a CTA that holds the whole K range (a split of 1, a cluster of one) writes
  // its outputs from its registers: no partial tile, no cluster barrier and no reduction, which
  // took 1.8 us of a 22.5 us launch on 28672x4096 at one token (the per-CTA timeline, H200).
  // It applies the epilogue of the reduction path to the same sums, so it gives the same bits.
  if constexpr (!WG && MT <= 2) {
    if (splits == 1) {
      if (warp < kWarps) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          // Fragment element 2h + b: row g + 8h, token 8i + 2t + b.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row =
                (static_cast<int>(blockIdx.x) * kTiles + warp * R + r) * kTileRows + g + 8 * h;
            if (row >= a.N) continue;
            const float amax = row_amax(a, row), bias = row_bias(a, row);
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
              for (int b = 0; b < 2; ++b)
                if (8 * i + 2 * t + b < a.M)
                  store_out(a, 8 * i + 2 * t + b, row, acc[r][0][i][2 * h + b], amax, bias);
          }
        }
      }
      return;
    }
  }
  __syncthreads();  // the stages are free: the partial tile reuses their memory

  // Partial tile [64R rows][TOK tokens] of this CTA; fragment c0, c1: row g, tokens 2t, 2t + 1;
  // c2, c3: row g + 8.
  float* part = reinterpret_cast<float*>(smem);
  if (WG && warp < kWarps) {
    // D fragment j, element e: token 16 warp + g + 8 (e / 2), column n = 8j + 2t + e % 2 of
    // group r, which is row n % 16 of warp n / 16's row tile r.
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int n = 8 * (e >> 2) + 2 * t + (e & 1), tok = 16 * warp + g + 8 * ((e >> 1) & 1);
        part[(((n >> 4) * R + r) * kTileRows + (n & 15)) * TOK + tok] = wacc[r][e];
      }
  } else if (warp < kWarps) {  // the producer holds no tile
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        float* r0 = part + ((warp * R + r) * kTileRows + g) * TOK + 8 * i + 2 * t;
        r0[0] = acc[r][0][i][0];
        r0[1] = acc[r][0][i][1];
        r0[8 * TOK] = acc[r][0][i][2];
        r0[8 * TOK + 1] = acc[r][0][i][3];
      }
  }
  cluster.sync();
  // Rank r reduces the groups of 4 elements (one row, 4 tokens) e = r (mod splits): a thread
  // loads the group from every rank first, 16 bytes each and all in flight, then sums the ranks'
  // partials in rank order.
  constexpr int kGroups = kTiles * kTileRows * TOK / 4;
  const float4* part4 = reinterpret_cast<const float4*>(part);
  for (int e = rank + splits * static_cast<int>(threadIdx.x); e < kGroups; e += splits * kThreads) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int q0 = 0; q0 < splits; q0 += 4) {  // four ranks at a time
      float4 p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (q0 + i < splits) p[i] = *cluster.map_shared_rank(part4 + e, q0 + i);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (q0 + i < splits) {
          v[0] = q0 + i == 0 ? p[i].x : v[0] + p[i].x;
          v[1] = q0 + i == 0 ? p[i].y : v[1] + p[i].y;
          v[2] = q0 + i == 0 ? p[i].z : v[2] + p[i].z;
          v[3] = q0 + i == 0 ? p[i].w : v[3] + p[i].w;
        }
    }
    const int row = blockIdx.x * kTiles * kTileRows + 4 * e / TOK, tok0 = 4 * e % TOK;
    if (row >= a.N) continue;
    const float amax = row_amax(a, row), bias = row_bias(a, row);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (tok0 + c >= a.M) break;
      store_out(a, tok0 + c, row, v[c], amax, bias);
    }
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
#endif
}

// ---- host ----------------------------------------------------------------------------------

// How a launch runs: the K splits (0: the kernel chooses), the device and stream, and whether it
// may overlap the end of the previous kernel on the stream (programmatic dependent launch).
struct LaunchOptions {
  int splits;
  int device;
  cudaStream_t stream;
  bool pdl;
};

// The launch of `groups` clusters of `splits` CTAs (64R weight rows each, over one K range);
// `attr` holds two attributes.
inline cudaLaunchConfig_t cluster_config(int groups, int splits, int smem, cudaStream_t stream,
                                         cudaLaunchAttribute* attr, bool pdl = false) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(groups), static_cast<unsigned>(splits), 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 1;
  attr->val.clusterDim.y = static_cast<unsigned>(splits);
  attr->val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  return cfg;
}

// The weight's or the scales' map: `rows` rows of `row_bytes` bytes at `base`, as 8-byte
// elements, with boxes of `box_rows` rows x `box_bytes` bytes (the row tiles and super-tiles of
// one stage).
CUtensorMap tile_map(const void* base, int64_t rows, int64_t row_bytes, int box_bytes, int box_rows,
                     const char* what) {
  return tensor_map({base,
                     {static_cast<cuuint64_t>(row_bytes / 8), static_cast<cuuint64_t>(rows)},
                     static_cast<cuuint64_t>(row_bytes),
                     {static_cast<cuuint32_t>(box_bytes / 8), static_cast<cuuint32_t>(box_rows)},
                     CU_TENSOR_MAP_DATA_TYPE_UINT64, CU_TENSOR_MAP_SWIZZLE_NONE,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
                    what);
}

// The activation's map: M rows of K 16-bit elements, ldx apart, boxes of 64 elements (a
// super-tile's 128 bytes) x M rows, swizzled by 128 bytes (Stage).
CUtensorMap activation_map(const uint16_t* x, int m, int k, int64_t ldx) {
  return tensor_map({x,
                     {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(m)},
                     static_cast<cuuint64_t>(ldx * 2),
                     {static_cast<cuuint32_t>(kSuperK), static_cast<cuuint32_t>(m)},
                     CU_TENSOR_MAP_DATA_TYPE_UINT16, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_128B},
                    "qtensor.decode_gemm: the activation");
}

// The most stages pick_splits leaves a CTA when it makes the split smaller than the largest
// one-wave split, and the most a CTA of that split may have for pick_splits to look below it.
constexpr int kSplitStages = 8, kShortStages = 5;
// From 33 tokens: the largest split, where it leaves each CTA at most kWideStages stages.
constexpr int kWideSplits = 2, kWideStages = 64;

// K splits (the cluster size) when the caller leaves them to the kernel. Among the sizes whose
// clusters are all resident at once (one wave: a second wave would double the time), the one
// that gives each CTA the fewest stages, and of those the smallest (the least to reduce), is
// the most the split goes to. A CTA also has a part that does not shrink with its K range: the
// cluster barriers, the reduction of the partial tiles and the epilogue took 2.5 us of a
// 4096x4096 NVFP4 launch at one token and a split of 8, against 1.6 us for the main loop over
// its two stages (per-CTA timeline, H200). So the split is the smallest size (at most the
// most, and one whose clusters all fit) that gives each CTA at most kSplitStages stages and
// makes at least 7/8 as many CTAs as the device has SMs (`sms`; with fewer CTAs the memory
// system idles). It is below the most only where that one leaves each CTA at most
// kShortStages stages: on the H200, 4096x4096 NVFP4 at one token ran 6.3 us at a split of 2
// against 7.1 at 8, 6.6 against 8.9 us at 16 tokens, and at 32 tokens (5 stages a CTA at a
// split of 7) 10.9 us at 4 against 13.1 at 7; but 4096x14336 4-bit weights, whose split of 8
// leaves each CTA 7 stages, ran 3 % (H100) and 8 % (H200) slower at a split of 7.
// From 33 tokens (`wide`) a CTA's partial tile is 64 tokens x its rows in fp32, 8 times that of
// 8 tokens, and its stages are bound by the MMAs more than by the memory: there the split is at
// most kWideSplits where that leaves each CTA at most kWideStages stages. On the H100 at 64
// tokens (benchmarks/RESULTS.md, "eighth decode session") a split of 2 against the resident
// rule's: 4096x4096 13.0 against 18.6 us (NVFP4), MXFP8 17.5 against 22.4; 4096x14336 NVFP4
// 30.5 against 34.3; 8192x8192 MXFP8 39.8 against 45.8. Longer K ranges keep the resident rule:
// 4096x14336 MXFP8 (112 stages a CTA at 2) ran 47.8 us at 2 against 41.0, and 8192x28672 4-bit
// weights on the warpgroup tile of 128 rows (224 stages) 5-22 % slower at 2. Beside the
// resident rule in one run (RESULTS.md, "ninth decode session", H100, two passes) it took 20-27
// % off 4096x4096 at 40 and 64 tokens, 7-12 % off 4096x14336 NVFP4 and 8192x8192 MXFP8, and
// 6-11 % off 6144x4096 4-bit weights, while 6144x4096 MXFP8 lost 4 % (22.0 -> 23.0 us at 64).
// `fits[s]` is the number of clusters of size s resident at once, from the occupancy API.
inline int pick_splits(int groups, int chunks, int sms, const int* fits, bool wide) {
  int most = 1;
  for (int s = 2; s <= std::min(kMaxSplits, chunks); ++s)
    if (fits[s] >= groups && (chunks + s - 1) / s < (chunks + most - 1) / most) most = s;
  if (wide && most > kWideSplits && fits[kWideSplits] >= groups &&
      (chunks + kWideSplits - 1) / kWideSplits <= kWideStages)
    return kWideSplits;
  if ((chunks + most - 1) / most > kShortStages) return most;
  const int spread = (sms * 7 / 8 + groups - 1) / groups;
  const int stream = (chunks + kSplitStages - 1) / kSplitStages;
  for (int s = std::max(spread, stream); s < most; ++s)
    if (fits[s] >= groups) return s;
  return most;
}

template <int FMT, int MT, bool HALF, int U, int R, bool WG = false>
void launch(const DecodeArgs& a, const LaunchOptions& o) {
  using St = Stage<FMT, U, R>;
  constexpr int TOK = 8 * MT;
  constexpr int kPart = St::kTiles * kTileRows * TOK * 4;
  constexpr int kB = WG ? kBBytes<R> : 0;  // the warpgroup tile's B tiles follow the stages
  auto kernel = decode_gemm_kernel<FMT, MT, HALF, U, R, WG>;
  DecodeArgs b = a;
  b.w_map = tile_map(a.w, a.NT, int64_t{a.KT} * St::V * 512, U * St::V * 512, St::kTiles,
                     "qtensor.decode_gemm: the packed weight");
  b.s_map = tile_map(a.s, a.NT, int64_t{a.KT} * 64, U * 64, St::kTiles,
                     "qtensor.decode_gemm: the packed scales");
  b.x_map = activation_map(a.x, a.M, a.K, a.ldx);
  b.bar_offset = (std::max(1024 + kStages * St::bytes(TOK) + kB, kPart) + 7) / 8 * 8;
  const int smem = b.bar_offset + 2 * kStages * 8;
  const int groups = (a.NT + St::kTiles - 1) / St::kTiles;
  cudaLaunchAttribute attr[2];
  // Per device (up to 16) and activation rows: the resident clusters of each size, found once.
  static int fits[16][TOK + 1][kMaxSplits + 1] = {};
  static bool ready[16] = {};
  static int sms[16] = {};
  const int d = o.device & 15;
  if (!ready[d]) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms[d], cudaDevAttrMultiProcessorCount, o.device));
    const int most = (std::max(1024 + kStages * St::bytes(TOK) + kB, kPart) + 7) / 8 * 8;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        most + 2 * kStages * 8));
    ready[d] = true;
  }
  if (fits[d][a.M][1] == 0) {
    for (int s = 1; s <= kMaxSplits; ++s) {
      cudaLaunchConfig_t q = cluster_config(s, s, smem, o.stream, attr);
      int n = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &q));
      fits[d][a.M][s] = std::max(n, s == 1 ? 1 : 0);
    }
  }
  const int splits =
      o.splits ? o.splits
               : pick_splits(groups, (a.KT + U - 1) / U, sms[d], fits[d][a.M], MT == 8);
  cudaLaunchConfig_t cfg = cluster_config(groups, splits, smem, o.stream, attr, o.pdl);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, b));
}

// Tokens per launch (8 * MT), row tiles per warp (R) and super-tiles per stage (U). A stage
// holds 8 KB of weights up to 16 tokens, 4 KB above, where the activation rows take the shared
// memory. A 4-bit weight of 2**27 elements or more takes two row tiles per warp from 9 tokens
// on: each activation chunk a warp reads feeds twice the MMAs, and every CTA's copy of the
// activation serves twice the rows (on the H200, 28672x8192 NVFP4: M = 16 61 against 67 us,
// M = 64 190 against 238 us); on smaller weights the halved CTA count costs more than that
// saves, and MXFP8's twice larger weight vectors leave it no gain.
template <int FMT, int MT, bool HALF, int U>
void launch_r(const DecodeArgs& a, const LaunchOptions& o) {
  if constexpr (FMT != kMxfp8 && MT >= 2) {
    if (static_cast<int64_t>(a.N) * a.K >= (int64_t{1} << 27))
      return launch<FMT, MT, HALF, (U >= 2 ? U / 2 : 1), 2>(a, o);
  }
  launch<FMT, MT, HALF, U, 1>(a, o);
}

// Whether the warpgroup tile runs on `device`: a compute capability 9.0 GPU running the sm_90a
// code of this build (wgmma exists on no other target), found once per device.
bool wgmma_runs(int device) {
  static int state[16] = {};  // 0 unknown, 1 yes, 2 no
  const int d = device & 15;
  if (state[d] == 0) {
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(
        &attr, decode_gemm_kernel<kNvfp4, 8, false, 1, 2, true>));
    state[d] = prop.major == 9 && prop.minor == 0 && attr.binaryVersion == 90 ? 1 : 2;
  }
  return state[d] == 1;
}

// The tile of a launch with 33-64 tokens: the m16n8k16 tiles with one or two row tiles per warp
// (kTileMma, kTileMma128: 64 or 128 weight rows a CTA) or the warpgroup tile with one or two
// (kTileWgmma64, kTileWgmma128). kTileAuto chooses: where the warpgroup tile runs, MXFP8 takes
// it with one row tile per warp, and a 4-bit weight of 2**27 elements or more with two where
// K >= N (long K ranges) and one where N > K (more CTAs); the rest the m16n8k16 tiles. On the
// H200 at 40 and 64 tokens (benchmarks/RESULTS.md, "the decode GEMM's warpgroup tile and
// overlapped launches"), MXFP8 gains 1.1-1.6x, 28672x8192 4-bit weights 2-12 % with 64 rows a
// CTA (128 rows: 0-4 %), 8192x28672 ones 1-4 % with 128 rows (64 rows lose 20 %), and 8192x8192
// NVFP4 runs 2-26 % slower on either, so it keeps m16n8k16. Without the warpgroup tile, the
// m16n8k16 tiles take the row tiles per warp of launch_r.
constexpr int64_t kTileAuto = 0, kTileMma = 1, kTileWgmma64 = 2, kTileWgmma128 = 3,
                  kTileMma128 = 4;

template <int FMT, bool HALF>
void launch_mt(const DecodeArgs& a, int64_t tile, const LaunchOptions& o) {
  constexpr int U = FMT == kMxfp8 ? 2 : 4;
  if (a.M <= 8) return launch_r<FMT, 1, HALF, U>(a, o);
  if (a.M <= 16) return launch_r<FMT, 2, HALF, U>(a, o);
  if (a.M <= 32) return launch_r<FMT, 4, HALF, U / 2>(a, o);
  if (tile == kTileAuto && wgmma_runs(o.device)) {
    if (FMT == kMxfp8) tile = kTileWgmma64;
    else if (static_cast<int64_t>(a.N) * a.K >= (int64_t{1} << 27))
      tile = a.K >= a.N ? kTileWgmma128 : kTileWgmma64;
  }
  // A stage of the warpgroup tile is one super-tile: with its B tiles, four CTAs (one row tile
  // per warp) or three (two) fit on an SM.
  if (tile == kTileWgmma64) return launch<FMT, 8, HALF, 1, 1, true>(a, o);
  if (tile == kTileWgmma128) return launch<FMT, 8, HALF, 1, 2, true>(a, o);
  if (tile == kTileMma) return launch<FMT, 8, HALF, U / 2, 1>(a, o);
  // The forced tile of 128 rows keeps the 64-row tile's stages (U / 2 super-tiles, twice its
  // weight bytes a stage), where launch_r's two row tiles a warp (taken where the warpgroup tile
  // does not run) halve U again. Both were timed on large weights, this one on the H100
  // (RESULTS.md, "eighth decode session"), launch_r's as the m16n8k16 tile of the H200 sweep
  // cited above; both spill a few registers at their bound of 128 (NVFP4).
  if constexpr (FMT != kMxfp8) {
    if (tile == kTileMma128) return launch<FMT, 8, HALF, U / 2, 2>(a, o);
  }
  launch_r<FMT, 8, HALF, U / 2>(a, o);
}

// The block size and the tile counts of a packed weight [N, K] (NT row tiles of 16, KT
// super-tiles of 64 K), after checking fmt, N, K and the packed bytes: contiguous uint8 of the
// layout's sizes, the weight on a 16-byte boundary and the scales on a `scale_align`-byte one.
struct PackedDims {
  int64_t block, NT, KT, V;
};

PackedDims check_packed(const char* op, const at::Tensor& w, const at::Tensor& s, int64_t fmt,
                        int64_t n, int64_t k, int64_t scale_align) {
  TORCH_CHECK(fmt == kNvfp4 || fmt == kMxfp4 || fmt == kMxfp8, op,
              ": fmt is 0 (NVFP4), 1 (MXFP4) or 2 (MXFP8); got ", num(fmt), ".");
  const int64_t block = fmt == kNvfp4 ? 16 : 32;
  TORCH_CHECK(n > 0 && k > 0 && k % block == 0, op, ": needs N > 0 and K > 0 divisible by ",
              num(block), "; got N = ", num(n), ", K = ", num(k), ".");
  const int64_t NT = (n + 63) / 64 * 4, KT = (k + kSuperK - 1) / kSuperK;
  const int64_t V = fmt == kMxfp8 ? 2 : 1;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == NT * KT * V * 512, op,
              ": the packed weight must be contiguous uint8 of ", num(NT * KT * V * 512),
              " bytes (decode layout of ", num(n), "x", num(k), "); got ", w.scalar_type(), " ",
              shape_str(w), ". Pack it with qtensor.formats.decode_layout.pack.");
  TORCH_CHECK(s.scalar_type() == at::kByte && s.is_contiguous() && s.numel() == NT * KT * 64, op,
              ": the packed scales must be contiguous uint8 of ", num(NT * KT * 64), " bytes; got ",
              s.scalar_type(), " ", shape_str(s), ".");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(s.data_ptr()) % scale_align == 0,
              op, ": the packed weight must start on a 16-byte boundary and the scales on a ",
              num(scale_align), "-byte one (they are read in vectors); pass them as allocated, "
              "or .clone() a view.");
  return {block, NT, KT, V};
}

at::Tensor decode_gemm_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                            const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& bias,
                            int64_t fmt, int64_t n, int64_t k, double inv, int64_t splits,
                            at::ScalarType out_dtype, int64_t tile, bool pdl) {
  const char* op = "qtensor.decode_gemm";
  const PackedDims p = check_packed(op, w, s, fmt, n, k, 16);
  const int64_t NT = p.NT, KT = p.KT;
  const bool half = x.scalar_type() == at::kHalf;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || (half && fmt == kNvfp4), op,
              ": the activation must be bfloat16 (float16 with NVFP4 weights, whose values "
              "float16 holds exactly); got ", x.scalar_type(), ".");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) <= 64, op,
              ": takes an activation [M <= 64, K = ", num(k), "]; got ", shape_str(x),
              ". Larger M runs the dense kernels.");
  check_same_device(x, w, op, "the packed weight");
  check_same_device(x, s, op, "the packed scales");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, op,
              ": writes float32, bfloat16 or float16; got ", out_dtype, ".");
  if (amax) {
    TORCH_CHECK(fmt == kNvfp4 && amax->scalar_type() == at::kFloat &&
                    (amax->dim() == 0 || (amax->dim() == 1 && amax->size(0) == n)),
                op, ": amax is NVFP4's fp32 scalar or [N] vector; got ", shape_str(*amax), ".");
    check_same_device(x, *amax, op, "amax");
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": the bias must be [N = ", num(n),
                "]; got ", shape_str(*bias), ".");
    check_same_device(x, *bias, op, "the bias");
  }
  TORCH_CHECK(splits >= 0 && splits <= kMaxSplits, op, ": splits is 0 (chosen) to 8; got ",
              num(splits), ".");
  TORCH_CHECK(tile >= kTileAuto && tile <= kTileMma128, op,
              ": tile is 0 (chosen), 1 or 4 (m16n8k16, 64 or 128 rows a CTA), 2 or 3 (warpgroup, "
              "64 or 128 rows a CTA); got ", num(tile), ".");
  TORCH_CHECK(tile != kTileMma128 || fmt != kMxfp8, op,
              ": the m16n8k16 tile of 128 rows a CTA takes 4-bit weights (MXFP8's twice larger "
              "weight vectors leave it no gain); got an MXFP8 weight. Pass tile=0 or 1.");
  TORCH_CHECK(tile == kTileAuto || x.size(0) > 32, op,
              ": a tile is chosen for 33 to 64 activation rows (fewer take their own); got ",
              num(x.size(0)), " rows with tile = ", num(tile), ". Pass tile=0.");
  TORCH_CHECK((tile != kTileWgmma64 && tile != kTileWgmma128) || wgmma_runs(x.get_device()), op,
              ": the warpgroup tile runs on a compute capability 9.0 GPU running this build's "
              "sm_90a code; got tile = ", num(tile), " elsewhere. Pass tile=0 to let the kernel "
              "choose.");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(out_dtype));
  if (x.size(0) == 0) return out;
  // Rows must start on 16-byte boundaries and lie a row or more apart (the activation's tensor
  // map takes the row stride; whether the driver encodes one of 0, a row expanded, is not
  // documented): a row-major copy only when they do not.
  at::Tensor xc = x;
  if (x.stride(1) != 1 || x.stride(0) % 8 != 0 || x.stride(0) < x.size(1) ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0)
    xc = at::empty(x.sizes(), x.options()).copy_(x);
  at::Tensor am = amax ? amax->contiguous() : at::Tensor();
  at::Tensor bs = bias ? bias->contiguous() : at::Tensor();
  DecodeArgs a;
  a.x = static_cast<const uint16_t*>(xc.data_ptr());
  a.ldx = xc.stride(0);
  a.w = reinterpret_cast<const uint4*>(w.data_ptr());
  a.s = reinterpret_cast<const uint16_t*>(s.data_ptr());
  a.amax = amax ? am.data_ptr<float>() : nullptr;
  a.amax_stride = amax && am.dim() == 1 ? 1 : 0;
  a.bias = bias ? bs.data_ptr() : nullptr;
  a.bias_dtype = bias ? bs.scalar_type() : at::kFloat;
  a.out = out.data_ptr();
  a.out_dtype = out_dtype;
  a.M = static_cast<int>(x.size(0));
  a.N = static_cast<int>(n);
  a.K = static_cast<int>(k);
  a.NT = static_cast<int>(NT);
  a.KT = static_cast<int>(KT);
  a.ep_scale = fmt == kNvfp4 ? (half ? 0x1p7f : 0x1p8f) : 1.f;
  a.inv = static_cast<float>(inv);
  a.has_inv = fmt == kNvfp4;
  // Where the overlap pays: up to 16 rows, and up to 32 except for 4-bit weights of 2**24
  // elements or fewer. Up to 8 rows every format gained 1-14 % on the H200; with the stages by
  // tensor copies, on the H100, MXFP4 weights gained 3-16 % at 16 rows and MXFP8 up to 11 %,
  // and at 17-32 rows every format up to 15 % (6144x4096 4-bit weights 12-14 %) but 4096x4096
  // 4-bit weights, which lost 3-4 %. At 64 rows 8192x8192 4-bit weights ran 13-18 % slower
  // with it (benchmarks/RESULTS.md): those launches wait for the previous kernel.
  const int64_t m = x.size(0);
  const bool overlap =
      pdl && (m <= 16 || (m <= 32 && (fmt == kMxfp8 || n * k > (int64_t{1} << 24))));
  const LaunchOptions o{static_cast<int>(std::min<int64_t>(splits, KT)), x.get_device(),
                        c10::cuda::getCurrentCUDAStream().stream(), overlap};
  if (fmt == kNvfp4) {
    if (half) launch_mt<kNvfp4, true>(a, tile, o);
    else launch_mt<kNvfp4, false>(a, tile, o);
  } else if (fmt == kMxfp4) {
    launch_mt<kMxfp4, false>(a, tile, o);
  } else {
    launch_mt<kMxfp8, false>(a, tile, o);
  }
  return out;
}

// ---- unpack: the decode layout back to the canonical bytes ----------------------------------

// One thread per lane of a super-tile: the lane's code bytes become the canonical bytes of its
// rows g and g + 8 at K offsets [16t, 16t + 16), and its scale pair the two rows' block scales.
// The codes go through the GEMM's own register decode (e2m1_regs, e4m3_regs), read backwards:
// a bf16 half holds an E2M1 code's sign at bit 15 and its other bits at 8-6, an E4M3 code's sign
// at bit 15 and its other bits at 10-4. The inverse of qtensor/formats/decode_layout.pack;
// qtensor/formats/decode_layout.unpack is the reference (tests/test_decode_gemm.py).
__device__ __forceinline__ uint32_t e2m1_code(uint32_t reg, int h) {
  return ((reg >> (6 + 16 * h)) & 7u) | ((reg >> (12 + 16 * h)) & 8u);
}
__device__ __forceinline__ uint32_t e4m3_code(uint32_t reg, int h) {
  return ((reg >> (4 + 16 * h)) & 0x7Fu) | ((reg >> (8 + 16 * h)) & 0x80u);
}

template <int FMT>
__global__ void decode_unpack_kernel(const uint4* __restrict__ w, const uint16_t* __restrict__ s,
                                     uint8_t* __restrict__ data, uint8_t* __restrict__ scale,
                                     int n, int k, int KT, int64_t lanes) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= lanes) return;
  const int lane = static_cast<int>(i & 31), g = lane >> 2, t = lane & 3;
  const int64_t tile = i >> 5;
  const int nt = static_cast<int>(tile / KT), kt = static_cast<int>(tile % KT);
  const int k0 = kt * kSuperK + 16 * t;  // K is whole blocks: a lane's range is in or out
  if (k0 >= k) return;
  constexpr int kBlock = FMT == kNvfp4 ? 16 : 32;
  const int blocks = k / kBlock;
  const uint32_t sc = s[i];
  if constexpr (FMT == kMxfp8) {
    // Word 2jl + p of vector jH holds registers r (row g + 8r) of elements 8jH + 4jl + 2p + h.
    const uint4 v0 = w[(tile * 2) * 32 + lane], v1 = w[(tile * 2 + 1) * 32 + lane];
    const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    uint32_t out[2][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // q = 2jH + jl: output word q of each row, elements 4q..4q+3
      uint32_t a0[2], a1[2];
      e4m3_regs(words[2 * q], a0);
      e4m3_regs(words[2 * q + 1], a1);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        out[r][q] = e4m3_code(a0[r], 0) | (e4m3_code(a0[r], 1) << 8) |
                    (e4m3_code(a1[r], 0) << 16) | (e4m3_code(a1[r], 1) << 24);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = nt * kTileRows + 8 * r + g;
      if (row < n)
        *reinterpret_cast<uint4*>(data + static_cast<int64_t>(row) * k + k0) =
            make_uint4(out[r][0], out[r][1], out[r][2], out[r][3]);
    }
  } else {
    // Word s holds registers 2p + r (row g + 8r) of elements 4s + 2p + h: canonical byte 2s + p
    // of the row, element h in its high nibble when h = 1.
    const uint4 v = w[tile * 32 + lane];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    uint32_t out[2][2] = {{0u, 0u}, {0u, 0u}};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t a[4];
      e2m1_regs<false>(words[q], a);
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint32_t byte = e2m1_code(a[2 * p + r], 0) | (e2m1_code(a[2 * p + r], 1) << 4);
          out[r][q >> 1] |= byte << (8 * (2 * (q & 1) + p));
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = nt * kTileRows + 8 * r + g;
      if (row < n)
        *reinterpret_cast<uint2*>(data + static_cast<int64_t>(row) * (k / 2) + k0 / 2) =
            make_uint2(out[r][0], out[r][1]);
    }
  }
  // The scale pair: NVFP4 blocks are a lane's range; an MX block spans two lanes, both holding
  // its scale, and the even one writes it.
  if (FMT == kNvfp4 || (t & 1) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = nt * kTileRows + 8 * r + g;
      if (row < n)
        scale[static_cast<int64_t>(row) * blocks + k0 / kBlock] = (sc >> (8 * r)) & 0xFFu;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> decode_unpack_cuda(const at::Tensor& w, const at::Tensor& s,
                                                     int64_t fmt, int64_t n, int64_t k) {
  const char* op = "qtensor.decode_unpack";
  const PackedDims p = check_packed(op, w, s, fmt, n, k, 2);
  const int64_t block = p.block, NT = p.NT, KT = p.KT;
  check_same_device(w, s, op, "the packed scales");
  const c10::cuda::CUDAGuard guard(w.device());
  at::Tensor data = at::empty({n, fmt == kMxfp8 ? k : k / 2}, w.options());
  at::Tensor scale = at::empty({n, k / block}, w.options());
  const int64_t lanes = NT * KT * 32;
  constexpr int kBlockThreads = 256;
  const auto grid = static_cast<unsigned>((lanes + kBlockThreads - 1) / kBlockThreads);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto* wp = reinterpret_cast<const uint4*>(w.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr());
  auto* dp = data.data_ptr<uint8_t>();
  auto* scp = scale.data_ptr<uint8_t>();
  const int ni = static_cast<int>(n), ki = static_cast<int>(k), kti = static_cast<int>(KT);
  auto kernel = fmt == kNvfp4   ? decode_unpack_kernel<kNvfp4>
                : fmt == kMxfp4 ? decode_unpack_kernel<kMxfp4>
                                : decode_unpack_kernel<kMxfp8>;
  kernel<<<grid, kBlockThreads, 0, stream>>>(wp, sp, dp, scp, ni, ki, kti, lanes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {data, scale};
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CUDA, m) {
  m.impl("decode_gemm", &decode_gemm_cuda);
  m.impl("decode_unpack", &decode_unpack_cuda);
}

}  // namespace qtensor
