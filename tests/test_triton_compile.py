"""The triton kernels compile for real GPUs, checked on a machine without one.

The interpreter tests (tests/test_triton*.py) prove what the kernels compute; they do not
prove the compiler takes them: the interpreter runs code Triton's compiler refuses (a
plain Python global read in a kernel ran under the interpreter for months and failed on
the first H100). Here every kernel variant a set of real calls reaches is compiled to
PTX and cubin for ``sm_90`` (and ``sm_80`` in the slow tier) by
``tests/triton_compile_only.py``, in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

SCRIPT = Path(__file__).with_name("triton_compile_only.py")
SRC = Path(__file__).resolve().parents[1] / "src"


def _compile(tmp_path: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile, never reuse
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    out = _compile(tmp_path, "--arch", "90")
    # 8 calls x (forward, dK/dV, dQ): a variant that silently stopped compiling would
    # change the count
    assert "compiled 24 kernels for sm_90" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["80", "90"])
def test_every_dtype_and_head_dim_compiles(tmp_path, arch):
    out = _compile(tmp_path, "--arch", arch, "--full")
    assert f"compiled 108 kernels for sm_{arch}" in out, out
