"""``attnkit explain``: the seed tutorial's arithmetic for any sentence, every number shown."""

from __future__ import annotations

import argparse
import sys

from attnkit.cli import CliError
from attnkit.explain import FORMATS, STAGES, explain, render, resolve_sentence


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="show every step of self-attention on a sentence",
        description=(
            "Compute the seed tutorial's stages (simplified, trainable, causal, dropout, "
            "multihead) on a sentence and print every intermediate. Without a sentence: "
            '"Your journey starts with one step" with the seeds\' embeddings.'
        ),
    )
    p.add_argument("sentence", nargs="?", help="the sentence (default: the seeds' example)")
    p.add_argument("--embeddings", metavar="FILE", help="JSON or CSV file, one vector per token")
    p.add_argument("--dim", type=int, help="width of seeded random embeddings (default 3)")
    p.add_argument(
        "--stage", default="all", help=f"one of {', '.join(STAGES)} or all (default all)"
    )
    p.add_argument("--heads", type=int, default=2, help="heads of the multihead stage (2)")
    p.add_argument("--d-out", type=int, default=2, help="d_out of the trainable stages (2)")
    p.add_argument("--dropout", type=float, default=0.5, help="dropout of the dropout stage (0.5)")
    p.add_argument(
        "--seed", type=int, help="seed for embeddings and modules (default: the book's seeds)"
    )
    p.add_argument("--query", metavar="TOKEN", help="follow one token step by step")
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (text)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.stage != "all" and args.stage not in STAGES:
        raise CliError(f"unknown stage {args.stage!r}; choose from {', '.join(STAGES)} or all")
    stages = STAGES if args.stage == "all" else (args.stage,)
    try:
        tokens, x = resolve_sentence(
            args.sentence,
            embeddings_file=args.embeddings,
            dim=args.dim,
            seed=0 if args.seed is None else args.seed,
        )
        expl = explain(
            tokens,
            x,
            stages=stages,
            d_out=args.d_out,
            heads=args.heads,
            dropout=args.dropout,
            seed=args.seed,
        )
        text = render(expl, fmt=args.format, query=args.query)
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from None
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
