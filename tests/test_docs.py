"""The documentation site builds with warnings as errors (``mkdocs build --strict``, as
``make docs`` runs it), offline, and its API reference is generated from the docstrings."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_docs_tools() -> list[str]:
    missing = []
    for name in DOCS_TOOLS:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


pytestmark = pytest.mark.skipif(
    bool(_missing_docs_tools()),
    reason=f"the docs tools are not installed ({', '.join(_missing_docs_tools())}; "
    "they come with the dev extra: pip install -e '.[dev]')",
)


def test_the_docs_build_strict_and_document_the_api(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # no proxy that could reach anything: the build must not need the network
    env.update({"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"})
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "attnkit" in index
    assert "fonts.googleapis.com" not in index  # theme.font: false, nothing fetched by readers
    api = (site / "api.html").read_text(encoding="utf-8")
    for name in ("attnkit.attention.attention", "attnkit.masks.document", "attnkit.models.GPT"):
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
    for page in ("tutorial", "attention", "performance", "llm", "ecosystem", "distributed"):
        assert (site / f"{page}.html").is_file()
    # the engineering notes moved verbatim from the README
    performance = (site / "performance.html").read_text(encoding="utf-8")
    assert "The native kernel on every CPU" in performance


def test_every_docs_page_is_in_the_nav() -> None:
    """A page left out of ``nav`` is a warning (``validation.omitted_files``), so --strict
    catches it; this names the page."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert rel in nav, f"docs/{rel} is not in mkdocs.yml's nav"
