"""The memory kvcomp holds outside vLLM's KV pool: bounded at start-up from the engine's shapes,
exported as a gauge (the bound's parts are what the step harness and bench memory check)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.conftest import BLOCK_SIZE, TINY
from vllm_kvcomp.engine.memory import DEFAULT_MAX_WINDOW, PluginMemory, Shapes, shapes_of

pytestmark = pytest.mark.engine


def test_the_bound_is_computed_for_the_engines_shapes_and_exported(engine):
    connector = engine.scheduler.connector
    shapes = shapes_of(connector._vllm_config)
    assert shapes == Shapes(num_layers=TINY["num_layers"], num_kv_heads=TINY["num_kv_heads"],
                            num_q_heads=TINY["num_heads"], head_dim=TINY["head_dim"], elem_bytes=4, max_len=2048,
                            block_size=BLOCK_SIZE, max_window=DEFAULT_MAX_WINDOW, host=True)
    bound = connector.memory_bound()
    assert engine.sched_connector.gauges()["reserved_bytes"] == bound.reserved == PluginMemory.bound(shapes).reserved
    assert all(part in bound.describe() for part in ("layer_read", "per_cell", "window_attention", "packing"))


def test_the_bound_grows_with_the_longest_request_and_not_with_the_window_past_a_run_of_rows():
    """A decision holds one layer's K+V and per-cell arrays of the longest request, and the
    window attended a run of rows at a time: doubling max_len about doubles the parts that scale
    with it; a window past WINDOW_ROWS adds nothing."""
    from vllm_kvcomp.policies.base import WINDOW_ROWS

    base = Shapes(num_layers=4, num_kv_heads=2, num_q_heads=8, head_dim=16, elem_bytes=2, max_len=1024,
                  block_size=16, max_window=WINDOW_ROWS)
    one, two = PluginMemory.bound(base), PluginMemory.bound(dataclasses.replace(base, max_len=2048))
    assert (two.layer_read, two.per_cell, two.window_attention) == (2 * one.layer_read, 2 * one.per_cell,
                                                                       2 * one.window_attention)
    assert two.packing == one.packing
    assert PluginMemory.bound(dataclasses.replace(base, max_window=8 * WINDOW_ROWS)) == dataclasses.replace(
        one, per_request=8 * one.per_request)
    assert one.layer_read >= 4 * base.layer_kv()  # read and right-aligned, the layer before still held
