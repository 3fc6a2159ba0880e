"""Packaging: the core stays light (no transformers, no matplotlib), extras exist, loads are safe."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_attnkit_loads_no_optional_dependency() -> None:
    code = (
        "import sys, attnkit, attnkit.checkpoints, attnkit.integrations\n"
        "heavy = sorted(m for m in ('transformers', 'matplotlib', 'safetensors') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "print('ok', attnkit.__version__)\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


def test_extras_are_declared() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(req.startswith("transformers>=") for req in extras["hf"])
    assert any(req.startswith("matplotlib") for req in extras["viz"])
    assert any(req.startswith("safetensors") for req in project["dependencies"])


def test_hf_minimum_version_matches_the_extra() -> None:
    """The version the integration checks at register() is the one the extra asks for."""
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("transformers")
    from attnkit.integrations.hf import MIN_TRANSFORMERS_VERSION

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (req,) = [r for r in extras["hf"] if r.startswith("transformers")]
    assert req == f"transformers>={MIN_TRANSFORMERS_VERSION.removesuffix('.0')}"


def _torch_load_calls() -> list[tuple[Path, ast.Call]]:
    calls = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                calls.append((path, node))
    return calls


def test_every_torch_load_is_weights_only() -> None:
    calls = _torch_load_calls()
    assert calls, "expected at least attnkit.checkpoints's torch.load"
    for path, call in calls:
        kw = {k.arg: k.value for k in call.keywords}
        ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
        assert ok, f"{path.relative_to(ROOT)}:{call.lineno}: torch.load without weights_only=True"


def test_license_file_is_the_mit_license_the_metadata_names() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text


def test_runtime_imports_are_declared_dependencies() -> None:
    """tqdm was imported by `attnkit bench` but not declared: a bare install crashed."""
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps}
    assert {"torch", "numpy", "safetensors", "tqdm", "jinja2"} <= names


def test_python_dash_m_attnkit_runs_the_cli() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run(
        [sys.executable, "-m", "attnkit", "--help"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and "train" in r.stdout and "generate" in r.stdout


def test_wheel_ships_the_native_kernel_source(tmp_path) -> None:
    """The native kernel is built from attention.cpp at run time: the wheel must carry it."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} is older than the build needs")
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (wheel,) = tmp_path.glob("attnkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "attnkit/backends/blockwise/native/attention.cpp" in names
    assert "attnkit/py.typed" in names
    # the tutorial page renders from its templates and language files
    for name in ("templates/page.html.j2", "templates/page.css", "templates/page.js",
                 "lang/en.json", "lang/ja.json", "lang/pt.json"):  # fmt: skip
        assert f"attnkit/explain/page/{name}" in names, name
    for asset in ("templates/page.html.j2", "static/views.js", "static/views.css"):
        assert f"attnkit/viz/page/{asset}" in names  # the views page, inlined when written


def _make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """The Makefile's rules: target -> (prerequisites, recipe lines), variables expanded."""
    text = (ROOT / "Makefile").read_text().replace("$(VENV)", ".venv")
    rules: dict[str, tuple[list[str], list[str]]] = {}
    target = None
    for line in text.splitlines():
        if line.startswith("\t") and target is not None:
            rules[target][1].append(line.strip())
        elif ":" in line and not line.startswith(("#", ".PHONY")) and "=" not in line:
            target, prereqs = line.split(":", 1)
            rules[target] = (prereqs.split(), [])
        else:
            target = None
    return rules


def test_make_demo_installs_the_viz_extra_and_make_test_the_dev_set() -> None:
    """``make demo`` must not wait for the dev tools (triton, transformers, ...)."""
    rules = _make_rules()
    (demo_stamp,) = rules["demo"][0]
    (test_stamp,) = rules["test"][0]
    demo_install = " ".join(rules[demo_stamp][1])
    assert '-e ".[viz]"' in demo_install and "[dev]" not in demo_install
    assert demo_install.index("TORCH_SPEC") < demo_install.index(".[viz]")  # torch first
    assert demo_stamp in rules[test_stamp][0] and '-e ".[dev]"' in " ".join(rules[test_stamp][1])
