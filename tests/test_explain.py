"""attnkit.explain: the seed stages' numbers, the JSON contract and the walkthrough."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from attnkit.examples import HELLO_SHINY_SUN, YOUR_JOURNEY
from attnkit.explain import (
    JSON_KEYS,
    STAGES,
    explain,
    load_embeddings,
    render,
    resolve_sentence,
    tokenize,
)
from tests.conftest import TOL


def _softmax64(scores: torch.Tensor) -> torch.Tensor:
    e = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def test_default_example_matches_the_seed_numbers():
    e = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor())
    s = e.stages
    close = dict(atol=5e-5, rtol=0)
    journey = s["simplified"]
    torch.testing.assert_close(
        journey["scores"][1],
        torch.tensor([0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]),
        **close,
    )
    torch.testing.assert_close(
        journey["weights"][1],
        torch.tensor([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]),
        **close,
    )
    torch.testing.assert_close(
        journey["context"][1], torch.tensor([0.4419, 0.6515, 0.5683]), **close
    )
    # the book's SelfAttentionV2 (seed 789), CausalAttention and MultiHeadAttention (seed 123)
    torch.testing.assert_close(
        s["trainable"]["context"][0], torch.tensor([-0.0739, 0.0713]), **close
    )
    torch.testing.assert_close(s["causal"]["context"][0], torch.tensor([-0.4519, 0.2216]), **close)
    torch.testing.assert_close(s["multihead"]["output"][0], torch.tensor([0.3190, 0.4858]), **close)


def test_hello_shiny_sun_context():
    e = explain(HELLO_SHINY_SUN.tokens, HELLO_SHINY_SUN.tensor(), stages=["simplified"])
    torch.testing.assert_close(
        e.stages["simplified"]["context"][1],
        torch.tensor([0.3990, 0.3854, 0.8610]),
        atol=5e-5,
        rtol=0,
    )


def test_stages_against_float64_reference_on_random_input():
    x = torch.rand(7, 5)
    e = explain([f"t{i}" for i in range(7)], x, d_out=6, heads=3, dropout=0.25, seed=3)
    x64 = x.double()
    simple = e.stages["simplified"]
    w = _softmax64(x64 @ x64.T)
    torch.testing.assert_close(simple["weights"].double(), w, **TOL[torch.float32])
    torch.testing.assert_close(simple["context"].double(), w @ x64, **TOL[torch.float32])
    tr = e.stages["trainable"]
    q, k, v = (tr[n].double() for n in ("queries", "keys", "values"))
    w = _softmax64(q @ k.T / math.sqrt(6))
    torch.testing.assert_close(
        tr["scaled_scores"].double(), q @ k.T / math.sqrt(6), **TOL[torch.float32]
    )
    torch.testing.assert_close(tr["context"].double(), w @ v, **TOL[torch.float32])
    ca = e.stages["causal"]
    q, k, v = (ca[n].double() for n in ("queries", "keys", "values"))
    future = torch.ones(7, 7, dtype=torch.bool).triu(1)
    w = _softmax64((q @ k.T / math.sqrt(6)).masked_fill(future, -math.inf))
    torch.testing.assert_close(ca["weights"].double(), w, **TOL[torch.float32])
    assert torch.isneginf(ca["masked_scores"][future]).all()
    # dropout: each weight is either dropped or the causal weight scaled by 1/(1-p)
    dr = e.stages["dropout"]
    kept = dr["weights"] != 0
    torch.testing.assert_close(dr["weights"][kept], dr["softmax_weights"][kept] / 0.75)
    assert 0 < kept.sum() < (~future).sum()
    mh = e.stages["multihead"]
    assert mh["weights"].shape == (3, 7, 7) and mh["context"].shape == (3, 7, 2)
    q, k, v = (mh[n].double() for n in ("queries", "keys", "values"))  # (h, t, head_dim)
    w = _softmax64((q @ k.transpose(-2, -1) / math.sqrt(2)).masked_fill(future, -math.inf))
    torch.testing.assert_close(mh["context"].double(), w @ v, **TOL[torch.float32])


def test_json_contract_keys_and_values():
    e = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor())
    data = json.loads(render(e, fmt="json"))
    assert data["tokens"] == list(YOUR_JOURNEY.tokens)
    assert data["embeddings"][1] == [0.55, 0.87, 0.66]
    assert list(data["stages"]) == list(STAGES)
    for stage in STAGES:
        assert set(data["stages"][stage]) == set(JSON_KEYS[stage])
    heads = data["stages"]["multihead"]["heads"]
    assert len(heads) == 2 and set(heads[0]) == {"weights", "context"}
    torch.testing.assert_close(
        torch.tensor(heads[1]["weights"]), e.stages["multihead"]["weights"][1]
    )
    torch.testing.assert_close(
        torch.tensor(data["stages"]["trainable"]["context"]), e.stages["trainable"]["context"]
    )
    masked = data["stages"]["causal"]["masked_scores"]
    assert masked[0][1] is None and masked[1][0] is not None  # -inf is written as null
    only = json.loads(render(explain(["a", "b"], torch.rand(2, 3), stages=["causal"]), fmt="json"))
    assert list(only["stages"]) == ["causal"]


def _numbers(line: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.\d+", line)]


def test_query_walkthrough_arithmetic_matches_library():
    e = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor(), stages=["simplified", "causal"])
    text = render(e, query="journey")
    assert "0.55*0.43 + 0.87*0.15 + 0.66*0.89 = 0.9544" in text
    assert "sum of the exponentials = 18.7453" in text
    weights = [ln for ln in text.splitlines() if " weight = " in ln]
    simple_w = [_numbers(ln)[-1] for ln in weights[:6]]
    torch.testing.assert_close(
        torch.tensor(simple_w), e.stages["simplified"]["weights"][1], atol=5e-5, rtol=0
    )
    causal_w = [_numbers(ln)[-1] for ln in weights[6:]]  # only the visible keys
    torch.testing.assert_close(
        torch.tensor(causal_w), e.stages["causal"]["weights"][1, :2], atol=5e-5, rtol=0
    )
    assert "masked: a future token" in text and "= [0.4419, 0.6515, 0.5683]" in text


def test_text_fits_80_columns_for_a_long_sentence():
    tokens = [f"word{i}" for i in range(12)]
    e = explain(tokens, torch.rand(12, 16), d_out=8, heads=4, seed=1)
    text = render(e, query="word5")
    assert max(len(ln) for ln in text.splitlines()) <= 80
    assert "word11" in text and "terms" in text  # long dot products are abbreviated


def test_markdown_has_token_tables():
    md = render(explain(["Hello", "sun"], torch.rand(2, 3), stages=["simplified"]), fmt="markdown")
    assert "| | Hello | sun |" in md and "| **sun** |" in md and md.count("### ") == 2


def test_bad_arguments_name_the_values():
    x = torch.rand(3, 3)
    with pytest.raises(ValueError, match="unknown stage"):
        explain(["a", "b", "c"], x, stages=["bogus"])
    with pytest.raises(ValueError, match=r"d_out \(4\) must be divisible by heads \(3\)"):
        explain(["a", "b", "c"], x, d_out=4, heads=3)
    with pytest.raises(ValueError, match="2 tokens but 3"):
        explain(["a", "b"], x)
    with pytest.raises(ValueError, match="not in the sentence"):
        render(explain(["a", "b", "c"], x, stages=["simplified"]), query="z")


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(heads=True), TypeError, "heads must be an int, got bool"),
        (dict(d_out=0), ValueError, "d_out must be >= 1, got 0"),
        (dict(dropout=1.0), ValueError, "dropout must be < 1.0"),
        (dict(dropout=False), TypeError, "dropout must be a number"),
    ],
)
def test_bad_options_name_the_argument(kw, err, match):
    """Regression: explain's hand-written checks took heads=True (bool is not an int)."""
    with pytest.raises(err, match=match):
        explain(["a", "b", "c"], torch.rand(3, 3), **kw)


def test_random_embeddings_refuse_bool_dim():
    with pytest.raises(TypeError, match="dim must be an int, got bool"):
        resolve_sentence("the cat sat", dim=True)


def test_inputs_tokenize_examples_and_files(tmp_path):
    assert tokenize("Hello shiny sun!") == ["Hello", "shiny", "sun", "!"]
    with pytest.raises(ValueError, match="no tokens"):
        tokenize("  \t ")
    tokens, x = resolve_sentence("hello shiny sun")
    assert tokens == ["Hello", "shiny", "sun"] and torch.equal(x, HELLO_SHINY_SUN.tensor())
    _, r1 = resolve_sentence("the cat sat", dim=4, seed=5)
    _, r2 = resolve_sentence("the cat sat", dim=4, seed=5)
    assert r1.shape == (3, 4) and torch.equal(r1, r2)
    (tmp_path / "e.json").write_text(json.dumps({"embeddings": [[1, 2], [3, 4]]}))
    assert load_embeddings(tmp_path / "e.json", 2).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    (tmp_path / "e.csv").write_text("the,0.1,0.2\ncat,0.3,0.4\n")
    assert load_embeddings(tmp_path / "e.csv", 2, dim=2).shape == (2, 2)
    with pytest.raises(ValueError, match="width 2, expected --dim 3"):
        load_embeddings(tmp_path / "e.csv", 2, dim=3)
    with pytest.raises(ValueError, match="2 vectors but the sentence has 3"):
        load_embeddings(tmp_path / "e.csv", 3)


def test_import_attnkit_does_not_import_matplotlib():
    code = "import sys, attnkit, attnkit.explain, attnkit.viz; print('matplotlib' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_explain_keeps_punctuation_tokens():
    assert tokenize("Wait, don't stop!") == ["Wait", ",", "don't", "stop", "!"]
    tokens, x = resolve_sentence("Hello shiny sun!")  # the book's example: its 3 tokens
    assert tokens == ["Hello", "shiny", "sun"] and torch.equal(x, HELLO_SHINY_SUN.tensor())
    tokens, x = resolve_sentence("Hi, sun!")
    assert tokens == ["Hi", ",", "sun", "!"] and x.shape == (4, 3)


def test_explain_query_picks_a_repeated_token():
    from attnkit.explain import find_token

    tokens = ["the", "cat", "saw", "the", "dog"]
    assert find_token(tokens, "the#1") == 0 and find_token(tokens, "the#2") == 3
    assert find_token(tokens, "cat") == 1 and find_token(tokens, "CAT") == 1
    with pytest.raises(ValueError, match="occurs 2 times; choose one of the#1, the#2"):
        find_token(tokens, "the")
    with pytest.raises(ValueError, match="#3 does not exist"):
        find_token(tokens, "the#3")
    assert find_token(["c#1"], "c#1") == 0  # a token that contains '#' matches as itself


def test_explain_labels_random_embeddings_as_random(capsys):
    from attnkit.cli import main

    assert main(["explain", "the red fox", "--stage", "simplified", "--seed", "4"]) == 0
    assert "random (seed 4" in capsys.readouterr().out
    assert main(["explain", "the red fox", "--stage", "simplified", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["embeddings_source"].startswith("random")
    assert main(["explain", "--stage", "simplified"]) == 0
    assert "the seeds' embeddings" in capsys.readouterr().out


def test_explain_reads_csv_header_and_labels(tmp_path, capsys):
    from attnkit.cli import main
    from attnkit.explain.inputs import read_embeddings

    f = tmp_path / "v.csv"
    f.write_text("token,x,y,z\nsun,0.1,0.2,0.3\nrain,0.4,0.5,0.6\n")
    labels, x = read_embeddings(f)
    assert labels == ["sun", "rain"]
    torch.testing.assert_close(x, torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]))
    assert main(["explain", "--embeddings", str(f), "--stage", "simplified"]) == 0
    assert '"sun rain"' in capsys.readouterr().out  # tokens from the labels
    assert main(["explain", "sun rain", "--embeddings", str(f), "--stage", "simplified"]) == 0
    capsys.readouterr()
    assert main(["explain", "moon rain", "--embeddings", str(f)]) == 2
    assert "differ from the sentence" in capsys.readouterr().err
