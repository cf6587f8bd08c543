"""The registry is the one list: a policy added as one module plus one registry line
(tests/policies/throwaway_policy.py) reaches the spec, the docs table, the benchmarks and every
test of the shared matrix, with no other edit; every registered class carries what they read."""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.policies import test_matrix
from tests.policies.throwaway_policy import Greedy, Oldest, register
from vllm_kvcomp.bench import cost, engine, pages
from vllm_kvcomp.eval import policy_table
from vllm_kvcomp.policies.registry import get_policy_class, policy_names, policy_variants
from vllm_kvcomp.spec import CompressionSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def oldest(monkeypatch) -> str:
    """``oldest`` registered for one test."""
    return register(Oldest, monkeypatch.setitem)


@pytest.mark.parametrize("name", policy_names())
def test_every_class_carries_its_table_text_and_valid_test_settings(name):
    cls = get_policy_class(name)
    assert cls.name == name and cls.KEEPS and cls.PAPER
    for settings in [cls.TEST_PARAMS, *cls.VARIANTS.values()]:
        assert CompressionSpec.from_mapping({"policy": name, **settings}).policy == name


def test_a_registered_policy_reaches_the_spec_and_the_docs_table(oldest):
    assert isinstance(CompressionSpec.from_header(f"{oldest}; ratio=0.25").build_policy(), Oldest)
    rows = [line for line in policy_table.table().splitlines() if line.startswith(f"| `{oldest}` |")]
    assert rows == [f"| `{oldest}` | the oldest tokens | `ratio`=0.5 ((0, 1]); `budget`=– (≥ 1); "
                    "`interval`=16 (≥ 1); `prefill`=end (end \\| stream \\| block) | none | no | `block` | "
                    f"{policy_table.PENDING} |"]


def test_a_registered_policy_reaches_the_benchmarks(oldest):
    for bench in (cost, engine, pages):
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        assert oldest in parser.get_default("policies").split(","), bench.__name__
    assert (oldest, oldest, "") in pages.configs()


def test_variants_follow_their_policy(monkeypatch):
    monkeypatch.setattr(Oldest, "VARIANTS", {"late": {"interval": 32}})
    name = register(Oldest, monkeypatch.setitem)
    assert policy_variants((name,)) == [(name, name, {}), (f"{name} late", name, {"interval": 32})]
    assert (f"{name} late", name, "interval=32") in pages.configs()


def _matrix_results(tmp_path: Path) -> dict[str, dict[str, str | None]]:
    """Run the shared matrix with both throwaway policies registered: {policy: {test id: failure
    message or None}}."""
    report = tmp_path / "matrix.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.policies.throwaway_policy",
                    "-p", "no:cacheprovider", "tests/policies/test_matrix.py", "-k", "oldest or greedy",
                    f"--junit-xml={report}"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    out: dict[str, dict[str, str | None]] = {Oldest.name: {}, Greedy.name: {}}
    for case in ET.parse(report).getroot().iter("testcase"):
        name, failure = case.get("name"), case.find("failure")
        policy = name[name.index("[") + 1:].rstrip("]").split("-")[0]
        out[policy][name] = None if failure is None else failure.get("message", "")
    return out


def test_the_shared_matrix_runs_every_test_on_a_registered_policy_and_catches_a_broken_one(tmp_path):
    results = _matrix_results(tmp_path)
    matrix_tests = {name for name in dir(test_matrix) if name.startswith("test_")}
    assert {test.split("[")[0] for test in results[Oldest.name]} == matrix_tests
    assert [test for test, failure in results[Oldest.name].items() if failure is not None] == []
    failures = [failure for failure in results[Greedy.name].values() if failure is not None]
    assert any("over the budget" in failure for failure in failures), failures
