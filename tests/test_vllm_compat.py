"""``vllm_compat`` is names only: vLLM's internal instance attributes the engine relies on are
ledgered there (resolved against the installed vLLM by tests/test_architecture.py) and read or
written nowhere else; the rules built on them live in the engine (engine/blocks.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_kvcomp import vllm_compat

PACKAGE = Path(vllm_compat.__file__).parent
#: attribute names too common to tell vLLM's from ours (our page geometry has a block_size too)
GENERIC = {"block_size", "kv_cache_spec"}


def ledgered_attributes() -> set[str]:
    return {a for use in vllm_compat.LEDGER for a in use.attrs} - GENERIC


def attribute_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every ``x.name`` (read or write) in ``source``, but ``vllm_compat.name``
    (the accessor of that name)."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names
            and not (isinstance(node.value, ast.Name) and node.value.id == "vllm_compat")]


def test_ledgered_instance_attributes_are_touched_only_in_vllm_compat():
    names = ledgered_attributes()
    assert {"req_to_blocks", "ref_cnt", "num_cached_block", "null_block", "block_pool"} <= names
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} .{name}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "vllm_compat.py" for line, name in attribute_uses(path.read_text(), names)]
    assert found == [], "go through vllm_compat's accessors:\n" + "\n".join(found)


def test_the_scan_sees_a_planted_use():
    source = (PACKAGE / "engine" / "blocks.py").read_text()
    assert attribute_uses(source, ledgered_attributes()) == []
    planted = source + "\n\ndef _planted(block):\n    block.ref_cnt += 1\n"
    assert [name for _, name in attribute_uses(planted, ledgered_attributes())] == ["ref_cnt"]
