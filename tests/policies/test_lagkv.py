"""LagKV: eq. 5–9 scoring against a direct implementation, eq. 10–11 lengths, recursion."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from vllm_kvcomp.policies.base import LayerKV, RequestState
from vllm_kvcomp.policies.lagkv import LagKV, lag_keep, lagkv_retained, lagkv_scores


def _direct_score(part: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Eq. 5–8 for one head, written out with Python loops. part/ref [L, D]."""
    length, dim = part.shape
    stds = []
    for t in range(length):
        normed = []
        for c in range(dim):
            lo = min(float(ref[s, c]) for s in range(ref.shape[0]))
            hi = max(float(ref[s, c]) for s in range(ref.shape[0]))
            normed.append((float(part[t, c]) - lo) / max(hi - lo, 1e-6))
        mean = sum(normed) / dim
        stds.append(math.sqrt(sum((x - mean) ** 2 for x in normed) / (dim - 1)))
    top = max(stds)
    total = sum(math.exp(s - top) for s in stds)
    return [math.exp(s - top) / total for s in stds]


def _eq10(n: int, sink: int, lag: int, ratio: float) -> int:
    """Eq. 10 with our rounding r·L -> max(1, floor(r·L)); nothing compressed below S + 2L."""
    if n < sink + 2 * lag:
        return n
    kept = max(1, math.floor(ratio * lag + 1e-9))
    return sink + kept * ((n - sink) // lag - 1) + lag + (n - sink) % lag


def _layer(n: int, heads: int = 2, dim: int = 6, seed: int = 0) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    return LayerKV(torch.randn(heads, n, dim, generator=gen), torch.randn(heads, n, dim, generator=gen))


def test_scores_match_direct_formula():
    gen = torch.Generator().manual_seed(1)
    kp, vp, kr, vr = (torch.randn(3, 5, 4, generator=gen) for _ in range(4))
    vr[1, :, 2] = 0.7  # a constant reference channel: range clamped, no NaN
    scores = lagkv_scores(kp, vp, kr, vr)
    assert scores.shape == (3, 5)
    assert torch.isfinite(scores).all()
    for h in range(3):
        expected = [a + b for a, b in zip(_direct_score(kp[h], kr[h]), _direct_score(vp[h], vr[h]))]
        assert scores[h].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_scores_accept_leading_dims():
    gen = torch.Generator().manual_seed(2)
    kp, vp, kr, vr = (torch.randn(2, 3, 8, 4, generator=gen) for _ in range(4))
    batched = lagkv_scores(kp, vp, kr, vr)
    for i in range(2):
        assert torch.allclose(batched[i], lagkv_scores(kp[i], vp[i], kr[i], vr[i]))
    assert torch.allclose(batched.sum(-1), torch.full((2, 3), 2.0))


def test_scores_ignore_reference_offset_and_scale():
    """Normalising by the reference's min/max makes a shift/scale of both K tensors irrelevant."""
    gen = torch.Generator().manual_seed(3)
    kp, vp, kr, vr = (torch.randn(2, 6, 4, generator=gen) for _ in range(4))
    base = lagkv_scores(kp, vp, kr, vr)
    moved = lagkv_scores(kp * 3 + 5, vp, kr * 3 + 5, vr)
    assert torch.allclose(base, moved, atol=1e-5)


@pytest.mark.parametrize(("sink", "lag"), list(itertools.product((0, 1, 4, 16), (1, 2, 3, 8))))
def test_retained_length_matches_eq10_grid(sink, lag):
    for ratio in (1.0, 0.5, 0.25, 0.167, 0.125):
        policy = LagKV(ratio=ratio, sink=sink, lag=lag)
        for n in range(0, sink + 5 * lag + 2):
            kv = _layer(n, seed=n)
            sel = policy.select_layer(kv, RequestState())
            expected = _eq10(n, sink, lag, ratio)
            assert sel.counts().tolist() == [expected, expected], (n, sink, lag, ratio)
            assert lagkv_retained(n, sink, lag, ratio) == expected
            if n:  # eq. 11: C = 1 - L_R / Ls, zero below S + 2L or when a partition keeps all
                compression = 1 - sel.counts()[0].item() / n
                drops = max(1, math.floor(ratio * lag + 1e-9)) < lag
                assert (compression > 0) == (n >= sink + 2 * lag and drops)


def test_rounding_is_floor_with_a_floor_of_one():
    assert lag_keep(128, 0.167) == 21
    assert lag_keep(128, 0.125) == 16
    assert lag_keep(4, 0.1) == 1
    assert lag_keep(8, 1.0) == 8


@pytest.mark.parametrize(("lag", "ratio", "ours", "authors"), [
    (128, 0.25, 32, 32),   # the defaults: same as the authors' int(r·L)
    (100, 0.57, 57, 56),   # 0.57·100 = 56.99999999999999 in binary: int() loses a token
    (100, 0.29, 29, 28),
    (8, 0.1, 1, 0),        # r·L < 1: the authors keep nothing of a scored partition
])
def test_partition_keep_deviates_from_int_only_on_rounding_noise_and_zero(lag, ratio, ours, authors):
    """Deviation pinned (issue #17): max(1, floor(r·L + 1e-9)) instead of the authors' int(r·L)."""
    assert int(ratio * lag) == authors
    assert lag_keep(lag, ratio) == ours


def test_small_ratio_keeps_one_token_per_scored_partition():
    """24 tokens, sink 0, lag 8, r = 0.1: partitions 0 and 1 are scored and keep 1 token each,
    partition 2 is the window: 1 + 1 + 8 = 10 (the authors' int(0.8) = 0 would keep 8)."""
    kv = _layer(24, heads=1, dim=4, seed=11)
    kept = LagKV(ratio=0.1, sink=0, lag=8).select_layer(kv, RequestState()).indices[0].tolist()
    assert len(kept) == 10 and kept[-8:] == list(range(16, 24))
    assert 0 <= kept[0] < 8 <= kept[1] < 16
    assert lagkv_retained(24, 0, 8, 0.1) == 10


def test_keeps_top_scores_per_partition_and_the_tail():
    sink, lag, ratio, n = 3, 5, 0.4, 3 + 4 * 5 + 2
    kv = _layer(n, heads=2, dim=4, seed=7)
    sel = LagKV(ratio=ratio, sink=sink, lag=lag).select_layer(kv, RequestState())
    keep = lag_keep(lag, ratio)
    for h in range(2):
        expected = list(range(sink))
        for p in range(3):  # partitions 0..2 are scored against 1..3; partition 3 + 2 extra = tail
            a, b = sink + p * lag, sink + (p + 1) * lag
            direct = [x + y for x, y in zip(
                _direct_score(kv.keys[h, a:b], kv.keys[h, b : b + lag]),
                _direct_score(kv.values[h, a:b], kv.values[h, b : b + lag]),
            )]
            best = sorted(range(lag), key=lambda i: -direct[i])[:keep]
            expected += sorted(a + i for i in best)
        expected += list(range(sink + 3 * lag, n))
        assert sel.indices[h].tolist() == expected


def test_recursive_decode_keeps_eq10_and_old_partitions():
    sink, lag, ratio = 4, 6, 0.5
    policy = LagKV(ratio=ratio, sink=sink, lag=lag)
    gen = torch.Generator().manual_seed(11)
    keys, values = torch.randn(1, 30, 5, generator=gen), torch.randn(1, 30, 5, generator=gen)
    positions = torch.arange(30).unsqueeze(0)
    state = RequestState()
    compressions = 0
    for total in range(30, 90):
        kv = LayerKV(keys, values, positions=positions)
        if total == 30 or policy.due(state, keys.shape[1], 1):
            old_prefix = positions[0, : state.layer(0).get("compressed", 0)].tolist()
            idx = policy.select_layer(kv, state).indices[0]
            keys, values, positions = keys[:, idx], values[:, idx], positions[:, idx]
            assert positions[0, : len(old_prefix)].tolist() == old_prefix, "compressed tokens changed"
            compressions += 1
        assert keys.shape[1] == _eq10(total, sink, lag, ratio), total
        # the next decode token
        keys = torch.cat([keys, torch.randn(1, 1, 5, generator=gen)], 1)
        values = torch.cat([values, torch.randn(1, 1, 5, generator=gen)], 1)
        positions = torch.cat([positions, torch.tensor([[total]])], 1)
    assert compressions == 1 + (90 - 30) // lag


def test_short_prompt_sink_grows_in_decode():
    """A prompt shorter than the sink: decode tokens fill the sink before partitions start."""
    policy = LagKV(ratio=0.5, sink=6, lag=2)
    kv = _layer(3, heads=1)
    state = RequestState()
    assert policy.select_layer(kv, state).counts().tolist() == [3]
    n = 6 + 2 * 2  # sink filled + two partitions: the first one compresses
    keys, values = torch.randn(1, n, 6), torch.randn(1, n, 6)
    assert policy.due(state, n, 1)
    sel = policy.select_layer(LayerKV(keys, values), state)
    assert sel.indices[0].tolist()[:6] == list(range(6))
    assert sel.counts().tolist() == [_eq10(n, 6, 2, 0.5)]


@pytest.mark.parametrize("settings", [{"lag": 1}, {"lag": 1, "ratio": 0.1, "sink": 0}])
def test_a_lag_that_compresses_nothing_is_refused(settings):
    """Issue #20 item 7: 1-token partitions each keep their token, so lag=1 evicts nothing."""
    from vllm_kvcomp.params import SpecError
    from vllm_kvcomp.spec import CompressionSpec

    with pytest.raises(SpecError) as info:
        CompressionSpec.from_mapping({"policy": "lagkv", **settings})
    assert info.value.field == "lag" and "[2, 65536]" in str(info.value)
    kv = _layer(40, heads=1)
    assert LagKV(ratio=0.1, sink=0, lag=1).select_layer(kv, RequestState()).counts().tolist() == [40]
    kept = LagKV.from_settings({"lag": 2, "ratio": 0.5, "sink": 0}).select_layer(kv, RequestState()).counts()
    assert kept.tolist() == [_eq10(40, 0, 2, 0.5)] and kept.item() < 40
