"""The worker and the per-step hook around the parent kernel: compressed rows attended over their
packed pages, the parent kernel's rows trimmed, the backends registered per platform.

The CUDA layout class runs on CPU tensors here and on CUDA tensors under the ``gpu`` marker;
every attention result is compared with eq. 5 in float64 over token data the test knows.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.helpers.paged_cells import (
    ATTEND_CASES,
    BS,
    CASES,
    CLASSES,
    GROUP,
    HK,
    HQ,
    NUM_BLOCKS,
    SCALE,
    D,
    L,
    buffer,
    eq5,
)
from vllm_kvcomp.engine.backends import common
from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin, trim_rows
from vllm_kvcomp.engine.cache import AttentionVariant, CudaPagedCache
from vllm_kvcomp.engine.connector import KVCompConnector, paged_cache
from vllm_kvcomp.engine.metadata import ScheduledRequest, StepMetadata
from vllm_kvcomp.engine.support import backend_overrides
from vllm_kvcomp.engine.worker import KVCompWorker
from vllm_kvcomp.policies.base import Compensation
from vllm_kvcomp.spec import CompressionSpec


# ---------------------------------------------------------------------------- worker + backend hook
@dataclasses.dataclass
class Tokens:
    """What the test knows each (layer, head) of a request holds: positions and K/V rows."""

    positions: list[list[list[int]]]
    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]


def compressed_worker(cache_cls, caches, lengths: list[int], seed: int = 0):
    """A worker with requests r0, r1, … of ``lengths`` tokens written at their natural slots,
    compressed to random page-rounded kept sets (r1 with a compensation token in layer 1), then
    given one decode token each; returns the worker (bound to that decode step) and the tokens."""
    rng = random.Random(seed)
    worker = KVCompWorker(block_size=BS, policy_builder=lambda spec: spec.build_policy())
    names = {f"model.layers.{i}.self_attn.attn": caches[i] for i in range(L)}
    worker.register(names, {name: i for i, name in enumerate(names)}, cache_cls,
                    {name: AttentionVariant(SCALE) for name in names})
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    requests, known = [], []
    for r, n in enumerate(lengths):
        blocks = [free.pop() for _ in range(n // BS + 1)]
        spec = CompressionSpec(policy="streamingllm", ratio=0.5).to_dict()
        requests.append(ScheduledRequest(f"r{r}", spec, n, n - 1, 1, blocks))
        known.append(_fill(worker, torch.tensor(blocks), n, seed + r))
    worker.bind(StepMetadata(requests=[dataclasses.replace(q, num_computed=q.prompt_len - 1) for q in requests]))
    for r, n in enumerate(lengths):
        _compress_randomly(worker, f"r{r}", torch.tensor(requests[r].block_ids), n, known[r], rng)
    worker.bind(StepMetadata(requests=[dataclasses.replace(q, num_computed=q.prompt_len) for q in requests]))
    worker.set_batch([q.req_id for q in requests], {q.req_id: 1 for q in requests})  # one decode row each
    for r, n in enumerate(lengths):  # the decode token, at its natural slot in every layer and head
        _write_token(worker, torch.tensor(requests[r].block_ids), n, known[r], seed + 100 + r)
    comp = Compensation(torch.randn(HK, D), torch.randn(HK, D), torch.tensor([3.0, 0.0]))
    worker.requests["r1"].compensation[1] = comp
    return worker, known


def _fill(worker, blocks, n, seed) -> Tokens:
    gen = torch.Generator().manual_seed(seed)
    pages = worker.cache.geometry.page_ids(blocks)
    tokens = Tokens([[list(range(n)) for _ in range(HK)] for _ in range(L)], [], [])
    for layer in range(L):
        tokens.keys.append([torch.randn(n, D, generator=gen) for _ in range(HK)])
        tokens.values.append([torch.randn(n, D, generator=gen) for _ in range(HK)])
        for head in range(HK):
            t = torch.arange(n)
            worker.cache.write_cells(pages[layer, head, t // BS].to(worker.cache.device), (t % BS).to(worker.cache.device),
                                     tokens.keys[layer][head].to(worker.cache.device),
                                     tokens.values[layer][head].to(worker.cache.device))
    return tokens


def _compress_randomly(worker, rid, blocks, n, tokens: Tokens, rng) -> None:
    state = worker.requests[rid]
    kept = []
    for layer in range(L):
        kept.append([])
        for head in range(HK):
            k = rng.choice(range(n % BS, n + 1, BS))
            idx = sorted(rng.sample(range(n), k))
            kept[layer].append(torch.tensor(idx, dtype=torch.long))
            tokens.positions[layer][head] = idx
            tokens.keys[layer][head] = tokens.keys[layer][head][idx]
            tokens.values[layer][head] = tokens.values[layer][head][idx]
    move, state.pages = state.pages.compact(kept, blocks, n)
    worker.cache.move(move)
    state.policy_state.compressions = 1


def _write_token(worker, blocks, n, tokens: Tokens, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    pages = worker.cache.geometry.page_ids(blocks[n // BS : n // BS + 1])
    for layer in range(L):
        for head in range(HK):
            k, v = torch.randn(1, D, generator=gen), torch.randn(1, D, generator=gen)
            page = pages[layer, head, :1].to(worker.cache.device)
            worker.cache.write_cells(page, torch.tensor([n % BS], device=page.device), k.to(page.device),
                                     v.to(page.device))
            tokens.keys[layer][head] = torch.cat([tokens.keys[layer][head], k])
            tokens.values[layer][head] = torch.cat([tokens.values[layer][head], v])


def expected(tokens: Tokens, q: torch.Tensor, layer: int, comp: Compensation | None) -> torch.Tensor:
    """[H_q, D] float64 reference for one decode query q [H_q, D] of one request."""
    out = []
    for head in range(HK):
        c = None if comp is None else (comp.keys[head], comp.values[head], float(comp.counts[head]))
        qh = q[head * GROUP : (head + 1) * GROUP].unsqueeze(0)
        out.append(eq5(qh, tokens.keys[layer][head], tokens.values[layer][head], c)[0])
    return torch.cat(out)


@pytest.mark.parametrize(("kind", "device"), ATTEND_CASES)
def test_worker_attends_compressed_rows_over_their_pages(kind, device):
    lengths = [75, 100]
    worker, known = compressed_worker(CLASSES[kind], buffer(device), lengths)
    for layer in range(L):
        q = torch.randn(2, HQ, D, device=device)
        out = torch.full_like(q, float("nan"))
        worker.after_attention(f"model.layers.{layer}.self_attn.attn", q, out)
        for r in range(2):
            comp = worker.requests[f"r{r}"].compensation[layer]
            ref = expected(known[r], q[r].cpu(), layer, comp)
            torch.testing.assert_close(out[r].cpu().double(), ref, rtol=2e-5, atol=2e-5)


@dataclasses.dataclass
class StubMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class PlainPagedImpl:
    """Stand-in for vLLM's kernel: causal attention of each row over its natural slots [0, seq_len)."""

    def __init__(self):
        self.scale = SCALE
        self.num_heads, self.num_kv_heads = HQ, HK
        self.seen: list[StubMetadata] = []

    def forward(self, layer, query, key, value, kv_cache, meta, output, output_scale=None, output_block_scale=None):
        self.seen.append(meta)
        qsl = meta.query_start_loc.tolist()
        for b in range(len(qsl) - 1):
            n = int(meta.seq_lens[b])
            t = torch.arange(n)
            cells = kv_cache[meta.block_table[b, t // BS].long(), :, t % BS]  # [n, H_kv, 2D]
            k, v = cells[..., :D].repeat_interleave(GROUP, 1), cells[..., D:].repeat_interleave(GROUP, 1)
            for row in range(qsl[b], qsl[b + 1]):
                pos = n - (qsl[b + 1] - row)
                probs = torch.softmax(torch.einsum("hd,shd->hs", query[row], k[: pos + 1]) * SCALE, dim=-1)
                output[row] = torch.einsum("hs,shd->hd", probs, v[: pos + 1])
        return output


class HookedImpl(KVCompAttentionMixin, PlainPagedImpl):
    def with_lengths(self, layer, dtype, meta, seq_lens, block_table):
        return dataclasses.replace(meta, seq_lens=seq_lens, block_table=block_table)


@pytest.mark.parametrize(("kind", "device"), CASES[1:])  # the stand-in kernel reads [bs, 2D] cells
def test_backend_hook_trims_kernel_rows_and_overwrites_them(kind, device, monkeypatch):
    """Batch: r0, r1 compressed decode rows plus an untracked 3-token prefill row. The parent
    kernel sees the compressed rows cut to their last block (copies: vLLM's tensors stay as they
    were); their outputs are the exact per-head results; the untracked row is the parent's.
    (The CPU class's hook runs in the engine tests, against the HF oracle.)"""
    caches = buffer(device)
    worker, known = compressed_worker(CLASSES[kind], caches, [75, 100], seed=3)
    monkeypatch.setattr(common, "active_worker", lambda: worker)
    blocks = [r.block_ids for r in worker.step.values()]
    untracked = [b for b in range(1, NUM_BLOCKS) if all(b not in ids for ids in blocks)][:1]
    pages = worker.cache.geometry.page_ids(torch.tensor(untracked))[1, :, 0].repeat_interleave(3)
    worker.cache.write_cells(pages.to(device), torch.arange(3, device=device).repeat(HK),
                             torch.randn(3 * HK, D, device=device), torch.randn(3 * HK, D, device=device))
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks] + [untracked + [0] * (width - 1)],
                         dtype=torch.int32, device=device)
    seq_lens = torch.tensor([76, 101, 3], dtype=torch.int32, device=device)
    worker.set_batch(["r0", "r1", "untracked"], {"r0": 1, "r1": 1, "untracked": 3})
    slots = torch.zeros(5, dtype=torch.long, device=device)  # never read by the hook
    meta = StubMetadata(5, torch.tensor([0, 1, 2, 5], dtype=torch.int32, device=device), seq_lens.clone(),
                        table.clone(), slots)
    q = torch.randn(5, HQ, D, device=device)
    out = torch.zeros_like(q)
    layer = type("Layer", (), {"layer_name": "model.layers.1.self_attn.attn"})()
    impl = HookedImpl()
    impl.forward(layer, q, None, None, caches[1], meta, out)
    kernel_meta = impl.seen[0]
    assert kernel_meta.seq_lens.tolist() == [76 - 64, 101 - 96, 3]
    assert kernel_meta.block_table[0, 0] == table[0, 2] and kernel_meta.block_table[1, 0] == table[1, 3]
    torch.testing.assert_close(meta.seq_lens, seq_lens, rtol=0, atol=0)
    torch.testing.assert_close(meta.block_table, table, rtol=0, atol=0)
    for r in range(2):
        ref = expected(known[r], q[r].cpu(), 1, worker.requests[f"r{r}"].compensation[1])
        torch.testing.assert_close(out[r].cpu().double(), ref, rtol=2e-5, atol=2e-5)
    plain = torch.zeros_like(q)
    PlainPagedImpl().forward(layer, q, None, None, caches[1], dataclasses.replace(meta), plain)
    torch.testing.assert_close(out[2:], plain[2:], rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "device"), CASES[1:])
def test_parent_kernel_is_skipped_when_every_row_is_compressed(kind, device, monkeypatch):
    """A step whose rows are all compressed: the worker attends every row, so the parent kernel
    (which only attends: the KV cache is written by a separate op) is never called, and every
    output is the exact per-head result."""
    caches = buffer(device)
    worker, known = compressed_worker(CLASSES[kind], caches, [75, 100], seed=5)
    monkeypatch.setattr(common, "active_worker", lambda: worker)
    blocks = [r.block_ids for r in worker.step.values()]
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32, device=device)
    slots = torch.zeros(2, dtype=torch.long, device=device)  # never read by the hook
    meta = StubMetadata(2, torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
                        torch.tensor([76, 101], dtype=torch.int32, device=device), table, slots)
    impl = HookedImpl()
    for layer in range(L):
        q = torch.randn(2, HQ, D, device=device)
        out = torch.full_like(q, float("nan"))
        named = type("Layer", (), {"layer_name": f"model.layers.{layer}.self_attn.attn"})()
        assert impl.forward(named, q, None, None, caches[layer], meta, out) is out
        for r in range(2):
            ref = expected(known[r], q[r].cpu(), layer, worker.requests[f"r{r}"].compensation[layer])
            torch.testing.assert_close(out[r].cpu().double(), ref, rtol=2e-5, atol=2e-5)
    assert impl.seen == []


def test_trim_rows_shifts_only_the_given_rows():
    seq_lens = torch.tensor([70, 5, 33], dtype=torch.int32)
    table = torch.arange(15, dtype=torch.int32).view(3, 5) + 1
    qsl = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
    new_lens, new_table = trim_rows(seq_lens, table, qsl, torch.tensor([0, 2]), 16)
    assert new_lens.tolist() == [70 - 64, 5, 33 - 32]
    assert new_table.tolist() == [[5, 0, 0, 0, 0], [6, 7, 8, 9, 10], [13, 14, 15, 0, 0]]
    assert seq_lens.tolist() == [70, 5, 33] and table[0, 0] == 1


# ---------------------------------------------------------------------------- registration
@pytest.mark.parametrize(
    ("module", "parent_module", "parent"),
    [
        ("flash_attn", "vllm.v1.attention.backends.flash_attn", "FlashAttention"),
        ("triton_attn", "vllm.v1.attention.backends.triton_attn", "TritonAttention"),
    ],
)
def test_cuda_backend_subclasses(module, parent_module, parent):
    import importlib

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    ours = importlib.import_module(f"vllm_kvcomp.engine.backends.{module}")
    theirs = importlib.import_module(parent_module)
    backend = getattr(ours, f"KVComp{parent}Backend")
    impl = backend.get_impl_cls()
    assert issubclass(backend, getattr(theirs, f"{parent}Backend"))
    assert issubclass(impl, getattr(theirs, f"{parent}Impl")) and issubclass(impl, KVCompAttentionMixin)
    assert backend.get_name() == getattr(theirs, f"{parent}Backend").get_name()
    overrides = backend_overrides("cuda")
    assert f"{backend.__module__}.{backend.__name__}" in overrides.values()
    assert all(name in AttentionBackendEnum.__members__ for name in overrides)
    fields = {f.name for f in dataclasses.fields(getattr(theirs, f"{parent}Metadata"))}
    meta_cls = getattr(theirs, f"{parent}Metadata")
    meta = meta_cls(**{name: None for name in fields if _required(meta_cls, name)})
    if "scheduler_metadata" in fields:
        meta = dataclasses.replace(meta, scheduler_metadata=torch.zeros(4))
    lens, table = torch.tensor([3]), torch.tensor([[7]])
    new = impl.with_lengths(object.__new__(impl), None, torch.float16, meta, lens, table)
    assert new.seq_lens is lens and new.block_table is table and new is not meta
    if parent == "FlashAttention":  # FA3's plan was made for the old lengths
        assert new.scheduler_metadata is None and meta.scheduler_metadata is not None


def _required(cls, name: str) -> bool:
    field = cls.__dataclass_fields__[name]
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def test_backend_overrides_per_platform():
    assert set(backend_overrides("cpu")) == {"CPU_ATTN"}
    assert set(backend_overrides("cuda")) == {"FLASH_ATTN", "TRITON_ATTN"}
    assert backend_overrides(None) == {}


def test_connector_asks_for_piecewise_graphs_and_page_contiguous_caches():
    assert KVCompConnector.requires_piecewise_for_cudagraph({}) is True
    assert KVCompConnector.get_required_kvcache_layout(None) == "LBHNC"


class FakeLayer:
    def __init__(self, impl, sliding_window=None):
        self.impl, self.sliding_window = impl, sliding_window


def test_paged_cache_per_platform_and_refusals():
    caches = {"l0": torch.zeros(3, HK, BS, 2 * D)}
    ours = FakeLayer(HookedImpl())
    assert paged_cache("cuda", {"l0": ours}, caches, BS) is CudaPagedCache
    assert paged_cache("cpu", {"l0": ours}, caches, BS)([caches["l0"]]).geometry.block_size == BS
    with pytest.raises(NotImplementedError, match="CPU and CUDA"):
        paged_cache(None, {"l0": ours}, caches, BS)
    from vllm_kvcomp.engine.support import StartupError

    with pytest.raises(StartupError, match="PlainPagedImpl, which vllm-kvcomp does not hook; pass --attention-backend "
                                           "FLASH_ATTN"):  # the engine does not start: the flag is named
        paged_cache("cuda", {"l0": FakeLayer(PlainPagedImpl())}, caches, BS)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        paged_cache("cuda", {"l0": FakeLayer(HookedImpl(), sliding_window=4096)}, caches, BS)
    with pytest.raises(NotImplementedError, match="--block-size"):
        paged_cache("cuda", {"l0": ours}, caches, 2 * BS)


def test_an_unhooked_backend_is_named_as_vllm_names_it_and_stops_the_start():
    """The layer's ``attn_backend`` (what vLLM picked) names the refusal; FLASHINFER, vLLM's
    Blackwell default, says why it is not hooked. A ``StartupError`` is not the
    ``NotImplementedError`` that serves an engine uncompressed: the engine does not start."""
    from vllm_kvcomp.engine.support import StartupError

    caches = {"l0": torch.zeros(3, HK, BS, 2 * D)}
    for name, why in (("FLASHINFER", "Blackwell"), ("FLEX_ATTENTION", "")):
        layer = FakeLayer(PlainPagedImpl())
        layer.attn_backend = type("Backend", (), {"get_name": staticmethod(lambda name=name: name)})
        with pytest.raises(StartupError) as refused:
            paged_cache("cuda", {"l0": layer}, caches, BS)
        message = str(refused.value)
        assert message.startswith(f"layer l0 runs attention backend {name}") and why in message
        assert "pass --attention-backend FLASH_ATTN (TRITON_ATTN if vLLM rejects FLASH_ATTN" in message
        assert not isinstance(refused.value, NotImplementedError)
    layer = FakeLayer(PlainPagedImpl())
    with pytest.raises(StartupError, match="pass --attention-backend CPU_ATTN,"):
        paged_cache("cpu", {"l0": layer}, caches, BS)
