"""The NIAH probe's bookkeeping on a hand-made layer (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.eval.probe import Probe, token_span
from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.streamingllm import StreamingLLM


def test_token_span_overlaps_characters() -> None:
    offsets = [(0, 3), (3, 4), (4, 7), (7, 7), (7, 9)]
    assert token_span(offsets, 3, 8) == [1, 2, 4]  # the empty (7, 7) token is skipped
    assert token_span(offsets, 9, 12) == []


def _row(probs: dict[int, float], n: int = 10) -> list[float]:
    return [math.log(probs[j]) if j in probs else -60.0 for j in range(n)]


def test_probe_measures_window_and_answer_attention_and_what_a_policy_keeps() -> None:
    """Prompt of 8 tokens (needle at 2, 3), 2 teacher-forced tokens; key j = e_j, scale 1.
    Window queries 6, 7 put 0.1 + 0.1 and 0.2 + 0.0 on the needle -> 0.2 on average; the
    digit queries 8, 9 put 0.9 and 0.7 -> 0.8. StreamingLLM (budget 3, sink 1) keeps 0, 6, 7:
    none of the needle."""
    window = [{2: 0.1, 3: 0.1, 6: 0.8}, {2: 0.2, 7: 0.8}]
    digits = [{2: 0.5, 3: 0.4, 8: 0.1}, {3: 0.7, 9: 0.3}]
    early = [{j: 1.0 / (p + 1) for j in range(p + 1)} for p in (4, 5)]  # positions 4, 5: unused
    queries = torch.tensor([_row(r) for r in [*early, *window, *digits]]).unsqueeze(0)
    kv = LayerKV(torch.eye(10).unsqueeze(0), torch.zeros(1, 10, 10), queries=queries,
                 query_positions=torch.arange(4, 10), scale=1.0)
    probe = Probe(prompt_len=8, window=2, digits=(8, 9), needle=(2, 3), key=(1,),
                  policies={"streamingllm": StreamingLLM(budget=3, sink=1)})
    assert probe.queries_needed() == 10 - (8 - 2)
    kept = probe.decide([kv], RequestState())
    assert kept[0].indices[0].tolist() == list(range(10))  # the probe itself keeps everything
    assert probe.stats["observe"][0][0] == pytest.approx(0.2, abs=1e-6)
    assert probe.stats["retrieve"][0][0] == pytest.approx(0.8, abs=1e-6)
    assert probe.stats["kept:streamingllm"] == [[0.0]]
