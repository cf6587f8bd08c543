"""Registration with vLLM (called by the ``vllm.general_plugins`` entry point, idempotent).

- Attention backends: our subclasses are registered under vLLM's own names (``CPU_ATTN`` on CPU;
  ``FLASH_ATTN`` and ``TRITON_ATTN`` on CUDA), so vLLM's own choice selects them. Each behaves
  exactly like its parent unless the kvcomp connector is active. An engine whose full-attention
  layers get another backend (FLASHINFER, vLLM's first choice on Blackwell; FLEX_ATTENTION, ...)
  does not start, the error naming ``--attention-backend`` (:mod:`~vllm_kvcomp.engine.support`);
  MLA models are served uncompressed.
- KV connector: registered as ``KVCompConnector``; enabling compression is the one engine
  argument ``kv_transfer_config=kv_transfer_config()``. vLLM's MultiConnector refuses to compose it
  with another connector (:data:`COMPOSED`).
- Attention owners: which module holds each vLLM ``Attention`` layer, recorded as models are
  built, so the worker can read each layer's output projection (``criticalkv``).
- Batch order: the V1 model runner tells the worker its request ids in row order before each
  forward (Model Runner V2 passes them to the connector), so the worker never reads which rows
  are its requests' from device tensors.
"""

from __future__ import annotations

from typing import Any

import vllm_kvcomp.vllm_compat as vllm_compat  # not `from vllm_kvcomp import`: the package imports us
from vllm_kvcomp.engine import support

CONNECTOR_NAME = "KVCompConnector"
CONNECTOR_MODULE = "vllm_kvcomp.engine.connector"
#: why a MultiConnector that includes ours does not start
COMPOSED = (f"vllm-kvcomp's {CONNECTOR_NAME} cannot be a child of vLLM's MultiConnector: it repacks each request's "
            "pages and rewrites its block tables, which another connector (LMCache, NIXL, offloading) would read or "
            f"transfer as full-cache blocks. Use {CONNECTOR_NAME} alone (kv_transfer_config="
            "vllm_kvcomp.engine.plugin.kv_transfer_config(), or `vllm-kvcomp serve`).")


def register_with_vllm() -> None:
    vllm_compat.register_connector_once(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    for name, path in support.backend_overrides(vllm_compat.platform_kind()).items():
        vllm_compat.register_attention_backend(name, path)
    vllm_compat.allow_max_model_len_beyond_kv_cache(long_prompts_allowed)
    vllm_compat.refuse_composition(CONNECTOR_NAME, COMPOSED)
    vllm_compat.track_attention_owners(uses_kvcomp)  # before any model is built: the worker reads o_proj
    vllm_compat.report_batch_order(tell_worker_the_batch)
    vllm_compat.reserve_outside_kv_cache(reserved_bytes)


def reserved_bytes(vllm_config: Any) -> int:
    """What a GPU worker of this engine takes from vLLM's KV budget for kvcomp:
    :class:`~vllm_kvcomp.engine.memory.PluginMemory`'s reservation; 0 without the kvcomp
    connector, or where its config already says the engine cannot compress (MLA, draft models)."""
    if not uses_kvcomp(vllm_config) or support.unavailable_reason(vllm_config) is not None:
        return 0
    from vllm_kvcomp.engine.memory import PluginMemory, shapes_of

    return PluginMemory.bound(shapes_of(vllm_config)).reserved


def tell_worker_the_batch(req_ids: list[str], num_scheduled: Any) -> None:
    """The V1 model runner's batch, before its forward (see :func:`vllm_compat.report_batch_order`)."""
    worker = active_worker()
    if worker is not None:
        worker.set_batch(req_ids, num_scheduled)


def uses_kvcomp(vllm_config: Any) -> bool:
    """Whether this engine's KV connector is the kvcomp connector."""
    return getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector", None) == CONNECTOR_NAME


def long_prompts_allowed(vllm_config: Any) -> bool:
    """Whether this engine's kvcomp connector was started with ``long_prompts`` (the opt-in of
    ``--allow-prompts-beyond-kv-cache``, see :func:`kv_transfer_config`)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    return getattr(transfer, "kv_connector", None) == CONNECTOR_NAME and bool(extra.get("long_prompts"))


def kv_transfer_config(profiles: dict[str, str] | None = None, long_prompts: bool = False,
                       compression_lag: int | str | None = None, max_window: int | None = None) -> dict[str, Any]:
    """The engine argument that turns kvcomp on (pass as ``kv_transfer_config=``).

    ``profiles`` maps a calibration kind (``razor``, ``pod``) to the profile the engine serves
    for it: a name in ``<model>/kvcomp_profiles/`` or a path to a profile JSON file.
    ``long_prompts`` lets ``max_model_len`` exceed the KV cache: only requests compressing during
    prefill (``prefill=stream``) can then use prompts longer than the cache holds.
    ``compression_lag`` says when a compression decided off the step is packed
    (:mod:`~vllm_kvcomp.engine.offload`; default ``"auto"``: as soon as it is decided; 0: decided
    and packed inside the step). ``max_window``: the widest query window a request may ask for
    (the operator config's ``bounds.max_window``), what the memory reserved at start-up is
    computed for (:mod:`~vllm_kvcomp.engine.memory`).
    """
    config: dict[str, Any] = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"}
    extra: dict[str, Any] = {}
    if profiles:
        extra["profiles"] = dict(profiles)
    if long_prompts:
        extra["long_prompts"] = True
    if compression_lag is not None:
        extra["compression_lag"] = compression_lag
    if max_window is not None:
        extra["max_window"] = max_window
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


_worker: Any = None  # the worker half this process's kvcomp connector built (see bind_worker)


def bind_worker(worker: Any) -> None:
    """Called by the connector's worker half when it is built: the backends attend through it."""
    global _worker
    _worker = worker


def active_worker():
    """The worker half of the kvcomp connector in this process, or None when KV transfer is off
    (an engine built later in the same process without the connector never sees a stale one)."""
    return _worker if _worker is not None and vllm_compat.active_connector() is not None else None
