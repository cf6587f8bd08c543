"""Spec -> policy instance for one served model (calibration profiles loaded once)."""

from __future__ import annotations

from collections.abc import Mapping

from vllm_kvcomp.policies.base import Policy
from vllm_kvcomp.spec import CompressionSpec


class PolicyFactory:
    """Builds policies for the model at ``model_dir``.

    ``served`` maps a profile kind to the operator's profile for it (a name in
    ``<model>/kvcomp_profiles/`` or a JSON path); a spec naming the default profile gets that one,
    a spec naming another profile loads it by name from the model folder. Profiles are cached.
    """

    def __init__(self, model_dir: str, served: Mapping[str, str] | None = None):
        self.model_dir = model_dir
        self.served = dict(served or {})
        self._profiles: dict[tuple[str, str], object] = {}

    def build(self, spec: CompressionSpec) -> Policy:
        """The policy of ``spec``; raises ProfileError if it needs a profile the model lacks."""
        policy = spec.build_policy()
        if policy.PROFILE is None:
            return policy
        from vllm_kvcomp.calibration.profiles import DEFAULT_NAME, bind_profile, load_profile

        name = getattr(policy, "profile", None) or DEFAULT_NAME
        ref = self.served.get(policy.PROFILE, DEFAULT_NAME) if name == DEFAULT_NAME else name
        key = (policy.PROFILE, ref)
        if key not in self._profiles:
            if ref.endswith(".json") or "/" in ref:
                self._profiles[key] = load_profile(policy.PROFILE, path=ref)
            else:
                self._profiles[key] = load_profile(policy.PROFILE, model_dir=self.model_dir, name=ref)
        return bind_profile(policy, self._profiles[key])
