"""triton stays optional: attnkit imports and runs every CPU path without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_attnkit_does_not_import_triton():
    result = _run("import sys, attnkit\nassert 'triton' not in sys.modules\nprint('ok')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_attnkit_works_without_triton():
    """With triton unimportable: no triton backend, auto and every CPU backend still run."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton now raises ImportError\n"
        "import torch, attnkit\n"
        "from attnkit import attention, backends\n"
        "assert 'triton' not in backends.available_backends(), backends.available_backends()\n"
        "q = torch.randn(1, 2, 8, 4)\n"
        "for name in ['auto', *backends.available_backends()]:\n"
        "    attention(q, q, q, causal=True, backend=name)\n"
        "try:\n"
        "    attention(q, q, q, backend='triton')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "refused: unknown attention backend 'triton'" in result.stdout


def test_gpu_extra_and_dev_declare_triton():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(r.startswith("triton>=") for r in extras["gpu"])
    assert any(r.startswith("triton>=") for r in extras["dev"])
    assert not any(r.startswith("triton") for r in project["dependencies"])
