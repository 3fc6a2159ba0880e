"""A real headless Chromium for the HTML tests: Debian's `chromium`, driven by Playwright.

Playwright's Python package talks to the system browser through `executable_path`, so no
browser is downloaded. `open_page(path)` loads a local file and records what a test must
check on every page: console errors, uncaught exceptions and every request to anything that
is not the file itself (a self-contained page makes none).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")


@dataclass
class Opened:
    """A loaded page and what it did while a test drove it."""

    page: Any
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def assert_clean(self) -> None:
        """No console error, no uncaught exception, no request beyond the page's own file."""
        assert self.errors == [], self.errors
        assert self.requests == [], self.requests


@contextmanager
def open_page(path: Path, *, width: int = 1280, height: int = 900) -> Iterator[Opened]:
    """Opens `path` in headless Chromium; yields an `Opened` (its `.page` is Playwright's)."""
    from playwright.sync_api import sync_playwright

    url = path.resolve().as_uri()
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            opened = Opened(page)
            page.on(
                "console",
                lambda m: opened.errors.append(m.text) if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: opened.errors.append(str(e)))
            page.on(
                "request",
                lambda r: opened.requests.append(r.url) if r.url != url else None,
            )
            page.goto(url)
            yield opened
        finally:
            browser.close()
