"""``decode``: the generated tokens kept (``keep``) or recompressed back to the prompt's budget
(``recompress``); unset, each method does what its paper does. The recompressions themselves keep
every invariant of the shared matrix (tests/policies/test_matrix.py, ``decode=recompress`` cases)."""

from __future__ import annotations

import pytest

from tests.policies.conftest import compressions, make_policy
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.base import Policy
from vllm_kvcomp.policies.registry import (
    compressing_policy_names,
    get_policy_class,
    recompressing_policy_names,
)
from vllm_kvcomp.spec import CompressionSpec


@pytest.mark.parametrize("name", compressing_policy_names())
def test_decode_setting_decides_whether_the_engine_recompresses(name):
    cls = get_policy_class(name)
    assert make_policy(name).recompresses == cls.RECOMPRESSES
    assert not make_policy(name, decode="keep").recompresses
    if cls.CAN_RECOMPRESS:
        assert make_policy(name, decode="recompress").recompresses
    else:
        with pytest.raises(SpecError) as err:
            make_policy(name, decode="recompress")
        assert err.value.field == "decode" and name not in err.value.allowed.split(", ")


def test_full_cannot_recompress_and_every_compressing_policy_can():
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "full", "decode": "recompress"})
    assert err.value.field == "decode"
    assert "snapkv" in err.value.allowed and "pod" in err.value.allowed and "full" not in err.value.allowed
    assert recompressing_policy_names() == compressing_policy_names()


def test_decode_values_and_scope_are_checked():
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "snapkv", "decode": "sometimes"})
    assert err.value.field == "decode" and err.value.allowed == "keep, recompress"
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_mapping({"policy": "snapkv", "decode": "recompress", "scope": "context"})
    assert err.value.field == "decode" and err.value.allowed == "keep"
    spec = CompressionSpec.from_mapping({"policy": "h2o", "decode": "keep", "scope": "context"})
    assert not spec.build_policy().recompresses


def test_keep_stops_a_recompressing_method_after_the_prompt(fake_request):
    request = fake_request(40, 2, 1, seed=4)
    assert len(list(compressions(make_policy("h2o", decode="keep"), request, decode_steps=40))) == 1
    request = fake_request(40, 2, 1, seed=4)
    assert len(list(compressions(make_policy("h2o"), request, decode_steps=40))) > 1


def test_a_one_shot_policy_asked_to_recompress_holds_its_budget_through_decode(fake_request):
    """snapkv keeps B per head after the prompt and again at every recompression, so a long
    output never holds more than B + one page (what makes a recompression due; no page grid
    here: one token)."""
    request = fake_request(64, 2, 3, seed=5)
    policy = make_policy("snapkv", ratio=0.25, window=4, decode="recompress")
    done = list(compressions(policy, request, decode_steps=100))
    assert len(done) >= 6
    budget = done[0].state.budget
    for each in done:
        assert all(sel.counts().tolist() == [budget] * 2 for sel in each.selections)
    assert request.max_live() <= budget + 1


def test_pyramidkv_returns_each_layer_to_its_first_budget(fake_request):
    request = fake_request(90, 2, 1, num_layers=4, seed=2)
    policy = make_policy("pyramidkv", ratio=0.4, window=6, beta=5, decode="recompress")
    done = list(compressions(policy, request, decode_steps=60))
    assert len(done) >= 3
    first = [sel.counts().tolist() for sel in done[0].selections]
    assert len({counts[0] for counts in first}) == 4, "the pyramid gives each layer its own budget"
    for each in done[1:]:
        assert [sel.counts().tolist() for sel in each.selections] == first
    assert done[-1].state.budget == max(c[0] for c in first)


@pytest.mark.parametrize("name", [n for n in recompressing_policy_names()
                                  if "interval" in get_policy_class(n).accepted_params()])
def test_interval_spaces_the_recompressions(name, fake_request):
    """``interval=N``: at most one recompression per N decode steps, for every policy it paces
    (a one-shot policy under ``decode=recompress`` too; which policies an interval paces:
    test_matrix's ``test_an_interval_means_recompression``)."""
    decode = {} if get_policy_class(name).RECOMPRESSES else {"decode": "recompress"}
    steps, every = 60, 20
    done = list(compressions(make_policy(name, interval=every, **decode), fake_request(64, 2, 3, seed=6),
                             decode_steps=steps))
    assert 2 <= len(done) <= 1 + steps // every


@pytest.mark.parametrize("name", recompressing_policy_names())
def test_a_decision_that_reads_no_cache_does_not_need_it(name, fake_request, monkeypatch):
    """``reads_cache`` False (the engine then gives NaN keys and no values): the decisions of a
    prompt and its decode recompressions equal those made with the real keys and values, for
    every policy that recompresses; the sliding policies do skip the reads."""
    decode = {} if get_policy_class(name).RECOMPRESSES else {"decode": "recompress"}
    params = {"interval": 4} if "interval" in get_policy_class(name).accepted_params() else {}

    def run(policy):
        return [[idx.tolist() for sel in each.selections for idx in sel.indices]
                for each in compressions(policy, fake_request(64, 2, 3, seed=7), decode_steps=40)]

    policy = make_policy(name, **decode, **params)
    skipped = []
    reads_cache = type(policy).reads_cache

    def counted(self, state):
        reads = reads_cache(self, state)
        skipped.append(not reads)
        return reads

    monkeypatch.setattr(type(policy), "reads_cache", counted)
    unread = run(policy)
    monkeypatch.setattr(type(policy), "reads_cache", lambda self, state: True)
    assert len(unread) >= 3 and unread == run(make_policy(name, **decode, **params))
    if reads_cache is not Policy.reads_cache:  # a policy that says when it reads nothing (the sliding ones)
        assert sum(skipped) >= 2  # every decode recompression
