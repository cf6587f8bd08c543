"""What scripts/container_smoke.sh proves on the CPU image holds for the GPU image and the chart.

The smoke script builds deploy/docker/Dockerfile.cpu, runs it and checks the entrypoint, the
port, the health endpoint and the non-root user of the running container (its constants at the
top). These tests read those constants, the Dockerfiles and the chart as Helm renders it, and
check that all of them agree, so a Deployment runs the image the way the smoke test ran it; and
that the committed report (docs/results/container_smoke.txt) is a complete passing run. Whether
the image files changed since that run is no CI failure (a run takes up to 15 minutes): it is a
warning here, and the live run, the ``slow`` test at the end, checks the digest it records
(docs/deploy.md: when to run it).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import warnings
from pathlib import Path

import pytest

from tests.deploy.test_dockerfiles import (
    DOCKER,
    DOCKERFILES,
    arg_default,
    final_stage,
    instructions,
)

try:
    import helm_python as helm
except ImportError as err:  # dev extra: helm-python-sdk
    pytest.fail(f"{err.name} missing: pip install helm-python-sdk", pytrace=False)

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "scripts" / "container_smoke.sh"
CHART = ROOT / "deploy" / "helm" / "vllm-kvcomp"
RESULTS = ROOT / "docs" / "results" / "container_smoke.txt"


def smoke_constants() -> dict[str, str | list[str]]:
    """The ``readonly NAME=value`` / ``readonly NAME=(a b)`` lines of the smoke script."""
    out: dict[str, str | list[str]] = {}
    for line in SMOKE.read_text().splitlines():
        match = re.fullmatch(r"readonly ([A-Z_]+)=(.*?)(\s+#.*)?", line)
        if not match or "$" in match.group(2):
            continue
        value = match.group(2)
        if value.startswith("(") and value.endswith(")"):
            out[match.group(1)] = shlex.split(value[1:-1])
        else:
            (out[match.group(1)],) = shlex.split(value)
    return out


SMOKE_CONSTANTS = smoke_constants()


def const(name: str) -> str:
    value = SMOKE_CONSTANTS[name]
    assert isinstance(value, str), name
    return value


@pytest.fixture(scope="module")
def deployment() -> dict:
    """The chart's Deployment with default values and with the CPU image's values."""
    import yaml

    with helm.Chart.load(CHART) as chart:
        rendered = {
            scenario: chart.render(values, name="demo", namespace="ml")
            for scenario, values in {
                "defaults": {},
                "cpu": {"gpu": {"count": 0}, "tolerations": [], "image": {"tag": "0.1.0-cpu"}},
            }.items()
        }
    out = {}
    for scenario, files in rendered.items():
        docs = [d for d in yaml.safe_load_all(files["vllm-kvcomp/templates/deployment.yaml"]) if d]
        (out[scenario],) = [d for d in docs if d["kind"] == "Deployment"]
    return out


def server_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_smoke_script_declares_what_it_checks():
    assert set(SMOKE_CONSTANTS) >= {"SERVE_COMMAND", "CONTAINER_PORT", "HEALTH_PATH", "POLICIES",
                                    "DOCKERFILE", "SHM_SIZE"}
    assert const("HEALTH_PATH").startswith("/") and const("CONTAINER_PORT").isdigit()
    assert SMOKE_CONSTANTS["POLICIES"] == ["policy=lagkv; ratio=0.25", "policy=razor; ratio=0.5"]
    assert const("DOCKERFILE") == "deploy/docker/Dockerfile.cpu"
    text = SMOKE.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    assert "trap cleanup EXIT" in text


@pytest.mark.parametrize("scenario", ["defaults", "cpu"])
def test_chart_runs_the_entrypoint_the_smoke_test_ran(deployment, scenario):
    command = const("SERVE_COMMAND").split()
    assert server_container(deployment[scenario])["command"] == command
    for dockerfile in DOCKERFILES:
        assert json.loads(dict(final_stage(dockerfile))["ENTRYPOINT"]) == command, dockerfile.name


@pytest.mark.parametrize("scenario", ["defaults", "cpu"])
def test_chart_probes_the_health_endpoint_and_port_the_smoke_test_used(deployment, scenario):
    container = server_container(deployment[scenario])
    port, health = int(const("CONTAINER_PORT")), const("HEALTH_PATH")
    (http,) = container["ports"]
    assert http["containerPort"] == port and http["name"] == "http"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": health, "port": "http"}, probe
    args = container["args"]
    assert args[args.index("--port") + 1] == str(port) and args[args.index("--host") + 1] == "0.0.0.0"
    for dockerfile in DOCKERFILES:
        stage = final_stage(dockerfile)
        assert dict(stage)["EXPOSE"] == str(port), dockerfile.name
        (check,) = [rest for word, rest in stage if word == "HEALTHCHECK"]
        assert f"http://127.0.0.1:{port}{health}'" in check, dockerfile.name


def test_chart_args_match_the_cpu_image_command(deployment):
    """The chart replaces the image's CMD: host and port as the smoke test served them."""
    cmd = json.loads(dict(final_stage(DOCKER / "Dockerfile.cpu"))["CMD"])
    args = server_container(deployment["cpu"])["args"]
    for flag in ("--host", "--port"):
        assert args[args.index(flag) + 1] == cmd[cmd.index(flag) + 1], flag
    assert cmd[cmd.index("--port") + 1] == const("CONTAINER_PORT")


@pytest.mark.parametrize("scenario", ["defaults", "cpu"])
def test_chart_runs_as_the_images_non_root_user(deployment, scenario):
    pod = deployment[scenario]["spec"]["template"]["spec"]["securityContext"]
    for dockerfile in DOCKERFILES:
        uid = int(arg_default(dockerfile, "KVCOMP_UID"))
        users = [rest for word, rest in final_stage(dockerfile) if word == "USER"]
        assert users == ["${KVCOMP_UID}:${KVCOMP_UID}"], dockerfile.name
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid != 0
        assert pod["runAsGroup"] == uid and pod["fsGroup"] == uid


def gibibytes(quantity: str) -> float:
    """``1g`` (podman/docker --shm-size) or ``8Gi`` / ``512Mi`` (Kubernetes) in GiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG])i?[bB]?", quantity)
    assert match, quantity
    return float(match.group(1)) * {"k": 2**-20, "m": 2**-10, "g": 1}[match.group(2).lower()]


@pytest.mark.parametrize("scenario", ["defaults", "cpu"])
def test_chart_gives_at_least_the_shared_memory_the_smoke_test_needed(deployment, scenario):
    pod = deployment[scenario]["spec"]["template"]["spec"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert gibibytes(shm["emptyDir"]["sizeLimit"]) >= gibibytes(const("SHM_SIZE"))
    mounts = {m["mountPath"]: m["name"] for m in server_container(deployment[scenario])["volumeMounts"]}
    assert mounts["/dev/shm"] == "shm"


def test_gibibytes_parses_both_notations():
    assert gibibytes("1g") == 1 and gibibytes("8Gi") == 8 and gibibytes("512Mi") == 0.5
    with pytest.raises(AssertionError):
        gibibytes("lots")


def test_smoke_script_changes_only_build_arguments():
    """The script builds the Dockerfile as it is: every --build-arg it passes is a declared ARG."""
    text = SMOKE.read_text()
    passed = set(re.findall(r'--build-arg "([A-Z_]+)=', text))
    passed |= set(re.findall(r'args\["([A-Z_]+)"\]', text))
    passed |= set(re.findall(r'\("[a-z-]+", "(PIP_[A-Z_]+)"\)', text))
    passed |= set(re.findall(r'\{"(PIP_[A-Z_]+)":', text))
    assert passed >= {"PYTHON_IMAGE", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
                      "PIP_CERT", "TORCH_INDEX"}
    dockerfile = ROOT / const("DOCKERFILE")
    declared = {rest.split("=", 1)[0] for word, rest in instructions(dockerfile) if word == "ARG"}
    assert passed <= declared, passed - declared
    assert re.search(r'build_flags=\(-f "\$DOCKERFILE" -t "\$IMAGE"', text)


def inputs_digest() -> str:
    """What ``inputs_digest`` in the smoke script prints: sha256 over ``sha256sum`` of its inputs."""
    paths = [p.relative_to(ROOT).as_posix() for p in (ROOT / "deploy" / "docker").rglob("*") if p.is_file()]
    paths += [".dockerignore", "scripts/container_smoke.sh"]
    listing = "".join(f"{hashlib.sha256((ROOT / p).read_bytes()).hexdigest()}  {p}\n" for p in sorted(paths))
    return hashlib.sha256(listing.encode()).hexdigest()


def test_inputs_digest_matches_sha256sum():
    listing = subprocess.run(
        "{ find deploy/docker -type f; echo .dockerignore; echo scripts/container_smoke.sh; }"
        " | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum",
        shell=True, cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert listing.split()[0] == inputs_digest()


def recorded_digest(report: str) -> str:
    """The inputs digest in a smoke report's summary."""
    recorded = re.search(r"^  inputs: +sha256 ([0-9a-f]{64}) ", report, re.M)
    assert recorded, "the report records no inputs digest"
    return recorded.group(1)


def check_smoke_report(report: str, current_digest: str) -> None:
    """A smoke report went through every step and passed: each request it sent answered HTTP 200
    with its policy applied, and its summary records the inputs digest. Made from other image
    files than ``current_digest`` says: a warning, not a failure."""
    assert report.rstrip().endswith("RESULT: PASS"), "the smoke run did not pass"
    steps = [int(n) for n, total in re.findall(r"^\[(\d+)/(\d+)\] ", report, re.M) if total == "10"]
    assert steps == list(range(1, 11)), f"steps run: {steps}"
    answers = re.findall(r"^  (policy=(\w+);.*) -> HTTP (\d+), X-KV-Compression-Applied: policy=(\w+);",
                         report, re.M)
    assert answers, "the report lists no request"
    for spec, asked, status, applied in answers:
        assert (status, applied) == ("200", asked), spec
    for needed in ("build time:", "image size:", "whole run:"):
        assert needed in report
    if recorded_digest(report) != current_digest:
        warnings.warn("deploy/docker, .dockerignore or scripts/container_smoke.sh changed since the committed "
                      "smoke run: bash scripts/container_smoke.sh --no-cache --report "
                      "docs/results/container_smoke.txt", stacklevel=1)


def test_committed_smoke_report_is_a_complete_passing_run():
    check_smoke_report(RESULTS.read_text(), inputs_digest())


def test_a_changed_image_file_warns_and_a_failed_run_fails():
    report = RESULTS.read_text()
    with pytest.warns(UserWarning, match="changed since the committed smoke run"):
        check_smoke_report(report, "0" * 64)
    with pytest.raises(AssertionError, match="did not pass"):
        check_smoke_report(report.replace("RESULT: PASS", "RESULT: FAIL"), inputs_digest())
    refused = report.replace("-> HTTP 200, X-KV-Compression-Applied: policy=razor", "-> HTTP 500, "
                             "X-KV-Compression-Applied: policy=razor")
    with pytest.raises(AssertionError, match="razor"):
        check_smoke_report(refused, inputs_digest())


@pytest.mark.slow
def test_container_smoke_script_passes(tmp_path):
    """Builds and runs the CPU image with podman: 2-3 min with the layer cache, 6-15 min on a
    fresh machine, so not in CI (docs/deploy.md, "Container smoke test")."""
    report = tmp_path / "container_smoke.txt"
    result = subprocess.run(["bash", str(SMOKE), "--report", str(report)], cwd=ROOT, text=True,
                            capture_output=True, timeout=3600, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    text = report.read_text()
    assert text.rstrip().endswith("RESULT: PASS")
    assert text.count("X-KV-Compression-Applied: ") >= 2 * len(SMOKE_CONSTANTS["POLICIES"])
    assert recorded_digest(text) == inputs_digest(), "the script's digest is not inputs_digest() of the files"
