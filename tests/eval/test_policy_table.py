"""docs/policies.md's overview table is generated from the registry; run_power.sh covers the claims."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_kvcomp.eval import claims, policy_table, runner
from vllm_kvcomp.policies.registry import POLICY_NAMES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "policies.md"


def test_policies_doc_table_matches_the_registry() -> None:
    doc = DOC.read_text(encoding="utf-8")
    assert policy_table.rewrite(doc) == doc, (
        "docs/policies.md is out of date: python3 -m vllm_kvcomp.eval.policy_table --write docs/policies.md")
    assert set(policy_table.current_quality(doc)) == set(POLICY_NAMES)


def test_table_cells_come_from_the_classes() -> None:
    text = policy_table.table()
    lag = next(line for line in text.splitlines() if line.startswith("| `lagkv` |"))
    assert "`lag`=128 (≥ 1)" in lag and "`sink`=16 (≥ 0)" in lag and "| `stream` |" in lag
    razor = next(line for line in text.splitlines() if line.startswith("| `razor` |"))
    assert "yes (`razor` profile)" in razor and "`buffer`=512" in razor
    snap = next(line for line in text.splitlines() if line.startswith("| `snapkv` |"))
    assert "`kernel`=7 (1–63)" in snap and snap.endswith(f"| no | `block` | {policy_table.PENDING} |")
    full = next(line for line in text.splitlines() if line.startswith("| `full` |"))
    assert full.endswith(f"| no | no | {policy_table.PENDING} |")


def test_quality_column_from_results_and_kept_on_rewrite() -> None:
    records = [{"key": f"k{i}", "task": t, "policy": p, "condition": c, "ratio": r, "length": 2048,
                "score": s, "kept_fraction": 0.26, "error": None}
               for i, (t, p, c, r, s) in enumerate([
                   ("niah", "lagkv", "lagkv", 0.25, 1.0), ("passkey5", "lagkv", "lagkv", 0.25, 0.0),
                   ("niah", "lagkv", "lagkv:lag=64", 0.25, 1.0),  # not the default: left out
                   ("niah", "lagkv", "lagkv", 0.5, 1.0), ("niah", "full", "full", 1.0, 1.0)])]
    quality = policy_table.measured_quality(records)
    assert quality == {"lagkv": "0.50 [0.09, 0.91] (n=2, kept 0.26)",
                       "full": "1.00 [0.21, 1.00] (n=1, kept 0.26)"}
    doc = "intro\n" + policy_table.table() + "\nrest\n"
    filled = policy_table.rewrite(doc, quality)
    assert policy_table.current_quality(filled)["lagkv"] == quality["lagkv"]
    assert policy_table.rewrite(filled) == filled  # a plain regeneration keeps the measured column
    with pytest.raises(ValueError, match="markers"):
        policy_table.rewrite("no table")


def _script_policies() -> list[str]:
    text = (ROOT / "docs" / "results" / "quality" / "run_power.sh").read_text(encoding="utf-8")
    parts = re.findall(r'^POLICIES\+?="([^"]*)"', text, flags=re.M)
    return [p for part in parts for p in part.lstrip(",").split(",")]


def test_run_power_script_runs_every_claim_and_the_lag_sweep() -> None:
    policies = _script_policies()
    conds = runner.conditions(policies, [0.5, 0.25])
    labels = {(c.label, c.kept_ratio) for c in conds}
    for claim in claims.CLAIMS:
        for side in claim.conditions():
            assert (side.label, side.kept_ratio) in labels, f"{claim.name}: {side} not run"
    assert {("lagkv:lag=32", 0.25), ("lagkv:lag=64", 0.25), ("lagkv", 0.25),
            ("lagkv:lag=256", 0.25)} <= labels
    assert ("snapkv:kernel=31", 0.25) in labels
    assert len(conds) == 38  # 26 (issue #17) + issue #27's six policies at both ratios
    # the script is the run that wrote power.jsonl: every policy it names has results there, and a
    # policy added since (no quality yet) says so in the docs table instead of a number
    measured = {json.loads(line)["policy"] for line in (ROOT / "docs/results/quality/power.jsonl").open()}
    assert {c.policy for c in conds} == measured
    table = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    for name in set(POLICY_NAMES) - measured:
        assert re.search(rf"^\| `{name}` \|.*pending", table, flags=re.M), f"{name}: quality not marked pending"
