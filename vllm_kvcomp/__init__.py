"""vllm-kvcomp: per-request, per-head KV-cache compression inside vLLM.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it once in every process it
starts (front end, engine core, workers); it is idempotent and imports vLLM lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Register the kvcomp attention backends and KV connector with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm_kvcomp.engine.plugin import register_with_vllm

    register_with_vllm()
    _registered = True
