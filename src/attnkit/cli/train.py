"""``attnkit train``: train a tiny GPT on a synthetic task or a text file."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli import CliError
from attnkit.cli._context_parallel import add_arguments as add_context_parallel_arguments


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a tiny GPT on a synthetic task or a text file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", choices=["copy", "reverse", "sort", "recall"], default=None)
    src.add_argument("--text", metavar="FILE", help="a text file (byte-level tokens)")
    p.add_argument("--out", metavar="DIR", required=True, help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--steps", type=int, default=1500, help="last step number")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--length", type=int, default=8, help="task length (digits or pairs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    m = p.add_argument_group("model (the 'tiny' preset unless given)")
    m.add_argument("--context-length", type=int, default=None)
    m.add_argument("--emb-dim", type=int, default=None)
    m.add_argument("--n-layers", type=int, default=None)
    m.add_argument("--n-heads", type=int, default=None)
    m.add_argument("--n-kv-heads", type=int, default=None)
    m.add_argument("--window", type=int, default=None)
    m.add_argument("--rope", action="store_true")
    add_context_parallel_arguments(p)
    p.set_defaults(func=run)


def _config(args: argparse.Namespace, vocab_size: int, seq_len: int):
    from attnkit.models import GPTConfig

    overrides = {
        k: v
        for k, v in dict(
            emb_dim=args.emb_dim,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads,
            window=args.window,
        ).items()
        if v is not None
    }
    context = args.context_length or seq_len
    if context < seq_len and args.task:
        raise CliError(f"--context-length {context} is shorter than the task's {seq_len} tokens")
    try:
        return GPTConfig.preset(
            "tiny", vocab_size=vocab_size, context_length=context, rope=args.rope, **overrides
        )
    except ValueError as err:
        raise CliError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    from attnkit.models import GPT
    from attnkit.train import (
        CheckpointError,
        TaskData,
        TextData,
        evaluate_task,
        load_checkpoint,
        save_checkpoint,
        train,
    )
    from attnkit.train.plots import plot_attention_maps, plot_loss

    for name in ("steps", "batch_size", "save_every"):
        if getattr(args, name) <= 0:
            raise CliError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    fit = train
    if args.context_parallel:  # under torchrun: each rank holds a shard of every sequence
        from attnkit.cli._context_parallel import context_parallel_trainer

        fit = context_parallel_trainer(args)
    out = Path(args.out)
    torch.manual_seed(args.seed)
    model, opt_state, start, losses, meta = None, None, 0, [], {}
    if args.resume:
        try:
            model, _, meta, opt_state = load_checkpoint(out)
        except CheckpointError as err:
            raise CliError(str(err)) from None
        args.task, args.text = meta.get("task"), meta.get("text")
        start, losses = int(meta.get("step", 0)), list(meta.get("losses", []))
        args.length = int(meta.get("length", args.length))
        if start >= args.steps:
            raise CliError(f"checkpoint is at step {start}; pass --steps larger than that")
    task = args.task or ("reverse" if args.text is None else None)
    try:
        if task is not None:
            data = TaskData(task, args.length)
        else:
            ctx = args.context_length or 64
            data = TextData(args.text, ctx if model is None else model.cfg.context_length)
    except ValueError as err:
        raise CliError(str(err)) from None
    if model is None:
        model = GPT(_config(args, data.tokenizer.vocab_size, data.seq_len))
    elif model.cfg.context_length < data.seq_len - 1:
        raise CliError("the checkpoint's context is shorter than the data's sequences")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    g = torch.Generator().manual_seed(args.seed + start)
    meta = {"task": task, "text": args.text, "length": args.length}
    print(
        f"training a GPT of {model.num_parameters():,} parameters on "
        f"{task or args.text}, steps {start + 1}..{args.steps}"
    )

    def save(step: int) -> None:
        save_checkpoint(
            out,
            model,
            data.tokenizer,
            optimizer=optimizer,
            meta={**meta, "step": step, "losses": losses},
        )

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        if step % args.save_every == 0 or step == args.steps:
            save(step)

    fit(
        model,
        lambda: data.batch(args.batch_size, g),
        args.steps,
        optimizer=optimizer,
        start_step=start,
        on_step=on_step,
    )
    print(f"checkpoint: {out} (model.safetensors, config.json)")
    print(f"loss curve: {plot_loss(losses, out / 'loss.png')}")
    if task is not None:
        seq_acc, tok_acc, prompts, answers = evaluate_task(model, data, n=500)
        print(f"held-out accuracy: {seq_acc:.1%} of sequences, {tok_acc:.2%} of tokens")
        sample = torch.cat((prompts[0], answers[0]))[:-1]
    else:
        sample = data.batch(1, g)[0][0]
    labels = (
        list(data.tokenizer.decode(sample.tolist())) if task else [str(i) for i in sample.tolist()]
    )
    maps = plot_attention_maps(model, sample, labels, out / "attention")
    print(f"attention maps: {', '.join(str(p) for p in maps)}")
    return 0
