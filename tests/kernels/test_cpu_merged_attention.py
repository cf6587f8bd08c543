"""kvcomp's CPU decode kernel (``kernels/cpu_merged_attention.c`` through ``cpu_native``) against
eq. 5 in float64, over every shape its dispatch tells apart: the vectorised rows (block sizes and
head dims that are multiples of 8, the specialised 16/32 x 64/128 and others), the plain C rows
(other sizes, soft-capping), query groups that do and do not fill its logit tiles, partial last
pages whose unwritten cells hold NaN, random page tables, compensation tokens, sinks and several
query rows per sequence."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.kernels import cpu_native
from vllm_kvcomp.policies.compensation import compensated_attention

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler to build the kernel")

SHAPES = [  # (block size, head dim, query heads per KV head)
    (32, 64, 3), (16, 64, 3), (32, 128, 4), (16, 128, 1), (128, 64, 3),  # the specialised vector rows
    (32, 64, 7), (8, 32, 7), (8, 16, 13), (24, 40, 5), (96, 16, 1),  # other vector rows, ragged head tiles
    (12, 64, 3), (32, 20, 2), (104, 64, 2),  # plain C rows: a size not a multiple of 8, a block past the tiles
]


def reference(q, keys, values, k_hat, v_hat, count, scale, softcap, sinks):
    """q [T, G, D] over keys/values [n, D] (causal, the last T tokens) -> [T, G, D] float64."""
    t, n, g = q.shape[0], keys.shape[0], q.shape[1]
    mask = torch.arange(n).view(1, n) <= (n - t + torch.arange(t)).view(t, 1)
    expand = lambda x: x.double().unsqueeze(1).expand(-1, g, -1)  # noqa: E731
    return compensated_attention(q.double(), expand(keys), expand(values), k_hat.double().expand(g, -1),
                                 v_hat.double().expand(g, -1), torch.full((g,), float(count)).double(),
                                 scale, mask, softcap, sinks)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("variant", ["plain", "token", "softcap-sinks"])
@pytest.mark.parametrize(("bs", "d", "group"), SHAPES)
def test_equals_eq5_in_float64(bs, d, group, variant, rows):
    gen = torch.Generator().manual_seed(bs * 1000 + d * 10 + group)
    lengths = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 7]  # one cell, partial and whole pages
    lengths = [max(n, rows) for n in lengths]
    widths = [-(-n // bs) for n in lengths]
    num_pages = sum(widths) + 3
    pages = torch.full((num_pages, 2 * bs * d), float("nan"))  # every cell nobody writes is NaN
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    data, used = [], 0
    for s, n in enumerate(lengths):
        table = order[used : used + widths[s]]
        used += widths[s]
        tables[s, : widths[s]] = table
        keys, values = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
        for cell in range(n):
            page, slot = pages[table[cell // bs]], cell % bs
            page[: bs * d].view(d, bs)[:, slot] = keys[cell]  # K^T [D, bs]
            page[bs * d :].view(bs, d)[slot] = values[cell]  # then V [bs, D]
        data.append((keys, values))
    seqs = len(lengths)
    q = 2 * torch.randn(seqs * rows, group, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    k_hat, v_hat = torch.randn(seqs, d, generator=gen), torch.randn(seqs, d, generator=gen)
    counts = torch.tensor([4.0, 0.0, 9.0, 2.0, 0.0, 3.0]) if variant == "token" else torch.zeros(seqs)
    softcap = 3.0 if variant == "softcap-sinks" else 0.0
    sinks = torch.randn(seqs, group, generator=gen) if variant == "softcap-sinks" else None
    scale = d ** -0.5
    starts = torch.arange(0, seqs * rows + 1, rows)
    cpu_native.merged_attention(pages, q, out, [(torch.arange(seqs), rows)], starts, tables, torch.tensor(lengths),
                                k_hat, v_hat, counts, sinks, bs, scale, softcap)
    for s, (keys, values) in enumerate(data):
        want = reference(q[s * rows : (s + 1) * rows], keys, values, k_hat[s], v_hat[s], counts[s], scale, softcap,
                         None if sinks is None else sinks[s].double())
        torch.testing.assert_close(out[s * rows : (s + 1) * rows].double(), want, rtol=2e-5, atol=2e-5)


def test_only_the_listed_sequences_are_written():
    """Sequences not in ``seqs`` keep their output rows as they were."""
    bs, d, group = 32, 64, 3
    gen = torch.Generator().manual_seed(1)
    pages = torch.randn(4, 2 * bs * d, generator=gen)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(2, group, d, generator=gen)
    out = torch.full_like(q, 7.0)
    zeros = torch.zeros(2, d)
    cpu_native.merged_attention(pages, q, out, [(torch.tensor([1]), 1)], torch.tensor([0, 1, 2]), tables,
                                torch.tensor([40, 50]), zeros, zeros, torch.zeros(2), None, bs, 0.125, 0.0)
    assert bool((out[0] == 7.0).all()) and bool(torch.isfinite(out[1]).all()) and not bool((out[1] == 7.0).any())


@pytest.mark.parametrize("variant", ["plain", "token", "softcap-sinks"])
@pytest.mark.parametrize(("bs", "d", "group"), SHAPES)
def test_observed_attention_adds_each_cells_weight(bs, d, group, variant):
    """``observe``: a sequence's row gains each cell's softmax weight among its cells alone (capped
    logits where the layer caps; the token and the sinks take no share), the mean over the query
    heads, added to what the row held; a sequence with address 0 and cells past a row's length
    are left alone, and the attention itself is unchanged."""
    gen = torch.Generator().manual_seed(bs * 7 + d * 3 + group)
    lengths = [1, bs + 1, 3 * bs + 5, bs]
    widths = [-(-n // bs) for n in lengths]
    pages = torch.randn(sum(widths) + 2, 2 * bs * d, generator=gen)
    order = torch.randperm(pages.shape[0], generator=gen)
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    used = 0
    for s, w in enumerate(widths):
        tables[s, :w] = order[used : used + w]
        used += w
    seqs = len(lengths)
    q = 2 * torch.randn(seqs, group, d, generator=gen)
    k_hat, v_hat = torch.randn(seqs, d, generator=gen), torch.randn(seqs, d, generator=gen)
    counts = torch.tensor([4.0, 0.0, 9.0, 2.0]) if variant == "token" else torch.zeros(seqs)
    softcap = 3.0 if variant == "softcap-sinks" else 0.0
    sinks = torch.randn(seqs, group, generator=gen) if variant == "softcap-sinks" else None
    scale, starts = d ** -0.5, torch.arange(seqs + 1)
    rows = torch.rand(seqs, max(lengths) + 4, generator=gen)
    before = rows.clone()
    observe = torch.tensor([rows[s].data_ptr() for s in range(seqs)])
    observe[3] = 0  # this one observes nothing
    args = (pages, q, None, [(torch.arange(seqs), 1)], starts, tables, torch.tensor(lengths), k_hat, v_hat, counts,
            sinks, bs, scale, softcap)
    plain, observed = torch.empty_like(q), torch.empty_like(q)
    cpu_native.merged_attention(*args[:2], plain, *args[3:])
    cpu_native.merged_attention(*args[:2], observed, *args[3:], observe=observe)
    torch.testing.assert_close(observed, plain, rtol=0, atol=0)
    for s, n in enumerate(lengths):
        page = pages[tables[s, : widths[s]].long()]  # [w, 2·bs·D]
        keys = page[:, : bs * d].view(-1, d, bs).transpose(1, 2).reshape(-1, d)[:n].double()
        logits = (q[s].double() @ keys.T) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        want = before[s].double().clone()
        if s != 3:
            want[:n] += torch.softmax(logits, dim=-1).mean(0)
        torch.testing.assert_close(rows[s].double(), want, rtol=2e-5, atol=2e-6)
