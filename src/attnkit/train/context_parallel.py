"""Training the GPT with every sequence split across a process group (context parallelism).

Each rank holds a shard of every sequence (``attnkit.distributed.shard`` along the
tokens), runs the model on it with its global positions (learned position embedding or
RoPE) and attention through :func:`attnkit.distributed.context_parallel_attention`, and
sums its tokens' losses. The loss is divided by the count of scored tokens over the
whole group and the gradients are all-reduced, so loss and gradients equal a
single-process step on the whole sequences::

    rank r:  tokens[:, shard r] ─ embeddings(positions of shard r) ─ blocks ─ logits ─ sum CE
                                    attention: context_parallel_attention over the group
             loss = all_reduce(sum CE) / all_reduce(count);  grads: all_reduce(sum)

Only rank 0 draws the progress bar. Every rank must draw the same batches (seed the
data generator identically).

What this relies on in :class:`~attnkit.models.GPT`: ``tok_emb``, ``pos_emb`` (or None),
``rope`` (the one RoPE table), ``windows``, ``trf_blocks``, ``final_norm`` and ``out_head``;
each block runs as it is, with its attention function handed down in
:class:`~attnkit.models.attention.AttentionInputs` (``attend``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from attnkit.distributed import context_parallel_attention, rank_and_size, shard
from attnkit.distributed.comm import Group
from attnkit.models import GPT
from attnkit.models.attention import AttentionInputs
from attnkit.train.data import IGNORE
from attnkit.train.loop import train

__all__ = [
    "all_reduce_grads",
    "broadcast_parameters",
    "sharded_logits",
    "sharded_loss",
    "train_context_parallel",
]

Batch = tuple[torch.Tensor, torch.Tensor]


def check_model(model: GPT) -> None:
    """Refuse what a split sequence cannot reproduce exactly."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be an attnkit GPT, got {type(model).__name__}")
    if model.cfg.drop_rate > 0:
        raise ValueError(
            f"context parallelism needs drop_rate=0 (got {model.cfg.drop_rate}): "
            "dropout would differ from a single-process run"
        )
    if model.cfg.mla_kv_rank is not None:
        raise ValueError(
            "context parallelism splits CausalSelfAttention layers; this model uses "
            "multi-head latent attention (mla_kv_rank)"
        )


def sharded_logits(
    model: GPT,
    idx_local: torch.Tensor,
    positions: torch.Tensor,
    *,
    group: Group = None,
    layout: str = "zigzag",
    strategy: str = "ring",
) -> torch.Tensor:
    """Logits ``(b, t_local, vocab)`` of this rank's tokens ``idx_local`` at ``positions``.

    The model's own blocks run on the shard; what differs from :meth:`GPT.forward` is
    handed down in :class:`AttentionInputs`: the global ``positions`` (RoPE from the
    model's one table) and the attention function, which attends over the group.
    """

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        causal: bool,
        window: int | None,
        dropout_p: float,
        sinks: torch.Tensor | None,
        backend: str,
    ) -> torch.Tensor:
        # No mask (no padding) and no dropout here: check_model refused dropout, and the
        # layer's backend is replaced by the ring / all-to-all kernels.
        if mask is not None or dropout_p:
            raise ValueError("context parallelism takes no attention mask and no dropout")
        out: torch.Tensor = context_parallel_attention(  # type: ignore[assignment]
            q,
            k,
            v,
            group=group,
            layout=layout,
            strategy=strategy,
            causal=causal,
            window=window,
            sinks=sinks,
        )  # (b, h, t_local, d)
        return out

    rope = None
    if model.rope is not None:  # (1, 1, t_local, d) each, at this shard's global positions
        rope = (model.rope.cos[positions][None, None], model.rope.sin[positions][None, None])
    x = model.tok_emb(idx_local)  # (b, t_local, d)
    if model.pos_emb is not None:
        x = x + model.pos_emb(positions)
    kinds: dict[int | None, AttentionInputs] = {}
    for block, window in zip(model.trf_blocks, model.windows, strict=True):
        if window not in kinds:
            kinds[window] = AttentionInputs(positions, rope, window=window, attend=attend)
        x = block(x, kinds[window])  # (b, t_local, d)
    return model.out_head(model.final_norm(x))  # (b, t_local, vocab)


def sharded_loss(
    model: GPT,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Group = None,
    layout: str = "zigzag",
    strategy: str = "ring",
) -> tuple[torch.Tensor, float]:
    """This rank's share of the mean next-token loss over the whole batch, and that mean.

    ``inputs``/``targets`` are the full ``(b, T)`` batch, the same on every rank. The
    shares sum to the single-process loss, so all-reduced gradients equal its gradients.
    """
    check_model(model)
    t = inputs.shape[1]
    if t > model.cfg.context_length:
        raise ValueError(f"{t} tokens exceed context_length={model.cfg.context_length}")
    positions = shard(torch.arange(t, device=inputs.device), 0, group=group, layout=layout)
    idx_l = shard(inputs, 1, group=group, layout=layout)  # (b, t_local)
    tgt_l = shard(targets, 1, group=group, layout=layout)
    logits = sharded_logits(model, idx_l, positions, group=group, layout=layout, strategy=strategy)
    total = F.cross_entropy(
        logits.flatten(0, 1), tgt_l.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    stats = torch.stack([total.detach(), (tgt_l != IGNORE).sum().to(total.dtype)])
    dist.all_reduce(stats, group=group)
    count = stats[1].clamp(min=1)
    return total / count, (stats[0] / count).item()


def all_reduce_grads(model: nn.Module, group: Group = None) -> None:
    """Sum every parameter's gradient over the group (one flat all-reduce)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_parameters(model: nn.Module, group: Group = None) -> None:
    """Give every rank rank 0's parameters (of ``group``)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src, group=group)


def train_context_parallel(
    model: GPT,
    batches: Callable[[], Batch],
    steps: int,
    *,
    group: Group = None,
    layout: str = "zigzag",
    strategy: str = "ring",
    progress: bool = True,
    **kwargs: Any,
) -> list[float]:
    """:func:`attnkit.train.train` with every sequence split over ``group``.

    The same loop (schedule, clipping, optimizer, Ctrl-C, checkpoints through
    ``on_step``): only the loss (this rank's share of the whole batch's) and an
    all-reduce of the gradients after the backward differ. ``batches`` must return the
    same full batch on every rank. Only rank 0 draws the bar.

    Args:
        kwargs: passed on to :func:`attnkit.train.train` (``optimizer``, ``lr``,
            ``start_step``, ``schedule``, ``on_step``, ``should_stop``).

    Returns:
        The loss of every step (the whole batch's mean, the same on every rank).
    """
    check_model(model)
    rank, _ = rank_and_size(group)
    broadcast_parameters(model, group)

    def loss_fn(m: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
        return sharded_loss(m, inputs, targets, group=group, layout=layout, strategy=strategy)

    return train(
        model,
        batches,
        steps,
        progress=progress and rank == 0,
        loss_fn=loss_fn,
        after_backward=lambda m: all_reduce_grads(m, group),
        **kwargs,
    )
