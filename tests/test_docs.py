"""The documentation site builds with `mkdocs build --strict`, and every page under docs/ is in its nav."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric import STRATEGY_REGISTRY, Fabric

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install torchfabric[docs])")
yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs (pip install torchfabric[docs])")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site once for this module; a warning of any kind (link, anchor, docstring) fails it."""
    out = tmp_path_factory.mktemp("site")
    # The banner Material prints about MkDocs 2 is noise in a failure message, not a build warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--site-dir", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log, log
    return out


def _nav_pages(node: Any) -> Iterator[str]:
    """Every markdown path the nav names, however deeply its sections nest."""
    if isinstance(node, str):
        if node.endswith(".md"):
            yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_pages(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_pages(value)


def _config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _page_text(site: Path, page: str) -> str:
    """The visible text of a built page: tags removed (inline code must not gain spaces), whitespace collapsed."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", raw)).split())


def test_every_docs_page_is_in_the_nav() -> None:
    in_nav = set(_nav_pages(_config()["nav"]))
    on_disk = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert not on_disk - in_nav, f"pages under docs/ that no nav entry reaches: {sorted(on_disk - in_nav)}"
    assert not in_nav - on_disk, f"nav entries without a file under docs/: {sorted(in_nav - on_disk)}"


def test_config_builds_strictly_and_offline() -> None:
    config = _config()
    assert config["strict"] is True
    assert config["docs_dir"] == "docs"
    # Google Fonts would be fetched by every reader's browser and are not needed to build.
    assert config["theme"]["name"] == "material"
    assert config["theme"]["font"] is False


def _built_page(site: Path, page: str) -> Path:
    """Where mkdocs writes a page with directory URLs: a.md -> a/index.html, a/index.md -> a/index.html."""
    stem = page.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        stem = stem.removesuffix("index")
    return site / stem / "index.html"


def test_strict_build_renders_every_page(site: Path) -> None:
    for page in _nav_pages(_config()["nav"]):
        assert _built_page(site, page).is_file(), f"{page} was not built"
    assert "five lines" in _page_text(site, "conversion")


def test_api_reference_shows_the_docstrings(site: Path) -> None:
    text = _page_text(site, "api/fabric")
    for method in (Fabric.setup, Fabric.setup_dataloaders, Fabric.backward, Fabric.all_reduce, Fabric.save):
        # Markdown turns `code` into <code>code</code>; the tags are stripped from the page, the backticks here.
        first_line = (method.__doc__ or "").strip().splitlines()[0].replace("`", "")
        assert first_line in text, f"the API page lacks the docstring of Fabric.{method.__name__}: {first_line!r}"
    assert "DistributedDataParallel" in _page_text(site, "api/strategies")
    assert "CSVLogger" in _page_text(site, "api/loggers")


def test_site_loads_nothing_from_font_services(site: Path) -> None:
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text, page


def test_strategy_overview_names_every_registered_strategy() -> None:
    overview = (DOCS / "strategies" / "index.md").read_text()
    missing = [name for name in STRATEGY_REGISTRY.names() if f"`{name}`" not in overview]
    assert not missing, f"docs/strategies/index.md does not list the registered strategies {missing}"
