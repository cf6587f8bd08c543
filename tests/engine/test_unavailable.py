"""Engines that cannot compress serve every request, and every compressed request says so.

Speculative decoding with a draft model and a model whose every layer uses sliding-window
attention: the engine starts and keeps serving; a request asking for compression runs
uncompressed with ``applied: none`` and the reason in its result (what ``usage.kv_compression``
and the applied header report), never a claim of compression that did not happen. Engines run in
child processes (tests/engine/stream_engine.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.engine.conftest import prompt_ids
from tests.engine.stream_engine import engine_request, run_engine
from vllm_kvcomp.engine.metadata import WorkerReport
from vllm_kvcomp.engine.scheduler import KVCompScheduler, RequestStats
from vllm_kvcomp.engine.support import TARGET_ONLY_SPECULATION, unavailable_reason
from vllm_kvcomp.spec import CompressionSpec

pytestmark = pytest.mark.engine

SNAPKV = {"policy": "snapkv", "ratio": 0.25, "window": 8}


def _runs(model_dir, **engine_args):
    batch = [engine_request("plain", prompt_ids(300, seed=1), None, 6),
             engine_request("asked", prompt_ids(310, seed=2), SNAPKV, 6)]
    results, free = run_engine(model_dir, 512, [batch], pool=200, engine_args=engine_args)
    assert free["free"] == free["total"]
    return {r["name"].rsplit("-", 1)[0]: r for r in results}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model", "medusa", "mtp"])
def test_speculation_with_a_draft_model_is_served_uncompressed_naming_what_works(method):
    """Draft models keep their own KV in the request's blocks: refused (uncompressed, with the
    reason naming the methods that compress) — the server keeps serving. ngram / suffix compress
    (tests/engine/test_speculative.py), with synchronous scheduling only."""
    config = SimpleNamespace(speculative_config=SimpleNamespace(method=method), scheduler_config=SimpleNamespace(
        async_scheduling=False), model_config=None)
    reason = unavailable_reason(config)
    assert reason is not None and repr(method) in reason and "'ngram' or 'suffix'" in reason
    for method in TARGET_ONLY_SPECULATION:
        config.speculative_config = SimpleNamespace(method=method)
        assert unavailable_reason(config) is None
        config.scheduler_config.async_scheduling = True
        assert "--async-scheduling" in unavailable_reason(config)
        config.scheduler_config.async_scheduling = False


@pytest.mark.engine
def test_a_model_without_full_attention_layers_says_so(tmp_path):
    from tests.helpers.tiny_gemma import make_tiny_gemma3

    model = make_tiny_gemma3(tmp_path / "swa", layer_types=("sliding_attention",) * 2, sliding_window=64)
    result = _runs(model)["asked"]["kvcomp"]
    assert result["applied"] == "none" and "sliding-window" in result["reason"]


def test_a_worker_that_cannot_compress_tells_the_scheduler():
    """A backend or attention variant found unsupported in the worker (after the model loaded):
    the scheduler hears it in the next report, and every tracked request's result says so."""
    scheduler = KVCompScheduler(block_size=32)
    scheduler.requests["r"] = RequestStats(spec=CompressionSpec(policy="snapkv", ratio=0.25), prompt_len=100)
    report = WorkerReport().aggregate(WorkerReport(unavailable="layer x uses ALiBi"))
    scheduler.on_worker_report(report)
    params = scheduler.requests["r"].as_params()
    assert params["applied"] == "none" and params["reason"] == "layer x uses ALiBi"
    assert params["requested"] == CompressionSpec(policy="snapkv", ratio=0.25).to_header()
    assert scheduler.unavailable == "layer x uses ALiBi" and not scheduler.copy_on_compress
