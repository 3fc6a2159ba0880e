"""``attnkit explain`` and ``attnkit viz`` end to end, as a learner would run them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from attnkit.cli import main
from attnkit.examples import YOUR_JOURNEY
from attnkit.explain import demo_section, explain


def test_default_explain_shows_seed_numbers_in_80_columns(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "0.1385   0.2379   0.2333   0.1240   0.1082   0.1581" in out  # "journey" weights
    assert "-0.4519" in out and "0.3190" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for stage in ("simplified", "trainable", "causal", "dropout", "multihead"):
        assert f"== {stage}:" in out


def test_query_walkthrough_and_stage(capsys):
    assert main(["explain", "Hello shiny sun!", "--stage", "simplified", "--query", "shiny"]) == 0
    out = capsys.readouterr().out
    assert "0.53*0.34 + 0.34*0.22 + 0.98*0.54" in out and "= [0.3990, 0.3854, 0.8610]" in out
    assert "== trainable" not in out


def test_json_output_equals_library(capsys, tmp_path):
    emb = tmp_path / "e.csv"
    emb.write_text("the,0.1,0.9,0.3,0.2\ncat,0.5,0.4,0.8,0.1\nsat,0.7,0.2,0.6,0.3\n")
    argv = ["explain", "the cat sat", "--embeddings", str(emb), "--d-out", "4", "--heads", "2"]
    assert main([*argv, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lib = explain(["the", "cat", "sat"], torch.tensor(data["embeddings"]), d_out=4, heads=2)
    torch.testing.assert_close(
        torch.tensor(data["stages"]["multihead"]["output"]), lib.stages["multihead"]["output"]
    )
    torch.testing.assert_close(
        torch.tensor(data["stages"]["causal"]["weights"]), lib.stages["causal"]["weights"]
    )
    assert main(["explain", "a b", "--dim", "5", "--seed", "2", "--format", "markdown"]) == 0
    assert "| d4 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "--stage", "bogus"], "unknown stage 'bogus'"),
        (["explain", "the cat", "--query", "dog"], "token 'dog' is not in the sentence"),
        (["explain", ""], "has no tokens"),
        (["explain", "--heads", "3"], "d_out (2) must be divisible by heads (3)"),
        (["viz", "missing.pt", "--tokens", "a b"], "no such file"),
        (["viz", "-o", "x.jpg"], "suffix must be one of"),
    ],
)
def test_user_errors_exit_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("attnkit: error:")


def test_wrong_width_embeddings_as_subprocess(tmp_path):
    emb = tmp_path / "e.json"
    emb.write_text(json.dumps([[0.1, 0.2, 0.3], [0.4, 0.5]]))
    r = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "explain", "the cat", "--embeddings", str(emb)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip()
        == "attnkit: error: embeddings file 'e.json' has rows of different widths [2, 3]"
    )


def test_viz_cli_writes_maps_from_explain_run(capsys, tmp_path):
    run = tmp_path / "run.json"
    assert main(["explain", "--format", "json"]) == 0
    run.write_text(capsys.readouterr().out)
    outs = [tmp_path / "m.png", tmp_path / "m.svg", tmp_path / "m.html"]
    argv = ["viz", str(run), "--layer", "4"] + [a for o in outs for a in ("-o", str(o))]
    assert main(argv) == 0
    assert all(o.stat().st_size > 1000 for o in outs)
    assert "stage multihead" in outs[1].read_text()


def test_demo_section_prints_walkthrough_and_writes_maps(tmp_path, capsys):
    written = demo_section(tmp_path / "maps")
    out = capsys.readouterr().out
    assert 'follow "journey"' in out and str(tmp_path / "maps") in out
    names = {p.name for p in written}
    assert {"attention.html", "multihead.png", "multihead.svg"} <= names
    assert all(p.exists() for p in written)
    assert YOUR_JOURNEY.tokens[1] in (tmp_path / "maps" / "attention.html").read_text()
