"""Offline per-model calibration: RazorAttention retrieval heads, POD layer groups, DuoAttention
head gates, KVzap scorers, JSON profiles.

Importing this package is cheap; the transformers-based probing lives in :mod:`.probe`.
"""

from vllm_kvcomp.calibration.profiles import (
    HeadGatesProfile,
    LayerGroupsProfile,
    ModelIdentity,
    Profile,
    ProfileError,
    RetrievalHeadsProfile,
    ScorerProfile,
    bind_profile,
    load_for_policy,
    load_profile,
    profile_path,
    save_profile,
)

__all__ = [
    "HeadGatesProfile",
    "LayerGroupsProfile",
    "ModelIdentity",
    "Profile",
    "ProfileError",
    "RetrievalHeadsProfile",
    "ScorerProfile",
    "bind_profile",
    "load_for_policy",
    "load_profile",
    "profile_path",
    "save_profile",
]
