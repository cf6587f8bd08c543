"""Why an engine cannot compress, told from its config alone (the API server and the engine core
both ask, so a client is never told that compression happened when it could not).

The engine core also learns reasons only it can see (no single full-attention KV-cache group, an
attention backend or variant it cannot reproduce over packed pages); those reach clients through
each request's result (``usage.kv_compression.reason``).
"""

from __future__ import annotations

from typing import Any

#: speculative methods that verify drafts on the target model alone (no draft model, no draft KV):
#: a compressed request's step then has several query tokens over its packed pages, and the
#: rejected ones are rolled back (see :mod:`~vllm_kvcomp.engine.lifecycle`)
TARGET_ONLY_SPECULATION = ("ngram", "suffix")


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
