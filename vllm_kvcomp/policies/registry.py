"""The policies' one source of truth: public name -> class, and through the class its
defaults (dataclass fields) and parameter schema (:meth:`Policy.accepted_params`).

Adding a method = one module in this package + one line in :data:`POLICIES`. Everything that
lists policies (the spec, the operator config and its JSON schema, the eval harness, the docs
tests) reads :data:`POLICY_NAMES` from here.
"""

from __future__ import annotations

import importlib

from vllm_kvcomp.params import SpecError

#: public name -> "module:Class" inside vllm_kvcomp.policies (imported lazily)
POLICIES: dict[str, str] = {
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
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
#: words a client may use for "do not compress" (``none`` is an alias of the ``full`` policy)
NO_COMPRESSION_WORDS: tuple[str, ...] = ("none", "full")


def streaming_policy_names() -> tuple[str, ...]:
    """Policies that may compress after every prefill chunk (``prefill=stream``)."""
    return tuple(name for name in POLICY_NAMES if get_policy_class(name).STREAMS)


def get_policy_class(name: str):
    """The policy class for a public name; SpecError for unknown names."""
    try:
        module, cls = POLICIES[name].split(":")
    except KeyError:
        raise SpecError("policy", f"unknown policy {name!r}", ", ".join(POLICY_NAMES)) from None
    return getattr(importlib.import_module(f"vllm_kvcomp.policies.{module}"), cls)
