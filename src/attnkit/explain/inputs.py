"""Turning what a learner types into tokens and embeddings for :func:`attnkit.explain.explain`."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import torch

from attnkit.examples import EXAMPLES, YOUR_JOURNEY, Example

__all__ = ["load_embeddings", "random_embeddings", "resolve_sentence", "tokenize"]

_EDGE_PUNCT = re.compile(r"^[^\w]+|[^\w]+$")


def tokenize(sentence: str) -> list[str]:
    """Split on whitespace and strip punctuation at word edges: ``"Hello shiny sun!"`` -> 3 tokens.

    Raises:
        ValueError: the sentence has no word in it.
    """
    tokens = [t for t in (_EDGE_PUNCT.sub("", w) for w in sentence.split()) if t]
    if not tokens:
        raise ValueError(f"the sentence {sentence!r} has no tokens")
    return tokens


def random_embeddings(num_tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Seeded uniform ``[0, 1)`` embeddings rounded to 2 decimals, like the seeds' ``(t, dim)``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    gen = torch.Generator().manual_seed(seed)
    return torch.round(torch.rand(num_tokens, dim, generator=gen) * 100) / 100  # (t, dim)


def load_embeddings(path: str | Path, num_tokens: int, dim: int | None = None) -> torch.Tensor:
    """Read one embedding vector per token from a JSON or CSV file.

    JSON: a list of vectors, or ``{"embeddings": [...]}`` (``attnkit explain
    --format json`` output works). CSV: one row per token; a first cell that is
    not a number is taken as the token's label and skipped.

    Args:
        path: the file; ``.json`` is read as JSON, anything else as CSV.
        num_tokens: how many vectors the sentence needs.
        dim: the width every vector must have, if given.

    Returns:
        A float32 tensor ``(num_tokens, dim)``.

    Raises:
        ValueError: unreadable file, ragged rows, wrong count or width, non-numbers.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read embeddings file {str(path)!r}: {err.strerror}") from None
    rows = _parse_json(text, path) if path.suffix.lower() == ".json" else _parse_csv(text, path)
    if len(rows) != num_tokens:
        raise ValueError(
            f"embeddings file {path.name!r} has {len(rows)} vectors but the sentence has "
            f"{num_tokens} tokens"
        )
    widths = sorted({len(r) for r in rows})
    if len(widths) != 1 or widths[0] == 0:
        raise ValueError(f"embeddings file {path.name!r} has rows of different widths {widths}")
    if dim is not None and widths[0] != dim:
        raise ValueError(
            f"embeddings file {path.name!r} has vectors of width {widths[0]}, expected --dim {dim}"
        )
    return torch.tensor(rows, dtype=torch.float32)  # (t, dim)


def _parse_json(text: str, path: Path) -> list[list[float]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"embeddings file {path.name!r} is not valid JSON: {err.msg}") from None
    except RecursionError:
        raise ValueError(f"embeddings file {path.name!r} is nested too deeply") from None
    if isinstance(data, dict):
        data = data.get("embeddings")
    if not isinstance(data, list) or not all(isinstance(r, list) for r in data):
        raise ValueError(
            f"embeddings file {path.name!r} must hold a list of vectors or {{'embeddings': [...]}}"
        )
    return [[_number(v, path, i) for v in row] for i, row in enumerate(data)]


def _parse_csv(text: str, path: Path) -> list[list[float]]:
    rows = []
    for i, row in enumerate(csv.reader(text.splitlines())):
        cells = [c.strip() for c in row if c.strip()]
        if not cells:
            continue
        if cells and not _is_number(cells[0]):
            cells = cells[1:]  # a token label
        rows.append([_number(c, path, i) for c in cells])
    return rows


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _number(value: object, path: Path, row: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"embeddings file {path.name!r} row {row}: {value!r} is not a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(
            f"embeddings file {path.name!r} row {row}: {value!r} is not a number"
        ) from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"embeddings file {path.name!r} row {row}: {value!r} is not finite")
    return number


def resolve_sentence(
    sentence: str | None,
    *,
    embeddings_file: str | Path | None = None,
    dim: int | None = None,
    seed: int = 0,
) -> tuple[list[str], torch.Tensor]:
    """Return ``(tokens, embeddings)`` for a sentence, the way ``attnkit explain`` reads it.

    No sentence means the seeds' "Your journey starts with one step". A sentence
    whose tokens are one of :data:`attnkit.examples.EXAMPLES` uses that example's
    embeddings; any other sentence needs ``embeddings_file`` or gets seeded
    random ones of width ``dim`` (3 by default).

    Raises:
        ValueError: empty sentence, or a bad embeddings file (see :func:`load_embeddings`).
    """
    tokens = list(YOUR_JOURNEY.tokens) if sentence is None else tokenize(sentence)
    if embeddings_file is not None:
        return tokens, load_embeddings(embeddings_file, len(tokens), dim)
    example = _matching_example(tokens)
    if example is not None and dim in (None, len(example.embeddings[0])):
        return list(example.tokens), example.tensor()
    return tokens, random_embeddings(len(tokens), 3 if dim is None else dim, seed)


def _matching_example(tokens: list[str]) -> Example | None:
    for example in EXAMPLES.values():
        if [t.lower() for t in tokens] == [t.lower() for t in example.tokens]:
            return example
    return None
