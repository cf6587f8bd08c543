"""Observation-window attention scores (+ entropy) over paged KV vs the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from vllm_kvcomp.triton_kernels.window import window_scores

from tests.helpers.kernel_refs import (
    assert_close_to_ref,
    policy_window,
    random_starts,
    ref_window,
)
from tests.kernels.cases import DEVICE, Case, cases

SEQ_LENS = [150, 9, 77]
KV_HEADS = 2


def _inputs(case: Case, window: int, seed: int = 0):
    paged = case.paged(SEQ_LENS, KV_HEADS, seed)
    gen = torch.Generator().manual_seed(seed + 20)
    q = torch.randn(len(SEQ_LENS), window, KV_HEADS * case.group, case.head_dim, generator=gen).to(
        case.dtype
    )
    starts = random_starts(SEQ_LENS, KV_HEADS, seed=seed, min_len=1) if case.ragged else None
    return paged, q.to(DEVICE), starts


@pytest.mark.parametrize("case", cases())
def test_window_scores_match_reference(case: Case) -> None:
    window = 8 if case.group < 8 else 4
    paged, q, starts = _inputs(case, window)
    scores, ent = window_scores(
        q,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        max(SEQ_LENS),
        None if starts is None else starts.to(DEVICE),
        with_entropy=case.comp,
        chunk=64,
    )
    cpu, scale = paged.cpu(), case.head_dim**-0.5
    s64, e64 = ref_window(q.cpu(), cpu, starts, scale, torch.float64)
    s_lp, e_lp = ref_window(q.cpu(), cpu, starts, scale, torch.float32)
    assert scores.shape == (len(SEQ_LENS), KV_HEADS, max(SEQ_LENS))
    assert_close_to_ref(scores, s64, s_lp, what=f"scores {case}")
    if case.comp:
        assert_close_to_ref(ent, e64, e_lp, what=f"entropy {case}")
    else:
        assert ent is None


def test_scores_sum_to_queries_times_group() -> None:
    """Each live query row is a distribution: a head's scores sum to G·w."""
    case = Case(torch.float32, 64, 16, 3, "NHC", True, False)
    paged, q, starts = _inputs(case, window=1, seed=5)
    scores, _ = window_scores(
        q, paged.cache, paged.block_table, paged.seq_lens, max(SEQ_LENS), starts.to(DEVICE)
    )
    torch.testing.assert_close(scores.sum(-1).cpu(), torch.full((len(SEQ_LENS), KV_HEADS), 3.0))


def test_reference_agrees_with_policy_window_attention() -> None:
    """The reference's convention (causal by slot, ragged right-aligned heads) is the policies'."""
    case = Case(torch.float32, 64, 16, 4, "NHC", True, False)
    paged, q, starts = _inputs(case, window=5, seed=7)
    cpu, scale = paged.cpu(), 0.1
    scores, ent = ref_window(q.cpu(), cpu, starts, scale, torch.float64)
    for b, n in enumerate(SEQ_LENS):
        probs = policy_window(q.cpu(), cpu, starts, b, scale)  # [H_q, w, N] float32
        torch.testing.assert_close(
            probs.sum(1).view(KV_HEADS, 4, n).sum(1).double(), scores[b, :, :n]
        )
        torch.testing.assert_close(ent[b].float(), -(probs * probs.clamp_min(1e-30).log()).sum(-1))
