"""Live: the README set-up (``vllm-kvcomp serve MODEL``, no operator config, the model's calibration
profiles found next to it), then one chat request per policy through the OpenAI SDK: all 200."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_llama import make_tiny_llama, seeded_scorer
from tests.server.conftest import TINY, chat_text, serving
from vllm_kvcomp.calibration.profiles import (
    HeadGatesProfile,
    LayerGroupsProfile,
    ModelIdentity,
    RetrievalHeadsProfile,
    save_profile,
)
from vllm_kvcomp.policies.registry import POLICY_NAMES

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory):
    """A fresh model folder with razor, pod, duoattention and kvzap profiles in ``kvcomp_profiles/``,
    served with no config."""
    root = tmp_path_factory.mktemp("readme")
    model = make_tiny_llama(root / "tiny", **TINY)
    identity = ModelIdentity.from_model_dir(model)
    save_profile(RetrievalHeadsProfile(model=identity, kv_heads=frozenset({(0, 0), (2, 1)})), model_dir=model)
    save_profile(LayerGroupsProfile(model=identity, groups=((0, 1), (2,))), model_dir=model)
    save_profile(HeadGatesProfile(model=identity, gates=((0.9, 0.1), (0.2, 0.3), (0.0, 0.6))), model_dir=model)
    save_profile(seeded_scorer(model), model_dir=model)
    with serving(root, model, None) as state:
        yield state


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_one_request_per_policy_through_the_openai_sdk(readme_server, policy):
    raw = readme_server.client().chat.completions.with_raw_response.create(
        model=readme_server.model, messages=[{"role": "user", "content": chat_text(400, seed=8)}],
        max_tokens=4, temperature=0, extra_headers={HEADER: f"policy={policy}"},
    )
    response = raw.parse()
    assert raw.status_code == 200 and response.choices[0].finish_reason in ("length", "stop")
    ext = response.usage.model_extra["kv_compression"]
    if policy == "full":
        assert raw.headers["X-KV-Compression-Applied"] == "none" == ext["applied"]
        return
    assert raw.headers["X-KV-Compression-Applied"].startswith(f"policy={policy}")
    assert ext["applied"] == raw.headers["X-KV-Compression-Applied"] and ext["policy"] == policy
    assert ext["compressions"] >= 1 and ext["kept_fraction"] < 1
