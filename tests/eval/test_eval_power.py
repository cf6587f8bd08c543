"""Statistical power: Wilson intervals, conditions with settings, claim cells, verdicts, sweeps."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from vllm_kvcomp.eval import claims, cli, runner
from vllm_kvcomp.eval.cells import summarize
from vllm_kvcomp.eval.claims import Cell, Claim, decide, judge
from vllm_kvcomp.eval.report import report_markdown, sweep_markdown
from vllm_kvcomp.eval.runner import Condition
from vllm_kvcomp.eval.stats import wilson

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("mean", "n", "expected"), [
    (0.9, 10, (0.5958, 0.9821)),   # 9/10: the textbook Wilson interval
    (0.5, 20, (0.2993, 0.7007)),
    (0.0, 10, (0.0, 0.2775)),      # 0/10 still allows up to 28 %
    (1.0, 10, (0.7225, 1.0)),
    (0.5, 0, (0.0, 1.0)),          # no samples: no information
])
def test_wilson_interval(mean: float, n: int, expected: tuple[float, float]) -> None:
    assert wilson(mean, n) == pytest.approx(expected, abs=1e-4)


def test_conditions_with_settings_and_pinned_ratios() -> None:
    conds = runner.conditions(["full", "lagkv", "lagkv:lag=64", "lagkv:lag=128",
                               "razor:ratio=0.07:buffer=64", "entropy:max_ratio=1:min_ratio=1"],
                              [0.5, 0.25])
    labels = [(c.label, c.ratio) for c in conds]
    assert labels == [("full", None), ("lagkv", 0.5), ("lagkv", 0.25), ("lagkv:lag=64", 0.5),
                      ("lagkv:lag=64", 0.25), ("razor:buffer=64", 0.07),
                      ("entropy:max_ratio=1:min_ratio=1", 0.5),
                      ("entropy:max_ratio=1:min_ratio=1", 0.25)]  # lag=128 is the default: dropped
    lag = conds[4]
    assert lag.header == "policy=lagkv; ratio=0.25; lag=64"
    assert conds[5].header == "policy=razor; ratio=0.07; buffer=64"
    # a condition without settings keeps the old resume key, so old result files still resume
    assert runner.record_key("m", "niah/L2048/s0/0", Condition("lagkv", 0.25)) == \
        "m|niah/L2048/s0/0|lagkv|0.25"
    assert runner.record_key("m", "u", lag) == "m|u|lagkv:lag=64|0.25"


@pytest.mark.parametrize(("text", "match"), [
    ("lagkv:window=8", "does not take 'window'"),
    ("lagkv:lag", "expected key=value"),
    ("lagkv:lag=0", "below the minimum"),
    ("snapkv:budget=64", "does not take 'budget'"),
    ("full:ratio=0.5", "full"),
    ("snapkv:prefill=stream", "cannot compress during prefill|prefill"),
    ("lagkv:ratio=0", "ratio must be in"),
    ("bogus:lag=3", "unknown policy"),
])
def test_bad_condition_settings_are_rejected(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        runner.conditions([text], [0.5])


def test_schedule_gives_claim_cells_more_samples_sample_major() -> None:
    conds = runner.conditions(["full", "lagkv", "h2o"], [0.25])
    extra = claims.claim_samples(4)
    work = runner.schedule(["passkey64", "niah"], [2048], conds, 2, extra)
    counts: dict[tuple[str, str], int] = {}
    for (task, _, _), wanted in work:
        for c in wanted:
            counts[(task, c.label)] = counts.get((task, c.label), 0) + 1
    # lagkv and h2o at 0.25 on passkey64 carry a claim; full on niah carries razor~full
    assert counts == {("passkey64", "full"): 2, ("passkey64", "lagkv"): 4, ("passkey64", "h2o"): 4,
                      ("niah", "full"): 4, ("niah", "lagkv"): 2, ("niah", "h2o"): 2}
    assert [index for (_, _, index), _ in work] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="unknown task"):
        runner.schedule(["nope"], [2048], conds, 1)


def test_every_claim_names_valid_conditions() -> None:
    for claim in claims.CLAIMS:
        a, b = claim.conditions()
        assert a != b and claim.tasks
    named = {c for claim in claims.CLAIMS for c in (claim.a, claim.b)}
    assert claims.ENTROPY_UNIFORM in named and "entropy:max_ratio=1:min_ratio=1:ratio=0.25" not in named


def _cell(low: float, high: float) -> Cell:
    return Cell(20, (low + high) / 2, low, high, None)


def test_verdicts_come_from_intervals_not_point_estimates() -> None:
    assert decide("better", _cell(0.6, 0.9), _cell(0.1, 0.5)) == "reproduced"
    assert decide("better", _cell(0.1, 0.5), _cell(0.6, 0.9)) == "refuted"
    # A's point estimate is far above B's, but the intervals touch: undecided
    assert decide("better", _cell(0.5, 0.95), _cell(0.05, 0.5)) == "undecided"
    assert decide("no_worse", _cell(0.1, 0.4), _cell(0.5, 0.9)) == "refuted"
    assert decide("no_worse", _cell(0.4, 0.8), _cell(0.5, 0.9)) == "not refuted"
    assert decide("better", None, _cell(0.1, 0.2)) == "missing"


def _records(policy: str, ratio: float, scores: list[float], task: str = "passkey64",
             condition: str | None = None, kept: float | None = None, **extra: Any) -> list[dict]:
    label = condition or policy
    return [{"key": f"{task}|{label}|{ratio}|{i}", "task": task, "policy": policy,
             "condition": label, "ratio": ratio, "length": 2048, "index": i, "depth": None,
             "score": s, "exact": s == 1.0, "kept_fraction": kept if kept is not None else ratio,
             "details": dict(extra), "error": None} for i, s in enumerate(scores)]


def test_judge_reads_the_claimed_cells_and_metric() -> None:
    records = (_records("lagkv", 0.25, [1.0] * 18 + [0.0] * 2)
               + _records("h2o", 0.25, [0.0] * 18 + [1.0] * 2)
               + _records("snapkv", 0.25, [1.0] * 10 + [0.0] * 10))
    rows = summarize(records)
    verdicts = {v.claim.name: v for v in judge(rows)}
    assert set(verdicts) == {"lagkv>h2o@0.25", "lagkv>snapkv@0.25"}
    assert verdicts["lagkv>h2o@0.25"].verdict == "reproduced"  # 0.90 [0.70,0.97] vs 0.10 [0.03,0.30]
    assert verdicts["lagkv>snapkv@0.25"].verdict == "undecided"  # 0.90 vs 0.50 [0.30,0.70]
    turn = Claim("t", "src", "turn 2", ("multiturn",), "lagkv:ratio=0.25", "h2o:ratio=0.25",
                 metric="turn2")
    rows = summarize(_records("lagkv", 0.25, [0.5] * 20, "multiturn", turn2=0.0)
                     + _records("h2o", 0.25, [0.5] * 20, "multiturn", turn2=1.0))
    (v,) = judge(rows, [turn])
    assert v.verdict == "refuted" and v.a is not None and v.a.mean == 0.0


def test_lag_sweep_table_includes_the_default_lag() -> None:
    records = (_records("lagkv", 0.25, [1.0, 0.0], kept=0.31)
               + _records("lagkv", 0.25, [1.0, 1.0], condition="lagkv:lag=64", kept=0.28)
               + _records("lagkv", 0.25, [0.0, 0.0], condition="lagkv:lag=32", kept=0.27)
               + _records("lagkv", 0.25, [0.0], condition="lagkv:lag=32:sink=4")
               + _records("lagkv", 0.5, [1.0], condition="lagkv:lag=64"))
    text = sweep_markdown(summarize(records))
    assert "lagkv, ratio 0.25, 2k tokens (default lag=128)" in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split("|")[1].strip() for line in lines] == ["32", "64", "128"]
    assert "1.000 [0.34, 1.00] · 0.280 (n=2)" in lines[1]
    assert "ratio 0.5" not in text  # a single lag at 0.5 is no sweep
    assert "## LagKV lag sweep" in report_markdown(summarize(records))


def test_cli_claim_samples_and_settings_reach_the_server(fake_server, tokenizer_json: Path,
                                                         essay_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out, plots = tmp_path / "power.jsonl", tmp_path / "plots"
    base = ["--url", fake_server.url, "--model", "fake", "--tasks", "passkey5,niah",
            "--policies", "full,streamingllm,sagekv,lagkv:lag=64:ratio=0.25", "--ratios", "0.25",
            "--lengths", "600", "--depths", "0,100", "--samples", "2", "--out", str(out),
            "--plots", str(plots), "--tokenizer", str(tokenizer_json), "--haystack", str(essay_dir)]
    assert cli.run(parser.parse_args(base)) == 0
    first = len(runner.read_jsonl(out))
    assert first == 2 * 2 * 4
    assert cli.run(parser.parse_args([*base, "--claim-samples", "4"])) == 0
    records = runner.read_jsonl(out)
    per_cell: dict[tuple[str, str], int] = {}
    for r in records:
        per_cell[(r["task"], r["condition"])] = per_cell.get((r["task"], r["condition"]), 0) + 1
    # sagekv vs streamingllm (niah, passkey5) and razor~full (full) are claim cells; lag=64 not
    assert per_cell[("niah", "sagekv")] == per_cell[("passkey5", "streamingllm")] == 4
    assert per_cell[("niah", "full")] == 4 and per_cell[("niah", "lagkv:lag=64")] == 2
    assert len(records) == first + 2 * 2 * 3  # only the new samples were sent
    assert "policy=lagkv; ratio=0.25; lag=64" in {q["header"] for q in fake_server.requests}
    text = capsys.readouterr().out
    assert "## Claims" in text and "| SAGE-KV beats StreamingLLM at the same 4x budget |" in text
    assert (plots / "memory_niah.png").read_bytes().startswith(PNG_MAGIC)
    assert (plots / "heatmap_niah_lagkv_lag64.png").is_file()
