"""Turning what a learner types into tokens and embeddings for :func:`attnkit.explain.explain`."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import torch

from attnkit._validate import check_int
from attnkit.examples import EXAMPLES, YOUR_JOURNEY, Example

__all__ = [
    "load_embeddings",
    "random_embeddings",
    "read_embeddings",
    "resolve_sentence",
    "resolve_sentence_source",
    "tokenize",
]

_TOKEN = re.compile(r"\w+(?:['\u2019]\w+)*|[^\w\s]")


def tokenize(sentence: str) -> list[str]:
    """Words and punctuation marks, each its own token: ``"Hello, sun!"`` -> 4 tokens
    (``Hello``, ``,``, ``sun``, ``!``). Apostrophes inside a word stay (``don't``).

    Raises:
        ValueError: the sentence has no token in it.
    """
    tokens = _TOKEN.findall(sentence)
    if not tokens:
        raise ValueError(f"the sentence {sentence!r} has no tokens")
    return tokens


def random_embeddings(num_tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Seeded uniform ``[0, 1)`` embeddings rounded to 2 decimals, like the seeds' ``(t, dim)``."""
    check_int(dim, "dim")
    gen = torch.Generator().manual_seed(seed)
    return torch.round(torch.rand(num_tokens, dim, generator=gen) * 100) / 100  # (t, dim)


def load_embeddings(path: str | Path, num_tokens: int, dim: int | None = None) -> torch.Tensor:
    """Read one embedding vector per token from a JSON or CSV file.

    JSON: a list of vectors, or ``{"embeddings": [...]}`` (``attnkit explain
    --format json`` output works). CSV: one row per token; a first cell that is
    not a number is the token's label, and a first row with no number is a header.

    Args:
        path: the file; ``.json`` is read as JSON, anything else as CSV.
        num_tokens: how many vectors the sentence needs.
        dim: the width every vector must have, if given.

    Returns:
        A float32 tensor ``(num_tokens, dim)``.

    Raises:
        ValueError: unreadable file, ragged rows, wrong count or width, non-numbers.
    """
    return read_embeddings(path, num_tokens, dim)[1]


def read_embeddings(
    path: str | Path, num_tokens: int | None = None, dim: int | None = None
) -> tuple[list[str] | None, torch.Tensor]:
    """Like :func:`load_embeddings`, also returning the CSV's token labels (None if it has none).

    ``num_tokens=None`` accepts any number of vectors.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read embeddings file {str(path)!r}: {err.strerror}") from None
    labels: list[str] | None = None
    if path.suffix.lower() == ".json":
        rows = _parse_json(text, path)
    else:
        labels, rows = _parse_csv(text, path)
    if not rows or (num_tokens is not None and len(rows) != num_tokens):
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
    return labels, torch.tensor(rows, dtype=torch.float32)  # (t, dim)


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


def _parse_csv(text: str, path: Path) -> tuple[list[str] | None, list[list[float]]]:
    rows: list[list[float]] = []
    labels: list[str] = []
    for i, row in enumerate(csv.reader(text.splitlines())):
        cells = [c.strip() for c in row if c.strip()]
        if not cells:
            continue
        if not rows and not any(_is_number(c) for c in cells):
            continue  # a header row: "token,x,y,z"
        if not _is_number(cells[0]):
            labels.append(cells[0])  # a token label
            cells = cells[1:]
        rows.append([_number(c, path, i) for c in cells])
    if labels and len(labels) != len(rows):
        raise ValueError(f"embeddings file {path.name!r}: some rows have a token label, some not")
    return (labels or None), rows


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

    See :func:`resolve_sentence_source`, which also says where the embeddings came from.
    """
    tokens, x, _ = resolve_sentence_source(
        sentence, embeddings_file=embeddings_file, dim=dim, seed=seed
    )
    return tokens, x


def resolve_sentence_source(
    sentence: str | None,
    *,
    embeddings_file: str | Path | None = None,
    dim: int | None = None,
    seed: int = 0,
) -> tuple[list[str], torch.Tensor, str]:
    """Return ``(tokens, embeddings, source)``; ``source`` says where the vectors came from.

    No sentence means the seeds' "Your journey starts with one step" (or, with a CSV
    whose rows carry labels, those labels). A sentence whose words are one of
    :data:`attnkit.examples.EXAMPLES` uses that example's tokens and embeddings (the book
    leaves out the punctuation: "Hello shiny sun!" is 3 tokens); any other sentence keeps
    its punctuation marks as tokens and needs ``embeddings_file`` or gets seeded random
    embeddings of width ``dim`` (3 by default), labelled as random.

    Raises:
        ValueError: empty sentence, labels that differ from the sentence, or a bad
            embeddings file (see :func:`load_embeddings`).
    """
    if embeddings_file is not None:
        tokens = None if sentence is None else tokenize(sentence)
        labels, x = read_embeddings(embeddings_file, None if tokens is None else len(tokens), dim)
        if tokens is None:
            tokens = labels if labels is not None else list(YOUR_JOURNEY.tokens)
            if len(tokens) != len(x):
                raise ValueError(
                    f"embeddings file {Path(embeddings_file).name!r} has {len(x)} vectors but "
                    f"the sentence has {len(tokens)} tokens"
                )
        elif labels is not None and [t.lower() for t in labels] != [t.lower() for t in tokens]:
            raise ValueError(
                f"embeddings file labels {labels} differ from the sentence's tokens {tokens}"
            )
        return tokens, x, f"from {Path(embeddings_file).name}"
    tokens = list(YOUR_JOURNEY.tokens) if sentence is None else tokenize(sentence)
    example = _matching_example([t for t in tokens if re.match(r"\w", t)])
    if example is not None and dim in (None, len(example.embeddings[0])):
        return list(example.tokens), example.tensor(), "the seeds' embeddings"
    width = 3 if dim is None else dim
    source = f"random (seed {seed}, width {width}): not learned, they carry no meaning"
    return tokens, random_embeddings(len(tokens), width, seed), source


def _matching_example(tokens: list[str]) -> Example | None:
    for example in EXAMPLES.values():
        if [t.lower() for t in tokens] == [t.lower() for t in example.tokens]:
            return example
    return None
