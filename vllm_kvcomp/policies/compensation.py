"""RazorAttention's compensation token in attention (eq. 5 of 003_…), as LSE merging.

The compensation token (k̂, v̂) stands for N_d dropped tokens: its softmax weight is
``N_d · exp(scale · q·k̂)``. As a partial attention result it has output v̂ and log-sum-exp
``scale · q·k̂ + ln N_d``; merging it with the kernel's (out, lse) over the kept tokens gives the
exact eq. 5 result. N_d = 0 gives lse = -inf, i.e. no compensation.

Two attention variants of the models we serve enter here, so that the engine, its kernels and
the HF oracle share one formula: logit soft-capping (Gemma 2: a logit ``x`` becomes
``cap · tanh(x / cap)``, the compensation token's too) and learned attention sinks (gpt-oss: one
extra logit per query head with a zero value, :func:`with_sinks`).
"""

from __future__ import annotations

import torch


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation copy: float64 stays float64, everything else computes in float32."""
    return x.double() if x.dtype == torch.float64 else x.float()


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` (Gemma 2's attention logit soft-capping); ``cap`` 0 = off."""
    return cap * torch.tanh(logits / cap) if cap else logits


def compensation_lse(q: torch.Tensor, k_hat: torch.Tensor, counts: torch.Tensor, scale: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """Log-weight of the compensation token.

    q [T, H_q, D], k_hat [H_q, D] (already expanded to query heads), counts [H_q] -> [T, H_q].
    """
    logits = soft_cap(torch.einsum("thd,hd->th", _acc(q), _acc(k_hat)) * scale, softcap)
    return logits + torch.log(counts.to(logits.dtype)).unsqueeze(0)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge learned attention sinks: one logit per query head whose value is zero.

    out [T, H, D], lse [T, H], sinks [H] or [T, H] (None = none) -> (out, lse) including them."""
    if sinks is None:
        return out, lse
    sink_lse = _acc(sinks).to(lse.dtype).expand(lse.shape)
    return merge_partials(out, lse, torch.zeros_like(out), sink_lse)


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of one head group, returning the log-sum-exp.

    q [T, H, D], k/v [S, H, D] (same head count as q), mask [T, S] or per head [H, T, S] bool
    (True = visible) or None, ``softcap`` the logit cap (0 = off). Returns out [T, H, D], lse [T, H].
    """
    logits = soft_cap(torch.einsum("thd,shd->hts", _acc(q), _acc(k)) * scale, softcap)
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
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 5: attention over kept keys plus the count-weighted compensation token (and the
    layer's sinks [H], if any).

    q [T, H, D], k/v [S, H, D], k_hat/v_hat [H, D], counts [H] (N_d; 0 = off). Returns [T, H, D].
    """
    out, lse = attention_with_lse(q, k, v, scale, mask, softcap)
    comp_lse = compensation_lse(q, k_hat, counts, scale, softcap)
    comp_out = _acc(v_hat).unsqueeze(0).expand(q.shape[0], -1, -1)
    merged, lse = merge_partials(out, lse, comp_out.to(out.dtype), comp_lse)
    return with_sinks(merged, lse, sinks)[0]

