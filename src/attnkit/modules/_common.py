"""Input checks and small helpers shared by the seed-stage modules."""

from __future__ import annotations

import torch
from torch import nn

from attnkit._validate import check_int


def check_input(
    x: torch.Tensor, d_in: int | None, context_length: int | None = None, name: str = "x"
) -> tuple[torch.Tensor, bool]:
    """Validate ``x`` and return it as ``(batch, tokens, d_in)`` plus "was unbatched".

    ``d_in=None`` accepts any feature size.

    Raises:
        TypeError: ``x`` is not a float tensor.
        ValueError: wrong rank, last dim != ``d_in``, or more tokens than ``context_length``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be (batch, tokens, d_in) or (tokens, d_in), got shape {tuple(x.shape)}"
        )
    if d_in is not None and x.shape[-1] != d_in:
        raise ValueError(f"{name} has {x.shape[-1]} features in its last dim, expected d_in={d_in}")
    if context_length is not None and x.shape[-2] > context_length:
        raise ValueError(
            f"{name} has {x.shape[-2]} tokens, more than context_length={context_length}"
        )
    unbatched = x.dim() == 2
    return (x.unsqueeze(0) if unbatched else x), unbatched


def check_dims(**dims: int) -> None:
    """Check that every named dimension is a positive int (``bool`` is not an int).

    Raises:
        TypeError: a value that is not an int (a ``bool``, a float, ...).
        ValueError: an int below 1.
    """
    for name, value in dims.items():
        check_int(value, name)


def active_dropout(dropout: nn.Dropout, training: bool) -> float:
    """The probability to pass to the core: the module's ``p`` in training, else 0."""
    return dropout.p if training else 0.0
