"""``attnkit train --context-parallel``: in-process on a one-rank group, refusals, and once
under a real ``torchrun`` with two ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from attnkit.cli import main
from tests.distributed_harness import free_port

ARGS = ["train", "--task", "copy", "--length", "3", "--batch-size", "8", "--save-every", "50"]


@pytest.fixture
def torchrun_env(monkeypatch):
    """The environment torchrun gives a single rank; the group is destroyed afterwards."""
    for name, value in dict(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    ).items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_one_rank_equals_plain_training(tmp_path, capsys, torchrun_env):
    """With one rank the split is trivial: the same losses as the plain command."""
    cp, plain = tmp_path / "cp", tmp_path / "plain"
    assert main([*ARGS, "--steps", "6", "--out", str(cp), "--context-parallel"]) == 0
    out = capsys.readouterr().out
    assert "context parallel: 1 ranks (gloo), strategy ring, layout zigzag" in out
    assert main([*ARGS, "--steps", "6", "--out", str(plain)]) == 0
    losses = [json.loads((d / "config.json").read_text())["meta"]["losses"] for d in (cp, plain)]
    assert len(losses[0]) == 6
    assert max(abs(a - b) for a, b in zip(*losses, strict=True)) < 1e-5


def test_needs_torchrun(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main([*ARGS, "--steps", "2", "--out", str(tmp_path / "x"), "--context-parallel"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "launch with torchrun" in err, err


def test_all_to_all_strategy_flag(tmp_path, capsys, torchrun_env):
    argv = [*ARGS, "--steps", "2", "--out", str(tmp_path / "x"), "--context-parallel"]
    argv += ["--cp-strategy", "all_to_all", "--cp-layout", "contiguous", "--n-heads", "4"]
    assert main(argv) == 0
    assert "strategy all_to_all, layout contiguous" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="no torchrun",
)
def test_torchrun_two_ranks(tmp_path):
    """The real launcher: two gloo ranks, progress on rank 0 only, one checkpoint."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += ["-m", "attnkit.cli", *ARGS, "--steps", "4", "--out", str(tmp_path / "cp")]
    cmd += ["--context-parallel"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("training a GPT") == 1  # rank 0 alone prints
    assert run.stderr.count("step 4/4") == 1
    assert (tmp_path / "cp" / "model.safetensors").is_file()
