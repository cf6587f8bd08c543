"""``KVCompConnector``: vLLM KV connector that coordinates compression between scheduler and worker.

Enable with one engine argument (see :func:`vllm_kvcomp.engine.plugin.kv_transfer_config`):
``kv_transfer_config={"kv_connector": "KVCompConnector", "kv_role": "kv_both"}``.
vLLM builds one instance per role: the scheduler role (engine core) delegates to
:class:`KVCompScheduler`, the worker role to :class:`KVCompWorker`. Nothing is transferred:
the connector only uses the hooks for metadata, confirmations and stats.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine import support
from vllm_kvcomp.engine.cache import AttentionVariant, CpuPagedCache, CudaPagedCache, PagedCache
from vllm_kvcomp.engine.memory import PluginMemory, shapes_of
from vllm_kvcomp.engine.metadata import StepMetadata, WorkerReport
from vllm_kvcomp.engine.metrics import KVCompPromMetrics, KVCompStats
from vllm_kvcomp.engine.offload import parse_lag
from vllm_kvcomp.engine.plugin import CONNECTOR_NAME, bind_worker
from vllm_kvcomp.engine.policy_factory import PolicyFactory
from vllm_kvcomp.engine.scheduler import KVCompScheduler
from vllm_kvcomp.engine.worker import KVCompWorker
from vllm_kvcomp.vllm_compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

logger = logging.getLogger(__name__)


def paged_cache(
    platform: str | None,
    layers: dict[str, Any],
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
) -> Callable[[list[torch.Tensor]], PagedCache]:
    """The worker's :class:`~vllm_kvcomp.engine.cache.PagedCache` class for this engine, after
    checking that every attention layer runs a kvcomp backend on a cache we can page.

    ``layers`` maps layer name -> vLLM ``Attention`` module. A layer on a backend we do not hook
    raises :class:`~vllm_kvcomp.engine.support.StartupError` (the engine does not start; the
    message names the flag); a platform or cache we cannot page raises ``NotImplementedError``
    with what to change (the engine serves uncompressed, saying why).
    """
    from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin

    if platform not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"vllm-kvcomp compresses KV on CPU and CUDA platforms only (this one: {platform or 'other'}); "
            "start vLLM without the KVCompConnector to serve uncompressed"
        )
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, KVCompAttentionMixin):
            raise support.StartupError(unhooked_backend(platform, name, vllm_compat.attention_backend_name(layer)))
        if getattr(layer, "sliding_window", None) is not None:
            raise NotImplementedError(
                f"layer {name} uses sliding-window attention, whose mask counts absolute slots; "
                "vllm-kvcomp compresses full-attention layers only"
            )
    for name, cache in kv_caches.items():
        if cache.dim() != 4 or cache.shape[2] != block_size:
            raise NotImplementedError(
                f"layer {name}: KV cache of shape {tuple(cache.shape)} does not hold {block_size}-token "
                "blocks as [num_blocks, heads, block_size, 2*head_size]; pass a --block-size the "
                "attention backend uses natively (e.g. 16)"
            )
    if platform == "cpu":
        isa = next((vllm_compat.cpu_attention_isa(layer) for layer in layers.values()), "vec")
        return functools.partial(CpuPagedCache, isa=isa)
    return CudaPagedCache


#: why vllm-kvcomp does not hook a backend vLLM may pick by itself (said when it refuses to start)
NOT_HOOKED = {
    "FLASHINFER": "vLLM's first choice on Blackwell; it plans its kernels on the host before vllm-kvcomp's hook "
                  "trims rows",
}


def unhooked_backend(platform: str, layer_name: str, backend: str) -> str:
    """Why the engine does not start when vLLM picked ``backend`` for a layer we compress."""
    why = f" ({NOT_HOOKED[backend]})" if backend in NOT_HOOKED else ""
    return (f"layer {layer_name} runs attention backend {backend}{why}, which vllm-kvcomp does not hook; "
            f"{support.backend_fix(platform)}, {support.UNCOMPRESSED}")


def attention_variants(layers: dict[str, Any], device: torch.device) -> dict[str, AttentionVariant]:
    """How each layer attends (:class:`~vllm_kvcomp.engine.cache.AttentionVariant`), as its vLLM
    kernel does; raises ``NotImplementedError`` naming what cannot be reproduced over packed pages
    (ALiBi biases count logical distances; a layer reading another layer's cache)."""
    variants = {}
    for name, layer in layers.items():
        attn = vllm_compat.layer_attention(layer)
        if attn.alibi_slopes is not None:
            raise NotImplementedError(f"layer {name} uses ALiBi position biases, which vllm-kvcomp does not "
                                      "apply over packed pages")
        if attn.kv_sharing_target is not None:
            raise NotImplementedError(f"layer {name} reads the KV cache of {attn.kv_sharing_target} "
                                      "(cross-layer KV sharing), which vllm-kvcomp does not compress")
        sinks = None if attn.sinks is None else attn.sinks.detach().to(device=device, dtype=torch.float32)
        variants[name] = AttentionVariant(attn.scale, attn.softcap, sinks)
    return variants


def output_projections(layers: dict[str, Any]) -> dict[str, torch.Tensor] | str:
    """Each layer's output-projection weight [hidden, H_q·D] on this rank (its ``o_proj``, read
    once from the loaded model: policies with ``NEEDS_OUT_PROJ`` read it), or why the model has
    none (those policies' requests are then served uncompressed, saying why; the others compress)."""
    try:
        return {name: vllm_compat.attention_output_weight(layer) for name, layer in layers.items()}
    except NotImplementedError as err:
        return str(err)


def compressible_group(kv_cache_config) -> tuple[int, list[str]] | None:
    """(index, layer names) of the one KV-cache group we compress: plain full attention. Sliding
    window, MLA, Mamba and other kinds of groups stay vLLM's; a model with no such group or with
    several is served uncompressed (None)."""
    if kv_cache_config is None:
        return None
    groups = [(i, list(g.layer_names)) for i, g in enumerate(kv_cache_config.kv_cache_groups)
              if vllm_compat.is_plain_full_attention(g.kv_cache_spec)]
    return groups[0] if len(groups) == 1 else None


def compressed_heads(kv_cache_config, vllm_config) -> int | None:
    """(layer, KV head) pairs one rank compresses: the compressible group's layers times its KV
    heads; None under tensor parallelism (a rank's share of retrieval heads differs)."""
    group = compressible_group(kv_cache_config)
    if group is None or vllm_config.parallel_config.tensor_parallel_size != 1:
        return None
    spec = kv_cache_config.kv_cache_groups[group[0]].kv_cache_spec
    return len(group[1]) * int(spec.num_kv_heads)


class KVCompConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        configured = getattr(vllm_config.kv_transfer_config, "kv_connector", None)
        if configured != CONNECTOR_NAME:
            raise ValueError(
                f"vllm-kvcomp's {CONNECTOR_NAME} must be the engine's only KV connector (kv_connector is "
                f"{configured!r}): it rewrites block tables and pages that another connector (MultiConnector, "
                "LMCache, NIXL, offloading) would read or transfer as full-cache blocks. Use it alone."
            )
        if (error := support.startup_error(vllm_config, vllm_compat.platform_kind())) is not None:
            raise support.StartupError(error)
        super().__init__(vllm_config, role, kv_cache_config)
        block_size = vllm_config.cache_config.block_size
        self.group = compressible_group(kv_cache_config)
        self.scheduler: KVCompScheduler | None = None
        self.worker: KVCompWorker | None = None
        unavailable = support.unavailable_reason(vllm_config) or (
            support.NO_FULL_ATTENTION_GROUP if self.group is None else None)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        factory = PolicyFactory(vllm_config.model_config.model, extra.get("profiles"))
        if role == KVConnectorRole.SCHEDULER:
            chunk = vllm_config.scheduler_config.max_num_batched_tokens
            self.scheduler = KVCompScheduler(block_size=block_size, chunk_tokens=chunk,
                                             group=None if self.group is None else self.group[0],
                                             unavailable=unavailable, policy_builder=factory.build,
                                             num_heads=compressed_heads(kv_cache_config, vllm_config),
                                             async_scheduling=bool(vllm_config.scheduler_config.async_scheduling))
            if unavailable is not None:
                logger.warning("vllm-kvcomp: requests are served uncompressed: %s", unavailable)
            else:
                self.scheduler.reserved_bytes = self.memory_bound().reserved
        else:
            self.worker = KVCompWorker(block_size=block_size, policy_builder=factory.build,
                                       ranks=vllm_compat.tensor_parallel_ranks())
            self.worker.configure_offload(parse_lag(extra.get("compression_lag"), vllm_compat.platform_kind()))
            if unavailable is not None:
                self.worker.disable(unavailable)
            bind_worker(self.worker)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Page the compressible group's caches; other groups' layers stay vLLM's untouched. What
        cannot be compressed exactly (backend, layout, attention variant) is served uncompressed,
        and every compressed request's result says why (the engine keeps serving)."""
        if self.worker.unavailable is not None:
            return
        names = [name for name in self.group[1] if name in kv_caches]
        caches = {name: kv_caches[name] for name in names}
        layers = vllm_compat.attention_layers(self._vllm_config, names)
        index = {name: vllm_compat.layer_index(name) for name in names}
        model_layers = max(vllm_compat.layer_index(name) for name in kv_caches) + 1
        try:
            cache_cls = paged_cache(vllm_compat.platform_kind(), layers, caches,
                                    self._vllm_config.cache_config.block_size)
            variants = attention_variants(layers, next(iter(caches.values())).device)
            self.worker.register(caches, index, cache_cls, variants, model_layers, output_projections(layers))
        except NotImplementedError as err:
            self.worker.disable(str(err))
            return
        where = "taken from the KV budget" if vllm_compat.platform_kind() == "cuda" else "beside the KV space"
        logger.info("vllm-kvcomp: memory outside the KV pool bounded at %s, %s", self.memory_bound().describe(), where)

    def memory_bound(self) -> PluginMemory:
        """What a worker of this engine holds outside the KV pool at most (:mod:`~vllm_kvcomp.engine.memory`)."""
        return PluginMemory.bound(shapes_of(self._vllm_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """LBHNC: each (layer, block, head) page is one contiguous run of cells (the CPU backend
        uses it anyway; FlashAttention and Triton take any layout)."""
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: compressed rows are attended in the backend's Python ``forward``, which a full
        CUDA graph replay skips; PIECEWISE graphs run attention eagerly between pieces."""
        return True

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, StepMetadata):
            self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.clear_step()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Model Runner V2 passes the batch's request ids in row order here, before the forward
        (the scheduler half sets ``has_sync_kv_loads`` for steps with tracked requests); the V1
        runner reports them through :func:`vllm_compat.report_batch_order`."""
        if self.worker is not None and "request_ids" in kwargs:
            self.worker.set_batch(kwargs["request_ids"], kwargs["scheduler_output"].num_scheduled_tokens)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_step()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self.worker.take_report() if self.worker is not None else None

    # ------------------------------------------------------------------ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        self.scheduler.on_worker_report(report if isinstance(report, WorkerReport) else None)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self.scheduler.on_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def get_kv_connector_stats(self) -> KVCompStats | None:
        if self.scheduler is None:
            return None
        return KVCompStats(data=self.scheduler.take_stats())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCompStats | None:
        return KVCompStats(data=data) if data is not None else KVCompStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVCompPromMetrics:
        return KVCompPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
