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


def test_small_causal_map_marks_exactly_the_masked_cells_and_prints_the_others(tmp_path):
    from attnkit.viz.static import draw_attention

    maps = viz.from_explanation(explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor()))
    causal = maps.names.index("causal")
    png = viz.plot_attention(maps, tmp_path / "causal.png", layer=causal)
    assert png.stat().st_size > 1000
    fig = draw_attention(maps, layer=causal)
    ax = fig.axes[0]
    (image,) = ax.images
    cells = image.get_array()  # what matplotlib colours: masked cells are left see-through
    future = torch.ones(6, 6).triu(1).bool().numpy()  # a key after its query
    assert np.array_equal(np.ma.getmaskarray(cells), future)
    assert (ax.patches[0].get_hatch() or "") != ""  # the hatched patch shows through them
    # one printed value per kept cell, each the weight rounded to 2 places
    weights = maps.weights[causal][0].numpy()
    want = {(q, k): f"{weights[q, k]:.2f}" for q in range(6) for k in range(q + 1)}
    got = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    assert got == want
    assert "masked" in fig.axes[-1].get_ylabel()  # the colour bar says what hatching means


def test_unmasked_or_large_maps_print_no_legend_note_or_values():
    from attnkit.viz.static import ANNOTATE_MAX, draw_attention

    maps = viz.from_hf(_hf_attentions(heads=1), TOKENS)  # softmax of finite scores: no zeros
    fig = draw_attention(maps)
    assert not np.ma.count_masked(fig.axes[0].images[0].get_array())
    assert fig.axes[-1].get_ylabel() == "attention weight"
    n = ANNOTATE_MAX + 1
    big = viz.AttentionMaps(
        ["x"], [torch.softmax(torch.randn(1, n, n), -1)], [f"t{i}" for i in range(n)]
    )
    assert len(draw_attention(big).axes[0].texts) == 0


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


# --- regressions from the new-user try ------------------------------------------------------


@pytest.mark.parametrize("token", ["STOPS", "DATA", "</script>", "{{ x }}", "ID", "<b>&"])
def test_html_token_containing_template_words_does_not_break_the_page(token):
    maps = viz.from_hf(_hf_attentions(), ["a", token, "c", "d", "e"])
    page = viz.AttentionView(maps).to_html()
    script = re.search(r"<script>(.*)</script>", page, re.S).group(1)
    assert "</script" not in script.replace("<\\/", "")  # no early end of the script
    data = json.loads(re.search(r"data=(\{.*?\}), stops=", page).group(1))
    assert data["tokens"][1] == token
    stops = json.loads(re.search(r"stops=(\[\[.*?\]\]);", page).group(1))
    assert len(stops) == 5  # the colour stops were not spliced into a token


def test_png_of_64_tokens_and_12_heads_is_capped():
    from matplotlib.image import imread

    from attnkit.viz.static import MAX_PIXELS

    t = 64
    w = torch.softmax(torch.randn(1, 12, t, t), dim=-1)
    maps = viz.from_hf([w], [f"tok{i}" for i in range(t)])
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        img = imread(viz.plot_attention(maps, Path(d) / "big.png"))
    assert img.shape[0] * img.shape[1] <= MAX_PIXELS * 1.05  # was 94 Mpx
    assert img.shape[0] > 800 and img.std() > 0.05  # still a real picture


def test_plot_selected_heads_and_pdf(tmp_path):
    maps = viz.from_hf(_hf_attentions(heads=6), TOKENS)
    svg = viz.plot_attention(maps, tmp_path / "m.svg", layer=1, heads=[0, 4]).read_text()
    assert svg.count("<image") == 2 + 1 and "head 4" in svg and "head 1" not in svg
    assert "2 of 6 heads" in svg
    pdf = viz.plot_attention(maps, tmp_path / "m.pdf", layer=0)
    assert pdf.read_bytes()[:5] == b"%PDF-"
    with pytest.raises(ValueError, match="heads \\[9\\] out of range"):
        viz.plot_attention(maps, tmp_path / "x.png", heads=[9])


def test_viz_cli_layer_all_heads_and_pdf(tmp_path, capsys):
    from attnkit.cli import main

    torch.save(list(_hf_attentions(layers=3)), tmp_path / "a.pt")
    argv = ["viz", str(tmp_path / "a.pt"), "--tokens", " ".join(TOKENS)]
    assert main([*argv, "-o", str(tmp_path / "m.png"), "--layer", "all", "--head", "1"]) == 0
    assert sorted(p.name for p in tmp_path.glob("m-layer*.png")) == [
        "m-layer0.png",
        "m-layer1.png",
        "m-layer2.png",
    ]
    assert main([*argv, "-o", str(tmp_path / "m.pdf"), "--layer", "2"]) == 0
    assert (tmp_path / "m.pdf").read_bytes()[:5] == b"%PDF-"
    capsys.readouterr()
    assert main([*argv, "-o", str(tmp_path / "m.png"), "--layer", "7"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_from_hf_accepts_generate_output_attentions():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = model.generate(
        prompt,
        max_new_tokens=3,
        do_sample=False,
        output_attentions=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = [str(t) for t in out.sequences[0].tolist()]  # 7 tokens; the last is never attended
    maps = viz.from_hf(out, tokens)
    assert len(maps.weights) == 2 and maps.weights[0].shape == (2, 6, 6)
    assert maps.tokens == tokens[:6]
    with torch.no_grad():
        full = model(out.sequences[:, :6], output_attentions=True).attentions
    for layer in range(2):  # stitched steps equal one full forward's causal maps
        torch.testing.assert_close(maps.weights[layer], full[layer][0], atol=1e-5, rtol=1e-4)
    assert viz.from_hf(out.attentions, tokens).weights[1].shape == (2, 6, 6)


def test_saved_trace_recording_loads_in_attnkit_viz(tmp_path, capsys):
    from attnkit.cli import main

    with trace.record() as rec:
        MultiHeadAttention(4, 4, 5, 0.0, num_heads=2)(torch.rand(1, 5, 4))
    torch.save(dict(rec), tmp_path / "trace.pt")  # as the viz help and README say
    argv = ["viz", str(tmp_path / "trace.pt"), "--tokens", " ".join(TOKENS)]
    assert main([*argv, "-o", str(tmp_path / "t.html"), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").is_file() and "weights" in (tmp_path / "t.html").read_text()


def test_text_model_axes_show_characters_not_byte_ids():
    from attnkit.train.data import ByteTokenizer, CharTokenizer

    assert ByteTokenizer().labels(list(b"hi \n")) == ["h", "i", "\u2423", "\\n"]
    assert ByteTokenizer().labels(list("é".encode())) == ["0xc3", "0xa9"]
    assert CharTokenizer("ab>").labels([2, 0]) == [">", "a"]


def test_html_view_one_head_has_no_average_and_one_scale_per_layer():
    maps = viz.AttentionMaps(
        ["layer 0", "layer 1"],
        [torch.tensor([[[1.0, 0.0], [0.5, 0.5]]]), torch.tensor([[[1.0, 0.0], [0.2, 0.8]]] * 2)],
        ["a", "b"],
    )
    page = viz.AttentionView(maps).to_html()
    assert "(many){" in page.replace(" ", "")  # the average option only for several heads
    assert "layerMax(l)" in page and "(masked)" in page


@needs_chromium
def test_html_view_masked_cells_axes_and_single_head_in_chromium(tmp_path):
    maps = viz.from_explanation(explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor()))
    page = viz.AttentionView(maps).save(tmp_path / "view.html")
    causal = maps.names.index("causal")
    dom = _chromium(tmp_path, f"{page.as_uri()}#layer={causal}", "--dump-dom").stdout
    head_select = re.search(r'<select class="akv-head">(.*?)</select>', dom).group(1)
    assert "average" not in head_select and head_select.count("<option") == 1  # one head
    assert dom.count("akv-c akv-m") == 15  # the 6x6 causal map's masked cells
    assert "query ↓ · key →" in dom
    multi = maps.names.index("multihead")
    dom = _chromium(tmp_path, f"{page.as_uri()}#layer={multi}", "--dump-dom").stdout
    assert "average of heads" in re.search(r'<select class="akv-head">(.*?)</select>', dom).group(1)


@pytest.mark.parametrize("empty", [(), [], None, (None, None), ((None, None), (None, None))])
def test_from_hf_without_weights_says_how_to_load_the_model(empty):
    # a model on SDPA (transformers' default) gives outputs.attentions == (): say what to do
    with pytest.raises(ValueError, match="no attention tensors found") as info:
        viz.from_hf(empty, TOKENS)
    message = str(info.value)
    assert "attn_implementation='attnkit'" in message and "'eager'" in message
    assert "\n" not in message


def test_from_hf_on_an_sdpa_model_then_attnkit_as_the_readme_shows():
    transformers = pytest.importorskip("transformers")
    import attnkit.integrations.hf as attnkit_hf

    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()  # the default way: SDPA
    ids, tokens = torch.tensor([[1, 2, 3, 4, 5]]), ["a", "b", "c", "d", "e"]
    with torch.no_grad():
        outputs = model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="attn_implementation='attnkit'"):
        viz.from_hf(outputs.attentions, tokens)
    attnkit_hf.register()
    model.set_attn_implementation("attnkit")
    with torch.no_grad():
        outputs = model(ids, output_attentions=True)
    maps = viz.from_hf(outputs.attentions, tokens)
    assert len(maps.weights) == 2 and maps.weights[0].shape == (2, 5, 5)
