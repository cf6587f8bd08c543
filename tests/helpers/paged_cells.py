"""One small LBHNC KV buffer for the paged-cache tests, and eq. 5 as their float64 reference.

vLLM-free: the ``cuda-layout`` cases run on a GPU machine where vLLM is not installed
(``scripts/gpu_check.sh``); the ``cpu`` class's attention calls vLLM's CPU kernel, so its cases
carry the ``vllm`` marker (:data:`ATTEND_CASES`).
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.engine.cache import CpuPagedCache, CudaPagedCache
from vllm_kvcomp.policies.compensation import compensated_attention

L, HK, HQ, D, BS, NUM_BLOCKS = 2, 2, 4, 32, 32, 24
GROUP, SCALE = HQ // HK, D**-0.5
CLASSES = {"cpu": CpuPagedCache, "cuda-layout": CudaPagedCache}
CASES = [("cpu", "cpu"), ("cuda-layout", "cpu"), pytest.param("cuda-layout", "cuda", marks=pytest.mark.gpu)]
#: attention through the CPU class calls vLLM's CPU kernel
ATTEND_CASES = [pytest.param("cpu", "cpu", marks=pytest.mark.vllm), *CASES[1:]]


#: what every cell nobody wrote holds: finite (stale cells in an engine are), but a key this large
#: that leaks into a sequence dominates its softmax, so reading past a range shows
POISON = 1e3


def buffer(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """vLLM's allocation: one buffer, a per-layer [num_blocks, H_kv, bs, 2D] view each (LBHNC)."""
    storage = torch.full((L, NUM_BLOCKS, HK, BS, 2 * D), POISON, dtype=dtype, device=device)
    return [storage[layer] for layer in range(L)]


def eq5(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, comp: tuple | None, softcap: float = 0.0,
        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, G, D] (the last T tokens of keys/values [n, D], causal) -> [T, G, D] float64, with
    logits capped at ``softcap`` (0 = off) and ``sinks`` [G] (None = off)."""
    t, n = q.shape[0], keys.shape[0]
    mask = torch.arange(n).view(1, n) <= (n - t + torch.arange(t)).view(t, 1)
    k_hat, v_hat, count = comp if comp is not None else (torch.zeros(D), torch.zeros(D), 0.0)
    expand = lambda x: x.double().unsqueeze(1).expand(-1, GROUP, -1)  # noqa: E731
    return compensated_attention(q.double(), expand(keys), expand(values), k_hat.double().expand(GROUP, -1),
                                 v_hat.double().expand(GROUP, -1), torch.full((GROUP,), float(count)).double(),
                                 SCALE, mask, softcap, None if sinks is None else sinks.double())


