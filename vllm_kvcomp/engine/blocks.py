"""What the scheduler half does to vLLM's block tables: admission by a bounded peak, spares for
copy-on-compress, taking columns out of the prefix cache, installing packed blocks.

The rules live here; every vLLM name and attribute they touch is reached through
:mod:`vllm_kvcomp.vllm_compat` (names only, each with its ledger entry).
"""

from __future__ import annotations

from typing import Any

from vllm_kvcomp import vllm_compat


def copy_on_compress_supported(kv_cache_manager: Any) -> bool:
    """Whether compressed requests can share the prefix cache (copy-on-compress): caching on,
    one KV-cache group (hybrid models stay salted), hashes per whole block."""
    if not vllm_compat.caching_enabled(kv_cache_manager):
        return False
    managers = vllm_compat.group_managers(kv_cache_manager)
    return len(managers) == 1 and managers[0].block_size == vllm_compat.hash_block_size(kv_cache_manager)


def room_for(kv_cache_manager: Any, req_id: str, num_tokens: int, bound: int) -> bool:
    """Whether the pool has the blocks a request needs to hold ``min(num_tokens, bound)`` tokens
    in every group (a sliding-window group holds at most its window and a block), beyond what it
    holds already: how a ``prefill=stream`` request is admitted (by its bounded peak)."""
    needed = 0
    for manager in vllm_compat.group_managers(kv_cache_manager):
        window = manager.sliding_window + manager.block_size if manager.sliding_window else num_tokens
        tokens = min(num_tokens, bound, window)
        needed += -(-tokens // manager.block_size) - len(manager.tables.get(req_id, ()))
    return needed <= vllm_compat.free_block_count(kv_cache_manager)


def new_blocks(kv_cache_manager: Any, count: int) -> list[Any] | None:
    """``count`` fresh private blocks (evicting cached free ones), or None if fewer are free."""
    if count <= 0:
        return []
    if vllm_compat.free_block_count(kv_cache_manager) < count:
        return None
    return vllm_compat.take_blocks(kv_cache_manager, count)


def make_private(kv_cache_manager: Any, req_id: str, start: int, end: int, group: int = 0) -> bool:
    """Take columns ``[start, end)`` of a running request out of the prefix cache so it may write
    into them; False (nothing changed) if another request shares one of those blocks."""
    table = vllm_compat.group_managers(kv_cache_manager)[group].tables[req_id]
    blocks = [b for b in table[max(start, 0) : end] if not vllm_compat.is_null_block(b)]
    if any(vllm_compat.block_refs(b) != 1 for b in blocks):
        return False
    for block in blocks:
        vllm_compat.uncache_block(kv_cache_manager, block)
    return True


def install_blocks(kv_cache_manager: Any, req_id: str, columns: dict[int, Any], group: int = 0) -> None:
    """Put ``columns`` (column -> block from :func:`new_blocks`) into a running request's block
    table, releasing the blocks they replace."""
    table = vllm_compat.group_managers(kv_cache_manager)[group].tables[req_id]
    null = vllm_compat.null_block(kv_cache_manager)
    old = []
    for col, block in columns.items():
        if table[col] is not null:
            old.append(table[col])
        table[col] = block
    vllm_compat.release_blocks(kv_cache_manager, old)


def pool_tokens(kv_cache_manager: Any, block_size: int) -> int:
    """Tokens the pool holds, the null block excluded."""
    return (vllm_compat.pool_blocks(kv_cache_manager) - 1) * block_size
