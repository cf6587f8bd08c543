"""Smoke test: ``vllm-kvcomp eval`` end to end against the live tiny-model server."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import BLOCK_SIZE
from vllm_kvcomp.cli import main

pytestmark = pytest.mark.server


def test_eval_harness_against_the_live_server(server, tmp_path):
    out = tmp_path / "results.jsonl"
    plots = tmp_path / "plots"
    code = main([
        "eval", "--url", server.url, "--model", server.model, "--tokenizer", server.model,
        "--tasks", "passkey5", "--policies", "full,streamingllm", "--ratios", "0.5",
        "--lengths", "512", "--samples", "2", "--out", str(out), "--plots", str(plots),
    ])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert not any(r["error"] for r in rows)
    compressed = [r for r in rows if r["policy"] == "streamingllm"]
    assert len(compressed) == 2
    for r in compressed:
        assert all(h.startswith("policy=streamingllm") for h in r["applied"])  # one per turn
        assert abs(r["kept_fraction"] - 0.5) <= BLOCK_SIZE / 512  # the budget, on the page grid
    assert all(r["kept_fraction"] == 1.0 for r in rows if r["policy"] == "full")
    assert (plots / "accuracy_passkey5.png").is_file()
    assert out.with_suffix(".md").read_text().count("passkey5") >= 2
