"""Static types of the public API, checked by mypy (the configuration in pyproject.toml)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

SNIPPET = """
    import torch
    from typing_extensions import assert_type

    import attnkit

    q = torch.rand(1, 2, 4, 8)
    assert_type(attnkit.attention(q, q, q), torch.Tensor)
    shape: torch.Size = attnkit.attention(q, q, q).shape
    out, weights = attnkit.attention(q, q, q, need_weights=True)
    assert_type(weights, torch.Tensor)
    out, lse = attnkit.attention(q, q, q, return_lse=True)
    out, weights, lse = attnkit.attention(q, q, q, need_weights=True, return_lse=True)
    assert_type(lse, torch.Tensor)
    flag = bool(torch.rand(()) > 0.5)
    assert_type(attnkit.attention(q, q, q, need_weights=flag), torch.Tensor | tuple[torch.Tensor, ...])
"""


@pytest.mark.slow  # mypy parses torch's stubs: ~15 s of CPU; `make` will run mypy on src
def test_attention_overloads_type_check(tmp_path):
    """Regression: attention() returned a union, so `attention(q, k, v).shape` failed mypy."""
    api = pytest.importorskip("mypy.api")
    src = Path(__file__).resolve().parents[1] / "src"
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(SNIPPET))
    env_path = os.environ.get("MYPYPATH")
    os.environ["MYPYPATH"] = str(src)
    try:
        stdout, stderr, status = api.run(
            [str(snippet), "--python-version", f"{sys.version_info[0]}.{sys.version_info[1]}"]
        )
    finally:
        if env_path is None:
            os.environ.pop("MYPYPATH", None)
        else:
            os.environ["MYPYPATH"] = env_path
    assert status == 0, stdout + stderr
