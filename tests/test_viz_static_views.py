"""attnkit.viz.static_views and `attnkit viz --hf ... --view`: PNG/SVG of the head, model and
neuron views, from Python and from the command line (a tiny GPT-2 saved to a folder)."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from attnkit import viz
from attnkit.cli import main
from attnkit.viz.record import neuron

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GPT-2 and a word-level tokenizer, saved as save_pretrained writes them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from tests.test_viz_record import gpt2

    path = tmp_path_factory.mktemp("gpt2")
    gpt2().save_pretrained(path)
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        path
    )
    return path


def test_cli_neuron_svg_prints_the_score(folder, tmp_path, capsys):
    out = tmp_path / "n.svg"
    args = ["viz", "--hf", str(folder), "--text", "the cat sat on the mat"]
    assert (
        main(
            [*args, "--view", "neuron", "--layer", "1", "--head", "2", "--key", "1", "-o", str(out)]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    rec = viz.record_hf(model, [1, 2, 3, 4, 1, 5], qk=True)
    n = neuron(rec, 1, 2, 5, 1)
    text = out.read_text()
    assert f"score {n.score:.6f}" in text and "“mat” → “cat”" in text


@pytest.mark.parametrize("view", ["head", "model"])
def test_cli_head_and_model_png(folder, tmp_path, view):
    from PIL import Image

    out = tmp_path / f"{view}.png"
    assert (
        main(["viz", "--hf", str(folder), "--ids", "1 2 3 4", "--view", view, "-o", str(out)]) == 0
    )
    img = Image.open(out).convert("L")
    assert img.size[0] > 300 and img.getextrema()[0] < 100  # something dark was drawn


def test_cli_page_with_every_view(folder, tmp_path):
    out = tmp_path / "v.html"
    args = ["viz", "--hf", str(folder), "--ids", "1 2 3", "--qk", "--steps", "2", "--branch", "2"]
    assert main([*args, "--view", "next", "-o", str(out)]) == 0
    page = out.read_text()
    assert 'data-view="neuron"' in page and 'data-view="next"' in page and '"start": "next"' in page


def test_head_view_draws_one_line_per_weight_above_threshold():
    w = torch.tensor([[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.001, 0.2, 0.799]]])  # (1, 3, 3)
    rec = viz.ModelRecording(viz.AttentionMaps(["layer 0"], [w], ["a", "b", "c"]))
    fig = viz.static_views.draw_view(rec, view="head")
    assert len(fig.axes[0].lines) == 5  # 0.001 < 0.005 is left out
    alphas = sorted(line.get_alpha() for line in fig.axes[0].lines)
    assert alphas == pytest.approx([0.2, 0.5, 0.5, 0.799, 1.0])


def test_cli_errors_are_one_line(folder, tmp_path, capsys, monkeypatch):
    cases = [
        (["--hf", str(folder)], "--text or --ids"),
        (["--hf", str(tmp_path), "--ids", "1"], "no config.json"),
        (["--hf", str(folder), "--ids", "1 x"], "--ids must be integers"),
        (["--view", "neuron", "--tokens", "a"], "needs --hf"),
        (["--hf", str(folder), "--ids", "1 2", "--view", "next"], "page only"),
    ]
    for extra, message in cases:
        out = tmp_path / ("x.html" if "neuron" in extra else "x.png")
        assert main(["viz", *extra, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # a bare install: no viz extra
    for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["viz", "--hf", str(folder), "--ids", "1 2", "-o", str(tmp_path / "h.svg")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"attnkit: error: .*pip install 'attnkit\[viz\]'\n", err), err


def test_cli_records_an_attnkit_gpt_checkpoint(tmp_path, capsys):
    """`--checkpoint` (attnkit train's GPT, with its tokenizer): the page's next-token tree
    is the model's own top tokens, labelled by the tokenizer."""
    from attnkit.models import GPT, GPTConfig
    from attnkit.train import save_checkpoint
    from attnkit.train.data import CharTokenizer

    tok = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, emb_dim=16, n_heads=2, rope=True)).eval()
    save_checkpoint(tmp_path / "run", model, tok)
    out = tmp_path / "gpt.html"
    args = ["viz", "--checkpoint", str(tmp_path / "run"), "--text", "12+3="]
    assert main([*args, "--qk", "--steps", "1", "--branch", "2", "-o", str(out)]) == 0
    page = viz.ModelView(viz.record_gpt(model, tok.encode("12+3="), decode=str, steps=1, branch=2))
    with torch.no_grad():
        top = torch.topk(model(torch.tensor([tok.encode("12+3=")]))[0, -1], 2).indices.tolist()
    text = out.read_text()
    assert 'data-view="next"' in text and 'data-view="neuron"' in text
    assert f'"ids": [{top[0]}, {top[1]}' in text and page.data()["next"]["tree"]["ids"][:2] == top
    assert main([*args, "--hf", "x", "-o", str(out)]) == 2
    assert "not both" in capsys.readouterr().err
