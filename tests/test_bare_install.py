"""A bare install: torch + attnkit's declared dependencies only, no extras.

A real ``pip install`` of torch takes minutes, so the venv is assembled in seconds instead:
``python -m venv --without-pip``, then the distributions of the requirement closure of
``pyproject.toml``'s ``dependencies`` (read from this environment's metadata) are symlinked
into its ``site-packages``, and ``src/`` is added with a ``.pth`` file. Anything attnkit
imports without declaring it (tqdm once) is missing there, as after ``pip install attnkit``.
Every subcommand's smallest form must then work, or say in one line which extra it needs.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _requirement(spec: str):
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(spec)


def _closure(specs: list[str]) -> dict[str, metadata.Distribution]:
    todo, found = list(specs), {}
    while todo:
        req = _requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in found:
            continue
        found[key] = metadata.distribution(req.name)
        todo.extend(found[key].requires or [])
    return found


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared() -> list[str]:
    return _pyproject()["dependencies"]


def _venv(root: Path, specs: list[str]) -> Path:
    """A venv holding the requirement closure of ``specs`` (symlinked) and ``src/``."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    site = Path(purelib)
    for dist in _closure(specs).values():
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    (site / "attnkit-src.pth").write_text(str(SRC) + "\n")
    return python


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return _venv(tmp_path_factory.mktemp("bare"), _declared())


@pytest.fixture(scope="module")
def demo_python(tmp_path_factory) -> Path:
    """What ``make demo`` installs: the declared dependencies and the ``[viz]`` extra."""
    viz = _pyproject()["optional-dependencies"]["viz"]
    return _venv(tmp_path_factory.mktemp("demo"), [*_declared(), *viz])


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # one thread: these check what an install can run, not its speed, and share the
    # machine with the other test workers (under `-m slow` the whole demo's training at
    # 2 threads beside another worker's ran at a fifteenth of its speed and timed out)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [str(python), "-I", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_bare_venv_has_no_extras(bare_python, tmp_path):
    code = (
        "import importlib.util as u\n"
        "print([m for m in ('matplotlib', 'transformers', 'pytest', 'hypothesis') if u.find_spec(m)])"
    )
    r = _run(bare_python, "-c", code, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


_WALK = r"""
import contextlib, io, json, sys
from attnkit.cli import main
for argv in [a.split("|") for a in sys.argv[1:]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    print("@@", json.dumps([argv[0], code, err.getvalue()]), flush=True)
"""


def test_every_subcommand_works_bare_or_names_its_extra(bare_python, tmp_path):
    r = _run(bare_python, "-m", "attnkit", "--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("attnkit "), r.stderr
    ck = tmp_path / "ck"
    argvs = [
        "explain",
        "viz|-o|view.html",
        "demo|--no-gpt|--out|tour",
        f"train|--task|copy|--length|2|--steps|3|--batch-size|4|--quiet|--out|{ck}",
        f"generate|--checkpoint|{ck}|--prompt|12>",
        "serve|--demo|--requests|2|--max-new-tokens|3",
        f"serve|--checkpoint|{ck}|--prompt|12>|--prompt|1>",
        "viz|-o|view.png",
    ]
    r = _run(bare_python, "-c", _WALK, *argvs, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    results = [json.loads(line[3:]) for line in r.stdout.splitlines() if line.startswith("@@ ")]
    codes = [(name, code) for name, code, _ in results[:-1]]
    names = ["explain", "viz", "demo", "train", "generate", "serve", "serve"]
    assert codes == [(name, 0) for name in names], r.stdout
    _, code, err = results[-1]  # a PNG needs matplotlib: one line naming the extra
    assert code == 2 and err.count("\n") == 1 and "attnkit[viz]" in err, err
    assert "pictures skipped" in r.stdout and "attnkit[viz]" in r.stdout  # train, no traceback
    assert (tmp_path / "view.html").is_file() and (tmp_path / "tour" / "maps").is_dir()
    assert (ck / "model.safetensors").is_file() and not (ck / "loss.png").exists()
    # bench: its run-time imports (the full --quick run is the slow test below)
    code = "from tqdm.auto import tqdm; import attnkit.bench.suite, attnkit.bench.report"
    r = _run(bare_python, "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


_DEV_ONLY = ("pytest", "transformers", "triton", "hypothesis", "ruff", "mypy")


def test_the_demo_runs_with_the_viz_extra_alone(demo_python, tmp_path):
    """``make demo`` installs ``.[viz]`` only (not the dev set): the demo's stages, the
    explain walkthrough and its pictures must need nothing more."""
    code = f"import importlib.util as u; print([m for m in {_DEV_ONLY!r} if u.find_spec(m)])"
    r = _run(demo_python, "-c", code, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    r = _run(demo_python, "-m", "attnkit", "demo", "--no-gpt", "--out", "tour", cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert list((tmp_path / "tour" / "maps").glob("*.png")), r.stdout


@pytest.mark.slow
def test_the_whole_demo_runs_with_the_viz_extra_alone(demo_python, tmp_path):
    r = _run(demo_python, "-m", "attnkit", "demo", "--out", "tour", cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "pictures skipped" not in r.stdout
    assert (tmp_path / "tour" / "gpt" / "loss.png").is_file()


@pytest.mark.slow
def test_bench_quick_runs_bare(bare_python, tmp_path):
    r = _run(
        bare_python,
        "-m",
        "attnkit",
        "bench",
        "--quick",
        "--reps",
        "1",
        "--quiet",
        "--serving",
        "--out",
        "b",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "plots: skipped" in r.stdout and (tmp_path / "b" / "results.json").is_file()
    assert "skipped (needs transformers: pip install 'attnkit[hf]')" in r.stdout
