"""A tiny random-weight Llama (HF folder with tokenizer) and its GGUF twin, for fast tests.

No hub access: the tokenizer is a byte-level BPE built with ``tokenizers`` (3 ChatML special
tokens, the 256 byte symbols, then a fixed list of merges up to ``vocab_size``), wrapped as a fast
tokenizer with a ChatML chat template. Weights are drawn from a seeded generator, with
``1/sqrt(fan_in)`` scaling so that attention is far from uniform (compression changes outputs).
Loads in transformers and in vLLM CPU.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

#: KV-cache size for test engines (their block count is set by ``num_gpu_blocks_override``): with
#: ``gpu_memory_utilization`` vLLM's CPU worker asks for that share of the NUMA node's memory minus the
#: process's RSS, which is negative on a node of ~8 GiB (every engine test errored there) and leaves
#: nothing next to a real model's weights (Gemma 3 270M: 1 GB in float32).
ENGINE_KV_CACHE_BYTES = 256 << 20
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def merge_candidates() -> list[tuple[str, str]]:
    """Fixed merge list: space+letter, then every lower-case letter pair."""
    letters = string.ascii_lowercase
    space = bytes_to_unicode()[ord(" ")]
    return [(space, c) for c in letters] + [(a, b) for a in letters for b in letters]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens in id order, merges) of a byte-level BPE with exactly ``vocab_size`` tokens."""
    extra = vocab_size - _MIN_VOCAB
    candidates = merge_candidates()
    if not 0 <= extra <= len(candidates):
        raise ValueError(f"vocab_size must be in [{_MIN_VOCAB}, {_MIN_VOCAB + len(candidates)}]")
    merges = candidates[:extra]
    return [*SPECIAL_TOKENS, *bytes_to_unicode(), *(a + b for a, b in merges)], merges


def save_tiny_tokenizer(path: Path, vocab_size: int, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json + chat template of the tiny byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens, merges = tiny_vocab(vocab_size)
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(path))


def make_tiny_llama(
    path: Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 320,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random LlamaForCausalLM (float32 safetensors) + tokenizer to ``path``; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokens, _ = tiny_vocab(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokens.index("<|im_start|>"),
        eos_token_id=tokens.index("<|im_end|>"),
        pad_token_id=tokens.index("<|endoftext|>"),
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tiny_tokenizer(path, vocab_size, max_position_embeddings)
    return path


# ---------------------------------------------------------------------------- GGUF twin


def permute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's q/k ``permute`` (HF half split -> interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(hf_dir: Path, gguf_path: Path, *, quantize_embeddings: bool = False) -> Path:
    """The tiny Llama at ``hf_dir`` as a llama.cpp-style GGUF (F32, optionally Q8_0 embeddings)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    tokenizer = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}

    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, tensor in state.items():
        if name in names:
            target = names[name]
        else:
            _, _, layer, *rest = name.split(".")
            target = f"blk.{layer}.{layer_names['.'.join(rest[:-1])]}.{rest[-1]}"
        if name.endswith("q_proj.weight"):
            tensor = permute_rope_rows(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = permute_rope_rows(tensor, kv_heads)
        array = tensor.float().numpy()
        if quantize_embeddings and target == "token_embd.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(gguf_path)


def seeded_scorer(model_dir: Path, seed: int = 0):
    """A ``kvzap`` profile of seeded weights for the model in ``model_dir`` (its layers, KV heads
    and head_dim): what a calibrated scorer gives the engine, without the calibration."""
    from vllm_kvcomp.calibration.profiles import ModelIdentity, ScorerProfile

    identity = ModelIdentity.from_model_dir(model_dir)
    gen = torch.Generator().manual_seed(seed)
    shape = (identity.num_layers, identity.num_kv_heads)
    weights = torch.randn(*shape, identity.head_dim * 3 // 2, generator=gen, dtype=torch.float64)
    bias = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return ScorerProfile.from_arrays(identity, weights, bias)
