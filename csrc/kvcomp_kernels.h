// C ABI of vllm-kvcomp's CUDA kernel, paged decode attention. Plain C types only, so the torch
// binding (bindings.cpp) needs no CUDA headers and the .cu file compiles standalone with nvcc.
//
// Paged cache of one layer: logical [num_blocks, block_size, H_kv, 2*D] with arbitrary element
// strides for the first three dims and a contiguous last dim (K in [0, D), V in [D, 2D)).
// Logical slot i of request b lives at block block_table[b * bt_stride + i / block_size],
// offset i % block_size. The launcher returns a cudaError_t value (0 = success).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { KVCOMP_FLOAT32 = 0, KVCOMP_FLOAT16 = 1, KVCOMP_BFLOAT16 = 2 } kvcomp_dtype;

typedef struct {
  void* data;
  int64_t stride_block;  // elements
  int64_t stride_token;  // elements
  int64_t stride_head;   // elements
  int32_t block_size;
  int32_t num_heads;
  int32_t head_dim;      // D; a cell holds 2*D elements
  int32_t elem_bytes;    // element size in bytes (vector alignment checks)
} kvcomp_paged_cache;

// Split-K decode attention, one query per request. q [B, H_q, D] (strides in elements, last dim
// contiguous), query head i reads KV head i / (H_q / H_kv). Head h of request b attends slots
// [start[b*start_stride_b + h*start_stride_h], seq_lens[b]). Optional compensation (k_hat, v_hat
// float32 [B, H_kv, D] contiguous, comp_counts float32 [B, H_kv], NULL = off). Workspace:
// mid_out float32 [B, H_q, num_splits, D], mid_lse float32 [B, H_q, num_splits]. Writes out
// [B, H_q, D] (dtype, strides) and lse float32 [B, H_q] contiguous (natural log).
// Supports head_dim 64/128/256 and H_q / H_kv <= 16 (else cudaErrorInvalidValue).
int kvcomp_decode_attention(const kvcomp_paged_cache* cache, kvcomp_dtype dtype, const void* q,
                            int64_t q_stride_b, int64_t q_stride_h, const int32_t* block_table,
                            int64_t bt_stride, const int32_t* seq_lens, const int32_t* start,
                            int64_t start_stride_b, int64_t start_stride_h, const float* k_hat,
                            const float* v_hat, const float* comp_counts, float scale, int32_t batch,
                            int32_t num_q_heads, int32_t num_splits, float* mid_out, float* mid_lse,
                            void* out, int64_t out_stride_b, int64_t out_stride_h, float* lse,
                            void* stream);

// Human-readable message of an error code returned above.
const char* kvcomp_error_string(int code);

#ifdef __cplusplus
}
#endif
