"""The training loop, with a one-line progress bar (step, loss, tokens/s, ETA)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch
import torch.nn.functional as F

from attnkit.models import GPT
from attnkit.train.data import IGNORE, TaskData

__all__ = ["Progress", "evaluate_task", "train"]

Batch = tuple[torch.Tensor, torch.Tensor]


class Progress:
    """A minimal progress bar: ``step 120/600 [####----] loss 0.4321 | 12.3k tok/s | ETA 0:42``."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 20) -> None:
        self.total, self.width = total, width
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.tokens = 0
        self._last = 0.0

    def update(self, step: int, loss: float, tokens: int, force: bool = False) -> None:
        """Report ``step`` (1-based) and the tokens processed since the last call."""
        self.tokens += tokens
        now = time.perf_counter()
        if not force and now - self._last < 0.2 and step < self.total:
            return
        self._last = now
        elapsed = max(now - self.t0, 1e-9)
        rate = self.tokens / elapsed
        eta = elapsed / max(step, 1) * (self.total - step)
        filled = int(self.width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        line = (
            f"\rstep {step}/{self.total} [{bar}] loss {loss:.4f} | "
            f"{rate / 1000:.1f}k tok/s | ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        )
        self.stream.write(line)
        if step >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def train(
    model: GPT,
    batches: Callable[[], Batch],
    steps: int,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 3e-3,
    start_step: int = 0,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` on next-token cross-entropy for steps ``start_step + 1 .. steps``.

    Args:
        model: the GPT (put in training mode).
        batches: returns ``(inputs, targets)`` ``(b, t)``; targets of -100 are skipped.
        steps: the last step number.
        optimizer: AdamW with ``lr`` and cosine decay to 10% when None.
        lr: peak learning rate for the default optimizer.
        start_step: steps already done (``--resume``).
        progress: draw the progress bar on stderr.
        on_step: called as ``on_step(step, loss)`` after each step.

    Returns:
        The loss of every step run.
    """
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    for g, base in zip(optimizer.param_groups, base_lrs, strict=True):
        g["initial_lr"] = base
    bar = Progress(steps - start_step) if progress else None
    losses: list[float] = []
    model.train()
    for step in range(start_step + 1, steps + 1):
        warm = min(1.0, step / 50)
        decay = 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * step / steps)).item())
        for g, base in zip(optimizer.param_groups, base_lrs, strict=True):
            g["lr"] = base * warm * decay
        inputs, targets = batches()
        logits = model(inputs)  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(step - start_step, losses[-1], inputs.numel())
        if on_step is not None:
            on_step(step, losses[-1])
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
