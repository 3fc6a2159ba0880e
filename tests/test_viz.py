"""attnkit.viz: loaders, PNG/SVG pictures and the offline HTML view (in headless Chromium)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from attnkit import MultiHeadAttention, trace, viz
from attnkit.examples import YOUR_JOURNEY
from attnkit.explain import explain, render

TOKENS = ["the", "cat", "sat", "on", "mat"]


def _hf_attentions(layers: int = 2, heads: int = 3) -> tuple[torch.Tensor, ...]:
    """What ``outputs.attentions`` looks like: one (batch, heads, q, k) per layer."""
    return tuple(torch.softmax(torch.randn(2, heads, 5, 5) * 3, dim=-1) for _ in range(layers))


def test_loaders_agree_across_formats(tmp_path):
    att = _hf_attentions()
    torch.save(att, tmp_path / "a.pt")
    np.savez(tmp_path / "a.npz", *[a.numpy() for a in att])
    from safetensors.torch import save_file

    save_file({f"layer_{i}": a for i, a in enumerate(att)}, tmp_path / "a.safetensors")
    for name in ("a.pt", "a.npz", "a.safetensors"):
        maps = viz.load_attentions(tmp_path / name, TOKENS, batch_index=1)
        assert len(maps.weights) == 2, name
        torch.testing.assert_close(maps.weights[1], att[1][1])
    with pytest.raises(ValueError, match="no token labels"):
        viz.load_attentions(tmp_path / "a.pt")
    with pytest.raises(ValueError, match="need 5 tokens, got 2"):
        viz.load_attentions(tmp_path / "a.pt", ["a", "b"])
    with pytest.raises(ValueError, match="batch_index 7"):
        viz.load_attentions(tmp_path / "a.pt", TOKENS, batch_index=7)


def test_load_explain_json_and_trace_recording(tmp_path):
    e = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor())
    (tmp_path / "run.json").write_text(render(e, fmt="json"))
    maps = viz.load_attentions(tmp_path / "run.json")
    assert maps.names == list(e.stages) and maps.tokens == list(YOUR_JOURNEY.tokens)
    torch.testing.assert_close(maps.weights[4], e.stages["multihead"]["weights"])
    with trace.record() as rec:
        MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)(torch.rand(1, 5, 3))
    torch.save(dict(rec), tmp_path / "trace.pt")
    maps = viz.load_attentions(tmp_path / "trace.pt", TOKENS)
    assert maps.names == ["weights"]
    torch.testing.assert_close(maps.weights[0], rec["weights"][0])


def test_png_and_svg_are_written_with_one_panel_per_head(tmp_path):
    import matplotlib.image as mpimg

    maps = viz.from_hf(_hf_attentions(heads=6), TOKENS)
    png = viz.plot_attention(maps, tmp_path / "m.png", layer=1)
    img = mpimg.imread(png)[..., :3]  # (H, W, 3)
    assert img.shape[0] > 200 and img.std() > 0.05  # not blank
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50
    svg = viz.plot_attention(maps, tmp_path / "m.svg", layer=0).read_text()
    assert svg.count("<image") == 6 + 1  # one heatmap per head + the colour bar
    assert "head 5" in svg and "layer 0" in svg and "attention weight" in svg
    assert all(t in svg for t in TOKENS)
    with pytest.raises(ValueError, match="not supported"):
        viz.plot_attention(maps, tmp_path / "m.jpg")


def test_html_is_self_contained_and_views_are_independent():
    maps = viz.from_hf(_hf_attentions(), TOKENS)
    a, b = viz.AttentionView(maps), viz.AttentionView(maps)
    page = a.to_html()
    assert "<script" in page and "<style>" in page
    assert not re.search(r"https?://|<script[^>]+src|<link", page)  # nothing fetched
    assert a.element_id != b.element_id and a.element_id in a._repr_html_()
    data = json.loads(re.search(r"const root=.*?data=(\{.*?\}), stops", page).group(1))
    assert data["tokens"] == TOKENS and len(data["layers"]) == 2
    assert data["layers"][1]["weights"][2][0][0] == pytest.approx(
        float(maps.weights[1][2, 0, 0]), abs=1e-6
    )


# --- in a real browser -------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")


def _chromium(tmp_path, url: str, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=700,600",
        "--hide-scrollbars",
        "--virtual-time-budget=3000",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args, url], capture_output=True, text=True, timeout=60, check=True
    )


@needs_chromium
def test_html_view_in_headless_chromium(tmp_path):
    import matplotlib.image as mpimg

    maps = viz.from_hf(_hf_attentions(), TOKENS)
    page = viz.AttentionView(maps, title="test view").save(tmp_path / "view.html")
    url = page.as_uri()

    shots = {}
    for view in ("layer=0&head=0", "layer=1&head=2", "layer=1&head=avg"):
        path = tmp_path / f"{view.replace('&', '_')}.png"
        _chromium(tmp_path, f"{url}#{view}", f"--screenshot={path}")
        shots[view] = mpimg.imread(path)[..., :3]
    first = shots["layer=0&head=0"]
    assert first.std() > 0.05 and len(np.unique(first.reshape(-1, 3), axis=0)) > 20  # not blank
    assert np.abs(first - shots["layer=1&head=2"]).mean() > 1e-3  # the pickers change the picture
    assert np.abs(shots["layer=1&head=2"] - shots["layer=1&head=avg"]).mean() > 1e-3

    dom = _chromium(tmp_path, f"{url}#layer=1&head=2&hover=3,1", "--dump-dom").stdout
    expected = f"{float(maps.weights[1][2, 3, 1]):.6f}"
    assert f"query “on” → key “cat”: weight {expected}" in dom  # the hover text
    assert "layer 1 · head 2" in dom
