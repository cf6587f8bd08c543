"""Spec -> policy instance for one served model (calibration profiles loaded once by name)."""

from __future__ import annotations

from vllm_kvcomp.policies.base import Policy
from vllm_kvcomp.spec import CompressionSpec


class PolicyFactory:
    """Builds policies for the model at ``model_dir``; profiles are cached per (kind, name)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._profiles: dict[tuple[str, str], object] = {}

    def build(self, spec: CompressionSpec) -> Policy:
        """The policy of ``spec``; raises ProfileError if it needs a profile the model lacks."""
        policy = spec.build_policy()
        if policy.PROFILE is None:
            return policy
        from vllm_kvcomp.calibration.profiles import DEFAULT_NAME, bind_profile, load_profile

        key = (policy.PROFILE, getattr(policy, "profile", None) or DEFAULT_NAME)
        if key not in self._profiles:
            self._profiles[key] = load_profile(key[0], model_dir=self.model_dir, name=key[1])
        return bind_profile(policy, self._profiles[key])
