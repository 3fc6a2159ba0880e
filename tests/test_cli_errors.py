"""Every CLI user error is one line on stderr, exit code 2, and no traceback.

The walk runs each bad input in-process through ``attnkit.cli.main`` (an uncaught exception
would fail the test), then asserts the exit code, a single ``attnkit: error:`` line, and that
nothing was written where the command was refused.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from attnkit.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny trained checkpoint (2 steps), shared by the walk."""
    out = tmp_path_factory.mktemp("ck") / "ck"
    argv = ["train", "--task", "copy", "--length", "2", "--steps", "2", "--out", str(out)]
    assert main([*argv, "--batch-size", "4", "--quiet"]) == 0
    return out


def edited_copy(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """Copy a checkpoint, edit its config.json, and re-sign the manifest (a whole but bad save)."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    manifest = json.loads((dst / "manifest.json").read_text())
    data = (dst / "config.json").read_bytes()
    manifest["files"]["config.json"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def assert_user_error(capsys, argv: list[str], match: str = "") -> str:
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err + captured.out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("attnkit: error:"), err
    assert match in err, err
    return err


def _files(tmp: Path) -> Path:
    f = tmp / "a_file"
    f.write_text("x")
    return f


# --- outputs that are a file, a directory, or under a file --------------------------------


@pytest.mark.parametrize(
    "make_argv",
    [
        lambda f: ["train", "--task", "copy", "--steps", "1", "--out", str(f)],
        lambda f: ["train", "--task", "copy", "--steps", "1", "--out", str(f / "sub")],
        lambda f: ["demo", "--no-gpt", "--out", str(f)],
        lambda f: ["demo", "--no-gpt", "--out", str(f / "sub")],
        lambda f: ["bench", "--quick", "--out", str(f)],
        lambda f: ["bench", "--quick", "--out", str(f / "sub")],
        lambda f: ["viz", "-o", str(f / "x.html")],
        lambda f: ["viz", "-o", str(f / "x.png")],
    ],
    ids=[
        "train-file",
        "train-under",
        "demo-file",
        "demo-under",
        "bench-file",
        "bench-under",
        "viz-html-under",
        "viz-png-under",
    ],
)
def test_output_path_that_is_a_file_or_under_one_is_refused(tmp_path, capsys, make_argv):
    f = _files(tmp_path)
    assert_user_error(capsys, make_argv(f), "is a file")
    assert f.read_text() == "x"


#: A folder no one can make, even root: /proc takes no new entries.
UNMAKEABLE = Path("/proc/attnkit-no-such-folder")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--quick", "--out", str(UNMAKEABLE)],
        ["train", "--task", "copy", "--steps", "1", "--out", str(UNMAKEABLE)],
        ["demo", "--no-gpt", "--out", str(UNMAKEABLE)],
        ["viz", "-o", str(UNMAKEABLE / "x.png")],
    ],
    ids=["bench", "train", "demo", "viz"],
)
def test_an_output_folder_that_cannot_be_made_is_refused_before_the_work(capsys, monkeypatch, argv):
    """Made and checked first, so the error names the flag and comes before the work: `attnkit
    bench --out` once ran its whole suite (5.5 minutes) and then failed on a bare
    "No such file or directory"; demo printed half its tour first."""
    from attnkit.bench import suite

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran before its output folder was checked")

    monkeypatch.setattr(suite, "run_suite", never)
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", (code, captured.out)  # nothing done first
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit: error:"), captured.err
    assert "cannot make" in lines[0] and ("-o" if argv[0] == "viz" else "--out") in lines[0]


def test_viz_output_that_is_a_directory_is_refused(tmp_path, capsys):
    (tmp_path / "maps.html").mkdir()
    assert_user_error(capsys, ["viz", "-o", str(tmp_path / "maps.html")], "is a directory")


def test_train_does_not_replace_an_existing_checkpoint_without_overwrite(
    tmp_path, capsys, checkpoint
):
    import shutil

    out = shutil.copytree(checkpoint, tmp_path / "ck")
    before = (out / "model.safetensors").read_bytes()
    argv = ["train", "--task", "copy", "--length", "2", "--steps", "1", "--out", str(out)]
    assert_user_error(capsys, argv, "--overwrite")
    assert (out / "model.safetensors").read_bytes() == before
    assert main([*argv, "--overwrite", "--quiet"]) == 0
    assert (out / "model.safetensors").read_bytes() != before


def test_train_refuses_a_non_empty_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    argv = ["train", "--task", "copy", "--steps", "1", "--out", str(tmp_path)]
    assert_user_error(capsys, argv, "not a checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# --- numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf"])
def test_train_bad_lr(tmp_path, capsys, lr):
    argv = ["train", "--task", "copy", "--steps", "1", "--out", str(tmp_path / "o"), "--lr", lr]
    assert_user_error(capsys, argv, "--lr")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_train_text_context_length_zero_is_not_silently_64(tmp_path, capsys, value):
    text = tmp_path / "t.txt"
    text.write_text("hello attention " * 10)
    argv = ["train", "--text", str(text), "--context-length", value, "--out", str(tmp_path / "o")]
    assert_user_error(capsys, argv, "--context-length")


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--temperature", "nan", "--temperature"),
        ("--temperature", "-1", "--temperature"),
        ("--temperature", "inf", "--temperature"),
        ("--max-new-tokens", "-1", "--max-new-tokens"),
        ("--top-k", "0", "--top-k"),
        ("--top-k", "1000", "--top-k"),
    ],
)
def test_generate_bad_sampling_arguments(capsys, checkpoint, flag, value, match):
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "1>", flag, value]
    assert_user_error(capsys, argv, match)


# --- checkpoints that are whole but wrong ----------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c["meta"].update(step="x"), "meta.step"),
        (lambda c: c["meta"].update(length="abc"), "meta.length"),
        (lambda c: c["meta"].update(losses="nope"), "meta.losses"),
        (lambda c: c["optimizer"].update(param_groups=5), "param_groups"),
        (lambda c: c["model"].update(attn_backend="nope"), "attn_backend"),
        (lambda c: c["model"].update(n_heads="4"), "n_heads"),
        (lambda c: c.update(model=[1]), "model"),
        (lambda c: c["tokenizer"].update(kind="words"), "tokenizer"),
    ],
    ids=["step", "length", "losses", "param_groups", "backend", "n_heads", "model", "tokenizer"],
)
def test_checkpoint_config_with_wrong_types(tmp_path, capsys, checkpoint, edit, match):
    bad = edited_copy(checkpoint, tmp_path / "bad", edit)
    gen = ["generate", "--checkpoint", str(bad), "--prompt", "1>"]
    resume = ["train", "--out", str(bad), "--steps", "5", "--resume"]
    if match in ("meta.step", "meta.length", "meta.losses", "param_groups"):
        assert_user_error(capsys, resume, match)
    else:
        assert_user_error(capsys, gen, match)
        assert_user_error(capsys, resume, match)


def test_optimizer_keys_without_a_dot(tmp_path, capsys, checkpoint):
    import shutil

    import torch
    from safetensors.torch import save_file

    from attnkit.checkpoints import write_directory

    bad = shutil.copytree(checkpoint, tmp_path / "bad")
    files = {n: (bad / n).read_bytes() for n in ("model.safetensors", "config.json")}
    files["optimizer.safetensors"] = lambda p: save_file({"nodot": torch.zeros(1)}, p)
    write_directory(bad, files)
    assert_user_error(capsys, ["train", "--out", str(bad), "--steps", "5", "--resume"], "nodot")
    # whole, but a moment of the wrong shape: refused before training, not a torch error
    files["optimizer.safetensors"] = lambda p: save_file({"0.exp_avg": torch.zeros(3)}, p)
    write_directory(bad, files)
    assert_user_error(capsys, ["train", "--out", str(bad), "--steps", "5", "--resume"], "shape")


def test_torn_checkpoint_is_refused_on_generate_and_resume(tmp_path, capsys, checkpoint):
    import shutil

    bad = shutil.copytree(checkpoint, tmp_path / "torn")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:-4] + b"xxxx")
    assert_user_error(capsys, ["generate", "--checkpoint", str(bad), "--prompt", "1>"], "torn")
    assert_user_error(capsys, ["train", "--out", str(bad), "--steps", "5", "--resume"], "torn")


def test_resume_refuses_a_changed_task_or_model(tmp_path, capsys, checkpoint):
    import shutil

    ck = shutil.copytree(checkpoint, tmp_path / "ck")
    base = ["train", "--out", str(ck), "--steps", "5", "--resume"]
    assert_user_error(capsys, [*base, "--task", "reverse"], "--task")
    text = tmp_path / "t.txt"
    text.write_text("some text here")
    assert_user_error(capsys, [*base, "--text", str(text)], "--text")
    assert_user_error(capsys, [*base, "--length", "5"], "--length")
    assert_user_error(capsys, [*base, "--emb-dim", "32"], "--emb-dim")
    assert_user_error(capsys, [*base, "--overwrite"], "not both")
    assert_user_error(capsys, [*base, "--lr", "0.1"], "keeps its learning rate")


# --- inputs that are files ------------------------------------------------------------------


def test_explain_deeply_nested_embeddings_json(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert_user_error(capsys, ["explain", "a b", "--embeddings", str(deep)], "deep.json")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty"),
        (b"not a pickle at all", "deep"),
        (b"PK\x03\x04truncated zip", "deep"),
    ],
    ids=["empty", "garbage", "truncated-zip"],
)
def test_viz_on_a_bad_pt_file(tmp_path, capsys, content, match):
    bad = tmp_path / "deep.pt"
    bad.write_bytes(content)
    err = assert_user_error(capsys, ["viz", str(bad), "--tokens", "a b"], match)
    assert "weights_only=False" not in err and "documentation" not in err  # no torch advice


def test_viz_on_a_truncated_real_pt_file(tmp_path, capsys):
    import torch

    good = tmp_path / "a.pt"
    torch.save([torch.rand(1, 2, 3, 3).softmax(-1)], good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert_user_error(capsys, ["viz", str(cut), "--tokens", "a b c"], "cut.pt")


def test_viz_on_a_pickle_that_runs_code_is_one_line(tmp_path, capsys):
    import pickle

    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"x": print}, f)  # a global: weights_only refuses it
    err = assert_user_error(capsys, ["viz", str(evil), "--tokens", "a"], "refusing")
    assert "weights_only=False" not in err


def test_truncated_and_empty_pt_raise_the_documented_value_error(tmp_path):
    import torch

    from attnkit.checkpoints import load_checkpoint, safe_torch_load

    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"w": torch.ones(100)}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    for name in ("empty.pt", "cut.pt"):
        with pytest.raises(ValueError, match=name):
            safe_torch_load(tmp_path / name)
        with pytest.raises(ValueError, match=name):
            load_checkpoint(tmp_path / name)


def test_no_traceback_from_a_real_process_on_a_user_error(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnkit",
            "train",
            "--task",
            "copy",
            "--lr",
            "nan",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "--lr" in r.stderr
