"""Every use of a private or unstable vLLM name, in one place, with its ledger.

vllm-kvcomp edits no vLLM file. What it needs beyond vLLM's documented plugin surface (the
``vllm.general_plugins`` entry point, ``LLM``/``SamplingParams``, the server's ``--middleware``)
is reached only through this module: classes it subclasses or reads are re-exported lazily
(``from vllm_kvcomp.vllm_compat import KVConnectorBase_V1``), attribute pokes are functions
here. :data:`LEDGER` says for each name why we need it, the vLLM versions it was checked on and
what breaks if it moves; ``tests/test_architecture.py`` resolves every entry against the
installed vLLM, so an upgrade that renames one fails in that one test.

Nothing in this module imports vLLM at import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHECKED = "0.32.0"  # vLLM versions every entry was checked on (CPU build; CUDA modules by import)


@dataclass(frozen=True)
class Use:
    """One ledgered name: ``symbol`` is ``module:attr.path`` (``module`` alone for a module)."""

    symbol: str
    why: str
    breaks: str
    checked: str = CHECKED
    param: str | None = None  # an instance attribute we set: a parameter of the callable ``symbol``
    #: instance attributes of the class ``symbol`` we read or write (only through this module)
    attrs: tuple[str, ...] = ()

    def resolve(self) -> Any:
        module, _, path = self.symbol.partition(":")
        obj = importlib.import_module(module)
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
        return obj

    def check(self) -> str | None:
        """None if the name exists on the installed vLLM, else why not."""
        try:
            obj = self.resolve()
        except (ImportError, AttributeError) as err:
            return f"{type(err).__name__}: {err}"
        import inspect

        if self.param is not None and self.param not in inspect.signature(obj).parameters:
            return f"{self.symbol} takes no parameter {self.param!r}"
        missing = [a for a in self.attrs if not _has_attribute(obj, a)]
        return f"{self.symbol} sets no attribute {', '.join(missing)}" if missing else None


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` carry ``name``: a dataclass field, a property, or an
    assignment ``self.name = ...`` in the class body."""
    import inspect
    import re

    if name in getattr(cls, "__dataclass_fields__", {}) or isinstance(getattr(cls, name, None), property):
        return True
    return re.search(rf"self\.{name}\b\s*[:=]", inspect.getsource(cls)) is not None


_KV = "vllm.distributed.kv_transfer.kv_connector"
LEDGER: tuple[Use, ...] = (
    # ---------------------------------------------------------------- KV connector interface
    Use(f"{_KV}.v1.base:KVConnectorBase_V1", "the connector's base class (scheduler + worker hooks)",
        "the engine cannot enable compression at all"),
    Use(f"{_KV}.v1.base:KVConnectorMetadata", "per-step scheduler -> worker message base",
        "no step metadata reaches the worker"),
    Use(f"{_KV}.v1.base:KVConnectorWorkerMetadata", "worker -> scheduler report base (aggregated over ranks)",
        "blocks are never freed (no confirmation)"),
    Use(f"{_KV}.v1.base:KVConnectorRole", "which half of the connector vLLM builds", "connector construction"),
    Use(f"{_KV}.v1.base:SupportsHMA", "declares hybrid-allocator support (else vLLM disables it)",
        "hybrid models lose vLLM's hybrid KV-cache manager"),
    Use(f"{_KV}.v1.metrics:KVConnectorStats", "scheduler stats carried to the API server's Prometheus logger",
        "no vllm:kvcomp_* series"),
    Use(f"{_KV}.v1.metrics:KVConnectorPromMetrics", "base of the vllm:kvcomp_* Prometheus series",
        "no vllm:kvcomp_* series"),
    Use(f"{_KV}.factory:KVConnectorFactory._registry", "make registration idempotent (register_connector "
        "raises on a second call in the same process)", "registering twice raises at start-up"),
    Use("vllm.distributed.kv_transfer:get_kv_transfer_group", "the worker's connector from inside a backend",
        "compressed rows are attended over their stale full context"),
    Use("vllm.distributed.kv_transfer:has_kv_transfer_group", "same", "same"),
    Use("vllm.distributed.parallel_state:get_tp_group", "policies that rank across heads gather every "
        "tensor-parallel rank's heads (its world_size, rank_in_group, cpu_group)", "TP>1 results differ from TP=1"),
    # ---------------------------------------------------------------- attention backends
    Use("vllm.v1.attention.backends.registry:register_backend", "put our backend subclasses under vLLM's names",
        "our per-step hook never runs"),
    Use("vllm.v1.attention.backends.registry:AttentionBackendEnum", "names of the overridden backends", "same"),
    Use("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend", "parent of the CPU backend subclass", "CPU path"),
    Use("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl", "parent of the CPU impl", "CPU path"),
    Use("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata", "trimmed copies of the CPU metadata",
        "CPU path"),
    Use("vllm._custom_ops:cpu_attn_get_scheduler_metadata", "rebuild the CPU kernel's schedule for trimmed rows",
        "CPU decode of compressed rows"),
    Use("vllm._custom_ops:cpu_attention_with_kv_cache", "vLLM's CPU paged attention kernel, called on the "
        "packed per-head pages (one sequence per (request, KV head))", "CPU decode of compressed rows"),
    Use("vllm.envs:VLLM_CPU_ATTN_SPLIT_KV", "same schedule flags as vLLM's own builder", "CPU schedule"),
    Use("vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "parent of the CUDA FA subclass", "GPU path"),
    Use("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl", "parent of the CUDA FA impl", "GPU path"),
    Use("vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata", "trimmed copies of FA metadata",
        "GPU path"),
    Use("vllm.v1.attention.backends.triton_attn:TritonAttentionBackend", "parent of the CUDA Triton subclass",
        "GPU path"),
    Use("vllm.v1.attention.backends.triton_attn:TritonAttentionImpl", "parent of the CUDA Triton impl",
        "GPU path"),
    Use("vllm.v1.attention.backends.triton_attn:TritonAttentionMetadata", "trimmed copies of Triton metadata",
        "GPU path"),
    # ---------------------------------------------------------------- block tables (engine/blocks.py's rules)
    Use("vllm.v1.core.kv_cache_manager:KVCacheManager", "the scheduler's cache manager: its pool, its groups' "
        "managers, whether prefix caching is on", "copy-on-compress, freeing and admission",
        attrs=("block_pool", "coordinator", "enable_caching", "empty_kv_cache_blocks")),
    Use("vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks", "a capped prefix-cache hit",
        "compressed requests read the whole cached prefix"),
    Use("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", "one manager per KV-cache group",
        "every block-table rule", attrs=("single_type_managers",)),
    Use("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager", "a request's live block list "
        "(edited in place to install packed blocks), the hashed-block count we stop, the group's block size and "
        "sliding window", "copy-on-compress and admission by a bounded peak",
        attrs=("req_to_blocks", "num_cached_block", "block_size", "kv_cache_spec")),
    Use("vllm.v1.core.block_pool:BlockPool", "the pool: size, free count, the null block freed columns point to",
        "freeing, spares, admission", attrs=("null_block", "num_gpu_blocks", "hash_block_size")),
    Use("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", "spares and admission only when they fit",
        "same"),
    Use("vllm.v1.core.kv_cache_utils:KVCacheBlock", "a block's id, how many requests hold it (a shared prompt "
        "block is never written), whether it is the null block", "copy-on-compress could write a shared block",
        attrs=("block_id", "ref_cnt", "is_null")),
    # ---------------------------------------------------------------- engine internals we read or poke
    Use("vllm.config:get_layers_from_vllm_config", "the attention layers behind registered caches",
        "engine checks at start-up"),
    Use("vllm.model_executor.layers.attention:Attention", "same", "same"),
    Use("vllm.v1.kv_cache_interface:FullAttentionSpec", "find the KV-cache group of plain full attention in "
        "hybrid models (sliding-window groups stay vLLM's)", "hybrid models are served uncompressed"),
    Use("vllm.model_executor.models.utils:extract_layer_index", "layer order of the registered caches",
        "per-layer state is mis-ordered"),
    Use("vllm.model_executor.layers.attention:Attention", "criticalkv reads the output projection of the "
        "block holding each Attention layer, recorded as the model is built (torch's public module-registration "
        "hook: no vLLM hook gives a KV connector the model; goes away when one does): the layer's per-rank query "
        "heads and head size (num_heads, head_size, read only here) check the weight's split",
        "criticalkv requests are served uncompressed (the reason says so)"),
    Use("vllm.model_executor.models.llama:LlamaAttention", "the attention block's output projection is its "
        "``o_proj`` (Llama, Qwen, Mistral, Gemma, gpt-oss... name it so); goes away with the hook above",
        "criticalkv requests are served uncompressed (the reason says so)"),
    Use("vllm.model_executor.layers.linear:RowParallelLinear", "o_proj's weight [hidden, input_size_per_partition]"
        " holds this rank's query heads' columns (split by input, contiguous like the rank's heads)",
        "criticalkv under tensor parallelism would pair heads with another rank's W_o (checked: served "
        "uncompressed instead)", attrs=("input_size_per_partition",)),
    Use("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "on CPU vLLM packs every linear weight "
        "for oneDNN and replaces it by an empty one (remove_weight=True); we keep the loaded o_proj weights of "
        "kvcomp engines (one [hidden, H_q·D] matrix per layer stays allocated); goes away if vLLM keeps the "
        "weight or hands connectors the model", "criticalkv on CPU is served uncompressed (no weight to read)",
        param="remove_weight"),
    Use("vllm.config:get_current_vllm_config_or_none", "the config of the model being built: only kvcomp "
        "engines' attention blocks are tracked", "criticalkv requests are served uncompressed"),
    Use("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager._remove_blocks_in_range",
        "free blocks of a running request, as the sliding-window managers do; no public API frees part "
        "of a request", "compressed requests keep all their blocks (no memory saved)"),
    Use("vllm.v1.core.kv_cache_manager:KVCacheManager.get_block_ids", "a request's positional block ids",
        "the worker cannot locate a request's pages"),
    Use("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", "PATCH (per scheduler instance): a "
        "request compressing during prefill is admitted by its bounded peak, not its whole prompt "
        "(`full_sequence_must_fit` would hold it back until the full prompt fits)", "prefill=stream requests wait "
        "for room for their whole prompt"),
    Use("vllm.v1.core.kv_cache_utils:_check_enough_kv_cache_memory", "PATCH (installed at plugin load, "
        "effective only for an engine started with --allow-prompts-beyond-kv-cache, read from the config its "
        "caller get_kv_cache_configs passes in the get_needed_memory partial): vLLM refuses to start when one "
        "max_model_len sequence does not fit the KV cache; prefill=stream requests hold a bounded part of theirs",
        "the opt-in flag has no effect (vLLM refuses max_model_len beyond the KV cache)"),
    Use(f"{_KV}.v1.multi_connector:MultiConnector._get_connector_classes_and_configs", "PATCH (installed at "
        "plugin load): vLLM's MultiConnector builds each child with a copy of the config naming only that child, "
        "so our connector cannot see it is composed; the wrapper refuses a composition that includes it (before "
        "any connector is built, and when vLLM asks for the KV-cache layout)", "a MultiConnector composing "
        "us with LMCache / NIXL / offloading starts, and they read or move blocks whose pages we repack"),
    Use("vllm.v1.request:Request.__init__", "abort_immediately: abort a request that can never fit the KV "
        "cache as it arrives (vLLM would keep it waiting forever)", "such a request waits forever",
        param="abort_immediately"),
    Use("vllm.v1.request:Request.update_block_hashes", "re-hash a request after salting it out of the "
        "prefix cache (its blocks are rewritten in place)", "compressed blocks could be served as cache hits"),
    Use("vllm.v1.request:Request.get_skip_reading_prefix_cache", "the attribute we override for compressed "
        "requests is set from it", "compressed requests read the prefix cache"),
    Use("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks", "PATCH (per scheduler instance): "
        "a compressed request's prefix-cache hit stops before its observation window (the policy needs those "
        "queries computed)", "a warm compressed request scores with fewer window queries than a cold one"),
    Use("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.cache_blocks", "it hashes blocks "
        "from ``num_cached_block[req_id]`` on, which we set past any length once a compressed request's prompt "
        "is cached: its later blocks (decode tokens attended over the compressed cache, packed pages) are never "
        "hashed", "blocks whose contents differ from their tokens' full-cache KV could be served as prefix-cache "
        "hits"),
    Use("vllm.v1.core.block_pool:BlockPool.get_new_blocks", "private blocks a compressed request packs its "
        "kept pages into (copy-on-compress), instead of writing into cached prompt blocks",
        "compressed requests cannot share the prefix cache"),
    Use("vllm.v1.core.block_pool:BlockPool.free_blocks", "same (spares not used, old blocks replaced)", "same"),
    Use("vllm.v1.core.block_pool:BlockPool.__init__", "``hash_block_size``: copy-on-compress needs hashes "
        "per whole block (no partial-tail caching)", "same", param="hash_block_size"),
    Use("vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block", "copy-on-compress without spares (a "
        "full pool): the request's own unshared prompt blocks leave the prefix cache before it packs into them",
        "such requests wait for spares instead"),
    Use("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.__init__", "what a layer's attention "
        "computes beyond softmax(scale·qk), read from its impl (``logits_soft_cap``, ``sinks``, "
        "``alibi_slopes``): compressed rows are attended the same way", "Gemma 2 / gpt-oss compressed rows "
        "ignore soft-capping or sinks (silently wrong)", param="logits_soft_cap"),
    Use("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.__init__", "same, on CUDA", "same",
        param="sinks"),
    Use("vllm.model_executor.layers.attention:Attention.__init__", "``kv_sharing_target_layer_name``: a layer "
        "reading another layer's cache cannot be compressed on its own", "cross-layer KV sharing would read "
        "another layer's packed pages", param="kv_sharing_target_layer_name"),
    Use("vllm.v1.attention.backends.cpu_attn:_get_attn_isa", "the CPU cache's in-block layout (the builder "
        "stores it on each layer as ``layer.isa``)", "CPU reads/writes of kept tokens use the wrong layout"),
    Use("vllm.model_executor.layers.attention:Attention", "the backend vLLM selected for a layer (``attn_backend``, "
        "read only here), named when vllm-kvcomp refuses to start on one it does not hook", "the start-up refusal "
        "names the impl class instead of vLLM's backend name", attrs=("attn_backend",)),
    Use("vllm.model_executor.layers.attention.attention:unified_attention_with_output", "the custom op our "
        "backends' ``forward`` runs in (:data:`ATTENTION_OP`): PIECEWISE CUDA graphs run it eagerly only when it "
        "is one of the compilation's ``splitting_ops``", "an engine capturing attention inside a graph piece "
        "starts, and its compressed rows replay what the capture recorded (silently wrong)"),
    Use("vllm.envs:VLLM_USE_BREAKABLE_CUDAGRAPH", "breakable CUDA graphs run that op eagerly whatever the "
        "splitting ops (vLLM sets it for some architectures)", "engines on breakable graphs are refused at start-up"),
    # ---------------------------------------------------------------- API server
    Use("vllm.entrypoints.launchers.cli_args:make_arg_parser", "`vllm-kvcomp serve` parses exactly like "
        "`vllm serve`", "the serve CLI"),
    Use("vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args", "same", "same"),
    Use("vllm.utils.argparse_utils:FlexibleArgumentParser", "same", "same"),
    Use("vllm.entrypoints.cli.serve:ServeSubcommand.cmd", "run vLLM's server in-process", "the serve CLI"),
    Use("vllm.entrypoints.serve.utils.api_utils:cli_env_setup", "same environment set-up as `vllm serve`",
        "the serve CLI"),
    Use("vllm.logger:configure_logging_from_args", "same logging set-up as `vllm serve`", "the serve CLI"),
    Use("vllm.exceptions:VLLMValidationError", "refuse a prompt the KV cache cannot hold (HTTP 400)",
        "such prompts are refused with HTTP 500 instead of 400"),
    Use("vllm.engine.protocol:EngineClient.generate", "PATCH: wrapped per API-server instance (ResultTap): "
        "vLLM drops kv_transfer_params from streamed responses and from every prompt after the first of a "
        "completion batch; remove when streams carry them", "usage.kv_compression is missing in streams"),
    Use("vllm.v1.worker.gpu_worker:Worker.determine_available_memory", "PATCH (installed at plugin load): a GPU "
        "worker of an engine with the kvcomp connector leaves the memory kvcomp reserves outside the KV pool "
        "(engine/memory.py) out of the KV budget it reports, as vLLM leaves out its CUDA graphs' (not when "
        "kv_cache_memory_bytes sets the budget)", "kvcomp's temporaries are not budgeted: an out-of-memory error "
        "fails the compression (the request is served uncompressed) instead of being planned for"),
    Use("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs", "PATCH (installed at plugin load): the "
        "V1 model runner (vLLM's CPU runner; on CUDA where Model Runner V2 is off) reports its batch's request ids "
        "in row order before the forward, so the worker finds its rows without reading device tensors (Model "
        "Runner V2 passes them to start_load_kv)", "the worker raises: no batch order for a step",
        param="scheduler_output"),
    Use("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "the V1 runner's persistent batch", "the worker raises: "
        "no batch order for a step", attrs=("input_batch",)),
    Use("vllm.v1.worker.gpu_input_batch:InputBatch", "the V1 runner's request ids in row order (the first "
        "num_reqs; req_ids is a property)", "the worker raises: no batch order for a step", attrs=("num_reqs",)),
    Use("vllm.v1.worker.gpu.kv_connector:ActiveKVConnector._build_load_kwargs", "Model Runner V2 passes request_ids "
        "(row order) and scheduler_output to the connector's start_load_kv before the forward when the scheduler "
        "output has has_sync_kv_loads (our scheduler half sets it)", "the worker raises: no batch order for a step"),
)

#: names importable from this module (``from vllm_kvcomp.vllm_compat import X``), resolved on first use
LAZY: dict[str, str] = {
    use.symbol.rpartition(":")[2]: use.symbol
    for use in LEDGER
    if use.symbol.rpartition(":")[2][:1].isupper() and "." not in use.symbol.rpartition(":")[2]
}


def __getattr__(name: str) -> Any:
    symbol = LAZY.get(name)
    if symbol is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = Use(symbol, "", "").resolve()
    globals()[name] = value
    return value


# ---------------------------------------------------------------------------- registration


def register_connector_once(name: str, module: str, class_name: str) -> None:
    """Register our KV connector unless this process already did."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)


def register_attention_backend(vllm_name: str, class_path: str) -> None:
    """Serve ``class_path`` wherever vLLM selects its backend ``vllm_name`` (e.g. ``CPU_ATTN``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum[vllm_name], class_path)


def platform_kind() -> str | None:
    """``"cpu"``, ``"cuda"`` or None (any other platform) for this process's vLLM platform."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None


def active_connector() -> Any:
    """This process's KV connector, or None when KV transfer is off."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


# ---------------------------------------------------------------------------- worker side


def attention_layers(vllm_config: Any, names: list[str]) -> dict[str, Any]:
    """Layer name -> vLLM ``Attention`` module for the given cache names."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(vllm_config, Attention, names)


def layer_index(layer_name: str) -> int:
    """The model layer a cache name belongs to (``model.layers.7.self_attn.attn`` -> 7)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


@dataclass(frozen=True)
class LayerAttention:
    """What a vLLM attention layer computes (see the ledger): its impl's softmax scale, logit
    soft-cap (0 = off), learned sinks [H_q] (or None), ALiBi slopes (or None), and the layer whose
    cache it reads instead of its own (or None)."""

    scale: float
    softcap: float
    sinks: Any
    alibi_slopes: Any
    kv_sharing_target: str | None


def layer_attention(layer: Any) -> LayerAttention:
    """The :class:`LayerAttention` of a vLLM ``Attention`` module (after its weights are loaded)."""
    impl = layer.impl
    return LayerAttention(scale=float(impl.scale), softcap=float(getattr(impl, "logits_soft_cap", 0) or 0),
                          sinks=getattr(impl, "sinks", None), alibi_slopes=getattr(impl, "alibi_slopes", None),
                          kv_sharing_target=getattr(layer, "kv_sharing_target_layer_name", None))


#: vLLM ``Attention`` layer -> weak reference to the module that registered it (its attention block)
_ATTENTION_OWNERS: Any = None
#: an attention block's ``o_proj`` -> its loaded weight, kept where vLLM drops it (CPU repacking)
_DROPPED_WEIGHTS: Any = None


def track_attention_owners(wanted: Callable[[Any], bool]) -> None:
    """Installed once per process at plugin load, before vLLM builds a model; for models whose
    vLLM config is ``wanted`` (the kvcomp connector's), through torch's public registration hooks:
    remember which module holds each vLLM ``Attention`` (its attention block), weakly, and keep
    the block's ``o_proj`` weight when vLLM's CPU path replaces it by an empty one after packing
    it for oneDNN (``dispatch_cpu_unquantized_gemm(remove_weight=True)``)."""
    global _ATTENTION_OWNERS, _DROPPED_WEIGHTS
    if _ATTENTION_OWNERS is not None:
        return
    import weakref

    from torch.nn.modules.module import (
        register_module_module_registration_hook,
        register_module_parameter_registration_hook,
    )

    owners: Any = weakref.WeakKeyDictionary()
    dropped: Any = weakref.WeakKeyDictionary()

    def remember_owner(module: Any, name: str, submodule: Any) -> None:
        if type(submodule).__module__.startswith("vllm.") and submodule not in owners:
            from vllm.config import get_current_vllm_config_or_none
            from vllm.model_executor.layers.attention import Attention

            config = get_current_vllm_config_or_none()
            if isinstance(submodule, Attention) and config is not None and wanted(config):
                owners[submodule] = weakref.ref(module)

    def keep_dropped_weight(module: Any, name: str, param: Any) -> None:
        if name == "weight" and param.numel() == 0 and getattr(module, "weight", None) is not None and any(
                getattr(ref(), "o_proj", None) is module for ref in owners.values()):
            dropped[module] = module.weight  # still the loaded one: torch calls the hook before replacing it

    register_module_module_registration_hook(remember_owner)
    register_module_parameter_registration_hook(keep_dropped_weight)
    _ATTENTION_OWNERS, _DROPPED_WEIGHTS = owners, dropped


def attention_output_weight(layer: Any) -> Any:
    """This rank's output-projection weight [hidden, H_q_local · D] of the attention block
    holding the vLLM ``Attention`` ``layer`` (its ``o_proj``, a ``RowParallelLinear`` split by
    input: the columns of the rank's own query heads, in order). NotImplementedError saying why
    there is none (not seen being built, no ``o_proj``, quantized, split otherwise)."""
    import torch
    from vllm.model_executor.layers.linear import RowParallelLinear

    name = getattr(layer, "layer_name", "?")
    ref = None if _ATTENTION_OWNERS is None else _ATTENTION_OWNERS.get(layer)
    owner = None if ref is None else ref()
    if owner is None:
        raise NotImplementedError(f"layer {name}: its attention block was not seen being built (the vllm-kvcomp "
                                  "plugin must load before the model)")
    proj = getattr(owner, "o_proj", None)
    if not isinstance(proj, RowParallelLinear):
        raise NotImplementedError(f"layer {name}: {type(owner).__name__} has no o_proj output projection "
                                  "(RowParallelLinear)")
    weight = getattr(proj, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.numel() == 0:
        weight = _DROPPED_WEIGHTS.get(proj)
    features = layer.num_heads * layer.head_size
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                                    torch.float64):
        raise NotImplementedError(f"layer {name}: o_proj holds no plain floating-point weight (quantized?)")
    if weight.dim() != 2 or weight.shape[1] != features or proj.input_size_per_partition != features:
        raise NotImplementedError(f"layer {name}: o_proj weight {tuple(weight.shape)} does not hold this rank's "
                                  f"{layer.num_heads} heads of {layer.head_size}")
    return weight.detach()


def cpu_attention_isa(layer: Any) -> str:
    """The CPU cache layout vLLM's metadata builder chose for ``layer`` (``vec``, ``amx``, ...)."""
    return getattr(layer, "isa", "vec")


def tensor_parallel_ranks() -> Any:
    """This worker's tensor-parallel group as policies' :class:`~vllm_kvcomp.policies.base.Ranks`
    (the one-rank identity without tensor parallelism)."""
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_kvcomp.policies.base import ONE_RANK, Ranks

    group = get_tp_group()
    if group.world_size == 1:
        return ONE_RANK

    class TensorParallelRanks(Ranks):
        size, rank = group.world_size, group.rank_in_group

        def gather(self, value: Any) -> list[Any]:
            import torch.distributed as dist

            out: list[Any] = [None] * self.size
            dist.all_gather_object(out, value, group=group.cpu_group)
            return out

    return TensorParallelRanks()


def cpu_attention_schedule(**kwargs: Any) -> Any:
    """vLLM's CPU attention schedule for new lengths, with the flags its own builder uses."""
    from vllm import _custom_ops, envs

    return _custom_ops.cpu_attn_get_scheduler_metadata(enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, **kwargs)


def cpu_paged_attention(**kwargs: Any) -> None:
    """vLLM's CPU paged attention kernel (``cpu_attention_with_kv_cache``), writing ``output``."""
    from vllm import _custom_ops

    _custom_ops.cpu_attention_with_kv_cache(**kwargs)


def is_plain_full_attention(spec: Any) -> bool:
    """A KV-cache group spec of ordinary full attention (not sliding window, MLA, sinks, Mamba...)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return type(spec) is FullAttentionSpec


def attention_backend_name(layer: Any) -> str:
    """vLLM's name of the backend it selected for the ``Attention`` module ``layer`` (e.g.
    ``FLASHINFER``; the impl's class name for a module without one)."""
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None else type(getattr(layer, "impl", None)).__name__


#: the custom op vLLM's ``Attention`` layers run their backend's ``forward`` in (see the ledger)
ATTENTION_OP = "vllm::unified_attention_with_output"


def attention_runs_between_graph_pieces(splitting_ops: list[str] | None) -> bool:
    """Whether PIECEWISE CUDA graphs run attention (our backends' ``forward``) eagerly: its op
    splits the graphs, or breakable CUDA graphs break at it whatever they split on."""
    from vllm import envs

    return ATTENTION_OP in (splitting_ops or ()) or bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)


# ---------------------------------------------------------------------------- scheduler side


def request_block_ids(kv_cache_manager: Any, req_id: str, group: int = 0) -> list[int]:
    """Positional block ids of a request in KV-cache group ``group`` (freed columns = null block)."""
    return list(kv_cache_manager.get_block_ids(req_id)[group])


def holds_blocks(kv_cache_manager: Any, req_id: str, group: int = 0) -> bool:
    """Whether the request still owns blocks (not finished or preempted meanwhile)."""
    return req_id in kv_cache_manager.coordinator.single_type_managers[group].req_to_blocks


def free_blocks(kv_cache_manager: Any, req_id: str, start: int, end: int, group: int = 0) -> None:
    """Return block-table columns ``[start, end)`` of a running request to the pool (null block)."""
    kv_cache_manager.coordinator.single_type_managers[group]._remove_blocks_in_range(req_id, start, end)


def admit_by(kv_cache_manager: Any, admission: Callable[[Any], bool | None]) -> None:
    """PATCH (see the ledger): before vLLM requires a request's whole sequence to fit
    (``full_sequence_must_fit``), ``admission(request)`` may decide: True admits it now without
    that rule, False holds it back, None leaves vLLM's rule."""
    allocate = kv_cache_manager.allocate_slots
    if getattr(allocate, "_kvcomp_bounded", False):
        return

    def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        decision = admission(request) if kwargs.get("full_sequence_must_fit") else None
        if decision is False:
            return None
        if decision:
            kwargs["full_sequence_must_fit"] = False
        return allocate(request, num_new_tokens, *args, **kwargs)

    allocate_slots._kvcomp_bounded = True
    kv_cache_manager.allocate_slots = allocate_slots


def allow_max_model_len_beyond_kv_cache(opted_in: Callable[[Any], bool]) -> None:
    """PATCH (see the ledger), installed once at plugin load: an engine whose config
    ``opted_in`` (``--allow-prompts-beyond-kv-cache``) starts even if one max_model_len sequence
    exceeds the KV cache (warn instead; such requests are refused at the API server). The config
    is the first argument of the check's ``get_needed_memory`` partial (vLLM's
    ``get_kv_cache_configs``); any other caller gets vLLM's check unchanged."""
    from vllm.v1.core import kv_cache_utils

    check = kv_cache_utils._check_enough_kv_cache_memory
    if getattr(check, "_kvcomp_relaxed", False):
        return

    def relaxed(available_memory: int, get_needed_memory: Callable[[], int], max_model_len: int, *args: Any) -> None:
        try:
            check(available_memory, get_needed_memory, max_model_len, *args)
        except ValueError as err:
            config = next(iter(getattr(get_needed_memory, "args", ())), None)
            if config is None or not opted_in(config):
                raise
            import logging

            logging.getLogger(__name__).warning(
                "--allow-prompts-beyond-kv-cache: %s Only prefill=stream requests can use the whole max_model_len.",
                err,
            )

    relaxed._kvcomp_relaxed = True
    kv_cache_utils._check_enough_kv_cache_memory = relaxed


def refuse_composition(connector_name: str, why: str) -> None:
    """PATCH (see the ledger), installed once at plugin load: vLLM's MultiConnector raises
    ``ValueError(why)`` when one of its children is ``connector_name``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    children = MultiConnector._get_connector_classes_and_configs
    if getattr(children, "_kvcomp_refusing", False):
        return

    def refusing(vllm_config: Any) -> list[tuple[type, Any]]:
        for ktc in vllm_config.kv_transfer_config.kv_connector_extra_config.get("connectors") or ():
            if ktc.get("kv_connector") == connector_name:
                raise ValueError(why)
        return children(vllm_config)

    refusing._kvcomp_refusing = True
    MultiConnector._get_connector_classes_and_configs = staticmethod(refusing)


def cap_prefix_cache_hits(kv_cache_manager: Any, cap_tokens: Callable[[Any], int | None]) -> None:
    """PATCH (see the ledger): a request for which ``cap_tokens(request)`` is a token count reads
    at most that many tokens from the prefix cache (rounded down to whole blocks)."""
    lookup = kv_cache_manager.get_computed_blocks
    if getattr(lookup, "_kvcomp_capped", False):
        return

    def get_computed_blocks(request: Any) -> Any:
        blocks, hit, boundary = lookup(request)
        cap = cap_tokens(request)
        if cap is None or hit <= cap:
            return blocks, hit, boundary
        size = kv_cache_manager.coordinator.single_type_managers[0].block_size
        keep = cap // size
        if keep == 0:
            return kv_cache_manager.empty_kv_cache_blocks, 0, 0
        return kv_cache_manager.create_kv_cache_blocks(tuple(b[:keep] for b in blocks.blocks)), keep * size, 0

    get_computed_blocks._kvcomp_capped = True
    kv_cache_manager.get_computed_blocks = get_computed_blocks


def caching_enabled(kv_cache_manager: Any) -> bool:
    """Whether vLLM's prefix cache is on for this cache manager."""
    return bool(getattr(kv_cache_manager, "enable_caching", False))


def hash_block_size(kv_cache_manager: Any) -> int:
    """Tokens per block hash (copy-on-compress needs one hash per whole block)."""
    return kv_cache_manager.block_pool.hash_block_size


@dataclass(frozen=True)
class GroupManager:
    """One KV-cache group's manager, as the engine reads it: tokens per block, its sliding
    window (None: full attention), and the live per-request block lists (edited in place)."""

    block_size: int
    sliding_window: int | None
    tables: dict[str, list[Any]]


def group_managers(kv_cache_manager: Any) -> list[GroupManager]:
    """Every KV-cache group's manager, in group order."""
    return [GroupManager(m.block_size, getattr(getattr(m, "kv_cache_spec", None), "sliding_window", None),
                         m.req_to_blocks) for m in kv_cache_manager.coordinator.single_type_managers]


def stop_hashing(kv_cache_manager: Any, req_id: str) -> None:
    """Hash none of ``req_id``'s blocks beyond those hashed so far (see the ledger)."""
    for manager in kv_cache_manager.coordinator.single_type_managers:
        if req_id in manager.req_to_blocks:
            manager.num_cached_block[req_id] = 1 << 62


def pool_blocks(kv_cache_manager: Any) -> int:
    """Blocks in vLLM's pool, the null block included."""
    return kv_cache_manager.block_pool.num_gpu_blocks


def free_block_count(kv_cache_manager: Any) -> int:
    return kv_cache_manager.block_pool.get_num_free_blocks()


def take_blocks(kv_cache_manager: Any, count: int) -> list[Any]:
    """``count`` fresh blocks from the pool (vLLM evicts cached free ones first)."""
    return kv_cache_manager.block_pool.get_new_blocks(count)


def release_blocks(kv_cache_manager: Any, blocks: list[Any]) -> None:
    """Give blocks back to the pool; cached ones stay cached."""
    if blocks:
        kv_cache_manager.block_pool.free_blocks(blocks)


def null_block(kv_cache_manager: Any) -> Any:
    return kv_cache_manager.block_pool.null_block


def block_id(block: Any) -> int:
    return block.block_id


def block_refs(block: Any) -> int:
    """How many requests hold ``block``."""
    return block.ref_cnt


def is_null_block(block: Any) -> bool:
    return block.is_null


def uncache_block(kv_cache_manager: Any, block: Any) -> None:
    """Take ``block`` out of the prefix cache (its contents may change)."""
    kv_cache_manager.block_pool._maybe_evict_cached_block(block)


def abort_on_arrival(request: Any) -> None:
    """Have vLLM abort a request right after adding it (it finishes with reason ``abort``)."""
    request.abort_immediately = True


def salt_out_of_prefix_cache(request: Any, salt: str) -> None:
    """Give ``request`` a unique cache salt (re-hashing its blocks) and stop it reading the cache."""
    request.cache_salt = salt
    request.block_hashes = []
    request.update_block_hashes()
    request.skip_reading_prefix_cache = True


# ---------------------------------------------------------------------------- API server


def wrap_engine_generate(engine_client: Any, wrap: Callable[[Callable], Callable]) -> None:
    """PATCH (see the ledger): replace this client's ``generate`` by ``wrap(generate)``."""
    engine_client.generate = wrap(engine_client.generate)


def long_prompt_kv_cache_tokens(engine_client: Any) -> int | None:
    """Tokens one engine's KV cache holds, when the operator let max_model_len exceed it
    (``--allow-prompts-beyond-kv-cache``); None otherwise (vLLM's own checks then hold)."""
    config = getattr(engine_client, "vllm_config", None)
    transfer = getattr(config, "kv_transfer_config", None)
    if not (getattr(transfer, "kv_connector_extra_config", None) or {}).get("long_prompts"):
        return None
    cache = config.cache_config
    engines = max(1, config.parallel_config.data_parallel_size)
    return ((cache.num_gpu_blocks or 0) // engines - 1) * cache.block_size  # less the null block


def validation_error(message: str, parameter: str | None = None) -> Exception:
    """vLLM's request-validation error (the API server answers it with HTTP 400)."""
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter)


def serve_parser(prog: str, description: str) -> Any:
    """vLLM's ``serve`` argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog=prog, description=description))


def run_server(args: Any) -> None:
    """Run vLLM's OpenAI server in this process with parsed ``serve`` arguments (blocks)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args

    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


def server_env_setup() -> None:
    """The process set-up ``vllm serve`` does before parsing."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()


def reserve_outside_kv_cache(reserved: Callable[[Any], int]) -> None:
    """PATCH (see the ledger), installed once at plugin load: a GPU worker's KV budget is what
    vLLM measured less ``reserved(vllm_config)`` bytes, logged (none when the operator set the
    budget with ``kv_cache_memory_bytes``)."""
    from vllm.v1.worker.gpu_worker import Worker

    determine = Worker.determine_available_memory
    if getattr(determine, "_kvcomp_reserving", False):
        return

    def reserving(self: Any) -> int:
        available = determine(self)
        nbytes = 0 if self.vllm_config.cache_config.kv_cache_memory_bytes else reserved(self.vllm_config)
        if nbytes:
            import logging

            logging.getLogger(__name__).info("vllm-kvcomp: %.2f GiB of the KV budget reserved for compression "
                                             "(%.2f GiB left for the KV cache)", nbytes / (1 << 30),
                                             (available - nbytes) / (1 << 30))
        return available - nbytes

    reserving._kvcomp_reserving = True
    Worker.determine_available_memory = reserving


def report_batch_order(report: Callable[[list[str], Any], None]) -> None:
    """PATCH (see the ledger), installed once at plugin load: the V1 model runner (vLLM's CPU
    runner, and the GPU one where Model Runner V2 is off) tells ``report`` its batch before the
    forward: request ids in row order and ``scheduler_output.num_scheduled_tokens`` (Model Runner
    V2 passes them to the connector's ``start_load_kv`` itself)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = GPUModelRunner._prepare_inputs
    if getattr(prepare, "_kvcomp_reporting", False):
        return

    def reporting(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        report(batch.req_ids[: batch.num_reqs], scheduler_output.num_scheduled_tokens)
        return prepare(self, scheduler_output, *args, **kwargs)

    reporting._kvcomp_reporting = True
    GPUModelRunner._prepare_inputs = reporting
