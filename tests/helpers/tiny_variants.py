"""Tiny random-weight models whose attention has a variant vLLM's kernels apply: Gemma 2 (logit
soft-capping) and gpt-oss (learned attention sinks), each with the variant made *active*.

A random tiny model never reaches Gemma 2's soft-cap (logits of a few units against a cap of 50)
and has sinks near zero, so a kernel that ignores them would pass any test. Here the q/k
projections are scaled (Gemma 2: logits well past the cap) and the sinks set large, so leaving
the variant out changes the output. Same tokenizer as the tiny Llama (tests/helpers/tiny_llama.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers.tiny_llama import save_tiny_tokenizer, tiny_vocab

VOCAB = 512
MAX_POSITIONS = 4096


def _special_ids() -> dict[str, int]:
    tokens, _ = tiny_vocab(VOCAB)
    return dict(bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"),
                pad_token_id=tokens.index("<|endoftext|>"))


def _random(model_cls, config, seed: int, adjust: Callable[[str, torch.Tensor, torch.Generator], None]):
    """HF's random init at the config's ``initializer_range``, then ``adjust`` on every parameter
    in name order (seeded)."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            adjust(name, param, gen)
    return model


def _save(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    save_tiny_tokenizer(path, VOCAB, MAX_POSITIONS)
    return path


def make_tiny_gemma2(path: Path, *, qk_scale: float = 16.0, softcap: float = 50.0, seed: int = 0) -> Path:
    """Gemma2ForCausalLM (tied embeddings, as vLLM's Gemma 2 requires): 4 layers alternating
    sliding (window 128) and global attention, GQA 2:1, attention logits soft-capped at ``softcap`` with q/k weights x ``qk_scale`` (logits reach
    ~100 against the cap)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=128, query_pre_attn_scalar=32,
        attn_logit_softcapping=softcap, final_logit_softcapping=30.0, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True, initializer_range=0.3, dtype="float32", **_special_ids(),
    )
    def adjust(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
        if "norm" in name:  # Gemma norms scale by (1 + weight): near 1, not all equal
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            param.mul_(qk_scale**0.5)
        elif "embed_tokens" in name:  # tied: a large embedding dominates the residual stream and
            param.mul_(0.03)  # the model repeats its last token forever

    return _save(_random(Gemma2ForCausalLM, config, seed, adjust), path)


def make_tiny_gpt_oss(path: Path, *, sink: float = 8.0, seed: int = 0) -> Path:
    """GptOssForCausalLM: 4 layers alternating sliding (window 128) and full attention, GQA 2:1,
    4 experts (2 per token), unquantized; every learned sink set to about ``sink``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=128, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False, initializer_range=0.3, dtype="float32", **_special_ids(),
    )
    def adjust(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
        if name.endswith("sinks"):
            param.copy_(sink + torch.randn(param.shape, generator=gen))
        elif "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))

    return _save(_random(GptOssForCausalLM, config, seed, adjust), path)
