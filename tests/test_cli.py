"""Every ``vllm-kvcomp`` subcommand exists and parses its ``--help``; the bench runner's rules."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest

from vllm_kvcomp import bench
from vllm_kvcomp.bench import common
from vllm_kvcomp.cli import RAW_ARGV, SUBCOMMANDS, main


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_module_has_its_entry_points(name):
    module = importlib.import_module(SUBCOMMANDS[name][0])
    if name in RAW_ARGV:
        assert callable(module.main)
    else:
        assert callable(module.add_arguments) and callable(module.run)


@pytest.mark.parametrize("name", sorted(set(SUBCOMMANDS) - {"serve"}))
def test_help_exits_cleanly(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert f"vllm-kvcomp {name}" in capsys.readouterr().out


def test_top_help_lists_every_benchmark_and_model(capsys):
    from vllm_kvcomp.models import SOURCES

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert all(name in out for name in (*bench.BENCHMARKS, *SOURCES, *SUBCOMMANDS)), out
    assert "engine (default)" in out and "examples:" in out


def test_bench_help_lists_every_benchmark_with_its_output(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name, (_, text) in bench.BENCHMARKS.items():
        out = common.default_out(name)
        where = "prints only unless --out" if out is None else str(out)
        assert out is None or out.exists(), f"{name}'s default output {out} is not a current results file"
        assert any(line.split()[:1] == [name] and text in line and where in line for line in lines), name
    assert "examples (without --out a run rewrites its current file under docs/results/):" in lines


def test_model_help_lists_every_fetchable_model(capsys):
    from vllm_kvcomp.models import SOURCES

    with pytest.raises(SystemExit) as done:
        main(["model", "--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for source in SOURCES.values():
        assert f"  {source.name:<22} {source.summary}" in lines
    assert "  vllm-kvcomp model fetch gemma-3-270m" in lines


def test_serve_help_lists_the_fetchable_models_and_examples():
    from vllm_kvcomp.models import SOURCES
    from vllm_kvcomp.server.cli import epilog

    text = epilog()
    assert all(f"  {name:<22} {source.summary}" in text.splitlines() for name, source in SOURCES.items())
    assert "  vllm-kvcomp serve --port 8000" in text.splitlines()


def test_bench_select_picks_the_benchmark_and_its_arguments(capsys):
    assert bench.select([]) == ("engine", [])
    assert bench.select(["--skip-overhead"]) == ("engine", ["--skip-overhead"])
    assert bench.select(["kept", "--lengths", "64"]) == ("kept", ["--lengths", "64"])
    with pytest.raises(SystemExit) as done:
        bench.select(["nope", "--x"])
    assert done.value.code == 2 and "unknown benchmark 'nope'" in capsys.readouterr().err


def test_bench_table_reports_ratios_against_full():
    from vllm_kvcomp.bench.engine import _table

    full = {"policy": "full", "ratio": 1.0, "peak_running": 2, "tokens_per_s": 10.0, "compress_s": 0.0, "prefill_s": 1.0}
    row = {"policy": "snapkv", "ratio": 0.25, "peak_running": 7, "tokens_per_s": 19.0, "compress_s": 0.1, "prefill_s": 2.0}
    text = _table([row], full, "title")
    assert "3.50" in text and "1.90" in text and "5.0%" in text


def test_bench_peak_covers_every_policy_and_checks_the_target():
    """``bench peak``: full first, then every compressing policy and variant from the registry; a
    request above prompt + kept + 2 blocks is marked as a miss."""
    import argparse

    from vllm_kvcomp.bench.peak import Peak, configs, table
    from vllm_kvcomp.policies.registry import compressing_policy_names

    args = argparse.Namespace(policies=None, model=None, ratio=0.25, prompt_len=2100, max_tokens=24, period=0.05)
    cases = configs(args)
    assert cases[0] == ("full", None)
    assert {label.split()[0] for label, _ in cases[1:]} == set(compressing_policy_names())
    # the bundled model's razor / duoattention profiles refuse 0.25: they run at the smallest ratio accepted
    floors = {label: header for label, header in cases[1:] if " at " in label}
    assert {label.split()[0] for label in floors} == {"razor", "duoattention"}
    for label, header in floors.items():
        assert header == f"policy={label.split()[0]}; ratio={label.split(' at ')[1]}" and "ratio=0.25" not in header
    assert all(header.startswith("policy=") and "ratio=0.25" in header for label, header in cases[1:]
               if label not in floors)
    rows = table(args, [Peak("full", 67, 67, 1.0), Peak("snapkv", 86, 18, 0.26), Peak("lagkv", 130, 22, 0.31)])
    lines = {line.split("|")[1].strip(): line for line in rows.splitlines() if line.startswith("| ")}
    assert "| 86 | 1.28x | 0.27x | 0.26 | 86 | yes |" in lines["snapkv"]  # 66 + ceil(0.26 * 66) + 2
    assert lines["lagkv"].endswith("| **no** |")


# ---------------------------------------------------------------------------- bench runner
@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_every_benchmark_runs_as_a_module_and_a_subcommand(name):
    module = importlib.import_module(f"vllm_kvcomp.bench.{name}")
    assert bench.BENCHMARKS[name][0] == module.__name__
    assert callable(module.add_arguments) and callable(module.run) and callable(module.main)
    parser = common.build_parser(module, name, f"vllm-kvcomp bench {name}")
    assert parser.parse_args([]).out == common.default_out(name)


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_benchmark_help_names_the_subcommand(name, capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"vllm-kvcomp bench {name}" in out and "--out" in out


def test_bench_list_prints_the_names(capsys):
    assert main(["bench", "--list"]) == 0
    from vllm_kvcomp.bench import BENCHMARKS

    assert capsys.readouterr().out.split() == list(BENCHMARKS) and "engine" in BENCHMARKS


def test_bench_rejects_an_unknown_name(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "nope"])
    assert done.value.code == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def _record_run(monkeypatch, name: str) -> list[argparse.Namespace]:
    seen: list[argparse.Namespace] = []
    module = importlib.import_module(f"vllm_kvcomp.bench.{name}")
    monkeypatch.setattr(module, "run", lambda args: seen.append(args) or 0)
    return seen


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        ([], "vllm-kvcomp bench"),
        (["--skip-overhead", "--num-requests", "3"], "vllm-kvcomp bench --skip-overhead --num-requests 3"),
        (["engine", "--skip-memory"], "vllm-kvcomp bench engine --skip-memory"),
    ],
)
def test_bench_defaults_to_engine(monkeypatch, argv, command):
    """No NAME, or a first argument starting with '-', runs engine with every argument."""
    seen = _record_run(monkeypatch, "engine")
    assert main(["bench", *argv]) == 0
    (args,) = seen
    assert args.command == command
    assert args.skip_overhead == ("--skip-overhead" in argv)
    assert args.skip_memory == ("--skip-memory" in argv)
    assert args.num_requests == (3 if "3" in argv else 24)


def test_bench_by_name_and_as_module_record_the_exact_command(monkeypatch, tmp_path):
    seen = _record_run(monkeypatch, "cost")
    out = tmp_path / "k.md"
    assert main(["bench", "cost", "--runs", "1", "--out", str(out)]) == 0
    from vllm_kvcomp.bench import cost

    assert cost.main(["--policies", "snapkv"]) == 0
    first, second = seen
    assert first.command == f"vllm-kvcomp bench cost --runs 1 --out {out}"
    assert first.out == out and first.runs == 1
    assert second.command == "python -m vllm_kvcomp.bench.cost --policies snapkv"
    assert second.out == Path("docs/results/bench_cost.md") and second.policies == "snapkv"


def test_a_benchmark_without_one_current_file_writes_only_with_out(tmp_path, capsys):
    assert common.write_report(None, "vllm-kvcomp bench pages", "| a |\n") is None
    assert "not written: pass --out FILE" in capsys.readouterr().out
    parser = common.build_parser(importlib.import_module("vllm_kvcomp.bench.pages"), "pages", "vllm-kvcomp bench pages")
    assert parser.parse_args([]).out is None


def test_write_report_puts_the_command_line_on_top(tmp_path, capsys):
    path = common.write_report(tmp_path / "new" / "r.md", "vllm-kvcomp bench kernels --device cpu", "| a |\n")
    lines = path.read_text().splitlines()
    assert lines[0] == "# `vllm-kvcomp bench kernels --device cpu`"
    assert lines[-1] == "| a |"
    assert f"wrote {path}" in capsys.readouterr().out


def test_benchmarks_skip_what_the_server_refuses():
    """Razor below its retrieval heads' share of the bundled model (24 of 90 heads) is a 400 at
    the server (#28): the benchmarks skip it with the server's message instead of crashing."""
    from vllm_kvcomp.bench.serving import refusal

    why = refusal(None, "policy=razor; ratio=0.25")
    assert why is not None and "ratio" in why and "exact=1" in why
    assert refusal(None, "policy=razor; ratio=0.5") is None
    assert refusal(None, "policy=razor; ratio=0.25; exact=1") is None
    assert refusal(None, "policy=snapkv; ratio=0.25") is None and refusal(None, None) is None


def test_benchmarks_judge_a_model_named_like_the_server_does(monkeypatch):
    """``bench pages --model gemma-3-270m``: the server loads the fetched folder's profiles, so
    the benchmark must look there too, not skip every calibrated policy as unprofiled."""
    from vllm_kvcomp import models
    from vllm_kvcomp.bench.serving import refusal

    bundled = models.fetch_default_model()
    fetched = []
    monkeypatch.setattr(models, "fetch_model", lambda name: fetched.append(name) or bundled)
    assert refusal("gemma-3-270m", "policy=razor; ratio=0.5") is None and fetched == ["gemma-3-270m"]
    assert "exact=1" in refusal("gemma-3-270m", "policy=razor; ratio=0.25")


def test_benchmark_pools_count_every_kv_cache_group(tmp_path):
    """A hybrid model's request holds blocks in every group vLLM makes of its layers."""
    from vllm_kvcomp.bench.serving import kv_cache_groups

    gemma3 = ["sliding_attention"] * 5 + ["full_attention"]
    for types, groups in ((gemma3 * 3, 6), (["sliding_attention", "full_attention"] * 2, 2), ([], 1),
                          (["full_attention"] * 4, 1)):
        (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": len(types), "layer_types": types}))
        assert kv_cache_groups(str(tmp_path)) == groups, types


def test_reports_name_the_model_they_measured():
    assert common.model_line(None).startswith("Bundled SmolLM2-135M (fp32")
    assert common.model_line("gemma-3-270m").startswith("gemma-3-270m (fp32")
    assert common.model_line("/models/my-llama/").startswith("my-llama (fp32")


# ---------------------------------------------------------------------------- serve: the GPU attention backend
# (what every GPU and flag gives, from vLLM's own selector: tests/engine/test_backend_choice.py)


def _serve_on_cuda(monkeypatch) -> None:
    """``vllm-kvcomp serve`` as on a CUDA machine, up to starting vLLM (which fails the test)."""
    from vllm_kvcomp import vllm_compat

    def no_server(args):
        raise AssertionError(f"vLLM was started with {args.attention_backend=}")

    monkeypatch.setattr(vllm_compat, "server_env_setup", lambda: None)
    monkeypatch.setattr(vllm_compat, "platform_kind", lambda: "cuda")
    monkeypatch.setattr(vllm_compat, "run_server", no_server)


@pytest.mark.parametrize("backend", [None, "auto", "FLASH_ATTN", "triton_attn"])
def test_serve_on_a_gpu_leaves_the_backend_to_vllm_or_the_operator(tmp_path, backend):
    """No backend is forced (vLLM picks per GPU); one vllm-kvcomp hooks passes through."""
    from vllm_kvcomp.server import cli

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    parser, vllm_defaults = cli.build_parser()
    args = parser.parse_args([str(tmp_path)] + ([] if backend is None else ["--attention-backend", backend]))
    cli.prepare(args, vllm_defaults, on_cpu=False)
    assert args.attention_backend == backend and args.attention_config.backend is None
    assert args.kv_transfer_config.kv_connector == "KVCompConnector"


@pytest.mark.parametrize(("flags", "named"), [
    (["--attention-backend", "FLASHINFER"], "pass --attention-backend FLASH_ATTN (TRITON_ATTN if vLLM rejects"),
    (["--attention-backend", "flex_attention"], "pass --attention-backend FLASH_ATTN"),
    (["-cc.pass_config.fuse_attn_quant=true"], "pass -cc.pass_config.fuse_attn_quant=false"),
    (["--enable-dbo"], "leave it off"),
    (["-tp", "2", "-dcp", "2"], "pass --decode-context-parallel-size 1"),
])
def test_serve_refuses_flags_it_cannot_compress_under_before_vllm_starts(monkeypatch, capsys, flags, named):
    """Exit status 2 and one ``vllm-kvcomp serve: error:`` line naming the fix, before any model
    is resolved (``org/not-fetched`` is never looked up) or vLLM started."""
    _serve_on_cuda(monkeypatch)
    assert main(["serve", "org/not-fetched", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("vllm-kvcomp serve: error: ") and named in err and "KVCompConnector" in err
