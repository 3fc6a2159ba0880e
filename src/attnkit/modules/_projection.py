"""One matmul for the query, key and value projections of self-attention.

``MultiHeadAttention`` keeps three ``nn.Linear`` layers (the seeds' W_query, W_key,
W_value); for self-attention their weights can be stacked and applied in a single
matmul, which is what ``nn.MultiheadAttention``'s packed ``in_proj`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fused_qkv(
    x: torch.Tensor, W_query: nn.Linear, W_key: nn.Linear, W_value: nn.Linear
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(W_query(x), W_key(x), W_value(x))`` computed with one matmul.

    Args:
        x: ``(b, t, d_in)``.
        W_query, W_key, W_value: the projections; all with a bias or all without.

    Returns:
        Three ``(b, t, d_out)`` tensors (views into one ``(b, t, 3 * d_out)`` result).
    """
    biases = [W_query.bias, W_key.bias, W_value.bias]
    if any(b is None for b in biases) != all(b is None for b in biases):
        raise ValueError("W_query, W_key and W_value must all have a bias or none")
    weight = torch.cat((W_query.weight, W_key.weight, W_value.weight))  # (3 * d_out, d_in)
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    qkv = F.linear(x, weight, bias)  # (b, t, 3 * d_out)
    return qkv.split(W_query.out_features, dim=-1)
