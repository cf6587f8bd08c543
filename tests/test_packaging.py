"""The wheel ships the kernels and benchmarks as plain subpackages of vllm_kvcomp (no package-dir
mapping, no build hook), nothing at the top level but ``vllm_kvcomp``, and no CUDA extension on a
CPU build; nothing of ours shadows OpenAI's ``triton`` or ``triton_kernels``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = (
    "vllm_kvcomp/kernels/__init__.py",
    "vllm_kvcomp/kernels/reference.py",
    "vllm_kvcomp/kernels/fixtures.py",
    "vllm_kvcomp/kernels/triton_jit/__init__.py",
    "vllm_kvcomp/kernels/triton_jit/_decode.py",
    "vllm_kvcomp/kernels/triton_jit/_paged.py",
    "vllm_kvcomp/kernels/triton_jit/decode.py",
    "vllm_kvcomp/kernels/triton_jit/utils.py",
    "vllm_kvcomp/bench/__init__.py",
    "vllm_kvcomp/bench/common.py",
    "vllm_kvcomp/bench/engine.py",
    "vllm_kvcomp/bench/kernels.py",
    "vllm_kvcomp/bench/kept.py",
)
GONE = ("vllm_kvcomp/ops.py", "vllm_kvcomp/eval/bench.py")
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


def test_wheel_ships_kernels_and_benchmarks_under_the_package(wheel_files: list[str]) -> None:
    assert [m for m in SHIPPED if m not in wheel_files] == []
    assert [m for m in GONE if m in wheel_files] == []


def test_wheel_has_only_the_vllm_kvcomp_top_level(wheel_files: list[str]) -> None:
    files = [n for n in wheel_files if not n.startswith("top_level:")]
    tops = {n.split("/")[0] for n in files if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"vllm_kvcomp"}
    assert [n.removeprefix("top_level:") for n in wheel_files if n.startswith("top_level:")] == [
        "vllm_kvcomp"
    ]


def test_build_config_has_no_packaging_hack() -> None:
    """packages.find alone lists every package: no package-dir mapping, no custom distclass."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "package-dir" not in config["tool"]["setuptools"]
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["vllm_kvcomp*"]
    setup_py = (ROOT / "setup.py").read_text()
    assert "distclass" not in setup_py and "package_dir" not in setup_py
    assert not (ROOT / "triton_kernels").exists() and not (ROOT / "benchmarks").exists()


def test_sdist_ships_the_cuda_sources(tmp_path: Path) -> None:
    """MANIFEST.in: a CUDA install from the sdist finds every source setup.py compiles."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    hook = "from setuptools import build_meta; print(build_meta.build_sdist('out'))"
    env = {**os.environ, "VLLM_KVCOMP_BUILD_CUDA": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", hook], cwd=src, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with tarfile.open(src / "out" / proc.stdout.split()[-1]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    expected = {"csrc/bindings.cpp", "csrc/decode_attention.cu", "csrc/kvcomp_kernels.h", "csrc/common.cuh"}
    assert {n for n in names if n.startswith("csrc/") and "." in n} == expected
    assert "vllm_kvcomp/kernels/triton_jit/_decode.py" in names


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


@pytest.mark.parametrize("where", ["outside", "repo root"])
def test_kernels_resolve_under_the_package_and_shadow_nothing(tmp_path: Path, where: str) -> None:
    """From any directory, ``triton`` and ``triton_kernels`` are whatever else is installed (or
    nothing), never a folder of this repository, and our Triton kernels resolve under
    vllm_kvcomp/kernels."""
    cwd = tmp_path if where == "outside" else ROOT
    for name in ("triton", "triton_kernels"):
        origin = _find_spec(cwd, name)
        assert origin == "none" or not Path(origin).resolve().is_relative_to(ROOT), name
    ours = Path(_find_spec(cwd, "vllm_kvcomp.kernels.triton_jit"))
    assert ours.parts[-4:] == ("vllm_kvcomp", "kernels", "triton_jit", "__init__.py")
