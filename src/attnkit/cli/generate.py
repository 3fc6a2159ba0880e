"""``attnkit generate``: continue a prompt with a trained checkpoint."""

from __future__ import annotations

import argparse
import math
import sys

import torch

from attnkit.cli import CliError, HelpFormatter, encode_prompt, new_tokens_for

EXAMPLES = """\
examples:
  attnkit generate --checkpoint runs/rev --prompt "31415926>"
  attnkit generate --checkpoint attnkit-out/gpt/checkpoint --prompt "12345678>"
  attnkit generate --checkpoint runs/notes --prompt "The " --max-new-tokens 200 \\
      --temperature 0.8 --top-k 20 --seed 1

A checkpoint predicts from at most its context_length tokens: a continuation that runs
past it keeps only the last context_length tokens as the model's input (as nanoGPT does);
a note on stderr says so.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a checkpoint of `attnkit train`",
        description="Continue a prompt with a checkpoint written by `attnkit train` (or the demo).",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="checkpoint directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to add (default: the task's answer length, or fill the context for text)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help=(
            "softmax temperature; 0 = greedy (always the most likely token), as is a "
            "positive one too small to divide the logits by (e.g. 1e-45)"
        ),
    )
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.train import CheckpointError, load_checkpoint

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise CliError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise CliError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    try:
        model, tokenizer, meta, _ = load_checkpoint(args.checkpoint)
    except CheckpointError as err:
        raise CliError(str(err)) from None
    if args.top_k is not None and not 1 <= args.top_k <= model.cfg.vocab_size:
        raise CliError(f"--top-k must be in [1, {model.cfg.vocab_size}], got {args.top_k}")
    ids = encode_prompt(tokenizer, args.prompt)
    ctx = model.cfg.context_length
    if len(ids) > ctx:
        raise CliError(f"prompt has {len(ids)} tokens, more than the context_length {ctx}")
    n = args.max_new_tokens
    if n is None:
        n = new_tokens_for(meta, ctx, len(ids))
    gen = torch.Generator().manual_seed(args.seed)
    within = min(n, ctx - len(ids))
    try:
        out = model.generate(
            torch.tensor([ids]),
            within,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=gen,
        )
        if n > within:
            print(
                f"note: past context_length {ctx}, each new token sees only the last {ctx} tokens",
                file=sys.stderr,
            )
        for _ in range(n - within):  # nanoGPT-style crop: the last ctx - 1 tokens, plus one
            step = model.generate(
                out[:, -max(ctx - 1, 1) :],
                1,
                temperature=args.temperature,
                top_k=args.top_k,
                generator=gen,
                use_cache=False,
            )
            out = torch.cat((out, step[:, -1:]), dim=1)
    except ValueError as err:
        raise CliError(str(err)) from None
    print(args.prompt + tokenizer.decode(out[0, len(ids) :].tolist()))
    return 0
