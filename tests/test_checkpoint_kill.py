"""``kill -9`` and Ctrl-C during ``attnkit train``: every directory left loads whole or is
refused clearly, and ``--resume`` continues from a consistent step.

Before manifests and the directory swap, 1 to 10 of 20 kills left ``model.safetensors``
newer than ``config.json``; the checkpoint loaded and ``--resume`` repeated steps on the
newer weights.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnkit.checkpoints import CheckpointError
from attnkit.cli import main
from attnkit.train import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _train(out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [
        sys.executable,
        "-m",
        "attnkit",
        "train",
        "--task",
        "copy",
        "--length",
        "2",
        "--batch-size",
        "4",
        "--save-every",
        "1",
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _wait_for_saves(proc: subprocess.Popen, n: int) -> None:
    seen = 0
    assert proc.stdout is not None
    while seen < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "no output"
        seen += "saved" in line


def _check_whole(out: Path) -> int:
    """Load the directory as --resume does; return its step (or -1 if clearly refused)."""
    try:
        _, _, meta, opt_state = load_checkpoint(out, require_manifest=True)
    except CheckpointError as err:
        assert "\n" not in str(err)
        return -1
    assert meta["step"] == len(meta["losses"]) > 0
    assert opt_state is not None
    return int(meta["step"])


def _kill_runs(tmp_path: Path, kills: int, seed: int, finish: bool) -> None:
    rng = random.Random(seed)
    out = tmp_path / "ck"
    steps = []
    for i in range(kills):
        proc = _train(out, "--steps", "100000", *(["--resume"] if i else []))
        try:
            _wait_for_saves(proc, 1)
            time.sleep(rng.uniform(0.0, 0.3))  # mid-step or mid-save
        finally:
            proc.kill()
            proc.wait()
        step = _check_whole(out)
        assert step > 0, "the previous whole checkpoint must survive a kill"
        assert not steps or step >= steps[-1]  # resume continued, never went back
        steps.append(step)
    if not finish:
        return
    # a run to the end leaves no temporary directories behind
    proc = _train(out, "--steps", str(steps[-1] + 2), "--resume")
    _, err_text = proc.communicate(timeout=120)
    assert proc.returncode == 0, err_text
    assert "Traceback" not in err_text
    assert _check_whole(out) == steps[-1] + 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_kill_9_during_training_leaves_whole_checkpoints(tmp_path):
    _kill_runs(tmp_path, kills=2, seed=0, finish=False)


@pytest.mark.slow
def test_kill_9_during_training_twenty_times(tmp_path):
    _kill_runs(tmp_path, kills=20, seed=1, finish=True)


def test_ctrl_c_saves_and_exits_cleanly(tmp_path, capsys):
    out = tmp_path / "ck"
    proc = _train(out, "--steps", "100000")
    _wait_for_saves(proc, 2)
    proc.send_signal(signal.SIGINT)
    out_text, err_text = proc.communicate(timeout=120)
    assert proc.returncode == 130, err_text
    assert "Traceback" not in err_text
    assert "interrupted at step" in out_text and "--resume" in out_text
    step = _check_whole(out)
    assert f"interrupted at step {step}:" in out_text  # the saved step is the one reported
    argv = ["train", "--out", str(out), "--steps", str(step + 1), "--resume", "--quiet"]
    assert main(argv) == 0
    assert f"steps {step + 1}..{step + 1}" in capsys.readouterr().out
