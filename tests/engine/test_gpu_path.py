"""The CUDA engine path, run where it can run: CPU tensors here, CUDA tensors under ``gpu``.

vLLM's FlashAttention/Triton kernels cannot run on this CPU build, so the backend hook is driven
with a stand-in parent impl (plain paged attention over whatever metadata it is given) on vLLM's
GPU KV layout; the layout class, the worker's batched decode through ``ops.decode_attention``,
the metadata trimming, the backend classes and the connector's checks are the real ones.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.helpers.kernel_refs import make_paged, random_starts
from vllm_kvcomp.engine.backends import common
from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin, trim_rows
from vllm_kvcomp.engine.connector import KVCompConnector, paged_layout
from vllm_kvcomp.engine.cpu_layout import CpuPagedKV
from vllm_kvcomp.engine.flash_layout import FlashPagedKV
from vllm_kvcomp.engine.metadata import ScheduledRequest, StepMetadata
from vllm_kvcomp.engine.paged import PagedKV
from vllm_kvcomp.engine.plugin import backend_overrides
from vllm_kvcomp.engine.worker import KVCompWorker
from vllm_kvcomp.policies.base import Compensation
from vllm_kvcomp.policies.compensation import compensated_attention
from vllm_kvcomp.spec import CompressionSpec

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BS, HK, HQ, D = 16, 2, 4, 32
SCALE = D**-0.5


def poison_dropped(storage: torch.Tensor, table: torch.Tensor, starts: torch.Tensor) -> None:
    """Large garbage into every slot a head no longer holds, so attending to one shows (finite:
    torch paths multiply masked slots by a zero weight, as stale slots in an engine are finite)."""
    for b in range(starts.shape[0]):
        for h in range(starts.shape[1]):
            for i in range(int(starts[b, h])):
                storage[int(table[b, i // BS]), h, i % BS] = 1e3


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, comp: Compensation | None):
    """q [1, H_q, D] over keys/values [H_kv, N, D] from each head's start (eq. 5 with ``comp``)."""
    n, group = k.shape[1], HQ // HK
    mask = torch.arange(n).view(1, 1, n) >= start.repeat_interleave(group).view(-1, 1, 1)
    kk = k.transpose(0, 1).repeat_interleave(group, 1)
    vv = v.transpose(0, 1).repeat_interleave(group, 1)
    if comp is None:
        comp = Compensation(torch.zeros(HK, D), torch.zeros(HK, D), torch.zeros(HK))
    return compensated_attention(
        q.double(), kk.double(), vv.double(), comp.keys.repeat_interleave(group, 0).double(),
        comp.values.repeat_interleave(group, 0).double(), comp.counts.repeat_interleave(group).double(),
        SCALE, mask,
    )


def random_compensation(seed: int) -> Compensation:
    g = torch.Generator().manual_seed(seed)
    return Compensation(torch.randn(HK, D, generator=g), torch.randn(HK, D, generator=g),
                        torch.tensor([5.0, 0.0]))


# ---------------------------------------------------------------------------- layouts
def test_cpu_layout_reads_what_vllm_cpu_kernel_wrote():
    from vllm import _custom_ops as vllm_ops

    nb, n = 6, 40
    cache = torch.zeros(nb, HK, BS, 2 * D)
    key_cache, value_cache = cache.view(nb, HK, 2 * BS, D).chunk(2, dim=2)
    table = torch.tensor([4, 1, 5], dtype=torch.long)
    slots = torch.arange(n)
    physical = table[slots // BS] * BS + slots % BS
    keys, values = torch.randn(n, HK, D), torch.randn(n, HK, D)
    vllm_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, physical, "vec")
    paged = CpuPagedKV(cache, "vec")
    got_k, got_v = paged.read(table, slots)
    torch.testing.assert_close(got_k, keys, rtol=0, atol=0)
    torch.testing.assert_close(got_v, values, rtol=0, atol=0)
    some = torch.tensor([3, 17, 33, 34])  # not a range: per-slot gather
    got_k, got_v = paged.read(table, some)
    torch.testing.assert_close(got_k, keys[some], rtol=0, atol=0)
    torch.testing.assert_close(got_v, values[some], rtol=0, atol=0)
    got_k, _ = paged.read(table, slots[7:35])  # a range starting mid-block
    torch.testing.assert_close(got_k, keys[7:35], rtol=0, atol=0)
    k1, v1 = paged.read_head(table, 1, slots[5:9])
    torch.testing.assert_close(k1, keys[5:9, 1], rtol=0, atol=0)
    torch.testing.assert_close(v1, values[5:9, 1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_layout_read_write_through_permuted_table(device):
    paged = make_paged([37, 50], HK, D, BS, torch.float32, device=device, layout="HNC")
    storage = paged.cache.transpose(1, 2)  # vLLM's logical [num_blocks, H_kv, bs, 2D]
    layout = FlashPagedKV(storage)
    table = paged.block_table[1].cpu()
    slots = torch.arange(50)
    keys, values = layout.read(table, slots)
    ref_k, ref_v = paged.kv(1)
    torch.testing.assert_close(keys, ref_k.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(values, ref_v.transpose(0, 1), rtol=0, atol=0)
    new_k, new_v = torch.randn(3, D), torch.randn(3, D)
    layout.write_head(table, 1, torch.tensor([0, 17, 49]), new_k, new_v)
    got_k, got_v = layout.read_head(table, 1, torch.tensor([0, 17, 49]))
    torch.testing.assert_close(got_k.cpu(), new_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v.cpu(), new_v, rtol=0, atol=0)
    untouched, _ = layout.read_head(table, 0, torch.tensor([0, 17, 49]))
    torch.testing.assert_close(untouched, ref_k[0, [0, 17, 49]], rtol=0, atol=0)


def test_flash_layout_refuses_quantized_cache():
    with pytest.raises(NotImplementedError, match="kv-cache-dtype auto"):
        FlashPagedKV(torch.zeros(2, HK, BS, 2 * D, dtype=torch.uint8))


# ---------------------------------------------------------------------------- worker decode
def compressed_worker(layout_cls, storage, paged, starts, comps, num_layers=1) -> KVCompWorker:
    """A worker whose requests r0, r1, … are compressed (starts [B, H_kv]) and in this step."""
    worker = KVCompWorker(block_size=BS, policy_builder=lambda spec: spec.build_policy())
    worker.register({f"model.layers.{i}.self_attn.attn": storage for i in range(num_layers)},
                    {f"model.layers.{i}.self_attn.attn": i for i in range(num_layers)}, layout_cls)
    seq_lens = paged.seq_lens.tolist()
    table = paged.block_table.cpu()
    requests = []
    for b, n in enumerate(seq_lens):
        first_slot = int(table[b, (n - 1) // BS]) * BS + (n - 1) % BS
        requests.append(ScheduledRequest(
            req_id=f"r{b}", spec=CompressionSpec(policy="streamingllm", ratio=0.5).to_dict(), prompt_len=n - 1,
            num_computed=n - 1, num_scheduled=1, block_ids=table[b].tolist(), first_slot=first_slot))
    worker.bind(StepMetadata(requests=requests))
    for b in range(len(seq_lens)):
        state = worker.requests[f"r{b}"]
        state.starts = starts[b].long().expand(num_layers, -1).clone()
        state.compensation = [comps[b]] * num_layers
    return worker


def as_cpu_layout(storage: torch.Tensor) -> torch.Tensor:
    """The same cells in vLLM's CPU (vec ISA) layout: K transposed per (block, head), then V."""
    nb, h, bs, c = storage.shape
    cpu = torch.empty(nb, h, bs, c, dtype=storage.dtype)
    layout = CpuPagedKV(cpu)
    layout.keys_t.copy_(storage[..., : c // 2].transpose(2, 3).cpu())
    layout.values.copy_(storage[..., c // 2 :].cpu())
    return cpu


class TorchOnly(FlashPagedKV):
    """The GPU layout without batched decode: the worker's per-row torch fallback."""

    decode = PagedKV.decode


class CpuTorchOnly(CpuPagedKV):
    decode = PagedKV.decode


LAYOUTS = {  # name -> (PagedKV class, storage converter)
    "flash-kernel": (FlashPagedKV, lambda s: s),
    "flash-torch": (TorchOnly, lambda s: s),
    "cpu-batched": (CpuPagedKV, as_cpu_layout),
    "cpu-torch": (CpuTorchOnly, as_cpu_layout),
}


DEVICE_LAYOUTS = [("cpu", name) for name in LAYOUTS] + [  # the CPU layout lives on the host
    pytest.param("cuda", name, marks=pytest.mark.gpu) for name in LAYOUTS if name.startswith("flash")
]


@pytest.mark.parametrize(("device", "layout"), DEVICE_LAYOUTS)
def test_worker_attends_each_heads_kept_suffix(device, layout):
    """Evicted decode rows, batched (one kernel / torch call per layer) or per row, = eq. 5."""
    layout_cls, convert = LAYOUTS[layout]
    seq_lens = [37, 50, 9]
    paged = make_paged(seq_lens, HK, D, BS, torch.float32, device=device, layout="HNC")
    storage = paged.cache.transpose(1, 2)
    starts = random_starts(seq_lens, HK, seed=3)
    comps = [random_compensation(0), None, random_compensation(1)]
    refs_kv = [paged.kv(b) for b in range(3)]
    poison_dropped(storage, paged.block_table.cpu(), starts)
    worker = compressed_worker(layout_cls, convert(storage), paged, starts, comps)
    q = torch.randn(3, HQ, D, device=device)
    out = torch.full_like(q, math.nan)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    slot_mapping = torch.tensor([r.first_slot for r in worker.step.values()], device=device)
    worker.after_attention("model.layers.0.self_attn.attn", q, out, qsl, paged.seq_lens, paged.block_table,
                           slot_mapping, SCALE)
    for b in range(3):
        k, v = refs_kv[b]
        ref = reference(q[b : b + 1].cpu(), k.cpu(), v.cpu(), starts[b], comps[b])
        torch.testing.assert_close(out[b : b + 1].cpu().double(), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- backend hook
@dataclasses.dataclass
class StubMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class PlainPagedImpl:
    """Stand-in for vLLM's kernel: causal attention of each row over slots [0, seq_len)."""

    def __init__(self):
        self.scale = SCALE
        self.seen: list[StubMetadata] = []

    def forward(self, layer, query, key, value, kv_cache, meta, output, output_scale=None, output_block_scale=None):
        self.seen.append(meta)
        layout = FlashPagedKV(kv_cache)
        qsl = meta.query_start_loc.tolist()
        for b in range(len(qsl) - 1):
            n = int(meta.seq_lens[b])
            k, v = layout.read(meta.block_table[b], torch.arange(n))
            k, v = k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1)  # [n, H_q, D]
            for t in range(qsl[b], qsl[b + 1]):
                pos = n - (qsl[b + 1] - t)  # causal: the row's t-th new token sees slots [0, pos]
                probs = torch.softmax(torch.einsum("hd,shd->hs", query[t], k[: pos + 1]) * SCALE, dim=-1)
                output[t] = torch.einsum("hs,shd->hd", probs, v[: pos + 1])
        return output


class HookedImpl(KVCompAttentionMixin, PlainPagedImpl):
    def with_lengths(self, layer, dtype, meta, seq_lens, block_table):
        return dataclasses.replace(meta, seq_lens=seq_lens, block_table=block_table)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_hook_trims_kernel_rows_and_overwrites_them(device, monkeypatch):
    """Batch: r0, r1 compressed decode rows, plus an untracked 3-token prefill row. The parent
    kernel sees the compressed rows cut to their last block (copies: vLLM's tensors stay as they
    were); their outputs are the exact per-head results; the untracked row is the parent's."""
    seq_lens = [37, 50, 3]
    paged = make_paged(seq_lens, HK, D, BS, torch.float32, device=device, layout="HNC", poison=False)
    storage = paged.cache.transpose(1, 2)
    starts = torch.tensor([[20, 33], [40, 1]], dtype=torch.int32)
    refs_kv = [paged.kv(b) for b in range(3)]
    poison_dropped(storage, paged.block_table.cpu(), starts)
    compressed = dataclasses.replace(paged, seq_lens=paged.seq_lens[:2], block_table=paged.block_table[:2])
    worker = compressed_worker(FlashPagedKV, storage, compressed, starts, [None, random_compensation(2)])
    monkeypatch.setattr(common, "active_worker", lambda: worker)
    qsl = torch.tensor([0, 1, 2, 5], dtype=torch.int32, device=device)
    table = paged.block_table.cpu()
    slot = [int(table[b, i // BS]) * BS + i % BS for b, i in ((0, 36), (1, 49), (2, 0), (2, 1), (2, 2))]
    meta = StubMetadata(5, qsl, paged.seq_lens.clone(), paged.block_table.clone(),
                        torch.tensor(slot, device=device))
    before = (meta.seq_lens.clone(), meta.block_table.clone())
    q = torch.randn(5, HQ, D, device=device)
    out = torch.zeros_like(q)
    layer = type("Layer", (), {"layer_name": "model.layers.0.self_attn.attn"})()
    impl = HookedImpl()
    impl.forward(layer, q, None, None, storage, meta, out)

    kernel_meta = impl.seen[0]
    assert kernel_meta.seq_lens.tolist() == [37 - 32, 50 - 48, 3]
    assert kernel_meta.block_table[0, 0] == meta.block_table[0, 2]
    assert kernel_meta.block_table[1, 0] == meta.block_table[1, 3]
    torch.testing.assert_close(meta.seq_lens, before[0], rtol=0, atol=0)
    torch.testing.assert_close(meta.block_table, before[1], rtol=0, atol=0)
    comps = [None, worker.requests["r1"].compensation[0]]
    for b in range(2):
        k, v = refs_kv[b]
        ref = reference(q[b : b + 1].cpu(), k.cpu(), v.cpu(), starts[b], comps[b])
        torch.testing.assert_close(out[b : b + 1].cpu().double(), ref, rtol=1e-5, atol=1e-5)
    plain = torch.zeros_like(q)
    PlainPagedImpl().forward(layer, q, None, None, storage, dataclasses.replace(meta), plain)
    torch.testing.assert_close(out[2:], plain[2:], rtol=0, atol=0)
    assert torch.isfinite(out).all()


def test_trim_rows_shifts_only_the_given_rows():
    seq_lens = torch.tensor([70, 5, 33], dtype=torch.int32)
    table = torch.arange(15, dtype=torch.int32).view(3, 5) + 1
    qsl = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
    new_lens, new_table = trim_rows(seq_lens, table, qsl, [0, 2], BS)
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


def test_connector_asks_for_piecewise_cuda_graphs():
    assert KVCompConnector.requires_piecewise_for_cudagraph({}) is True


class FakeLayer:
    def __init__(self, impl, sliding_window=None):
        self.impl, self.sliding_window = impl, sliding_window


def test_paged_layout_per_platform_and_refusals():
    cache = {"l0": torch.zeros(3, HK, BS, 2 * D)}
    ours = FakeLayer(HookedImpl())
    assert paged_layout("cuda", {"l0": ours}, cache, BS) is FlashPagedKV
    assert paged_layout("cpu", {"l0": ours}, cache, BS)(cache["l0"]).block_size == BS
    with pytest.raises(NotImplementedError, match="CPU and CUDA"):
        paged_layout(None, {"l0": ours}, cache, BS)
    with pytest.raises(NotImplementedError, match="FLASH_ATTN or TRITON_ATTN"):
        paged_layout("cuda", {"l0": FakeLayer(PlainPagedImpl())}, cache, BS)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        paged_layout("cuda", {"l0": FakeLayer(HookedImpl(), sliding_window=4096)}, cache, BS)
    with pytest.raises(NotImplementedError, match="--block-size"):
        paged_layout("cuda", {"l0": ours}, cache, 32)
