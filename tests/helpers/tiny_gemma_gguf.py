"""A tiny Gemma 3 as llama.cpp's converter writes it: a SentencePiece-style vocabulary with
scores, control / user-defined / byte tokens, ``gemma3`` metadata and tensors with every norm
stored as ``1 + w`` (convert_hf_to_gguf's Gemma3Model), for the GGUF -> HF round trip.

Tensor names come from gguf's own map (``gguf.get_tensor_name_map``), not from the converter's
table, so the round trip checks that table too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "\n\n", "  ", "   ", "\t", "<b>", "</b>"]
WORDS = ["the", "cat", "sat", "on", "mat", "capital", "of", "France", "is", "Paris", "hello", "world",
         "token", "merge", "abcabc", "banana", "tokenizer", "Gemma", "window"]
CHARS = [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()é", "\u2581"]


def tiny_spm_vocab(seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) in llama.cpp's layout: control first, then user-defined,
    the 256 byte tokens, single characters and every substring of the words (and of the words
    after ``▁``). The normal tokens' scores are a seeded random order, not their ids' order, so
    which merge wins depends on the scores alone."""
    pieces: set[str] = set()
    for word in WORDS:
        for text in (word, "\u2581" + word):
            pieces.update(text[i:j] for i in range(len(text)) for j in range(i + 2, len(text) + 1))
    merged = sorted(pieces - set(CHARS))
    ranks = [-float(i) for i in range(len(CHARS) + len(merged))]
    random.Random(seed).shuffle(ranks)
    tokens = CONTROL + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)] + CHARS + merged
    types = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * (len(CHARS) + len(merged))
    scores = [-1000.0] * (len(CONTROL) + len(USER_DEFINED)) + [0.0] * 256 + ranks
    return tokens, scores, types


def write_tiny_gemma3_gguf(hf_dir: Path, gguf_path: Path, seed: int = 0) -> Path:
    """The tiny Gemma 3 at ``hf_dir`` (tests/helpers/tiny_gemma.py, vocabulary size
    ``len(tiny_spm_vocab()[0])``) as a llama.cpp-style F32 GGUF with the tiny SentencePiece vocab."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    tokens, scores, types = tiny_spm_vocab(seed)
    if config["vocab_size"] != len(tokens):
        raise ValueError(f"build the model with vocab_size={len(tokens)}")
    writer = gguf.GGUFWriter(str(gguf_path), "gemma3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<bos>"))
    writer.add_eos_token_id(tokens.index("<eos>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_pad_token_id(tokens.index("<pad>"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config["num_hidden_layers"])
    for name, tensor in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        if name.endswith("norm.weight"):
            tensor = tensor + 1.0  # Gemma3RMSNorm scales by 1 + w; llama.cpp stores 1 + w
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(tensor.to(torch.float32).numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(gguf_path)
