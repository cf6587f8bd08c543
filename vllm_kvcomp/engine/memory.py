"""The memory vllm-kvcomp holds outside vLLM's KV pool on a worker, bounded at start-up.

A compression holds, at most, per part (:class:`PluginMemory`; one decision at a time, inside
the step or on the one side thread; packings only on the step's thread):

- ``layer_read``: a decision reads the request one layer at a time
  (:class:`~vllm_kvcomp.engine.cache.LayerReader`): that layer's K+V as read and right-aligned
  (two copies), plus on the host the keys' gather buffer; and the layer a policy still holds
  while it reads the next (twice that);
- ``per_cell``: arrays per (layer, KV head, token) of the request: a decision's float32 scores,
  observed attention and rankings for every layer until it allocates (four per cell, where the
  cache is), and a packing's int64 indices (on the host its plan's source and destination page,
  offset and row: six per cell; on a GPU the source and destination rows it sends: two), about
  an eighth (host) or a sixteenth (GPU, 16-bit K/V of 128 dimensions) of the request's K+V;
- ``window_attention``: one layer's attention of the query window over the request, which
  policies attend ``WINDOW_ROWS`` queries at a time (``H_q × rows × tokens`` float32: the
  logits, the weights and one temporary);
- ``packing``: the buffer a packing copies through (``MOVE_CHUNK`` cells,
  :meth:`~vllm_kvcomp.engine.pages.Move.staged`); an in-place compaction also holds the cells it
  must read before writing (none with copy-on-compress), allocated when needed.

On a GPU the reservation is taken from vLLM's KV budget, the way vLLM takes its CUDA graphs'
(:func:`~vllm_kvcomp.vllm_compat.reserve_outside_kv_cache`), so ``--gpu-memory-utilization``
means what it says; on the host vLLM's KV space is what the operator set, and the reservation is
logged and exported beside it (``vllm:kvcomp_reserved_bytes``). Per request, outside the
reservation: its query window (:attr:`PluginMemory.per_request`, at most ``2 × (window +
drafts)`` query rows of every layer) and, for a policy that reads the decode queries' attention,
a float32 per (layer, KV head, token).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from vllm_kvcomp.policies.base import WINDOW_ROWS

#: the widest query window a request may ask for when the connector is not told
#: (the operator config's ``bounds.max_window`` default)
DEFAULT_MAX_WINDOW = 512
#: bytes per (layer, KV head, token) of a request a compression keeps for every layer, on the host
#: and on a GPU (see the module doc)
BYTES_PER_CELL = {True: 4 * 4 + 6 * 8, False: 4 * 4 + 2 * 8}
#: most cells a packing copies through one buffer
MOVE_CHUNK = 16384


@dataclass(frozen=True)
class Shapes:
    """What the bound depends on: the compressed layers and heads of one rank, the cache's
    element size, the longest request, the widest window, and whether it runs on the host."""

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    elem_bytes: int
    max_len: int
    block_size: int
    max_window: int = DEFAULT_MAX_WINDOW
    host: bool = False

    def layer_kv(self) -> int:
        """One layer's K+V of the longest request (whole pages)."""
        tokens = -(-self.max_len // self.block_size) * self.block_size
        return tokens * self.num_kv_heads * self.head_dim * 2 * self.elem_bytes


@dataclass(frozen=True)
class PluginMemory:
    """Bytes by part (see the module doc); :attr:`reserved` is their sum."""

    layer_read: int
    per_cell: int
    window_attention: int
    packing: int
    per_request: int  # one request's query window at the widest window (not in the reservation)

    @classmethod
    def bound(cls, s: Shapes) -> PluginMemory:
        layer = s.layer_kv()
        gather = layer // 4 if s.host else 0  # the keys' K^T gather buffer, one layer's keys
        tokens = s.max_len * s.num_kv_heads * s.num_layers
        return cls(
            layer_read=2 * (2 * layer + gather),
            per_cell=BYTES_PER_CELL[s.host] * tokens,
            window_attention=3 * 4 * s.num_q_heads * min(s.max_window, WINDOW_ROWS) * s.max_len,
            packing=MOVE_CHUNK * 2 * s.head_dim * s.elem_bytes,
            per_request=2 * s.max_window * s.num_layers * s.num_q_heads * s.head_dim * s.elem_bytes,
        )

    @property
    def reserved(self) -> int:
        return self.layer_read + self.per_cell + self.window_attention + self.packing

    def describe(self) -> str:
        parts = ", ".join(f"{f.name} {_mib(getattr(self, f.name))}" for f in fields(self) if f.name != "per_request")
        return f"{_mib(self.reserved)} ({parts}); per compressed request up to {_mib(self.per_request)} of query window"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def shapes_of(vllm_config: Any) -> Shapes:
    """:class:`Shapes` of one rank of the engine ``vllm_config`` describes (every layer counted: a
    hybrid model compresses fewer, so this is an upper bound)."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = cache.cache_dtype if isinstance(cache.cache_dtype, torch.dtype) else model.dtype
    extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    return Shapes(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        num_q_heads=model.get_num_attention_heads(parallel),
        head_dim=model.get_head_size(),
        elem_bytes=torch.empty(0, dtype=dtype).element_size(),
        max_len=model.max_model_len,
        block_size=cache.block_size,
        max_window=int(extra.get("max_window", DEFAULT_MAX_WINDOW)),
        host=vllm_config.device_config.device_type == "cpu",
    )
