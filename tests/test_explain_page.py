"""attnkit.explain.page: the offline step-through of the tutorial.

The numbers on the page are the book's (in every language), the page is one self-contained
file, and in a real headless Chromium it walks every step by keyboard, every cell explains
itself, it makes no request and logs no error, and axe-core finds no violation.
"""

from __future__ import annotations

import html
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from attnkit.cli import main
from attnkit.examples import HELLO_SHINY_SUN, YOUR_JOURNEY
from attnkit.explain import LANGS, explain, render, tutorial_page
from attnkit.explain.page import STEP_IDS
from attnkit.explain.page.steps import format_number
from tests.browser import needs_browser, open_page
from tests.test_modules import (
    BOOK_CAUSAL_SEED123,
    BOOK_MHA_SEED123,
    BOOK_V2_SEED789,
    BOOK_WRAPPER_SEED123,
)

# The book's "journey" row (chapter 3), as tests/test_modules.py checks the modules.
JOURNEY_SCORES = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
JOURNEY_NAIVE = [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]
JOURNEY_WEIGHTS = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
JOURNEY_CONTEXT = [0.4419, 0.6515, 0.5683]
SHINY_CONTEXT = [0.3990, 0.3854, 0.8610]


def _book(values: list[float]) -> list[str]:
    """The book's numbers as the page writes them (4 decimals, a real minus sign)."""
    return [f"{v:.4f}".replace("-", "\u2212") for v in values]


class _Tables(HTMLParser):
    """Every table of the page: ``id -> rows of cell texts`` (the numbers a learner sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.data_json = ""
        self._table: str | None = None
        self._in_button = False
        self._in_data = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("data-table"):
            self._table = a["data-table"]
            self.tables[self._table] = []
        elif tag == "tr" and self._table and "data-i" in a:
            self.tables[self._table].append([])
        elif tag == "button" and self._table and a.get("class") == "cell":
            self._in_button = True
            self.tables[self._table][-1].append("")
        elif tag == "script" and a.get("id") == "akdata":
            self._in_data = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = None
        elif tag == "button":
            self._in_button = False
        elif tag == "script":
            self._in_data = False

    def handle_data(self, data: str) -> None:
        if self._in_button and self._table:
            self.tables[self._table][-1][-1] += data
        elif self._in_data:
            self.data_json += data


def _parse(page_html: str) -> _Tables:
    parser = _Tables()
    parser.feed(page_html)
    return parser


@pytest.mark.parametrize("lang", LANGS)
def test_every_number_is_the_books_in_every_language(lang):
    html_text = tutorial_page(lang=lang).to_html()
    parsed = _parse(html_text)
    t = parsed.tables
    assert t["scores-omega"][1] == _book(JOURNEY_SCORES)
    assert t["normalize-naive"][1] == _book(JOURNEY_NAIVE)
    assert t["normalize-softmax"][1] == _book(JOURNEY_WEIGHTS)
    assert t["context-weights"][1] == _book(JOURNEY_WEIGHTS)
    assert t["context-z"][1] == _book(JOURNEY_CONTEXT)
    assert t["scaled-z"] == [_book(r) for r in BOOK_V2_SEED789]
    assert t["causal-z"] == [_book(r) for r in BOOK_CAUSAL_SEED123]
    assert t["wrapper-out"] == [_book(r) for r in BOOK_WRAPPER_SEED123]
    assert t["multihead-out"] == [_book(r) for r in BOOK_MHA_SEED123]
    # both ways of the causal mask give the same weights; the inputs are the book's as written
    assert t["renormalize-renorm"] == t["causal-weights"]
    assert t["scores-x"][1] == ["0.55", "0.87", "0.66"]
    # every number shown is the embedded one, which is explain()'s
    data = json.loads(parsed.data_json)
    expl = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor())
    for name in ("multihead.output", "causal.weights", "trainable.W_query"):
        stage, key = name.split(".")
        torch.testing.assert_close(torch.tensor(data["m"][name]), expl.stages[stage][key])
    shown = 0
    for step in data["steps"]:
        for table in step["tables"]:
            style = "input" if table["matrix"] == "x" else "value"
            want = [[format_number(v, style) for v in row] for row in data["m"][table["matrix"]]]
            assert t[table["id"]] == want, table["id"]
            shown += sum(len(r) for r in want)
    assert shown > 500
    assert [s["id"] for s in data["steps"]] == list(STEP_IDS)
    assert html_text.count("MultiHeadAttentionWrapper") >= 1  # "the book prints these" notes


def test_hello_shiny_sun_page_and_query():
    page = tutorial_page(sentence="Hello shiny sun!", lang="pt", query="shiny")
    parsed = _parse(page.to_html())
    assert parsed.tables["context-z"][1] == _book(SHINY_CONTEXT)
    assert "MultiHeadAttentionWrapper" not in page.to_html()  # not the book's numbers there
    assert json.loads(parsed.data_json)["query"] == 1
    with pytest.raises(ValueError, match="token 'moon' is not in the sentence"):
        tutorial_page(sentence="Hello shiny sun!", query="moon")


def test_page_is_self_contained_and_notebook_shows_it():
    page = tutorial_page(lang="ja")
    text = page.to_html()
    assert '<html lang="ja">' in text and "ステップ" in text
    for needle in ("http://", "https://", "//cdn", " src=", "<link", "@import", "url("):
        assert needle not in text, needle
    assert "</script>" not in text.split('id="akdata">', 1)[1].split("</script>", 1)[0]
    # the notebook gets the same page in an iframe, so its script runs there
    shown = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor())._repr_html_()
    match = re.fullmatch(r'<iframe srcdoc="([^"]*)".*</iframe>', shown, flags=re.S)
    assert match is not None and 'sandbox="allow-scripts"' in shown
    assert html.unescape(match.group(1)) == tutorial_page().to_html()
    assert page._repr_html_().startswith("<iframe srcdoc=")


def test_tokens_are_escaped_and_any_head_count_works():
    x = torch.rand(4, 5)
    expl = explain(["</script>", "a&b", "<i>", "x"], x, d_out=6, heads=3, dropout=0.25, seed=3)
    text = tutorial_page(expl, lang="ja", query="x").to_html()
    assert text.count("<script") == 2 and "<i>" not in text  # only the page's own two
    parsed = _parse(text)
    assert parsed.tables["scores-x"][0] == [format_number(v, "input") for v in x[0].tolist()]
    data = json.loads(parsed.data_json)
    assert data["tokens"][0] == "</script>" and data["query"] == 3
    assert sum(t["id"].startswith("multihead-h") for s in data["steps"] for t in s["tables"]) == 6


def test_some_stages_only_and_bad_language():
    expl = explain(HELLO_SHINY_SUN.tokens, HELLO_SHINY_SUN.tensor(), stages=["simplified"])
    data = json.loads(_parse(render(expl, fmt="html")).data_json)
    assert [s["id"] for s in data["steps"]] == ["scores", "normalize", "context"]
    with pytest.raises(ValueError, match="lang must be one of 'en', 'ja', 'pt'; got 'fr'"):
        render(expl, fmt="html", lang="fr")
    with pytest.raises(ValueError, match="lang must be one of"):
        tutorial_page(lang="EN")


def test_cli_writes_the_page_and_refuses_an_unknown_language(capsys):
    assert main(["explain", "--format", "html", "--lang", "pt"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == tutorial_page(lang="pt").to_html().rstrip("\n")
    assert main(["explain", "--format", "html", "--lang", "fr"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "unknown --lang 'fr'; choose from en, ja, pt" in err


# --- in a real browser ---------------------------------------------------------------------

_STEP_TITLE = {  # a few words of each step's English title, in the book's order
    "scores": "Attention scores for one query",
    "normalize": "From scores to attention weights",
    "context": "Context vectors for every token",
    "qkv": "Trainable weights",
    "scaled": "Scaled dot-product attention",
    "causal": "Causal attention",
    "renormalize": "after the softmax",
    "dropout": "Dropout",
    "wrapper": "a wrapper of heads",
    "multihead": "out_proj",
}


def _non_blank(png: bytes) -> float:
    """Pixel standard deviation of a screenshot (a blank page is ~0)."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64)
    return float(pixels.std())


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tutorial")
    return {lang: tutorial_page(lang=lang).save(folder / f"{lang}.html") for lang in LANGS}


@needs_browser
def test_keyboard_walks_every_step_with_a_screenshot_each(pages, tmp_path):
    with open_page(pages["en"]) as opened:
        page = opened.page
        visible = "section.step:not([hidden])"
        for k, (step, title) in enumerate(_STEP_TITLE.items()):
            if k:
                page.keyboard.press("ArrowRight")
            assert page.get_attribute(visible, "data-step") == step
            assert title in page.inner_text(f"{visible} h2")
            assert page.inner_text("#counter") == f"Step {k + 1} of {len(_STEP_TITLE)}"
            png = page.screenshot(path=str(tmp_path / f"step-{k + 1}.png"))
            assert _non_blank(png) > 20, step
        page.keyboard.press("ArrowRight")  # past the last step: stays
        assert page.get_attribute(visible, "data-step") == "multihead"
        assert page.is_disabled("#next")
        for _ in _STEP_TITLE:
            page.keyboard.press("ArrowLeft")
        assert page.get_attribute(visible, "data-step") == "scores"
        # up/down move the query row; step 1 shows that row's scores only
        assert page.inner_text(f"{visible} .qname") == "journey"
        page.keyboard.press("ArrowDown")
        page.keyboard.press("ArrowDown")
        assert page.inner_text(f"{visible} .qname") == "with"
        rows = page.locator(f"{visible} table[data-table=scores-omega] tbody tr:not([hidden])")
        assert rows.count() == 1 and rows.first.get_attribute("data-i") == "3"
        page.keyboard.press("ArrowUp")
        assert page.input_value("#query") == "2"
        opened.assert_clean()


@needs_browser
def test_every_cell_of_every_stage_explains_itself(pages):
    with open_page(pages["en"]) as opened:
        page = opened.page
        why = "#why-body"
        # a click shows the book's notation with the actual operands
        page.click("table[data-table=scores-omega] tr[data-i='1'] td:nth-child(7) button")
        assert (
            "ω(journey, step) = x(journey)·x(step) = 0.55·0.05 + 0.87·0.80 + 0.66·0.55 = 1.0865"
        ) in page.inner_text(why)
        outlined = page.locator("table[data-table=scores-x] tr:has(td.src)")
        assert outlined.count() == 2  # the operands: x(journey) and x(step)
        assert [outlined.nth(k).get_attribute("data-i") for k in range(2)] == ["1", "5"]
        page.keyboard.press("ArrowRight")
        page.click("table[data-table=normalize-softmax] tr[data-i='1'] td:nth-child(7) button")
        text = page.inner_text(why)
        assert "= 2.9639 / 18.7453 = 0.1581" in text and "x(step) = [0.05, 0.80, 0.55]" in text
        for _ in range(4):
            page.keyboard.press("ArrowRight")
        # a masked cell says why; Tab reaches cells and focusing one explains it
        page.click("table[data-table=causal-scores] tr[data-i='1'] td:nth-child(5) button")
        assert "“with” comes after “journey”" in page.inner_text(why)
        page.keyboard.press("Tab")
        assert page.get_attribute(why, "data-cell") == "causal-scores:1:4"
        page.click("table[data-table=causal-z] tr[data-i='0'] td:nth-child(2) button")
        assert "1.0000·(−0.4519) = −0.4519" in page.inner_text(why)
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        page.click("table[data-table=dropout-after] tr[data-i='1'] td:nth-child(2) button")
        assert "dropped: dropout zeroed this weight in training (p = 0.5)" in page.inner_text(why)
        page.click("table[data-table=dropout-after] tr[data-i='0'] td:nth-child(2) button")
        assert "1.0000 · 1/(1−0.5) = 1.0000 · 2.0000 = 2.0000" in page.inner_text(why)
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        page.click("table[data-table=multihead-out] tr[data-i='0'] td:nth-child(2) button")
        assert re.search(r"y\(Your\)\[1\] = .* \+ .* = 0\.3190", page.inner_text(why))
        # every cell, on every step: its explanation ends in the number it explains
        result = page.evaluate(
            """() => {
                const bad = [];
                const cells = document.querySelectorAll('button.cell');
                cells.forEach((b) => {
                    b.click();
                    const text = document.getElementById('why-body').textContent;
                    if (!text.includes(b.textContent)) bad.push(
                        b.closest('table').dataset.table + ' ' + b.textContent);
                });
                return [cells.length, bad];
            }"""
        )
        count, bad = result
        assert count > 500 and bad == []
        opened.assert_clean()


@needs_browser
@pytest.mark.parametrize(
    ("lang", "steps"),
    [("en", ("scores", "causal")), ("ja", ("dropout",)), ("pt", ("multihead",))],
)
def test_axe_finds_no_accessibility_violation(pages, lang, steps):
    from axe_playwright_python.sync_playwright import Axe

    axe = Axe()
    with open_page(pages[lang]) as opened:
        page = opened.page
        for step in steps:  # with a cell's explanation open
            while page.get_attribute("section.step:not([hidden])", "data-step") != step:
                page.keyboard.press("ArrowRight")
            page.locator("section.step:not([hidden]) button.cell").nth(3).click()
            result = axe.run(page)
            assert result.violations_count == 0, result.generate_report()
            assert len(result.response["passes"]) > 20  # axe did check the page
        opened.assert_clean()
