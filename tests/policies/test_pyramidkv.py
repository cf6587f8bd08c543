"""PyramidKV: the paper's arithmetic layer budgets (mean = the requested budget), SnapKV inside
each layer."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.conftest import make_policy
from vllm_kvcomp.policies.base import RequestState
from vllm_kvcomp.policies.pyramidkv import PyramidKV, pyramid_budgets
from vllm_kvcomp.policies.snapkv import SnapKV


@pytest.mark.parametrize(("layers", "target", "length", "window", "beta", "expected"), [
    (4, 30, 100, 6, 4, [48, 36, 24, 12]),  # top 24: 42, 30, 18, 6 (+6)
    (3, 60, 80, 10, 20, [80, 60, 40]),  # 97.5 > N - w = 70: capped, the bottom rises to 30
    (3, 10, 100, 2, 3, [15, 10, 5]),  # 13.33, 8, 2.67: largest remainder gives the last layer 3
    (4, 8, 100, 2, 4, [13, 10, 6, 3]),  # 10.5, 7.5, 4.5, 1.5: equal remainders go to the lower layers
    (3, 6, 100, 8, 20, [6, 6, 6]),  # T <= window: uniform
    (3, 100, 100, 8, 20, [100, 100, 100]),  # T = N: uniform
    (1, 40, 100, 8, 20, [40]),
])
def test_budgets_by_hand(layers, target, length, window, beta, expected):
    assert pyramid_budgets(layers, target, length, window, beta) == expected


@pytest.mark.parametrize("seed", range(20))
def test_budgets_are_the_arithmetic_sequence_rounded_with_mean_exactly_target(seed):
    gen = torch.Generator().manual_seed(seed)
    layers, window, beta = (int(x) for x in torch.randint(2, 40, (3,), generator=gen))
    length = window + int(torch.randint(2, 3000, (1,), generator=gen))
    target = window + 1 + int(torch.randint(0, length - window - 1, (1,), generator=gen))
    top = target - window
    low, high = top / beta, 2 * top - top / beta
    if high > length - window:
        high, low = length - window, 2 * top - (length - window)
    real = [window + high - i * (high - low) / (layers - 1) for i in range(layers)]
    got = pyramid_budgets(layers, target, length, window, beta)
    assert sum(got) == layers * target
    assert all(abs(b - r) < 1 for b, r in zip(got, real)), (got, real)
    assert got == sorted(got, reverse=True) and window <= got[-1] and got[0] <= length


def kvpress_budgets(num_layers: int, q_len: int, compression_ratio: float, window: int, beta: int) -> list[int]:
    """Every layer's budget as kvpress 0.5.5 computes it (``PyramidKVPress.get_layer_budget`` in
    ``kvpress/presses/pyramidkv_press.py``), the same float arithmetic, layer by layer: a sequence
    over the whole mean budget, window included, ``round()``ed, and SnapKV's uniform budget unless
    ``q_len ≥ max ≥ min ≥ window``."""
    mean = q_len * (1 - compression_ratio)
    low = mean / beta
    high = mean * 2 - low
    if high >= q_len - window:
        high = q_len - window
        low = mean * 2 - high
    if not q_len >= high >= low >= window:
        return [max(1, round(mean))] * num_layers
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(high - layer * step) for layer in range(num_layers)]


@pytest.mark.parametrize(("layers", "length", "compression", "target", "window", "beta", "ours"), [
    (4, 200, 0.8, 40, 16, 4, [58, 46, 34, 22]),  # kvpress's last layer would hold K/beta = 10 < 16
    (30, 619, 0.75, 155, 64, 20, None),  # issue #70's prompt at kvpress's defaults: 7.7 < 64
    (3, 128, 0.5625, 56, 32, 4, [74, 56, 38]),  # kvpress capped at N - w: its last layer 16 < 32
])
def test_kvpress_falls_back_to_snapkv_where_its_last_layer_would_hold_less_than_the_window(
        layers, length, compression, target, window, beta, ours):
    """kvpress keeps ``round(K)`` in every layer there; ours still builds the pyramid (mean T)."""
    assert kvpress_budgets(layers, length, compression, window, beta) == [target] * layers
    got = pyramid_budgets(layers, target, length, window, beta)
    assert sum(got) == layers * target and got[0] > target > got[-1] >= window
    assert got == ours if ours is not None else (got[0], got[-1]) == (241, 69)


@pytest.mark.parametrize(("layers", "length", "compression", "target", "window", "beta", "kvpress", "ours"), [
    (4, 1000, 0.625, 375, 16, 4, [656, 469, 281, 94], [644, 465, 285, 106]),  # K = 375 ≥ beta·w = 64
    (3, 128, 0.375, 80, 16, 20, [112, 80, 48], [128, 80, 32]),  # both capped at N - w; K = 80 ≥ N/2
])
def test_where_kvpress_builds_a_pyramid_its_sequence_includes_the_window_ours_adds_it(
        layers, length, compression, target, window, beta, kvpress, ours):
    """Same mean, another shape: kvpress's last layer holds K/beta window included (uncapped), ours
    w + (T - w)/beta."""
    assert kvpress_budgets(layers, length, compression, window, beta) == kvpress
    assert pyramid_budgets(layers, target, length, window, beta) == ours
    assert sum(ours) == layers * target


@pytest.mark.parametrize("length", [100, 619, 2048, 8192])
@pytest.mark.parametrize("compression", [0.25, 0.5, 0.75, 0.9])
@pytest.mark.parametrize(("window", "beta"), [(16, 4), (64, 20)])
def test_kvpress_fallback_rule_as_the_docstring_states_it(length, compression, window, beta):
    """Uncapped, kvpress falls back whenever K < beta·w; capped (its top at N - w), whenever
    K < N/2 or K > N - w. Ours is a strict pyramid whenever w < T < N."""
    mean = length * (1 - compression)
    capped = 2 * mean - mean / beta >= length - window
    falls_back = (mean < length / 2 or mean > length - window) if capped else mean < beta * window
    budgets = kvpress_budgets(30, length, compression, window, beta)
    assert (len(set(budgets)) == 1) == falls_back
    target = math.ceil(mean)
    ours = pyramid_budgets(30, target, length, window, beta)
    if window < target < length:
        assert ours[0] > ours[-1] >= window and sum(ours) == 30 * target


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_each_layer_keeps_what_snapkv_keeps_at_that_layers_budget(heads, fake_request):
    request = fake_request(90, 2, 3, num_layers=4, seed=2)
    policy = make_policy("pyramidkv", ratio=0.4, window=6, beta=5, heads=heads)
    layers = request.layers(policy.queries_needed())
    state = RequestState(prompt_len=90)
    selections = policy.decide(layers, state)
    budgets = pyramid_budgets(4, math.ceil(0.4 * 90), 90, 6, 5)
    assert len(set(budgets)) == 4 and state.budget == budgets[0]
    for kv, sel, budget in zip(layers, selections, budgets):
        snap = SnapKV(budget=budget, window=6, kernel=policy.kernel, heads=heads)
        expected = snap.decide([kv], RequestState())[0]
        assert [i.tolist() for i in sel.indices] == [i.tolist() for i in expected.indices]
        assert int(sel.counts().sum()) == 2 * budget


def test_budgets_run_over_the_layers_given_in_model_order(fake_request):
    """A hybrid model's sliding-window layers are not given: the pyramid spans the others."""
    request = fake_request(60, 1, 1, num_layers=3, seed=1)
    layers = request.layers(8)
    given = [layers[2], layers[0]]  # layer 1 is sliding-window
    selections = PyramidKV(ratio=0.5, window=8).decide(given, RequestState(prompt_len=60))
    top, bottom = pyramid_budgets(2, 30, 60, 8, 20)
    assert [len(sel.indices[0]) for sel in selections] == [bottom, top]
