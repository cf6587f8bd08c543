"""``vllm-kvcomp bench soak``: the pure parts (request drawing from the registry, slope fit,
idle-point check, report) without a server, and a short soak through a live server (slow)."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from vllm_kvcomp.bench import soak
from vllm_kvcomp.bench.common import build_parser
from vllm_kvcomp.bench.serving import feasible_ratios
from vllm_kvcomp.eval.tasks.sizing import CharEstimateCounter
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.registry import (
    NO_COMPRESSION_WORDS,
    POLICY_NAMES,
    get_policy_class,
    streaming_policy_names,
)
from vllm_kvcomp.spec import CompressionSpec

MAX_LEN = 4416


def drawer(labels: list[str] | None = None, seed: int = 0) -> soak.Drawer:
    labels = labels or soak.policy_labels("all", POLICY_NAMES)[0]
    return soak.Drawer(seed, labels, [0.125, 0.25, 0.5], (256, 4096), (16, 256), MAX_LEN)


# ---------------------------------------------------------------------------- drawing requests


def test_all_is_none_plus_every_registered_policy_the_model_can_use():
    labels, left_out = soak.policy_labels("all", [p for p in POLICY_NAMES if p not in ("razor", "pod")])
    assert labels == ["none", *(p for p in POLICY_NAMES if p not in ("razor", "pod"))]
    assert left_out == ["razor", "pod"]
    assert soak.policy_labels("none", POLICY_NAMES) == (["none"], [])
    assert soak.policy_labels("None, SnapKV", POLICY_NAMES) == (["none", "snapkv"], [])
    with pytest.raises(SystemExit, match="unknown"):
        soak.policy_labels("none,zip", POLICY_NAMES)


def test_draws_cover_every_policy_route_and_client_behaviour():
    source = drawer()
    draws = [source.draw() for _ in range(6000)]  # ~120 malformed over 12 kinds: each drawn
    normal = [d for d in draws if d.malformed is None]
    assert {d.label for d in normal} == {"none", *POLICY_NAMES}
    assert {d.route for d in normal} == {"chat", "completions"}
    assert {d.stream for d in normal} == {True, False}
    assert all(256 <= d.prompt_tokens <= 4096 and 16 <= d.max_tokens <= 256 for d in normal)
    assert all(d.prompt_tokens + d.max_tokens + soak.CHAT_MARGIN <= MAX_LEN for d in normal)
    aborted = [d for d in normal if d.abort_after is not None]
    assert 0.07 < len(aborted) / len(draws) < 0.13
    assert all(d.stream and 0 <= d.abort_after <= d.max_tokens // 2 + 1 for d in aborted)
    assert any(d.abort_after == 0 for d in aborted)  # some close before the first token
    assert 0.01 < (len(draws) - len(normal)) / len(draws) < 0.03
    assert {d.malformed.kind for d in draws if d.malformed} == {c.kind for c in soak.malformed_cases(POLICY_NAMES, MAX_LEN)}


def test_prefill_stream_block_and_ratio_only_where_the_registry_allows_them():
    source = drawer()
    normal = [d for d in (source.draw() for _ in range(3000)) if d.malformed is None]
    streamed = {d.label for d in normal if d.prefill is not None}
    assert streamed == {d.label for d in normal if d.compressed}
    assert {d.label for d in normal if d.prefill == "stream"} == set(streaming_policy_names()) & streamed
    for d in normal:
        accepts_ratio = d.label != "none" and "ratio" in get_policy_class(d.label).accepted_params()
        assert (d.ratio is not None) == accepts_ratio, d
        assert d.compressed == (d.label not in NO_COMPRESSION_WORDS)
    for label in streamed:  # about half of a compressing policy's requests compress their prefill
        mine = [d for d in normal if d.label == label]
        assert 0.3 < sum(d.prefill is not None for d in mine) / len(mine) < 0.7


def test_every_drawn_spec_is_valid_and_every_malformed_header_is_not():
    source = drawer()
    for d in (source.draw() for _ in range(1500)):
        if d.malformed is not None:
            continue
        if d.header() is not None:
            spec = CompressionSpec.from_header(d.header())
        elif d.settings():
            assert d.in_body
            spec = CompressionSpec.from_mapping(d.settings())
        else:
            assert d.label == "none"
            continue
        spec.build_policy()
        assert spec.policy == d.label
    for case in soak.malformed_cases(POLICY_NAMES, MAX_LEN):
        if case.header is not None and case.path == "/v1/completions":
            with pytest.raises(SpecError):
                CompressionSpec.from_header(case.header).build_policy()


def test_malformed_cases_come_from_the_registry():
    cases = soak.malformed_cases(POLICY_NAMES, MAX_LEN)
    scoring = [c.header.split(";")[0].split("=")[1] for c in cases if c.kind == "prefill=stream on a scoring policy"]
    assert set(scoring) == set(POLICY_NAMES) - set(streaming_policy_names()) - set(NO_COMPRESSION_WORDS)
    assert {c.header for c in cases if c.kind == "unknown policy"}.isdisjoint({f"policy={p}" for p in POLICY_NAMES})
    assert [c.prompt_tokens for c in cases if c.kind == "prompt over the model length"] == [MAX_LEN + 1]


def test_a_server_without_the_plugin_gets_only_the_malformed_requests_vllm_refuses_itself():
    native = {c.kind for c in soak.malformed_cases(POLICY_NAMES, MAX_LEN) if c.native}
    assert native == {"body not JSON", "max_tokens negative", "prompt over the model length"}
    plain = soak.Drawer(0, ["none"], [0.25], (256, 4096), (16, 256), MAX_LEN, soak.Shares(malformed=0.5),
                        native_only=True)
    draws = [plain.draw() for _ in range(400)]
    assert {d.malformed.kind for d in draws if d.malformed} == native
    assert all(not d.settings() and d.header() is None for d in draws)


def test_the_plain_server_is_vllms_own_without_the_plugin():
    from vllm_kvcomp.bench import serving

    cmd, env = serving.plain_server(None, ["--port", "1"])
    assert cmd[1:4] == ["-c", serving.VLLM_CLI, "serve"] and Path(cmd[4]).is_dir()
    assert "vllm_kvcomp" not in " ".join(cmd) and "--kv-transfer-config" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    allowed = env["VLLM_PLUGINS"].split(",")
    assert "kvcomp" not in allowed and "lora_filesystem_resolver" in allowed


def test_the_same_seed_draws_the_same_requests_and_another_seed_does_not():
    a, b, c = drawer(seed=3), drawer(seed=3), drawer(seed=4)
    first = [a.draw() for _ in range(200)]
    assert first == [b.draw() for _ in range(200)]
    assert first != [c.draw() for _ in range(200)]


def test_a_shared_document_is_repeated_by_the_next_request():
    source = drawer()
    draws = [source.draw() for _ in range(3000)]
    normal = [d for d in draws if d.malformed is None]
    repeats = [i for i, d in enumerate(normal[:-1]) if d.shared_doc is not None and normal[i - 1].shared_doc is None]
    assert len(repeats) > 20
    for i in repeats:
        assert normal[i + 1].shared_doc == normal[i].shared_doc
        assert normal[i + 1].route == "completions"


def test_prompts_are_unique_sized_and_share_only_the_documents():
    source = drawer()
    draws = [d for d in (source.draw() for _ in range(400)) if d.malformed is None]
    prompts = soak.Prompts(0, 49152, CharEstimateCounter(), source.doc_tokens)
    ids = [prompts.completion_prompt(d) for d in draws if d.route == "completions"]
    completions = [d for d in draws if d.route == "completions"]
    assert all(len(p) == d.prompt_tokens for p, d in zip(ids, completions))
    unique = [p for p, d in zip(ids, completions) if d.shared_doc is None]
    assert len({tuple(p[:soak.BLOCK_SIZE]) for p in unique}) == len(unique)
    shared = [(d, prompts.completion_prompt(d)) for d in draws if d.shared_doc is not None]
    assert shared
    for d, p in shared:
        doc = prompts.docs[d.shared_doc]
        assert p[:len(doc)] == doc and len(p) > len(doc)
    counter = CharEstimateCounter()
    texts = [(d, prompts.chat_text(d)) for d in draws if d.route == "chat"][:20]
    assert len({t for _, t in texts}) == len(texts)
    for d, text in texts:
        assert d.prompt_tokens - max(8, d.prompt_tokens // 50) <= counter.count(text) <= d.prompt_tokens


def test_request_parts_put_the_spec_where_the_draw_says():
    prompts = soak.Prompts(0, 512, CharEstimateCounter(), [])
    header = soak.Draw(1, "lagkv", 0.25, "stream", False, "chat", True, True, 300, 8)
    path, headers, body, raw = soak.request_parts(header, "m", prompts)
    assert path == "/v1/chat/completions" and raw is None
    assert headers == {soak.HEADER: "policy=lagkv; ratio=0.25; prefill=stream"}
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] and "kv_compression" not in body
    in_body = soak.Draw(2, "snapkv", 0.5, None, True, "completions", False, False, 300, 8)
    path, headers, body, _ = soak.request_parts(in_body, "m", prompts)
    assert path == "/v1/completions" and headers == {} and len(body["prompt"]) == 300
    assert body["kv_compression"] == {"policy": "snapkv", "ratio": 0.5}
    _, headers, body, _ = soak.request_parts(soak.Draw(3, "none", route="completions", prompt_tokens=300, max_tokens=8),
                                             "m", prompts)
    assert headers == {} and "kv_compression" not in body
    bad = soak.Draw(4, "malformed", malformed=soak.Malformed("body not JSON", raw="{not json"))
    assert soak.request_parts(bad, "m", prompts)[3] == "{not json"


# ---------------------------------------------------------------------------- answers


def result_of(draw: soak.Draw, status: int | None, **fields) -> soak.Result:
    result = soak.Result(draw, False, 0.0, status=status, **fields)
    soak.classify(draw, result, "text")
    return result


def test_answers_are_classified_and_checked():
    snap = soak.Draw(1, "snapkv", 0.25, route="completions", max_tokens=8, prompt_tokens=300)
    good = dict(applied="policy=snapkv; ratio=0.25", kvc={"policy": "snapkv"}, usage={"completion_tokens": 8})
    assert result_of(snap, 200, **good).outcome == "ok"
    assert "kv_compression.policy" in result_of(snap, 200, **{**good, "kvc": {"policy": "full"}}).error
    assert "X-KV-Compression-Applied" in result_of(snap, 200, **{**good, "applied": "none"}).error
    assert "completion_tokens" in result_of(snap, 200, **{**good, "usage": {"completion_tokens": 7}}).error
    none = soak.Draw(2, "none", max_tokens=8, prompt_tokens=300)
    assert result_of(none, 200, applied="none", kvc={"policy": "full"}).outcome == "ok"
    assert result_of(none, 200, applied="none", kvc={}).outcome == "error"
    assert result_of(snap, 200, aborted=True).outcome == "aborted"
    failed = result_of(snap, 503)
    assert failed.outcome == "error" and failed.server_error and failed.error.startswith("HTTP 503")
    in_stream = result_of(snap, 200, stream_error=500)
    assert in_stream.outcome == "error" and in_stream.server_error
    plain_ok = soak.Result(none, False, 0.0, status=200, usage={"completion_tokens": 8})
    soak.classify(none, plain_ok, "text", plugin=False)
    assert plain_ok.outcome == "ok"
    plain_applied = soak.Result(none, False, 0.0, status=200, applied="none", usage={"completion_tokens": 8})
    soak.classify(none, plain_applied, "text", plugin=False)
    assert "without the plugin" in plain_applied.error
    bad = soak.Draw(3, "malformed", malformed=soak.Malformed("unknown policy", header="policy=zip"))
    assert result_of(bad, 400).outcome == "rejected"
    assert result_of(bad, 200).outcome == "error"
    assert result_of(bad, 500).server_error


# ---------------------------------------------------------------------------- figures


def sample(t: float, worker: float, pids=(10, 11), **metrics) -> soak.Sample:
    return soak.Sample(t, {"api": 600.0, "engine": 640.0, "worker": worker}, metrics, pids)


def test_slope_fit_in_mb_per_hour_after_the_warm_up():
    assert soak.fit_slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2)
    assert math.isnan(soak.fit_slope([(1, 1), (1, 2)]))
    rng = random.Random(0)
    samples = [sample(t, 2000.0 if t < 100 else 1000 + 0.01 * t + rng.uniform(-0.5, 0.5)) for t in range(0, 1200, 5)]
    slopes = soak.rss_slopes(samples, warmup=100)
    assert slopes["worker"] == pytest.approx(36, abs=2)  # 0.01 MB/s
    assert slopes["api"] == 0 and slopes["total"] == pytest.approx(slopes["worker"])
    assert soak.rss_slopes(samples, warmup=0)["worker"] < 0  # the warm-up spike would hide the growth


def test_percentiles():
    assert soak.percentile([3, 1, 2], 50) == 2
    assert soak.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert math.isnan(soak.percentile([], 50))


def idle(kv: float = 0.0, held: float = 0.0, saved: float = 0.0, reached: bool = True) -> soak.IdlePoint:
    return soak.IdlePoint(300.0, 4.0, reached, kv, held, saved, 1024.0, {"api": 600.0})


def test_an_idle_point_is_clean_only_with_nothing_held():
    assert idle().clean
    assert not idle(kv=1 / 143).clean
    assert not idle(held=3).clean
    assert not idle(saved=1).clean
    assert not idle(reached=False).clean


def test_schedule_puts_waves_between_idle_points_and_stops_before_the_end():
    events = soak.schedule(1200, 150, 45, 300)
    assert [t for t, kind in events if kind == "idle"] == [300, 600, 900]
    waves = [t for t, kind in events if kind == "wave"]
    assert waves == [75, 225, 375, 525, 675, 825, 975, 1125]
    assert all(not (t < i < t + 45) for t in waves for i in (300, 600, 900))
    assert soak.schedule(100, 0, 45, 0) == []


def test_idle_point_pauses_do_not_count_as_load():
    import argparse

    args = argparse.Namespace(duration=100.0, max_requests=50)
    state = soak.Soak("http://127.0.0.1:1", "m", args, drawer(), None, None, t0=time.monotonic() - 130)
    assert state.stopping()
    state.paused = 40.0  # 130 s since the start, 40 of them in idle points: 90 s of load
    assert state.load_time() == pytest.approx(90, abs=1) and not state.stopping()
    for _ in range(50):
        state.drawer.draw()
    assert state.stopping()  # the request bound


def run_data(name: str, labels: list[str], results: list[soak.Result], samples: list[soak.Sample],
             idles: list[soak.IdlePoint]) -> soak.RunData:
    settings = dict(duration=600.0, clients=8, wave_clients=8, wave_every=150.0, wave_seconds=45.0, idle_every=300.0,
                    pool_blocks=144, max_len=MAX_LEN, min_prompt=256, max_prompt=4096, min_output=16, max_output=256,
                    ratios="0.25", abort_share=0.1, malformed_share=0.02, repeat_share=0.1, warmup=100.0, window=120.0,
                    seed=0)
    return soak.RunData(name, "vllm-kvcomp bench soak", labels, [], settings, results, samples, idles, [(75.0, 120.0)],
                        600.0, True, [], [])


def synthetic_runs() -> list[soak.RunData]:
    snap = soak.Draw(1, "snapkv", 0.25, route="completions", stream=True, max_tokens=8, prompt_tokens=300)
    none = soak.Draw(2, "none", route="chat", stream=True, max_tokens=8, prompt_tokens=300)
    ok = dict(usage={"completion_tokens": 8})
    mixed = [soak.Result(snap, False, 30.0 * i, 2.0, 200, "ok", ttft=0.5 + i / 10, itl=[0.04] * 7,
                         kvc={"policy": "snapkv", "kept_fraction": 0.3, "blocks_freed": 5, "preemptions": 1}, **ok)
             for i in range(20)]
    mixed += [soak.Result(none, True, 15.0 * i, 2.0, 200, "ok", ttft=0.4, itl=[0.03] * 7, kvc={"policy": "full"}, **ok)
              for i in range(30)]
    bad = soak.Draw(3, "malformed", malformed=soak.Malformed("unknown policy", header="policy=zip"))
    mixed.append(soak.Result(bad, False, 50.0, 0.1, 400, "rejected"))
    samples = [sample(t, 1500 + t / 100, **{soak.USAGE: 0.5, soak.PREEMPTIONS: t // 60}) for t in range(0, 600, 5)]
    base = [soak.Result(none, False, 12.0 * i, 2.0, 200, "ok", ttft=0.3, itl=[0.03] * 7, kvc={"policy": "full"}, **ok)
            for i in range(40)]
    return [run_data("mixed", ["none", "snapkv"], mixed, samples, [idle(), idle()]),
            run_data("baseline", ["none", "full"], base, samples, [idle()])]


def test_the_report_puts_both_runs_side_by_side(tmp_path: Path):
    runs = synthetic_runs()
    plot = soak.plot_runs(runs, tmp_path / "soak_timeline.png", 120)
    assert plot.stat().st_size > 10_000
    text = soak.render(runs, plot)
    assert "| | mixed | baseline |" in text
    assert "| **5xx** (must be 0) | **0** | **0** |" in text
    assert "| idle points with KV usage 0 and kvcomp held/saved 0 | 2 of 2 | 1 of 1 |" in text
    assert "| preemptions (vllm:num_preemptions_total) | 9 | 9 |" in text
    assert "| engine restarted (engine core / worker pids changed) | no | no |" in text
    assert "| snapkv | 20 | 20 | 0 | 0 | 0 | 20 | 0 | 0 | 0 | 0.300 | 100 | 20 |" in text
    assert "| unknown policy | 1 | 400: 1 |" in text
    assert "RSS slope after warm-up, worker (MB/h) | +36.0 | +36.0 |" in text
    assert "![RSS, KV usage and p99 TTFT over time](soak_timeline.png)" in text
    assert text.count("## ") == 2


def test_quarters_show_the_workers_rss_levelling_off_against_plain_vllm():
    mixed, baseline = synthetic_runs()
    # mixed: +60 MB in the first 300 s, then flat; plain: +12 MB per 300 s throughout
    mixed.samples = [sample(t, 1500 + min(t, 300) / 5) for t in range(0, 1200, 5)]
    plain = soak.RunData(**{**vars(baseline), "name": "plain", "plugin": False,
                            "samples": [sample(t, 1400 + t / 25) for t in range(0, 1200, 5)]})
    for run, base in ((mixed, 1550.0), (plain, 1400.0)):
        run.idles = [soak.IdlePoint(t, 4.0, True, 0.0, 0.0, 0.0, 0.0, {"worker": base + 50},
                                    rss_trimmed={"worker": base + (10 if run is mixed else 1) * k})
                     for k, t in enumerate((290.0, 590.0, 890.0, 1190.0))]
    rows = soak.quarters(mixed, 300)
    assert [round(r["slope"]) for r in rows] == [720, 0, 0, 0]
    assert [r["worker"] for r in rows] == [1559.0, 1560.0, 1560.0, 1560.0]
    assert [r["trimmed"] for r in rows] == [1550.0, 1560.0, 1570.0, 1580.0]
    assert [round(r["slope"]) for r in soak.quarters(plain, 300)] == [144] * 4
    table = soak.quarter_table([mixed, plain], 300)
    # sent before 300 s: mixed 10 snapkv (every 30 s) + 20 none (every 15 s) + 1 malformed; plain 25 (every 12 s)
    assert table[2] == "| 0–300 | 1559 | +720 | 1550 | 31 | 1412 | +144 | 1400 | 25 |"
    (line,) = soak.against_plain([mixed, plain])
    slope = soak.rss_slopes(mixed.samples, 100.0)["worker"]
    assert f"{slope:+.1f} vs +144.0 MB/h = **{slope / 144:.2f}x**" in line
    assert "+120.0 vs +12.0 MB/h" in line  # after the trim: 10 vs 1 MB per 300 s
    assert "+150, +159, +168, +177 MB more than plain's" in line
    assert soak.against_plain([mixed]) == []
    mixed.settings["quarter"] = 300.0
    text = soak.render([mixed, plain], None)
    assert "without the plugin" in text and "**mixed against plain**" in text and table[2] in text


def test_records_are_json_lines(tmp_path: Path):
    import json

    path = soak.write_records(synthetic_runs()[0], tmp_path / "out" / "soak_mixed.jsonl")
    kinds = Counter(json.loads(line)["kind"] for line in path.read_text().splitlines())
    assert kinds == {"meta": 1, "request": 51, "sample": 120, "idle": 2, "wave": 1}


def test_the_verdict_fails_on_a_5xx_a_lost_request_a_dirty_idle_point_or_a_new_engine():
    mixed = synthetic_runs()[0]
    assert soak.verdict(mixed)
    draw = mixed.results[0].draw
    for broken in (
        dict(results=[*mixed.results, soak.Result(draw, False, 1.0, 1.0, 502, "error")]),
        dict(results=[*mixed.results, soak.Result(draw, False, 1.0, 1.0, None, "error")]),
        dict(idles=[idle(), idle(kv=0.02)]),
        dict(idles=[]),
        dict(samples=[*mixed.samples, sample(700, 1500, pids=(12, 13))]),
        dict(server_alive=False),
    ):
        run = soak.RunData(**{**vars(mixed), **broken})
        assert not soak.verdict(run), broken.keys()
        if "samples" in broken or "server_alive" in broken:
            assert soak.restarted(run)


# ---------------------------------------------------------------------------- live (slow)


@pytest.mark.slow
@pytest.mark.server
def test_a_short_soak_through_the_server_holds(tmp_path: Path):
    """Two minutes of every policy the tiny model can use, aborts, malformed requests and waves on a
    pool of about two full requests: no 5xx, KV back to 0 at every idle point, the same engine."""
    from tests.helpers.tiny_llama import make_tiny_llama
    from tests.server.conftest import TINY

    model = make_tiny_llama(tmp_path / "tiny", **TINY)
    argv = ["--model", str(model), "--duration", "120", "--clients", "4", "--wave-clients", "4", "--wave-every", "30",
            "--wave-seconds", "15", "--idle-every", "40", "--min-prompt", "256", "--max-prompt", "1024",
            "--min-output", "8", "--max-output", "64", "--pool-blocks", "72", "--warmup", "30", "--window", "30",
            "--sample-every", "2", "--request-timeout", "120", "--logs", str(tmp_path / "logs"),
            "--out", str(tmp_path / "soak.md")]
    args = build_parser(soak, "soak", "vllm-kvcomp bench soak").parse_args(argv)
    args.command = "vllm-kvcomp bench soak " + " ".join(argv)
    (run,) = soak.soak_all(args)
    outcomes = Counter(r.outcome for r in run.results)
    errors = [r.error for r in run.results if r.outcome == "error"]
    assert errors == [], errors[:5]
    assert not any(r.server_error for r in run.results)
    assert outcomes["ok"] > 100 and outcomes["aborted"] > 5
    assert {r.draw.label for r in run.results if r.outcome == "ok"} == set(run.labels)
    assert set(run.labels) >= {"none", "full", *(p for p in POLICY_NAMES if p not in ("razor", "pod", "duoattention"))}
    assert len(run.idles) >= 3 and all(p.clean for p in run.idles), run.idles
    assert not soak.restarted(run) and run.leftover == []
    assert soak.preemptions(run) > 0
    assert run.log_errors == []
    assert soak.verdict(run)
    assert (tmp_path / "soak_mixed.jsonl").stat().st_size > 0


def test_ratios_a_policy_refuses_on_the_model_are_not_drawn(tmp_path):
    """Razor's retrieval heads keep everything: ratios at or under their share are a 400 on that
    model's server, so the soak draws only the ones it accepts (the smallest it accepts if none)."""
    from tests.helpers.tiny_llama import make_tiny_llama
    from vllm_kvcomp.calibration.profiles import ModelIdentity, RetrievalHeadsProfile, save_profile

    path = make_tiny_llama(tmp_path / "llama", num_layers=3, num_kv_heads=2)
    model = ModelIdentity.from_model_dir(path)
    save_profile(RetrievalHeadsProfile(model=model, kv_heads=frozenset({(0, 1), (2, 0)})), model_dir=path)  # 2 of 6
    labels = ["none", "snapkv", "razor", "streamingllm"]
    assert feasible_ratios(path, labels, [0.125, 0.25, 0.5]) == {"razor": [0.5]}
    assert feasible_ratios(path, labels, [0.125, 0.25]) == {"razor": [0.34]}
    source = soak.Drawer(0, labels, [0.125, 0.25, 0.5], (256, 4096), (16, 256), MAX_LEN, label_ratios={"razor": [0.5]})
    drawn = [d for d in (source.draw() for _ in range(400)) if d.malformed is None]
    assert {d.ratio for d in drawn if d.label == "razor"} == {0.5}
    assert {d.ratio for d in drawn if d.label == "snapkv"} == {0.125, 0.25, 0.5}


def test_trim_gives_a_process_free_heap_back():
    """--trim-at-idle: a process that freed most of its heap (the last block still live, so the
    heap cannot shrink from the top) holds far less after the trim; idle points report both."""
    import subprocess
    import sys

    import psutil

    script = ("import sys, time\n"
              "blocks = [bytearray(100_000) for _ in range(3000)]\n"  # ~300 MB on the heap (< mmap threshold)
              "keep = blocks[-1]\n"
              "del blocks\n"
              "print('ready', flush=True)\n"
              "time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        processes = object.__new__(soak.ServerProcesses)
        processes.api = psutil.Process(child.pid)
        before = processes.api.memory_info().rss / 2**20
        processes.trim()
        after = processes.api.memory_info().rss / 2**20
        assert before - after > 200, (before, after)
    finally:
        child.kill()
        child.wait()


def test_trimmed_idle_points_are_reported_with_their_slope():
    runs = synthetic_runs()
    mixed = runs[0]
    for i, point in enumerate(mixed.idles):
        point.t = 200.0 + 300 * i
        point.rss_trimmed = {"api": 800.0, "engine": 700.0, "worker": 2000.0 + 10 * i}
    rows = soak.trimmed_rows(mixed)
    shown = rows["worker RSS at the idle points, MB: as sampled → after malloc_trim"]
    assert shown == ", ".join(f"{p.rss.get('worker', math.nan):.0f} → {2000 + 10 * i}" for i, p in enumerate(mixed.idles))
    after = [p for p in mixed.idles if p.t >= mixed.settings["warmup"]]
    slope = soak.fit_slope([(p.t, p.rss_trimmed["worker"]) for p in after]) * 3600
    assert slope == pytest.approx(120.0)  # 10 MB per 300 s
    assert rows["slope of the trimmed idle-point RSS after warm-up, worker / total (MB/h)"] == "+120.0 / +120.0"
    assert soak.trimmed_rows(runs[1]) == {}  # no trimmed readings: no rows
    assert "after malloc_trim" in soak.render(runs, None)
