"""Every ``vllm-kvcomp`` subcommand exists and parses its ``--help``."""

from __future__ import annotations

import importlib

import pytest

from vllm_kvcomp.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_module_has_its_entry_points(name):
    module = importlib.import_module(SUBCOMMANDS[name][0])
    if name == "serve":
        assert callable(module.main)
    else:
        assert callable(module.add_arguments) and callable(module.run)


@pytest.mark.parametrize("name", sorted(set(SUBCOMMANDS) - {"serve"}))
def test_help_exits_cleanly(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert f"vllm-kvcomp {name}" in capsys.readouterr().out


def test_bench_table_reports_ratios_against_full():
    from vllm_kvcomp.eval.bench import _table

    full = {"policy": "full", "ratio": 1.0, "peak_running": 2, "tokens_per_s": 10.0, "compress_s": 0.0, "prefill_s": 1.0}
    row = {"policy": "snapkv", "ratio": 0.25, "peak_running": 7, "tokens_per_s": 19.0, "compress_s": 0.1, "prefill_s": 2.0}
    text = _table([row], full, "title")
    assert "3.50" in text and "1.90" in text and "5.0%" in text
