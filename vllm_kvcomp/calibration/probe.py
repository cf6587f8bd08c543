"""Attention-probability providers: the one seam between calibration and a model.

A provider runs one sequence through a model and reports every layer's attention
probabilities, one layer at a time (so the full [L, H, T, T] tensor never exists):

    provider(input_ids [T] int64, on_layer(layer: int, probs [H_q, T, T] float32)) -> None

and, when asked (``on_cache``), each layer's cache as the model wrote it: post-RoPE keys and
values [H_kv, T, D]. :func:`hf_provider` builds one for a Hugging Face causal LM by registering an eager attention
function with ``transformers.AttentionInterface``; tests pass hand-made providers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

OnLayer = Callable[[int, torch.Tensor], None]
OnCache = Callable[[int, torch.Tensor, torch.Tensor], None]
AttentionProvider = Callable[..., None]  # (input_ids, on_layer, on_cache=None)

PROBE_NAME = "kvcomp_probe"
_ON_LAYER: ContextVar[OnLayer | None] = ContextVar("kvcomp_probe_on_layer", default=None)
_ON_CACHE: ContextVar[OnCache | None] = ContextVar("kvcomp_probe_on_cache", default=None)


def _probe_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (transformers' own) that hands the probabilities to the active callback."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    out, probs = eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs)
    on_cache = _ON_CACHE.get()
    if on_cache is not None:  # before the probabilities: a consumer may pair them with the cache
        on_cache(int(module.layer_idx), key[0].float(), value[0].float())
    on_layer = _ON_LAYER.get()
    if on_layer is not None:
        on_layer(int(module.layer_idx), probs[0].float())
    return out, probs


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextmanager
def hf_provider(model: Any) -> Iterator[AttentionProvider]:
    """Context in which ``model`` (an HF causal LM, batch 1) runs with the probing attention.

    Restores the model's attention implementation on exit.
    """
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(PROBE_NAME)

    def provider(input_ids: torch.Tensor, on_layer: OnLayer, on_cache: OnCache | None = None) -> None:
        token, cache_token = _ON_LAYER.set(on_layer), _ON_CACHE.set(on_cache)
        try:
            with torch.no_grad():
                model(input_ids.view(1, -1).to(model.device), use_cache=False)
        finally:
            _ON_LAYER.reset(token)
            _ON_CACHE.reset(cache_token)

    try:
        yield provider
    finally:
        model.set_attn_implementation(previous)


def load_hf_model(model_dir: str, threads: int | None = None) -> Any:
    """Load an HF causal LM from a local folder in float32 on CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
