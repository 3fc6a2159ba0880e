"""``ATTNKIT_FUZZ_EXAMPLES`` (``make fuzz``, tests/conftest.py): every hypothesis test runs
that many random examples."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

PROBE = """
from hypothesis import given, settings, strategies as st

SEEN = []


@settings(max_examples=5, derandomize=True)
@given(st.integers(0, 10**9))
def test_probe(x):
    SEEN.append(x)


def test_count():
    with open({out!r}, "w") as f:
        f.write(f"{{len(SEEN)}} {{len(set(SEEN))}}")
"""


def _run(tmp_path: Path, examples: str | None) -> tuple[int, int]:
    """(examples run, distinct ones) of a 5-example derandomized test, run under the
    suite's conftest with ``ATTNKIT_FUZZ_EXAMPLES=examples``."""
    out = tmp_path / "count.txt"
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(PROBE.format(out=str(out)))
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_FUZZ_EXAMPLES"}
    if examples is not None:
        env["ATTNKIT_FUZZ_EXAMPLES"] = examples
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    runs, distinct = out.read_text().split()
    return int(runs), int(distinct)


def test_fuzz_examples_widens_every_hypothesis_test(tmp_path):
    """Unset, the test's own 5 derandomized examples; set to 60, 60 random ones (the
    conftest sets an attribute Hypothesis reads internally: this fails if it stops)."""
    assert _run(tmp_path, None) == (5, 5)
    runs, distinct = _run(tmp_path, "60")
    assert runs == 60 and distinct > 50
