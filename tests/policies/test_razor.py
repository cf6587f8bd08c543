"""RazorAttention policy: what each head keeps, the compensation token, spec and profile binding."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.conftest import assert_refuses_infeasible_ratio, served_model_dir
from vllm_kvcomp.calibration.profiles import ModelIdentity, RetrievalHeadsProfile, bind_profile
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.compensation import attention_with_lse, compensated_attention
from vllm_kvcomp.policies.head_split import MIN_RECENT
from vllm_kvcomp.policies.razor import Razor
from vllm_kvcomp.spec import CompressionSpec


def _kv(n: int = 64, heads: int = 3, dim: int = 8, layer: int = 0, seed: int = 0, dtype=torch.float32, **kw) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    return LayerKV(
        torch.randn(heads, n, dim, generator=g, dtype=dtype),
        torch.randn(heads, n, dim, generator=g, dtype=dtype),
        layer=layer,
        num_layers=4,
        **kw,
    )


@pytest.mark.parametrize(("exact", "recent"), [(1, 25), (0, 21)])
def test_non_retrieval_head_keeps_sink_recent_and_mean_compensation(exact, recent):
    """exact=1: L_h = max(S0, N/C) = 25 recent tokens; exact=0 (no retrieval heads): 25 in all."""
    kv = _kv(n=100)
    policy = Razor(retrieval_heads=frozenset(), ratio=0.25, sink=4, buffer=10, exact=exact)
    sel = policy.decide([kv], RequestState())[0]
    expected = torch.cat([torch.arange(4), torch.arange(100 - recent, 100)])
    for h in range(3):
        assert torch.equal(sel.indices[h], expected)
        dropped = slice(4, 100 - recent)
        torch.testing.assert_close(sel.compensation.keys[h], kv.keys[h, dropped].mean(0))
        torch.testing.assert_close(sel.compensation.values[h], kv.values[h, dropped].mean(0))
    assert sel.compensation.counts.tolist() == [100 - 4 - recent] * 3


def test_buffer_floor_dominates_for_short_inputs():
    kv = _kv(n=100)
    sel = Razor(retrieval_heads=frozenset(), ratio=0.1, sink=2, buffer=40, exact=1).decide([kv], RequestState())[0]
    assert sel.counts().tolist() == [42, 42, 42]
    assert torch.equal(sel.indices[0][2:], torch.arange(60, 100))
    assert sel.compensation.counts.tolist() == [58.0] * 3


@pytest.mark.parametrize(("exact", "kept"), [(1, 34), (0, 30)])
def test_budget_replaces_ratio(exact, kept):
    """exact=1: sink + a 30-token window; exact=0: 30 per head on average, sink included."""
    kv = _kv(n=100)
    policy = CompressionSpec.from_mapping(
        {"policy": "razor", "budget": 30, "buffer": 0, "sink": 4, "exact": exact}).build_policy()
    sel = policy.decide([kv], RequestState())[0]
    assert sel.counts().tolist() == [kept] * 3


def test_retrieval_heads_keep_everything_without_compensation():
    kv = _kv(n=80, layer=2)
    policy = Razor(retrieval_heads=frozenset({(2, 1), (3, 0)}), ratio=0.2, sink=4, buffer=8, exact=1)
    sel = policy.decide([kv], RequestState())[0]
    assert torch.equal(sel.indices[1], torch.arange(80))
    assert sel.compensation.counts[1] == 0
    assert sel.counts().tolist() == [4 + 16, 80, 4 + 16]  # (3, 0) is another layer's head
    assert sel.compensation.counts[0] == 80 - 20


def test_ragged_lengths_are_right_aligned():
    kv = _kv(n=50, lengths=torch.tensor([50, 30, 10]))
    sel = Razor(retrieval_heads=frozenset(), ratio=0.2, sink=2, buffer=6, exact=1).decide([kv], RequestState())[0]
    assert torch.equal(sel.indices[1], torch.cat([torch.arange(20, 22), torch.arange(44, 50)]))
    torch.testing.assert_close(sel.compensation.keys[1], kv.keys[1, 22:44].mean(0))
    assert sel.compensation.counts.tolist() == [50 - 2 - 10, 30 - 8, 10 - 8]
    assert torch.equal(sel.indices[2][:2], torch.tensor([40, 41]))


def test_nothing_to_drop_means_no_compensation():
    kv = _kv(n=20)
    sel = Razor(retrieval_heads=frozenset(), sink=4, buffer=16, exact=1).decide([kv], RequestState())[0]
    assert all(torch.equal(i, torch.arange(20)) for i in sel.indices)
    assert sel.compensation.counts.tolist() == [0.0, 0.0, 0.0]


def test_identical_dropped_tokens_make_compensation_exact():
    """If every dropped token is the same (k, v), eq. 5 with one compensation token is exact."""
    kv = _kv(n=40, heads=2, dim=4, dtype=torch.float64)
    kv.keys[:, 4:30] = kv.keys[:, 4:5]
    kv.values[:, 4:30] = kv.values[:, 4:5]
    policy = Razor(retrieval_heads=frozenset(), ratio=0.25, sink=4, buffer=0, exact=1)  # drops slots 4..29
    sel = policy.decide([kv], RequestState())[0]
    q = torch.randn(3, 2, 4, dtype=torch.float64)  # decode queries attend to everything
    full, _ = attention_with_lse(q, kv.keys.transpose(0, 1), kv.values.transpose(0, 1), 0.5)
    idx = sel.indices[0]
    assert torch.equal(idx, sel.indices[1])
    comp = sel.compensation
    out = compensated_attention(
        q, kv.keys[:, idx].transpose(0, 1), kv.values[:, idx].transpose(0, 1),
        comp.keys, comp.values, comp.counts, 0.5,
    )
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    without, _ = attention_with_lse(q, kv.keys[:, idx].transpose(0, 1), kv.values[:, idx].transpose(0, 1), 0.5)
    assert not torch.allclose(without, full, atol=1e-3)


def test_spec_parsing_defaults_and_errors():
    policy = CompressionSpec.from_header("razor").build_policy()
    assert isinstance(policy, Razor)
    assert (policy.ratio, policy.sink, policy.buffer, policy.profile, policy.exact) == (0.5, 4, 512, "default", 0)
    assert policy.queries_needed() == 0 and not Razor.RECOMPRESSES and Razor.PROFILE == "razor"
    policy = CompressionSpec.from_header("policy=razor; ratio=0.3; buffer=100; profile=alt-2; exact=1").build_policy()
    assert (policy.ratio, policy.buffer, policy.profile, policy.exact) == (0.3, 100, "alt-2", 1)
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; exact=2")
    assert err.value.field == "exact" and err.value.allowed == "integer in [0, 1]"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; profile=../etc")
    assert err.value.field == "profile"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; buffer=-1")
    assert err.value.field == "buffer"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("razor; window=4")
    assert err.value.field == "window"
    with pytest.raises(SpecError):
        CompressionSpec.from_mapping({"policy": "razor", "retrieval_heads": "x"})


def test_bind_profile_fills_the_retrieval_heads():
    ident = ModelIdentity("llama", 4, 6, 3, 8, "abc")
    profile = RetrievalHeadsProfile(model=ident, kv_heads=frozenset({(0, 1), (3, 2)}))
    policy = CompressionSpec.from_header("razor; ratio=0.5").build_policy()
    bound = bind_profile(policy, profile)
    assert bound.retrieval_heads == frozenset({(0, 1), (3, 2)}) and bound.ratio == 0.5
    assert policy.retrieval_heads is None


def test_unbound_policy_compresses_every_head():
    sel = Razor(ratio=0.25, buffer=0).decide([_kv(n=64)], RequestState())[0]
    assert sel.counts().tolist() == [16] * 3
    sel = Razor(ratio=0.25, buffer=0, exact=1).decide([_kv(n=64)], RequestState())[0]
    assert sel.counts().tolist() == [4 + 16] * 3


def _two_layers(n: int, heads: int = 3, **kw) -> list[LayerKV]:
    return [_kv(n=n, heads=heads, layer=layer, seed=layer, **kw) for layer in range(2)]


@pytest.mark.parametrize("ratio", [0.5, 0.3, 0.25])
@pytest.mark.parametrize("n", [64, 97, 500])
def test_the_mean_over_every_layer_and_head_is_the_ratio(ratio, n):
    """R = 1 retrieval head of T = 6 keeps the prompt; each other head keeps
    ceil((B·T − R·N) / (T − R)), so the mean over all six is B = ceil(ratio·N) (+ < 1)."""
    policy = Razor(retrieval_heads=frozenset({(1, 2)}), ratio=ratio, sink=4, buffer=512)
    selections = policy.decide(_two_layers(n), RequestState(prompt_len=n))
    counts = torch.cat([sel.counts() for sel in selections])
    budget = math.ceil(ratio * n)
    others = math.ceil((budget * 6 - n) / 5)
    assert counts.tolist() == [others] * 5 + [n]
    assert budget <= float(counts.float().mean()) < budget + 1
    assert float(counts.float().mean()) <= policy.mean_kept_bound(n, num_heads=6) <= budget + 1
    for sel in selections:  # sink + the most recent, the rest in the compensation token
        assert torch.equal(sel.indices[0], torch.cat([torch.arange(4), torch.arange(n - others + 4, n)]))
        assert sel.compensation.counts[0] == n - others
    exact = Razor(retrieval_heads=frozenset({(1, 2)}), ratio=ratio, sink=4, buffer=0, exact=1)
    held = torch.cat([sel.counts() for sel in exact.decide(_two_layers(n), RequestState(prompt_len=n))])
    assert held.tolist() == [4 + budget] * 5 + [n]  # the paper's window: the retrieval head on top


def test_an_infeasible_ratio_keeps_the_floor_and_says_so(caplog):
    """Two retrieval heads of six already hold 1/3 of the cache: at ratio 0.25 the others keep
    their floor (sink + MIN_RECENT); the warning names the smallest feasible ratio."""
    n = 120
    policy = Razor(retrieval_heads=frozenset({(0, 0), (1, 2)}), ratio=0.25, sink=4)
    with caplog.at_level("WARNING", logger="vllm_kvcomp.policies.razor"):
        selections = policy.decide(_two_layers(n), RequestState(prompt_len=n))
    counts = torch.cat([sel.counts() for sel in selections]).tolist()
    assert sorted(counts) == [4 + MIN_RECENT] * 4 + [n, n]
    smallest = (2 * n + 4 * (4 + MIN_RECENT)) / (6 * n)
    assert policy.min_ratio(n, 6, 2) == pytest.approx(smallest)
    assert f"the smallest feasible ratio is {smallest:.4f}" in caplog.text and "ratio=0.25" in caplog.text
    assert policy.mean_kept_bound(n, num_heads=6) == math.ceil(sum(counts) / 6)
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm_kvcomp.policies.razor"):
        Razor(retrieval_heads=frozenset({(0, 0), (1, 2)}), ratio=0.4, sink=4).decide(
            _two_layers(n), RequestState(prompt_len=n))
    assert "infeasible" not in caplog.text


def test_check_fit_refuses_what_the_retrieval_heads_fill_alone():
    """The bundled model: 24 retrieval heads of 90 hold 0.2667 of the cache whatever the prompt."""
    Razor(ratio=0.3).check_fit(24, 90)
    Razor(ratio=0.25, exact=1).check_fit(24, 90)
    Razor(budget=64, ratio=None).check_fit(24, 90)  # prompt-dependent: the engine decides
    for ratio in (0.25, 24 / 90):
        with pytest.raises(SpecError) as err:
            Razor(ratio=ratio).check_fit(24, 90)
        assert err.value.field == "ratio" and "24 retrieval heads" in err.value.message
        assert err.value.allowed.startswith("a number in (0.2667, 1]") and "exact=1" in err.value.allowed


def test_the_server_answers_an_infeasible_ratio_with_a_400(tmp_path, monkeypatch):
    """protocol.resolve with the model's profile: ratio=0.3 is refused naming ``ratio`` and the
    allowed values; ratio=0.5 and exact=1 pass; a request without settings gets the default."""

    from vllm_kvcomp.calibration import profiles
    from vllm_kvcomp.server import protocol
    from vllm_kvcomp.server.operator_config import OperatorConfig

    model = served_model_dir(tmp_path, monkeypatch)
    identity = ModelIdentity.from_model_dir(model)
    profiles.save_profile(RetrievalHeadsProfile(model=identity, kv_heads=frozenset({(0, 1), (2, 0)})),
                          model_dir=model)
    config = OperatorConfig.for_server(None, str(model))
    assert_refuses_infeasible_ratio(config, "razor", 0.3, "0.3333")
    assert protocol.resolve(config, ["policy=razor; ratio=0.5"], {}).ratio == 0.5
    assert protocol.resolve(config, ["policy=razor; ratio=0.25; exact=1"], {}).extras["exact"] == 1
    assert protocol.resolve(config, ["policy=razor"], {}).policy == "razor"  # the default ratio, 0.5, fits


def test_the_server_counts_only_the_layers_the_engine_compresses(tmp_path, monkeypatch):
    """A hybrid model (``layer_types``): the sliding-window layers stay vLLM's, so the retrieval
    heads' share is over the full-attention layers only. Layer 2 of 3 is global and both its KV
    heads are retrieval heads: nothing below 1 is feasible (over all 6 pairs it would look like 1/3)."""
    import json

    from vllm_kvcomp.calibration import profiles
    from vllm_kvcomp.server import protocol
    from vllm_kvcomp.server.operator_config import OperatorConfig

    model = served_model_dir(tmp_path, monkeypatch)
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]
    (model / "config.json").write_text(json.dumps(config))
    profiles.save_profile(RetrievalHeadsProfile(model=ModelIdentity.from_model_dir(model),
                                                kv_heads=frozenset({(2, 0), (2, 1)})), model_dir=model)
    served = OperatorConfig.for_server(None, str(model))
    assert_refuses_infeasible_ratio(served, "razor", 0.5, "1.0000")
    assert protocol.resolve(served, ["policy=razor; ratio=0.5; exact=1"], {}).extras["exact"] == 1


@pytest.fixture(scope="module")
def tiny_oracle(tmp_path_factory):
    """The HF oracle's tiny Llama: 3 layers x 2 KV heads (T = 6 pairs)."""
    from tests.helpers.tiny_llama import make_tiny_llama
    from vllm_kvcomp.oracle import load_model

    path = make_tiny_llama(tmp_path_factory.mktemp("razor") / "tiny", num_layers=3, hidden_size=192,
                           num_heads=6, num_kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=512)
    return load_model(path), ModelIdentity.from_model_dir(path)


@pytest.mark.parametrize("n", [300, 700])
def test_the_oracle_holds_the_ratio_within_a_page(tiny_oracle, n):
    """Issue #28: at ratio 0.25, on 32-token pages, the held fraction the engine reports
    (kept cells over T·N after the compaction) is within one page per prompt of 0.25; the paper's
    window (exact=1) holds far more."""
    from vllm_kvcomp.oracle import generate

    model, identity = tiny_oracle
    profile = RetrievalHeadsProfile(model=identity, kv_heads=frozenset({(1, 0)}))  # R/T = 1/6
    prompt = [(7 * i * i + 3 * i) % 509 + 3 for i in range(n)]
    held = {}
    for exact in (0, 1):
        policy = CompressionSpec.from_mapping({"policy": "razor", "ratio": 0.25, "buffer": 64,
                                               "exact": exact}).build_policy()
        (record,) = generate(model, prompt, policy, 2, profile=profile, block_size=32).compressions
        held[exact] = sum(map(sum, record["kept"])) / (6 * record["num_tokens"])
    assert abs(held[0] - 0.25) <= 32 / n, held
    assert held[1] > 0.25 + 32 / n, held
