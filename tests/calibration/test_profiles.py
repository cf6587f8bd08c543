"""Profile JSON: paths, round trips, validation errors, model identity, binding to policies."""

from __future__ import annotations

import json

import pytest

from vllm_kvcomp.calibration.profiles import (
    LayerGroupsProfile,
    ModelIdentity,
    ProfileError,
    RetrievalHeadsProfile,
    load_for_policy,
    load_profile,
    profile_path,
    save_profile,
)
from vllm_kvcomp.policies.pod import POD
from vllm_kvcomp.policies.razor import Razor

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "torch_dtype": "float32",
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def _razor(ident: ModelIdentity, name: str = "default") -> RetrievalHeadsProfile:
    return RetrievalHeadsProfile(
        model=ident,
        kv_heads=frozenset({(0, 1), (2, 0)}),
        induction_heads=frozenset({(0, 3)}),
        echo_heads=frozenset({(2, 1)}),
        induction_scores=((0.1, 0.2, 0.3, 0.9), (0.0, 0.0, 0.1, 0.1), (0.2, 0.3, 0.1, 0.0)),
        echo_scores=((0.0,) * 4, (0.1,) * 4, (0.5, 0.9, 0.0, 0.0)),
        settings={"seed": 3},
        name=name,
    )


def test_identity_from_config_is_stable_and_ignores_dtype():
    a = ModelIdentity.from_config(CONFIG)
    b = ModelIdentity.from_config({**CONFIG, "torch_dtype": "bfloat16", "_name_or_path": "/x"})
    assert a == b
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.group_size) == (3, 4, 2, 16, 2)
    assert ModelIdentity.from_config({**CONFIG, "hidden_size": 128}).config_hash != a.config_hash


def test_identity_from_hf_config_object_matches_json():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "torch_dtype")})
    assert ModelIdentity.from_config(cfg) == ModelIdentity.from_config(CONFIG)


def test_paths_by_name(model_dir):
    assert profile_path(model_dir, "razor") == model_dir / "kvcomp_profiles" / "razor.json"
    assert profile_path(model_dir, "pod", "long-ctx") == model_dir / "kvcomp_profiles" / "pod.long-ctx.json"
    with pytest.raises(ProfileError, match="invalid"):
        profile_path(model_dir, "pod", "../up")
    with pytest.raises(ProfileError, match="unknown profile kind"):
        profile_path(model_dir, "snapkv")


def test_round_trip_both_kinds(model_dir):
    ident = ModelIdentity.from_model_dir(model_dir)
    razor = _razor(ident)
    pod = LayerGroupsProfile(
        model=ident, groups=((0,), (1, 2)), delta=0.4,
        similarity=((1.0, 0.2, 0.1), (0.2, 1.0, 0.7), (0.1, 0.7, 1.0)), settings={"last": 8},
    )
    assert save_profile(razor, model_dir=model_dir) == profile_path(model_dir, "razor")
    save_profile(pod, model_dir=model_dir)
    assert load_profile("razor", model_dir=model_dir) == razor
    assert load_profile("pod", model_dir=model_dir) == pod
    named = _razor(ident, name="alt")
    path = save_profile(named, model_dir=model_dir)
    assert path.name == "razor.alt.json"
    assert load_profile("razor", model_dir=model_dir, name="alt").name == "alt"
    other = model_dir / "elsewhere.json"
    save_profile(pod, path=other)
    assert load_profile("pod", path=other, expect=ident) == pod


def test_missing_profile_tells_how_to_create_it(model_dir):
    with pytest.raises(ProfileError, match=r"vllm-kvcomp calibrate --model .* --kind razor --name alt"):
        load_profile("razor", model_dir=model_dir, name="alt")


def test_identity_mismatch_is_refused(model_dir, tmp_path_factory):
    save_profile(_razor(ModelIdentity.from_model_dir(model_dir)), model_dir=model_dir)
    other = tmp_path_factory.mktemp("other")
    (other / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 4}))
    with pytest.raises(ProfileError, match=r"num_layers: .* has 3, model has 4"):
        load_profile("razor", path=profile_path(model_dir, "razor"), expect=ModelIdentity.from_model_dir(other))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: d.update(format="other"), "not a vllm-kvcomp profile"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(kind="snapkv"), "unknown profile kind"),
        (lambda d: d["data"].update(kv_heads=[[5, 0]]), "outside 3 layers x 2 heads"),
        (lambda d: d["data"].update(kv_heads=[[0, 1, 2]]), r"\[layer, head\] pairs"),
        (lambda d: d["data"].update(kv_heads=[[0, "1"]]), "must be an integer"),
        (lambda d: d["data"].update(kv_heads=[[0, 1]]), "misses the KV heads"),
        (lambda d: d["data"].update(echo_scores=[[0.1]]), "3 rows of 4 scores"),
        (lambda d: d["model"].pop("num_kv_heads"), "lacks the key 'num_kv_heads'"),
        (lambda d: d.update(name="Bad Name"), "invalid"),
    ],
)
def test_malformed_razor_profiles(model_dir, edit, message):
    path = save_profile(_razor(ModelIdentity.from_model_dir(model_dir)), model_dir=model_dir)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message):
        load_profile("razor", model_dir=model_dir)


@pytest.mark.parametrize(
    "groups,message",
    [([[0], [2, 1]], "consecutive"), ([[0, 1]], "consecutive"), ([[0], [], [1, 2]], "non-empty"), ("x", "list")],
)
def test_malformed_pod_groups(model_dir, groups, message):
    pod = LayerGroupsProfile(model=ModelIdentity.from_model_dir(model_dir), groups=((0, 1, 2),))
    path = save_profile(pod, model_dir=model_dir)
    doc = json.loads(path.read_text())
    doc["data"]["groups"] = groups
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message):
        load_profile("pod", model_dir=model_dir)


def test_wrong_kind_and_bad_json(model_dir):
    ident = ModelIdentity.from_model_dir(model_dir)
    path = save_profile(LayerGroupsProfile(model=ident, groups=((0, 1, 2),)), path=model_dir / "p.json")
    with pytest.raises(ProfileError, match="holds a 'pod' profile, expected 'razor'"):
        load_profile("razor", path=path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read JSON"):
        load_profile("pod", path=path)


def test_invalid_profile_is_not_saved(model_dir):
    bad = LayerGroupsProfile(model=ModelIdentity.from_model_dir(model_dir), groups=((0,), (1,)))
    with pytest.raises(ProfileError):
        save_profile(bad, model_dir=model_dir)
    assert not profile_path(model_dir, "pod").exists()


def test_load_for_policy_binds_by_profile_name(model_dir):
    ident = ModelIdentity.from_model_dir(model_dir)
    save_profile(_razor(ident, name="alt"), model_dir=model_dir)
    save_profile(LayerGroupsProfile(model=ident, groups=((0, 1), (2,))), model_dir=model_dir)
    razor = load_for_policy(Razor(profile="alt"), model_dir)
    assert razor.retrieval_heads == frozenset({(0, 1), (2, 0)})
    assert load_for_policy(POD(), model_dir).groups == ((0, 1), (2,))
    with pytest.raises(ProfileError, match="no razor profile 'default'"):
        load_for_policy(Razor(), model_dir)
    with pytest.raises(ProfileError, match="needs a 'razor' profile"):
        from vllm_kvcomp.calibration.profiles import bind_profile

        bind_profile(Razor(), load_profile("pod", model_dir=model_dir))


def test_the_package_store_serves_any_copy_of_a_model(model_dir, tmp_path_factory, monkeypatch):
    from vllm_kvcomp.calibration import profiles

    monkeypatch.setattr(profiles, "STORE", tmp_path_factory.mktemp("store"))
    ident = ModelIdentity.from_model_dir(model_dir)
    assert profiles.find_profile("razor", model_dir) is None
    assert profiles.available_profiles(model_dir) == {}
    shipped = save_profile(_razor(ident), path=profiles.store_dir(ident) / "razor.json")
    copy = tmp_path_factory.mktemp("copy")  # the same model in another folder
    (copy / "config.json").write_text(json.dumps(CONFIG))
    assert profiles.find_profile("razor", copy) == shipped
    assert profiles.available_profiles(copy) == {"razor": "default"}
    assert load_profile("razor", model_dir=copy).kv_heads == _razor(ident).kv_heads
    local = save_profile(_razor(ident), model_dir=copy)  # the model's own folder wins
    assert profiles.find_profile("razor", copy) == local
    other = tmp_path_factory.mktemp("other")  # another shape: the shipped profile is not its
    (other / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 5}))
    assert profiles.find_profile("razor", other) is None


def test_the_bundled_model_ships_both_profiles():
    """The store holds a profile of every kind (razor, pod, duoattention, kvzap) for the bundled SmolLM2
    (so a default server runs every policy); they were made by `vllm-kvcomp calibrate --store`
    (docs/calibration.md)."""
    from vllm_kvcomp.calibration import profiles
    from vllm_kvcomp.models import BUNDLED_IDENTITY

    folder = profiles.STORE / BUNDLED_IDENTITY
    for kind in profiles.KINDS:
        profile = load_profile(kind, path=folder / f"{kind}.json")
        assert f"{profile.model.model_type}-{profile.model.config_hash}" == BUNDLED_IDENTITY
