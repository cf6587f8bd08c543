"""Operator config: loading, validation errors with YAML paths, resolve(), presets, schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.registry import POLICY_NAMES
from vllm_kvcomp.server.operator_config import (
    DEFAULT_MIN_INTERVAL,
    Bounds,
    ConfigError,
    OperatorConfig,
    main,
    requires_profile,
)
from vllm_kvcomp.spec import CompressionSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMPRESSING = [p for p in POLICY_NAMES if p != "full"]


def spec(header: str) -> CompressionSpec:
    return CompressionSpec.from_header(header)


def config(**data) -> OperatorConfig:
    return OperatorConfig.validate_mapping(data)


# ---------------------------------------------------------------------------- defaults & files


def test_default_config_compresses_nothing_and_allows_everything():
    cfg = OperatorConfig.default()
    assert cfg.resolve(None) == CompressionSpec(policy="full")
    assert cfg.allow == POLICY_NAMES
    assert cfg.bounds == Bounds()
    assert cfg.profiles == {} and cfg.policies == {}


def test_default_yaml_spells_out_the_built_in_defaults():
    loaded = OperatorConfig.load(CONFIGS / "default.yaml")
    assert loaded.source == str(CONFIGS / "default.yaml")
    assert {**vars(loaded), "source": None} == vars(OperatorConfig.default())


@pytest.mark.parametrize("policy", COMPRESSING)
def test_every_method_has_a_preset_that_loads_and_applies(policy):
    cfg = OperatorConfig.load(CONFIGS / f"{policy}.yaml")
    default = cfg.resolve(None)
    assert default.policy == policy and default.compresses
    assert default.to_dict() == {"policy": policy, **cfg.policies[policy]}
    # a client asking for the method with another ratio keeps the preset's other settings
    mine = cfg.resolve(spec(f"policy={policy}; ratio=0.5"))
    assert mine.ratio == 0.5
    assert {k: v for k, v in mine.to_dict().items() if k != "ratio"} == {
        k: v for k, v in default.to_dict().items() if k != "ratio"
    }
    assert policy in cfg.usable_policies()


def test_presets_cover_exactly_the_policies():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(["default", *COMPRESSING])


# ---------------------------------------------------------------------------- resolve


def test_request_gets_operator_defaults_under_what_it_sets():
    cfg = config(policies={"lagkv": {"ratio": 0.25, "lag": 64, "sink": 8}})
    assert cfg.resolve(spec("lagkv")).to_dict() == {"policy": "lagkv", "ratio": 0.25, "sink": 8, "lag": 64}
    assert cfg.resolve(spec("lagkv; lag=32")).lag == 32
    # a budget request replaces the default ratio instead of clashing with it
    snap = config(policies={"snapkv": {"ratio": 0.25, "window": 16}})
    out = snap.resolve(spec("snapkv; budget=256"))
    assert (out.ratio, out.budget, out.window) == (None, 256, 16)


def test_default_spec_gets_its_policy_defaults():
    cfg = config(default="lagkv", policies={"lagkv": {"ratio": 0.25, "lag": 64}})
    assert cfg.resolve(None).to_dict() == {"policy": "lagkv", "ratio": 0.25, "lag": 64}
    header = config(default="snapkv; ratio=0.5; window=16")
    assert header.resolve(None).to_dict() == {"policy": "snapkv", "ratio": 0.5, "window": 16}


def test_explicit_none_means_full_even_with_a_compressing_default():
    cfg = config(default={"policy": "lagkv", "ratio": 0.25})
    assert cfg.resolve(None).policy == "lagkv"
    assert cfg.resolve(None, explicit_none=True) == CompressionSpec()
    forced = config(default={"policy": "lagkv"}, allow=["lagkv"])
    with pytest.raises(SpecError) as err:
        forced.resolve(None, explicit_none=True)
    assert err.value.field == "policy" and err.value.allowed == "lagkv"


def test_allow_list_refuses_other_policies_naming_the_usable_ones():
    cfg = config(allow=["full", "lagkv", "razor"])
    assert cfg.resolve(spec("lagkv")).policy == "lagkv"
    with pytest.raises(SpecError) as err:
        cfg.resolve(spec("snapkv; ratio=0.5"))
    assert err.value.field == "policy"
    assert "not enabled" in err.value.message
    assert err.value.allowed == "full, lagkv"  # razor is allowed but has no profile


@pytest.mark.parametrize("policy", ["razor", "pod", "duoattention", "kvzap"])
def test_profile_methods_need_their_profile(policy):
    assert requires_profile(policy) == policy
    with pytest.raises(SpecError) as err:
        OperatorConfig.default().resolve(spec(policy))
    assert err.value.field == "policy" and f"{policy!r} calibration profile" in err.value.message
    assert policy not in OperatorConfig.default().usable_policies()
    cfg = config(profiles={policy: "default"})
    assert cfg.resolve(spec(policy)).policy == policy
    assert policy in cfg.usable_policies()


def test_a_server_uses_the_profiles_found_for_its_model(tmp_path, monkeypatch):
    """No operator YAML: the served model's profiles (its folder or the package store) enable
    razor and pod; a model without them gets a 400 that names the command creating them."""
    from vllm_kvcomp.calibration import profiles

    monkeypatch.setattr(profiles, "STORE", tmp_path / "store")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "hidden_size": 64}))
    bare = OperatorConfig.for_server(None, str(model))
    with pytest.raises(SpecError) as err:
        bare.resolve(spec("razor; ratio=0.25"))
    assert f"vllm-kvcomp calibrate --model {model} --kind razor" in err.value.message
    identity = profiles.ModelIdentity.from_model_dir(model)
    profiles.save_profile(profiles.RetrievalHeadsProfile(model=identity, kv_heads=frozenset({(1, 0)})),
                          path=profiles.store_dir(identity) / "razor.json")
    served = OperatorConfig.for_server(None, str(model))
    assert served.resolve(spec("razor; ratio=0.25")).policy == "razor"
    assert "razor" in served.usable_policies() and "pod" not in served.usable_policies()
    (tmp_path / "op.yaml").write_text("default: razor\n")  # a default needing the found profile is fine
    assert OperatorConfig.for_server(tmp_path / "op.yaml", str(model)).resolve(None).policy == "razor"


def test_only_razor_pod_duoattention_and_kvzap_need_profiles():
    assert [p for p in POLICY_NAMES if requires_profile(p)] == ["razor", "pod", "duoattention", "kvzap"]


@pytest.mark.parametrize(
    ("header", "field", "allowed"),
    [
        ("snapkv; ratio=0.01", "ratio", "a number in [0.1, 0.9]"),
        ("snapkv; ratio=0.95", "ratio", "a number in [0.1, 0.9]"),
        ("snapkv; budget=10", "budget", "an integer in [100, 5000]"),
        ("snapkv; budget=5001", "budget", "an integer in [100, 5000]"),
        ("snapkv; window=65", "window", "an integer in [0, 64]"),
        ("expected_attention; observe=65", "observe", "an integer in [0, 64] (bounds.max_window)"),
        ("h2o; interval=2", "interval", "an integer >= 4"),
    ],
)
def test_bounds_refuse_client_values_outside_them(header, field, allowed):
    bounds = {"min_ratio": 0.1, "max_ratio": 0.9, "min_budget": 100, "max_budget": 5000,
              "max_window": 64, "min_interval": 4}
    cfg = config(bounds=bounds, allow=["full", "snapkv", "h2o", "expected_attention"], policies={"h2o": {"interval": 16}})
    with pytest.raises(SpecError) as err:
        cfg.resolve(spec(header))
    assert (err.value.field, err.value.allowed) == (field, allowed)
    assert "bounds" in err.value.message


def test_bounds_accept_their_edges():
    cfg = config(bounds={"min_ratio": 0.1, "max_ratio": 0.9, "min_budget": 100, "max_budget": 5000})
    assert cfg.resolve(spec("snapkv; ratio=0.1")).ratio == 0.1
    assert cfg.resolve(spec("snapkv; ratio=0.9")).ratio == 0.9
    assert cfg.resolve(spec("snapkv; budget=100")).budget == 100
    assert cfg.resolve(spec("snapkv; budget=5000")).budget == 5000


# ---------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("data", "path", "fragment"),
    [
        ({"bogus": 1}, "bogus", "allowed: default, allow, bounds, policies, profiles"),
        ({"allow": ["full", "nope"]}, "allow[1]", "'nope'"),
        ({"allow": []}, "allow", "at least 1"),
        ({"bounds": {"min_ratio": 0}}, "bounds.min_ratio", "greater than 0"),
        ({"bounds": {"max_ratios": 1}}, "bounds.max_ratios", "allowed: min_ratio, max_ratio"),
        ({"bounds": {"min_budget": "64"}}, "bounds.min_budget", "integer"),
        ({"bounds": {"min_ratio": 0.5, "max_ratio": 0.2}}, "bounds.min_ratio", "above bounds.max_ratio"),
        ({"bounds": {"min_budget": 10, "max_budget": 5}}, "bounds.min_budget", "above bounds.max_budget"),
        ({"policies": {"nope": {}}}, "policies.nope", "unknown key"),
        ({"policies": {"lagkv": {"ratio": 2}}}, "policies.lagkv.ratio", "above the maximum"),
        ({"policies": {"lagkv": {"window": 2}}}, "policies.lagkv.window", "unknown key for policy 'lagkv'"),
        ({"policies": {"lagkv": {"policy": "lagkv"}}}, "policies.lagkv.policy", "key above"),
        ({"policies": {"snapkv": {"ratio": 0.5, "budget": 9}}}, "policies.snapkv.budget", "not both"),
        ({"bounds": {"max_window": 8}}, "policies.snapkv.window", "set policies.snapkv.window"),
        ({"bounds": {"min_ratio": 0.9}}, "policies.streamingllm.ratio", "bounds"),
        ({"default": 3}, "default", "policy name or a mapping"),
        ({"default": {"policy": "nope"}}, "default.policy", "unknown policy"),
        ({"default": "lagkv; ratio=7"}, "default.ratio", "above the maximum"),
        ({"default": "lagkv", "allow": ["full"]}, "default.policy", "not in allow"),
        ({"default": "razor"}, "default.policy", "set profiles.razor"),
        ({"default": "lagkv; ratio=0.01"}, "default.ratio", "bounds"),
        ({"profiles": {"lagkv": "x"}}, "profiles.lagkv", "'razor', 'pod', 'duoattention' or 'kvzap'"),
        ({"profiles": {"razor": "Not A Name"}}, "profiles.razor", "neither a profile name"),
        ({"profiles": {"razor": 3}}, "profiles.razor", "string"),
    ],
)
def test_invalid_configs_name_the_yaml_path(data, path, fragment):
    with pytest.raises(ConfigError) as err:
        OperatorConfig.validate_mapping(data, source="ops.yaml")
    assert err.value.path == path
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"ops.yaml: {path}: ")


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping, got list"):
        OperatorConfig.validate_mapping(["full"])


def test_load_reports_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the file"):
        OperatorConfig.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("allow: [full\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        OperatorConfig.load(bad)
    assert str(err.value).startswith(str(bad))
    twice = tmp_path / "twice.yaml"
    twice.write_text("default: full\nallow: [full]\ndefault: lagkv\n")
    with pytest.raises(ConfigError, match="'default' is given twice"):
        OperatorConfig.load(twice)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert OperatorConfig.load(empty).resolve(None) == CompressionSpec()


def test_profile_paths_resolve_from_the_config_folder(tmp_path):
    path = tmp_path / "ops.yaml"
    path.write_text("profiles: {razor: ./profiles/razor.json, pod: /abs/pod.json}\n")
    cfg = OperatorConfig.load(path)
    assert cfg.profiles == {"razor": str(tmp_path / "profiles" / "razor.json"), "pod": "/abs/pod.json"}
    assert config(profiles={"razor": "my-heads"}).profiles == {"razor": "my-heads"}


# ---------------------------------------------------------------------------- schema & CLI


def test_json_schema_is_self_contained_and_matches_the_validator():
    schema = OperatorConfig.json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert "$ref" not in json.dumps(schema) and "$defs" not in schema
    validator = jsonschema.Draft7Validator(schema)
    for path in CONFIGS.glob("*.yaml"):
        validator.validate(yaml.safe_load(path.read_text()))
    for bad in ({"bogus": 1}, {"allow": ["nope"]}, {"bounds": {"min_ratio": 0}},
                {"policies": {"lagkv": {"ratio": 2}}}, {"policies": {"lagkv": {"window": 4}}},
                {"profiles": {"lagkv": "x"}}, {"default": {"policy": "nope"}}):
        assert not validator.is_valid(bad), bad
        with pytest.raises(ConfigError):
            OperatorConfig.validate_mapping(bad)
    from vllm_kvcomp.policies.registry import get_policy_class

    for name in POLICY_NAMES:
        props = schema["properties"]["policies"]["properties"][name]["properties"]
        assert set(props) == set(get_policy_class(name).accepted_params())


def test_cli_checks_files_and_prints_the_schema(tmp_path, capsys):
    assert main(["check", str(CONFIGS / "lagkv.yaml")]) == 0
    assert "default: policy=lagkv" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("bounds: {max_window: -1}\n")
    assert main(["check", str(bad), str(CONFIGS / "default.yaml")]) == 1
    captured = capsys.readouterr()
    assert "bounds.max_window" in captured.err and "default.yaml: ok" in captured.out
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == OperatorConfig.json_schema()


def test_client_cannot_pick_another_profile_than_the_served_one():
    config = OperatorConfig.validate_mapping({"profiles": {"razor": "default"}})
    assert config.resolve(CompressionSpec.from_mapping({"policy": "razor", "profile": "default"})).policy == "razor"
    with pytest.raises(SpecError) as err:
        config.resolve(CompressionSpec.from_mapping({"policy": "razor", "profile": "other"}))
    assert err.value.field == "profile"


# ---------------------------------------------------------------------------- issue #20 item 6: the interval floor


def test_the_default_floor_refuses_frequent_recompression_and_keeps_builtin_defaults():
    cfg = OperatorConfig.default()
    assert cfg.bounds.min_interval == DEFAULT_MIN_INTERVAL == 16
    for header, field in (("streamingllm; interval=1", "interval"), ("h2o; interval=15", "interval"),
                          ("sagekv; interval=8", "interval"), ("entropy; interval=2", "interval"),
                          ("lagkv; lag=8", "lag")):
        with pytest.raises(SpecError) as err:
            cfg.resolve(spec(header))
        assert err.value.field == field and err.value.allowed.startswith("an integer >= 16")
    assert cfg.resolve(spec("lagkv; lag=16")).lag == 16
    assert cfg.resolve(spec("h2o; interval=16")).interval == 16
    for name in cfg.allow:  # every built-in default within the floor: nothing for the operator to set
        cfg.check_builtin_defaults(name)


def test_a_floor_above_a_builtin_interval_must_set_that_policy():
    with pytest.raises(ConfigError) as err:
        OperatorConfig.validate_mapping({"bounds": {"min_interval": 32}, "allow": ["full", "h2o"]})
    assert err.value.path == "policies.h2o.interval"
    ok = OperatorConfig.validate_mapping({"bounds": {"min_interval": 32}, "allow": ["full", "h2o", "lagkv"],
                                          "policies": {"h2o": {"interval": 32}}})
    assert ok.resolve(spec("lagkv")).build_policy().lag == 128  # the built-in lag is above the floor


def test_a_request_recompressing_without_an_interval_is_held_to_the_floor():
    """``decode=recompress`` on a method without an interval of its own gets ``min_interval``
    (also in the operator's default spec); one set below the floor is refused; a request that
    does not recompress, and lagkv (paced by ``lag``), get none."""
    cfg = OperatorConfig.validate_mapping({"bounds": {"min_interval": 64}, "policies": {"h2o": {"interval": 64}},
                                           "allow": ["full", "snapkv", "keydiff", "knorm", "h2o", "lagkv"],
                                           "default": "knorm; decode=recompress"})
    for header in ("snapkv; decode=recompress", "keydiff; decode=recompress", "h2o"):
        assert cfg.resolve(spec(header)).interval == 64
    assert cfg.resolve(spec("snapkv; decode=recompress; interval=96")).interval == 96
    assert cfg.default_spec.interval == 64 and cfg.default_spec.build_policy().interval == 64
    assert cfg.resolve(spec("snapkv")).interval is None and cfg.resolve(spec("lagkv; lag=64")).interval is None
    with pytest.raises(SpecError) as err:
        cfg.resolve(spec("snapkv; decode=recompress; interval=32"))
    assert err.value.field == "interval" and err.value.allowed.startswith("an integer >= 64")
    for name in ("full", "lagkv"):  # nothing recompresses by interval there
        with pytest.raises(SpecError) as err:
            spec(f"{name}; interval=64")
        assert err.value.field == "interval"
