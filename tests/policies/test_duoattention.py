"""DuoAttention policy: retrieval heads from the trained gates, what each head type keeps, the
mean kept fraction, infeasible ratios (policy and server), the paper's window, spec and binding."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.policies.conftest import assert_refuses_infeasible_ratio, served_model_dir
from vllm_kvcomp.calibration.profiles import HeadGatesProfile, ModelIdentity, bind_profile
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.duoattention import DuoAttention, retrieval_heads
from vllm_kvcomp.policies.head_split import MIN_RECENT
from vllm_kvcomp.spec import CompressionSpec

#: 2 layers x 3 KV heads; at the default threshold 0.5 the retrieval heads are (0, 1) and (1, 2)
GATES = ((0.1, 0.9, 0.3), (0.0, 0.45, 0.5))


def _layers(n: int, heads: int = 3, layers: int = 2, lengths: list[int] | None = None) -> list[LayerKV]:
    out = []
    for layer in range(layers):
        g = torch.Generator().manual_seed(layer)
        out.append(LayerKV(torch.randn(heads, n, 8, generator=g), torch.randn(heads, n, 8, generator=g), layer=layer,
                           num_layers=layers, lengths=None if lengths is None else torch.tensor(lengths)))
    return out


def _policy(**settings) -> DuoAttention:
    return DuoAttention(gates=GATES, **settings)


def test_retrieval_heads_are_the_gates_at_or_above_the_threshold():
    assert retrieval_heads(GATES) == {(0, 1), (1, 2)}  # 0.5 counts, 0.45 does not
    assert retrieval_heads(GATES, threshold=0.3) == {(0, 1), (0, 2), (1, 1), (1, 2)}
    assert _policy(threshold=0.95).retrieval_set() == frozenset()
    assert DuoAttention().retrieval_set() is None  # no profile bound


def test_sparsity_makes_the_lowest_gates_streaming_heads_as_kvpress_rounds():
    """kvpress: ``n_pruned = round(T · head_compression_ratio)`` lowest scores are streaming heads
    (T = 6 here); the threshold is then ignored. Ties go to the lower (layer, head) pair first."""
    assert retrieval_heads(GATES, sparsity=0.5) == {(0, 1), (1, 2), (1, 1)}  # round(3.0) = 3 streaming
    assert retrieval_heads(GATES, sparsity=0.25) == {(0, 1), (1, 2), (1, 1), (0, 2)}  # round(1.5) = 2
    assert retrieval_heads(GATES, sparsity=0.0) == {(layer, h) for layer in range(2) for h in range(3)}
    assert retrieval_heads(GATES, sparsity=1.0) == frozenset()
    tied = ((0.2, 0.2), (0.2, 0.2))
    assert retrieval_heads(tied, sparsity=0.5) == {(1, 0), (1, 1)}
    assert _policy(sparsity=0.5, threshold=0.99).retrieval_set() == {(0, 1), (1, 2), (1, 1)}


@pytest.mark.parametrize("n", [60, 97, 400])
@pytest.mark.parametrize("ratio", [0.5, 0.4])
def test_retrieval_heads_keep_everything_streaming_heads_sink_and_recent(n, ratio):
    """R = 2 of T = 6 pairs keep the prompt; the four streaming heads keep ``sink`` and the most
    recent tokens, ceil((B·T − R·N) / (T − R)) in all, so the mean over the six is B."""
    policy = _policy(ratio=ratio, sink=4)
    selections = policy.decide(_layers(n), RequestState(prompt_len=n))
    budget = math.ceil(ratio * n)
    keep = math.ceil((budget * 6 - 2 * n) / 4)
    streaming = torch.cat([torch.arange(4), torch.arange(n - keep + 4, n)])
    for layer, sel in enumerate(selections):
        for h, idx in enumerate(sel.indices):
            expected = torch.arange(n) if (layer, h) in {(0, 1), (1, 2)} else streaming
            assert torch.equal(idx, expected), (layer, h)
        assert sel.compensation is None  # no RazorAttention compensation token
    counts = torch.cat([sel.counts() for sel in selections]).float()
    assert budget <= float(counts.mean()) < budget + 1
    assert float(counts.mean()) <= policy.mean_kept_bound(n, num_heads=6)


@pytest.mark.parametrize("sparsity", [None, 0.5, 0.75])  # 2, 3 and 2 retrieval heads of 6
@pytest.mark.parametrize(("n", "ratio"), [(300, 0.6), (700, 0.7), (1000, 0.55)])
def test_the_ratio_is_the_mean_kept_fraction_within_one_page(n, ratio, sparsity):
    """On a 32-token page grid the held fraction over every (layer, KV head) pair is within one
    page of ``ratio`` (Policy.decide rounds each head up to the grid by recency)."""
    page = 32
    policy = _policy(ratio=ratio, sink=4, sparsity=sparsity)
    state = RequestState(prompt_len=n, page_quantum=(page, n % page))
    counts = torch.cat([sel.counts() for sel in policy.decide(_layers(n), state)]).float()
    held = float(counts.mean()) / n
    assert ratio <= held <= ratio + page / n, held


def test_exact_mode_keeps_the_papers_sink_and_recent_whatever_the_ratio():
    """exact=1: a streaming head keeps ``sink`` + ``recent`` (the authors' deployment: 64 + 256),
    the retrieval heads everything on top; ratio and budget do not change it."""
    n = 1000
    for settings in ({"ratio": 0.1}, {"ratio": 0.9}, {"budget": 50, "ratio": None}):
        selections = _policy(exact=1, **settings).decide(_layers(n), RequestState(prompt_len=n))
        for layer, sel in enumerate(selections):
            for h, idx in enumerate(sel.indices):
                if (layer, h) in {(0, 1), (1, 2)}:
                    assert torch.equal(idx, torch.arange(n))
                else:
                    assert torch.equal(idx, torch.cat([torch.arange(64), torch.arange(n - 256, n)]))
    short = _policy(exact=1).decide(_layers(200), RequestState(prompt_len=200))  # 64 + 256 > 200: all kept
    assert all(torch.equal(idx, torch.arange(200)) for sel in short for idx in sel.indices)


def test_ragged_heads_keep_their_own_sink_and_newest_slots():
    n = 80
    lengths = [80, 50, 30]
    sel = _policy(exact=1, sink=2, recent=10).decide(_layers(n, lengths=lengths)[:1], RequestState(prompt_len=n))[0]
    assert torch.equal(sel.indices[0], torch.cat([torch.arange(2), torch.arange(70, 80)]))
    assert torch.equal(sel.indices[1], torch.arange(30, 80))  # (0, 1): retrieval head
    assert torch.equal(sel.indices[2], torch.cat([torch.arange(50, 52), torch.arange(70, 80)]))


def test_an_infeasible_ratio_is_refused_by_the_policy_and_served_at_the_floor(caplog):
    """The two retrieval heads of six hold 1/3 of the cache: check_fit refuses ratio ≤ 1/3 naming
    the field and the allowed values; in the engine the others keep sink + MIN_RECENT and a warning
    names the smallest feasible ratio."""
    _policy(ratio=0.34).check_fit(2, 6)
    _policy(ratio=0.2, exact=1).check_fit(2, 6)
    for ratio in (0.3, 1 / 3):
        with pytest.raises(SpecError) as err:
            _policy(ratio=ratio).check_fit(2, 6)
        assert err.value.field == "ratio" and "duoattention profile" in err.value.message
        assert err.value.allowed.startswith("a number in (0.3333, 1]") and "sparsity" in err.value.allowed
    n = 120
    with caplog.at_level("WARNING", logger="vllm_kvcomp.policies.duoattention"):
        selections = _policy(ratio=0.25, sink=4).decide(_layers(n), RequestState(prompt_len=n))
    assert sorted(torch.cat([s.counts() for s in selections]).tolist()) == [4 + MIN_RECENT] * 4 + [n, n]
    smallest = (2 * n + 4 * (4 + MIN_RECENT)) / (6 * n)
    assert f"the smallest feasible ratio is {smallest:.4f}" in caplog.text and "duoattention" in caplog.text


def _served_model(tmp_path, monkeypatch, gates=None):
    """A model folder (3 layers x 2 KV heads) with a duoattention profile (if ``gates``) and an
    empty package store."""
    from vllm_kvcomp.calibration import profiles

    model = served_model_dir(tmp_path, monkeypatch)
    if gates is not None:
        identity = ModelIdentity.from_model_dir(model)
        profiles.save_profile(HeadGatesProfile(model=identity, gates=gates), model_dir=model)
    return model


def test_the_server_answers_an_infeasible_ratio_with_a_400(tmp_path, monkeypatch):
    """Gates ≥ 0.5 in 2 of 6 pairs: ratio 0.3 is refused naming ``ratio`` where the client wrote
    it; a larger sparsity (fewer retrieval heads) or exact=1 makes it feasible."""
    from vllm_kvcomp.server import protocol
    from vllm_kvcomp.server.operator_config import OperatorConfig

    model = _served_model(tmp_path, monkeypatch, gates=((0.9, 0.1), (0.2, 0.3), (0.0, 0.6)))
    config = OperatorConfig.for_server(None, str(model))
    assert_refuses_infeasible_ratio(config, "duoattention", 0.3, "0.3333")
    assert protocol.resolve(config, ["policy=duoattention; ratio=0.3; sparsity=0.9"], {}).ratio == 0.3
    assert protocol.resolve(config, ["policy=duoattention; ratio=0.3; exact=1"], {}).extras["exact"] == 1
    assert protocol.resolve(config, ["policy=duoattention"], {}).policy == "duoattention"  # 0.5 fits


def test_a_server_without_the_profile_names_the_calibrate_command(tmp_path, monkeypatch):
    from vllm_kvcomp.server import protocol
    from vllm_kvcomp.server.operator_config import OperatorConfig

    model = _served_model(tmp_path, monkeypatch)
    config = OperatorConfig.for_server(None, str(model))
    assert "duoattention" not in config.usable_policies()
    with pytest.raises(protocol.RequestError) as err:
        protocol.resolve(config, ["policy=duoattention; ratio=0.5"], {})
    body = json.loads(err.value.to_json())["error"]
    assert body["code"] == 400 and err.value.param == "X-KV-Compression.policy"
    assert f"vllm-kvcomp calibrate --model {model} --kind duoattention" in body["message"]


def test_spec_defaults_ranges_and_errors():
    policy = CompressionSpec.from_header("duoattention").build_policy()
    assert isinstance(policy, DuoAttention)
    assert (policy.ratio, policy.sink, policy.recent, policy.sparsity, policy.exact) == (0.5, 64, 256, None, 0)
    assert policy.queries_needed() == 0 and not DuoAttention.RECOMPRESSES and DuoAttention.PROFILE == "duoattention"
    policy = CompressionSpec.from_header("policy=duoattention; ratio=0.4; sparsity=0.75; recent=128; exact=1").build_policy()
    assert (policy.ratio, policy.sparsity, policy.recent, policy.exact) == (0.4, 0.75, 128, 1)
    for header, field in (("duoattention; sparsity=1.5", "sparsity"), ("duoattention; recent=0", "recent"),
                          ("duoattention; exact=2", "exact"), ("duoattention; profile=../x", "profile"),
                          ("duoattention; window=4", "window"), ("duoattention; buffer=4", "buffer")):
        with pytest.raises(SpecError) as err:
            CompressionSpec.from_header(header)
        assert err.value.field == field, header
    with pytest.raises(SpecError):
        CompressionSpec.from_mapping({"policy": "duoattention", "gates": [[1.0]]})


def test_bind_profile_fills_gates_and_threshold():
    identity = ModelIdentity("llama", 2, 6, 3, 8, "abc")
    profile = HeadGatesProfile(model=identity, gates=GATES, threshold=0.4)
    bound = bind_profile(CompressionSpec.from_header("duoattention; ratio=0.6").build_policy(), profile)
    assert bound.gates == GATES and bound.threshold == 0.4 and bound.ratio == 0.6
    assert bound.retrieval_set() == {(0, 1), (1, 1), (1, 2)}


def test_compression_runs_once_the_papers_streaming_window_does_not_slide_in_decode():
    """Deviation (as kvpress): one compression after prefill; the paper's streaming heads keep a
    constant sink + recent cache during decode. Decode tokens accumulate until the request ends."""
    assert not DuoAttention.RECOMPRESSES and DuoAttention.interval is None  # an interval only with decode=recompress
