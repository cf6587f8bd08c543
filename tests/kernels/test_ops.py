"""vllm_kvcomp.ops: the dispatch rule, and the torch and Triton paths behind the same calls."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernel_refs import (
    assert_close_to_ref,
    make_paged,
    random_selection,
    random_starts,
    ref_compact,
    ref_decode,
    ref_lagkv,
    ref_window,
)
from tests.kernels.cases import COVER, DEVICE, INTERPRET, Case
from vllm_kvcomp import ops

BACKENDS = ["torch", "triton"] if DEVICE == "cpu" else ["triton"]
SEQ_LENS = [70, 1, 33]
KV_HEADS = 2


def test_auto_dispatch_rule() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ops.resolve_backend("decode_attention", cpu) == "torch"
    assert ops.resolve_backend("window_scores", cuda) == "triton"  # no CUDA kernel for it
    built = "cuda" if ops.cuda_extension_available() else "triton"
    assert ops.resolve_backend("compact_heads", cuda) == built
    assert ops.resolve_backend("decode_attention", cuda, cuda_ok=False) == "triton"


def test_forced_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert ops.resolve_backend("lagkv_scores", torch.device("cuda"), "torch") == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        ops.resolve_backend("lagkv_scores", cpu, "tpu")
    with pytest.raises(RuntimeError, match="CUDA extension"):
        ops.resolve_backend("window_scores", cpu, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.resolve_backend("decode_attention", cpu, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.resolve_backend("decode_attention", cpu, "triton") == "triton"


def _paged(case: Case, seed: int = 0):
    return case.paged(SEQ_LENS, KV_HEADS, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", COVER[:3], ids=str)
def test_decode_attention(case: Case, backend: str) -> None:
    paged = _paged(case)
    gen = torch.Generator().manual_seed(1)
    batch, d = len(SEQ_LENS), case.head_dim
    q = torch.randn(batch, KV_HEADS * case.group, d, generator=gen).to(case.dtype)
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=0)
    comp = (
        torch.randn(batch, KV_HEADS, d),
        torch.randn(batch, KV_HEADS, d),
        torch.tensor([[2.0, 0.0]] * batch),
    )
    args = (q.to(DEVICE), paged.cache, paged.block_table.long(), paged.seq_lens.long())
    out, lse = ops.decode_attention(
        *args, starts.long().to(DEVICE), tuple(t.to(DEVICE) for t in comp), backend=backend
    )
    o64, l64 = ref_decode(q, paged.cpu(), starts, d**-0.5, comp, torch.float64)
    o_lp, l_lp = ref_decode(q, paged.cpu(), starts, d**-0.5, comp, case.dtype)
    assert_close_to_ref(out, o64, o_lp, what="out")
    assert_close_to_ref(lse, l64, l_lp, what="lse")
    # a [B] start is one start for every head of the request
    out_b, _ = ops.decode_attention(*args, torch.tensor([3, 0, 5], device=DEVICE), backend=backend)
    shared = torch.tensor([3, 0, 5], dtype=torch.int32).view(-1, 1).expand(-1, KV_HEADS)
    o64, _ = ref_decode(q, paged.cpu(), shared, d**-0.5, None, torch.float64)
    o_lp, _ = ref_decode(q, paged.cpu(), shared, d**-0.5, None, case.dtype)
    assert_close_to_ref(out_b, o64, o_lp, what="out, [B] start")


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_heads(backend: str) -> None:
    case = COVER[1]
    paged = _paged(case)
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=0)
    kept, counts = random_selection(SEQ_LENS, starts, keep=0.5)
    want = ref_compact(paged.cpu(), kept, counts)
    ops.compact_heads(
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        kept.long().to(DEVICE),
        counts.to(DEVICE),
        backend=backend,
    )
    torch.testing.assert_close(paged.cache.cpu(), want, atol=0, rtol=0, equal_nan=True)
    # one request given as [H_kv, K_max] with a 1-d block-table row
    one = make_paged([40], KV_HEADS, 64, 16, torch.float32, DEVICE)
    kept1, counts1 = random_selection([40], torch.zeros(1, KV_HEADS, dtype=torch.int32), keep=0.3)
    want1 = ref_compact(one.cpu(), kept1, counts1)
    ops.compact_heads(
        one.cache,
        one.block_table[0],
        one.seq_lens[0],
        kept1[0].to(DEVICE),
        counts1[0].to(DEVICE),
        backend=backend,
    )
    torch.testing.assert_close(one.cache.cpu(), want1, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_scores(backend: str) -> None:
    case = COVER[3]
    paged = _paged(case)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(SEQ_LENS), 1, KV_HEADS * case.group, case.head_dim, generator=gen).to(
        case.dtype
    )
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=1)
    scores, ent = ops.window_scores(
        q.to(DEVICE),
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts.to(DEVICE),
        with_entropy=True,
        backend=backend,
    )
    s64, e64 = ref_window(q, paged.cpu(), starts, case.head_dim**-0.5, torch.float64)
    s_lp, e_lp = ref_window(q, paged.cpu(), starts, case.head_dim**-0.5, torch.float32)
    assert_close_to_ref(scores, s64, s_lp, what="scores")
    assert_close_to_ref(ent, e64, e_lp, what="entropy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lagkv_scores(backend: str) -> None:
    case = COVER[2]
    paged = _paged(case)
    starts = torch.tensor([[4, 6], [0, 0], [0, 1]], dtype=torch.int32)  # 6 + (3 + 1) * 16 = 70 = N
    parts = torch.tensor([3, 0, 1])
    got = ops.lagkv_scores(
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        starts.to(DEVICE),
        (parts + 1).to(DEVICE),
        16,
        backend=backend,
    )
    assert got.shape == (len(SEQ_LENS), KV_HEADS, 4, 16)  # 4 asked, at most 3 fit
    assert torch.equal(got[:, :, 3].cpu(), torch.zeros(len(SEQ_LENS), KV_HEADS, 16))
    got = got[:, :, :3]
    want64 = ref_lagkv(paged.cpu(), starts, parts.int(), 16, torch.float64)
    assert_close_to_ref(got, want64, ref_lagkv(paged.cpu(), starts, parts.int(), 16, None))


@pytest.mark.skipif(
    not INTERPRET and DEVICE == "cpu", reason="needs TRITON_INTERPRET=1 for Triton on CPU"
)
def test_triton_rejects_wrong_index_dtype() -> None:
    """The launchers take int32 only; ops converts, a direct call with int64 is an error."""
    from vllm_kvcomp.triton_kernels.compaction import compact_heads

    paged = _paged(COVER[0])
    kept = torch.zeros(len(SEQ_LENS), KV_HEADS, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        compact_heads(paged.cache, paged.block_table, paged.seq_lens, kept, kept[..., 0].int())
