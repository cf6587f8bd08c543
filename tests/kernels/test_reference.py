"""The package's one decode reference equals eq. 5 written per request and head.

``decode_reference`` gathers every request at once and folds heads; here each (request, KV head)
reads its suffix token by token through the block table (``Paged.kv``) and calls the policies'
``compensated_attention`` in float64, so a gather, mask or GQA fold mistake shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvcomp.kernels.fixtures import make_paged, random_starts
from vllm_kvcomp.kernels.reference import decode_reference, head_starts
from vllm_kvcomp.policies.compensation import attention_with_lse, compensated_attention

SEQ_LENS = [150, 1, 77, 0]
KV_HEADS = 2


def per_head_eq5(q, paged, starts, comp, scale: float) -> torch.Tensor:
    """out [B, H_q, D] float64, one (request, KV head) at a time."""
    batch, hq, d = q.shape
    group = hq // KV_HEADS
    out = torch.zeros(batch, hq, d, dtype=torch.float64)
    for b in range(batch):
        keys, values = paged.kv(b)
        for h in range(KV_HEADS):
            rows = slice(h * group, (h + 1) * group)
            lo = int(starts[b, h])
            k = keys[h, lo:].double().unsqueeze(1).expand(-1, group, -1)  # [S, G, D]
            v = values[h, lo:].double().unsqueeze(1).expand(-1, group, -1)
            k_hat, v_hat, counts = (t[b, h].double() for t in comp)
            token = (k_hat.expand(group, -1), v_hat.expand(group, -1), counts.expand(group))
            out[b, rows] = compensated_attention(q[b, rows].unsqueeze(0), k, v, *token, scale)[0]
    return out


@pytest.mark.parametrize("layout", ["NHC", "HNC"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_eq5_per_head(layout: str, group: int) -> None:
    paged = make_paged(SEQ_LENS, KV_HEADS, 16, 16, torch.float64, layout=layout)
    gen = torch.Generator().manual_seed(5)
    batch = len(SEQ_LENS)
    q = torch.randn(batch, KV_HEADS * group, 16, generator=gen, dtype=torch.float64)
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=0)
    comp = (
        torch.randn(batch, KV_HEADS, 16, generator=gen, dtype=torch.float64),
        torch.randn(batch, KV_HEADS, 16, generator=gen, dtype=torch.float64),
        torch.tensor([[0.0, 4.0], [1.0, 0.0], [7.0, 2.0], [0.0, 0.0]], dtype=torch.float64),
    )
    out, lse = decode_reference(q, paged.cache, paged.block_table, paged.seq_lens, starts, comp, 0.2)
    assert out.dtype == lse.dtype == torch.float64
    want = per_head_eq5(q, paged, starts, comp, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all()  # NaN-poisoned unowned slots never leak in


def test_reference_lse_is_the_log_partition_function() -> None:
    paged = make_paged([40, 9], KV_HEADS, 8, 16, torch.float64)
    q = torch.randn(2, KV_HEADS, 8, dtype=torch.float64)
    _, lse = decode_reference(q, paged.cache, paged.block_table, paged.seq_lens, 3, scale=0.5)
    for b in range(2):
        keys, values = paged.kv(b)
        for h in range(KV_HEADS):
            _, want = attention_with_lse(
                q[b, h].view(1, 1, -1), keys[h, 3:].unsqueeze(1), values[h, 3:].unsqueeze(1), 0.5
            )
            assert math.isclose(float(lse[b, h]), float(want), rel_tol=1e-12)


def test_reference_empty_ranges_and_compensation_only() -> None:
    """No visible slot: out 0 and lse -inf, or with a token of count N_d, out v̂ and
    lse = scale·q·k̂ + ln N_d."""
    paged = make_paged([20, 5], KV_HEADS, 8, 16, torch.float32)
    q = torch.randn(2, KV_HEADS, 8)
    everything = paged.seq_lens.view(-1, 1).expand(-1, KV_HEADS)
    out, lse = decode_reference(q, paged.cache, paged.block_table, paged.seq_lens, everything)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    k_hat, v_hat = torch.randn(2, KV_HEADS, 8), torch.randn(2, KV_HEADS, 8)
    counts = torch.full((2, KV_HEADS), 3.0)
    out, lse = decode_reference(
        q, paged.cache, paged.block_table, paged.seq_lens, everything, (k_hat, v_hat, counts)
    )
    torch.testing.assert_close(out, v_hat)
    want = (q * k_hat).sum(-1) * 8**-0.5 + math.log(3.0)
    torch.testing.assert_close(lse, want)


def test_reference_computes_in_float32_for_low_precision() -> None:
    paged = make_paged([33], KV_HEADS, 8, 16, torch.bfloat16)
    q = torch.randn(1, KV_HEADS, 8).to(torch.bfloat16)
    out, lse = decode_reference(q, paged.cache, paged.block_table, paged.seq_lens)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exact, _ = decode_reference(
        q.double(), paged.cache.double(), paged.block_table, paged.seq_lens
    )
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-2)


def test_reference_rejects_ungroupable_heads() -> None:
    paged = make_paged([4], KV_HEADS, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="do not group"):
        decode_reference(torch.randn(1, 3, 8), paged.cache, paged.block_table, paged.seq_lens)


def test_head_starts_forms() -> None:
    dev = torch.device("cpu")
    assert head_starts(None, 2, 3, dev).tolist() == [[0] * 3] * 2
    assert head_starts(4, 2, 3, dev).tolist() == [[4] * 3] * 2
    assert head_starts(torch.tensor([1, 2]), 2, 3, dev).tolist() == [[1] * 3, [2] * 3]
    per_head = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    got = head_starts(per_head, 2, 3, dev)
    assert got.dtype == torch.int32 and got.tolist() == per_head.tolist()


def naive_variant(q, paged, starts, comp, scale: float, cap: float, sinks: torch.Tensor) -> torch.Tensor:
    """out [B, H_q, D] float64 from one explicit softmax per query head over every logit it sees:
    its kept keys' and the compensation token's (capped: cap·tanh(x / cap)), then its sink (a
    zero value); written without the package's attention math."""
    batch, hq, d = q.shape
    group = hq // KV_HEADS
    out = torch.zeros(batch, hq, d, dtype=torch.float64)
    for b in range(batch):
        keys, values = paged.kv(b)
        for i in range(hq):
            h = i // group
            lo = int(starts[b, h])
            k, v = keys[h, lo:].double(), values[h, lo:].double()
            k_hat, v_hat, count = (t[b, h].double() for t in comp)
            logits = [cap * math.tanh(float(q[b, i].double() @ k[j]) * scale / cap) for j in range(k.shape[0])]
            vals = [v[j] for j in range(k.shape[0])]
            if count > 0:
                logits.append(cap * math.tanh(float(q[b, i].double() @ k_hat) * scale / cap) + math.log(count))
                vals.append(v_hat)
            logits.append(float(sinks[i]))
            vals.append(torch.zeros(d, dtype=torch.float64))
            p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
            out[b, i] = sum(w * x for w, x in zip(p, vals, strict=True))
    return out


def test_reference_soft_cap_and_sinks_equal_one_explicit_softmax() -> None:
    paged = make_paged(SEQ_LENS, KV_HEADS, 8, 16, torch.float64)
    gen = torch.Generator().manual_seed(11)
    batch, group = len(SEQ_LENS), 2
    q = 4 * torch.randn(batch, KV_HEADS * group, 8, generator=gen, dtype=torch.float64)  # logits reach the cap
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=0)
    comp = (
        torch.randn(batch, KV_HEADS, 8, generator=gen, dtype=torch.float64),
        torch.randn(batch, KV_HEADS, 8, generator=gen, dtype=torch.float64),
        torch.tensor([[0.0, 4.0], [1.0, 0.0], [7.0, 2.0], [0.0, 0.0]], dtype=torch.float64),
    )
    sinks = torch.tensor([2.0, -1.0, 0.5, 8.0], dtype=torch.float64)
    out, lse = decode_reference(q, paged.cache, paged.block_table, paged.seq_lens, starts, comp, 0.5,
                                softcap=3.0, sinks=sinks)
    want = naive_variant(q, paged, starts, comp, 0.5, 3.0, sinks)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert bool((lse >= sinks).all())  # the sink is part of the partition function
    plain, _ = decode_reference(q, paged.cache, paged.block_table, paged.seq_lens, starts, comp, 0.5)
    assert float((plain - out).abs().max()) > 0.1  # the variant is active in this test
