"""examples/tutorial.ipynb runs top to bottom in a fresh kernel (nbclient), offline, and shows
the book's numbers and the tutorial page inline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "tutorial.ipynb"


def test_tutorial_notebook_runs_and_shows_the_page(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # the kernel imports this checkout's attnkit, as the tests do
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    texts, htmls = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error"
            texts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            htmls.append(out.get("data", {}).get("text/html", ""))
    text = "\n".join(texts)
    # the book's numbers: "journey"'s scores and context, V2 (seed 789), causal and MHA (seed 123)
    for number in ("1.0865", "0.4419", "0.6515", "-0.0739", "-0.4519", "0.4772", "0.3190"):
        assert number in text, number
    pages = [h for h in htmls if h.startswith("<iframe srcdoc=")]
    assert len(pages) == 2 and "lang=&quot;pt&quot;" in pages[1]
    assert (tmp_path / "tutorial-pt.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
