// Device helpers shared by the kvcomp CUDA kernels: dtype conversion, vector loads, paged slots.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kvcomp_kernels.h"

namespace kvcomp {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N consecutive elements loaded as one aligned vector and widened to float.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float (&dst)[N]) {
  const Pack<T, N> p = *reinterpret_cast<const Pack<T, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = to_float(p.v[i]);
}

// Element offset of the cell of logical slot `slot` of one request, KV head `head`.
__device__ __forceinline__ int64_t cell_offset(const kvcomp_paged_cache& c, const int32_t* bt_row, int32_t slot,
                                               int32_t head) {
  const int64_t block = bt_row[slot / c.block_size];
  return block * c.stride_block + static_cast<int64_t>(slot % c.block_size) * c.stride_token +
         static_cast<int64_t>(head) * c.stride_head;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace kvcomp
