"""Shared parametrisation of the decode kernel tests: a small covering set for CI, the product for --run-slow.

Every listed value of every axis appears in ``COVER``; ``FULL`` is the cross product of the
numeric axes (layout, ragged and compensation cycle along it).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch

from vllm_kvcomp.kernels.fixtures import Paged, make_paged

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32, 128)
GROUPS = (1, 3, 4, 8)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    block_size: int
    group: int
    layout: str  # "NHC" (vLLM LBNHC) or "HNC" (LBHNC passed as a transposed view)
    ragged: bool  # per-head starts differ
    comp: bool  # compensation token on

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        flags = ("ragged" if self.ragged else "full") + ("-comp" if self.comp else "")
        return f"{dt}-d{self.head_dim}-bs{self.block_size}-g{self.group}-{self.layout}-{flags}"

    def paged(self, seq_lens: list[int], kv_heads: int, seed: int = 0) -> Paged:
        """The paged fixture (random block-table permutation) for this case on DEVICE."""
        return make_paged(
            seq_lens, kv_heads, self.head_dim, self.block_size, self.dtype, DEVICE, self.layout,
            seed=seed,
        )


COVER = [
    Case(torch.float32, 64, 16, 1, "NHC", True, True),
    Case(torch.float16, 128, 32, 3, "HNC", True, False),
    Case(torch.bfloat16, 64, 128, 4, "NHC", False, True),
    Case(torch.bfloat16, 128, 16, 8, "HNC", True, True),
    Case(torch.float16, 64, 32, 8, "NHC", False, False),
    Case(torch.float32, 128, 128, 3, "HNC", True, True),
]

FULL = [
    Case(dt, d, bs, g, ("NHC", "HNC")[i % 2], i % 3 != 0, i % 2 == 0)
    for i, (dt, d, bs, g) in enumerate(itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS))
]


def cases() -> list:
    """COVER as plain params, plus FULL marked slow."""
    return [pytest.param(c, id=str(c)) for c in COVER] + [
        pytest.param(c, id=f"full-{c}", marks=pytest.mark.slow) for c in FULL
    ]
