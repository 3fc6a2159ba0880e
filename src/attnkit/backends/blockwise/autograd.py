"""The blockwise autograd function: an engine's forward, sinks merged in, and its backward.

``BlockwiseAttention.apply(plan, q, k, v, sinks, *extra) -> (out, lse)``:

* the plan's engine computes ``(out, lse)`` over the keys;
* learned sinks (``(h,)`` logits, or None) are merged as one more partial result with
  ``out = 0`` and ``lse = sink`` (:func:`.merge.add_sinks`), so ``lse`` includes them;
* the backward recomputes the weights from the *total* ``lse``: a sink changes nothing
  else in the key gradients, and its own gradient is ``sum p_sink * (dlse - rowsum(dO*O))``.

``extra`` are the tensors a ``score_mod`` reads that want gradients; they are inputs of
the function so that autograd hands their gradients back. Only ``O(t)`` per head is saved.
"""

from __future__ import annotations

import dataclasses

import torch

from attnkit.backends.blockwise import flash_cpu, native, torch_tiles
from attnkit.backends.blockwise.merge import add_sinks
from attnkit.backends.blockwise.plan import FLASH_CPU, NATIVE_CPU, TORCH_TILES, TilePlan


def engine_forward(plan: TilePlan, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (b, h, t, d_v), lse (b, h, t))`` over the keys, on the plan's engine, both in
    the accumulation dtype (float32 for half inputs: the backward and the sinks' gradient
    read the unrounded output)."""
    return (flash_cpu.forward if plan.fused else torch_tiles.forward)(plan, q, k, v)


def engine_backward(
    plan: TilePlan,
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    grad_lse: torch.Tensor | None,
    extra: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """``(dq, dk, dv, d_extra)`` from the total ``out`` and ``lse``.

    The native kernel's backward where it runs the plan (any additive relative bias, a
    gradient through the log-sum-exp included). Else torch's fused kernel's backward, which
    takes no gradient for the log-sum-exp and no score_mod:
    those run on the tile engine, which gives the same gradients from the same LSE (and
    zeroes the subnormal weights a score_mod's wide range produces, which the fused
    backward would multiply as they are, several times slower).
    """
    engines = plan.engines
    chosen = engines.backward if engines is not None else TORCH_TILES
    if engines is not None and chosen == NATIVE_CPU:
        q4, k4, v4 = flash_cpu.native_views(plan, q, k, v)
        mod_grads: dict[int, torch.Tensor] = {}
        grads = native.backward(plan, q4, k4, v4, out, lse, grad_out, grad_lse, mod_grads)
        dq, dk, dv = (g.to(x.dtype).reshape(x.shape) for g, x in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, _extra_grads(plan, extra, mod_grads)
    if chosen == FLASH_CPU and grad_lse is None:  # (it takes no gradient through the LSE)
        dq, dk, dv = flash_cpu.backward(plan, q, k, v, out, lse, grad_out)
        return dq, dk, dv, []
    tiles_plan = dataclasses.replace(plan, engine=TORCH_TILES)
    return torch_tiles.backward(tiles_plan, q, k, v, out, lse, grad_out, grad_lse, extra)


def _extra_grads(
    plan: TilePlan, extra: tuple[torch.Tensor, ...], mod_grads: dict[int, torch.Tensor]
) -> list[torch.Tensor | None]:
    """The gradients of ``extra`` (the leaves a score_mod's tensors come from) from a
    compiled score_mod's gradients of the tensors it reads (``{slot: gradient}``): through
    autograd where a read tensor is computed from a leaf (``w = p * 2``), as they are
    where it is the leaf."""
    if not extra or not mod_grads:
        return []
    program = native.score_mod_program(plan)
    if isinstance(program, str):  # the native backward ran it: it was compiled
        raise RuntimeError(f"a native backward without its compiled score_mod: {program}")
    read = [program.graph.tensors[slot] for slot in mod_grads]
    with torch.enable_grad():
        found = torch.autograd.grad(
            read, extra, list(mod_grads.values()), retain_graph=True, allow_unused=True
        )
    return [None if g is None else g.to(x.dtype) for g, x in zip(found, extra, strict=True)]


def forward(
    plan: TilePlan, q, k, v, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (b, h, t, d_v), lse (b, h, t))``: the engine's forward with the sinks merged
    in. What :class:`BlockwiseAttention` computes, called as it is where no gradient is
    wanted (an autograd function costs several microseconds a call: a decode step's
    kernel takes tens)."""
    out, lse = engine_forward(plan, q, k, v)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks, plan.h)
    return out, lse


class BlockwiseAttention(torch.autograd.Function):
    """``apply(plan, q, k, v, sinks, *extra) -> (out (b, h, t, d_v), lse (b, h, t))``."""

    @staticmethod
    def forward(ctx, plan: TilePlan, q, k, v, sinks, *extra):  # type: ignore[override]
        out, lse = forward(plan, q, k, v, sinks)
        ctx.plan = plan
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if sinks is not None else []), *extra)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sinks = rest.pop(0) if ctx.has_sinks else None
        extra = tuple(rest)
        plan: TilePlan = ctx.plan
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out = grad_out.reshape(out.shape)
        dq, dk, dv, d_extra = engine_backward(plan, q, k, v, out, lse, grad_out, grad_lse, extra)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            acc = lse.dtype
            p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)  # (b, h, t)
            p_sink = torch.nan_to_num(p_sink, nan=0.0)  # a -inf sink and an empty row
            delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # (b, h, t)
            g = -delta if grad_lse is None else grad_lse.reshape(delta.shape).to(acc) - delta
            d_sinks = (p_sink * g).sum((0, 2)).to(sinks.dtype)
        if len(d_extra) < len(extra):
            d_extra = [*d_extra, *([None] * (len(extra) - len(d_extra)))]
        return (None, dq, dk, dv, d_sinks, *d_extra)
