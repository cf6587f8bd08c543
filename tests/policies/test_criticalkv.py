"""CriticalKV: the two-stage score against a plain float64 implementation, stage-1 picks kept
whatever their value, the output-aware second stage, CriticalAdaKV's allocation, parameter
validation, and the output projection the oracle hands a policy that asks for it."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.conftest import make_policy
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies import criticalkv
from vllm_kvcomp.policies.base import LayerKV, RequestState, out_proj_heads, protected_topk
from vllm_kvcomp.policies.criticalkv import (
    CriticalKV,
    ExpectedAttentionNoNorm,
    projected_value_norms,
    projection_dtype,
)
from vllm_kvcomp.policies.expected_attention import ExpectedAttention
from vllm_kvcomp.policies.snapkv import SnapKV
from vllm_kvcomp.policies.wrappers import adaptive_topk
from vllm_kvcomp.spec import CompressionSpec

HEADS, GROUP, N, D, HIDDEN, W = 2, 3, 16, 4, 5, 4


def _layer(seed: int, lengths: tuple[int, ...] = (N, N)) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    return LayerKV(torch.randn(HEADS, N, D, generator=gen, dtype=torch.float64),
                   torch.randn(HEADS, N, D, generator=gen, dtype=torch.float64),
                   lengths=torch.tensor(lengths), scale=0.6,
                   queries=torch.randn(HEADS * GROUP, W, D, generator=gen, dtype=torch.float64) * 2,
                   out_proj=torch.randn(HEADS * GROUP, D, HIDDEN, generator=gen, dtype=torch.float64))


def _plain_norms(kv: LayerKV) -> list[list[float]]:
    """Per KV head and slot: mean over the query group of sum_j |sum_d v_d · W_o^q[d, j]|."""
    out = []
    for h in range(HEADS):
        row = []
        for i in range(N):
            total = 0.0
            for q in range(h * GROUP, (h + 1) * GROUP):
                total += sum(abs(sum(float(kv.values[h, i, d]) * float(kv.out_proj[q, d, j]) for d in range(D)))
                             for j in range(HIDDEN))
            row.append(total / GROUP)
        out.append(row)
    return out


def _plain_snapkv_mean(kv: LayerKV) -> list[list[float]]:
    """SnapKV with kernel 1 on kvpress's scale: per prefix slot the softmax attention of the W
    window queries (causal: a query sees the slots up to its own), averaged over the window and
    the group; the window's own slots score the prefix maximum."""
    out = []
    for h in range(HEADS):
        length = int(kv.lengths[h])
        start = N - length
        votes = [0.0] * N
        for q in range(h * GROUP, (h + 1) * GROUP):
            for t in range(W):
                seen = range(start, N - W + t + 1)
                logits = [float(kv.queries[q, t] @ kv.keys[h, i]) * kv.scale for i in seen]
                top = max(logits)
                total = sum(math.exp(x - top) for x in logits)
                for i, x in zip(seen, logits):
                    votes[i] += math.exp(x - top) / total / (W * GROUP)
        prefix = max(votes[: N - W])
        out.append([votes[i] if i < N - W else prefix for i in range(N)])
    return out


@pytest.mark.parametrize(("budget", "first_stage_ratio", "epsilon"), [(10, 0.5, 1e-4), (12, 0.75, 0.05), (9, 0.0, 0.0)])
def test_score_is_the_written_formula(budget, first_stage_ratio, epsilon):
    """+inf on the window and the top floor(ratio · b) - window prefix slots by the inner score;
    (inner + epsilon) · mean_q ||v W_o^q||_1 elsewhere."""
    lengths = (N, 11)
    kv = _layer(budget, lengths)
    policy = CriticalKV(budget=budget, window=W, kernel=1, first_stage_ratio=first_stage_ratio, epsilon=epsilon)
    scores = policy.score(kv, RequestState(budget=budget))
    inner, norms = _plain_snapkv_mean(kv), _plain_norms(kv)
    expected = torch.zeros(HEADS, N, dtype=torch.float64)
    for h in range(HEADS):
        b = min(budget, lengths[h])
        first = max(int(first_stage_ratio * b), min(W, b))  # the window comes first, as in kvpress
        prefix = sorted(range(N - lengths[h], N - W), key=lambda i: -inner[h][i])
        picked = set(range(N - W, N)) | set(prefix[: first - W])
        for i in range(N - lengths[h], N):
            expected[h, i] = math.inf if i in picked else (inner[h][i] + epsilon) * norms[h][i]
        live = slice(N - lengths[h], N)
        assert torch.equal(torch.isinf(scores[h, live]), torch.isinf(expected[h, live]))
        finite = ~torch.isinf(expected[h, live])
        torch.testing.assert_close(scores[h, live][finite].double(), expected[h, live][finite], rtol=1e-5, atol=0)


def test_projected_norms_are_the_plain_sum():
    kv = _layer(3)
    expected = torch.tensor(_plain_norms(kv), dtype=torch.float64)
    torch.testing.assert_close(projected_value_norms(kv), expected, rtol=1e-12, atol=0)


def test_a_recompression_projects_only_the_tokens_it_has_not_seen(monkeypatch):
    """The norms a selection projected are remembered at the kept slots by position (a restart
    keeps them): a recompression never projects a remembered slot again, and selects and scores
    as if it had projected them all."""
    projected: list[torch.Tensor] = []
    plain = criticalkv.projected_l1_norms
    monkeypatch.setattr(criticalkv, "projected_l1_norms", lambda v, *a: projected.append(v) or plain(v, *a))
    kv = _layer(5)
    policy = CriticalKV(budget=8, window=W, kernel=1, decode="recompress")
    state = RequestState(prompt_len=N)
    kept = torch.stack(policy.decide([kv], state)[0].indices)  # [H, 8]
    gen = torch.Generator().manual_seed(6)
    new = 4
    grown = LayerKV(
        torch.cat([kv.keys.gather(1, kept[..., None].expand(-1, -1, D)),
                   torch.randn(HEADS, new, D, generator=gen, dtype=torch.float64)], 1),
        torch.cat([kv.values.gather(1, kept[..., None].expand(-1, -1, D)),
                   torch.randn(HEADS, new, D, generator=gen, dtype=torch.float64)], 1),
        positions=torch.cat([kept, torch.arange(N, N + new).expand(HEADS, new)], 1), scale=0.6,
        queries=kv.queries, query_positions=torch.arange(N + new - W, N + new), out_proj=kv.out_proj)
    state.restart()  # prefill=block's: the norms stay
    assert state.tokens and not state.layers
    remembered = state.token_memory(0, criticalkv.NormMemory).norms.lookup(grown.slot_positions(), float("nan"))
    exact = projected_value_norms(grown)
    known = ~remembered.isnan()
    assert bool(known.any())
    torch.testing.assert_close(remembered[known], exact[known], rtol=0, atol=0)
    state.budget = 8
    projected.clear()
    (again,) = policy.decide([grown], state)
    seen = {tuple(row.tolist()) for h in range(HEADS) for row in grown.values[h][known[h]]}
    rows = [tuple(row.tolist()) for values in projected for row in values.reshape(-1, D)]
    assert rows and not seen & set(rows)
    (fresh,) = CriticalKV(budget=8, window=W, kernel=1).decide([grown], RequestState(budget=8))
    assert [i.tolist() for i in again.indices] == [i.tolist() for i in fresh.indices]
    scores = policy.score(grown, state)
    torch.testing.assert_close(scores, CriticalKV(budget=8, window=W, kernel=1).score(grown, RequestState(budget=8)),
                               rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_bounds_are_upper_bounds_close_to_the_norms(dtype):
    """sqrt(hidden) times the 2-norm through the factor bounds every projected L1 norm, on values
    of very different sizes and a rank-deficient W_o; for Gaussian-like products within 1.3x."""
    gen = torch.Generator().manual_seed(12)
    hk, group, n, d, hidden = 2, 4, 500, 16, 64
    values = torch.randn(hk, n, d, generator=gen, dtype=torch.float64) * 10 ** torch.empty(hk, n, 1).uniform_(-3, 3, generator=gen)
    weight = torch.randn(hk * group, d, hidden, generator=gen, dtype=torch.float64)
    weight[0, :, hidden // 2:] = 0.0  # head 0's first query head reads half the hidden units
    weight[1, 3] = 0.0  # a zero row: the Gram matrix is singular
    kv = LayerKV(values.to(dtype), values.to(dtype), out_proj=weight.to(dtype))
    bounds, exact = criticalkv.projected_norm_bounds(kv), projected_value_norms(kv).double()
    assert bool((bounds >= exact).all())
    assert float((bounds / exact).median()) < 1.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("settings", [{}, {"heads": "adaptive"}, {"inner": "expected_attention", "sink": 4},
                                      {"first_stage_ratio": 0.0}, {"epsilon": 0.0}])
def test_a_selection_projects_only_what_it_reads_and_keeps_what_every_norm_gives(settings, dtype, monkeypatch):
    """On the host a selection projects the slots whose bound can reach the depth it reads (its
    budget and the page rounding after it); the kept sets equal those of every slot projected,
    on heads of unequal lengths, in fewer projected rows."""
    gen = torch.Generator().manual_seed(11)
    hk, group, n, d, hidden, window = 2, 3, 600, 16, 40, 16
    keys = torch.randn(hk, n, d, generator=gen, dtype=torch.float64).to(dtype)
    values = (torch.randn(hk, n, d, generator=gen, dtype=torch.float64)
              * torch.rand(hk, n, 1, generator=gen, dtype=torch.float64) * 3).to(dtype)
    kv = LayerKV(keys, values, lengths=torch.tensor([n, n - 77]), scale=d**-0.5,
                 queries=torch.randn(hk * group, window, d, generator=gen, dtype=torch.float64).to(dtype) * 2,
                 out_proj=torch.randn(hk * group, d, hidden, generator=gen, dtype=torch.float64).to(dtype) / 5)
    kv.values[1, :77] = float("nan")  # head 1's padding: never projected, never kept
    projected = []
    plain = criticalkv.projected_l1_norms
    monkeypatch.setattr(criticalkv, "projected_l1_norms", lambda v, *a: projected.append(v.shape[0] * v.shape[1])
                        or plain(v, *a))
    size = {"window": window} if settings.get("inner") != "expected_attention" else {"observe": window}
    (pruned,) = CriticalKV(ratio=0.1, **size, **settings).decide([kv], RequestState(page_quantum=(16, 5)))
    rows, projected[:] = sum(projected), []

    def every_norm(inner, kv, memory, first, depth, epsilon):
        return criticalkv.critical_scores(inner, criticalkv.remembered_value_norms(kv, memory), first, epsilon)

    monkeypatch.setattr(criticalkv, "pruned_critical_scores", every_norm)
    (dense,) = CriticalKV(ratio=0.1, **size, **settings).decide([kv], RequestState(page_quantum=(16, 5)))
    assert [i.tolist() for i in pruned.indices] == [i.tolist() for i in dense.indices]
    assert sum(projected) == 2 * n and rows < 2 * n - 77, rows  # the live slots


@pytest.mark.parametrize(("values", "weight", "device", "expected"), [
    (torch.float64, torch.float64, "cpu", torch.float64),
    (torch.float32, torch.float32, "cpu", torch.float32),
    (torch.bfloat16, torch.bfloat16, "cpu", torch.float32),  # the host multiplies in float32
    (torch.float16, torch.float16, "cpu", torch.float32),
])
def test_projection_dtype_on_the_host(values, weight, device, expected):
    assert projection_dtype(torch.zeros(1, dtype=values), torch.zeros(1, dtype=weight, device=device)) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_projected_norms_on_a_gpu_multiply_in_the_models_dtype(dtype):
    """On a GPU the product runs in the weight's half dtype (the model's, as kvpress's
    ``vwl1norm``): within that dtype's rounding of the float64 norms, in float32."""
    gen = torch.Generator().manual_seed(7)
    hk, group, n, d, hidden = 2, 4, 300, 64, 512
    values = torch.randn(hk, n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(hk * group, d, hidden, generator=gen, dtype=torch.float64) * d**-0.5
    exact = projected_value_norms(LayerKV(values, values, out_proj=weight))
    kv = LayerKV(values.to("cuda", dtype), values.to("cuda", dtype), out_proj=weight.to("cuda", dtype))
    assert projection_dtype(kv.values, kv.out_proj) == dtype
    got = projected_value_norms(kv)
    assert got.dtype == torch.float32 and got.device.type == "cuda"
    torch.testing.assert_close(got.cpu().double(), exact, rtol=2e-2, atol=0)
    as_float32 = projected_value_norms(kv, torch.float32)
    assert as_float32.dtype == torch.float32
    torch.testing.assert_close(as_float32.cpu().double(), exact, rtol=2e-2, atol=0)  # the half inputs' rounding


def test_out_proj_heads_is_each_query_heads_slice_of_the_weight_transposed():
    weight = torch.randn(HIDDEN, HEADS * GROUP * D)
    heads = out_proj_heads(weight, D)
    assert heads.shape == (HEADS * GROUP, D, HIDDEN) and heads.data_ptr() == weight.data_ptr()  # a view
    for q in range(HEADS * GROUP):
        assert torch.equal(heads[q], weight[:, q * D:(q + 1) * D].t())
    with pytest.raises(ValueError, match="not split into heads"):
        out_proj_heads(weight, 7)


def _best_prefix_slot(kv: LayerKV, policy: CriticalKV, h: int) -> int:
    inner = policy.scorer.score(kv, RequestState(budget=policy.budget))
    return int(torch.argmax(inner[h, : N - W]))


@pytest.mark.parametrize("first_stage_ratio", [0.75, 0.0])
def test_stage_one_keeps_the_best_inner_token_even_with_a_zero_value(first_stage_ratio):
    """Its projected norm is 0, so stage 2 alone would drop it; stage 1 keeps it."""
    kv = _layer(5)
    policy = CriticalKV(budget=8, window=W, kernel=1, first_stage_ratio=first_stage_ratio)
    best = _best_prefix_slot(kv, policy, 0)
    kv.values[0, best] = 0.0
    (selection,) = policy.decide([kv], RequestState())
    assert (best in selection.indices[0].tolist()) == (first_stage_ratio > 0)


def test_stage_two_keeps_a_low_attention_token_with_a_large_projected_value():
    kv = _layer(6)
    policy = CriticalKV(budget=8, window=W, kernel=1)
    inner = policy.scorer.score(kv, RequestState(budget=8))
    worst = int(torch.argmin(inner[0, : N - W]))
    kv.values[0, worst] *= 1e4
    (critical,) = policy.decide([kv], RequestState())
    (snap,) = SnapKV(budget=8, window=W, kernel=1).decide([kv], RequestState())
    assert worst in critical.indices[0].tolist() and worst not in snap.indices[0].tolist()


def test_adaptive_heads_allocate_by_the_inner_score_then_run_both_stages_per_head():
    """CriticalAdaKV (kvpress): the counts are AdaKV's over the inner scores; each head keeps its
    top max(floor(ratio · b_h), safeguard) by the inner score, the rest by the critical score."""
    kv = _layer(7)
    kv.queries[:GROUP] *= 6  # head 0 attends sharply, head 1 broadly: AdaKV moves budget to head 1
    budget = 8
    policy = CriticalKV(budget=budget, window=W, kernel=1, heads="adaptive")
    (selection,) = policy.decide([kv], RequestState())
    inner = policy.scorer.score(kv, RequestState(budget=budget)).float()
    counts = [len(idx) for idx in adaptive_topk(inner, budget, kv.valid_lengths(), 0, W)]
    assert selection.counts().tolist() == counts and counts[0] != counts[1] and sum(counts) == HEADS * budget
    safeguard = max(W, math.ceil(0.2 * budget))
    first = protected_topk(inner, [max(int(0.5 * b), min(safeguard, b)) for b in counts], kv.valid_lengths(), 0, W)
    scores = policy.score(kv, RequestState(budget=budget))
    for h in range(HEADS):
        kept = set(selection.indices[h].tolist())
        assert set(first[h].tolist()) <= kept
        rest = [i for i in range(N) if i not in set(first[h].tolist())]
        chosen = [scores[h, i] for i in rest if i in kept]
        dropped = [scores[h, i] for i in rest if i not in kept]
        assert min(chosen) >= max(dropped)


def test_expected_attention_inner_is_expected_attention_without_the_value_norm():
    kv = _layer(8)
    plain = ExpectedAttention(sink=2, epsilon=0.0).score(kv, RequestState())
    bare = ExpectedAttentionNoNorm(sink=2).score(kv, RequestState())
    scored = slice(2, N)
    torch.testing.assert_close(bare[:, scored] * kv.values[:, scored].norm(dim=-1), plain[:, scored], rtol=1e-12,
                               atol=0)
    assert bool(torch.isinf(bare[:, :2]).all())
    policy = make_policy("criticalkv", inner="expected_attention", sink=2, observe=W, first_stage_ratio=0.0)
    scores = policy.score(kv, RequestState(budget=8))
    torch.testing.assert_close(scores[:, scored], ((bare[:, scored] + 1e-4) * projected_value_norms(kv)[:, scored]).float())


@pytest.mark.parametrize(("header", "key", "fragment"), [
    ("inner=h2o", "inner", "snapkv, expected_attention"),
    ("observe=8", "observe", "inner=expected_attention"),
    ("inner=expected_attention; window=8", "window", "inner=snapkv"),
    ("kernel=4", "kernel", "even"),
    ("window=0", "window", "observation query"),
    ("first_stage_ratio=1.5", "first_stage_ratio", "above the maximum"),
    ("epsilon=-1", "epsilon", "below the minimum"),
    ("heads=some", "heads", "uniform, adaptive"),
    ("prefill=stream", "prefill", "cannot compress during prefill"),
])
def test_invalid_settings_name_the_key_and_what_is_allowed(header, key, fragment):
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header(f"policy=criticalkv; {header}")
    assert err.value.field == key and fragment in str(err.value)


def test_each_inner_takes_its_own_settings():
    snap = CompressionSpec.from_header("policy=criticalkv; budget=64; window=16; kernel=5").build_policy()
    assert (type(snap.scorer), snap.scorer.budget, snap.scorer.window, snap.scorer.kernel) == (
        criticalkv.SnapKVMean, 64, 16, 5)
    ea = CompressionSpec.from_header("criticalkv; ratio=0.3; inner=expected_attention; sink=2; observe=8; "
                                     "heads=adaptive").build_policy()
    assert (type(ea.scorer), ea.scorer.ratio, ea.scorer.sink, ea.scorer.observe) == (ExpectedAttentionNoNorm, 0.3, 2, 8)
    assert ea.queries_needed() == 8 and ea.protected() == (2, 0) and snap.protected() == (0, 16)
    with pytest.raises(SpecError, match="inner"):
        CriticalKV(inner="knorm")


def test_a_layer_without_its_output_projection_is_an_error():
    kv = _layer(9)
    kv.out_proj = None
    with pytest.raises(ValueError, match="output projection"):
        CriticalKV(budget=8, window=W).decide([kv], RequestState())


def test_the_oracle_hands_each_layers_o_proj_to_a_policy_that_asks(tmp_path):
    """Split by query head as LayerKV.out_proj says, for every layer; none to a policy that does not ask."""
    from tests.helpers.tiny_llama import make_tiny_llama
    from vllm_kvcomp import oracle

    model = oracle.load_model(make_tiny_llama(tmp_path / "llama", num_layers=2, hidden_size=64, num_heads=4,
                                              num_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=300))
    seen: dict[str, list] = {"criticalkv": [], "snapkv": []}

    def spy(cls, key):
        class Spy(cls):
            def select(self, layers, state):
                seen[key].extend((kv.layer, kv.out_proj) for kv in layers)
                return super().select(layers, state)
        return Spy

    oracle.generate(model, list(range(3, 40)), spy(CriticalKV, "criticalkv")(ratio=0.5, window=4), 2)
    oracle.generate(model, list(range(3, 40)), spy(SnapKV, "snapkv")(ratio=0.5, window=4), 2)
    assert [layer for layer, _ in seen["criticalkv"]] == [0, 1]
    for layer, out_proj in seen["criticalkv"]:
        weight = model.model.layers[layer].self_attn.o_proj.weight
        assert out_proj.shape == (4, 16, 64)
        assert all(torch.equal(out_proj[q], weight[:, q * 16:(q + 1) * 16].t()) for q in range(4))
    assert [out_proj for _, out_proj in seen["snapkv"]] == [None, None]
