"""How mask mods and score mods are called: FlexAttention's scalar semantics, one home.

A mod is written as if its indices were scalars (``flex_attention``'s contract):
``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx)
-> score``. Such a mod may index captured tensors in any way (``bias[q_idx][kv_idx]``,
``bias[b][q_idx]``, ``table[h].sum()``), which broadcast index grids would get wrong,
so attnkit evaluates it, like FlexAttention, through nested :func:`torch.vmap` over
``b``, ``h``, ``q_idx`` and ``kv_idx``: every index is a scalar inside the mod.

attnkit's own mods (:mod:`attnkit.masks`) are written for broadcast grids as well
and say so with a true ``grid`` attribute; they are called once on broadcastable
``(b, h, q, kv)`` index tensors, which is faster and gives the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["eval_mask_mod", "eval_score_mod", "grad_leaves", "is_grid_mod", "mod_name"]


def mod_name(mod: Any) -> str:
    """A readable name of a mod, for error messages."""
    name = getattr(mod, "__qualname__", None) or getattr(mod, "__name__", None)
    return name if isinstance(name, str) else repr(mod)


def is_grid_mod(mod: Any) -> bool:
    """Whether ``mod`` may be called on broadcast index grids (attnkit's own mods)."""
    return getattr(mod, "grid", False) is True


def _grids(
    b: int, h: int, q0: int, q1: int, k0: int, k1: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.arange(b, device=device).view(-1, 1, 1, 1),
        torch.arange(h, device=device).view(1, -1, 1, 1),
        torch.arange(q0, q1, device=device).view(1, 1, -1, 1),
        torch.arange(k0, k1, device=device).view(1, 1, 1, -1),
    )


def _vmapped(fn: Callable[..., Any], with_score: bool) -> Callable[..., Any]:
    """``fn`` mapped over ``(b, h, q_idx, kv_idx)``: every index a scalar inside ``fn``."""

    def call(*args: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(fn(*args))

    mapped: Callable[..., Any] = call
    # innermost kv, then q, h, b; a score is mapped on its leading dim at every level
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
        mapped = torch.vmap(mapped, in_dims=((0, *dims) if with_score else dims))
    last = (0, None, None, None)
    return torch.vmap(mapped, in_dims=((0, *last) if with_score else last))


def eval_mask_mod(
    mod: Callable[..., Any],
    b: int,
    h: int,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    device: torch.device,
) -> torch.Tensor:
    """``mod`` on rows ``[q0, q1)`` x keys ``[k0, k1)``: bool ``(b|1, h|1, q1-q0, k1-k0)``.

    Raises:
        TypeError: naming the mod, when it fails or returns something that is not one
            value per ``(b, h, q_idx, kv_idx)``.
    """
    shape = (b, h, q1 - q0, k1 - k0)
    idx = _grids(b, h, q0, q1, k0, k1, device)
    try:
        if is_grid_mod(mod):
            out = torch.as_tensor(mod(*idx), device=device)
        else:
            out = _vmapped(mod, False)(*(i.flatten() for i in idx))
            # vmap expands an output that does not depend on an index (stride 0):
            # keep one copy, so a mask that is the same for every batch/head is stored once
            for dim in (0, 1):
                if out.dim() == 4 and out.shape[dim] > 1 and out.stride(dim) == 0:
                    out = out.narrow(dim, 0, 1)
    except Exception as err:
        raise TypeError(
            f"mask_mod {mod_name(mod)} failed on scalar indices (b, h, q_idx, kv_idx): "
            f"{err}{_device_hint(err, device)}"
        ) from err
    out = _fit(out, shape, "mask_mod", mod).to(torch.bool)
    return out.expand(out.shape[0], out.shape[1], q1 - q0, k1 - k0)  # (b|1, h|1, rows, keys)


def eval_score_mod(
    mod: Callable[..., Any],
    score: torch.Tensor,
    q0: int,
    k0: int,
) -> torch.Tensor:
    """``mod`` on a score tile ``(b, h, bq, bk)`` whose first row is query ``q0``, first
    column key ``k0``; returns the modded scores ``(b, h, bq, bk)``, differentiable.

    Raises:
        TypeError: naming the mod, when it fails, returns something that is not one value
            per ``(b, h, q_idx, kv_idx)``, or returns integer or bool scores (which no
            softmax takes) instead of floating ones.
    """
    b, h, bq, bk = score.shape
    idx = _grids(b, h, q0, q0 + bq, k0, k0 + bk, score.device)
    try:
        if is_grid_mod(mod):
            out = mod(score, *idx)
        else:
            out = _vmapped(mod, True)(score, *(i.flatten() for i in idx))
    except Exception as err:
        raise TypeError(
            f"score_mod {mod_name(mod)} failed on scalar indices (score, b, h, q_idx, kv_idx): "
            f"{err}{_device_hint(err, score.device)}"
        ) from err
    out = _fit(torch.as_tensor(out), score.shape, "score_mod", mod)
    if not out.is_floating_point():
        raise TypeError(
            f"score_mod {mod_name(mod)} must return floating scores; it returned dtype "
            f"{out.dtype} (for scores of dtype {score.dtype})"
        )
    return out


def _device_hint(err: Exception, device: torch.device) -> str:
    """What to do when a mod fails because a tensor it captures is on another device."""
    if "device" not in str(err):
        return ""
    return (
        f" (the indices are on the call's device, {device}: a tensor the mod captures must "
        "be there too, as in FlexAttention)"
    )


def _fit(
    out: torch.Tensor, shape: tuple[int, ...] | torch.Size, what: str, mod: Any
) -> torch.Tensor:
    """Check ``out`` is one value per index (broadcastable to ``shape``) and give it rank 4."""
    try:
        ok = out.dim() <= 4 and torch.broadcast_shapes(out.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise TypeError(
            f"{what} {mod_name(mod)} must return one value per (b, h, q_idx, kv_idx); "
            f"got shape {tuple(out.shape)} for {tuple(shape)}"
        )
    while out.dim() < 4:
        out = out.unsqueeze(0)
    return out


def grad_leaves(
    mod: Callable[..., Any], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The tensors requiring grad that a score_mod's output depends on, however it reaches
    them (closure, dict, ``functools.partial``, bound method, nested mod, ``nn.Module``).

    The mod is probed once on a 1-element tile under grad and the autograd graph of its
    output walked back to its leaves. A captured non-leaf (``w = p * 2``) leads to ``p``:
    its gradient is then taken through ``w``'s graph (kept for it: ``retain_graph``).

    Raises:
        TypeError: naming the mod, when it fails on the probe.
    """
    score = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device, requires_grad=True)
    with torch.enable_grad():
        out = eval_score_mod(mod, score, 0, 0)
    if not out.requires_grad or out.grad_fn is None:
        return ()
    return autograd_leaves(out.grad_fn, exclude=score)


def autograd_leaves(root: Any, exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The leaf tensors (``AccumulateGrad`` variables) an autograd graph reaches from
    ``root`` (a ``grad_fn``), each once, in the order found; ``exclude`` is left out."""
    leaves: dict[int, torch.Tensor] = {}
    stack: list[Any] = [root]
    # torch makes a node's Python object when it is reached and may free it once unused, so
    # a later node can get a freed one's id: ``seen`` holds the visited objects, keeping
    # them alive while their ids mark them seen (a reused id skipped a captured tensor's
    # node on torch 2.11)
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor) and var is not exclude:
            leaves.setdefault(id(var), var)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return tuple(leaves.values())
