// Per-head compaction of a paged KV cache (see kvcomp_compact_heads in kvcomp_kernels.h).
//
// Kept slots only move right (kept[j] <= N - count + j), but a cell's source may be another
// cell's destination, so the copy runs as two kernels on one stream: gather every moving cell
// to the workspace, then scatter it to its destination. Cells already in place are skipped.
// Cells are copied as raw bytes in the widest unit their alignment allows.
#include "common.cuh"

namespace kvcomp {
namespace {

constexpr int kThreads = 128;

template <typename Unit, bool kGather>
__global__ void __launch_bounds__(kThreads)
    compact_kernel(kvcomp_paged_cache cache, const int32_t* __restrict__ block_table, int64_t bt_stride,
                   const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ kept,
                   const int32_t* __restrict__ counts, int32_t k_max, int32_t tokens_per_cta, char* workspace) {
  const int32_t h = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t head_row = b * gridDim.y + h;
  const int32_t count = counts[head_row];
  const int32_t n = seq_lens[b];
  const int64_t cell_bytes = 2LL * cache.head_dim * cache.elem_bytes;
  const int32_t units = static_cast<int32_t>(cell_bytes / sizeof(Unit));
  const int32_t j0 = blockIdx.x * tokens_per_cta;
  const int32_t* bt_row = block_table + b * bt_stride;
  for (int32_t i = threadIdx.x; i < tokens_per_cta * units; i += blockDim.x) {
    const int32_t j = j0 + i / units;
    if (j >= count) break;  // i only grows, so j does too
    const int32_t src = kept[head_row * k_max + j];
    const int32_t dst = n - count + j;
    if (src == dst) continue;
    const int32_t u = i % units;
    Unit* cell = reinterpret_cast<Unit*>(static_cast<char*>(cache.data) +
                                         cell_offset(cache, bt_row, kGather ? src : dst, h) * cache.elem_bytes);
    Unit* work = reinterpret_cast<Unit*>(workspace + (head_row * k_max + j) * cell_bytes);
    if (kGather) {
      work[u] = cell[u];
    } else {
      cell[u] = work[u];
    }
  }
}

template <typename Unit>
cudaError_t launch(const kvcomp_paged_cache& cache, const int32_t* block_table, int64_t bt_stride,
                   const int32_t* seq_lens, const int32_t* kept, const int32_t* counts, int32_t batch, int32_t k_max,
                   void* workspace, cudaStream_t stream) {
  const int32_t units = static_cast<int32_t>(2LL * cache.head_dim * cache.elem_bytes / sizeof(Unit));
  const int32_t tokens_per_cta = units >= kThreads ? 1 : kThreads / units;
  const dim3 grid((k_max + tokens_per_cta - 1) / tokens_per_cta, cache.num_heads, batch);
  char* work = static_cast<char*>(workspace);
  compact_kernel<Unit, true><<<grid, kThreads, 0, stream>>>(cache, block_table, bt_stride, seq_lens, kept, counts,
                                                            k_max, tokens_per_cta, work);
  compact_kernel<Unit, false><<<grid, kThreads, 0, stream>>>(cache, block_table, bt_stride, seq_lens, kept, counts,
                                                             k_max, tokens_per_cta, work);
  return cudaGetLastError();
}

bool aligned_to(const kvcomp_paged_cache& c, const void* workspace, int64_t unit) {
  const int64_t eb = c.elem_bytes;
  return reinterpret_cast<uintptr_t>(c.data) % unit == 0 && reinterpret_cast<uintptr_t>(workspace) % unit == 0 &&
         (c.stride_block * eb) % unit == 0 && (c.stride_token * eb) % unit == 0 && (c.stride_head * eb) % unit == 0 &&
         (2LL * c.head_dim * eb) % unit == 0;
}

}  // namespace
}  // namespace kvcomp

extern "C" int kvcomp_compact_heads(const kvcomp_paged_cache* cache, const int32_t* block_table, int64_t bt_stride,
                                    const int32_t* seq_lens, const int32_t* kept, const int32_t* counts, int32_t batch,
                                    int32_t k_max, void* workspace, void* stream) {
  using namespace kvcomp;
  if (batch == 0 || k_max == 0) return cudaSuccess;
  if (cache->num_heads > 65535 || batch > 65535) return cudaErrorInvalidValue;
  auto s = static_cast<cudaStream_t>(stream);
  if (aligned_to(*cache, workspace, 16))
    return launch<uint4>(*cache, block_table, bt_stride, seq_lens, kept, counts, batch, k_max, workspace, s);
  if (aligned_to(*cache, workspace, 8))
    return launch<uint2>(*cache, block_table, bt_stride, seq_lens, kept, counts, batch, k_max, workspace, s);
  if (aligned_to(*cache, workspace, 4))
    return launch<uint32_t>(*cache, block_table, bt_stride, seq_lens, kept, counts, batch, k_max, workspace, s);
  if (aligned_to(*cache, workspace, 2))
    return launch<uint16_t>(*cache, block_table, bt_stride, seq_lens, kept, counts, batch, k_max, workspace, s);
  return launch<uint8_t>(*cache, block_table, bt_stride, seq_lens, kept, counts, batch, k_max, workspace, s);
}

extern "C" const char* kvcomp_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
