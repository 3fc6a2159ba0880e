"""Smoke test of the eager-vs-compiled benchmark (``python -m attnkit.bench.compile``).

Uses ``--quick`` sizes and dynamo's ``eager`` compiler (tracing without inductor code
generation) so it takes seconds; the real measurement is the benchmark run itself. The
run is a process of its own, as a user's is: inside a test worker, dynamo state left by
other test files once broke the decode workload's guards (an IndexError in torch).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from attnkit.bench import compile as bench_compile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_quick_run_writes_json_and_markdown(tmp_path):
    argv = ["--quick", "--backends", "reference", "sdpa", "--compiler", "eager"]
    done = subprocess.run(
        [sys.executable, "-m", "attnkit.bench.compile", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "compile.json").read_text())
    rows = result["rows"]
    assert [(r["workload"], r["backend"]) for r in rows] == [
        (w, b) for w in ("mha", "gpt", "decode") for b in ("reference", "sdpa")
    ]
    for r in rows:  # compiled output equals eager output, timings are positive
        assert r["max_abs_diff"] < 1e-5, r
        assert r["eager_ms"] > 0 and r["compiled_ms"] > 0
        assert r["speedup"] == pytest.approx(r["eager_ms"] / r["compiled_ms"])
    table = (tmp_path / "compile.md").read_text()
    assert sum(line.startswith("|") for line in table.splitlines()) == 2 + len(rows)
    assert "| decode | sdpa |" in table and "--quick" in table
    assert "compile.json" in done.stdout


def test_unknown_backend_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_compile.main(["--quick", "--backends", "nope", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert not (tmp_path / "compile.json").exists()
