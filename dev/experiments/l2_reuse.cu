// What a read of an input leaves in L2 for a second read right after it: the question behind the
// dynamic casts' two passes (the amax, then the cast under it; [Note: the amax walks back] in
// csrc/quant_rows_cuda.cu). Standalone: nvcc -O3 -arch=sm_90a dev/experiments/l2_reuse.cu -o l2 && ./l2
//
// The first kernel reads a buffer of S MB in a persistent grid-stride walk like amax_all_kernel's
// (forward, or from the end), with its loads under one of these L2 policies: the default; the
// default with the last `keep` MB of its walk under evict_last; everything evict_first (`__ldcs`,
// what the amax kernels used before). The second reads the same buffer forward, either in the
// amax's grid-stride walk ("stride") or in the rows kernels' chunks, one CTA a chunk in launch
// order ("chunks"), and writes a quarter of its bytes (the cast's outputs). Its time is set
// against its time after a read of another buffer (nothing of this one in L2): the time it saves,
// at its own rate over its DRAM bytes (the read and a quarter written), is about the bytes it
// found in L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e = (x);                                                                  \
    if (e != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kThreads = 256, kLoads = 4;

enum Policy { kDefault = 0, kKeepLast = 1, kStreaming = 2 };

__device__ __forceinline__ uint4 load(const uint4* p, int policy, bool keep) {
  uint4 r;
  if (policy == kStreaming) return __ldcs(p);
  if (policy == kKeepLast && keep) {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
    return r;
  }
  return __ldg(p);
}

// The first read: words i, i + stride, ... of the walk; word n - 1 - i when `back`. The last
// `keep` words of the walk (in its order) load under evict_last with kKeepLast.
__global__ void __launch_bounds__(kThreads) first_read(const uint4* x, int64_t n, bool back, int policy,
                                                       int64_t keep, unsigned* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  unsigned acc = 0u;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride * kLoads) {
    uint4 r[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t j = i + u * stride;
      r[u] = j < n ? load(x + (back ? n - 1 - j : j), policy, j >= n - keep) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

// The second read, forward: a grid-stride walk (persistent grid) or one chunk of kThreads *
// kLoads words a CTA; it writes one word for every 4 it reads.
__global__ void __launch_bounds__(kThreads) second_read(const uint4* x, int64_t n, bool chunks, uint4* out) {
  const int64_t stride = chunks ? kThreads : static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = chunks ? static_cast<int64_t>(blockIdx.x) * kThreads * kLoads + threadIdx.x
                               : static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t step = chunks ? n : stride * kLoads;  // one pass over the chunk, or the walk
  for (int64_t i = first; i < n; i += step) {
    uint4 r[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t j = i + u * stride;
      r[u] = j < n ? __ldg(x + j) : make_uint4(0u, 0u, 0u, 0u);
    }
    uint4 o = r[0];
#pragma unroll
    for (int u = 1; u < kLoads; ++u) o = make_uint4(o.x ^ r[u].x, o.y ^ r[u].y, o.z ^ r[u].z, o.w ^ r[u].w);
    if (i < n) out[i / kLoads] = o;
  }
}

int main() {
  int dev = 0, sms = 0, l2 = 0, persist_max = 0;
  size_t persist_now = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  CHECK(cudaDeviceGetAttribute(&persist_max, cudaDevAttrMaxPersistingL2CacheSize, dev));
  CHECK(cudaDeviceGetLimit(&persist_now, cudaLimitPersistingL2CacheSize));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# %s: %d SMs, L2 %.1f MB, persisting L2 limit %.1f MB (max %.1f MB)\n", prop.name, sms, l2 / 1e6,
              persist_now / 1e6, persist_max / 1e6);
  const int64_t max_bytes = int64_t{268} << 20;
  uint4 *a, *flush, *out;
  unsigned* sink;
  CHECK(cudaMalloc(&a, max_bytes));
  CHECK(cudaMalloc(&flush, max_bytes));
  CHECK(cudaMalloc(&out, max_bytes / 4 + 64));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(a, 1, max_bytes));
  CHECK(cudaMemset(flush, 2, max_bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int grid = 8 * sms;
  struct First {
    const char* name;
    bool back;
    int policy;
    int64_t keep_mb;
  };
  const std::vector<First> firsts = {{"forward, streaming (__ldcs)", false, kStreaming, 0},
                                     {"forward, default", false, kDefault, 0},
                                     {"from the end, default", true, kDefault, 0},
                                     {"from the end, last 16 MB evict_last", true, kKeepLast, 16},
                                     {"from the end, last 32 MB evict_last", true, kKeepLast, 32}};
  std::printf("| MB | second read | first read | us | us after another buffer | MB found in L2 (est.) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (int64_t mb : {16, 32, 48, 64, 84, 128, 268}) {
    const int64_t n = (mb << 20) / 16;
    for (bool chunks : {false, true}) {
      const int grid2 = chunks ? static_cast<int>((n + kThreads * kLoads - 1) / (kThreads * kLoads)) : grid;
      auto second = [&](float* us) {
        CHECK(cudaEventRecord(e0));
        second_read<<<grid2, kThreads>>>(a, n, chunks, out);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        CHECK(cudaEventElapsedTime(us, e0, e1));
        *us *= 1000.f;
      };
      // The baseline: a read of the other buffer (as large as the largest input) before it.
      std::vector<float> base;
      for (int rep = 0; rep < 7; ++rep) {
        first_read<<<grid, kThreads>>>(flush, max_bytes / 16, false, kDefault, 0, sink);
        float us;
        second(&us);
        base.push_back(us);
      }
      std::sort(base.begin(), base.end());
      const float b = base[3];
      for (const First& f : firsts) {
        std::vector<float> t;
        for (int rep = 0; rep < 7; ++rep) {
          first_read<<<grid, kThreads>>>(flush, max_bytes / 16, false, kDefault, 0, sink);
          first_read<<<grid, kThreads>>>(a, n, f.back, f.policy, (f.keep_mb << 20) / 16, sink);
          float us;
          second(&us);
          t.push_back(us);
        }
        std::sort(t.begin(), t.end());
        const float m = t[3];
        const float found = (b - m) / b * 1.25f * mb;  // of its DRAM bytes: the read and a quarter written
        std::printf("| %lld | %s | %s | %.1f | %.1f | %.0f |\n", static_cast<long long>(mb),
                    chunks ? "chunks" : "stride", f.name, m, b, found);
      }
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
