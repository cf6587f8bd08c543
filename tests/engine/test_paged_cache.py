"""The KV buffer as pages (:mod:`vllm_kvcomp.engine.cache`) on both platforms' layouts: cells,
pages, moves and attention over virtual sequences.

vLLM's FlashAttention/Triton kernels cannot run on this CPU build, so the CUDA layout class runs
on CPU tensors here (through ``kernels.decode_attention``'s torch path) and on CUDA tensors under
the ``gpu`` marker (``scripts/gpu_check.sh`` runs this file on a GPU machine without vLLM); the
CPU class calls vLLM's own CPU kernel. Every attention result is compared with eq. 5
(RazorAttention's compensated attention) in float64 over token data the test knows, never over
what the cache under test returns.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paged_cells import (
    ATTEND_CASES,
    BS,
    CASES,
    CLASSES,
    GROUP,
    HK,
    NUM_BLOCKS,
    SCALE,
    D,
    L,
    buffer,
    eq5,
)
from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine.cache import (
    AttentionVariant,
    CpuPagedCache,
    CudaPagedCache,
    SequenceCompensation,
)
from vllm_kvcomp.engine.pages import Move
from vllm_kvcomp.kernels import cpu_native


# ---------------------------------------------------------------------------- cells
@pytest.mark.vllm
def test_cpu_cache_pages_what_vllm_cpu_kernel_wrote():
    from vllm import _custom_ops as vllm_ops

    caches = buffer()
    blocks = torch.tensor([7, 2, 19])
    n = 40
    written = []
    for cache in caches:
        key_cache, value_cache = cache.view(NUM_BLOCKS, HK, 2 * BS, D).chunk(2, dim=2)
        keys, values = torch.randn(n, HK, D), torch.randn(n, HK, D)
        slots = blocks[torch.arange(n) // BS] * BS + torch.arange(n) % BS
        vllm_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec")
        written.append((keys, values))
    cache = CpuPagedCache(caches)
    pages = cache.geometry.page_ids(blocks)  # [L, H, 3]
    for layer, (keys, values) in enumerate(written):
        for head in range(HK):
            tokens = torch.tensor([0, 5, 16, 33, 39])
            got_k, got_v = cache.read_cells(pages[layer, head, tokens // BS], tokens % BS)
            torch.testing.assert_close(got_k, keys[tokens, head], rtol=0, atol=0)
            torch.testing.assert_close(got_v, values[tokens, head], rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_cells_round_trip_across_layers_without_touching_neighbours(kind, device):
    cache = CLASSES[kind](buffer(device))
    cache.pages.zero_()
    pages = torch.tensor([0, 5, cache.geometry.page_ids(torch.tensor([3]))[1, 1, 0]], device=device)
    offsets = torch.tensor([0, BS - 1, 7], device=device)
    keys, values = torch.randn(3, D, device=device), torch.randn(3, D, device=device)
    cache.write_cells(pages, offsets, keys, values)
    got_k, got_v = cache.read_cells(pages, offsets)
    torch.testing.assert_close(got_k, keys, rtol=0, atol=0)
    torch.testing.assert_close(got_v, values, rtol=0, atol=0)
    assert int((cache.pages != 0).sum()) == 3 * 2 * D


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_read_pages_equals_reading_every_cell(kind, device):
    cache = CLASSES[kind](buffer(device))
    cache.pages.copy_(torch.randn_like(cache.pages))
    pages = torch.randint(0, cache.num_pages, (L, HK, 3), device=device)  # [L, H, n] any pages, any order
    keys, values = cache.read_pages(pages)
    assert keys.shape == values.shape == (L, HK, 3 * BS, D)
    cells = torch.arange(3 * BS, device=device)
    for layer in range(L):
        for head in range(HK):
            want_k, want_v = cache.read_cells(pages[layer, head, cells // BS], cells % BS)
            torch.testing.assert_close(keys[layer, head], want_k, rtol=0, atol=0)
            torch.testing.assert_close(values[layer, head], want_v, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_keys_alone_are_the_keys_of_a_full_read(kind, device):
    """``values=False`` (a policy that reads no values): the same keys, no values."""
    cache = CLASSES[kind](buffer(device))
    cache.pages.copy_(torch.randn_like(cache.pages))
    pages = torch.randint(0, cache.num_pages, (L, HK, 3), device=device)
    want = cache.read_pages(pages)[0].clone()
    keys, values = cache.read_pages(pages, values=False)
    assert values is None
    torch.testing.assert_close(keys, want, rtol=0, atol=0)
    cells, offsets = pages.flatten(), torch.randint(0, BS, (pages.numel(),), device=device)
    keys, values = cache.read_cells(cells, offsets, values=False)
    assert values is None
    torch.testing.assert_close(keys, cache.read_cells(cells, offsets)[0], rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_move_reads_every_source_before_writing(kind, device):
    """A compaction's move: cells shift onto cells that are themselves sources (a chain and a
    swap), across layers; every destination gets its source's old content, nothing else changes."""
    cache = CLASSES[kind](buffer(device))
    cache.pages.copy_(torch.randn_like(cache.pages))
    before = cache.pages.clone()
    far = int(cache.geometry.page_ids(torch.tensor([NUM_BLOCKS - 1]))[L - 1, HK - 1, 0])
    src = [(3, 5), (3, 6), (3, 7), (far, 0), (9, 1)]
    dst = [(3, 4), (3, 5), (3, 6), (9, 1), (far, 0)]
    as_t = lambda cells, i: torch.tensor([c[i] for c in cells], device=device)  # noqa: E731
    want = cache.read_cells(as_t(src, 0), as_t(src, 1))
    cache.move(Move(as_t(src, 0), as_t(src, 1), as_t(dst, 0), as_t(dst, 1)))
    got = cache.read_cells(as_t(dst, 0), as_t(dst, 1))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    untouched = torch.ones(cache.num_pages, dtype=torch.bool, device=device)
    untouched[[3, 9, far]] = False
    torch.testing.assert_close(cache.pages[untouched], before[untouched], rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize(("kind", "device"), CASES)
def test_a_large_move_changes_exactly_its_destinations(kind, device, chunk, monkeypatch):
    """A decode recompression's move at scale: cells of a few pages shuffled onto each other's
    places (most destinations are other moves' sources). The whole buffer afterwards equals
    writing every source's old content to its destination, cell by cell, and nothing else; also
    when the moves whose sources nothing overwrites go through a buffer of ``chunk`` cells."""
    cache = CLASSES[kind](buffer(device))
    buffered = []
    if chunk is not None:
        monkeypatch.setattr(cache, "MOVE_CHUNK", chunk)
        scratch = cache.scratch
        monkeypatch.setattr(cache, "scratch", lambda name, shape: buffered.append(shape[0]) or scratch(name, shape))
    cache.pages.copy_(torch.randn_like(cache.pages))
    want = CLASSES[kind](buffer(device))
    want.pages.copy_(cache.pages)
    pages = torch.randperm(cache.num_pages, device=device)[:12]
    pool_pages, pool_offsets = pages.repeat_interleave(BS), torch.arange(BS, device=device).repeat(12)
    n = 10 * BS
    src, dst = torch.randperm(12 * BS, device=device)[:n], torch.randperm(12 * BS, device=device)[:n]
    keys, values = cache.read_cells(pool_pages[src], pool_offsets[src])
    want.write_cells(pool_pages[dst], pool_offsets[dst], keys, values)
    cache.move(Move(pool_pages[src], pool_offsets[src], pool_pages[dst], pool_offsets[dst]))
    torch.testing.assert_close(cache.pages, want.pages, rtol=0, atol=0)
    if chunk is not None:
        assert buffered and max(buffered) == chunk  # some sources are no destination: they went through it


def test_refusals():
    with pytest.raises(NotImplementedError, match="kv-cache-dtype auto"):
        CudaPagedCache([torch.zeros(2, HK, BS, 2 * D, dtype=torch.uint8)])
    nhc = torch.zeros(NUM_BLOCKS, BS, HK, 2 * D).transpose(1, 2)  # LBNHC: a page is not contiguous
    with pytest.raises(NotImplementedError, match="LBHNC"):
        CudaPagedCache([nhc])
    with pytest.raises(NotImplementedError, match="one buffer"):
        CudaPagedCache([torch.zeros(NUM_BLOCKS, HK, BS, 2 * D), torch.zeros(NUM_BLOCKS, HK, BS, 2 * D)])
    with pytest.raises(NotImplementedError, match="ISA"):
        CpuPagedCache(buffer(), isa="amx")


# ---------------------------------------------------------------------------- attention
@pytest.mark.parametrize("capped", [False, True], ids=["plain", "softcap-sinks"])
@pytest.mark.parametrize("queries", [[1, 3, 1, 1, 1, 2], [1] * 6], ids=["mixed", "decode"])
@pytest.mark.parametrize(("kind", "device"), ATTEND_CASES)
def test_attend_virtual_sequences_equals_eq5(kind, device, queries, capped):
    """Sequences over random pages of any layer, 1- to 3-token query rows (or one each: the
    decode launch), some with a compensation token; poison in every cell no sequence reads. With
    ``capped`` the layer soft-caps its logits (Gemma 2) and has sinks per query head (gpt-oss),
    large enough to matter; sequence s reads KV head s % H_kv."""
    _attends_as_eq5(CLASSES[kind](buffer(device)), device, queries, capped)


def _count_calls(monkeypatch, owner, name) -> list[int]:
    calls, fn = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    return calls


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["native", "kernel+native", "kernel+bags", "kernel+gathered"])
def test_cpu_merged_sequences_read_nothing_past_their_end(monkeypatch, path):
    """The CPU class attends decode rows by kvcomp's C kernel (``kernels.cpu_native``). Rows of
    a prefill chunk go to vLLM's kernel, but the sequences it merges (a compensation token; every
    one in a layer with sinks, as here) go to the C kernel or, where it is not built, to torch,
    reading their pages in place (``embedding_bag``) or gathered (many query rows). Each path
    equals eq. 5 when every cell no sequence wrote holds NaN. (vLLM's kernel, which attends the
    others, reads its last page's unwritten cells.)"""
    native, kernel = (_count_calls(monkeypatch, cpu_native, "merged_attention"),
                      _count_calls(monkeypatch, vllm_compat, "cpu_paged_attention"))
    if path != "native":
        monkeypatch.setattr(CpuPagedCache, "NATIVE_ROWS", 0)
    if path in ("kernel+bags", "kernel+gathered"):
        monkeypatch.setattr(cpu_native, "covers", lambda *a: False)
        monkeypatch.setattr(CpuPagedCache, "BAG_LIMIT", CpuPagedCache.BAG_LIMIT if path == "kernel+bags" else 0)
    _attends_as_eq5(CpuPagedCache([layer.fill_(float("nan")) for layer in buffer()]), "cpu", [1, 3, 1, 1, 1, 2],
                    capped=True)
    assert (len(native), len(kernel)) == {"native": (1, 0), "kernel+native": (1, 1)}.get(path, (0, 1))


@pytest.mark.vllm
@pytest.mark.parametrize("capped", [False, True], ids=["plain", "softcap-sinks"])
def test_cpu_rows_past_the_native_limit_attend_by_vllms_kernel(monkeypatch, capped):
    """A sequence with more than ``NATIVE_ROWS`` query rows (a prefill chunk) sends the call to
    vLLM's kernel (it tiles many rows), with the same results."""
    monkeypatch.setattr(CpuPagedCache, "NATIVE_ROWS", 2)  # the test's 3-row sequence is past it
    kernel = _count_calls(monkeypatch, vllm_compat, "cpu_paged_attention")
    _attends_as_eq5(CpuPagedCache(buffer()), "cpu", [1, 3, 1, 1, 1, 2], capped)
    assert len(kernel) == 1


def test_cpu_merged_attention_builds_here_and_falls_back_without_a_compiler(monkeypatch, caplog, tmp_path):
    """The C kernel builds on this machine (CI's has ``cc``), once: a second build finds it. Where
    it cannot be built :func:`cpu_native.library` is None with a warning that says why, and
    :func:`cpu_native.covers` sends every call to torch; calls past its limits go there too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = cpu_native.build()
    assert built.parent == tmp_path / "vllm-kvcomp" and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns
    assert cpu_native.build() == built and built.stat().st_mtime_ns == stamp
    assert cpu_native.covers(torch.float32, 3, 64, 16)
    assert not cpu_native.covers(torch.float16, 3, 64, 16)
    assert not cpu_native.covers(torch.float32, cpu_native.MAX_GROUP + 1, 64, 16)
    assert not cpu_native.covers(torch.float32, 3, cpu_native.MAX_HEAD_DIM * 2, 16)
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    cpu_native.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_native.__name__):
            assert cpu_native.library() is None
        assert "no C compiler" in caplog.text and "vLLM's kernel" in caplog.text and "in torch" in caplog.text
        assert not cpu_native.covers(torch.float32, 3, 64, 16)
        with pytest.raises(RuntimeError, match="failed"):  # a compiler that cannot build it says so
            cpu_native.build(compiler="false")
    finally:
        cpu_native.library.cache_clear()


def _attends_as_eq5(cache, device, queries, capped):
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(cache.num_pages, generator=gen)
    lengths, tables, data, used = [70, 7, 33, 32, 1, 50], [], [], 0
    for n in lengths:
        pages = perm[used : used + -(-n // BS)]
        used += pages.numel()
        keys, values = torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen)
        cache.write_cells(pages[torch.arange(n) // BS].to(device), (torch.arange(n) % BS).to(device),
                          keys.to(device), values.to(device))
        tables.append(torch.nn.functional.pad(pages, (0, 3 - pages.numel())))
        data.append((keys, values))
    comp = (torch.randn(6, D, generator=gen), torch.randn(6, D, generator=gen),
            torch.tensor([4.0, 0, 0, 9.0, 2.0, 0]))
    q = (8.0 if capped else 1.0) * torch.randn(sum(queries), GROUP, D, generator=gen)
    sinks = torch.tensor([3.0, -1.0, 0.5, 6.0]) if capped else None  # [H_q] = [H_kv * G]
    variant = AttentionVariant(SCALE, 4.0 if capped else 0.0, None if sinks is None else sinks.to(device))
    starts = torch.cumsum(torch.tensor([0, *queries]), 0)
    present = ((comp[2] > 0) | capped).unsqueeze(0)
    plan = SequenceCompensation.schedule(*(t.unsqueeze(0).to(device) for t in comp), present, queries,
                                         torch.tensor([lengths]), BS)
    out = cache.attend(q.to(device), torch.stack(tables).to(device), torch.tensor(lengths).to(device),
                       starts.to(device), variant, plan[0])
    for s, (keys, values) in enumerate(data):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        head_sinks = None if sinks is None else sinks.view(HK, GROUP)[s % HK]
        ref = eq5(q[rows], keys, values, tuple(t[s] for t in comp), variant.softcap, head_sinks)
        torch.testing.assert_close(out[rows].cpu().double(), ref, rtol=2e-5, atol=2e-5)
    if capped:  # the variant is active: leaving it out changes the result
        plain = eq5(q[:1], *data[0], tuple(t[0] for t in comp))
        assert float((plain - out[:1].cpu().double()).abs().max()) > 1e-2


@pytest.mark.vllm
def test_calls_sharing_a_memo_make_the_cpu_schedule_once(monkeypatch):
    """Layers whose sequences have the same lengths this step share one memo: vLLM's CPU
    schedule is made by the first and reused by the others, with the same outputs as without."""
    monkeypatch.setattr(CpuPagedCache, "NATIVE_ROWS", 0)  # vLLM's kernel even for these decode rows
    made = []
    schedule = vllm_compat.cpu_attention_schedule
    monkeypatch.setattr(vllm_compat, "cpu_attention_schedule", lambda **kw: made.append(1) or schedule(**kw))
    cache = CpuPagedCache(buffer())
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([40, 9, 33])
    pages = torch.randperm(cache.num_pages, generator=gen)[:9].view(3, 3)
    for n, row in zip(lengths.tolist(), pages):
        cells = torch.arange(n)
        cache.write_cells(row[cells // BS], cells % BS, torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen))
    starts, variant = torch.arange(4), AttentionVariant(SCALE)
    queries = [torch.randn(3, GROUP, D, generator=gen) for _ in range(2)]  # two layers' decode queries
    alone = [cache.attend(q, pages, lengths, starts, variant, None) for q in queries]
    assert len(made) == 2
    memo: dict[str, object] = {}
    shared = [cache.attend(q, pages, lengths, starts, variant, None, memo) for q in queries]
    assert len(made) == 3  # one more, for both calls
    for a, b in zip(alone, shared):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a layer that merges a sequence (its compensation token) attends it in torch and the kernel
    # reads one cell of it: its own schedule, kept beside the other
    plan = SequenceCompensation.schedule(torch.randn(1, 3, D, generator=gen), torch.randn(1, 3, D, generator=gen),
                                         torch.tensor([[0.0, 5.0, 0.0]]), torch.tensor([[False, True, False]]), [1, 1, 1],
                                         lengths.view(1, 3), BS)[0]
    merging = [cache.attend(q, pages, lengths, starts, variant, plan, memo) for q in queries]
    assert len(made) == 4
    assert float((merging[0][1] - shared[0][1]).abs().max()) > 1e-3  # the token counts
    torch.testing.assert_close(merging[0][[0, 2]], shared[0][[0, 2]], rtol=0, atol=0)

