"""The GPU benchmark script: refuses cleanly without CUDA; its FLOP count and table are right."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit.bench import gpu

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-m", "attnkit.bench.gpu", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "nothing measured" in lines[0]
    assert not list(tmp_path.iterdir()), "no results written"


def test_flops_follow_flash_attn_convention():
    """Full: 4 b h T^2 d; causal about half; fwd+bwd 3.5x; documents count their own pairs."""
    b, h, t, d = 2, 3, 64, 16
    assert gpu.flops(b, h, d, gpu._keep("full", t, None), False) == 4 * b * h * t * t * d
    assert gpu._keep("causal", t, None) == t * (t + 1) // 2
    assert gpu.flops(b, h, d, 10, True) == 3.5 * gpu.flops(b, h, d, 10, False)
    ids = torch.tensor([0] * 3 + [1] * 5)
    assert gpu._keep("documents", 8, ids) == 6 + 15
    assert gpu._keep("window", 300, None) == sum(min(i + 1, gpu.WINDOW) for i in range(300))
    assert gpu._doc_ids(4096).shape == (4096,)


def test_table_marks_goals():
    row = dict(group="dense", pattern="causal", d=64, t=1024, backward=False, b=16, h=32,
               tflops={"attnkit-triton": 90.0, "sdpa-flash": 100.0, "sdpa-default": 200.0},
               ms={}, max_err_vs_fp32=1e-3)  # fmt: skip
    result = {"machine": dict(gpu="X", torch="t", triton="3", cuda="12"), "reps": 3, "rows": [row]}
    md = gpu.markdown(result)
    assert "| sdpa-flash | 100.0 | 0.90 | >= 0.8 | yes |" in md
    assert "| sdpa-default | 200.0 | 0.45 | — | — |" in md


def test_cases_cover_the_issue_grid():
    cs = gpu.cases(quick=False)
    dense = {(c["pattern"], c["d"], c["t"], c["backward"]) for c in cs if c["group"] == "dense"}
    assert len(dense) == 2 * 2 * 5 * 2
    assert {c["pattern"] for c in cs if c["group"] == "mods"} == set(gpu.MODS)


def test_a_failing_peer_is_recorded_and_the_others_timed(monkeypatch):
    """torch 2.11's compiled FlexAttention failed to compile ALiBi on the first H100 run and
    ended the whole benchmark; now that peer's row says why and the rest goes on."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []

    def broken():
        raise RuntimeError("InductorError: CompilationError at 145:20\nmore lines")

    fns = {"attnkit-triton": lambda: calls.append(1), "flex-compiled": broken}
    failed = gpu._warm(fns)
    assert list(fns) == ["attnkit-triton"] and len(calls) == 2
    assert failed == {"flex-compiled": "RuntimeError: InductorError: CompilationError at 145:20"}

    def ours_broken():
        raise RuntimeError("ours")

    with pytest.raises(RuntimeError, match="ours"):  # our own kernel failing is never a row
        gpu._warm({"attnkit-triton": ours_broken})

    row = dict(group="mods", pattern="alibi", d=128, t=1024, backward=False, b=16, h=16,
               tflops={"attnkit-triton": 50.0}, ms={}, failed=failed, max_err_vs_fp32=7e-3)  # fmt: skip
    md = gpu.markdown({"machine": dict(gpu="X", torch="t", triton="3", cuda="12"), "reps": 3,
                       "rows": [row]})  # fmt: skip
    assert "| flex-compiled | failed: RuntimeError: InductorError" in md
