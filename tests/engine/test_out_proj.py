"""The output projection a ``NEEDS_OUT_PROJ`` policy (criticalkv) reads: what the worker does
without one, how the reason reaches the request's result, and what vllm_compat refuses. The
engine reading the real ``o_proj`` is covered by tests/engine/test_oracle_equality.py (one rank)
and tests/engine/test_tensor_parallel.py (each rank's slice)."""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from tests.helpers.step_harness import StepHarness
from vllm_kvcomp import vllm_compat
from vllm_kvcomp.engine.metadata import WorkerReport

pytestmark = pytest.mark.vllm  # vLLM's scheduler (no engine, no model)

NO_O_PROJ = "layer model.layers.0.self_attn.attn: GPTNeoXAttention has no o_proj output projection"


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_without_an_output_projection_criticalkv_is_served_uncompressed_saying_why(tiny_model_dir, prefix_caching):
    """The other policies still compress; no block (copy-on-compress spares included) leaks."""
    h = StepHarness(tiny_model_dir, prefix_caching=prefix_caching)
    h.worker.out_proj, h.worker.no_out_proj = [], NO_O_PROJ  # what registering such a model leaves
    h.add("critical", _ids(600, 1), "criticalkv", max_tokens=8, ratio=0.25, window=8)
    h.add("snap", _ids(600, 2), "snapkv", max_tokens=8, ratio=0.25, window=8)
    h.run_until_idle()
    critical, snap = h.results["critical"]["kvcomp"], h.results["snap"]["kvcomp"]
    assert critical["applied"] == "none" and critical["compressions"] == 0 and critical["blocks_freed"] == 0
    assert critical["requested"].startswith("policy=criticalkv") and NO_O_PROJ in critical["reason"]
    assert snap["compressions"] == 1 and snap["blocks_freed"] > 0 and "reason" not in snap
    assert len(h.outputs["critical"]) == 8 and h.leaks() == []


def test_with_its_output_projection_criticalkv_compresses(tiny_model_dir):
    h = StepHarness(tiny_model_dir)
    h.add("critical", _ids(600, 3), "criticalkv", max_tokens=8, ratio=0.25, window=8)
    h.run_until_idle()
    assert h.results["critical"]["kvcomp"]["blocks_freed"] > 0 and h.leaks() == []


def test_ranks_reports_merge_the_requests_served_uncompressed():
    merged = WorkerReport(uncompressed={"a": "why"}).aggregate(WorkerReport(uncompressed={"b": "why not"}))
    assert merged.uncompressed == {"a": "why", "b": "why not"}


class _Layer:
    """Stands for a vLLM ``Attention`` layer (only its name is read before the refusal)."""

    layer_name = "model.layers.0.self_attn.attn"


def test_an_attention_layer_without_a_recorded_block_or_o_proj_is_refused(monkeypatch):
    layer, owner = _Layer(), torch.nn.Module()
    monkeypatch.setattr(vllm_compat, "_ATTENTION_OWNERS", weakref.WeakKeyDictionary())
    with pytest.raises(NotImplementedError, match="not seen being built"):
        vllm_compat.attention_output_weight(layer)
    vllm_compat._ATTENTION_OWNERS[layer] = weakref.ref(owner)
    with pytest.raises(NotImplementedError, match="Module has no o_proj"):
        vllm_compat.attention_output_weight(layer)
