// Thin torch binding of the kvcomp CUDA kernel: argument checks, raw pointers and strides,
// registration as torch.ops.kvcomp.decode_attention. It includes no CUDA header (the stream
// arrives as an integer, torch.cuda.current_stream().cuda_stream), so it compiles against any
// torch build.
#include <Python.h>
#include <torch/library.h>

#include <optional>

#include "kvcomp_kernels.h"

namespace {

void check_code(int code) { TORCH_CHECK(code == 0, "kvcomp CUDA kernel failed: ", kvcomp_error_string(code)); }

void check_int32(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.dim() == dims && t.stride(-1) == 1, name,
              " must be a CUDA int32 tensor of rank ", dims, " with a contiguous last dim");
}

kvcomp_paged_cache cache_of(const at::Tensor& kv) {
  TORCH_CHECK(kv.is_cuda() && kv.dim() == 4 && kv.size(3) % 2 == 0 && kv.stride(3) == 1,
              "kv_cache must be a CUDA [num_blocks, block_size, H_kv, 2*D] tensor with contiguous cells");
  return kvcomp_paged_cache{kv.data_ptr(), kv.stride(0), kv.stride(1), kv.stride(2),
                            static_cast<int32_t>(kv.size(1)), static_cast<int32_t>(kv.size(2)),
                            static_cast<int32_t>(kv.size(3) / 2), static_cast<int32_t>(kv.element_size())};
}

kvcomp_dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return KVCOMP_FLOAT32;
    case at::kHalf:
      return KVCOMP_FLOAT16;
    case at::kBFloat16:
      return KVCOMP_BFLOAT16;
    default:
      TORCH_CHECK(false, "decode_attention supports float32, float16 and bfloat16, got ", t.scalar_type());
  }
}

const float* optional_f32(const std::optional<at::Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, name,
              " must be a contiguous CUDA float32 tensor of ", numel, " elements");
  return t->data_ptr<float>();
}

void decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, const at::Tensor& start, const std::optional<at::Tensor>& k_hat,
                      const std::optional<at::Tensor>& v_hat, const std::optional<at::Tensor>& comp_counts,
                      double scale, int64_t num_splits, const at::Tensor& mid_out, const at::Tensor& mid_lse,
                      const at::Tensor& out, const at::Tensor& lse, int64_t stream) {
  const kvcomp_paged_cache cache = cache_of(kv_cache);
  TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1 && q.size(2) == cache.head_dim &&
                  q.scalar_type() == kv_cache.scalar_type(),
              "q must be a CUDA [B, H_q, D] tensor of the cache's dtype with a contiguous last dim");
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  check_int32(block_table, "block_table", 2);
  check_int32(seq_lens, "seq_lens", 1);
  TORCH_CHECK(start.is_cuda() && start.scalar_type() == at::kInt && start.dim() == 2 && start.size(0) == batch &&
                  start.size(1) == cache.num_heads,
              "start must be a CUDA int32 [B, H_kv] tensor (any strides)");
  TORCH_CHECK(block_table.size(0) == batch && seq_lens.size(0) == batch, "block_table/seq_lens batch mismatch");
  const int64_t kv_rows = batch * cache.num_heads;
  const float* kh = optional_f32(k_hat, kv_rows * d, "k_hat");
  const float* vh = optional_f32(v_hat, kv_rows * d, "v_hat");
  const float* cnt = optional_f32(comp_counts, kv_rows, "comp_counts");
  TORCH_CHECK((kh == nullptr) == (cnt == nullptr) && (vh == nullptr) == (cnt == nullptr),
              "k_hat, v_hat and comp_counts go together");
  TORCH_CHECK(mid_out.is_contiguous() && mid_out.scalar_type() == at::kFloat &&
                  mid_out.numel() == batch * hq * num_splits * d && mid_lse.is_contiguous() &&
                  mid_lse.scalar_type() == at::kFloat && mid_lse.numel() == batch * hq * num_splits,
              "mid_out [B, H_q, S, D] / mid_lse [B, H_q, S] must be contiguous float32");
  TORCH_CHECK(out.is_cuda() && out.dim() == 3 && out.stride(2) == 1 && out.scalar_type() == q.scalar_type() &&
                  out.size(0) == batch && out.size(1) == hq && out.size(2) == d,
              "out must be [B, H_q, D] of q's dtype with a contiguous last dim");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.numel() == batch * hq,
              "lse must be a contiguous float32 [B, H_q] tensor");
  check_code(kvcomp_decode_attention(
      &cache, dtype_of(q), q.data_ptr(), q.stride(0), q.stride(1), block_table.data_ptr<int32_t>(),
      block_table.stride(0), seq_lens.data_ptr<int32_t>(), start.data_ptr<int32_t>(), start.stride(0),
      start.stride(1), kh, vh, cnt, static_cast<float>(scale), static_cast<int32_t>(batch),
      static_cast<int32_t>(hq), static_cast<int32_t>(num_splits), mid_out.data_ptr<float>(),
      mid_lse.data_ptr<float>(), out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr<float>(),
      reinterpret_cast<void*>(stream)));
}

}  // namespace

TORCH_LIBRARY(kvcomp, m) {
  m.def(
      "decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor start, "
      "Tensor? k_hat, Tensor? v_hat, Tensor? comp_counts, float scale, int num_splits, Tensor(a!) mid_out, "
      "Tensor(b!) mid_lse, Tensor(c!) out, Tensor(d!) lse, int stream) -> ()",
      &decode_attention);
}

// `import vllm_kvcomp._C` loads this library (registering the op above); the module is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
