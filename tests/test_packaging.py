"""The wheel ships our kernels as vllm_kvcomp.triton_kernels and never a top-level
``triton_kernels`` (vLLM imports OpenAI's package of that name), and we do not shadow it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("__init__.py", "_paged.py", "compaction.py", "decode.py", "window.py", "lagkv.py")
IGNORE = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "results",
    ".whl",
    ".venv*",
    "tests",
    "deploy",
    "benchmarks",
    "docs",
)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """File list of a wheel built from a copy of the checkout (CUDA extension off)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    env = {**os.environ, "VLLM_KVCOMP_BUILD_CUDA": "0", "PIP_NO_INPUT": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "out"),
        ],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp / "out").glob("vllm_kvcomp-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        return [*names, *(f"top_level:{t}" for t in zf.read(top_level).decode().split())]


def test_wheel_ships_kernels_under_the_package(wheel_files: list[str]) -> None:
    for module in KERNEL_MODULES:
        assert f"vllm_kvcomp/triton_kernels/{module}" in wheel_files
    assert "vllm_kvcomp/ops.py" in wheel_files


def test_wheel_has_no_top_level_triton_kernels(wheel_files: list[str]) -> None:
    assert not [n for n in wheel_files if n.split("/")[0] == "triton_kernels"]
    assert [n.removeprefix("top_level:") for n in wheel_files if n.startswith("top_level:")] == [
        "vllm_kvcomp"
    ]


def test_cpu_wheel_has_no_extension(wheel_files: list[str]) -> None:
    assert not [n for n in wheel_files if n.endswith((".so", ".pyd"))]


def _find_spec(cwd: Path, name: str) -> str:
    """``importlib.util.find_spec(name)`` in a fresh interpreter started in ``cwd``."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.find_spec({name!r})\n"
        "print('none' if spec is None else (spec.origin or spec.submodule_search_locations[0]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_installed_package_does_not_provide_top_level_triton_kernels(tmp_path: Path) -> None:
    """Outside the checkout, ``triton_kernels`` is whatever else is installed (or nothing), and
    our kernels resolve under vllm_kvcomp."""
    origin = _find_spec(tmp_path, "triton_kernels")
    assert origin == "none" or not Path(origin).resolve().is_relative_to(ROOT)
    ours = _find_spec(tmp_path, "vllm_kvcomp.triton_kernels")
    assert ours != "none" and Path(ours).name == "__init__.py"


def test_repo_root_folder_refuses_the_top_level_name() -> None:
    """Run from the repository root the folder is on sys.path; importing it as ``triton_kernels``
    fails (so vLLM falls back to its own copy) unless another installation comes first."""
    code = "import triton_kernels, pathlib; print(pathlib.Path(triton_kernels.__file__).resolve())"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if proc.returncode == 0:
        assert not Path(proc.stdout.strip()).is_relative_to(ROOT)
    else:
        assert "vllm_kvcomp.triton_kernels" in proc.stderr and "ImportError" in proc.stderr
