// Rowwise quantizers and the amax pass at memory speed. A rowwise block (16 elements NVFP4, 32
// MXFP8) is contiguous in the input, so no shared-memory tile is needed (NVFP4's 16x16 2D tiles
// neither: the 4 lanes of a tile join their amaxes by shuffles): each thread reads its own
// 16 elements with 16-byte read-only loads, kSlots blocks per thread issued before any math so
// 64 B per thread are in flight, and writes its codes with one vector store (a warp's stores
// cover 256 contiguous bytes of NVFP4 codes, 512 of MXFP8). The math is quant_math.h's, plus
// quant_rows_math.h's cheaper equivalents on the domains where they are proven equal; built with
// --fmad=false like quant_cuda.cu, whose tile kernel keeps every other mode.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>

#include "checks.h"
#include "cuda_vec.cuh"
#include "quant_math.h"
#include "quant_rows.h"
#include "quant_rows_math.h"

namespace qtensor {
namespace {

constexpr int kThreads = 256;
constexpr int kSlots = 2;  // 16-element blocks per thread: 2 x 32 B of bf16 in flight

// The 16-element blocks first, first + kThreads, ...: in each slot a warp reads 32 consecutive
// blocks (1 KB of bf16), one 32-byte sector per thread, both halves of it from L1 after one miss.
template <typename T>
struct Slots {
  static constexpr int kC = 16 / Vec<T>::kN;  // 16-byte loads per block
  uint4 raw[kSlots][kC];
  __device__ void load(const T* x, int64_t first, int64_t n) {
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      const int64_t b = first + u * kThreads;
#pragma unroll
      for (int c = 0; c < kC; ++c)
        raw[u][c] = b < n ? __ldg(reinterpret_cast<const uint4*>(x + b * 16 + c * Vec<T>::kN))
                          : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  __device__ void unpack(int u, float* v) const {
#pragma unroll
    for (int c = 0; c < kC; ++c) Vec<T>::unpack(raw[u][c], v + c * Vec<T>::kN);
  }
  // bf16: block u's packed words (for the sign nibbles); else nullptr.
  __device__ const uint32_t* words16(int u) const {
    if constexpr (std::is_same_v<T, at::BFloat16>) return reinterpret_cast<const uint32_t*>(raw[u]);
    return nullptr;
  }
  // max |element| bits of block u, absmax16 of the unpacked values, on the packed words.
  __device__ uint32_t absmax(int u) const {
    uint32_t m = 0u;
#pragma unroll
    for (int c = 0; c < kC; ++c) m = absmax_word<T>(m, raw[u][c]);
    return absmax_bits<T>(m);
  }
};

// ---- NVFP4 ---------------------------------------------------------------------------------------

// FO6: 0 plain, 1 4over6 MAE, 2 4over6 MSE (row-scaled; under one tensor scale 4over6 runs in
// nv_rows_fo6_kernel). nblocks = M K / 16 blocks, bpr = K / 16 per row.
template <typename T, bool ROW_SCALED, int FO6>
__global__ void __launch_bounds__(kThreads) nv_rows_kernel(const T* x, int64_t nblocks, int64_t bpr,
                                                           bool idx32, const float* amax, int bound,
                                                           uint2* q, uint8_t* s) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (kThreads * kSlots) + threadIdx.x;
  Slots<T> in;
  in.load(x, first, nblocks);
  const float six_b = static_cast<float>(6 * bound);
  NvScale ts{};
  if constexpr (!ROW_SCALED) ts = nv_scale(amax[0], bound);
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {
    const int64_t b = first + u * kThreads;
    if (b >= nblocks) break;
    if constexpr (ROW_SCALED) {
      const int64_t row = idx32 ? static_cast<int64_t>(static_cast<uint32_t>(b) / static_cast<uint32_t>(bpr))
                                : b / bpr;
      ts = nv_scale(amax[row], bound);
    }
    float v[16];
    in.unpack(u, v);
    const float bam = u2f(in.absmax(u));
    uint8_t sb;
    Codes codes;
    if constexpr (FO6 == 0) {
      sb = e4m3_scale_bits(bam * ts.s_enc_c6);
      codes = nv_codes(v, bam, nv_block_enc(sb, ts.s_dec));
    } else {
      sb = fo6_block<FO6 == 2>(v, bam, ts, six_b, &codes);
    }
    q[b] = make_uint2(codes.x, codes.y);
    s[b] = sb;
  }
}

// A 4over6 CTA's tables under one tensor scale, built before its first block: fo6_byte of the
// 256 scale bytes (one a thread, three divisions each), and this thread's column of each
// candidate's value table in shared memory (a warp's lanes in distinct banks), entry 0 set here.
struct Fo6Tables {
  const Fo6Byte* bytes;
  float *col6, *col4;
};

__device__ __forceinline__ Fo6Tables fo6_tables(Fo6Byte* bytes, float (&cols)[2][8][kThreads], const NvScale& ts,
                                                float six_b) {
  static_assert(kThreads == 256, "one scale byte a thread");
  bytes[threadIdx.x] = fo6_byte(static_cast<uint8_t>(threadIdx.x), ts, six_b);
  __syncthreads();
  const Fo6Tables t{bytes, &cols[0][0][threadIdx.x], &cols[1][0][threadIdx.x]};
  fo6_zero(t.col6);
  fo6_zero(t.col4);
  return t;
}

// 4over6 under one tensor scale: a grid-stride loop over chunks of kThreads * kSlots blocks, so
// the CTA's table of the 256 scale bytes (fo6_byte: block factor and candidate values, three
// divisions each) is built once for many chunks. Each thread keeps a value table per candidate in
// its own shared-memory column (fo6_block_tab).
template <typename T, bool MSE>
__global__ void __launch_bounds__(kThreads) nv_rows_fo6_kernel(const T* x, int64_t nblocks, const float* amax,
                                                               int bound, uint2* q, uint8_t* s) {
  __shared__ Fo6Byte bytes[256];
  __shared__ float cols[2][8][kThreads];
  const float six_b = static_cast<float>(6 * bound);
  const NvScale ts = nv_scale(amax[0], bound);
  const Fo6Tables tab = fo6_tables(bytes, cols, ts, six_b);
  constexpr int64_t kChunk = kThreads * kSlots;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kChunk;
  // The next chunk's words are read before this one is evaluated, so a thread's loads overlap its
  // own long evaluation (out-of-range slots load zeros and are never evaluated).
  Slots<T> ahead;
  ahead.load(x, static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x, nblocks);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x; first < nblocks; first += stride) {
    const Slots<T> in = ahead;
    ahead.load(x, first + stride, nblocks);
    // The blocks in fo6_common's case with distinct candidates first, every other one after them
    // (fo6_common says why).
    uint32_t rare = 0u;
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      const int64_t b = first + u * kThreads;
      if (b >= nblocks) break;
      const Fo6Cand c = fo6_prepare<kThreads>(u2f(in.absmax(u)), ts, tab.bytes, tab.col6, tab.col4);
      if (fo6_common(c) && c.s6 != c.s4) {
        float v[16];
        in.unpack(u, v);
        Codes codes;
        s[b] = fo6_choose(c, fo6_pair_tab<MSE, true, kThreads>(c, v, tab.col6, tab.col4, in.words16(u)), &codes);
        q[b] = make_uint2(codes.x, codes.y);
      } else {
        rare |= 1u << u;
      }
    }
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      if (!((rare >> u) & 1u)) continue;
      const int64_t b = first + u * kThreads;
      float v[16];
      in.unpack(u, v);
      Codes codes;
      s[b] = fo6_block_tab<MSE, kThreads>(v, u2f(in.absmax(u)), ts, six_b, tab.bytes, tab.col6, tab.col4, &codes,
                                           in.words16(u));
      q[b] = make_uint2(codes.x, codes.y);
    }
  }
}

// Rowwise codes under one scale per 16x16 tile (2D), without a shared-memory stage: warp g takes
// the panel of 16 rows x 128 columns at rows 16 (g / panels_k).., columns 128 (g % panels_k)..;
// lane l the 4 rows 4 (l % 4).. of the tile at columns 16 (l / 4)... Each lane reads its 4 rows
// of 16 elements (4 x 32 bytes of bf16 in flight) before any math and joins the tile's amax with
// the tile's 3 other lanes by two shuffles; a warp's stores then cover 64 contiguous code bytes
// and 8 scale bytes of each of 4 rows. M % 16 == 0 (nv_shape) and K % 16 == 0 make every tile
// whole; the lanes of a panel past K read zeros and store nothing. Panel indices are 32-bit
// (nvfp4_rows_2d_cuda bounds the count): a 64-bit division per panel would cost a lane about 2
// instructions an element.
template <typename T>
struct Panel2d {
  static constexpr int kC = 16 / Vec<T>::kN;  // 16-byte loads a row of the tile
  uint4 raw[4][kC];
  int64_t r0, col;
  bool in;
  __device__ Panel2d(const T* x, int64_t K, uint32_t panels_k, uint32_t g) {
    const int l = threadIdx.x & 31;
    const uint32_t pr = g / panels_k;
    r0 = static_cast<int64_t>(pr) * 16 + 4 * (l & 3);
    col = static_cast<int64_t>(g - pr * panels_k) * 128 + 16 * (l >> 2);
    in = col < K;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T* p = x + ((r0 + i) * K + col);
#pragma unroll
      for (int c = 0; c < kC; ++c)
        raw[i][c] = in ? __ldg(reinterpret_cast<const uint4*>(p + c * Vec<T>::kN)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  // The tile's max |element| (NaN above inf), on every lane of the tile.
  __device__ float tile_absmax() const {
    uint32_t m = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < kC; ++c) m = absmax_word<T>(m, raw[i][c]);
    }
    uint32_t bits = absmax_bits<T>(m);
    bits = max(bits, __shfl_xor_sync(kFull, bits, 1));
    return u2f(max(bits, __shfl_xor_sync(kFull, bits, 2)));
  }
  // 16-bit inputs: row i's packed words (for the sign nibbles); else nullptr.
  __device__ const uint32_t* words16(int i) const {
    if constexpr (sizeof(T) == 2) return reinterpret_cast<const uint32_t*>(raw[i]);
    return nullptr;
  }
  __device__ void unpack(int i, float* v) const {
#pragma unroll
    for (int c = 0; c < kC; ++c) Vec<T>::unpack(raw[i][c], v + c * Vec<T>::kN);
  }
  // Row i's codes and the tile's scale byte, at block (r0 + i, col / 16) of q and s.
  __device__ void store(int i, int64_t K, Codes codes, uint8_t sb, uint2* q, uint8_t* s) const {
    const int64_t b = (r0 + i) * (K / 16) + col / 16;
    q[b] = make_uint2(codes.x, codes.y);
    s[b] = sb;
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) nv_rows_2d_kernel(const T* x, int64_t K, uint32_t panels,
                                                              uint32_t panels_k, const float* amax, int bound,
                                                              uint2* q, uint8_t* s) {
  const uint32_t g = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  if (g >= panels) return;  // whole warps: every lane of a panel takes part in the shuffles
  const Panel2d<T> in(x, K, panels_k, g);
  const float bam = in.tile_absmax();
  if (!in.in) return;
  const NvScale ts = nv_scale(amax[0], bound);
  const uint8_t sb = e4m3_scale_bits(bam * ts.s_enc_c6);
  const float enc = nv_block_enc(sb, ts.s_dec);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[16];
    in.unpack(i, v);
    in.store(i, K, nv_codes(v, bam, enc), sb, q, s);
  }
}

// 4over6 over 16x16 tiles: the panels of nv_rows_2d_kernel in a grid-stride loop, so the CTA's
// table of the 256 scale bytes (fo6_byte) is built once for many panels, as in nv_rows_fo6_kernel.
// Both candidates of the tile are evaluated on each of the lane's 4 rows; the tile's error is the
// reference's tree over its 16 row errors (row r = 4 (l % 4) + i): r + 8 is lane l + 2, r + 4
// lane l + 1, r + 2 and r + 1 this lane's i + 2 and i + 1. Map-to-4 wins where its error is
// strictly lower (equal candidates give equal errors: map-to-6).
template <typename T, bool MSE>
__global__ void __launch_bounds__(kThreads) nv_rows_2d_fo6_kernel(const T* x, int64_t K, uint32_t panels,
                                                                  uint32_t panels_k, const float* amax, int bound,
                                                                  uint2* q, uint8_t* s) {
  __shared__ Fo6Byte bytes[256];
  __shared__ float cols[2][8][kThreads];
  const float six_b = static_cast<float>(6 * bound);
  const NvScale ts = nv_scale(amax[0], bound);
  const Fo6Tables tab = fo6_tables(bytes, cols, ts, six_b);
  // One panel: both candidates on each of the lane's 4 rows, the tile's tree, the choice, the stores.
  auto evaluate = [&](const Panel2d<T>& in) {
    const Fo6Cand t = fo6_prepare<kThreads>(in.tile_absmax(), ts, tab.bytes, tab.col6, tab.col4);
    float e6[4], e4[4];
    Codes c6[4], c4[4];
    auto take = [&](int i, const Fo6Pair& r) {
      e6[i] = r.e6;
      e4[i] = r.e4;
      c6[i] = r.c6;
      c4[i] = r.c4;
    };
    if (fo6_common(t)) {  // the four rows' common path together, the other cases apart
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v[16];
        in.unpack(i, v);
        take(i, fo6_pair_tab<MSE, true, kThreads>(t, v, tab.col6, tab.col4, in.words16(i)));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v[16];
        in.unpack(i, v);
        take(i, fo6_pair<MSE, kThreads>(t, v, ts, six_b, tab.col6, tab.col4, in.words16(i)));
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // + 8: rows of lanes q = 0, 1 take those of q + 2
      e6[i] = e6[i] + __shfl_down_sync(kFull, e6[i], 2, 4);
      e4[i] = e4[i] + __shfl_down_sync(kFull, e4[i], 2, 4);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // + 4: lane q = 0 takes q = 1's
      e6[i] = e6[i] + __shfl_down_sync(kFull, e6[i], 1, 4);
      e4[i] = e4[i] + __shfl_down_sync(kFull, e4[i], 1, 4);
    }
    const float t6 = (e6[0] + e6[2]) + (e6[1] + e6[3]), t4 = (e4[0] + e4[2]) + (e4[1] + e4[3]);  // + 2, + 1
    const bool map4 = __shfl_sync(kFull, t4, 0, 4) < __shfl_sync(kFull, t6, 0, 4);
    if (in.in) {
#pragma unroll
      for (int i = 0; i < 4; ++i) in.store(i, K, map4 ? c4[i] : c6[i], map4 ? t.s4 : t.s6, q, s);
    }
  };
  const uint32_t warps = gridDim.x * (kThreads / 32);  // panels + warps < 2**32
  uint32_t g = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  if constexpr (sizeof(T) == 2) {
    // The next panel's words are read before this one is evaluated, so a warp's loads overlap its
    // own long evaluation (2 CTAs an SM leave too few warps to hide them otherwise). Not for
    // fp32: its panels take twice the registers, and two of them would leave 1 CTA an SM.
    if (g >= panels) return;  // whole warps (no barrier follows)
    Panel2d<T> ahead(x, K, panels_k, g);
    for (; g < panels; g += warps) {
      const Panel2d<T> in = ahead;
      if (g + warps < panels) ahead = Panel2d<T>(x, K, panels_k, g + warps);
      evaluate(in);
    }
  } else {
    for (; g < panels; g += warps) evaluate(Panel2d<T>(x, K, panels_k, g));
  }
}

// ---- MXFP8 ---------------------------------------------------------------------------------------

// Threads 2j and 2j+1 hold the two halves of 32-block j (one shuffle joins their amaxes), so each
// thread stores 16 contiguous code bytes. A finite block amax gives a finite multiplier and no NaN
// product; a NaN or inf amax gives code 255, whose NaN multiplier makes every byte 0x7F.
template <typename T>
__global__ void __launch_bounds__(kThreads) mx_rows_kernel(const T* x, int64_t nhalves, int rule,
                                                           uint4* q, uint8_t* s) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (kThreads * kSlots) + threadIdx.x;
  Slots<T> in;
  in.load(x, first, nhalves);
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {  // no early exit: every lane takes part in the shuffle
    const int64_t h = first + u * kThreads;
    float v[16];
    in.unpack(u, v);
    uint32_t am = in.absmax(u);
    am = max(am, __shfl_xor_sync(kFull, am, 1));
    const uint32_t code = mx_scale_code(u2f(am), rule);
    const uint4 bytes = mx_e4m3x16(v, code);
    if (h < nhalves) {
      q[h] = bytes;
      if ((h & 1) == 0) s[h >> 1] = static_cast<uint8_t>(code);
    }
  }
}

// ---- amax ----------------------------------------------------------------------------------------

// [Note: the amax walks back]
// A dynamic cast reads its input twice: the amax, then the cast under it. What the amax leaves in
// L2 decides how much of the second read comes from DRAM again (dev/experiments/l2_reuse.cu, on an
// H100 with 52 MB of L2):
// - streaming loads (evict-first, __ldcs) leave nothing, even of a 16 MB input;
// - loads at L2's normal priority leave an input that fits (16 and 32 MB measured) for the cast,
//   whatever the order of the two walks: at 32 MB its read took 0.73-0.75 of its time from DRAM;
// - of a larger input (48-268 MB measured), an amax that walks from the start leaves nothing the
//   cast finds (the cast's first reads are the amax's first, the first evicted), and one that walks
//   from the end leaves about 10-13 MB of the input's start for the cast's first reads.
// So the amax kernels (here, in convert_cuda.cu, and the amax after RHT in quant_cuda.cu's tile
// kernel) load at normal priority and walk the input from its end to its start, and every cast
// walks from the start. The amax is a maximum: the same in any order.

constexpr int kAmaxLoads = 4;  // 16-byte loads in flight per thread and iteration

// One amax of n 16-byte words: a grid-stride loop from the last word (the amax walks back), one
// atomicMax per CTA (cta_max).
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_all_kernel(const uint4* x, int64_t n, unsigned* out) {
  __shared__ uint32_t warp_max[kThreads / 32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const uint4* last = x + (n - 1);
  uint32_t m = 0u;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride * kAmaxLoads) {
    uint4 r[kAmaxLoads];
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u)
      r[u] = i + u * stride < n ? __ldg(last - (i + u * stride)) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) m = absmax_word<T>(m, r[u]);
  }
  const uint32_t cta = cta_max<kThreads / 32>(absmax_bits<T>(m), warp_max);
  if (threadIdx.x == 0 && cta != 0u) atomicMax(out, cta);
}

// One amax per row of `words` 16-byte words: 2**lanes_log2 lanes (<= 32, aligned in the warp)
// share a row, reduce by shuffles and store it; no atomics, each row has one owner. The first
// threads take the last rows (the amax walks back).
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_row_kernel(const uint4* x, int64_t M, int64_t words,
                                                            int lanes_log2, unsigned* out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = M - 1 - (t >> lanes_log2);
  const int lanes = 1 << lanes_log2, li = static_cast<int>(t & (lanes - 1));
  uint32_t m = 0u;
  if (row >= 0) {  // the threads past the first row's
    const uint4* p = x + row * words;
    for (int64_t c = li; c < words; c += static_cast<int64_t>(lanes) * kAmaxLoads) {
      uint4 r[kAmaxLoads];
#pragma unroll
      for (int u = 0; u < kAmaxLoads; ++u)
        r[u] = c + u * lanes < words ? __ldg(p + c + u * lanes) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int u = 0; u < kAmaxLoads; ++u) m = absmax_word<T>(m, r[u]);
    }
  }
  uint32_t bits = absmax_bits<T>(m);
  for (int o = lanes >> 1; o >= 1; o >>= 1) bits = max(bits, __shfl_xor_sync(kFull, bits, o));
  if (li == 0 && row >= 0) out[row] = bits;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int sm_count() {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// The persistent grid of a 4over6 kernel: at most the CTAs of `Kernel` resident at once (read once
// per device and kernel: kernels of one signature differ in registers), so each builds its byte
// table once and walks its chunks.
template <auto* Kernel>
int64_t resident_grid(int64_t chunks) {
  static std::array<int, 64> resident{};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  TORCH_CHECK(dev < static_cast<int>(resident.size()), "qtensor: device index ", num(dev), " is out of range.");
  if (resident[dev] == 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
    resident[dev] = std::max(per_sm, 1) * sm_count();
  }
  return std::min<int64_t>(chunks, resident[dev]);
}

template <typename T, bool ROW_SCALED>
void launch_nv(const at::Tensor& x2, const float* amax, int64_t fourover6, int bound, uint2* q, uint8_t* s) {
  const int64_t nblocks = x2.numel() / 16, bpr = x2.size(1) / 16;
  const bool idx32 = nblocks <= static_cast<int64_t>(UINT32_MAX);
  const int64_t grid = ceil_div(nblocks, kThreads * kSlots);
  const T* x = x2.const_data_ptr<T>();
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (fourover6 == 0) {
    nv_rows_kernel<T, ROW_SCALED, 0><<<grid, kThreads, 0, stream>>>(x, nblocks, bpr, idx32, amax, bound, q, s);
  } else if constexpr (ROW_SCALED) {
    if (fourover6 == 2)
      nv_rows_kernel<T, true, 2><<<grid, kThreads, 0, stream>>>(x, nblocks, bpr, idx32, amax, bound, q, s);
    else
      nv_rows_kernel<T, true, 1><<<grid, kThreads, 0, stream>>>(x, nblocks, bpr, idx32, amax, bound, q, s);
  } else if (fourover6 == 2) {
    constexpr auto kernel = nv_rows_fo6_kernel<T, true>;
    kernel<<<resident_grid<kernel>(grid), kThreads, 0, stream>>>(x, nblocks, amax, bound, q, s);
  } else {
    constexpr auto kernel = nv_rows_fo6_kernel<T, false>;
    kernel<<<resident_grid<kernel>(grid), kThreads, 0, stream>>>(x, nblocks, amax, bound, q, s);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void nvfp4_rows_cuda(const at::Tensor& x2, const at::Tensor& amax, int64_t fourover6, int64_t bound,
                     at::Tensor& q, at::Tensor& s) {
  const float* a = amax.const_data_ptr<float>();
  auto* qp = reinterpret_cast<uint2*>(q.data_ptr<uint8_t>());
  uint8_t* sp = s.data_ptr<uint8_t>();
  dispatch_float(x2.scalar_type(), "qtensor.nvfp4_quantize", [&](auto tag) {
    using T = decltype(tag);
    if (amax.dim() == 1) launch_nv<T, true>(x2, a, fourover6, static_cast<int>(bound), qp, sp);
    else launch_nv<T, false>(x2, a, fourover6, static_cast<int>(bound), qp, sp);
  });
}

void nvfp4_rows_2d_cuda(const at::Tensor& x2, const at::Tensor& amax, int64_t fourover6, int64_t bound,
                        at::Tensor& q, at::Tensor& s) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const int64_t panels_k = ceil_div(K, 128), panels = (M / 16) * panels_k, grid = ceil_div(panels, kThreads / 32);
  TORCH_CHECK(panels < (int64_t{1} << 31), "qtensor.nvfp4_quantize: the CUDA 2D rowwise kernels take fewer than "
              "2**31 panels of 16x128 elements; got an input of ", num(M), "x", num(K), ". Quantize it in row chunks.");
  const uint32_t np = static_cast<uint32_t>(panels), npk = static_cast<uint32_t>(panels_k);
  const float* a = amax.const_data_ptr<float>();
  auto* qp = reinterpret_cast<uint2*>(q.data_ptr<uint8_t>());
  uint8_t* sp = s.data_ptr<uint8_t>();
  const int b = static_cast<int>(bound);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x2.scalar_type(), "qtensor.nvfp4_quantize", [&](auto tag) {
    using T = decltype(tag);
    const T* x = x2.const_data_ptr<T>();
    if (fourover6 == 0) {
      nv_rows_2d_kernel<T><<<grid, kThreads, 0, stream>>>(x, K, np, npk, a, b, qp, sp);
    } else if (fourover6 == 2) {
      constexpr auto kernel = nv_rows_2d_fo6_kernel<T, true>;
      kernel<<<resident_grid<kernel>(grid), kThreads, 0, stream>>>(x, K, np, npk, a, b, qp, sp);
    } else {
      constexpr auto kernel = nv_rows_2d_fo6_kernel<T, false>;
      kernel<<<resident_grid<kernel>(grid), kThreads, 0, stream>>>(x, K, np, npk, a, b, qp, sp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void mxfp8_rows_cuda(const at::Tensor& x2, int64_t rule, at::Tensor& q, at::Tensor& s) {
  const int64_t nhalves = x2.numel() / 16;
  dispatch_float(x2.scalar_type(), "qtensor.mxfp8_quantize", [&](auto tag) {
    using T = decltype(tag);
    mx_rows_kernel<T><<<ceil_div(nhalves, kThreads * kSlots), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x2.const_data_ptr<T>(), nhalves, static_cast<int>(rule), reinterpret_cast<uint4*>(q.data_ptr<uint8_t>()),
        s.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void amax_rows_cuda(const at::Tensor& x2, bool per_row, at::Tensor& out) {
  auto* o = reinterpret_cast<unsigned*>(out.data_ptr<float>());
  const auto* x = reinterpret_cast<const uint4*>(x2.const_data_ptr());
  const int64_t words = x2.numel() * x2.element_size() / 16;  // rows are whole words: K % 16 == 0
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x2.scalar_type(), "qtensor.amax", [&](auto tag) {
    using T = decltype(tag);
    if (!per_row) {
      // 8 CTAs of 256 per SM fill it; more would only add atomics.
      const int64_t grid = std::min<int64_t>(ceil_div(words, kThreads * kAmaxLoads), 8 * sm_count());
      amax_all_kernel<T><<<grid, kThreads, 0, stream>>>(x, words, o);
    } else {
      const int64_t M = x2.size(0), row_words = words / M;
      int lanes_log2 = 0;  // the fewest lanes (up to a warp) that cover a row in one load each
      while (lanes_log2 < 5 && (int64_t{1} << lanes_log2) < row_words) ++lanes_log2;
      amax_row_kernel<T><<<ceil_div(M << lanes_log2, kThreads), kThreads, 0, stream>>>(x, M, row_words, lanes_log2, o);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace qtensor
