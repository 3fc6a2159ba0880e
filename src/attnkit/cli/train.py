"""``attnkit train``: train a tiny GPT on a synthetic task or a text file."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from attnkit.cli import CliError, HelpFormatter, output_dir, writable_output
from attnkit.cli._context_parallel import add_arguments as add_context_parallel_arguments

TASKS = ["copy", "reverse", "sort", "recall"]
DEFAULT_TASK, DEFAULT_LENGTH, DEFAULT_TEXT_CONTEXT, DEFAULT_LR = "reverse", 8, 64, 3e-3
_MODEL_FLAGS = ("context_length", "emb_dim", "n_layers", "n_heads", "n_kv_heads", "window")

EXAMPLES = """\
examples:
  attnkit train --task reverse --out runs/rev --steps 600
  attnkit train --out runs/rev --steps 1200 --resume      # continue to step 1200
  attnkit train --text notes.txt --context-length 128 --out runs/notes --quiet
  attnkit generate --checkpoint runs/rev --prompt "31415926>"

Ctrl-C stops after the current step, saves the checkpoint and exits (code 130);
--resume continues from it.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a tiny GPT on a synthetic task or a text file",
        description=(
            "Train attnkit's tiny GPT on a synthetic task that needs attention (copy, reverse, "
            "sort, recall; default reverse) or on a text file (byte-level tokens). Writes a "
            "checkpoint directory (model.safetensors, optimizer.safetensors, config.json, "
            "manifest.json; saved atomically) plus loss.png and attention maps (with the "
            "[viz] extra)."
        ),
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--task", choices=TASKS, default=None, help=f"synthetic task (default: {DEFAULT_TASK})"
    )
    src.add_argument("--text", metavar="FILE", help="a text file (byte-level tokens)")
    p.add_argument("--out", metavar="DIR", required=True, help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoint in --out"
    )
    p.add_argument("--steps", type=int, default=1500, help="last step number")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate, warm-up then cosine (default: {DEFAULT_LR}; kept on --resume)",
    )
    p.add_argument(
        "--length",
        type=int,
        default=None,
        help=f"task length: digits, or key/value pairs for recall (default: {DEFAULT_LENGTH})",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of weights and batches")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--quiet", action="store_true", help="no progress bar; a line per save")
    m = p.add_argument_group("model (the 'tiny' preset unless given; fixed on --resume)")
    m.add_argument(
        "--context-length",
        type=int,
        default=None,
        help=f"tokens per sequence (default: the task's length, or {DEFAULT_TEXT_CONTEXT} for text)",
    )
    m.add_argument("--emb-dim", type=int, default=None, help="model width")
    m.add_argument("--n-layers", type=int, default=None, help="transformer blocks")
    m.add_argument("--n-heads", type=int, default=None, help="query heads")
    m.add_argument("--n-kv-heads", type=int, default=None, help="key/value heads (GQA)")
    m.add_argument("--window", type=int, default=None, help="sliding-window size")
    m.add_argument("--rope", action="store_true", help="rotary positions")
    add_context_parallel_arguments(p)
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "save_every"):
        if getattr(args, name) <= 0:
            raise CliError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise CliError(f"--lr must be a positive finite number, got {args.lr}")
    for name in ("length", *_MODEL_FLAGS):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.resume and args.overwrite:
        raise CliError("give --resume or --overwrite, not both")


def _check_out(args: argparse.Namespace, out: Path) -> None:
    from attnkit.train.checkpoint import is_checkpoint

    if args.resume:
        return
    if is_checkpoint(out):
        if not args.overwrite:
            raise CliError(
                f"--out {str(out)!r} already holds a checkpoint: pass --resume to continue it "
                "or --overwrite to replace it"
            )
    elif out.is_dir() and any(out.iterdir()):
        raise CliError(f"--out {str(out)!r} is a non-empty directory that is not a checkpoint")


def _config(args: argparse.Namespace, vocab_size: int, seq_len: int) -> Any:
    from attnkit.models import GPTConfig

    overrides = {
        k: getattr(args, k)
        for k in ("emb_dim", "n_layers", "n_heads", "n_kv_heads", "window")
        if getattr(args, k) is not None
    }
    context = args.context_length or seq_len
    if context < seq_len and args.task:
        raise CliError(f"--context-length {context} is shorter than the task's {seq_len} tokens")
    try:
        return GPTConfig.preset(
            "tiny", vocab_size=vocab_size, context_length=context, rope=args.rope, **overrides
        )
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from None


def _resume_meta(args: argparse.Namespace, meta: dict[str, Any]) -> None:
    """Take task, text and length from the checkpoint; refuse a flag that would change them."""
    for flag, key in (("task", "task"), ("text", "text"), ("length", "length")):
        given, saved = getattr(args, flag), meta.get(key)
        if given is not None and given != saved:
            raise CliError(
                f"--{flag} {given} differs from the checkpoint's {saved!r}; "
                "a resumed run keeps its data (start a new --out instead)"
            )
    if args.lr is not None:
        raise CliError("--lr: a resumed run keeps its learning rate and schedule")
    changed = [f"--{f.replace('_', '-')}" for f in _MODEL_FLAGS if getattr(args, f) is not None]
    if changed or args.rope:
        raise CliError(f"{', '.join(changed or ['--rope'])}: the model is fixed on --resume")
    args.task, args.text, args.length = meta.get("task"), meta.get("text"), meta.get("length")


@contextlib.contextmanager
def _stop_on_ctrl_c() -> Iterator[threading.Event]:
    """Ctrl-C sets the event (training stops after the step); a second Ctrl-C aborts."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def run(args: argparse.Namespace) -> int:
    from attnkit.train.loop import train

    _check_args(args)
    out = writable_output(args.out)
    _check_out(args, out)
    fit = train
    if args.context_parallel:  # under torchrun: each rank holds a shard of every sequence
        from attnkit.cli._context_parallel import context_parallel_trainer

        fit = context_parallel_trainer(args)
        out = output_dir(args.out)  # rank 0 keeps --out; the others, a private copy
    from attnkit.checkpoints import CheckpointError, lock_directory

    with contextlib.ExitStack() as stack:
        try:  # one run per --out: a second one would delete this one's saves in progress
            stack.enter_context(lock_directory(out))
        except CheckpointError as err:
            raise CliError(f"--out: {err}") from None
        return _train(args, out, fit)


def _train(args: argparse.Namespace, out: Path, fit: Any) -> int:
    """The run itself, holding the lock on ``out``."""
    from attnkit.models import GPT
    from attnkit.train import CheckpointError, TaskData, TextData, load_checkpoint
    from attnkit.train.loop import Schedule

    torch.manual_seed(args.seed)
    model, opt_state, start = None, None, 0
    losses: list[float] = []
    meta: dict[str, Any] = {}
    schedule = None
    if args.resume:
        try:
            model, _, meta, opt_state = load_checkpoint(out, require_manifest=True)
            schedule = Schedule.from_dict(meta["schedule"]) if "schedule" in meta else None
        except (CheckpointError, ValueError) as err:
            raise CliError(str(err)) from None
        _resume_meta(args, meta)
        start, losses = int(meta.get("step", 0)), list(meta.get("losses", []))
        if start >= args.steps:
            raise CliError(f"checkpoint is at step {start}; pass --steps larger than that")
        if len(losses) != start:
            raise CliError(f"checkpoint at step {start} has {len(losses)} losses: not whole")
    task = args.task or (DEFAULT_TASK if args.text is None else None)
    length = args.length or DEFAULT_LENGTH
    try:
        if task is not None:
            data: TaskData | TextData = TaskData(task, length)
        else:
            ctx = args.context_length or DEFAULT_TEXT_CONTEXT
            data = TextData(args.text, ctx if model is None else model.cfg.context_length)
    except ValueError as err:
        raise CliError(str(err)) from None
    if model is None:
        model = GPT(_config(args, data.tokenizer.vocab_size, data.seq_len))
    elif model.cfg.context_length < data.seq_len - 1:
        raise CliError("the checkpoint's context is shorter than the data's sequences")
    lr = DEFAULT_LR if args.lr is None else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if opt_state is not None:
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CliError(f"checkpoint's optimizer state does not fit the model: {msg}") from None
    schedule = (schedule or Schedule(args.steps)).extended(start, args.steps)
    out.mkdir(parents=True, exist_ok=True)  # a path that cannot be written fails now, not later
    g = torch.Generator().manual_seed(args.seed + start)
    meta = {"task": task, "text": args.text, "length": length if task else None}
    print(
        f"training a GPT of {model.num_parameters():,} parameters on "
        f"{task or args.text}, steps {start + 1}..{args.steps}"
    )

    def save(step: int) -> None:
        from attnkit.train import save_checkpoint

        save_checkpoint(
            out,
            model,
            data.tokenizer,
            optimizer=optimizer,
            meta={**meta, "step": step, "losses": losses, "schedule": schedule.to_dict()},
        )
        if args.quiet:
            print(f"step {step}/{args.steps}: loss {losses[-1]:.4f}, saved {out}", flush=True)

    last = start

    def on_step(step: int, loss: float) -> None:
        nonlocal last
        losses.append(loss)
        last = step
        if step % args.save_every == 0 or step == args.steps:
            save(step)

    with _stop_on_ctrl_c() as stop:
        fit(
            model,
            lambda: data.batch(args.batch_size, g),
            args.steps,
            optimizer=optimizer,
            start_step=start,
            schedule=schedule,
            progress=not args.quiet,
            on_step=on_step,
            should_stop=stop.is_set,
        )
    if last < args.steps:  # stopped by Ctrl-C: keep what was done
        if last > start:
            save(last)
        print(
            f"interrupted at step {last}: checkpoint {out}; continue with "
            f"`attnkit train --out {out} --steps {args.steps} --resume`"
        )
        return 130
    print(f"checkpoint: {out} (model.safetensors, optimizer.safetensors, config.json)")
    _report(model, data, task, g, out, losses)
    return 0


def _report(
    model: Any, data: Any, task: str | None, g: torch.Generator, out: Path, losses: list[float]
) -> None:
    from attnkit.train import evaluate_task

    if task is not None:
        seq_acc, tok_acc, prompts, answers = evaluate_task(model, data, n=500)
        print(f"held-out accuracy: {seq_acc:.1%} of sequences, {tok_acc:.2%} of tokens")
        sample = torch.cat((prompts[0], answers[0]))[:-1]
        prompt = data.tokenizer.decode(prompts[0].tolist())
    else:
        sample = data.batch(1, g)[0][0]
        prompt = data.tokenizer.decode(sample[:8].tolist())
    print(f"try: attnkit generate --checkpoint {out} --prompt {prompt!r}")
    if importlib.util.find_spec("matplotlib") is None:
        print("pictures skipped: loss.png and attention maps need pip install 'attnkit[viz]'")
        return
    from attnkit.train.plots import plot_attention_maps, plot_loss

    print(f"loss curve: {plot_loss(losses, out / 'loss.png')}")
    labels = data.tokenizer.labels(sample.tolist())
    maps = plot_attention_maps(model, sample, labels, out / "attention")
    print(f"attention maps: {', '.join(str(p) for p in maps)}")
