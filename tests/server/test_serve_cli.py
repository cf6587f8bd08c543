"""``vllm-kvcomp serve`` argument handling, without starting vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from vllm_kvcomp import models
from vllm_kvcomp.server import cli
from vllm_kvcomp.server.operator_config import ConfigError


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A local model folder as far as the CLI looks: config.json and a weights file."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    return folder


def parse(argv: list[str], on_cpu: bool = True):
    parser, vllm_defaults = cli.build_parser()
    args = parser.parse_args(argv)
    cli.prepare(args, vllm_defaults, on_cpu=on_cpu)
    return args


def test_cpu_defaults_and_kvcomp_wiring(model_dir):
    args = parse([str(model_dir)])
    assert args.model == str(model_dir)
    assert (args.dtype, args.enforce_eager, args.max_model_len) == ("float32", True, 4096)  # model's own limit
    assert 0 < args.kv_cache_memory_bytes <= cli.CPU_KV_CACHE_BYTES
    assert args.kv_transfer_config.kv_connector == "KVCompConnector"
    assert args.kv_transfer_config.kv_role == "kv_both"
    assert args.middleware == [cli.MIDDLEWARE]
    assert args.kv_compression_config is None


@pytest.mark.parametrize(("flag", "lag"), [([], None), (["--compression-lag", "auto"], "auto"),
                                         (["--compression-lag", "0"], 0), (["--compression-lag", "3"], 3)])
def test_compression_lag_reaches_the_connector(model_dir, flag, lag):
    """Unset, the connector picks the platform's default (engine/offload.py's parse_lag)."""
    extra = parse([str(model_dir), *flag]).kv_transfer_config.kv_connector_extra_config or {}
    assert extra.get("compression_lag") == lag


@pytest.mark.parametrize("value", ["-1", "soon", "1.5"])
def test_a_bad_compression_lag_is_refused_naming_the_choices(model_dir, value, capsys):
    with pytest.raises(SystemExit):
        parse([str(model_dir), "--compression-lag", value])
    assert "--compression-lag: expected auto or a whole number of steps >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", [-1, "soon", 1.5, True])
def test_the_connector_refuses_a_bad_compression_lag(value):
    from vllm_kvcomp.engine.offload import parse_lag

    with pytest.raises(ValueError, match="compression_lag must be 'auto' or an integer >= 0"):
        parse_lag(value)
    assert parse_lag("auto") is None and parse_lag(4) == 4
    assert parse_lag(None, "cuda") is None and parse_lag(None, "cpu") == 0  # unset: the platform's default


def test_explicit_flags_win_over_the_cpu_defaults(model_dir):
    args = parse([str(model_dir), "--dtype", "bfloat16", "--max-model-len", "1024", "--no-enforce-eager",
                  "--gpu-memory-utilization", "0.3", "--middleware", "my.Middleware"])
    assert (args.dtype, args.enforce_eager, args.max_model_len, args.gpu_memory_utilization) == \
        ("bfloat16", False, 1024, 0.3)
    assert args.kv_cache_memory_bytes is None  # the fraction asked for is not overridden
    assert args.middleware == ["my.Middleware", cli.MIDDLEWARE]
    assert parse([str(model_dir), "--kv-cache-memory-bytes", "1G"]).kv_cache_memory_bytes == 1 << 30


def test_off_cpu_the_vllm_defaults_stay(model_dir):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_parser = make_arg_parser(FlexibleArgumentParser())
    args = parse(["--model", str(model_dir)], on_cpu=False)
    assert {name: getattr(args, name) for name in cli.PLATFORM_FLAGS} == \
        {name: vllm_parser.get_default(name) for name in cli.PLATFORM_FLAGS}
    assert args.kv_cache_memory_bytes is None
    assert args.model == str(model_dir)


def test_max_model_len_is_capped_at_8192(model_dir):
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    assert parse([str(model_dir)]).max_model_len == cli.CPU_MAX_MODEL_LEN == 8192
    assert cli.cpu_defaults("org/hub-model")["max_model_len"] == 8192


@pytest.mark.parametrize(("free_gib", "expected"), [(64, 4 << 30), (6, 1536 << 20), (1.001, 256 << 20)])
def test_kv_cache_default_is_4_gib_within_a_quarter_of_free_memory(monkeypatch, free_gib, expected):
    free = SimpleNamespace(available=int(free_gib * (1 << 30)), total=128 << 30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    assert cli.cpu_kv_cache_bytes() == expected


def test_no_model_serves_the_bundled_one(monkeypatch, model_dir):
    monkeypatch.setattr(models, "fetch_default_model", lambda: model_dir)
    args = parse([])
    assert args.model == str(model_dir) and args.served_model_name == ["SmolLM2-135M-Instruct"]
    assert models.served_name(None) == "SmolLM2-135M-Instruct"  # what the benchmarks ask for
    assert parse(["--served-model-name", "mine"]).served_model_name == ["mine"]


def test_a_fetchable_model_by_name(monkeypatch, model_dir, tmp_path):
    fetched = []
    monkeypatch.setattr(models, "fetch_model", lambda name: fetched.append(name) or model_dir)
    args = parse(["gemma-3-270m"])
    assert args.model == str(model_dir) and args.served_model_name == ["gemma-3-270m"] and fetched == ["gemma-3-270m"]
    assert args.model_tag == str(model_dir)  # what vLLM's serve command loads
    assert models.served_name("gemma-3-270m") == "gemma-3-270m"
    assert parse([str(model_dir)]).served_model_name is None  # vLLM's default: the folder as given
    assert models.served_name(str(model_dir)) == str(model_dir)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()  # a folder of that name here wins
    assert parse(["gemma-3-270m"]).model == "gemma-3-270m" and fetched == ["gemma-3-270m"]


def test_operator_config_is_checked_and_made_absolute(model_dir, tmp_path, monkeypatch):
    (tmp_path / "ops.yaml").write_text("default: {policy: lagkv}\n")
    monkeypatch.chdir(tmp_path)
    args = parse([str(model_dir), "--kv-compression-config", "ops.yaml"])
    assert args.kv_compression_config == str(tmp_path / "ops.yaml")
    (tmp_path / "bad.yaml").write_text("allow: [snapkv]\n")  # default `full` is not allowed
    with pytest.raises(ConfigError, match=r"default\.policy"):
        parse([str(model_dir), "--kv-compression-config", "bad.yaml"])


def test_another_connector_is_refused(model_dir):
    with pytest.raises(ValueError, match="KVCompConnector"):
        parse([str(model_dir), "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'])


def test_main_reports_a_bad_config_before_starting_anything(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # main sets it; keep the test process as it was
    (tmp_path / "bad.yaml").write_text("bounds: {min_ratios: 0.1}\n")
    assert cli.main([str(model_dir), "--kv-compression-config", str(tmp_path / "bad.yaml")]) == 2
    assert "bounds.min_ratios: unknown key" in capsys.readouterr().err
