"""Retrieval-head calibration finds planted echo and induction heads (fake provider and tiny Llama)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.calibration import retrieval_heads as rh
from vllm_kvcomp.calibration.probe import hf_provider
from vllm_kvcomp.calibration.profiles import ModelIdentity

L, HQ, HKV = 6, 8, 2  # 48 query heads: 14% -> 7 induction heads, 1% -> 1 echo head
IDENT = ModelIdentity("llama", L, HQ, HKV, 16, "test")
INDUCTION = {(0, 5): 0.9, (1, 0): 0.8, (2, 2): 0.85, (2, 7): 0.7, (3, 3): 0.75, (4, 6): 0.95, (5, 1): 0.65}
DECOYS = {(3, 4): 0.3, (5, 5): 0.25}  # weaker induction: must not be picked
ECHO = {(1, 6): 0.9}
WEAK_ECHO = {(0, 0): 0.4}


def _planted_probs(ids: torch.Tensor, plan: dict[tuple[int, int], tuple[str, float]], layer: int) -> torch.Tensor:
    """[HQ, T, T]: local attention (self + previous token) plus planted echo/induction mass."""
    t = len(ids)
    probs = torch.zeros(HQ, t, t)
    rows = torch.arange(t)
    probs[:, rows, rows] = 0.5
    probs[:, rows, (rows - 1).clamp(min=0)] += 0.5
    for p in range(1, t):
        earlier = torch.nonzero(ids[:p] == ids[p]).flatten()
        if not len(earlier):
            continue
        prev = int(earlier[-1])
        for head in range(HQ):
            kind, mass = plan.get((layer, head), ("", 0.0))
            if kind:
                target = prev if kind == "echo" else prev + 1
                probs[head, p] *= 1.0 - mass
                probs[head, p, target] += mass
    return probs


def _plan():
    plan = {k: ("induction", v) for k, v in {**INDUCTION, **DECOYS}.items()}
    plan.update({k: ("echo", v) for k, v in {**ECHO, **WEAK_ECHO}.items()})
    return plan


def fake_provider(ids: torch.Tensor, on_layer) -> None:
    for layer in range(L):
        on_layer(layer, _planted_probs(ids, _plan(), layer))


def test_targets_point_at_previous_copies():
    query, echo, induction = rh._targets(length=3, repeats=3, offset=1)
    triples = list(zip(query.tolist(), echo.tolist(), induction.tolist()))
    assert triples[:3] == [(4, 1, 2), (5, 2, 3), (6, 3, 4)]
    assert (9, 3, 4) in triples and (9, 6, 7) in triples and len(triples) == 9


def test_repeated_random_tokens_structure():
    g = torch.Generator().manual_seed(0)
    ids = rh.repeated_random_tokens(50, 10, 3, g, exclude=range(5), prefix=[1])
    assert ids[0] == 1 and len(ids) == 31
    block = ids[1:11]
    assert len(set(block.tolist())) == 10 and int(block.min()) >= 5
    assert torch.equal(ids[11:21], block) and torch.equal(ids[21:], block)
    with pytest.raises(ValueError, match="length"):
        rh.repeated_random_tokens(8, 10, 2, g, exclude=range(5))
    with pytest.raises(ValueError, match="repeats"):
        rh.repeated_random_tokens(50, 10, 1, g)


def test_scores_of_planted_heads():
    ids = rh.repeated_random_tokens(100, 12, 3, torch.Generator().manual_seed(1), prefix=[0])
    probs = _planted_probs(ids, {(0, 1): ("echo", 1.0), (0, 2): ("induction", 1.0)}, layer=0)
    echo, induction = rh.echo_induction_scores(probs, 12, 3, offset=1)
    torch.testing.assert_close(echo[1], torch.tensor(1.0))
    torch.testing.assert_close(induction[2], torch.tensor(1.0))
    assert echo[0] < 0.1 and induction[0] < 0.1 and induction[1] == 0 and echo[2] == 0


def test_top_heads_counts_and_order():
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.2]])
    assert rh.top_heads(scores, 0.5) == frozenset({(0, 1), (1, 0)})
    assert rh.top_heads(scores, 0.26) == frozenset({(0, 1), (1, 0)})  # ceil(1.04) = 2
    assert rh.top_heads(scores, 0.0) == frozenset()
    with pytest.raises(ValueError, match="fraction"):
        rh.top_heads(scores, 1.5)
    assert rh.kv_heads_of({(0, 5), (0, 7), (2, 0)}, 4) == frozenset({(0, 1), (2, 0)})


def test_calibration_finds_exactly_the_planted_heads():
    profile = rh.calibrate_retrieval_heads(
        fake_provider, IDENT, vocab_size=200, length=16, repeats=3, samples=2, seed=7, prefix=[0], progress=False
    )
    assert profile.induction_heads == frozenset(INDUCTION)
    assert profile.echo_heads == frozenset(ECHO)
    group = HQ // HKV
    assert profile.kv_heads == frozenset((layer, q // group) for layer, q in {*INDUCTION, *ECHO})
    assert len(profile.induction_scores) == L and len(profile.echo_scores[0]) == HQ
    profile.validate()
    assert profile.settings["seed"] == 7 and profile.settings["samples"] == 2


def test_provider_must_report_every_layer():
    def partial(ids, on_layer):
        on_layer(0, _planted_probs(ids, {}, 0))

    with pytest.raises(RuntimeError, match="reported layers"):
        rh.calibrate_retrieval_heads(partial, IDENT, vocab_size=100, length=8, repeats=2, samples=1, progress=False)


# ---------------------------------------------------------------------------- tiny HF Llama


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=L,
        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=4, bos_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def test_hf_provider_reports_the_eager_attention_probabilities():
    model = _tiny_llama()
    model.set_attn_implementation("eager")
    ids = torch.randint(1, 120, (20,))
    with torch.no_grad():
        ref = model(ids.view(1, -1), output_attentions=True, use_cache=False).attentions
    got: dict[int, torch.Tensor] = {}
    with hf_provider(model) as provider:
        provider(ids, lambda layer, probs: got.__setitem__(layer, probs))
    assert sorted(got) == list(range(L))
    for layer in range(L):
        torch.testing.assert_close(got[layer], ref[layer][0])
    assert model.config._attn_implementation == "eager"  # restored


def test_tiny_llama_with_planted_heads(monkeypatch):
    """The HF path (probe -> layer index -> head order -> BOS offset) recovers planted heads."""
    import transformers.models.llama.modeling_llama as modeling

    real = modeling.eager_attention_forward
    plan = _plan()

    def planted(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, _ = real(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        return out, _planted_probs(current["ids"], plan, module.layer_idx).unsqueeze(0)

    current: dict[str, torch.Tensor] = {}
    monkeypatch.setattr(modeling, "eager_attention_forward", planted)
    model = _tiny_llama()
    with hf_provider(model) as provider:

        def recording(ids, on_layer):
            current["ids"] = ids
            provider(ids, on_layer)

        identity = ModelIdentity.from_config(model.config)
        profile = rh.calibrate_retrieval_heads(
            recording, identity, 120, length=16, repeats=3, samples=2, prefix=[0], progress=False
        )
    assert profile.induction_heads == frozenset(INDUCTION)
    assert profile.echo_heads == frozenset(ECHO)
