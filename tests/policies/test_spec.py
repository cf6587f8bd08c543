"""CompressionSpec: header grammar, validation, error messages, xargs round trip, defaults."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.policies.conftest import TEST_PROFILES
from vllm_kvcomp.calibration.profiles import bind_profile
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class
from vllm_kvcomp.spec import MAX_HEADER_LENGTH, CompressionSpec, parse_header


def _error(call) -> SpecError:
    with pytest.raises(SpecError) as info:
        call()
    return info.value


# ------------------------------------------------------------------ header grammar


def test_bare_word_is_the_policy():
    spec = CompressionSpec.from_header("snapkv; ratio=0.25")
    assert (spec.policy, spec.ratio) == ("snapkv", 0.25)


@pytest.mark.parametrize("word", ["none", "full", "NONE", " Full "])
def test_no_compression_words(word):
    spec = CompressionSpec.from_header(word)
    assert spec.policy == "full"
    assert not spec.compresses


def test_spaces_and_case_are_ignored():
    spec = CompressionSpec.from_header("  POLICY = LagKV ;  Ratio = 0.25 ; lag=64 ;")
    assert (spec.policy, spec.ratio, spec.lag) == ("lagkv", 0.25, 64)


def test_values_are_typed():
    spec = CompressionSpec.from_header("policy=streamingllm; budget=100; sink=2; interval=8")
    assert isinstance(spec.budget, int) and spec.budget == 100
    assert (spec.sink, spec.interval) == (2, 8)


def test_integer_given_as_float_text():
    assert CompressionSpec.from_header("policy=streamingllm; budget=64.0").budget == 64


def test_duplicate_key_names_the_key():
    err = _error(lambda: CompressionSpec.from_header("policy=snapkv; ratio=0.5; ratio=0.3"))
    assert err.field == "ratio"
    assert "twice" in str(err)


@pytest.mark.parametrize(
    "header", ["policy=snapkv; ratio", "policy=snapkv; =0.5", "policy=snapkv; ratio=", "snapkv; lagkv"]
)
def test_malformed_entries(header):
    err = _error(lambda: CompressionSpec.from_header(header))
    assert err.field == "X-KV-Compression"
    assert "key=value" in str(err)


@pytest.mark.parametrize("header", ["", " ", ";;", " ; "])
def test_empty_header(header):
    assert _error(lambda: CompressionSpec.from_header(header)).field == "X-KV-Compression"


def test_too_long_header():
    header = "policy=snapkv; " + "x" * MAX_HEADER_LENGTH
    err = _error(lambda: CompressionSpec.from_header(header))
    assert err.field == "X-KV-Compression"
    assert str(MAX_HEADER_LENGTH) in str(err)


def test_parse_header_keeps_raw_strings():
    assert parse_header("lagkv; ratio=0.25") == {"policy": "lagkv", "ratio": "0.25"}


# ------------------------------------------------------------------ validation


def test_unknown_policy_lists_the_names():
    err = _error(lambda: CompressionSpec.from_header("policy=magic"))
    assert err.field == "policy"
    for name in POLICY_NAMES:
        assert name in err.allowed


def test_unknown_key_lists_the_policy_keys():
    err = _error(lambda: CompressionSpec.from_header("policy=snapkv; lag=3"))
    assert err.field == "lag"
    assert "kernel" in err.allowed and "window" in err.allowed
    assert "lag" not in err.allowed.split(", ")


@pytest.mark.parametrize(("key", "value"), [("ratio", "abc"), ("budget", "ten"), ("budget", "3.5"), ("ratio", "nan")])
def test_non_numeric(key, value):
    err = _error(lambda: CompressionSpec.from_header(f"policy=snapkv; {key}={value}"))
    assert err.field == key
    assert err.allowed


@pytest.mark.parametrize(
    ("header", "field", "allowed"),
    [
        ("policy=snapkv; ratio=1.5", "ratio", "(0, 1]"),
        ("policy=snapkv; ratio=0", "ratio", "(0, 1]"),
        ("policy=snapkv; ratio=-0.1", "ratio", "(0, 1]"),
        ("policy=snapkv; budget=0", "budget", "integer"),
        ("policy=snapkv; kernel=65", "kernel", "63"),
        ("policy=snapkv; kernel=4", "kernel", "odd"),
        ("policy=snapkv; window=0", "window", "[1,"),
        ("policy=snapkv; heads=some", "heads", "uniform, adaptive"),
        ("policy=lagkv; lag=0", "lag", "integer"),
        ("policy=entropy; min_ratio=1.5", "min_ratio", "[0, 1]"),
        ("policy=entropy; max_ratio=0.5", "max_ratio", "[1, 64]"),
        ("policy=entropy; window=0", "window", "[1,"),
    ],
)
def test_out_of_range_names_field_and_allowed(header, field, allowed):
    err = _error(lambda: CompressionSpec.from_header(header))
    assert err.field == field
    assert allowed in err.allowed
    assert str(err).startswith(f"{field}:")


def test_ratio_and_budget_together():
    err = _error(lambda: CompressionSpec.from_mapping({"policy": "h2o", "ratio": 0.5, "budget": 64}))
    assert err.field == "budget"
    assert "ratio" in err.allowed


def test_budget_alone_switches_off_the_default_ratio():
    policy = CompressionSpec.from_mapping({"policy": "snapkv", "budget": 64}).build_policy()
    assert (policy.ratio, policy.budget) == (None, 64)
    assert policy.kept_for(1000) == 64


def test_lagkv_has_no_budget():
    assert _error(lambda: CompressionSpec.from_mapping({"policy": "lagkv", "budget": 8})).field == "budget"


def test_mapping_must_be_a_mapping():
    assert _error(lambda: CompressionSpec.from_mapping(["policy", "snapkv"])).field == "kv_compression"


def test_field_prefix():
    err = _error(lambda: CompressionSpec.from_mapping({"policy": "snapkv", "ratio": 2}, field_prefix="kv_compression."))
    assert err.field == "kv_compression.ratio"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_bare_policy_builds_with_defaults(name):
    policy = CompressionSpec.from_header(name).build_policy()
    if policy.PROFILE is not None:
        policy = bind_profile(policy, TEST_PROFILES[policy.PROFILE])
    assert isinstance(policy, get_policy_class(name))
    if name != "full":
        assert 0 < policy.ratio <= 1


def test_extras_are_carried():
    spec = CompressionSpec.from_header("policy=snapkv; kernel=5; heads=ADAPTIVE")
    assert dict(spec.extras) == {"kernel": 5, "heads": "adaptive"}
    policy = spec.build_policy()
    assert (policy.kernel, policy.heads) == (5, "adaptive")


# ------------------------------------------------------------------ xargs and defaults


def test_xargs_round_trip():
    spec = CompressionSpec.from_header("policy=lagkv; ratio=0.25; lag=64; sink=8")
    xargs = spec.to_xargs()
    assert all(k.startswith("kvcomp_") for k in xargs)
    assert CompressionSpec.from_xargs({**xargs, "other": 1}) == spec


def test_xargs_absent():
    assert CompressionSpec.from_xargs(None) is None
    assert CompressionSpec.from_xargs({"temperature": 0.5}) is None


def test_xargs_errors_carry_the_prefix():
    err = _error(lambda: CompressionSpec.from_xargs({"kvcomp_policy": "snapkv", "kvcomp_ratio": "x"}))
    assert err.field == "kvcomp_ratio"


def test_with_defaults_fills_unset_fields():
    spec = CompressionSpec.from_header("policy=snapkv; window=16")
    merged = spec.with_defaults({"policy": "ignored", "ratio": 0.3, "kernel": 5, "window": 64})
    assert (merged.policy, merged.ratio, merged.window, merged.extras["kernel"]) == ("snapkv", 0.3, 16, 5)


def test_request_size_overrides_both_default_sizes():
    spec = CompressionSpec.from_header("policy=snapkv; budget=32")
    merged = spec.with_defaults({"ratio": 0.3})
    assert (merged.ratio, merged.budget) == (None, 32)
    spec = CompressionSpec.from_header("policy=snapkv; ratio=0.5")
    assert spec.with_defaults({"budget": 128}).budget is None


def test_with_defaults_revalidates():
    spec = CompressionSpec.from_header("policy=lagkv")
    assert _error(lambda: spec.with_defaults({"kernel": 5})).field == "kernel"


# ------------------------------------------------------------------ property: round trips


def _value(param, draw):
    if param.choices:
        return draw(st.sampled_from(param.choices))
    if param.kind is str:  # profile names
        return draw(st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True))
    if param.kind is int:
        return draw(st.integers(int(param.low), min(int(param.high), 10_000)))
    if param.name == "ratio":
        return draw(st.integers(1, 1000)) / 1000
    low, high = param.low or 0.0, min(param.high, 64.0)
    return round(draw(st.floats(low, high)), 3)


@st.composite
def specs(draw):
    name = draw(st.sampled_from(POLICY_NAMES))
    accepted = get_policy_class(name).accepted_params()
    keys = draw(st.lists(st.sampled_from(sorted(accepted)), unique=True)) if accepted else []
    if "ratio" in keys and "budget" in keys:
        keys.remove("budget")
    mapping = {"policy": name, **{k: _value(accepted[k], draw) for k in keys}}
    try:
        return CompressionSpec.from_mapping(mapping)
    except SpecError as err:  # only cross-field rules may reject a per-field valid mapping
        # pod: budget >= sink + window; streaming; lagkv: lag >= 2; criticalkv: another inner's key;
        # context_tokens only with scope=context; decode=recompress not with scope=context, pod or full
        assert err.field in ("window", "kernel", "budget", "prefill", "lag", "sink", "observe", "context_tokens",
                             "decode")
        return CompressionSpec.from_mapping({"policy": name})


@settings(max_examples=150, deadline=None)
@given(specs())
def test_round_trips(spec):
    assert CompressionSpec.from_xargs(spec.to_xargs()) == spec
    assert CompressionSpec.from_header(spec.to_header()) == spec
    assert CompressionSpec.from_mapping(spec.to_dict()) == spec
    assert spec.with_defaults({}) == spec


def test_header_round_trips_floats_exactly():
    spec = CompressionSpec.from_mapping({"policy": "snapkv", "ratio": 0.1234567891})
    assert CompressionSpec.from_header(spec.to_header()) == spec


def test_settings_without_a_policy_name_the_missing_policy():
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_header("ratio=0.5")
    assert err.value.field == "policy"
    assert "snapkv" in err.value.allowed


# ------------------------------------------------------------------ issue #20: text numbers, duplicate keys


@pytest.mark.parametrize("text", ["０.２５", "0.２5", "١", "1_0", "inf", "nan", "0x10", "\u20030.25", "½"])
@pytest.mark.parametrize("source", ["mapping", "xargs", "header"])
def test_numbers_given_as_text_must_be_ascii_decimals(text, source):
    key = "ratio" if "." in text or text in ("inf", "nan", "½") else "budget"
    calls = {
        "mapping": lambda: CompressionSpec.from_mapping({"policy": "snapkv", key: text}),
        "xargs": lambda: CompressionSpec.from_xargs({"kvcomp_policy": "snapkv", f"kvcomp_{key}": text}),
        "header": lambda: CompressionSpec.from_header(f"snapkv; {key}={text}"),
    }
    err = _error(calls[source])
    assert err.field.endswith(key)
    assert "ASCII digits" in str(err) or "finite" in str(err)


@pytest.mark.parametrize(("text", "value"), [("0.25", 0.25), (" .5", 0.5), ("1e-1", 0.1), ("+0.3", 0.3)])
def test_ascii_numbers_as_text_still_work(text, value):
    assert CompressionSpec.from_mapping({"policy": "snapkv", "ratio": text}).ratio == value


def test_an_integer_too_large_for_a_float_is_a_spec_error():
    err = _error(lambda: CompressionSpec.from_mapping({"policy": "snapkv", "budget": 10**400}))
    assert err.field == "budget" and "401 digits" in err.message
    assert _error(lambda: CompressionSpec.from_mapping({"policy": "snapkv", "ratio": 10**400})).field == "ratio"


def test_case_variants_of_a_key_must_agree():
    err = _error(lambda: CompressionSpec.from_xargs({"KVComp_Policy": "snapkv", "kvcomp_policy": "h2o"}))
    assert err.field == "kvcomp_policy" and "KVComp_Policy='snapkv'" in err.message and "'h2o'" in err.message
    err = _error(lambda: CompressionSpec.from_mapping({"policy": "snapkv", "Ratio": 0.3, "RATIO": 0.5}))
    assert err.field == "RATIO" and "Ratio=0.3" in err.message
    same = CompressionSpec.from_xargs({"KVCOMP_POLICY": "SnapKV", "kvcomp_policy": "snapkv", "kvcomp_ratio": "0.30",
                                       "KVComp_Ratio": 0.3})
    assert same == CompressionSpec.from_mapping({"policy": "snapkv", "ratio": 0.3})
