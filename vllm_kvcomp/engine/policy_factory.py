"""Spec -> policy instance for one served model (resolving calibration profiles by name)."""

from __future__ import annotations

from vllm_kvcomp.policies.base import Policy
from vllm_kvcomp.spec import CompressionSpec


class PolicyFactory:
    """Builds policies for the model at ``model_dir``; profiles are cached per (kind, name)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._profiles: dict[tuple[str, str], object] = {}

    def build(self, spec: CompressionSpec) -> Policy:
        policy = spec.build_policy()
        if policy.PROFILE is None:
            return policy
        from vllm_kvcomp.calibration.profiles import bind_profile, load_profile

        name = str(spec.extras.get("profile", "default"))
        key = (policy.PROFILE, name)
        if key not in self._profiles:
            self._profiles[key] = load_profile(self.model_dir, policy.PROFILE, name)
        return bind_profile(policy, self._profiles[key])
