"""The ``blockwise`` backend: FlashAttention-style tiles with skipping, mods and an O(t) backward.

It walks tiles of queries against tiles of keys, merges them through their
log-sum-exps and keeps only the output and the log-sum-exp (``O(t)`` per head);
its backward recomputes each tile's weights from the log-sum-exp, so no ``t × s``
tensor is ever saved. Tiles that causal, a sliding window, a bool mask or a
``mask_mod`` leave empty are skipped. ``score_mod`` gradients flow into the mod's
tensors (found on the mod: a ``tensors`` attribute, an ``nn.Module``'s parameters,
or closure cells).

Two engines compute the tiles (:data:`ENGINE`):

* on CPU, torch's fused flash kernel, called once per key segment of a query tile
  (:mod:`attnkit.backends._fused_tiles`): every request except a ``score_mod``
  that is not additive or whose tensors need gradients;
* everywhere else, PyTorch ops with an online softmax
  (:mod:`attnkit.backends._blockwise_autograd`): every request, any device.

It hands off (``supports`` returns a reason) rather than drop a request:
dropout, a float mask that requires grad, and weights while gradients are being
recorded (weights recomputed from the log-sum-exp carry no gradient).
"""

from __future__ import annotations

import torch
from torch import nn

from attnkit.backends import AttentionCall, BackendResult, _fused_tiles, register_backend
from attnkit.backends._blockwise_autograd import BlockwiseAttention, weights_from_lse
from attnkit.backends._tiles import build_plan
from attnkit.masks import ScoreMod

__all__ = ["ENGINE", "blockwise_attention", "score_mod_tensors"]

#: ``"auto"``: run the tiles on torch's fused CPU flash kernel where it can do the
#: whole request exactly (:mod:`attnkit.backends._fused_tiles`), else on PyTorch ops;
#: ``"tiles"``: always PyTorch ops (every request, any device).
ENGINE = "auto"


def score_mod_tensors(score_mod: ScoreMod | None) -> tuple[torch.Tensor, ...]:
    """The tensors a ``score_mod`` reads that may need gradients.

    Looked up, in order: an explicit ``score_mod.tensors`` sequence, the parameters
    of an ``nn.Module``, and tensors (or modules) captured in a closure.
    """
    if score_mod is None:
        return ()
    found: list[torch.Tensor] = []
    explicit = getattr(score_mod, "tensors", None)
    if explicit is not None:
        found.extend(t for t in explicit if isinstance(t, torch.Tensor))
    elif isinstance(score_mod, nn.Module):
        found.extend(score_mod.parameters())
    else:
        for cell in getattr(score_mod, "__closure__", None) or ():
            try:
                obj = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(obj, torch.Tensor):
                found.append(obj)
            elif isinstance(obj, nn.Module):
                found.extend(obj.parameters())
    unique: dict[int, torch.Tensor] = {}
    for t in found:
        if t.is_floating_point() and t.requires_grad:
            unique.setdefault(id(t), t)
    return tuple(unique.values())


def _wants_grad(call: AttentionCall) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in (call.query, call.key, call.value)):
        return True
    return bool(score_mod_tensors(call.score_mod))


def _supports(call: AttentionCall) -> str | None:
    if call.dropout_p > 0.0:
        return "blockwise does not implement dropout (use backend='sdpa' or 'reference')"
    if call.mask is not None and call.mask.is_floating_point() and call.mask.requires_grad:
        return "blockwise gives no gradient to a float mask (use backend='reference')"
    if call.need_weights and _wants_grad(call):
        return (
            "weights recomputed from the log-sum-exp carry no gradient; "
            "use backend='reference' or torch.no_grad()"
        )
    return None


def blockwise_attention(
    call: AttentionCall, *, block_q: int | None = None, block_k: int | None = None
) -> BackendResult:
    """Compute ``call`` tile by tile (see the module docs); weights recomputed if asked."""
    extra = score_mod_tensors(call.score_mod)
    fused = ENGINE == "auto" and _fused_tiles.usable(call, extra)
    plan = build_plan(call, block_q, block_k, fused=fused)
    if fused and block_q is None:
        plan.block_q = _fused_tiles.query_block(plan)
    if plan.score_mod is not None and torch.is_grad_enabled() and not extra:
        _check_no_hidden_grad(call)
    out, lse = BlockwiseAttention.apply(plan, call.query, call.key, call.value, *extra)
    out = out.reshape(*call.query.shape[:-1], call.value.shape[-1])  # (..., h, t, d_v)
    weights = None
    if call.need_weights:
        w = weights_from_lse(plan, call.query, call.key, lse)  # (b, h, t, s)
        weights = w.reshape(*call.query.shape[:-1], call.k_len)
    return out, weights


def _check_no_hidden_grad(call: AttentionCall) -> None:
    """Refuse a score_mod whose output needs grad through tensors we could not find."""
    probe = torch.zeros(1, 1, 1, 1, dtype=call.query.dtype, device=call.query.device)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=call.query.device)
    if call.score_mod(probe, idx, idx, idx, idx).requires_grad:
        raise ValueError(
            "score_mod reads tensors that require grad but blockwise cannot find them; "
            "give the mod a `tensors` attribute listing them (attnkit.masks mods do)"
        )


register_backend("blockwise", blockwise_attention, supports=_supports)
