"""Training data: synthetic tasks that need attention, and byte-level text.

Every task sequence is ``question '>' answer``; the loss covers the answer only.

=========  =======================  ==========
task       question                 answer
=========  =======================  ==========
copy       ``31415926``             ``31415926``
reverse    ``31415926``             ``62951413``
sort       ``31415926``             ``11234569``
recall     ``a3c1f4?c``             ``1``  (the value stored under key ``c``)
=========  =======================  ==========
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["TASKS", "TASK_SYMBOLS", "ByteTokenizer", "CharTokenizer", "TaskData", "TextData"]

TASKS = ("copy", "reverse", "sort", "recall")
#: One symbol set for every task: digits are values, letters are recall keys.
TASK_SYMBOLS = "0123456789abcdefghij?>"
IGNORE = -100  # target id the loss skips


class CharTokenizer:
    """One token per character of ``symbols``."""

    kind = "chars"

    def __init__(self, symbols: str = TASK_SYMBOLS) -> None:
        if not symbols or len(set(symbols)) != len(symbols):
            raise ValueError(f"symbols must be distinct characters, got {symbols!r}")
        self.symbols = symbols
        self._ids = {c: i for i, c in enumerate(symbols)}

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        """Return the ids of ``text``; unknown characters raise ValueError naming them."""
        bad = sorted({c for c in text if c not in self._ids})
        if bad:
            raise ValueError(f"characters {bad} are not in the vocabulary {self.symbols!r}")
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.symbols[i] for i in ids)

    def labels(self, ids: list[int]) -> list[str]:
        """One printable label per token (its character), for the axes of pictures."""
        return [self.symbols[i] for i in ids]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "symbols": self.symbols}


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256)."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def labels(self, ids: list[int]) -> list[str]:
        """One printable label per byte, for the axes of pictures: the character for
        printable ASCII, ``␣`` for a space, an escape such as ``\\n`` or ``0xe2`` otherwise."""
        out = []
        for i in ids:
            c = chr(i)
            if c == " ":
                out.append("\u2423")
            elif c.isprintable() and i < 128:
                out.append(c)
            elif c in "\n\t\r":
                out.append(repr(c)[1:-1])
            else:
                out.append(f"0x{i:02x}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


def tokenizer_from_dict(data: dict[str, Any]) -> CharTokenizer | ByteTokenizer:
    """Rebuild a tokenizer saved with ``to_dict``."""
    if data.get("kind") == "bytes":
        return ByteTokenizer()
    if data.get("kind") == "chars" and isinstance(data.get("symbols"), str):
        return CharTokenizer(data["symbols"])
    raise ValueError(f"unknown tokenizer description {data!r}")


class TaskData:
    """Random batches of a synthetic task.

    Args:
        task: one of :data:`TASKS`.
        length: digits per question (copy/reverse/sort) or key/value pairs (recall).
    """

    def __init__(self, task: str, length: int = 8) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
        if not isinstance(length, int) or length <= 0 or (task == "recall" and length > 10):
            raise ValueError(f"length must be a positive int (<= 10 for recall), got {length!r}")
        self.task, self.length = task, length
        self.tokenizer = CharTokenizer()
        self.answer_len = 1 if task == "recall" else length
        self.prompt_len = 2 * length + 3 if task == "recall" else length + 1
        self.seq_len = self.prompt_len + self.answer_len  # tokens in a full sequence

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Return ``n`` full sequences ``(n, seq_len)`` of token ids."""
        sep = torch.full((n, 1), TASK_SYMBOLS.index(">"), dtype=torch.long)
        if self.task == "recall":
            keys = torch.argsort(torch.rand(n, 10, generator=generator), dim=1)[:, : self.length]
            vals = torch.randint(0, 10, (n, self.length), generator=generator)
            pairs = torch.stack((keys + 10, vals), dim=2).reshape(n, -1)  # (n, 2 * length)
            pick = torch.randint(0, self.length, (n, 1), generator=generator)
            ask = torch.full((n, 1), TASK_SYMBOLS.index("?"), dtype=torch.long)
            answer = vals.gather(1, pick)
            return torch.cat((pairs, ask, keys.gather(1, pick) + 10, sep, answer), dim=1)
        digits = torch.randint(0, 10, (n, self.length), generator=generator)
        if self.task == "copy":
            answer = digits
        elif self.task == "reverse":
            answer = digits.flip(1)
        else:
            answer = digits.sort(dim=1).values
        return torch.cat((digits, sep, answer), dim=1)

    def batch(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, targets)``, each ``(n, seq_len - 1)``; only answers are scored."""
        seq = self.sample(n, generator)
        targets = seq[:, 1:].clone()
        targets[:, : self.prompt_len - 1] = IGNORE
        return seq[:, :-1], targets


class TextData:
    """Random windows of a text file as byte-level tokens.

    Raises:
        ValueError: an empty or unreadable file, or one shorter than two bytes.
    """

    def __init__(self, path: str | Path, context_length: int) -> None:
        try:
            raw = Path(path).read_bytes()
        except OSError as err:
            raise ValueError(f"cannot read text file {str(path)!r}: {err.strerror}") from None
        if len(raw) < 2:
            raise ValueError(f"text file {str(path)!r} is empty (needs at least 2 bytes)")
        self.tokenizer = ByteTokenizer()
        self.data = torch.tensor(list(raw), dtype=torch.long)
        self.seq_len = min(context_length, len(raw) - 1) + 1

    def batch(
        self, n: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, targets)`` ``(n, seq_len - 1)``: targets are inputs shifted by one."""
        starts = torch.randint(0, len(self.data) - self.seq_len + 1, (n,), generator=generator)
        idx = starts[:, None] + torch.arange(self.seq_len)  # (n, seq_len)
        seq = self.data[idx]
        return seq[:, :-1], seq[:, 1:]
