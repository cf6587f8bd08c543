"""The policies' one source of truth: public name -> class, and through the class everything else
about it: defaults (dataclass fields), parameter schema (:meth:`Policy.accepted_params`), the docs
table's text (``KEEPS``, ``PAPER``), test settings (``TEST_PARAMS``) and benchmarked variants
(``VARIANTS``).

Adding a method = one module in this package + one line in :data:`POLICIES`. Everything that
lists policies (the spec, the operator config and its JSON schema, the eval harness, the docs
table, the benchmarks, the shared tests) reads the names from here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

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
    "keydiff": "keydiff:KeyDiff",
    "tova": "tova:TOVA",
    "pyramidkv": "pyramidkv:PyramidKV",
    "expected_attention": "expected_attention:ExpectedAttention",
    "criticalkv": "criticalkv:CriticalKV",
    "duoattention": "duoattention:DuoAttention",
    "kvzap": "kvzap:KVzap",
}
#: the names when this module was imported (for import-time uses: type literals, schemas, test
#: parameters); :func:`policy_names` reads :data:`POLICIES` when called
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
#: words a client may use for "do not compress" (``none`` is an alias of the ``full`` policy)
NO_COMPRESSION_WORDS: tuple[str, ...] = ("none", "full")


def policy_names() -> tuple[str, ...]:
    """Every public policy name, in registry order."""
    return tuple(POLICIES)


def compressing_policy_names() -> tuple[str, ...]:
    """Every policy but ``full``: what benchmarks compare with the full cache."""
    return tuple(name for name in policy_names() if name not in NO_COMPRESSION_WORDS)


def streaming_policy_names() -> tuple[str, ...]:
    """Policies that may compress after every prefill chunk (``prefill=stream``)."""
    return tuple(name for name in policy_names() if get_policy_class(name).STREAMS)


def recompressing_policy_names() -> tuple[str, ...]:
    """Compressing policies that may recompress during decode (``decode=recompress``)."""
    return tuple(name for name in compressing_policy_names() if get_policy_class(name).CAN_RECOMPRESS)


def policy_variants(names: tuple[str, ...] | None = None) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(label, policy name, spec settings) of each policy in ``names`` (default: all) at its
    defaults (label = the name, no settings), each followed by its ``VARIANTS`` (label
    ``"NAME SUFFIX"``)."""
    out: list[tuple[str, str, Mapping[str, Any]]] = []
    for name in policy_names() if names is None else names:
        out.append((name, name, {}))
        out += [(f"{name} {suffix}", name, settings)
                for suffix, settings in get_policy_class(name).VARIANTS.items()]
    return out


def get_policy_class(name: str):
    """The policy class for a public name; SpecError for unknown names."""
    try:
        module, cls = POLICIES[name].split(":")
    except KeyError:
        raise SpecError("policy", f"unknown policy {name!r}", ", ".join(policy_names())) from None
    return getattr(importlib.import_module(f"vllm_kvcomp.policies.{module}"), cls)
