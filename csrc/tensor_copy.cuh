// Device side of the tensor copies (cp.async.bulk.tensor, sm_90 on) and of the shared-memory
// barriers (mbarrier) their completion counts on: what a kernel that streams its input by the
// copy unit needs. The maps are made on the host (tensor_map.h). Built for an earlier target (the
// portable PTX), the functions are empty: a kernel calls them only where it was built for sm_90
// or later.
#pragma once

#include <cuda.h>

#include <cstdint>

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define QT_TENSOR_COPIES 1
#else
#define QT_TENSOR_COPIES 0
#endif

namespace qtensor {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if QT_TENSOR_COPIES
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
#endif
}
// Barriers made by one thread, visible to the copy unit and the other threads' waits (behind a
// CTA barrier).
__device__ __forceinline__ void mbar_init_fence() {
#if QT_TENSOR_COPIES
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// This thread's arrival (one of the count the barrier was made with).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if QT_TENSOR_COPIES
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// This thread's arrival, with `bytes` more for the copies completing on the barrier to bring.
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
#if QT_TENSOR_COPIES
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// Wait for the barrier's phase of the given parity to complete.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if QT_TENSOR_COPIES
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n"
      ::"r"(bar), "r"(parity) : "memory");
#endif
}
// Orders this thread's earlier shared-memory accesses (the generic proxy's) before later tensor
// copies (the async proxy's) into the same memory: a thread that wrote a stage fences before the
// CTA barrier after which the stage is refilled.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if QT_TENSOR_COPIES
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// The box at (c0, c1) of a 2-D tensor map global -> shared, completing on `bar`; the box's
// parts outside the tensor arrive as zeros, and its bytes count in full.
__device__ __forceinline__ void tensor_copy(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
#if QT_TENSOR_COPIES
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
#endif
}
// The box at (c0, c1) of a 2-D tensor map shared -> global: the copy unit's store of a staged
// box, in this thread's bulk group (commit it with bulk_commit); the box's parts outside the
// tensor are not written. The shared memory must be written and fenced (fence_proxy_async_smem)
// by every thread that wrote it, behind a CTA barrier, before the store is issued.
__device__ __forceinline__ void tensor_store(const CUtensorMap* map, int c0, int c1, uint32_t src) {
#if QT_TENSOR_COPIES
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(src) : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if QT_TENSOR_COPIES
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Wait until every bulk group of this thread but the newest N has read its shared memory (the
// memory may then be written again; the global writes may still be under way).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if QT_TENSOR_COPIES
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
// The tensor map itself into the constant cache, before its first copy.
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
#if QT_TENSOR_COPIES
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

}  // namespace qtensor

#undef QT_TENSOR_COPIES
