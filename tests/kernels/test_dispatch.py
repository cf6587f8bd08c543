"""vllm_kvcomp.kernels: the dispatch rule, and the torch and Triton paths behind the same call."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernel_refs import assert_decode_close
from tests.kernels.cases import COVER, DEVICE, INTERPRET, Case
from vllm_kvcomp import kernels
from vllm_kvcomp.kernels.fixtures import random_starts

BACKENDS = ["torch", "triton"] if DEVICE == "cpu" else ["triton", *(["cuda"] * kernels.cuda_extension_available())]
SEQ_LENS = [70, 1, 33]
KV_HEADS = 2


def test_auto_dispatch_rule() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.resolve_backend("decode_attention", cpu) == "torch"
    assert kernels.resolve_backend("decode_attention", cuda) == "triton"  # the CUDA extension only when forced
    assert kernels.resolve_backend("decode_attention", cuda, cuda_ok=False) == "triton"


def test_forced_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert kernels.resolve_backend("decode_attention", torch.device("cuda"), "torch") == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.resolve_backend("decode_attention", cpu, "tpu")
    with pytest.raises(ValueError, match="unknown kernel op"):
        kernels.resolve_backend("compact_heads", cpu)
    with pytest.raises(RuntimeError, match="CUDA extension"):
        kernels.resolve_backend("decode_attention", cpu, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.resolve_backend("decode_attention", cpu, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.resolve_backend("decode_attention", cpu, "triton") == "triton"


def test_public_api() -> None:
    assert kernels.BACKENDS == ("cuda", "triton", "torch")
    assert set(kernels.__all__) == {
        "BACKENDS",
        "cuda_extension_available",
        "decode_attention",
        "prefill_attention",
        "projected_l1_norms",
        "resolve_backend",
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", COVER[:3], ids=str)
def test_decode_attention(case: Case, backend: str) -> None:
    paged = case.paged(SEQ_LENS, KV_HEADS)
    gen = torch.Generator().manual_seed(1)
    batch, d = len(SEQ_LENS), case.head_dim
    q = torch.randn(batch, KV_HEADS * case.group, d, generator=gen).to(case.dtype)
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=0)
    comp = (
        torch.randn(batch, KV_HEADS, d),
        torch.randn(batch, KV_HEADS, d),
        torch.tensor([[2.0, 0.0]] * batch),
    )
    # int64 index tensors: the dispatch converts them for the kernels
    args = (q.to(DEVICE), paged.cache, paged.block_table.long(), paged.seq_lens.long())
    out, lse = kernels.decode_attention(
        *args, starts.long().to(DEVICE), tuple(t.to(DEVICE) for t in comp), backend=backend
    )
    assert_decode_close(q, paged, starts, comp, d**-0.5, out, lse, what=f"{backend} {case}")
    # a [B] start is one start for every head of the request
    out_b, lse_b = kernels.decode_attention(
        *args, torch.tensor([3, 0, 5], device=DEVICE), backend=backend
    )
    shared = torch.tensor([3, 0, 5], dtype=torch.int32).view(-1, 1).expand(-1, KV_HEADS)
    assert_decode_close(q, paged, shared, None, d**-0.5, out_b, lse_b, what="[B] start")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_on_an_int_start_and_a_custom_scale(backend: str) -> None:
    """An int start and an explicit scale reach every backend the same way."""
    case = COVER[0]
    paged = case.paged(SEQ_LENS, KV_HEADS, seed=4)
    q = torch.randn(len(SEQ_LENS), KV_HEADS * case.group, case.head_dim).to(case.dtype)
    out, lse = kernels.decode_attention(
        q.to(DEVICE), paged.cache, paged.block_table, paged.seq_lens, 1, scale=0.3, backend=backend
    )
    starts = torch.ones(len(SEQ_LENS), KV_HEADS, dtype=torch.int32)
    assert_decode_close(q, paged, starts, None, 0.3, out, lse, what=f"{backend} int start")
    assert torch.isneginf(lse[1]).all()  # request 1 holds one slot, start 1 leaves nothing


@pytest.mark.skipif(
    not INTERPRET and DEVICE == "cpu", reason="needs TRITON_INTERPRET=1 for Triton on CPU"
)
def test_triton_launcher_rejects_wrong_index_dtype() -> None:
    """The launcher takes int32 only; the dispatch converts, a direct call with int64 is an error."""
    from vllm_kvcomp.kernels.triton_jit.decode import decode_attention

    paged = COVER[0].paged(SEQ_LENS, KV_HEADS)
    q = torch.randn(len(SEQ_LENS), KV_HEADS, 64, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, paged.cache, paged.block_table.long(), paged.seq_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_decode_attention_replays_in_a_cuda_graph(backend: str) -> None:
    """Captured once with a fixed split count, a replay over new queries, lengths and per-head
    starts written into the captured buffers equals an eager call on them (vLLM replays the
    decode step's attention this way under FULL CUDA graphs)."""
    if backend == "cuda" and not kernels.cuda_extension_available():
        pytest.skip("vllm_kvcomp._C not built")
    case = Case(torch.bfloat16, 128, 16, 4, "HNC", True, True)
    lens = [300, 1, 77]
    paged = case.paged(lens, KV_HEADS)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), KV_HEADS * case.group, case.head_dim, generator=gen).to(case.dtype).cuda()
    starts = random_starts(lens, KV_HEADS, min_len=0).cuda()
    comp = tuple(t.cuda() for t in (torch.randn(3, KV_HEADS, 128), torch.randn(3, KV_HEADS, 128),
                                    torch.tensor([[3.0, 0.0], [1.0, 9.0], [0.0, 2.0]])))
    args = (q, paged.cache, paged.block_table, paged.seq_lens, starts, comp)
    call = lambda: kernels.decode_attention(*args, num_splits=4, backend=backend)  # noqa: E731
    call()  # compile / load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
    paged.seq_lens.copy_(torch.tensor([250, 1, 60], dtype=torch.int32))
    starts.copy_(random_starts([250, 1, 60], KV_HEADS, seed=9, min_len=0))
    graph.replay()
    want_out, want_lse = call()
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert_decode_close(q, paged, starts.cpu(), tuple(t.cpu() for t in comp), 128**-0.5, out, lse,
                        what=f"graph replay {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink_shape", ["per-head", "per-row"])
def test_soft_cap_and_sinks(backend: str, sink_shape: str) -> None:
    """Gemma 2's logit soft-capping and gpt-oss's learned sinks, with ragged starts and a
    compensation token, on every backend against the reference (the CUDA extension refuses them)."""
    case = Case(torch.float32, 64, 16, 4, "HNC", True, True)
    paged = case.paged(SEQ_LENS, KV_HEADS, seed=2)
    gen = torch.Generator().manual_seed(12)
    batch, hq = len(SEQ_LENS), KV_HEADS * case.group
    q = (6 * torch.randn(batch, hq, case.head_dim, generator=gen)).to(DEVICE)  # logits past the cap
    starts = random_starts(SEQ_LENS, KV_HEADS, min_len=0)
    comp = (torch.randn(batch, KV_HEADS, 64, generator=gen), torch.randn(batch, KV_HEADS, 64, generator=gen),
            torch.tensor([[3.0, 0.0], [1.0, 9.0], [0.0, 2.0]]))
    sinks = 3 * torch.randn(hq if sink_shape == "per-head" else (batch, hq), generator=gen)
    if backend == "cuda":  # the extension has neither: refused, never silently dropped
        with pytest.raises(RuntimeError, match="CUDA extension"):
            kernels.decode_attention(q, paged.cache, paged.block_table, paged.seq_lens, backend="cuda",
                                     softcap=5.0, sinks=sinks.to(DEVICE))
        return
    out, lse = kernels.decode_attention(q, paged.cache, paged.block_table, paged.seq_lens, starts.to(DEVICE),
                                        tuple(t.to(DEVICE) for t in comp), scale=0.125, backend=backend,
                                        softcap=5.0, sinks=sinks.to(DEVICE))
    assert_decode_close(q, paged, starts, comp, 0.125, out, lse, what=backend, softcap=5.0, sinks=sinks)


@pytest.mark.parametrize("backend", ["torch", "triton"] if DEVICE == "cpu" else ["triton"])
def test_prefill_attention(backend: str) -> None:
    """The dispatch's multi-row call on each path equals the float64 reference (one KV head per
    sequence, a chunk, a decode row and draft-like rows in one call, a compensation token)."""
    if backend == "triton" and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    from vllm_kvcomp.kernels.fixtures import make_paged
    from vllm_kvcomp.kernels.reference import prefill_reference

    paged = make_paged([40, 9, 21], 1, 64, 16, torch.float32, DEVICE, seed=4)
    rows = torch.tensor([0, 12, 13, 17], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(17, 3, 64, generator=gen)
    comp = (torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen), torch.tensor([0.0, 4.0, 2.0]))
    out, lse = kernels.prefill_attention(q.to(DEVICE), paged.cache, paged.block_table, paged.seq_lens,
                                         rows.to(DEVICE), tuple(t.to(DEVICE) for t in comp), softcap=3.0,
                                         backend=backend)
    p = paged.cpu()
    want, want_lse = prefill_reference(q.double(), p.cache.double(), p.block_table, p.seq_lens, rows, comp,
                                       softcap=3.0)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)
