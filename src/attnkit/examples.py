"""The seed tutorial's worked examples, as data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EXAMPLES", "HELLO_SHINY_SUN", "YOUR_JOURNEY", "Example"]


@dataclass(frozen=True)
class Example:
    """A sentence with one embedding vector per token."""

    name: str
    tokens: tuple[str, ...]
    embeddings: tuple[tuple[float, ...], ...]

    def tensor(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The embeddings as a ``(tokens, dim)`` tensor."""
        return torch.tensor(self.embeddings, dtype=dtype)


#: "Your journey starts with one step": six tokens, 3-d embeddings (the book's chapter 3).
YOUR_JOURNEY = Example(
    "journey",
    ("Your", "journey", "starts", "with", "one", "step"),
    (
        (0.43, 0.15, 0.89),
        (0.55, 0.87, 0.66),
        (0.57, 0.85, 0.64),
        (0.22, 0.58, 0.33),
        (0.77, 0.25, 0.10),
        (0.05, 0.80, 0.55),
    ),
)

#: "Hello shiny sun!": three tokens, the tutorial's hand-computed example.
HELLO_SHINY_SUN = Example(
    "hello",
    ("Hello", "shiny", "sun"),
    ((0.34, 0.22, 0.54), (0.53, 0.34, 0.98), (0.29, 0.54, 0.93)),
)

EXAMPLES = {e.name: e for e in (YOUR_JOURNEY, HELLO_SHINY_SUN)}
