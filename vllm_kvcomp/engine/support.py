"""Why an engine cannot compress, told from its config alone, in two kinds.

- :func:`startup_error`: a setting under which attention would run where vllm-kvcomp's per-step
  hook cannot see it or reproduce it (an attention backend it does not hook, full CUDA graphs,
  attention-output quantisation fused into attention, micro-batching, context parallelism). Each
  has a flag that fixes it, and an operator who enabled the connector expects compression: the
  engine refuses to start (:class:`StartupError`, naming the flag) rather than serve every
  request uncompressed. ``vllm-kvcomp serve`` refuses the flags it parses before vLLM starts.
- :func:`unavailable_reason`: the model (MLA, sliding-window layers only) or a serving feature
  vllm-kvcomp composes with by not compressing (speculative decoding with a draft model). The
  engine serves; the API server and the engine core both ask, so a client is never told that
  compression happened when it could not.

The engine core also learns reasons only it can see (no single full-attention KV-cache group, an
attention variant it cannot reproduce over packed pages); those reach clients through each
request's result (``usage.kv_compression.reason``).
"""

from __future__ import annotations

from typing import Any

import vllm_kvcomp.vllm_compat as vllm_compat  # not `from vllm_kvcomp import`: the package imports plugin, which imports us

#: speculative methods that verify drafts on the target model alone (no draft model, no draft KV):
#: a compressed request's step then has several query tokens over its packed pages, and the
#: rejected ones are rolled back (see :mod:`~vllm_kvcomp.engine.lifecycle`)
TARGET_ONLY_SPECULATION = ("ngram", "suffix")


def backend_overrides(platform: str | None) -> dict[str, str]:
    """vLLM backend name -> our subclass (import path, loaded lazily by vLLM) on ``platform``."""
    prefix = "vllm_kvcomp.engine.backends"
    if platform == "cpu":
        return {"CPU_ATTN": f"{prefix}.cpu.KVCompCPUAttentionBackend"}
    if platform == "cuda":
        return {
            "FLASH_ATTN": f"{prefix}.flash_attn.KVCompFlashAttentionBackend",
            "TRITON_ATTN": f"{prefix}.triton_attn.KVCompTritonAttentionBackend",
        }
    return {}


def unavailable_reason(vllm_config: Any) -> str | None:
    """The reason compression cannot run on this engine, or None."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        method = getattr(speculative, "method", None)
        if method not in TARGET_ONLY_SPECULATION:
            return (f"speculative decoding with method {method!r} runs a draft model over the request's KV "
                    f"blocks, which vllm-kvcomp does not compress; compressed requests work with "
                    f"{' or '.join(repr(m) for m in TARGET_ONLY_SPECULATION)} speculation (no draft model)")
        if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
            return (f"{method!r} speculative decoding with --async-scheduling: the scheduler plans a step before "
                    f"it knows which draft tokens were rejected; vllm-kvcomp compresses speculative requests "
                    f"with synchronous scheduling only")
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return None
    if getattr(model, "use_mla", False):
        return "the model uses multi-head latent attention (MLA), which vllm-kvcomp does not compress yet"
    layer_types = getattr(getattr(model, "hf_text_config", None), "layer_types", None)
    if layer_types and "full_attention" not in layer_types:
        return ("every layer of the model uses sliding-window attention (its own KV recycling); vllm-kvcomp "
                "compresses full-attention layers only")
    return None


NO_FULL_ATTENTION_GROUP = ("the model has no single full-attention KV-cache group (MLA, sliding-window or "
                           "attention-free layers only); vllm-kvcomp compresses plain full attention")


class StartupError(ValueError):
    """An engine setting vllm-kvcomp cannot run under, raised while the engine starts (it never
    serves); the message names the flag that fixes it."""


#: the KV-cache-group kind vllm-kvcomp compresses (a key of ``--attention-config.backend_per_kind``)
FULL_ATTENTION_KIND = "full_attention"
UNCOMPRESSED = "or drop the KVCompConnector to serve uncompressed"


def startup_error(vllm_config: Any, platform: str | None) -> str | None:
    """What in this engine's resolved config vllm-kvcomp would get wrong, with the flag that
    fixes it, or None (``platform``: ``vllm_compat.platform_kind()``)."""
    attention = vllm_config.attention_config
    compilation = vllm_config.compilation_config
    return (forced_backend_error(platform, attention.backend, attention.backend_per_kind)
            or output_fusion_error(compilation.pass_config) or graph_error(compilation)
            or parallel_error(vllm_config.parallel_config))


def backend_fix(platform: str | None) -> str:
    """The ``--attention-backend`` to pass on ``platform``: vllm-kvcomp's hooked backends, best first."""
    first, *others = backend_overrides(platform)
    also = "".join(f" ({name} if vLLM rejects {first} for this model or GPU)" for name in others)
    return f"pass --attention-backend {first}{also}"


def forced_backend_error(platform: str | None, backend: Any, per_kind: dict[str, Any] | None) -> str | None:
    """An attention backend forced for full-attention layers (``--attention-backend``, or
    ``--attention-config.backend_per_kind`` for ``full_attention``) that vllm-kvcomp does not hook.
    MLA backends (vLLM names each ``*MLA*``) run MLA models, which are served uncompressed
    (:func:`unavailable_reason`), so they are not refused."""
    hooked = list(backend_overrides(platform))
    chosen = (per_kind or {}).get(FULL_ATTENTION_KIND)
    name = _backend_name(chosen if chosen is not None else backend)
    if not hooked or name is None or name in hooked or "MLA" in name:
        return None
    if chosen is None:
        flag, fix = "--attention-backend", backend_fix(platform)
    else:
        flag = f"--attention-config.backend_per_kind {FULL_ATTENTION_KIND}"
        fix = f"map {FULL_ATTENTION_KIND} to {hooked[0]} in --attention-config.backend_per_kind or leave it out"
    return f"{flag} {name}: vllm-kvcomp compresses only with {' or '.join(hooked)}; {fix}, {UNCOMPRESSED}"


def _backend_name(backend: Any) -> str | None:
    """``FLASHINFER`` for vLLM's enum member or a flag's spelling (``flashinfer``); None for automatic."""
    name = getattr(backend, "name", backend)
    return None if name is None or str(name).lower() == "auto" else str(name).upper()


def output_fusion_error(pass_config: Any) -> str | None:
    """vLLM's attention + output-quantisation fusion: the backend writes the quantised input of the
    next layer (``output_scale``), inside full CUDA graphs."""
    if not pass_config.fuse_attn_quant:
        return None
    return ("-cc.pass_config.fuse_attn_quant=true fuses attention's output quantisation into the attention kernel "
            "(output_scale) and captures attention in full CUDA graphs, while vllm-kvcomp writes compressed rows "
            f"unquantised, outside the graphs; pass -cc.pass_config.fuse_attn_quant=false, {UNCOMPRESSED}")


def graph_error(compilation: Any) -> str | None:
    """CUDA graphs that capture attention: a replay skips vllm-kvcomp's per-step hook. The
    connector asks vLLM for PIECEWISE graphs (attention eager between pieces), and vLLM lowers
    any FULL mode to PIECEWISE for it; what the resolved config still captures is refused."""
    mode = compilation.cudagraph_mode
    if mode.has_full_cudagraphs():
        return (f"CUDA graph mode {mode.name} replays attention without running vllm-kvcomp's per-step hook; pass "
                f"-cc.cudagraph_mode=PIECEWISE or --enforce-eager, {UNCOMPRESSED}")
    if mode.has_piecewise_cudagraphs() and not vllm_compat.attention_runs_between_graph_pieces(
            compilation.splitting_ops):
        return (f"-cc.splitting_ops leaves vLLM's attention op {vllm_compat.ATTENTION_OP} inside captured graph "
                "pieces, whose replays skip vllm-kvcomp's per-step hook; leave -cc.splitting_ops unset (vLLM splits "
                f"at attention) or pass --enforce-eager, {UNCOMPRESSED}")
    return None


def parallel_error(parallel: Any) -> str | None:
    """Micro-batching and context parallelism, from a ``ParallelConfig`` or serve's parsed flags
    (the same field names)."""
    if parallel.enable_dbo or parallel.ubatch_size > 1:
        flag = "--enable-dbo" if parallel.enable_dbo else f"--ubatch-size {parallel.ubatch_size}"
        return (f"{flag} splits each step into micro-batches attended separately, each with its own metadata, "
                f"while vllm-kvcomp plans and attends a step's compressed rows as one batch; leave it off, "
                f"{UNCOMPRESSED}")
    for size, flag in ((parallel.decode_context_parallel_size, "--decode-context-parallel-size"),
                       (parallel.prefill_context_parallel_size, "--prefill-context-parallel-size")):
        if size > 1:
            return (f"{flag} {size} splits each request's tokens across ranks, while vllm-kvcomp scores, evicts and "
                    f"attends a request's KV as one sequence on every rank; pass {flag} 1, {UNCOMPRESSED}")
    return None
