"""Plugin-load patches and the worker binding: no patch is installed from a query method, and
each applies only where its engine opted in."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine import plugin


def config(connector: str = plugin.CONNECTOR_NAME, long_prompts: bool = False) -> SimpleNamespace:
    extra = {"long_prompts": True} if long_prompts else {}
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra))


def test_long_prompts_allowed_only_for_our_opted_in_connector():
    assert plugin.long_prompts_allowed(config(long_prompts=True))
    assert not plugin.long_prompts_allowed(config())
    assert not plugin.long_prompts_allowed(config("MultiConnector", long_prompts=True))
    assert not plugin.long_prompts_allowed(SimpleNamespace(kv_transfer_config=None))


def test_the_kv_cache_check_is_relaxed_only_for_an_opted_in_engine(monkeypatch):
    from vllm.v1.core import kv_cache_utils

    def strict(available, get_needed_memory, max_model_len, *args):
        raise ValueError("one max_model_len sequence does not fit")

    monkeypatch.setattr(kv_cache_utils, "_check_enough_kv_cache_memory", strict)
    vllm_compat.allow_max_model_len_beyond_kv_cache(plugin.long_prompts_allowed)
    vllm_compat.allow_max_model_len_beyond_kv_cache(plugin.long_prompts_allowed)  # idempotent
    check = kv_cache_utils._check_enough_kv_cache_memory
    assert check is not strict and check._kvcomp_relaxed
    needed = lambda cfg: functools.partial(lambda c, groups: 0, cfg, [])  # noqa: E731 (vLLM's partial shape)
    check(1, needed(config(long_prompts=True)), 8192)  # opted in: a warning, no error
    for other in (needed(config()), needed(config("OffloadingConnector", True)), lambda: 0):
        with pytest.raises(ValueError, match="does not fit"):
            check(1, other, 8192)


def test_the_backends_reach_only_a_bound_worker_of_an_active_connector(monkeypatch):
    worker = object()
    monkeypatch.setattr(plugin, "_worker", None)
    monkeypatch.setattr(vllm_compat, "active_connector", lambda: object())
    assert plugin.active_worker() is None
    plugin.bind_worker(worker)
    assert plugin.active_worker() is worker
    monkeypatch.setattr(vllm_compat, "active_connector", lambda: None)  # an engine without KV transfer
    assert plugin.active_worker() is None


def test_the_connector_refuses_to_be_composed_with_another():
    """Under vLLM's MultiConnector another connector would read or move blocks whose pages we
    repack: refused at construction (before the model loads), naming what to do."""
    from vllm_kvcomp.engine.connector import KVCompConnector
    from vllm_kvcomp.vllm_compat import KVConnectorRole

    composed = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="MultiConnector"))
    with pytest.raises(ValueError, match=r"only KV connector.*MultiConnector"):
        KVCompConnector(composed, KVConnectorRole.WORKER)


def test_a_multiconnector_that_includes_ours_does_not_start():
    """vLLM's MultiConnector hands each child a copy of the config naming only that child, so the
    connector alone cannot tell it is composed: the plugin makes vLLM's MultiConnector refuse the
    composition (building its children, and when vLLM asks it for the KV-cache layout), with vLLM's
    own example connector beside ours; a composition without ours is left alone."""
    import copy

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    plugin.register_with_vllm()
    plugin.register_with_vllm()  # idempotent: one wrapper

    def composed(*children: str) -> SimpleNamespace:
        connectors = [{"kv_connector": name, "kv_role": "kv_both"} for name in children]
        return SimpleNamespace(kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": connectors}))

    ours_and_example = composed(plugin.CONNECTOR_NAME, "ExampleConnector")
    with pytest.raises(ValueError, match="cannot be a child of vLLM's MultiConnector"):
        MultiConnector._get_connector_classes_and_configs(copy.copy(ours_and_example))
    with pytest.raises(ValueError, match="cannot be a child of vLLM's MultiConnector"):
        MultiConnector.get_required_kvcache_layout(copy.copy(ours_and_example))
    others = MultiConnector._get_connector_classes_and_configs(composed("ExampleConnector"))
    assert [cls.__name__ for cls, _ in others] == ["ExampleConnector"]


def test_a_gpu_workers_kv_budget_leaves_out_what_kvcomp_reserves(monkeypatch):
    """Only an engine with the kvcomp connector gives up the reservation, and not when the
    operator sized the KV cache with kv_cache_memory_bytes (vLLM then skips its own profile)."""
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: 10 << 30)
    vllm_compat.reserve_outside_kv_cache(lambda cfg: 3 << 30 if plugin.uses_kvcomp(cfg) else 0)
    vllm_compat.reserve_outside_kv_cache(lambda cfg: 1 / 0)  # idempotent: the first stays
    assert Worker.determine_available_memory._kvcomp_reserving

    def worker(connector: str, kv_bytes: int | None = None) -> SimpleNamespace:
        cfg = config(connector)
        cfg.cache_config = SimpleNamespace(kv_cache_memory_bytes=kv_bytes)
        return SimpleNamespace(vllm_config=cfg)

    assert Worker.determine_available_memory(worker(plugin.CONNECTOR_NAME)) == 7 << 30
    assert Worker.determine_available_memory(worker("OffloadingConnector")) == 10 << 30
    assert Worker.determine_available_memory(worker(plugin.CONNECTOR_NAME, 5 << 30)) == 10 << 30


def test_the_reservation_is_kvcomps_bound_only_where_the_engine_can_compress():
    """An engine whose config already rules compression out (MLA here) reserves nothing."""
    from vllm_kvcomp.engine.memory import PluginMemory, shapes_of

    def engine(use_mla: bool, connector: str = plugin.CONNECTOR_NAME) -> SimpleNamespace:
        cfg = config(connector)
        cfg.model_config = SimpleNamespace(
            use_mla=use_mla, hf_text_config=SimpleNamespace(), dtype=torch.bfloat16, max_model_len=4096,
            get_num_layers=lambda p: 4, get_num_kv_heads=lambda p: 2, get_num_attention_heads=lambda p: 8,
            get_head_size=lambda: 64)
        cfg.parallel_config, cfg.speculative_config = SimpleNamespace(), None
        cfg.cache_config = SimpleNamespace(cache_dtype="auto", block_size=16)
        cfg.device_config = SimpleNamespace(device_type="cuda")
        return cfg

    assert plugin.reserved_bytes(engine(False)) == PluginMemory.bound(shapes_of(engine(False))).reserved > 0
    assert plugin.reserved_bytes(engine(True)) == 0
    assert plugin.reserved_bytes(engine(False, "OffloadingConnector")) == 0
