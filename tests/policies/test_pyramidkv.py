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


def test_kvpress_runs_the_sequence_over_the_whole_budget_we_over_the_selected_part():
    """kvpress ``get_layer_budget``: min = T/beta over the whole T (window included), then
    ``round``; the authors' code and ours: min = (T - w)/beta, plus the window in every layer."""
    layers, target, length, window, beta = 4, 40, 200, 16, 4
    low = target / beta
    step = (2 * target - 2 * low) / (layers - 1)
    kvpress = [round(2 * target - low - i * step) for i in range(layers)]
    assert kvpress == [70, 50, 30, 10]  # the last layer cannot hold its 16-token window
    assert pyramid_budgets(layers, target, length, window, beta) == [58, 46, 34, 22]


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
