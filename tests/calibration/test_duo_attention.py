"""DuoAttention gate calibration: the synthetic passkey samples, streaming attention, the authors'
loss and schedule, training a tiny random Llama (seconds), the profile's round trip and identity."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.policies.conftest import _one_thread  # noqa: F401  (autouse: tiny tensors, one thread)
from vllm_kvcomp.calibration import duo_attention as duo
from vllm_kvcomp.calibration.profiles import (
    HeadGatesProfile,
    ModelIdentity,
    ProfileError,
    from_json,
    load_profile,
    save_profile,
    to_json,
)


def encode(text: str) -> list[int]:
    """Word-level stand-in tokenizer: words, punctuation and newlines, ids 3..127."""
    return [3 + sum(map(ord, token)) % 125 for token in re.findall(r"\w+|[^\w ]", text)]


def test_a_sample_is_the_authors_layout_with_the_answers_masked():
    hay = list(range(1000, 1100))
    sample = duo.passkey_sample(encode, hay, [0.2, 0.7], ["alpha bravo", "zulu"], prefix=[1])
    sep = encode(duo.SEPARATOR)
    needle = [encode(duo.NEEDLE.format(ordinal=o)) for o in ("first", "second")]
    question = [encode(duo.QUESTION.format(ordinal=o)) for o in ("first", "second")]
    head = [1, *encode(duo.OPEN), *hay[:20], *sep, *needle[0], *encode("alpha bravo"), *sep, *hay[20:70], *sep,
            *needle[1], *encode("zulu"), *sep, *hay[70:], *encode(duo.CLOSE)]
    qa = [*question[0], *encode("alpha bravo"), *sep, *question[1], *encode("zulu"), *sep]
    assert sample.input_ids.tolist() == head + qa
    assert sample.answer.tolist() == [False] * len(head) + [True] * len(qa)


def _haystack_tokens(sample: duo.PasskeySample, passkeys: int) -> int:
    """Haystack tokens in a sample of :func:`encode` (the passkeys' length read off the answers)."""
    ordinals = duo.ORDINALS[:passkeys]
    sep = len(encode(duo.SEPARATOR))
    keys = int(sample.answer.sum()) - sum(len(encode(duo.QUESTION.format(ordinal=o))) + sep for o in ordinals)
    fixed = 1 + len(encode(duo.OPEN)) + len(encode(duo.CLOSE))
    fixed += sum(len(encode(duo.NEEDLE.format(ordinal=o))) + 2 * sep for o in ordinals)
    return len(sample.input_ids) - fixed - keys - int(sample.answer.sum())


def test_samples_visit_every_context_length_per_pass_and_follow_the_seed():
    kw = dict(min_length=40, max_length=100, intervals=4, passkeys=3, passkey_words=5, prefix=[1])
    samples = list(duo.passkey_samples(encode, 8, seed=3, **kw))
    grid = torch.linspace(40, 100, 4).long().tolist()
    lengths = [_haystack_tokens(s, 3) for s in samples]
    assert sorted(lengths[:4]) == grid and sorted(lengths[4:]) == grid
    again = list(duo.passkey_samples(encode, 8, seed=3, **kw))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, again))
    other = list(duo.passkey_samples(encode, 8, seed=4, **kw))
    assert any(not torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, other))
    with pytest.raises(ValueError, match="passkeys"):
        next(duo.passkey_samples(encode, 1, seed=0, **{**kw, "passkeys": 11}))


@pytest.mark.parametrize(("t", "sink", "recent"), [(1, 0, 1), (7, 2, 3), (50, 4, 8), (100, 16, 64), (33, 40, 5),
                                                   (65, 3, 1), (64, 0, 64)])
def test_blocked_streaming_attention_is_attention_under_the_streaming_mask(t, sink, recent):
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(h, t, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    mask = duo.streaming_mask(t, sink, recent)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0),
                                              attn_mask=mask, scale=0.3)
    torch.testing.assert_close(duo.streaming_attention(q, k, v, sink, recent, 0.3), expected, rtol=1e-12, atol=1e-12)
    assert mask[-1].sum() == min(t, recent + min(sink, max(0, t - recent)))


def test_schedule_and_loss_are_the_authors():
    """lr factor ``min(1, max((s+1)/(n//5), 0.1), max((n−s)/(n//5), 0.1))``; loss = mean over
    answer tokens of mean_d (h − h')² + reg · mean |α|."""
    assert [duo.lr_factor(s, 10) for s in (0, 1, 5, 8, 9)] == [0.5, 1.0, 1.0, 1.0, 0.5]
    assert duo.lr_factor(0, 100) == 0.1 and duo.lr_factor(99, 100) == 0.1 and duo.lr_factor(3, 3) == 0.1
    target = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    loss, distill, l1 = duo.gate_loss(target, torch.zeros(3, 2), torch.tensor([False, True, True]),
                                      torch.tensor([[0.5, 1.0]]), reg=0.1)
    assert (float(distill), float(l1)) == (21.5, 0.75) and float(loss) == pytest.approx(21.575)


def _tiny_llama(zero_values: int | None = None):
    """2 layers x 2 KV heads x 2 query heads each, random weights; ``zero_values``: that KV head's
    value projection is zero in every layer (its attention output is 0 whatever it attends to)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    if zero_values is not None:
        dim = config.hidden_size // config.num_attention_heads
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.v_proj.weight[zero_values * dim:(zero_values + 1) * dim] = 0
    return model, ModelIdentity.from_config(config)


SMALL = dict(steps=6, min_length=40, max_length=80, intervals=3, sink=2, recent=8, passkeys=2, passkey_words=3)


def _pure_l1(steps: int, lr: float) -> float:
    """A gate whose distillation gradient is 0 under AdamW: it falls by lr · factor each step."""
    return 1.0 - lr * sum(duo.lr_factor(s, steps) for s in range(steps))


def test_gates_start_at_the_model_and_the_l1_penalty_alone_lowers_idle_heads():
    """At α = 1 the gated model is the model (first distillation loss 0). A KV head with zero
    values loses nothing by streaming: its gate follows the pure L1 path; the live head's gates
    are held up by the distillation loss."""
    model, identity = _tiny_llama(zero_values=1)
    profile = duo.calibrate_duo_attention(model, encode, identity, prefix=[1], progress=False, **SMALL)
    assert profile.settings["final_distill"] > 0
    gates = torch.tensor(profile.gates)
    idle = _pure_l1(SMALL["steps"], duo.DEFAULTS["lr"])
    torch.testing.assert_close(gates[:, 1], torch.full((2,), idle), rtol=0, atol=1e-5)
    assert bool((gates[:, 0] > idle + 1e-4).all()), gates


def test_a_window_covering_every_sample_makes_streaming_free(monkeypatch):
    """sink + recent ≥ T: streaming attention is full attention, every gate follows the L1 path."""
    model, identity = _tiny_llama()
    history = []
    train = duo.train_gates

    def spy(*args, **kwargs):
        gates, losses = train(*args, **kwargs)
        history.extend(losses)
        return gates, losses

    monkeypatch.setattr(duo, "train_gates", spy)
    profile = duo.calibrate_duo_attention(model, encode, identity, prefix=[1], progress=False,
                                          **{**SMALL, "recent": 4096})
    assert max(history) < 1e-10
    idle = _pure_l1(SMALL["steps"], duo.DEFAULTS["lr"])
    torch.testing.assert_close(torch.tensor(profile.gates), torch.full((2, 2), idle), rtol=0, atol=1e-5)


def test_calibration_is_deterministic_and_the_profile_round_trips(tmp_path):
    model, identity = _tiny_llama()
    first = duo.calibrate_duo_attention(model, encode, identity, prefix=[1], progress=False, seed=5, **SMALL)
    second = duo.calibrate_duo_attention(model, encode, identity, prefix=[1], progress=False, seed=5, **SMALL)
    assert first.gates == second.gates and first.gates != tuple((1.0, 1.0) for _ in range(2))
    assert first.settings["steps"] == SMALL["steps"] and first.settings["method"] == "duoattention-gates"
    path = save_profile(first, path=tmp_path / "duoattention.json")
    loaded = load_profile("duoattention", path=path, expect=identity)
    assert (loaded.gates, loaded.threshold, loaded.model) == (first.gates, first.threshold, identity)
    other = ModelIdentity.from_config({**model.config.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(ProfileError, match="num_layers"):
        load_profile("duoattention", path=path, expect=other)
    with pytest.raises(ValueError, match="unknown settings"):
        duo.calibrate_duo_attention(model, encode, identity, progress=False, stepz=3)


@pytest.mark.parametrize(("data", "message"), [
    ({"gates": [[0.5, 0.5]]}, "2 rows of 2"),
    ({"gates": [[0.5, 0.5], [0.5, 1.5]]}, r"\[0, 1\]"),
    ({"gates": [[0.5, 0.5], [0.5, 0.5]], "threshold": 2}, "threshold"),
    ({"gates": [[0.5, "x"], [0.5, 0.5]]}, "numbers"),
    ({}, "data.gates must be a list"),
])
def test_malformed_gate_profiles_name_what_is_wrong(data, message):
    identity = ModelIdentity("llama", 2, 4, 2, 8, "abc")
    doc = to_json(HeadGatesProfile(model=identity, gates=((0.5, 0.5), (0.5, 0.5))))
    with pytest.raises(ProfileError, match=message):
        from_json({**doc, "data": data})
