"""Weights in and out: ``torch.nn.MultiheadAttention`` and the seed notebook's names.

Every conversion check lives here, and the import goes one way (this module imports
:mod:`attnkit.modules.multihead`, never the reverse): use :func:`from_torch_mha` and
:func:`to_torch_mha`. Only the book's :class:`~attnkit.MultiHeadAttention` converts;
a module that computes something ``nn.MultiheadAttention`` cannot (GQA, the LLM layers
of :mod:`attnkit.models` with RoPE, windows or sinks) is refused, never approximated.

Mask polarity differs between the two libraries: ``nn.MultiheadAttention``'s
boolean ``attn_mask`` and ``key_padding_mask`` mean True = *masked out*, while
attnkit's boolean masks mean True = *may attend*. Invert (``~mask``) when
moving a boolean mask from one to the other; float masks mean the same in both.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from attnkit.modules.multihead import MultiHeadAttention

__all__ = ["from_torch_mha", "load_seed_state_dict", "to_torch_mha"]

# The seed notebook names its projections query/key/value/output; the book (and
# attnkit) names them W_query/W_key/W_value/out_proj.
_SEED_NAMES = {"query": "W_query", "key": "W_key", "value": "W_value", "output": "out_proj"}


def from_torch_mha(
    module: nn.MultiheadAttention, *, context_length: int, backend: str = "auto"
) -> MultiHeadAttention:
    """Copy a ``torch.nn.MultiheadAttention``'s weights into a new :class:`MultiHeadAttention`.

    ``batch_first`` does not matter (the weights are the same); pass batch-first
    tensors to the result. attnkit's module is causal by default for
    self-attention: call it with ``causal=False`` to match an unmasked torch call.

    Args:
        module: the torch module; its query, key and value inputs must share
            ``embed_dim`` (no ``kdim``/``vdim``), without ``add_bias_kv`` or ``add_zero_attn``.
        context_length: the most query tokens the new module accepts.
        backend: attention backend of the new module.

    Raises:
        TypeError: ``module`` is not an ``nn.MultiheadAttention``.
        ValueError: it uses a feature attnkit's module does not have.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise ValueError(
            f"kdim ({module.kdim}) and vdim ({module.vdim}) must equal embed_dim "
            f"({module.embed_dim}) to convert"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn have no attnkit equivalent")
    e = module.embed_dim
    weight = module.in_proj_weight
    ours = MultiHeadAttention(
        e,
        e,
        context_length,
        module.dropout,
        module.num_heads,
        qkv_bias=module.in_proj_bias is not None,
        backend=backend,
    ).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for i, proj in enumerate((ours.W_query, ours.W_key, ours.W_value)):
            proj.weight.copy_(weight[i * e : (i + 1) * e])  # rows: q, then k, then v
            if module.in_proj_bias is not None:
                proj.bias.copy_(module.in_proj_bias[i * e : (i + 1) * e])
        ours.out_proj.weight.copy_(module.out_proj.weight)
        if module.out_proj.bias is not None:
            ours.out_proj.bias.copy_(module.out_proj.bias)
        else:
            ours.out_proj.bias.zero_()
    return ours


def to_torch_mha(module: MultiHeadAttention) -> nn.MultiheadAttention:
    """Return a ``torch.nn.MultiheadAttention`` (``batch_first=True``) with ``module``'s weights.

    Raises:
        TypeError: ``module`` is not an attnkit :class:`MultiHeadAttention` (e.g. the LLM
            layer :class:`attnkit.models.CausalSelfAttention`, whose RoPE, window and
            sinks torch's module cannot compute).
        ValueError: GQA/MQA (``num_kv_heads != num_heads``), or ``d_in != d_out``
            (torch's module projects ``embed_dim`` to ``embed_dim``).
    """
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            "to_torch_mha converts attnkit.MultiHeadAttention only, got "
            f"{type(module).__name__}: nn.MultiheadAttention has no RoPE, window, sinks, "
            "GQA or latent attention"
        )
    if module.num_kv_heads != module.num_heads:
        raise ValueError(
            "nn.MultiheadAttention has no GQA/MQA: got num_kv_heads="
            f"{module.num_kv_heads}, num_heads={module.num_heads}"
        )
    if module.d_in != module.d_out:
        raise ValueError(
            f"nn.MultiheadAttention needs d_in == d_out, got d_in={module.d_in}, d_out={module.d_out}"
        )
    e = module.d_out
    ref = module.W_query.weight
    theirs = nn.MultiheadAttention(
        e,
        module.num_heads,
        dropout=module.dropout.p,
        bias=True,
        batch_first=True,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        projections = (module.W_query, module.W_key, module.W_value)
        theirs.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
        theirs.in_proj_bias.copy_(
            torch.cat(
                [
                    p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0])
                    for p in projections
                ]
            )
        )
        theirs.out_proj.weight.copy_(module.out_proj.weight)
        theirs.out_proj.bias.copy_(module.out_proj.bias)
    return theirs


def load_seed_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
):
    """Load a state dict written by the seed notebook's (or the book's) classes.

    - The notebook's layer names ``query``/``key``/``value``/``output`` become
      ``W_query``/``W_key``/``W_value``/``out_proj``.
    - The book's ``mask`` buffers (a causal triangle attnkit computes on the fly)
      are dropped.
    - The notebook's ``output`` layer has no bias; ``out_proj.bias`` is then set
      to zeros, which makes the two modules compute the same function.

    Args:
        module: an attnkit module (any of the seed-stage classes).
        state_dict: the seed-style state dict.
        strict: passed on to ``load_state_dict``.

    Returns:
        What ``module.load_state_dict`` returns.

    Example:
        >>> load_seed_state_dict(mha, notebook_mha.state_dict())  # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    mapped: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        parts = name.split(".")
        if parts[-1] == "mask":
            continue
        mapped[".".join(_SEED_NAMES.get(p, p) for p in parts)] = tensor
    own = module.state_dict()
    for name, tensor in own.items():
        if name.endswith("out_proj.bias") and name not in mapped:
            mapped[name] = torch.zeros_like(tensor)
    return module.load_state_dict(mapped, strict=strict)
