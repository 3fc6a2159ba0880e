"""The training loop: tqdm progress bar, AdamW, warm-up + cosine via ``LambdaLR``."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.models import GPT
from attnkit.train.data import IGNORE, TaskData

__all__ = ["WARMUP_STEPS", "LossFn", "Schedule", "evaluate_task", "next_token_loss", "train"]

Batch = tuple[torch.Tensor, torch.Tensor]
#: ``loss_fn(model, inputs, targets) -> (loss to backpropagate, value to record)``
LossFn = Callable[[GPT, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]]


def next_token_loss(
    model: GPT, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Mean next-token cross-entropy of ``model`` on ``(b, t)`` ids (targets -100 skipped)."""
    logits = model(inputs)  # (b, t, vocab)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return loss, loss.item()


WARMUP_STEPS = 50


@dataclass(frozen=True)
class Schedule:
    """Learning-rate factor per step: linear warm-up, then cosine decay to 10% at ``total``.

    A schedule resumed with a different ``total`` continues from the factor it had reached
    (``start``, ``start_factor``) with a cosine to 10% at the new total, so the rate never jumps.
    """

    total: int
    start: int = 0
    start_factor: float = 1.0
    warmup: int = WARMUP_STEPS

    def factor(self, step: int) -> float:
        """The factor of the learning rate used for ``step`` (1-based)."""
        if self.start == 0:
            warm = min(1.0, step / self.warmup)
            return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / self.total)))
        span = max(self.total - self.start, 1)
        frac = min(max((step - self.start) / span, 0.0), 1.0)
        return 0.1 + (self.start_factor - 0.1) * 0.5 * (1 + math.cos(math.pi * frac))

    def extended(self, step: int, total: int) -> Schedule:
        """This schedule, continued from ``step`` (the last one done) to a new ``total``."""
        if total == self.total:
            return self
        return Schedule(total, start=step, start_factor=self.factor(step), warmup=self.warmup)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Schedule:
        """Rebuild from :meth:`to_dict`; ValueError on anything else."""
        try:
            sched = cls(
                total=int(data["total"]),
                start=int(data["start"]),
                start_factor=float(data["start_factor"]),
                warmup=int(data["warmup"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"bad learning-rate schedule {data!r}") from err
        if not (0 <= sched.start < sched.total and sched.warmup > 0):
            raise ValueError(f"bad learning-rate schedule {data!r}")
        if not (math.isfinite(sched.start_factor) and sched.start_factor > 0):
            raise ValueError(f"bad learning-rate schedule {data!r}")
        return sched


def train(
    model: GPT,
    batches: Callable[[], Batch],
    steps: int,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 3e-3,
    start_step: int = 0,
    schedule: Schedule | None = None,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    loss_fn: LossFn | None = None,
    after_backward: Callable[[GPT], None] | None = None,
) -> list[float]:
    """Train ``model`` on next-token cross-entropy for steps ``start_step + 1 .. steps``.

    Args:
        model: the GPT (put in training mode).
        batches: returns ``(inputs, targets)`` ``(b, t)``; targets of -100 are skipped.
        steps: the last step number.
        optimizer: AdamW with ``lr`` when None. The peak rate is each group's ``initial_lr``
            (set from ``lr`` the first time).
        lr: peak learning rate for the default optimizer.
        start_step: steps already done (``--resume``).
        schedule: the learning-rate schedule (``torch.optim.lr_scheduler.LambdaLR`` over
            :meth:`Schedule.factor`); warm-up + cosine over ``steps`` when None.
        progress: draw a tqdm progress bar on stderr (step numbers run start+1..steps;
            redrawn at most every 10 s when stderr is not a terminal).
        on_step: called as ``on_step(step, loss)`` after each step.
        should_stop: checked after each whole step; True ends training early (Ctrl-C).
        loss_fn: ``loss_fn(model, inputs, targets) -> (loss to backpropagate, loss to
            record)``; next-token cross-entropy by default. Context parallelism passes
            each rank's share of the whole batch's loss (:mod:`attnkit.train.context_parallel`).
        after_backward: called with the model after ``loss.backward()``, before clipping
            (context parallelism all-reduces the gradients there).

    Returns:
        The loss of every step run.
    """
    from tqdm.auto import tqdm

    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = schedule or Schedule(steps)
    # epoch e of the scheduler is step start_step + 1 + e
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: schedule.factor(start_step + 1 + e)
    )
    bar = tqdm(
        total=steps,
        initial=start_step,
        desc="train",
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 10.0,  # a log file gets a line per 10 s
    )
    losses: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    model.train()
    try:
        for step in range(start_step + 1, steps + 1):
            inputs, targets = batches()
            loss, value = (loss_fn or next_token_loss)(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(value)
            tokens += inputs.numel()
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"loss {losses[-1]:.4f}, {rate / 1000:.1f}k tok/s", refresh=False)
            bar.update()
            if on_step is not None:
                on_step(step, losses[-1])
            if should_stop is not None and should_stop():
                break
    finally:
        bar.close()
    model.eval()
    return losses


@torch.no_grad()
def evaluate_task(
    model: GPT, data: TaskData, n: int = 1000, seed: int = 12345
) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Greedy-decode the answers of ``n`` fresh sequences (a seed training never uses).

    Returns:
        ``(sequence_accuracy, token_accuracy, prompts, predicted_answers)``.
    """
    g = torch.Generator().manual_seed(seed)
    seq = data.sample(n, g)
    prompts, answers = seq[:, : data.prompt_len], seq[:, data.prompt_len :]
    out = model.generate(prompts, data.answer_len, temperature=0)[:, data.prompt_len :]
    correct = out == answers
    return (
        correct.all(dim=1).float().mean().item(),
        correct.float().mean().item(),
        prompts,
        out,
    )
