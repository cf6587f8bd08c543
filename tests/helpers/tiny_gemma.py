"""A tiny random-weight Gemma 3 text model (sliding-window + full-attention layers) for hybrid tests.

Same tokenizer as the tiny Llama (tests/helpers/tiny_llama.py). Greedy outputs must depend on
which tokens are kept, or an equality test proves nothing: untied embeddings (tied ones make a
random model repeat its last input token forever) and HF's initializer at ``initializer_range``
0.3 give varied tokens that change with the kept set.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_llama import save_tiny_tokenizer, tiny_vocab


def make_tiny_gemma3(
    path: Path,
    *,
    layer_types: tuple[str, ...] = ("sliding_attention",) * 5 + ("full_attention",),
    sliding_window: int = 128,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.3,
    seed: int = 0,
) -> Path:
    """Write a random Gemma3ForCausalLM (float32 safetensors) + tokenizer to ``path``; returns it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokens, _ = tiny_vocab(vocab_size)
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types), num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, layer_types=list(layer_types), sliding_window=sliding_window,
        query_pre_attn_scalar=head_dim, max_position_embeddings=max_position_embeddings,
        bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"),
        pad_token_id=tokens.index("<|endoftext|>"), tie_word_embeddings=False, dtype="float32",
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32)  # HF's init at initializer_range
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:  # Gemma norms scale by (1 + weight): keep them near 1, not all equal
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path), safe_serialization=True)
    save_tiny_tokenizer(path, vocab_size, max_position_embeddings)
    return path
