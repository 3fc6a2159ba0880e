"""The demo's last section: a tiny GPT learns to reverse digit strings."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from attnkit.models import GPT, GPTConfig
from attnkit.train.checkpoint import save_checkpoint
from attnkit.train.data import TaskData
from attnkit.train.loop import evaluate_task, train

__all__ = ["DEMO_STEPS", "demo_section", "reverse_model_config"]

#: Training steps of the demo (batch 64, sequences of 17 tokens).
DEMO_STEPS = 1500


def reverse_model_config(data: TaskData) -> GPTConfig:
    """The tiny preset, sized for ``data``'s vocabulary and sequence length."""
    return GPTConfig.preset(
        "tiny", vocab_size=data.tokenizer.vocab_size, context_length=data.seq_len
    )


def demo_section(out_dir: str | Path, steps: int = DEMO_STEPS, seed: int = 0) -> dict[str, float]:
    """Train the tiny GPT on the reverse task, report held-out accuracy, a sample and maps.

    Prints as it goes; writes the trained model to ``out_dir/checkpoint`` (for
    ``attnkit generate``) and, with the ``[viz]`` extra, ``loss.png`` and
    ``attention/layer<i>.png`` under ``out_dir``.

    Returns:
        ``{"sequence_accuracy", "token_accuracy", "seconds", "final_loss"}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    data = TaskData("reverse", length=8)
    model = GPT(reverse_model_config(data))
    g = torch.Generator().manual_seed(seed)
    print(
        f"\n== A tiny GPT ({model.num_parameters():,} parameters) learns to reverse "
        f"{data.length} digits: {steps} steps of 64 sequences"
    )
    t0 = time.perf_counter()
    losses = train(model, lambda: data.batch(64, g), steps, lr=3e-3)
    seconds = time.perf_counter() - t0
    seq_acc, tok_acc, prompts, answers = evaluate_task(model, data, n=1000)
    tok = data.tokenizer
    print(f"trained in {seconds:.0f} s, final loss {losses[-1]:.4f}")
    print(
        f"held-out accuracy (1000 unseen sequences, greedy, KV cache): "
        f"{seq_acc:.1%} of sequences, {tok_acc:.2%} of digits"
    )
    sample = torch.cat((prompts[0], answers[0]))
    print(f"sample: {tok.decode(prompts[0].tolist())} -> {tok.decode(answers[0].tolist())}")
    ckpt = save_checkpoint(
        out / "checkpoint",
        model,
        tok,
        meta={"task": data.task, "text": None, "length": data.length, "step": steps},
    )
    print(
        f"model saved: {ckpt}; try: attnkit generate --checkpoint {ckpt} "
        f'--prompt "{tok.decode(prompts[1].tolist())}"'
    )
    if importlib.util.find_spec("matplotlib") is None:
        print("pictures skipped: loss.png and attention maps need pip install 'attnkit[viz]'")
    else:
        from attnkit.train.plots import plot_attention_maps, plot_loss

        plot_loss(losses, out / "loss.png")
        maps = plot_attention_maps(
            model, sample[:-1], tok.labels(sample[:-1].tolist()), out / "attention"
        )
        print(f"loss curve: {out / 'loss.png'}")
        print(f"learned attention maps: {', '.join(str(p) for p in maps)}")
    return {
        "sequence_accuracy": seq_acc,
        "token_accuracy": tok_acc,
        "seconds": seconds,
        "final_loss": losses[-1],
    }
