"""Launcher-side helpers of the Triton kernels: cache checks, interpreter detection."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run in float32 (float32 data or the interpreter, see ``qk_dot``)."""
    return dtype == torch.float32 or interpreting()


@dataclass(frozen=True)
class CacheView:
    """Geometry of one layer's paged cache ``[num_blocks, block_size, H_kv, 2*D]`` (any strides).

    The last dim holds K in ``[0, D)`` and V in ``[D, 2D)`` and must have stride 1; LBHNC caches
    are passed as ``cache.transpose(1, 2)`` of their ``[num_blocks, H_kv, block_size, 2D]`` view.
    """

    block_size: int
    num_heads: int
    head_dim: int
    stride_blk: int
    stride_tok: int
    stride_head: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> CacheView:
        if kv_cache.dim() != 4:
            raise ValueError(
                f"kv_cache must be [num_blocks, block_size, H_kv, 2*D], got {tuple(kv_cache.shape)}"
            )
        if kv_cache.shape[-1] % 2:
            raise ValueError(f"kv_cache last dim {kv_cache.shape[-1]} is not 2*D")
        if kv_cache.stride(-1) != 1:
            raise ValueError("kv_cache cells (last dim) must be contiguous")
        s_blk, s_tok, s_head, _ = kv_cache.stride()
        _, bs, h, c = kv_cache.shape
        return cls(bs, h, c // 2, s_blk, s_tok, s_head)


def check_query(q: torch.Tensor, view: CacheView, kv_cache: torch.Tensor) -> None:
    """q [..., H_q, D] must match the cache's heads/dim and share its supported dtype."""
    hq, d = q.shape[-2:]
    if d != view.head_dim or hq % view.num_heads or q.stride(-1) != 1:
        raise ValueError(
            f"q {tuple(q.shape)} does not match a cache of {view.num_heads} heads of dim {view.head_dim}"
        )
    if q.dtype not in SUPPORTED_DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(
            f"q and kv_cache must share one of {SUPPORTED_DTYPES}, got {q.dtype}/{kv_cache.dtype}"
        )


def check_int_table(name: str, t: torch.Tensor, dims: int) -> None:
    """Index tensors are int32 with the given rank (``vllm_kvcomp.kernels`` converts first)."""
    if t.dtype != torch.int32 or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d int32 tensor, got {t.dtype} {tuple(t.shape)}")


def per_head(t: torch.Tensor | None, batch: int, heads: int, name: str) -> torch.Tensor | None:
    """A [B] or [B, H] int32 tensor as a [B, H] view (stride 0 over heads for [B])."""
    if t is None:
        return None
    if t.dim() == 1:
        t = t.unsqueeze(1).expand(batch, heads)
    if tuple(t.shape) != (batch, heads) or t.dtype != torch.int32:
        raise ValueError(
            f"{name} must be int32 [B] or [B, H_kv] = [{batch}, {heads}], got {t.dtype} {tuple(t.shape)}"
        )
    return t
