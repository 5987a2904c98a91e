"""The page-cache hint before a save replaces a file: it never changes the file and ignores a missing one."""

from __future__ import annotations

from pathlib import Path

from fabric.io._page_cache import release_cached_pages


def test_release_keeps_the_file_and_ignores_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"x" * 100_000)
    release_cached_pages(path)
    assert path.read_bytes() == b"x" * 100_000
    release_cached_pages(tmp_path / "missing.pt")
    assert not (tmp_path / "missing.pt").exists()
