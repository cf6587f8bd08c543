"""Compression policies: pure functions of K, V, window queries and per-request state."""

from vllm_kvcomp.policies.base import (
    Compensation,
    LayerKV,
    Policy,
    RequestState,
    ScorePolicy,
    Selection,
)
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class

__all__ = [
    "POLICY_NAMES",
    "Compensation",
    "LayerKV",
    "Policy",
    "RequestState",
    "ScorePolicy",
    "Selection",
    "get_policy_class",
]
