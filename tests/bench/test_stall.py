"""``vllm-kvcomp bench stall`` without an engine: a label's spec (shared with ``bench cost``), and
the table of its steps."""

from __future__ import annotations

import argparse

from vllm_kvcomp.bench.common import spec_xargs
from vllm_kvcomp.bench.stall import Gaps, Stalls, Step, _report, _server_report
from vllm_kvcomp.spec import CompressionSpec


def test_a_label_becomes_the_flat_spec_of_its_policy_ratio_and_settings():
    xargs = spec_xargs("snapkv", 0.25, "decode=recompress; window=16")
    assert CompressionSpec.from_xargs(xargs) == CompressionSpec.from_header(
        "policy=snapkv; ratio=0.25; decode=recompress; window=16")
    assert spec_xargs("full", 0.25, "") is None


def test_the_table_gives_each_configs_heaviest_and_longest_step_against_its_median():
    args = argparse.Namespace(model=None, chunk=2048, streams=4, ratio=0.25, decode_tokens=96,
                              compression_lag="0,auto")
    chunk = Step(0.400, 0.030, ["prefill chunk"])  # long by its own prefill
    in_flight = Step(0.036, 0.0, in_flight=True)  # decided off the step meanwhile: no work in it
    rows = [Stalls("full", 2048, 0.025, None, None, 0.030, 0, []),
            Stalls("h2o, lag 0", 2048, 0.020, chunk, Step(0.080, 0.050, ["prompt end", "decode"]), 0.024, 5,
                   [0] * 5),
            Stalls("h2o, lag auto", 2048, 0.020, in_flight, Step(0.030, 0.008, ["prompt end"], True), 0.024, 3,
                   [4, 2, 9])]
    table = _report(args, rows, {"razor": [0.3]})
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert lines["h2o, lag 0"] == \
        "| h2o, lag 0 | 2048 | 20.0 | 50 (decode, prompt end) | **2.50x** | **20.00x** | 5 | 0 | 1.20x |"
    assert lines["h2o, lag auto"] == \
        "| h2o, lag auto | 2048 | 20.0 | 8 (prompt end, in flight) | **0.40x** | **1.80x** | 3 | 2-9 | 1.20x |"
    assert lines["full"] == "| full | 2048 | 25.0 | - | - | - | 0 | - | 1.20x |"
    assert "razor at 0.3 (refuses 0.25)" in table and "compression_lag 0, auto" in table


def test_through_the_server_the_table_gives_the_streams_longest_gap_against_their_median():
    args = argparse.Namespace(model=None, chunk=2048, streams=4, ratio=0.25, decode_tokens=160)
    table = _server_report(args, [Gaps("full", 6000, 0.030, 0.036, 0), Gaps("h2o, lag auto", 6000, 0.032, 0.048, 2)])
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert lines["h2o, lag auto"] == "| h2o, lag auto | 6000 | 32.0 | **1.50x** | 2 |"
    assert lines["full"] == "| full | 6000 | 30.0 | **1.20x** | 0 |"
    assert "through `vllm-kvcomp serve`" in table and "decodes 160 tokens" in table
