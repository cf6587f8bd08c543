"""Retrieval heads of the bundled SmolLM2 are stable across seeds (slow: runs the real model)."""

from __future__ import annotations

import pytest

from vllm_kvcomp.calibration import retrieval_heads as rh
from vllm_kvcomp.calibration.profiles import ModelIdentity


@pytest.mark.slow
def test_smollm2_retrieval_heads_are_stable_across_seeds():
    from transformers import AutoTokenizer

    from vllm_kvcomp.calibration.probe import hf_provider, load_hf_model
    from vllm_kvcomp.models import fetch_default_model

    model_dir = fetch_default_model(progress=False)
    identity = ModelIdentity.from_model_dir(model_dir)
    model = load_hf_model(str(model_dir))
    special = AutoTokenizer.from_pretrained(str(model_dir)).all_special_ids
    profiles = []
    with hf_provider(model) as provider:
        for seed in (0, 1):
            profiles.append(
                rh.calibrate_retrieval_heads(
                    provider, identity, model.config.vocab_size, length=256, repeats=4, samples=2,
                    seed=seed, exclude=special, prefix=[model.config.bos_token_id], progress=False,
                )
            )
    a, b = (p.kv_heads for p in profiles)
    jaccard = len(a & b) / len(a | b)
    assert jaccard >= 0.7, (sorted(a), sorted(b))
    # the strongest induction heads (score > 0.5) must be found by both seeds
    strong = [
        {(layer, q) for layer, row in enumerate(p.induction_scores) for q, s in enumerate(row) if s > 0.5}
        for p in profiles
    ]
    assert strong[0] and strong[0] == strong[1]
    assert strong[0] <= profiles[0].induction_heads
