"""KVzap calibration: KVzip's teacher scores, the replay layout, the ridge fit, and the HF path."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.calibration import kvzap
from vllm_kvcomp.calibration.probe import hf_provider
from vllm_kvcomp.calibration.profiles import (
    ModelIdentity,
    ProfileError,
    ScorerProfile,
    from_json,
    to_json,
)
from vllm_kvcomp.policies.kvzap import cache_features


def test_kvzip_scores_are_the_max_over_replay_rows_and_the_query_group():
    probs = torch.rand(4, 10, 10)  # 4 query heads, 2 per KV head
    context, replay = slice(1, 4), slice(6, 10)
    got = kvzap.kvzip_scores(probs, 2, context, replay)
    want = torch.zeros(2, 3)
    for h in range(2):
        for i in range(3):
            want[h, i] = max(float(probs[q, t, 1 + i]) for q in (2 * h, 2 * h + 1) for t in range(6, 10))
    torch.testing.assert_close(got, want)


def test_the_replay_repeats_the_context_after_the_repeat_prompt():
    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    ids, first, again = kvzap.replay_sequence(encode, [7, 8, 9], prefix=[0])
    repeat = encode(kvzap.REPEAT)
    assert ids.tolist() == [0, 7, 8, 9, *repeat, 7, 8, 9]
    assert ids[first].tolist() == ids[again].tolist() == [7, 8, 9]


def test_needle_text_is_seeded_and_holds_its_facts():
    text = kvzap.needle_text(60, 3, seed=5)
    assert text == kvzap.needle_text(60, 3, seed=5) != kvzap.needle_text(60, 3, seed=6)
    assert text.count("The code of the ") == 3


def test_the_ridge_fit_recovers_a_linear_map_and_is_scored_by_r2():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 500, 6, generator=gen, dtype=torch.float64) * torch.tensor([1, 5, 0.1, 2, 3, 1.0])
    w = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    y = (x * w.unsqueeze(-2)).sum(-1) + b.unsqueeze(-1)
    weights, bias = kvzap.fit_ridge(x, y, 1e-9)
    torch.testing.assert_close(weights, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kvzap.r_squared(x, y, weights, bias), torch.ones(2, 3, dtype=torch.float64))
    noisy = y + torch.randn(y.shape, generator=gen, dtype=torch.float64) * y.std()
    assert float(kvzap.r_squared(x, noisy, *kvzap.fit_ridge(x, noisy, 1e-3)).max()) < 0.8
    with pytest.raises(ValueError, match="ridge must be positive"):
        kvzap.fit_ridge(x, y, 0.0)


def test_a_stronger_ridge_shrinks_the_weights():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(1, 1, 200, 4, generator=gen), torch.randn(1, 1, 200, generator=gen)
    weak, _ = kvzap.fit_ridge(x, y, 1e-6)
    strong, _ = kvzap.fit_ridge(x, y, 10.0)
    assert float(strong.norm()) < 0.2 * float(weak.norm())


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, bos_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def test_the_teacher_pairs_each_context_token_with_its_cache_features_and_log_score():
    """Through the HF probe: features from the layer's own K/V, scores from its probabilities."""
    model = _tiny_llama()
    identity = ModelIdentity.from_config(model.config)

    def encode(text: str) -> list[int]:
        return [1 + len(word) % 60 for word in text.split()]

    text = "one two three four five six seven eight nine ten"
    with hf_provider(model) as provider:
        (features, scores), = kvzap.teacher_data(provider, encode, identity, [text], prefix=[0], progress=False)
        ids, first, again = kvzap.replay_sequence(encode, encode(text), [0])
        seen: dict[int, tuple[torch.Tensor, ...]] = {}
        provider(ids, lambda layer, probs: None, lambda layer, k, v: seen.__setitem__(layer, (k, v)))
    keep = slice(kvzap.SINK, first.stop)  # the prefix is 1 token: positions 1..3 are sinks too
    assert features.shape == (2, 2, first.stop - kvzap.SINK, 12) and scores.shape == features.shape[:3]
    for layer in range(2):
        k, v = seen[layer]
        torch.testing.assert_close(features[layer], cache_features(k[:, keep], v[:, keep]))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = model(ids.view(1, -1), output_attentions=True, use_cache=False).attentions
    for layer in range(2):
        want = kvzap.kvzip_scores(probs[layer][0], 2, first, again)[:, kvzap.SINK - first.start:]
        torch.testing.assert_close(scores[layer], want.log())


def test_calibrate_makes_a_valid_profile_with_its_held_out_fit():
    model = _tiny_llama()
    identity = ModelIdentity.from_config(model.config)
    with hf_provider(model) as provider:
        profile = kvzap.calibrate_kvzap(provider, lambda t: [1 + len(w) % 60 for w in t.split()], identity,
                                        samples=3, holdout=1, words=40, needles=1, prefix=[0], progress=False)
    assert isinstance(profile, ScorerProfile) and from_json(to_json(profile)) == profile
    assert len(profile.weights) == 2 and len(profile.weights[0]) == 2 and len(profile.weights[0][0]) == 12
    assert profile.settings["r2"] <= 1 and len(profile.settings["r2_layers"]) == 2
    assert profile.settings["r2_over_layers"] == [0, 1]
    with hf_provider(model) as provider:  # Gemma 3: the fit is judged on the layers the engine compresses
        one = kvzap.calibrate_kvzap(provider, lambda t: [1 + len(w) % 60 for w in t.split()], identity,
                                    samples=3, holdout=1, words=40, needles=1, prefix=[0], compressed=[1],
                                    progress=False)
    assert one.settings["r2"] == pytest.approx(one.settings["r2_layers"][1], abs=1e-4)
    assert one.settings["r2_over_layers"] == [1] and one.weights == profile.weights
    with pytest.raises(ValueError, match="holdout"):
        kvzap.calibrate_kvzap(provider, str.split, identity, samples=2, holdout=2)


def test_a_scorer_profile_of_the_wrong_shape_is_refused():
    identity = ModelIdentity("llama", 2, 4, 2, 8, "test")
    good = ScorerProfile(identity, weights=(((0.0,) * 12,) * 2,) * 2, bias=((0.0, 0.0),) * 2)
    good.validate()
    for bad in (ScorerProfile(identity, weights=(((0.0,) * 11,) * 2,) * 2, bias=good.bias),
                ScorerProfile(identity, weights=good.weights, bias=((0.0,),) * 2),
                ScorerProfile(identity, weights=(((float("nan"),) * 12,) * 2,) * 2, bias=good.bias)):
        with pytest.raises(ProfileError):
            bad.validate()
