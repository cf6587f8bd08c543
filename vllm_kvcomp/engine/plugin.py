"""Registration with vLLM (called by the ``vllm.general_plugins`` entry point, idempotent).

- Attention backend: on CPU, vLLM always picks ``CPU_ATTN``; we register our subclass under that
  name. It behaves exactly like the parent unless the kvcomp connector is active.
- KV connector: registered as ``KVCompConnector``; enabling compression is the one engine
  argument ``kv_transfer_config=kv_transfer_config()``.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "KVCompConnector"
CONNECTOR_MODULE = "vllm_kvcomp.engine.connector"


def register_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, "KVCompConnector")
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_kvcomp.engine.backends.cpu.KVCompCPUAttentionBackend")


def kv_transfer_config(profiles: dict[str, str] | None = None) -> dict[str, Any]:
    """The engine argument that turns kvcomp on (pass as ``kv_transfer_config=``).

    ``profiles`` maps a calibration kind (``razor``, ``pod``) to the profile the engine serves
    for it: a name in ``<model>/kvcomp_profiles/`` or a path to a profile JSON file.
    """
    config: dict[str, Any] = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"}
    if profiles:
        config["kv_connector_extra_config"] = {"profiles": dict(profiles)}
    return config


def active_worker():
    """The worker half of the kvcomp connector in this process, or None when not enabled."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return getattr(connector, "worker", None) if type(connector).__name__ == CONNECTOR_NAME else None
