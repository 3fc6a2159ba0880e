"""``attnkit generate``: continue a prompt with a trained checkpoint."""

from __future__ import annotations

import argparse

import torch

from attnkit.cli import CliError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint of `attnkit train`")
    p.add_argument("--checkpoint", metavar="DIR", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: fill the context")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.train import CheckpointError, load_checkpoint

    try:
        model, tokenizer, meta, _ = load_checkpoint(args.checkpoint)
    except CheckpointError as err:
        raise CliError(str(err)) from None
    try:
        ids = tokenizer.encode(args.prompt)
    except ValueError as err:
        raise CliError(f"prompt: {err}") from None
    ctx = model.cfg.context_length
    if not ids:
        raise CliError("prompt is empty")
    if len(ids) > ctx:
        raise CliError(f"prompt has {len(ids)} tokens, more than the context_length {ctx}")
    n = args.max_new_tokens
    if n is None:
        answer = meta.get("length") if meta.get("task") not in (None, "recall") else 1
        n = answer if meta.get("task") else ctx - len(ids)
    n = min(n, ctx - len(ids))
    if n < 0:
        raise CliError(f"--max-new-tokens must be >= 0, got {n}")
    try:
        out = model.generate(
            torch.tensor([ids]),
            n,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=torch.Generator().manual_seed(args.seed),
        )
    except ValueError as err:
        raise CliError(str(err)) from None
    print(args.prompt + tokenizer.decode(out[0, len(ids) :].tolist()))
    return 0
