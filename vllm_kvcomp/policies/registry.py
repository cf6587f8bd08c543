"""Name -> policy class. Adding a method = one module in this package + one line here."""

from __future__ import annotations

import importlib

from vllm_kvcomp.spec import POLICY_NAMES, SpecError

# public name -> "module:Class" inside vllm_kvcomp.policies (imported lazily)
_CLASSES: dict[str, str] = {
    "full": "full:Full",
    "streamingllm": "streamingllm:StreamingLLM",
    "snapkv": "snapkv:SnapKV",
    "h2o": "h2o:H2O",
    "knorm": "knorm:KNorm",
    "sagekv": "sagekv:SageKV",
    "lagkv": "lagkv:LagKV",
    "entropy": "entropy:EntropyBudget",
    "razor": "razor:Razor",
    "pod": "pod:POD",
}


def get_policy_class(name: str):
    """The policy class for a public name; SpecError for unknown names."""
    try:
        module, cls = _CLASSES[name].split(":")
    except KeyError:
        raise SpecError("policy", f"unknown policy {name!r}", ", ".join(POLICY_NAMES)) from None
    return getattr(importlib.import_module(f"vllm_kvcomp.policies.{module}"), cls)


def available() -> tuple[str, ...]:
    return POLICY_NAMES
