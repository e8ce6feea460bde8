// Tensor maps (the descriptors of the copy unit's tensor copies, cp.async.bulk.tensor) for the
// kernels that stream their operands by them: the decode GEMM and the quantizers' tile kernel.
// Host code. A map is encoded by the driver (cuTensorMapEncodeTiled, found once through the
// runtime, so the extension does not link the driver library) and passed to the kernel as a
// __grid_constant__ argument.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "checks.h"

namespace qtensor {

// An address in hex digits, for error messages.
inline std::string to_hex(uintptr_t v) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  do {
    s.insert(s.begin(), kDigits[v & 15]);
    v >>= 4;
  } while (v != 0);
  return s;
}

// The driver's tensor-map encoder, found once.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && p != nullptr,
                "qtensor: the CUDA driver has no cuTensorMapEncodeTiled; the kernels that stream by "
                "tensor copies need CUDA 12.0 or newer.");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A 2-D tensor map and what it is made from. A map is a pure function of these fields (the
// address, the sizes, the box, the element type, the swizzle), so a map made earlier from equal
// fields is the same map, whatever the memory at that address holds now.
struct MapSpec {
  const void* base;
  cuuint64_t dims[2];   // elements per row, rows
  cuuint64_t stride;    // bytes between rows
  cuuint32_t box[2];    // elements, rows
  CUtensorMapDataType dtype;
  CUtensorMapSwizzle swizzle;
  CUtensorMapL2promotion promotion;
  bool operator==(const MapSpec& o) const {
    return base == o.base && dims[0] == o.dims[0] && dims[1] == o.dims[1] && stride == o.stride &&
           box[0] == o.box[0] && box[1] == o.box[1] && dtype == o.dtype && swizzle == o.swizzle &&
           promotion == o.promotion;
  }
};

// The tensor map of `spec`, parts outside the tensor read as zeros: each host thread keeps the
// last maps it made in a small table (by a hash of the fields; a slot holds one map), so that
// launches whose operands recur (the weights and activation buffers of an eager decode loop, the
// caching allocator's blocks of a training step) encode a map only the first time. `what` names
// the op and the tensor in errors.
inline CUtensorMap tensor_map(const MapSpec& spec, const char* what) {
  constexpr int kSlots = 64;
  struct Slot {
    MapSpec spec;
    CUtensorMap map;
    bool used;
  };
  thread_local Slot slots[kSlots] = {};
  uint64_t h = reinterpret_cast<uintptr_t>(spec.base);
  for (uint64_t v : {spec.dims[0], spec.dims[1], spec.stride, uint64_t{spec.box[0]},
                     uint64_t{spec.box[1]}, uint64_t(spec.dtype), uint64_t(spec.swizzle)})
    h = (h ^ v) * 0x100000001B3ull;
  Slot& slot = slots[(h ^ (h >> 29)) % kSlots];
  if (slot.used && slot.spec == spec) return slot.map;
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(
      &slot.map, spec.dtype, 2, const_cast<void*>(spec.base), spec.dims, &spec.stride, spec.box,
      steps, CU_TENSOR_MAP_INTERLEAVE_NONE, spec.swizzle, spec.promotion,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  slot.used = r == CUDA_SUCCESS;
  // Numbers enter the message as strings, through num() (see checks.h).
  TORCH_CHECK(r == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed (error ",
              num(static_cast<int>(r)), ") for ", num(static_cast<int64_t>(spec.dims[1])),
              " rows of ", num(static_cast<int64_t>(spec.dims[0])), " elements, ",
              num(static_cast<int64_t>(spec.stride)), " bytes apart, at 0x",
              to_hex(reinterpret_cast<uintptr_t>(spec.base)), ".");
  slot.spec = spec;
  return slot.map;
}

}  // namespace qtensor
