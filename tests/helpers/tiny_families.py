"""Tiny random-weight models of the families in docs/compatibility.md (tests/engine/test_compatibility.py).

Each builder writes an HF folder (float32 safetensors, 2 layers, GQA where the family has it) with
the shared 512-token tokenizer of the tiny Llama (tests/helpers/tiny_llama.py), loadable by
transformers and by vLLM CPU (attention ``head_dim >= 32``). Weights are drawn as the tiny Llama's
are (norms near 1, embeddings N(0, 1), matrices ``1/sqrt(fan_in)``; biases made non-zero so a
family's bias is active). A random model with tied embeddings still tends to repeat one token
greedily; the support matrix records what the engine does with the cache, not the text. Gemma 2,
Gemma 3 and gpt-oss are tests/helpers/tiny_variants.py's and tests/helpers/tiny_gemma.py's
builders, re-exported unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_gemma import make_tiny_gemma3
from tests.helpers.tiny_llama import save_tiny_tokenizer, tiny_vocab
from tests.helpers.tiny_variants import make_tiny_gemma2, make_tiny_gpt_oss

VOCAB = 512
MAX_POSITIONS = 4096
#: the geometry every family below shares unless it says otherwise
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_POSITIONS,
              rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="float32")


def _special_ids() -> dict[str, int]:
    tokens, _ = tiny_vocab(VOCAB)
    return dict(bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"),
                pad_token_id=tokens.index("<|endoftext|>"))


def _build(path: Path, config_name: str, model_name: str, *, seed: int = 0, **overrides) -> Path:
    """Write ``transformers.<model_name>`` built from ``<config_name>(COMMON | overrides)``."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, config_name)(**{**COMMON, **_special_ids(), **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name and param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:  # tied: halved, or greedy output copies the last prompt token
                scale = 0.5 if config.tie_word_embeddings else 1.0
                param.copy_(scale * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tiny_tokenizer(path, VOCAB, MAX_POSITIONS)
    return path


def make_tiny_llama3(path: Path, seed: int = 0) -> Path:
    """Llama 3.x: GQA 8:1 (8 query heads, 1 KV head) and Llama 3.1's frequency-scaled RoPE."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    return _build(path, "LlamaConfig", "LlamaForCausalLM", seed=seed, hidden_size=256, num_attention_heads=8,
                  num_key_value_heads=1, rope_parameters=rope)


def make_tiny_qwen2(path: Path, seed: int = 0) -> Path:
    """Qwen2: biases on the q/k/v projections (random, far from zero)."""
    return _build(path, "Qwen2Config", "Qwen2ForCausalLM", seed=seed)


def make_tiny_qwen2_5(path: Path, seed: int = 0) -> Path:
    """Qwen2.5: the Qwen2 architecture as the small Qwen2.5 checkpoints ship it (tied embeddings,
    RoPE theta 1e6)."""
    return _build(path, "Qwen2Config", "Qwen2ForCausalLM", seed=seed, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def make_tiny_qwen3(path: Path, seed: int = 0) -> Path:
    """Qwen3: RMS norm on each query and key head before RoPE."""
    return _build(path, "Qwen3Config", "Qwen3ForCausalLM", seed=seed)


def make_tiny_mistral(path: Path, sliding_window: int | None = None, seed: int = 0) -> Path:
    """Mistral; with ``sliding_window`` every layer attends a window (Mistral 7B v0.1's config)."""
    return _build(path, "MistralConfig", "MistralForCausalLM", seed=seed, sliding_window=sliding_window)


def make_tiny_mixtral(path: Path, seed: int = 0) -> Path:
    """Mixtral: 4 experts, 2 per token."""
    return _build(path, "MixtralConfig", "MixtralForCausalLM", seed=seed, intermediate_size=128,
                  num_local_experts=4, num_experts_per_tok=2)


def make_tiny_phi3(path: Path, seed: int = 0) -> Path:
    """Phi-3: fused qkv and gate/up projections."""
    return _build(path, "Phi3Config", "Phi3ForCausalLM", seed=seed)


def make_tiny_granite(path: Path, seed: int = 0) -> Path:
    """Granite: embedding / residual / logit multipliers and an attention multiplier (0.25) in place
    of the 1/sqrt(head_dim) softmax scale."""
    return _build(path, "GraniteConfig", "GraniteForCausalLM", seed=seed, embedding_multiplier=4.0,
                  residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0)


def make_tiny_olmo2(path: Path, seed: int = 0) -> Path:
    """OLMo 2: RMS norm over the whole query and key projections, norms after attention and MLP."""
    return _build(path, "Olmo2Config", "Olmo2ForCausalLM", seed=seed)


def make_tiny_deepseek_v2(path: Path, kv_lora_rank: int = 512, seed: int = 0) -> Path:
    """DeepSeek-V2 (Lite-style, no q LoRA): multi-head latent attention, q/k head 64 (no RoPE) + 64
    (RoPE), v head 64; layer 0 dense, layer 1 MoE (4 routed experts, 2 per token, 1 shared).

    ``kv_lora_rank`` is DeepSeek's 512: vLLM CPU 0.32's MLA decode kernel takes only a 576-wide
    latent (rank + RoPE 64); any other rank fails in plain vLLM ("Head dimension 128 is not
    supported by MLA." for rank 64)."""
    return _build(path, "DeepseekV2Config", "DeepseekV2ForCausalLM", seed=seed, num_key_value_heads=4,
                  head_dim=64, kv_lora_rank=kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
                  v_head_dim=64, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1)


__all__ = ["make_tiny_deepseek_v2", "make_tiny_gemma2", "make_tiny_gemma3", "make_tiny_gpt_oss",
           "make_tiny_granite", "make_tiny_llama3", "make_tiny_mistral", "make_tiny_mixtral", "make_tiny_olmo2",
           "make_tiny_phi3", "make_tiny_qwen2", "make_tiny_qwen2_5", "make_tiny_qwen3"]
