"""Profiles reach policies: the operator's served profile (name or path) or a named one."""

from __future__ import annotations

import json

import pytest

from vllm_kvcomp.calibration.profiles import (
    ModelIdentity,
    ProfileError,
    RetrievalHeadsProfile,
    save_profile,
)
from vllm_kvcomp.engine.plugin import kv_transfer_config
from vllm_kvcomp.engine.policy_factory import PolicyFactory
from vllm_kvcomp.spec import CompressionSpec

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 128, "head_dim": 32}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def _profile(model_dir, heads, name="default"):
    return RetrievalHeadsProfile(model=ModelIdentity.from_model_dir(model_dir), kv_heads=frozenset(heads), name=name)


def test_default_name_from_the_model_folder(model_dir):
    save_profile(_profile(model_dir, {(0, 1)}), model_dir=model_dir)
    policy = PolicyFactory(str(model_dir)).build(CompressionSpec.from_mapping({"policy": "razor"}))
    assert policy.retrieval_heads == frozenset({(0, 1)})


def test_operator_served_path_wins_for_the_default_name(model_dir, tmp_path_factory):
    save_profile(_profile(model_dir, {(0, 1)}), model_dir=model_dir)
    path = save_profile(_profile(model_dir, {(1, 0)}), path=tmp_path_factory.mktemp("ops") / "razor.json")
    factory = PolicyFactory(str(model_dir), kv_transfer_config({"razor": str(path)})["kv_connector_extra_config"]["profiles"])
    assert factory.build(CompressionSpec.from_mapping({"policy": "razor"})).retrieval_heads == frozenset({(1, 0)})


def test_named_profile_and_missing_profile(model_dir):
    save_profile(_profile(model_dir, {(1, 1)}, name="alt"), model_dir=model_dir)
    factory = PolicyFactory(str(model_dir))
    spec = CompressionSpec.from_mapping({"policy": "razor", "profile": "alt"})
    assert factory.build(spec).retrieval_heads == frozenset({(1, 1)})
    with pytest.raises(ProfileError, match="calibrate"):
        factory.build(CompressionSpec.from_mapping({"policy": "razor"}))


def test_kv_transfer_config_without_profiles_has_no_extra_config():
    assert "kv_connector_extra_config" not in kv_transfer_config()
