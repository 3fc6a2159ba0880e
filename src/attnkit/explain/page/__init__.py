"""The tutorial as one offline page: every stage of the book, step by step, every cell explained.

:func:`tutorial_page` turns an :class:`~attnkit.explain.Explanation` into a
:class:`TutorialPage`: one self-contained HTML file (inline CSS and script, no URL at all)
that walks the book's order (scores for one query, normalisation, context vectors, trainable
W_query/W_key/W_value and the 1/√d_k scaling, the causal mask both ways, dropout, the wrapper's
heads, the fused multi-head with out_proj). ←/→ move between steps, ↑/↓ between query rows,
and clicking or focusing a number shows its computation with its actual operands.

The page is rendered by jinja2 from ``templates/`` (``page.html.j2``, ``page.css``,
``page.js``); the narration and labels come from ``lang/<lang>.json`` (en, ja, pt).

Example:
    >>> from attnkit.explain import tutorial_page
    >>> page = tutorial_page(lang="pt")
    >>> page.save("tutorial.html")  # doctest: +SKIP
    >>> page                        # a notebook shows it inline  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import html
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from markupsafe import Markup, escape

from attnkit._validate import check_choice
from attnkit.examples import YOUR_JOURNEY
from attnkit.explain.core import Explanation, explain
from attnkit.explain.inputs import resolve_sentence_source
from attnkit.explain.page.steps import (
    STEP_IDS,
    build_steps,
    format_number,
    matrices,
    stage_seed,
)
from attnkit.explain.render import find_token

__all__ = ["LANGS", "STEP_IDS", "TutorialPage", "tutorial_page"]

#: The page's languages (the seeds exist in English, Japanese and Portuguese).
LANGS = ("en", "ja", "pt")

#: The steps whose context vectors the book prints, and the class that prints them.
_BOOK_CLASSES = {
    "scaled": "SelfAttention_v2",
    "causal": "CausalAttention",
    "wrapper": "MultiHeadAttentionWrapper",
    "multihead": "MultiHeadAttention",
}

#: Cell kinds whose numbers are attention weights (shaded by value).
_WEIGHT_KINDS = {"softmax", "naive", "zero", "renorm", "drop"}


@functools.cache
def _resource(*parts: str) -> str:
    return resources.files(__name__).joinpath(*parts).read_text(encoding="utf-8")


@functools.cache
def strings(lang: str) -> dict[str, Any]:
    """The narration and labels of ``lang`` (``lang/<lang>.json``)."""
    check_choice(lang, "lang", LANGS)
    data: dict[str, Any] = json.loads(_resource("lang", f"{lang}.json"))
    return data


@functools.cache
def _template() -> Any:
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_resource("templates", "page.html.j2"))


def _short(v: float) -> str:
    s = f"{v:.4f}".rstrip("0").rstrip(".")
    return "0" if s in ("", "-0") else s


class TutorialPage:
    """The step-through page of one :class:`~attnkit.explain.Explanation`.

    Args:
        expl: what :func:`~attnkit.explain.explain` computed (any subset of stages).
        lang: ``"en"``, ``"ja"`` or ``"pt"``.
        query: the token whose row the page opens on (``TOKEN#n`` for a repeated one);
            default: the second token, as the book follows "journey".

    Raises:
        ValueError: unknown ``lang``, or ``query`` not in the sentence.
    """

    def __init__(self, expl: Explanation, *, lang: str = "en", query: str | None = None) -> None:
        self.text = strings(check_choice(lang, "lang", LANGS))
        self.expl = expl
        self.lang = lang
        if query is None:
            self.query = 1 if len(expl.tokens) > 1 else 0
        else:
            self.query = find_token(expl.tokens, query)

    def _params(self) -> dict[str, str]:
        """The numbers the narration names (d_in, d_out, seeds, p, heads, ...)."""
        e, st = self.expl, self.expl.stages
        p = float(e.options.get("dropout", 0.0))
        params = {
            "d_in": str(e.embeddings.shape[1]),
            "d_out": str(e.options.get("d_out", "")),
            "p": f"{p:g}",
            "keep": _short(1 / (1 - p)),
            "heads": str(e.options.get("heads", "")),
            "seed": "",
            "dk": "",
            "wd": "",
            "wout": "",
            "hd": "",
        }
        if "trainable" in st:
            params["seed"] = str(stage_seed(e, "trainable"))
            params["dk"] = str(st["trainable"]["keys"].shape[-1])
        if "multihead" in st:
            h, _, hd = st["multihead"]["context"].shape
            wd = st["multihead"]["wrapper_context"].shape[-1]
            params.update(hd=str(hd), wd=str(wd), wout=str(h * wd))
        return params

    def _narration(self, step_id: str, params: dict[str, str]) -> Markup:
        """The step's paragraph, escaped, with the query as a live ``<span class="qname">``."""
        text = escape(self.text["steps"][step_id]["text"])
        for key, value in params.items():
            text = text.replace("{" + key + "}", escape(value))
        qname = Markup('<span class="qname">{}</span>').format(self.expl.tokens[self.query])
        text = Markup(text.replace("{query}", qname))
        if step_id in _BOOK_CLASSES and self._is_book():
            sep = "" if self.lang == "ja" else " "
            text += sep + escape(self.text["ui"]["book"].format(cls=_BOOK_CLASSES[step_id]))
        return text

    def _is_book(self) -> bool:
        """The book's sentence, embeddings, seeds and sizes: its printed numbers apply."""
        e, o = self.expl, self.expl.options
        return (
            tuple(e.tokens) == YOUR_JOURNEY.tokens
            and torch.equal(e.embeddings, YOUR_JOURNEY.tensor())
            and o.get("seed") is None
            and (o.get("d_out"), o.get("heads")) == (2, 2)
        )

    def data(self) -> dict[str, Any]:
        """What the page embeds: tokens, every matrix, the steps' tables and the UI strings."""
        steps = build_steps(self.expl)
        return {
            "lang": self.lang,
            "tokens": list(self.expl.tokens),
            "query": self.query,
            "m": matrices(self.expl),
            "steps": [
                {
                    "id": s.id,
                    "tables": [
                        {
                            "id": t.id,
                            "kind": t.kind,
                            "matrix": t.matrix,
                            "caption": self._caption(t.caption, t.head),
                            "rows": t.rows,
                            "cols": t.cols,
                            "args": t.args,
                            "head": t.head,
                        }
                        for t in s.tables
                    ],
                }
                for s in steps
            ],
            "t": {"ui": self.text["ui"], "why": self.text["why"]},
        }

    def _caption(self, key: str, head: int | None) -> str:
        caption: str = self.text["captions"][key]
        if head is not None:
            caption = self.text["captions"]["head"].format(h=head + 1, caption=caption)
        return caption

    def to_html(self) -> str:
        """The whole page: one self-contained HTML document."""
        data = self.data()
        m = data["m"]
        params = self._params()
        steps = []
        for step, raw in zip(build_steps(self.expl), data["steps"], strict=True):
            tables = []
            for t, rt in zip(step.tables, raw["tables"], strict=True):
                tables.append(
                    {
                        "id": t.id,
                        "caption": rt["caption"],
                        "kind": t.kind,
                        "matrix": t.matrix,
                        "rows": t.rows,
                        "cols": t.cols,
                        "query_only": t.query_only,
                        "cells": self._cells(t.kind, m[t.matrix], t.style, t.args),
                    }
                )
            steps.append(
                {
                    "id": step.id,
                    "title": self.text["steps"][step.id]["title"],
                    "text": self._narration(step.id, params),
                    "tables": tables,
                }
            )
        source = self._source()
        return _template().render(
            lang=self.lang,
            t=self.text,
            tokens=self.expl.tokens,
            query=self.query,
            source=source,
            steps=steps,
            total=len(steps),
            data=data,
            css=Markup(_resource("templates", "page.css")),
            js=Markup(_resource("templates", "page.js")),
        )

    def _source(self) -> str:
        """Where the embeddings came from, in the page's language."""
        source = str(self.expl.options.get("embeddings", "the seeds' embeddings"))
        if source == "the seeds' embeddings":
            return str(self.text["source"]["seeds"])
        random = re.match(r"random \(seed (-?\d+), width (\d+)\)", source)
        if random:
            return str(self.text["source"]["random"]).format(
                seed=random.group(1), width=random.group(2)
            )
        return source

    def _cells(
        self, kind: str, values: list[list[float | None]], style: str, args: dict[str, Any]
    ) -> list[list[dict[str, Any]]]:
        """Each cell's text (as the book prints it), CSS class and shade."""
        rows = []
        for i, row in enumerate(values):
            cells = []
            for j, v in enumerate(row):
                cls = []
                shade = 0.0
                if v is None or (args.get("causal") and j > i and kind != "context"):
                    cls.append("masked")
                elif kind == "drop" and v == 0.0:
                    cls.append("dropped")
                if kind in _WEIGHT_KINDS and v is not None:
                    shade = max(0.0, min(1.0, v))
                cells.append({"text": format_number(v, style), "cls": " ".join(cls), "w": shade})
            rows.append(cells)
        return rows

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_html` to ``path`` (UTF-8) and return it."""
        path = Path(path)
        path.write_text(self.to_html(), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        """The same page in a notebook: an ``<iframe srcdoc>``, so its script runs there."""
        return (
            f'<iframe srcdoc="{html.escape(self.to_html(), quote=True)}" '
            f'title="{html.escape(self.text["title"])}" sandbox="allow-scripts" '
            'style="width:100%;height:820px;border:1px solid #ccc"></iframe>'
        )


def tutorial_page(
    expl: Explanation | None = None,
    *,
    sentence: str | None = None,
    lang: str = "en",
    query: str | None = None,
) -> TutorialPage:
    """The tutorial page of ``expl``, or of ``sentence`` computed with the book's settings.

    Args:
        expl: an :class:`~attnkit.explain.Explanation`; ``None`` computes one for ``sentence``.
        sentence: used only without ``expl``; ``None`` is the book's "Your journey starts
            with one step" with its embeddings (see :func:`~attnkit.explain.resolve_sentence`).
        lang: ``"en"``, ``"ja"`` or ``"pt"``.
        query: the token the page opens on (default: the second one).

    Raises:
        ValueError: unknown ``lang``, an empty sentence, or ``query`` not in the sentence.
    """
    check_choice(lang, "lang", LANGS)
    if expl is None:
        tokens, x, source = resolve_sentence_source(sentence)
        expl = explain(tokens, x)
        expl.options["embeddings"] = source
    return TutorialPage(expl, lang=lang, query=query)
