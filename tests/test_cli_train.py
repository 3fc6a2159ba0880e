"""``attnkit train`` / ``attnkit generate`` / ``attnkit serve --checkpoint``: a short run,
resume, serving its prompts together, and one-line errors."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from attnkit.cli import main


@pytest.fixture(scope="module")
def _trained(tmp_path_factory):
    """A checkpoint of 2 steps on the copy task of length 2 (context_length 5), trained
    once for the module (each training also draws its loss curve and attention maps)."""
    out = tmp_path_factory.mktemp("trained") / "ck"
    argv = ["train", "--task", "copy", "--length", "2", "--steps", "2", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    return out


@pytest.fixture
def trained(_trained, tmp_path, capsys):
    """A copy of the module's checkpoint under ``tmp_path / "ck"`` (tests may change it)."""
    out = tmp_path / "ck"
    shutil.copytree(_trained, out)
    capsys.readouterr()
    return out


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


def test_prompt_longer_than_context_subprocess(trained):
    out = trained
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
def test_bad_prompts(trained, capsys, prompt):
    one_line_error(capsys, ["generate", "--checkpoint", str(trained), "--prompt", prompt], "prompt")


def test_generate_past_context_length_crops_and_says_so(trained, capsys):
    out = trained  # context_length 5 (the task's sequence)
    assert (
        main(["generate", "--checkpoint", str(out), "--prompt", "12>", "--max-new-tokens", "6"])
        == 0
    )
    text = capsys.readouterr()
    assert len(text.out.strip()) == 3 + 6  # not silently stopped at the context
    assert "past context_length 5" in text.err and text.err.count("\n") == 1


def test_generate_help_says_temperature_zero_is_greedy(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    assert "0 = greedy" in " ".join(capsys.readouterr().out.split())


def test_generate_with_a_subnormal_temperature_is_greedy(trained, capsys):
    generate = ["generate", "--checkpoint", str(trained), "--prompt", "12>"]
    assert main(generate) == 0
    greedy = capsys.readouterr().out
    assert main([*generate, "--temperature", "1e-45"]) == 0  # was a multinomial traceback
    assert capsys.readouterr().out == greedy


def test_generate_refuses_a_config_larger_than_its_weights_in_one_line(trained, capsys):
    import json

    out = trained
    (out / "manifest.json").unlink()  # generate accepts checkpoints from before manifests
    config = json.loads((out / "config.json").read_text())
    config["model"]["vocab_size"] = 10**13
    (out / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    one_line_error(
        capsys,
        ["generate", "--checkpoint", str(out), "--prompt", "1>"],
        "does not match model.safetensors: tok_emb.weight",
    )


@pytest.mark.parametrize("command", ["train", "generate", "bench", "demo", "explain", "viz"])
def test_help_has_description_examples_and_defaults(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "(default:" in out and f"attnkit {command}" in out


def test_demo_saves_a_model_generate_can_use(tmp_path, capsys):
    from attnkit.train import demo_section

    demo_section(tmp_path, steps=3)
    printed = capsys.readouterr().out
    assert f"attnkit generate --checkpoint {tmp_path / 'checkpoint'}" in printed
    assert (
        main(["generate", "--checkpoint", str(tmp_path / "checkpoint"), "--prompt", "12345678>"])
        == 0
    )
    answer = capsys.readouterr().out.strip()
    assert answer.startswith("12345678>") and len(answer) == 9 + 8  # the reverse task's answer


def test_train_quiet_logs_a_line_per_save_and_no_bar(tmp_path, capsys):
    argv = ["train", "--task", "copy", "--length", "2", "--steps", "4", "--save-every", "2"]
    assert main([*argv, "--quiet", "--out", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr()
    assert "step 2/4: loss" in text.out and "step 4/4: loss" in text.out
    assert "it/s" not in text.err and "step/s" not in text.err


def test_resume_through_a_symlinked_out_saves_into_its_target(tmp_path, capsys):
    real, link = tmp_path / "real", tmp_path / "link"
    argv = ["train", "--task", "copy", "--length", "2", "--batch-size", "4", "--quiet"]
    assert main([*argv, "--steps", "1", "--out", str(real)]) == 0
    link.symlink_to(real, target_is_directory=True)
    assert main([*argv, "--steps", "2", "--resume", "--out", str(link)]) == 0
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link is kept
    from attnkit.train import load_checkpoint

    assert load_checkpoint(real, require_manifest=True)[2]["step"] == 2  # saved into the target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_second_train_on_the_same_out_is_refused_up_front(tmp_path, capsys):
    from attnkit.checkpoints import lock_directory

    out = tmp_path / "ck"
    argv = ["train", "--task", "copy", "--length", "2", "--steps", "1", "--out", str(out)]
    with lock_directory(out):  # as a run in progress holds it (flock: per open file)
        one_line_error(capsys, argv, "is in use by another process")
    assert not out.exists()  # nothing written, nothing deleted
    assert main(argv) == 0  # free again once released


def test_two_train_processes_on_one_out(tmp_path):
    out = tmp_path / "ck"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from attnkit.checkpoints import lock_directory\n"
            f"with lock_directory({str(out)!r}):\n print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        r = subprocess.run(
            [sys.executable, "-m", "attnkit.cli", "train", "--steps", "1", "--out", str(out)],
            capture_output=True,
            text=True,
        )
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2 and "in use by another process" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_serve_gives_each_prompt_what_generate_gives_it(trained, tmp_path, capsys):
    """Served together (continuous batching, 2 at once on pages of 2 tokens), every prompt
    gets the continuation `attnkit generate` prints for it alone, in the order given;
    a prompts file's blank lines are skipped; the server's log and --check go to stderr."""
    prompts = ["12>", "1>", "21>", "2>", "11>"]
    alone = []
    for prompt in prompts:
        assert main(["generate", "--checkpoint", str(trained), "--prompt", prompt]) == 0
        alone.append(capsys.readouterr().out.strip())
    served = ["serve", "--checkpoint", str(trained), "--max-batch", "2", "--page-size", "2"]
    argv = [*served, *(x for p in prompts for x in ("--prompt", p)), "--check"]
    assert main(argv) == 0
    got = capsys.readouterr()
    assert got.out.splitlines() == alone
    assert "check: 5 of 5 requests got the tokens they get alone" in got.err
    assert "joined" in got.err and "finished" in got.err
    listed = tmp_path / "prompts.txt"
    listed.write_text("\n".join(prompts[:2]) + "\n\n" + prompts[2] + "\n")
    assert main([*served, "--prompts-file", str(listed), "--prompt", prompts[3]]) == 0
    assert capsys.readouterr().out.splitlines() == [alone[3], *alone[:3]]


def test_serve_caps_new_tokens_at_the_context(trained, capsys):
    """A request never runs past context_length (5 here): a larger --max-new-tokens is cut
    there, with a note naming the prompt."""
    argv = ["serve", "--checkpoint", str(trained), "--prompt", "1>", "--max-new-tokens", "9"]
    assert main(argv) == 0
    got = capsys.readouterr()
    assert "note: prompt 1 gets 3 new tokens, not 9" in got.err
    assert len(got.out.strip()) == 5  # "1>" and 3 tokens: the context's 5


@pytest.mark.parametrize(
    "extra, match",
    [
        ([], "no prompt: give --prompt TEXT"),
        (["--prompt", "1212>"], "prompt 1 has 5 tokens: no room for a new one"),
        (["--prompt", "12>", "--prompt", ""], "prompt 2 is empty"),
        (["--prompt", "12>", "--prompt", "#"], "prompt 2: "),
        (["--prompt", "1", "--prompts-file", "missing.txt"], "--prompts-file 'missing.txt'"),
        (["--prompt", "1", "--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--prompt", "1", "--demo"], "not allowed with argument"),
    ],
)
def test_serve_errors(trained, capsys, extra, match):
    one_line_error(capsys, ["serve", "--checkpoint", str(trained), *extra], match)
