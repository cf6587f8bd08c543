"""The one dispatch point of vllm-kvcomp's KV kernels: CUDA extension, Triton, or PyTorch.

Dispatch rule (``backend=None``):

1. tensors on CUDA and the ``vllm_kvcomp._C`` extension built and covering the op and its case
   (compaction: any dtype; decode attention: float32/16, bf16, head_dim 64/128/256, ≤ 16
   query heads per KV head) -> **cuda**;
2. else tensors on CUDA -> **triton** (``vllm_kvcomp.triton_kernels``);
3. else (CPU tensors) -> **torch**, a vectorised PyTorch path over the same paged layout.

``backend="cuda" | "triton" | "torch"`` forces one; forcing ``triton`` on CPU
tensors needs ``TRITON_INTERPRET=1`` (tests, ``bench_kernels.py --device cpu``).

Shared conventions. One layer's cache is ``kv_cache [num_blocks, block_size, H_kv, 2D]`` (K in
``[0, D)``, V in ``[D, 2D)`` of a cell; any strides with a contiguous last dim: pass an LBHNC
cache as ``cache.transpose(1, 2)``); ``block_table [B, max_blocks]``: logical slot i of request b
is ``kv_cache[block_table[b, i // bs], i % bs]``; ``seq_lens [B]`` = N_b slots; per-head valid
ranges are right-aligned: head h of request b holds slots ``[start[b, h], N_b)``. Index tensors
may be any integer dtype (converted to int32). All ops work on CUDA graphs' fixed shapes except
where a ``max``/``n_max`` argument is left None (that reads a device value on the host).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from vllm_kvcomp.policies.lagkv import RANGE_EPS
from vllm_kvcomp.policies.lagkv import lagkv_scores as _lagkv_partition_scores

BACKENDS: tuple[str, ...] = ("cuda", "triton", "torch")
CUDA_OPS = ("compact_heads", "decode_attention")
CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_MAX_GROUP = 16


@functools.cache
def cuda_extension_available() -> bool:
    """Whether the optional ``vllm_kvcomp._C`` extension is built and registered its ops."""
    try:
        import vllm_kvcomp._C  # noqa: F401  (registers torch.ops.kvcomp)
    except ImportError:
        return False
    return hasattr(torch.ops, "kvcomp") and hasattr(torch.ops.kvcomp, "decode_attention")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(
    op: str, device: torch.device, backend: str | None = None, cuda_ok: bool = True
) -> str:
    """The backend that runs ``op`` on ``device`` (see the module docstring for the rule)."""
    choice = backend or "auto"
    if choice == "auto":
        if device.type != "cuda":
            return "torch"
        return "cuda" if op in CUDA_OPS and cuda_ok and cuda_extension_available() else "triton"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; pick one of {BACKENDS} or auto")
    if choice == "cuda" and (
        op not in CUDA_OPS or device.type != "cuda" or not cuda_extension_available() or not cuda_ok
    ):
        raise RuntimeError(
            f"{op}: the CUDA extension cannot run this case (built: {cuda_extension_available()})"
        )
    if choice == "triton" and device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"{op}: Triton on {device.type} tensors needs TRITON_INTERPRET=1")
    return choice


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _starts(
    start: torch.Tensor | int | None, batch: int, heads: int, device: torch.device
) -> torch.Tensor:
    """[B, H_kv] int32 (a broadcast view for None, an int or a [B] tensor)."""
    if start is None or isinstance(start, int):
        return torch.full((1, 1), start or 0, dtype=torch.int32, device=device).expand(batch, heads)
    start = _i32(start)
    return start.unsqueeze(1).expand(batch, heads) if start.dim() == 1 else start


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------------- torch path


def _slots(
    kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tuple selecting logical ``slots`` (any shape) of request b in ``kv_cache``."""
    bs = kv_cache.shape[1]
    return block_table[b, slots // bs].long(), slots % bs


def _torch_compact(
    kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, kept: Tensor, counts: Tensor
) -> None:
    """Torch compaction: gather every kept cell of a request, then write them right-aligned."""
    heads = kv_cache.shape[2]
    for b in range(kept.shape[0]):
        n = int(seq_lens[b])
        cnt = counts[b].long()
        j = torch.arange(kept.shape[2], device=kept.device)
        live = j.unsqueeze(0) < cnt.unsqueeze(1)  # [H, K_max]
        h_idx = torch.arange(heads, device=kept.device).unsqueeze(1).expand_as(live)[live]
        src = kept[b].long()[live]
        dst = (n - cnt.unsqueeze(1) + j.unsqueeze(0))[live]
        cells = kv_cache[(*_slots(kv_cache, block_table, b, src), h_idx)].clone()  # gather first
        kv_cache[(*_slots(kv_cache, block_table, b, dst), h_idx)] = cells


def _torch_decode(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    start: Tensor,
    comp: tuple[Tensor, Tensor, Tensor] | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Torch decode: per request [H_kv, G, N] logits, the compensation token as one more key."""
    batch, hq, d = q.shape
    hk = kv_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        slots = torch.arange(n, device=q.device)
        cells = kv_cache[_slots(kv_cache, block_table, b, slots)].float()  # [N, H_kv, 2D]
        k, v = cells[..., :d].transpose(0, 1), cells[..., d:].transpose(0, 1)  # [H_kv, N, D]
        qb = q[b].float().view(hk, group, d)
        logits = torch.einsum("hgd,hnd->hgn", qb, k) * scale
        visible = slots.view(1, 1, -1) >= start[b].long().view(-1, 1, 1)
        logits = logits.masked_fill(~visible, float("-inf"))
        if comp is not None:
            k_hat, v_hat, counts = comp
            c_logit = torch.einsum("hgd,hd->hg", qb, k_hat[b].float()) * scale + counts[
                b
            ].float().log().unsqueeze(1)
            logits = torch.cat([logits, c_logit.unsqueeze(-1)], dim=-1)
            v = torch.cat([v, v_hat[b].float().unsqueeze(1)], dim=1)
        row_lse = torch.logsumexp(logits, dim=-1)  # [H_kv, G]
        probs = torch.exp(logits - row_lse.nan_to_num(0.0, neginf=0.0).unsqueeze(-1))
        out[b] = torch.einsum("hgn,hnd->hgd", probs, v).reshape(hq, d).to(q.dtype)
        lse[b] = row_lse.reshape(hq)
    return out, lse


def _torch_window(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    start: Tensor,
    scale: float,
    with_entropy: bool,
    n_max: int,
) -> tuple[Tensor, Tensor | None]:
    """Torch window scores: per request [H_kv, G·w, N] probabilities, summed over rows."""
    batch, w, hq, d = q.shape
    hk = kv_cache.shape[2]
    group = hq // hk
    scores = torch.zeros(batch, hk, n_max, dtype=torch.float32, device=q.device)
    entropy = (
        torch.zeros(batch, hq, w, dtype=torch.float32, device=q.device) if with_entropy else None
    )
    for b in range(batch):
        n = int(seq_lens[b])
        slots = torch.arange(n, device=q.device)
        keys = (
            kv_cache[_slots(kv_cache, block_table, b, slots)][..., :d].float().transpose(0, 1)
        )  # [H_kv, N, D]
        qb = q[b].float().transpose(0, 1).reshape(hk, group * w, d)  # rows g·w + j
        logits = torch.einsum("hrd,hnd->hrn", qb, keys) * scale
        qpos = (n - w + torch.arange(w, device=q.device)).repeat(group)  # [G·w]
        visible = (slots.view(1, 1, -1) >= start[b].long().view(-1, 1, 1)) & (
            slots.view(1, 1, -1) <= qpos.view(1, -1, 1)
        )
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        scores[b, :, :n] = probs.sum(1)
        if entropy is not None:
            logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
            entropy[b] = -(probs * logp).sum(-1).reshape(hq, w)
    return scores, entropy


def _torch_lagkv(
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    start: Tensor,
    num_parts: Tensor,
    lag: int,
    max_parts: int,
) -> Tensor:
    """Torch LagKV: per request and head, the policy's scoring on the gathered partitions."""
    batch, hk, d = num_parts.shape[0], kv_cache.shape[2], kv_cache.shape[3] // 2
    scores = torch.zeros(batch, hk, max_parts, lag, dtype=torch.float32, device=kv_cache.device)
    for b in range(batch):
        for h in range(hk):
            first = int(start[b, h])
            parts = min(int(num_parts[b]), max_parts, (int(seq_lens[b]) - first) // lag - 1)
            if parts <= 0:
                continue
            slots = first + torch.arange((parts + 1) * lag, device=kv_cache.device).view(
                parts + 1, lag
            )
            cells = kv_cache[(*_slots(kv_cache, block_table, b, slots), h)]  # [P+1, L, 2D]
            k, v = cells[..., :d], cells[..., d:]
            scores[b, h, :parts] = _lagkv_partition_scores(k[:-1], v[:-1], k[1:], v[1:])
    return scores


# ---------------------------------------------------------------------------- public ops


def compact_heads(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kept: torch.Tensor,
    counts: torch.Tensor,
    backend: str | None = None,
) -> None:
    """In place: head h of request b moves its kept slots ``kept[b, h, :counts[b, h]]`` (sorted
    ascending) to slots ``[N_b - count, N_b)``, in order. kept [B, H_kv, K_max] (or [H_kv, K_max]
    with B = 1), counts [B, H_kv]. Overlap-safe (kept tokens only move right). Slots left of the
    new range keep stale data; the caller shifts its tables. Blocks must not be shared with other
    requests (prefix caching)."""
    if kept.dim() == 2:
        kept, counts = kept.unsqueeze(0), counts.reshape(1, -1)
        block_table, seq_lens = block_table.reshape(1, -1), seq_lens.reshape(1)
    args = (kv_cache, _i32(block_table), _i32(seq_lens), _i32(kept), _i32(counts))
    which = resolve_backend("compact_heads", kv_cache.device, backend)
    if which == "torch":
        _torch_compact(*args)
    elif which == "triton":
        from vllm_kvcomp.triton_kernels.compaction import compact_heads as triton_compact

        triton_compact(*args)
    else:
        batch, heads, k_max = kept.shape
        work = torch.empty(
            batch, heads, k_max, kv_cache.shape[-1], dtype=kv_cache.dtype, device=kv_cache.device
        )
        kv, bt, sl, kept32, counts32 = args
        with torch.cuda.device(kv_cache.device):
            torch.ops.kvcomp.compact_heads(
                kv, bt, sl, kept32.contiguous(), counts32.contiguous(), work, _stream(kv.device)
            )


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | int | None = None,
    compensation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q [B, H_q, D] (one token per request, GQA: query head i reads KV head
    i // (H_q / H_kv)) over each head's slots ``[start[b, h], N_b)`` (start [B], [B, H_kv] or
    None = 0), plus an optional compensation token ``(k_hat [B, H_kv, D], v_hat [B, H_kv, D],
    counts [B, H_kv])`` of weight N_d·exp(scale·q·k̂) (counts 0 = off). Returns out [B, H_q, D]
    (q's dtype) and lse [B, H_q] float32, natural log (-inf when nothing is attended), ready for
    ``merge_attn_states`` (transpose to [H, T]). ``num_splits`` fixes the GPU key split count.
    """
    batch, hq, d = q.shape
    hk = kv_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    start_bh = _starts(start, batch, hk, q.device)
    bt, sl = _i32(block_table), _i32(seq_lens)
    cuda_ok = _cuda_decode_supports(q, kv_cache)
    which = resolve_backend("decode_attention", q.device, backend, cuda_ok)
    if which == "torch":
        return _torch_decode(q, kv_cache, bt, sl, start_bh, compensation, scale)
    if num_splits is None:
        num_splits = _default_splits(q.device, batch * hk)
    k_hat, v_hat, counts = compensation if compensation is not None else (None, None, None)
    if counts is not None:
        counts = counts.to(torch.float32)
    if which == "triton":
        from vllm_kvcomp.triton_kernels.decode import decode_attention as triton_decode

        return triton_decode(q, kv_cache, bt, sl, start_bh, k_hat, v_hat, counts, scale, num_splits)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    mid_o = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    comp = (
        [None, None, None]
        if counts is None
        else [k_hat.float().contiguous(), v_hat.float().contiguous(), counts.contiguous()]
    )
    with torch.cuda.device(q.device):
        torch.ops.kvcomp.decode_attention(
            q,
            kv_cache,
            bt,
            sl,
            start_bh,
            *comp,
            scale,
            num_splits,
            mid_o,
            mid_lse,
            out,
            lse,
            _stream(q.device),
        )
    return out, lse


def _cuda_decode_supports(q: Tensor, kv_cache: Tensor) -> bool:
    """dtype, head dim, group size and vector alignment (D/32 elements per lane) of the CUDA kernel."""
    batch, hq, d = q.shape
    hk = kv_cache.shape[2]
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.dtype != kv_cache.dtype:
        return False
    if d not in CUDA_HEAD_DIMS or hq % hk or hq // hk > CUDA_MAX_GROUP or batch > 65535:
        return False
    lane = d // 32
    return kv_cache.data_ptr() % (lane * kv_cache.element_size()) == 0 and all(
        st % lane == 0 for st in kv_cache.stride()[:3]
    )


def _default_splits(device: torch.device, programs: int) -> int:
    """Key splits so that about two waves of programs cover the GPU (fixed per batch shape)."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(64, -(-2 * sms // max(programs, 1))))


def window_scores(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | int | None = None,
    scale: float | None = None,
    with_entropy: bool = False,
    n_max: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Observation-window scores: q [B, w, H_q, D] are the queries of slots ``[N_b - w, N_b)``;
    query j sees slots ``[start[b, h], N_b - w + j]``. Returns scores [B, H_kv, n_max] float32,
    the softmax probabilities summed over the w queries and the query group (divide by G·w for
    a mean), and with ``with_entropy`` the per-query entropy [B, H_q, w] (nats)."""
    batch, _, _, d = q.shape
    hk = kv_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    start_bh = _starts(start, batch, hk, q.device)
    bt, sl = _i32(block_table), _i32(seq_lens)
    n_max = int(sl.max()) if n_max is None and batch else (n_max or 0)
    if resolve_backend("window_scores", q.device, backend) == "torch":
        return _torch_window(q, kv_cache, bt, sl, start_bh, scale, with_entropy, n_max)
    from vllm_kvcomp.triton_kernels.window import window_scores as triton_window

    return triton_window(q, kv_cache, bt, sl, n_max, start_bh, scale, with_entropy)


def lagkv_scores(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | int,
    num_parts: torch.Tensor,
    lag: int,
    max_parts: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """LagKV scores (000_… eq. 5–9) of partitions ``p < num_parts[b]`` of every head: partition p
    of head h spans slots ``start[b, h] + p·lag + [0, lag)`` and is normalised by the following
    ``lag`` slots; partitions whose reference would pass N_b are not scored. Conventions of ``policies.lagkv.lagkv_scores`` (unbiased std, range clamped to
    ``RANGE_EPS``). Returns [B, H_kv, max_parts, lag] float32 (0 for missing partitions)."""
    num_parts = _i32(num_parts)
    batch, hk = num_parts.shape[0], kv_cache.shape[2]
    start_bh = _starts(start, batch, hk, kv_cache.device)
    max_parts = int(num_parts.max()) if max_parts is None and batch else (max_parts or 0)
    if resolve_backend("lagkv_scores", kv_cache.device, backend) == "torch":
        return _torch_lagkv(
            kv_cache, _i32(block_table), _i32(seq_lens), start_bh, num_parts, lag, max_parts
        )
    from vllm_kvcomp.triton_kernels.lagkv import lagkv_scores as triton_lagkv

    return triton_lagkv(
        kv_cache, _i32(block_table), _i32(seq_lens), start_bh, num_parts, lag, max_parts, RANGE_EPS
    )


__all__ = [
    "BACKENDS",
    "compact_heads",
    "cuda_extension_available",
    "decode_attention",
    "lagkv_scores",
    "resolve_backend",
    "window_scores",
]
