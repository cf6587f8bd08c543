"""``vllm-kvcomp bench pages``: its configs and the report next to the physical limit, without a server."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from vllm_kvcomp.bench import pages


def test_a_policies_entry_may_add_settings_next_to_the_plain_config():
    args = argparse.Namespace(policies="snapkv, snapkv:decode=recompress,pod", ratios="0.25,0.5", model=None)
    assert pages._configs(args) == [
        ("snapkv", "snapkv", "", 0.25),
        ("snapkv decode=recompress", "snapkv", "decode=recompress", 0.25),
        ("pod", "pod", "", 0.25),
        ("snapkv", "snapkv", "", 0.5),
        ("snapkv decode=recompress", "snapkv", "decode=recompress", 0.5),
        ("pod", "pod", "", 0.5),
    ]
    args.policies = "snapkv adaptive:decode=recompress"
    assert pages._configs(args)[0] == ("snapkv adaptive decode=recompress", "snapkv",
                                       "heads=adaptive; decode=recompress", 0.25)


def test_configs_the_server_would_refuse_are_skipped_and_said(capsys):
    args = argparse.Namespace(policies="pod:prefill=stream,snapkv", ratios="0.25", model=None)
    assert pages._configs(args) == [("snapkv", "snapkv", "", 0.25)]
    assert "skip pod prefill=stream at 0.25" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown"):
        pages._configs(argparse.Namespace(policies="snapkvv:decode=recompress", ratios="0.25", model=None))


def test_limit_table_puts_each_config_next_to_full_at_its_kept_length():
    args = argparse.Namespace(streams=4, decode_tokens=96, limit_repeats=1, limit_mode="sequential")
    full = {n: pages.Held(blocks=64.0, decode_tps=tps, kept_fraction=1.0) for n, tps in ((2048, 40.0), (8000, 20.0))}
    results = {("full", n): held for n, held in full.items()}
    results[("snapkv", 0.25, 2048)] = pages.Limit(2048, pages.Held(18.0, 50.0, 0.26), 532, pages.Held(18.0, 62.5, 1.0))
    results[("snapkv", 0.25, 8000)] = pages.Limit(8000, pages.Held(66.0, 30.0, 0.25), 2000, pages.Held(66.0, 40.0, 1.0))
    lines = pages._limit_table(args, [("snapkv", "snapkv", "", 0.25)], results)
    rows = [line for line in lines if line.startswith("| snapkv")]
    assert rows == [
        "| snapkv | 0.25 | 2048 | 0.260 | 50.0 | 62.5 (532 tokens) | 0.80x | 40.0 | 1.25x |",
        "| snapkv | 0.25 | 8000 | 0.250 | 30.0 | 40.0 (2000 tokens) | 0.75x | 20.0 | 1.50x |",
    ]
    assert results[("snapkv", 0.25, 2048)].share == 50.0 / 62.5
    assert "best of" not in lines[0] and "pairs" not in lines[2]


def test_limit_table_gives_every_pair_and_their_median_when_it_repeats():
    """Best of 3 per side, and each pair's own ratio with their median (a drift of the machine
    between pairs cancels in each pair, not in the best of each side)."""
    args = argparse.Namespace(streams=4, decode_tokens=96, limit_repeats=3, limit_mode="sequential")
    results = {("full", 2048): pages.Held(64.0, 40.0, 1.0),
               ("razor", 0.5, 2048): pages.Limit(2048, pages.Held(33.0, 20.0, 0.507), 1039, pages.Held(33.0, 25.0, 1.0),
                                                 (0.95, 0.70, 0.80))}
    lines = pages._limit_table(args, [("razor", "razor", "", 0.5)], results)
    assert "best of 3 runs" in lines[0] and "median" in lines[0]
    assert "| vs limit | pairs (median) | full at the prompt length |" in lines[2]
    assert lines[3].count("|") == lines[2].count("|")
    assert lines[4] == "| razor | 0.5 | 2048 | 0.507 | 20.0 | 25.0 (1039 tokens) | 0.80x | 0.95, 0.70, 0.80 (0.80x) | " \
                       "40.0 | 0.50x |"


def test_decode_window_starts_after_the_prompt_end_compression():
    """The step after the first token runs the prompt-end compression: decode is timed from the
    second token on (the same rule for the uncompressed limit)."""
    from vllm_kvcomp.bench.serving import Stream

    assert Stream(sent=0.0, token_times=[1.0, 1.9, 2.0]).decoding == 1.9
    assert Stream(sent=0.0, token_times=[1.0]).decoding == 1.0


def test_membound_serves_with_the_step_size_asked_for(monkeypatch, tmp_path):
    seen = {}

    @contextlib.contextmanager
    def fake_served(model, pool, max_seqs, max_len, log, chunk=2048):
        seen.update(pool=pool, max_seqs=max_seqs, chunk=chunk)
        yield "http://127.0.0.1:1"

    async def fake_throughput(url, args, header, seed):
        return 10.0 + seed if header is None else 100.0 + seed

    monkeypatch.setattr(pages, "served", fake_served)
    monkeypatch.setattr(pages, "_throughput", fake_throughput)
    parser = argparse.ArgumentParser()
    pages.add_arguments(parser)
    args = parser.parse_args(["--membound-chunk", "512", "--membound-clients", "16", "--logs", str(tmp_path)])
    out = pages._phase_membound(args, [("lagkv prefill=stream", "lagkv", "prefill=stream", 0.25)])
    assert seen["chunk"] == 512 and seen["max_seqs"] == 16
    assert out == {"full": [14.0, 15.0], "lagkv prefill=stream": 130.0}  # full first and last, new seeds
    assert parser.parse_args([]).membound_chunk == 2048  # the server's default step, as before


def _samples(rows):
    """(time, gauges) from (seconds, running, waiting, KV use) rows."""
    return [(t, {pages.RUNNING: r, pages.WAITING: w, pages.USAGE: u}) for t, r, w, u in rows]


def test_the_pool_bounds_admission_only_after_a_settled_full_window():
    rising = [(t, 10 + t, 40, 0.5 + t / 100) for t in range(0, 40, 2)]  # still admitting
    assert not pages.pool_bound(_samples(rising), settle=10)
    full = rising + [(t, 49, 30, 0.92) for t in range(40, 60, 2)]  # no new peak for 20 s, requests wait
    assert pages.pool_bound(_samples(full), settle=10)
    assert not pages.pool_bound(_samples(full), settle=30)  # the window reaches back into the rise
    idle = rising + [(t, 49, 0, 0.92) for t in range(40, 60, 2)]  # nobody waits: not bound by the pool
    assert not pages.pool_bound(_samples(idle), settle=10)
    low = rising + [(t, 49, 30, 0.6) for t in range(40, 60, 2)]  # requests wait, KV half used: the prefill rate
    assert not pages.pool_bound(_samples(low), settle=10)
    assert not pages.pool_bound([], settle=10)


def test_admission_rows_mark_a_peak_the_window_cut_short_as_a_lower_bound():
    full = pages.Admitted(16, 1.0, "pool")
    assert pages._row("lagkv", "0.25", None, None, pages.Admitted(57, 0.93, "pool"), full).endswith(
        "| 57 | 3.56x | 93% | pool |")
    assert pages._row("tova", "0.25", None, None, pages.Admitted(27, 0.55, "time"), full).endswith(
        "| >= 27 | >= 1.69x | 55% | time |")
    assert pages._row("razor", "0.25", None, None, None, full).endswith("| - | - | - | - |")


@pytest.mark.parametrize(("phases", "expected"), [({"limit"}, "8000-token"), ({"held", "limit"}, "2048 / 8000-token"),
                                                   ({"held"}, "2048-token")])
def test_report_names_the_prompt_lengths_its_phases_ran(monkeypatch, phases, expected):
    monkeypatch.setattr(pages, "_limit_table", lambda *a: ["limit table"])
    monkeypatch.setattr(pages, "_held_header", lambda *a: "held header")
    monkeypatch.setattr(pages, "_row", lambda *a: "row")
    monkeypatch.setattr(pages, "_columns", lambda *a: 1)
    monkeypatch.setattr(pages, "model_line", lambda model: "Model")
    full = pages.Held(64.0, 20.0, 1.0)
    results = {"held": {"full": (full, full)} if "held" in phases else None, "admit": None, "membound": None,
               "limit": {"x": 1} if "limit" in phases else None}
    args = argparse.Namespace(model="m", prompt_len=2048, limit_lengths="8000", streams=4, decode_tokens=96,
                              pool_held=332)
    assert pages._report(args, [], results).splitlines()[0] == f"Model, block size 32, {expected} random prompts, " \
                                                                "through `vllm-kvcomp serve`."


def _stream(times, kept=None):
    from vllm_kvcomp.bench.serving import Stream

    usage = {"completion_tokens": len(times), **({} if kept is None else {"kv_compression": {"kept_fraction": kept}})}
    return Stream(sent=0.0, token_times=list(times), usage=usage)


def test_concurrent_pairs_time_both_sides_over_the_window_where_all_decode():
    ours = [_stream([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.25), _stream([1.5, 2.5, 3.5, 4.5, 5.5, 6.5], 0.27)]
    theirs = [_stream([2.2, 3.0, 3.2, 3.4, 3.6, 3.8, 4.0, 4.2, 7.0])]
    start, end = pages.both_decoding(ours, theirs)
    assert (start, end) == (3.0, 6.0)  # the latest second token, the earliest last token
    held = pages._held_in(ours, start, end)
    assert held.decode_tps == 6 / 3.0  # 4, 5, 6 and 3.5, 4.5, 5.5 (not 3.0 itself)
    assert held.kept_fraction == pytest.approx(0.26)
    theirs_held = pages._held_in(theirs, start, end)
    assert theirs_held.decode_tps == 6 / 3.0 and theirs_held.kept_fraction == 1.0  # 3.2 ... 4.2
    with pytest.raises(SystemExit, match="raise --decode-tokens"):
        pages.both_decoding(ours, [_stream([7.0, 8.0, 9.0])])


@pytest.mark.parametrize(("limit_len", "lead"), [(16, 3), (32, 2), (48, 1), (64, 0)])
def test_a_concurrent_pair_sends_the_limit_so_that_its_shorter_prefill_ends_with_theirs(monkeypatch, limit_len, lead):
    """4 compressed streams of 64 tokens: the limit's 4 of 16 (a quarter of their prefill) go
    once 3 have their first token, 4 of 32 once 2 have, ...; prompts of one length at once."""
    import asyncio

    log = []

    async def fake_stream(client, url, model, prompt, max_tokens, header, return_token_ids=False, on_first=None):
        log.append(("sent", url, len(prompt), header))
        index = sum(entry[0] == "sent" and entry[1] == url for entry in log)
        for _ in range(10 * index):  # the i-th stream's first token 10 loop turns after the one before
            await asyncio.sleep(0)
        log.append(("first token", url))
        if on_first is not None:
            on_first()
        await asyncio.sleep(0.05)
        base = 10.0 if header is None else 0.0
        return _stream([base + t for t in (1.0, 2.0, 30.0)], None if header is None else 0.25)

    monkeypatch.setattr(pages, "stream_completion", fake_stream)
    args = argparse.Namespace(streams=4, decode_tokens=8, served_name="m")
    compressed, limit = asyncio.run(pages._pair_at_once(("A", "B"), args, "policy=snapkv", 1, 64, limit_len))
    sent_b = log.index(("sent", "B", limit_len, None))
    assert log[:4] == [("sent", "A", 64, "policy=snapkv")] * 4
    assert log[4:sent_b] == [("first token", "A")] * lead  # the limit, uncompressed, at the kept length
    assert compressed.kept_fraction == 0.25 and limit.kept_fraction == 1.0
    assert compressed.decode_tps == 4 / 18.0 and limit.decode_tps == 0.0  # window (12, 30]: no limit token inside


def test_concurrent_limit_serves_on_disjoint_halves_and_swaps_the_sides_every_pair(monkeypatch, tmp_path):
    servers, pairs = [], []

    @contextlib.contextmanager
    def fake_served(model, pool, max_seqs, max_len, log, cpus=None):
        servers.append((log.name, list(cpus)))
        yield f"url-{log.name}"

    async def fake_pair(urls, args, header, seed, prompt_len, limit_len):
        pairs.append((urls, header, prompt_len, limit_len))
        return pages.Held(float("nan"), 10.0 if header else 20.0, 0.25 if header else 1.0), pages.Held(float("nan"), 40.0, 1.0)

    async def fake_kept(url, args, header, seed, prompt_len):
        return 0.25

    monkeypatch.setattr(pages, "served", fake_served)
    monkeypatch.setattr(pages, "_pair_at_once", fake_pair)
    monkeypatch.setattr(pages, "_kept_fraction", fake_kept)
    monkeypatch.setattr(pages.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    parser = argparse.ArgumentParser()
    pages.add_arguments(parser)
    args = parser.parse_args(["--phases", "limit", "--limit-mode", "concurrent", "--limit-repeats", "3",
                              "--limit-lengths", "2048", "--logs", str(tmp_path)])
    out = pages._phase_limit(args, [("snapkv", "snapkv", "", 0.25)])
    assert servers == [("limit-a.log", [0, 1]), ("limit-b.log", [2, 3])]
    a, b = "url-limit-a.log", "url-limit-b.log"
    compressed = [p for p in pairs if p[1] is not None]
    assert [p[0] for p in compressed] == [(a, b), (b, a), (a, b)]
    assert all(p[2:] == (2048, 512) for p in compressed)  # the kept length from the probe's kept_fraction
    entry = out[("snapkv", 0.25, 2048)]
    assert entry.pairs == (0.25, 0.25, 0.25) and entry.limit_len == 512
    assert out[("full", 2048)].decode_tps == 30.0  # both servers at once, their mean
    monkeypatch.setattr(pages.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit, match="sequential"):
        pages._phase_limit(args, [("snapkv", "snapkv", "", 0.25)])
    assert parser.parse_args([]).limit_mode == "sequential"
