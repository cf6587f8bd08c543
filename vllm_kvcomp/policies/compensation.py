"""RazorAttention's compensation token in attention (eq. 5 of 003_…), as LSE merging.

The compensation token (k̂, v̂) stands for N_d dropped tokens: its softmax weight is
``N_d · exp(scale · q·k̂)``. As a partial attention result it has output v̂ and log-sum-exp
``scale · q·k̂ + ln N_d``; merging it with the kernel's (out, lse) over the kept tokens gives the
exact eq. 5 result. N_d = 0 gives lse = -inf, i.e. no compensation.
"""

from __future__ import annotations

import torch

from vllm_kvcomp.policies.base import Compensation


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation copy: float64 stays float64, everything else computes in float32."""
    return x.double() if x.dtype == torch.float64 else x.float()


def compensation_lse(q: torch.Tensor, k_hat: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """Log-weight of the compensation token.

    q [T, H_q, D], k_hat [H_q, D] (already expanded to query heads), counts [H_q] -> [T, H_q].
    """
    logits = torch.einsum("thd,hd->th", _acc(q), _acc(k_hat)) * scale
    return logits + torch.log(counts.to(logits.dtype)).unsqueeze(0)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two softmax-attention partials over disjoint key sets.

    out_* [T, H, D], lse_* [T, H] (natural log; -inf = empty). Returns (out [T, H, D], lse [T, H]).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).nan_to_num(0.0).unsqueeze(-1)
    out = _acc(out_a) * w_a + _acc(out_b) * w_b
    return out.to(out_a.dtype), lse


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of one head group, returning the log-sum-exp.

    q [T, H, D], k/v [S, H, D] (same head count as q), mask [T, S] or per head [H, T, S] bool
    (True = visible) or None. Returns out [T, H, D], lse [T, H].
    """
    logits = torch.einsum("thd,shd->hts", _acc(q), _acc(k)) * scale
    if mask is not None:
        logits = logits.masked_fill(~(mask if mask.dim() == 3 else mask.unsqueeze(0)), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [H, T]
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("hts,shd->thd", probs, _acc(v))
    return out.to(q.dtype), lse.transpose(0, 1)


def compensated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 5: attention over kept keys plus the count-weighted compensation token.

    q [T, H, D], k/v [S, H, D], k_hat/v_hat [H, D], counts [H] (N_d; 0 = off). Returns [T, H, D].
    """
    out, lse = attention_with_lse(q, k, v, scale, mask)
    comp_lse = compensation_lse(q, k_hat, counts, scale)
    comp_out = _acc(v_hat).unsqueeze(0).expand(q.shape[0], -1, -1)
    merged, _ = merge_partials(out, lse, comp_out.to(out.dtype), comp_lse)
    return merged


def stack_compensation(
    entries: list[Compensation | None], num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per-row compensation tokens as batch tensors: k_hat, v_hat [R, H_kv, D] and counts
    [R, H_kv] (float32; rows without one get count 0 = off), or None when no row has one."""
    if all(c is None for c in entries):
        return None
    k_hat = torch.zeros(len(entries), num_kv_heads, head_dim, dtype=torch.float32)
    v_hat = torch.zeros_like(k_hat)
    counts = torch.zeros(len(entries), num_kv_heads, dtype=torch.float32)
    for r, c in enumerate(entries):
        if c is not None:
            k_hat[r], v_hat[r], counts[r] = c.keys.float(), c.values.float(), c.counts.float()
    return k_hat, v_hat, counts
