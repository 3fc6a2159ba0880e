"""What every self-contained HTML view shares: a fragment, the page around it, Jupyter's
inline display and saving to a file."""

from __future__ import annotations

import html
from pathlib import Path


class HtmlPage:
    """A view drawn as one HTML fragment (``fragment()``) with no outside resource.

    Subclasses set ``title`` and implement :meth:`fragment`; ``MARGIN`` is the page's
    margin in pixels.
    """

    title: str
    MARGIN = 8

    def fragment(self) -> str:
        """The view's HTML, styles and script inline (what a notebook shows)."""
        raise NotImplementedError

    def to_html(self) -> str:
        """A complete, self-contained HTML page."""
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(self.title)}</title></head>"
            f'<body style="margin:{self.MARGIN}px;background:#fff">{self.fragment()}'
            "</body></html>\n"
        )

    def _repr_html_(self) -> str:
        return self.fragment()

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_html` to ``path`` and return it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_html(), encoding="utf-8")
        return path
