"""Every ```python block of README.md runs as pasted: the blocks of one ``##`` section run
in order in one namespace (a later block may use an earlier one's names). A block right
after ``<!-- not-run: reason -->`` is skipped (it needs a GPU, torchrun or the network);
a block that needs a missing optional extra skips its section."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.+?)\s*-->")
#: Optional extras a README block may import; without them its section is skipped.
EXTRAS = {"transformers", "matplotlib", "triton"}


@dataclass
class Block:
    """One fenced ```python block: its first line number, source and skip reason."""

    line: int
    source: str
    not_run: str | None


def readme_sections(text: str) -> dict[str, list[Block]]:
    """The ```python blocks of ``text`` by ``##`` section, in order."""
    sections: dict[str, list[Block]] = {}
    section = "(top)"
    lines = text.splitlines()
    i = 0
    previous = ""  # the last non-blank line outside a fence
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            lang = line[3:].strip()
            end = i + 1
            while not lines[end].startswith("```"):
                end += 1
            if lang == "python":
                reason = NOT_RUN.search(previous)
                block = Block(i + 2, "\n".join(lines[i + 1 : end]), reason and reason.group(1))
                sections.setdefault(section, []).append(block)
            i, previous = end + 1, ""
            continue
        if line.strip():
            previous = line
        i += 1
    return sections


SECTIONS = readme_sections(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks_and_skips_only_with_a_reason():
    blocks = [b for bs in SECTIONS.values() for b in bs]
    assert len(blocks) >= 8
    skipped = [b for b in blocks if b.not_run]
    assert all(b.not_run and b.not_run.strip() for b in skipped)
    assert len(skipped) <= 3  # a GPU/torchrun/network block each; everything else runs


def test_the_parser_groups_blocks_by_section_and_reads_not_run():
    text = (
        "## A\n```python\nx = 1\n```\n<!-- not-run: needs a GPU -->\n\n```python\ny\n```\n"
        "## B\n```bash\nls\n```\n```python\nz = 2\n```\n"
    )
    got = readme_sections(text)
    assert list(got) == ["A", "B"]
    assert [(b.source, b.not_run) for b in got["A"]] == [("x = 1", None), ("y", "needs a GPU")]
    assert [(b.line, b.source) for b in got["B"]] == [(15, "z = 2")]  # its first line


@pytest.mark.parametrize("section", list(SECTIONS))
def test_readme_section_runs(section, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict[str, object] = {"__name__": "readme"}
    ran = 0
    for block in SECTIONS[section]:
        if block.not_run:
            continue
        code = compile(block.source, f"README.md:{block.line}", "exec")
        try:
            exec(code, namespace)
        except ModuleNotFoundError as err:
            if err.name in EXTRAS:
                pytest.skip(f"README.md:{block.line} needs {err.name}")
            raise
        ran += 1
    if not ran:
        pytest.skip(f"every block of {section!r} is marked not-run")
