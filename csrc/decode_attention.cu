// Split-K paged decode attention with per-(request, KV head) valid ranges and an optional
// compensation token (see kvcomp_decode_attention in kvcomp_kernels.h).
//
// Stage 1: CTA (split, h_kv, b) of kWarps warps. Each warp walks every kWarps-th slot of the
// split (two slots per step for memory-level parallelism); a lane holds D/32 consecutive
// channels of K and V and the online-softmax state of all G query heads of the KV head. The
// warps' states merge through shared memory into a normalised partial output + LSE per split.
// Stage 2: CTA (h_q, b) merges the splits and the compensation token (weight N_d·e^(scale·q·k̂)).
#include <float.h>
#include <math.h>

#include "common.cuh"

namespace kvcomp {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

struct DecodeArgs {
  kvcomp_paged_cache cache;
  const void* q;
  int64_t q_stride_b, q_stride_h;
  const int32_t* block_table;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* start;
  int64_t start_stride_b, start_stride_h;
  const float* k_hat;
  const float* v_hat;
  const float* comp_counts;
  float scale;
  int32_t num_q_heads, group, num_splits;
  float* mid_out;
  float* mid_lse;
  void* out;
  int64_t out_stride_b, out_stride_h;
  float* lse;
};

template <typename T, int D, int MAX_G>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(DecodeArgs a) {
  constexpr int EPL = D / 32;  // channels per lane
  const int split = blockIdx.x, hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.group;

  __shared__ float q_s[MAX_G][D];
  __shared__ float acc_s[kWarps][D];
  __shared__ float ml_s[kWarps][2];
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride_b;
  for (int i = threadIdx.x; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    q_s[g][d] = to_float(q[static_cast<int64_t>(hk * group + g) * a.q_stride_h + d]) * a.scale;
  }
  __syncthreads();

  const int32_t seq_len = a.seq_lens[b];
  const int32_t start = a.start[b * a.start_stride_b + hk * a.start_stride_h];
  const int32_t length = max(seq_len - start, 0);
  const int32_t per_split = (length + a.num_splits - 1) / a.num_splits;
  const int32_t lo = start + split * per_split;
  const int32_t hi = min(lo + per_split, seq_len);

  float m[MAX_G], l[MAX_G], acc[MAX_G][EPL];
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
  }

  const T* base = static_cast<const T*>(a.cache.data) + lane * EPL;
  const int32_t* bt_row = a.block_table + b * a.bt_stride;
  for (int32_t t0 = lo + warp; t0 < hi; t0 += 2 * kWarps) {
    const int32_t t1 = t0 + kWarps;
    const bool has1 = t1 < hi;
    float k0[EPL], v0[EPL], k1[EPL], v1[EPL];
    const T* c0 = base + cell_offset(a.cache, bt_row, t0, hk);
    load_floats<T, EPL>(c0, k0);
    load_floats<T, EPL>(c0 + D, v0);
    if (has1) {
      const T* c1 = base + cell_offset(a.cache, bt_row, t1, hk);
      load_floats<T, EPL>(c1, k1);
      load_floats<T, EPL>(c1 + D, v1);
    }
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      if (step == 1 && !has1) break;
      const float(&k)[EPL] = step == 0 ? k0 : k1;
      const float(&v)[EPL] = step == 0 ? v0 : v1;
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
        if (g >= group) break;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) s += q_s[g][lane * EPL + e] * k[e];
        s = warp_sum(s);
        const float m_new = fmaxf(m[g], s);
        const float alpha = expf(m[g] - m_new);  // 0 on the first slot (m = -inf)
        const float p = expf(s - m_new);
        l[g] = l[g] * alpha + p;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * alpha + p * v[e];
        m[g] = m_new;
      }
    }
  }

  // Merge the warps, one query head at a time.
  const int64_t hq0 = b * a.num_q_heads + static_cast<int64_t>(hk) * group;
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    if (g >= group) break;
    if (lane == 0) {
      ml_s[warp][0] = m[g];
      ml_s[warp][1] = l[g];
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc_s[warp][lane * EPL + e] = acc[g][e];
    __syncthreads();
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, ml_s[w][0]);
    float weight[kWarps], l_all = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = ml_s[w][1] > 0.f ? expf(ml_s[w][0] - m_all) : 0.f;
      l_all += weight[w] * ml_s[w][1];
    }
    const int64_t row = (hq0 + g) * a.num_splits + split;
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o += weight[w] * acc_s[w][d];
      a.mid_out[row * D + d] = l_all > 0.f ? o / l_all : 0.f;
    }
    if (threadIdx.x == 0) a.mid_lse[row] = l_all > 0.f ? m_all + logf(l_all) : -INFINITY;
    __syncthreads();
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_merge_kernel(DecodeArgs a) {
  const int hq = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int64_t row = b * a.num_q_heads + hq;
  __shared__ float red_s[kWarps];

  float m_all = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) m_all = fmaxf(m_all, a.mid_lse[row * a.num_splits + s]);
  float comp_lse = -INFINITY;
  const int64_t kv_row = b * (a.num_q_heads / a.group) + hq / a.group;
  if (a.comp_counts != nullptr && a.comp_counts[kv_row] > 0.f) {
    const T* q = static_cast<const T*>(a.q) + b * a.q_stride_b + hq * a.q_stride_h;
    float dot = 0.f;
    for (int d = threadIdx.x; d < D; d += kThreads) dot += to_float(q[d]) * a.k_hat[kv_row * D + d];
    dot = warp_sum(dot);
    if (threadIdx.x % 32 == 0) red_s[threadIdx.x / 32] = dot;
    __syncthreads();
    dot = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) dot += red_s[w];
    comp_lse = dot * a.scale + logf(a.comp_counts[kv_row]);
    m_all = fmaxf(m_all, comp_lse);
  }
  float l_all = 0.f;
  if (m_all > -INFINITY) {
    for (int s = 0; s < a.num_splits; ++s) l_all += expf(a.mid_lse[row * a.num_splits + s] - m_all);
    l_all += expf(comp_lse - m_all);
  }
  T* out = static_cast<T*>(a.out) + b * a.out_stride_b + hq * a.out_stride_h;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.f;
    if (l_all > 0.f) {
      for (int s = 0; s < a.num_splits; ++s) {
        const float w = expf(a.mid_lse[row * a.num_splits + s] - m_all);
        if (w > 0.f) o += w * a.mid_out[(row * a.num_splits + s) * D + d];
      }
      if (comp_lse > -INFINITY) o += expf(comp_lse - m_all) * a.v_hat[kv_row * D + d];
      o /= l_all;
    }
    out[d] = from_float<T>(o);
  }
  if (threadIdx.x == 0) a.lse[row] = l_all > 0.f ? m_all + logf(l_all) : -INFINITY;
}

template <typename T, int D>
cudaError_t launch_dim(const DecodeArgs& a, int32_t batch, cudaStream_t stream) {
  const dim3 split_grid(a.num_splits, a.num_q_heads / a.group, batch);
  if (a.group <= 4) {
    decode_split_kernel<T, D, 4><<<split_grid, kThreads, 0, stream>>>(a);
  } else if (a.group <= 8) {
    decode_split_kernel<T, D, 8><<<split_grid, kThreads, 0, stream>>>(a);
  } else {
    decode_split_kernel<T, D, 16><<<split_grid, kThreads, 0, stream>>>(a);
  }
  decode_merge_kernel<T, D><<<dim3(a.num_q_heads, batch), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_type(const DecodeArgs& a, int32_t batch, cudaStream_t stream) {
  switch (a.cache.head_dim) {
    case 64:
      return launch_dim<T, 64>(a, batch, stream);
    case 128:
      return launch_dim<T, 128>(a, batch, stream);
    case 256:
      return launch_dim<T, 256>(a, batch, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// K/V vectors of D/32 elements per lane are loaded as one aligned vector.
bool vector_aligned(const kvcomp_paged_cache& c) {
  const int64_t unit = static_cast<int64_t>(c.head_dim / 32) * c.elem_bytes;
  const int64_t elems = c.head_dim / 32;
  return reinterpret_cast<uintptr_t>(c.data) % unit == 0 && c.stride_block % elems == 0 &&
         c.stride_token % elems == 0 && c.stride_head % elems == 0;
}

}  // namespace
}  // namespace kvcomp

extern "C" int kvcomp_decode_attention(const kvcomp_paged_cache* cache, kvcomp_dtype dtype, const void* q,
                                       int64_t q_stride_b, int64_t q_stride_h, const int32_t* block_table,
                                       int64_t bt_stride, const int32_t* seq_lens, const int32_t* start,
                                       int64_t start_stride_b, int64_t start_stride_h, const float* k_hat,
                                       const float* v_hat, const float* comp_counts, float scale, int32_t batch,
                                       int32_t num_q_heads, int32_t num_splits, float* mid_out, float* mid_lse,
                                       void* out, int64_t out_stride_b, int64_t out_stride_h, float* lse,
                                       void* stream) {
  using namespace kvcomp;
  if (batch == 0) return cudaSuccess;
  const int32_t hk = cache->num_heads;
  if (hk <= 0 || num_q_heads % hk != 0 || num_q_heads / hk > 16 || num_splits < 1 || batch > 65535 ||
      !vector_aligned(*cache))
    return cudaErrorInvalidValue;
  const DecodeArgs a{*cache, q, q_stride_b, q_stride_h, block_table, bt_stride, seq_lens, start, start_stride_b,
                     start_stride_h, k_hat, v_hat, comp_counts, scale, num_q_heads, num_q_heads / hk, num_splits,
                     mid_out, mid_lse, out, out_stride_b, out_stride_h, lse};
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case KVCOMP_FLOAT32:
      return launch_type<float>(a, batch, s);
    case KVCOMP_FLOAT16:
      return launch_type<__half>(a, batch, s);
    case KVCOMP_BFLOAT16:
      return launch_type<__nv_bfloat16>(a, batch, s);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" const char* kvcomp_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
