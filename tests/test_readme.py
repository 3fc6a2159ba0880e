"""Every ```python block of README.md and of the documentation pages (``docs/**/*.md``)
runs as pasted: the blocks of one ``##`` section of a page run in order in one namespace
(a later block may use an earlier one's names). A block right
after ``<!-- not-run: reason -->`` is skipped (it needs a GPU, torchrun or the network);
a block that needs a missing optional extra skips its section."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose blocks run: the README, then every documentation page.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
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


def page_name(page: Path) -> str:
    """``page`` relative to the repository root, with ``/`` separators."""
    return page.relative_to(ROOT).as_posix()


#: page name -> section -> its blocks
PAGE_SECTIONS = {page_name(p): readme_sections(p.read_text(encoding="utf-8")) for p in PAGES}
SECTIONS = PAGE_SECTIONS["README.md"]


def test_the_readme_has_python_blocks_and_skips_only_with_a_reason():
    blocks = [b for bs in SECTIONS.values() for b in bs]
    assert len(blocks) >= 5  # the tutorial, attention() with a mod, the GPT, HF, context parallel
    skipped = [b for b in blocks if b.not_run]
    assert all(b.not_run and b.not_run.strip() for b in skipped)
    assert len(skipped) <= 1  # context parallelism needs torchrun; everything else runs


def test_the_docs_pages_have_python_blocks_and_skip_only_with_a_reason():
    docs = {name: s for name, s in PAGE_SECTIONS.items() if name != "README.md"}
    for page in ("docs/tutorial.md", "docs/attention.md", "docs/performance.md", "docs/llm.md"):
        assert docs[page], f"{page} has no python block"
    blocks = [b for sections in docs.values() for bs in sections.values() for b in bs]
    assert len(blocks) >= 10
    skipped = [b for b in blocks if b.not_run]
    assert all(b.not_run and b.not_run.strip() for b in skipped)
    assert len(skipped) <= 3  # a GPU/torchrun/network block each; everything else runs


def test_the_readme_quick_start_is_the_two_commands():
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [
        line.split("#")[0].strip()
        for line in quick.split("```bash", 1)[1].split("```")[0].splitlines()
    ]
    assert [c for c in commands if c] == ["make demo", "make test"]


def test_the_parser_groups_blocks_by_section_and_reads_not_run():
    text = (
        "## A\n```python\nx = 1\n```\n<!-- not-run: needs a GPU -->\n\n```python\ny\n```\n"
        "## B\n```bash\nls\n```\n```python\nz = 2\n```\n"
    )
    got = readme_sections(text)
    assert list(got) == ["A", "B"]
    assert [(b.source, b.not_run) for b in got["A"]] == [("x = 1", None), ("y", "needs a GPU")]
    assert [(b.line, b.source) for b in got["B"]] == [(15, "z = 2")]  # its first line


@pytest.mark.parametrize(
    ("page", "section"),
    [(page, section) for page, sections in PAGE_SECTIONS.items() for section in sections],
    ids=lambda value: value,
)
def test_readme_section_runs(page, section, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict[str, object] = {"__name__": "readme"}
    ran = 0
    for block in PAGE_SECTIONS[page][section]:
        if block.not_run:
            continue
        code = compile(block.source, f"{page}:{block.line}", "exec")
        try:
            exec(code, namespace)
        except ModuleNotFoundError as err:
            if err.name in EXTRAS:
                pytest.skip(f"{page}:{block.line} needs {err.name}")
            raise
        ran += 1
    if not ran:
        pytest.skip(f"every block of {page} {section!r} is marked not-run")
