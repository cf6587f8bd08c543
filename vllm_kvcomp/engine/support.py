"""Why an engine cannot compress, told from its config alone (the API server and the engine core
both ask, so a client is never told that compression happened when it could not).

The engine core also learns reasons only it can see (no single full-attention KV-cache group, an
attention backend or variant it cannot reproduce over packed pages); those reach clients through
each request's result (``usage.kv_compression.reason``).
"""

from __future__ import annotations

from typing import Any


def unavailable_reason(vllm_config: Any) -> str | None:
    """The reason compression cannot run on this engine, or None."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        return ("speculative decoding (--speculative-config) is on; vllm-kvcomp does not yet verify draft "
                "tokens over packed pages, so requests are served uncompressed")
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
