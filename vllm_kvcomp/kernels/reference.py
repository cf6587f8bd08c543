"""The one plain-PyTorch paged decode attention: the CPU path of ``vllm_kvcomp.kernels`` and the
reference the Triton and CUDA kernels are tested against.

It gathers every request's cells through the block table, masks each KV head to its right-aligned
suffix ``[start[b, h], N_b)`` and runs the policy-side math of
:mod:`vllm_kvcomp.policies.compensation` (``attention_with_lse``, then RazorAttention's eq. 5
token via ``compensation_lse`` and ``merge_partials``), so kernels, engine and policies share one
formula. Batch and KV heads are folded into one head axis and the G query heads of a KV head
into the token axis, so GQA never repeats keys.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vllm_kvcomp.policies.compensation import (
    attention_with_lse,
    compensation_lse,
    merge_partials,
    soft_cap,
    with_sinks,
)

Compensation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def head_starts(
    start: torch.Tensor | int | None, batch: int, heads: int, device: torch.device
) -> torch.Tensor:
    """Per-head starts [B, H_kv] int32 from None/an int (all heads), [B] or [B, H_kv].

    None, an int and [B] give a broadcast (stride-0) view; no copy is made.
    """
    if start is None or isinstance(start, int):
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a graph's memory is its own pool: no tensor made during a capture is cached
            return torch.full((1, 1), start or 0, dtype=torch.int32, device=device).expand(batch, heads)
        return _constant_start(start or 0, device).expand(batch, heads)
    start = start if start.dtype == torch.int32 else start.to(torch.int32)
    return start.unsqueeze(1).expand(batch, heads) if start.dim() == 1 else start


@functools.lru_cache(maxsize=64)
def _constant_start(value: int, device: torch.device) -> torch.Tensor:
    """A [1, 1] int32 ``value`` on ``device``, made once (a launch saved per decode call on a GPU;
    read-only: callers expand it)."""
    return torch.full((1, 1), value, dtype=torch.int32, device=device)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs compute in float64 (an exact reference), everything else in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_heads(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values [N_max, B·H_kv, D] of every request padded to N_max, and visible [B·H_kv, N_max].

    Cell (b, h, i) is visible when ``start[b, h] <= i < N_b``. Invisible cells are zeroed: stale or
    unowned slots may hold anything (NaN included) and a zero attention weight times NaN is NaN.
    """
    batch, heads = starts.shape
    d = kv_cache.shape[3] // 2
    n_max = int(seq_lens.max()) if batch else 0
    slots = torch.arange(n_max, device=kv_cache.device)
    live = slots < seq_lens.to(kv_cache.device).long().unsqueeze(1)  # [B, N]
    safe = torch.where(live, slots, 0)  # past N_b read slot 0 of the request: owned, then masked
    bs = kv_cache.shape[1]
    blocks = block_table.to(kv_cache.device).long().gather(1, safe // bs)
    cells = kv_cache[blocks, safe % bs]  # [B, N, H_kv, 2D]
    visible = live.unsqueeze(1) & (slots >= starts.to(kv_cache.device).long().unsqueeze(2))
    cells = torch.where(visible.transpose(1, 2).unsqueeze(-1), cells, 0.0)
    cells = cells.permute(1, 0, 2, 3).reshape(n_max, batch * heads, 2 * d)
    return cells[..., :d], cells[..., d:], visible.reshape(batch * heads, n_max)


def decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | int | None = None,
    compensation: Compensation | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    observe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q [B, H_q, D] over each KV head's slots ``[start[b, h], N_b)``.

    kv_cache [num_blocks, block_size, H_kv, 2D] (K in ``[0, D)``, V in ``[D, 2D)``, any strides),
    block_table [B, max_blocks], seq_lens [B], start None/int/[B]/[B, H_kv]; query head i reads
    KV head i // (H_q / H_kv). ``compensation = (k_hat [B, H_kv, D], v_hat [B, H_kv, D],
    counts [B, H_kv])`` adds a token of weight N_d·exp(scale·q·k̂) and value v̂ (counts 0 = off).
    ``softcap`` caps every logit, the token's too (0 = off); ``sinks`` [H_q] or [B, H_q] are
    learned sink logits with a zero value (counted in the LSE). Computes in float32 (float64 when q is float64). Returns out [B, H_q, D] in q's dtype and
    lse [B, H_q] (natural log, -inf when nothing is attended; float32, float64 for float64 q).
    ``observe`` [B, H_kv] int64 (CPU tensors only): addresses of float32 rows (0 = none) that get
    :func:`observed_weights_reference` added (the Triton kernel's ``observe``).
    """
    batch, hq, d = q.shape
    hk = kv_cache.shape[2]
    if hq % hk:
        raise ValueError(f"{hq} query heads do not group over {hk} KV heads")
    group = hq // hk
    scale = d**-0.5 if scale is None else scale
    acc = accumulation_dtype(q.dtype)
    starts = head_starts(start, batch, hk, q.device)
    keys, values, visible = gather_heads(kv_cache, block_table, seq_lens, starts)
    # tokens = the G query heads of a KV head; heads = (request, KV head) pairs
    qg = q.to(acc).reshape(batch * hk, group, d).transpose(0, 1)  # [G, B·H_kv, D]
    mask = visible.unsqueeze(1).expand(-1, group, -1)  # [B·H_kv, G, N]
    out, lse = attention_with_lse(qg, keys.to(acc), values.to(acc), scale, mask, softcap)
    if compensation is not None:
        k_hat, v_hat, counts = (t.to(device=q.device, dtype=acc) for t in compensation)
        c_lse = compensation_lse(qg, k_hat.reshape(batch * hk, d), counts.reshape(-1), scale, softcap)
        c_out = v_hat.reshape(1, batch * hk, d).expand(group, -1, -1)
        out, lse = merge_partials(out, lse, c_out, c_lse)
    if sinks is not None:  # [G, B·H_kv] in the folded layout
        per_row = sinks.to(device=q.device, dtype=acc).expand(batch, hq)
        out, lse = with_sinks(out, lse, per_row.reshape(batch * hk, group).transpose(0, 1))
    out = out.transpose(0, 1).reshape(batch, hq, d).to(q.dtype)
    if observe is not None:
        weights = observed_weights_reference(q, kv_cache, block_table, seq_lens, starts, scale, softcap)
        add_to_rows(observe, weights, seq_lens)
    return out, lse.transpose(0, 1).reshape(batch, hq)


def observed_weights_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | int | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """[B, H_kv, N_max]: at slot i of KV head h of request b, the softmax weight of that cell
    among the head's cells ``[start[b, h], N_b)`` alone (soft-capped logits where ``softcap``; no
    compensation token, no sink), the mean over the head's G query heads; 0 at the other slots.
    What H2O accumulates (``observe``). Arguments as :func:`decode_reference`; float32 (float64
    for float64 q)."""
    batch, hq, d = q.shape
    hk = kv_cache.shape[2]
    if hq % hk:
        raise ValueError(f"{hq} query heads do not group over {hk} KV heads")
    scale = d**-0.5 if scale is None else scale
    acc = accumulation_dtype(q.dtype)
    keys, _, visible = gather_heads(kv_cache, block_table, seq_lens, head_starts(start, batch, hk, q.device))
    qg = q.to(acc).reshape(batch * hk, hq // hk, d)  # [B·H_kv, G, D]
    logits = soft_cap(torch.einsum("sgd,nsd->sgn", qg, keys.to(acc)) * scale, softcap)
    logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a head with no cell: 0 everywhere
    return weights.mean(dim=1).view(batch, hk, -1)


def add_to_rows(addresses: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor) -> None:
    """Add ``weights[b, h, :lengths[b]]`` ([B, H, N]) to the float32 row at ``addresses[b, h]``
    ([B, H] int64, 0 = none; a row holds at least ``lengths[b]`` floats), as the kernels'
    ``observe`` does: host memory only."""
    if addresses.dtype != torch.int64 or addresses.shape != weights.shape[:2]:
        raise ValueError(f"observe must be int64 [B, H_kv] = {list(weights.shape[:2])}, got "
                         f"{addresses.dtype} {list(addresses.shape)}")
    if addresses.device.type != "cpu" or weights.device.type != "cpu":
        raise ValueError("the torch reference adds observed weights to CPU rows only; on a GPU use the "
                         "Triton backend")
    for b, (row_addresses, n) in enumerate(zip(addresses.tolist(), lengths.tolist())):
        for h, address in enumerate(row_addresses):
            if address and n:
                row = torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)
                row += weights[b, h, :n].to(torch.float32)


#: elements of one [H_q, rows, hidden] product block of :func:`projected_l1_norms_reference` (bounds its memory)
PROJECTED_BLOCK = 1 << 22


def projected_l1_norms_reference(values: torch.Tensor, weight: torch.Tensor,
                                 block: int = PROJECTED_BLOCK) -> torch.Tensor:
    """[H_kv, N] ``mean_{q ∈ G(h)} ||v_i W_o^q||₁`` of values [H_kv, N, D] and weight
    [H_q, D, hidden] of one dtype: the product in it, one batched product per block of rows
    (``block`` elements of [H_q, rows, hidden] at a time), the norms summed in float32 (float64
    for float64)."""
    hk, n, _ = values.shape
    hq, _, hidden = weight.shape
    group = hq // hk
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    rows = max(1, block // (hq * hidden))
    out = torch.empty(hk, n, dtype=acc, device=values.device)
    for start in range(0, n, rows):
        grouped = values[:, start:start + rows].repeat_interleave(group, dim=0)  # [H_q, rows, D]
        projected = torch.bmm(grouped, weight)  # [H_q, rows, hidden]: every query head's W_o as it lies
        out[:, start:start + rows] = projected.abs().sum(dim=-1, dtype=acc).view(hk, group, -1).mean(dim=1)
    return out


def prefill_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    query_start: torch.Tensor,
    compensation: Compensation | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of S sequences of one KV head: :func:`decode_reference` per query row.

    q [T_total, G, D]; sequence s owns rows ``query_start[s]:query_start[s + 1]`` ([S + 1]), the
    last T of its ``lengths[s]`` cells, its pages ``tables[s]`` of kv_cache [num_pages, bs, 1, 2D];
    row t of T sees cells ``< lengths[s] - (T - 1 - t)``. ``compensation = (k_hat [S, D],
    v_hat [S, D], counts [S])``, ``sinks`` [S, G], ``softcap`` as in :func:`decode_reference`.
    Returns out [T_total, G, D] in q's dtype and lse [T_total, G] (float64 for float64 q).
    """
    rows = (query_start[1:] - query_start[:-1]).long().to(q.device)
    seq = torch.repeat_interleave(torch.arange(rows.numel(), device=q.device), rows, output_size=q.shape[0])
    after = (query_start[1:].long().to(q.device) - 1)[seq] - torch.arange(q.shape[0], device=q.device)
    ends = (lengths.long().to(q.device)[seq] - after).clamp(min=0)  # row i sees cells [0, ends[i])
    comp = None if compensation is None else tuple(t.to(q.device)[seq].unsqueeze(1) for t in compensation)
    return decode_reference(q, kv_cache, tables.to(q.device)[seq], ends, None, comp, scale, softcap,
                            None if sinks is None else sinks.to(q.device)[seq])
