"""``attnkit train`` / ``attnkit generate``: a short run, resume, and one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnkit.cli import main


def test_train_resume_generate(tmp_path, capsys):
    out = tmp_path / "ck"
    args = ["train", "--task", "copy", "--length", "3", "--out", str(out), "--batch-size", "16"]
    assert main([*args, "--steps", "20", "--save-every", "10"]) == 0
    for name in ("model.safetensors", "config.json", "loss.png", "attention/layer0.png"):
        assert (out / name).is_file()
    assert main([*args, "--steps", "25", "--resume"]) == 0
    text = capsys.readouterr()
    assert "steps 21..25" in text.out and "25/25" in text.err  # the bar counts as the header
    assert main(["generate", "--checkpoint", str(out), "--prompt", "123>"]) == 0
    generated = capsys.readouterr().out.strip()
    assert generated.startswith("123>") and len(generated) == 7


def one_line_error(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err


def test_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    one_line_error(
        capsys, ["train", "--text", str(empty), "--out", str(tmp_path / "x")], "is empty"
    )
    assert not (tmp_path / "x").exists()  # nothing written
    one_line_error(
        capsys,
        ["train", "--task", "copy", "--n-kv-heads", "3", "--out", str(tmp_path / "y")],
        "must be divisible by n_kv_heads (3)",
    )
    one_line_error(
        capsys,
        ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "1"],
        "no checkpoint",
    )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    one_line_error(
        capsys, ["generate", "--checkpoint", str(tmp_path / "bad"), "--prompt", "1"], "incomplete"
    )


def test_prompt_longer_than_context_subprocess(tmp_path):
    out = tmp_path / "ck"
    assert (
        main(["train", "--task", "copy", "--length", "2", "--steps", "2", "--out", str(out)]) == 0
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnkit.cli",
            "generate",
            "--checkpoint",
            str(out),
            "--prompt",
            "1" * 40,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "more than the context_length" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("prompt", ["", "xyz"])
def test_bad_prompts(tmp_path, capsys, prompt):
    out = tmp_path / "ck"
    assert (
        main(["train", "--task", "copy", "--length", "2", "--steps", "2", "--out", str(out)]) == 0
    )
    capsys.readouterr()
    one_line_error(capsys, ["generate", "--checkpoint", str(out), "--prompt", prompt], "prompt")
