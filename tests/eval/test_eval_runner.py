"""Runner: conditions, resumable JSONL, and end to end against a fake OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from vllm_kvcomp.eval import cli, runner
from vllm_kvcomp.eval.haystack import essay_sentences
from vllm_kvcomp.eval.runner import Condition, Settings
from vllm_kvcomp.eval.tasks import TaskContext, plan
from vllm_kvcomp.eval.tasks.sizing import TokenCounter, load_counter

DEPTHS = (0.0, 0.5, 1.0)


def test_conditions_validate_and_put_full_once() -> None:
    conds = runner.conditions(["full", "lagkv", "none", "SnapKV"], [0.5, 0.25])
    assert conds == [Condition("full"), Condition("lagkv", 0.5), Condition("lagkv", 0.25),
                     Condition("snapkv", 0.5), Condition("snapkv", 0.25)]
    assert conds[0].header == "policy=full" and conds[0].kept_ratio == 1.0
    assert conds[2].header == "policy=lagkv; ratio=0.25"
    with pytest.raises(ValueError, match="unknown policy"):
        runner.conditions(["lagkvv"], [0.5])
    with pytest.raises(ValueError, match="ratios"):
        runner.conditions(["lagkv"], [0.0])
    with pytest.raises(ValueError, match="needs at least one ratio"):
        runner.conditions(["lagkv"], [])


def test_base_url_and_kept_fraction_sources() -> None:
    assert runner.base_url("http://h:8000/") == "http://h:8000/v1"
    assert runner.base_url("http://h:8000/v1") == "http://h:8000/v1"
    assert runner.kept_fraction({"kept_fraction": 0.3}, None) == 0.3
    assert runner.kept_fraction({"kept_tokens": 25, "prompt_tokens": 100}, None) == 0.25
    assert runner.kept_fraction(None, "policy=lagkv; kept_fraction=0.4") == 0.4
    assert runner.kept_fraction(None, "policy=lagkv; ratio=0.25") is None


def test_jsonl_resume_ignores_torn_lines_and_errors(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"key": "a"}) + "\n" + json.dumps({"key": "b", "error": "x"})
                   + "\n" + '{"key": "c", "sco')
    assert runner.done_keys(out) == {"a"}
    writer = runner.JsonlAppender(out)
    writer.write({"key": "d"})
    writer.close()
    assert [r["key"] for r in runner.read_jsonl(out)] == ["a", "b", "d"]
    assert runner.done_keys(tmp_path / "missing.jsonl") == set()


def _ctx(counter: TokenCounter, essay_dir: Path) -> TaskContext:
    return TaskContext(0, counter, DEPTHS, lambda: essay_sentences(essay_dir))


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_end_to_end_two_policies_and_resume(api: str, fake_server, whitespace_counter,
                                            essay_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    items = plan(["passkey5", "niah", "multiturn"], [600], 3)
    conds = runner.conditions(["full", "lagkv"], [0.4])
    settings = Settings(fake_server.url, "fake-model", api=api, concurrency=2)
    stats = runner.run(_ctx(whitespace_counter, essay_dir), items, conds, settings, out)
    records = runner.read_jsonl(out)
    assert stats.sent == len(records) == 3 * 3 * 2 and stats.errors == 0
    assert len(fake_server.requests) == 2 * (3 + 3 + 2 * 3)  # multiturn sends two requests

    headers = {r["header"] for r in fake_server.requests}
    assert headers == {"policy=full", "policy=lagkv; ratio=0.4"}
    assert all(r["body"]["temperature"] == 0 and r["body"]["max_tokens"] > 0
               for r in fake_server.requests)
    for r in records:
        assert r["applied"] == [r["header"]] * len(r["answers"])
        assert r["kept_fraction"] == r["ratio"] and r["kv_compression"][0]["kept_fraction"] == r["ratio"]
        assert r["error"] is None and 0.0 <= r["score"] <= 1.0

    full = [r for r in records if r["policy"] == "full"]
    assert all(r["score"] == 1.0 for r in full)
    window = [r for r in records if r["policy"] == "lagkv" and r["depth"] is not None]
    assert {r["score"] for r in window if r["depth"] == 1.0} == {1.0}  # needle in the kept tail
    assert {r["score"] for r in window if r["depth"] == 0.0} == {0.0}  # needle evicted

    if api == "chat":
        second = [q for q in fake_server.requests if len(q["body"]["messages"]) == 3]
        assert len(second) == 2 * 3
        assert all(q["body"]["messages"][1]["role"] == "assistant" for q in second)
    else:  # a base model continues the answer: passkey/niah prompts end with its start
        ends = [q["body"]["prompt"].rsplit("\n\n", 1)[1] for q in fake_server.requests]
        assert sum(e == "Assistant: The pass key is" for e in ends) == 2 * 3
        assert sum(e.startswith("Assistant: The special magic number for ") for e in ends) == 2 * 3
        assert sum(e == "Assistant:" for e in ends) == 2 * 2 * 3  # multiturn has none

    before = len(fake_server.requests)
    again = runner.run(_ctx(whitespace_counter, essay_dir), items, conds, settings, out)
    assert again.sent == 0 and again.skipped == 18 and len(fake_server.requests) == before
    assert len(runner.read_jsonl(out)) == 18


def test_context_scope_sends_the_question_as_its_own_message(fake_server, whitespace_counter,
                                                           essay_dir: Path, tmp_path: Path) -> None:
    """``--scope context``: every condition (full too) sends the document and the question as two
    user messages; compressing ones add ``scope=context`` so the server compresses the document
    only. Records say so and resume apart from the same conditions in scope ``all``."""
    out = tmp_path / "results.jsonl"
    items = plan(["passkey5", "niah", "multiturn"], [600], 2)
    conds = runner.conditions(["full", "snapkv"], [0.4], "context")
    settings = Settings(fake_server.url, "fake-model", concurrency=2)
    stats = runner.run(_ctx(whitespace_counter, essay_dir), items, conds, settings, out)
    records = runner.read_jsonl(out)
    assert stats.errors == 0 and len(records) == 3 * 2 * 2
    assert {r["header"] for r in fake_server.requests} == {"policy=full", "policy=snapkv; ratio=0.4; scope=context"}
    for request in fake_server.requests:
        messages = request["body"]["messages"]
        assert [m["role"] for m in messages[:2]] == ["user", "user"]
        assert messages[1]["content"].endswith("only.") and messages[1]["content"] not in messages[0]["content"]
        assert len(messages) in (2, 4)  # the multiturn's second request: + the reply and question 2
    # the fake server keeps the first message's tail only: the question, a message of its own, survives
    lost = [r for r in records if r["policy"] == "snapkv" and r["depth"] == 0.0]
    assert lost and all(r["score"] == 0.0 for r in lost)
    assert all(r["scope"] == "context" and r["key"].endswith("|context") for r in records)
    assert all(r["score"] == 1.0 for r in records if r["policy"] == "full")
    with pytest.raises(ValueError, match="--scope"):
        runner.conditions(["snapkv:scope=context"], [0.4])
    with pytest.raises(ValueError, match="scope must be one of"):
        runner.conditions(["snapkv"], [0.4], "question")


def test_failed_requests_are_recorded_retried_and_bounded(fake_server, whitespace_counter,
                                                          essay_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    items = plan(["passkey5"], [300], 2)
    conds = runner.conditions(["full", "h2o"], [0.5])
    settings = Settings(fake_server.url, "m", concurrency=1)
    stats = runner.run(_ctx(whitespace_counter, essay_dir), items, conds, settings, out)
    assert stats.errors == 2 and stats.sent == 4
    failed = [r for r in runner.read_jsonl(out) if r["error"]]
    assert len(failed) == 2 and all("400" in r["error"] for r in failed)

    again = runner.run(_ctx(whitespace_counter, essay_dir), items, conds, settings, out)
    assert again.sent == 2 and again.skipped == 2  # only the failures are retried

    strict = Settings(fake_server.url, "m", concurrency=1, max_errors=0)
    with pytest.raises(RuntimeError, match="failed requests"):
        runner.run(_ctx(whitespace_counter, essay_dir), items, conds, strict, out)


def test_cli_end_to_end_writes_results_summary_and_plots(fake_server, tokenizer_json: Path,
                                                         essay_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out, plots = tmp_path / "res" / "eval.jsonl", tmp_path / "plots"
    args = parser.parse_args([
        "--url", fake_server.url, "--model", "fake", "--tasks", "passkey64,niah,multi_niah",
        "--policies", "full,snapkv", "--ratios", "0.5,0.25", "--lengths", "700,1k",
        "--depths", "0,50,100", "--samples", "3", "--seed", "5", "--out", str(out),
        "--plots", str(plots), "--tokenizer", str(tokenizer_json), "--haystack", str(essay_dir)])
    assert cli.run(args) == 0
    records = runner.read_jsonl(out)
    assert len(records) == 3 * 2 * 3 * 3
    assert {r["length"] for r in records} == {700, 1024}
    table = capsys.readouterr().out
    assert "| passkey64 | snapkv | 0.25 | 1k | 3 |" in table
    cells, pooled = out.with_suffix(".md").read_text().split("## Pooled over tasks")
    assert cells.count("\n| ") == 1 + 3 * 2 * 3
    assert pooled.count("\n| ") == 2 * (1 + 3)  # per length: header + full and snapkv at 2 ratios
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["accuracy_multi_niah.png", "accuracy_niah.png", "accuracy_passkey64.png",
                     "heatmap_niah_full.png", "heatmap_niah_snapkv.png",
                     "heatmap_passkey64_full.png", "heatmap_passkey64_snapkv.png",
                     "memory_multi_niah.png", "memory_niah.png", "memory_passkey64.png"]

    report_only = parser.parse_args(["--report-only", "--out", str(out), "--summary",
                                     str(tmp_path / "again.md")])
    assert cli.run(report_only) == 0
    assert (tmp_path / "again.md").read_text() == out.with_suffix(".md").read_text()


def test_cli_reports_bad_input_without_traceback(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    base = ["--url", "http://127.0.0.1:9", "--model", "m", "--no-tokenizer", "--out",
            str(tmp_path / "r.jsonl")]
    assert cli.run(parser.parse_args([*base, "--policies", "bogus"])) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert cli.run(parser.parse_args([*base, "--depths", "150"])) == 2
    assert cli.run(parser.parse_args([*base, "--scope", "context", "--api", "completions"])) == 2
    assert "--scope context needs --api chat" in capsys.readouterr().err
    assert cli.run(parser.parse_args(["--no-tokenizer"])) == 2
    assert cli.parse_length("4k") == 4096 and cli.parse_length("1500") == 1500


def test_cli_default_tokenizer_is_the_bundled_model(monkeypatch: pytest.MonkeyPatch,
                                                    tokenizer_json: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvcomp import models

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    monkeypatch.setattr(models, "default_model_dir", lambda: tmp_path / "absent")
    args = parser.parse_args(["--url", "http://127.0.0.1:9", "--model", "m", "--out",
                              str(tmp_path / "r.jsonl")])
    assert cli.run(args) == 2
    assert "vllm-kvcomp model" in capsys.readouterr().err

    folder = tmp_path / "bundled"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    monkeypatch.setattr(models, "default_model_dir", lambda: folder)
    counter = cli._counter(args)
    assert counter.count("startup founders") == load_counter(tokenizer_json).count("startup founders")
