"""``attnkit explain``: the seed tutorial's arithmetic for any sentence, every number shown."""

from __future__ import annotations

import argparse
import sys

from attnkit.cli import CliError, HelpFormatter
from attnkit.explain import FORMATS, LANGS, STAGES, explain, render
from attnkit.explain.inputs import resolve_sentence_source

EXAMPLES = """\
examples:
  attnkit explain                                   # the seeds' sentence and embeddings
  attnkit explain "Hello shiny sun!" --stage simplified --query shiny
  attnkit explain "the cat saw the dog" --query the#2   # the second "the"
  attnkit explain --embeddings vectors.csv          # tokens from the CSV's labels
  attnkit explain "a b c" --format json > run.json && attnkit viz run.json -o run.html
  attnkit explain --format html --lang ja > tutorial.html   # the step-through page, offline

Embeddings: the seeds' own for their two sentences; otherwise --embeddings FILE (JSON list
of vectors, or CSV rows "token,x1,x2,...", an optional header row) or seeded random ones,
labelled as random in the output: they show the arithmetic, not meaning. --seed is a random
seed (for those embeddings and the modules); "the seeds" are the tutorial this follows.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="show every step of self-attention on a sentence",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
        description=(
            "Compute the seed tutorial's stages (simplified, trainable, causal, dropout, "
            "multihead) on a sentence and print every intermediate. Without a sentence: "
            '"Your journey starts with one step" with the seeds\' embeddings.'
        ),
    )
    p.add_argument("sentence", nargs="?", help="the sentence (default: the seeds' example)")
    p.add_argument("--embeddings", metavar="FILE", help="JSON or CSV file, one vector per token")
    p.add_argument("--dim", type=int, help="width of seeded random embeddings (default: 3)")
    p.add_argument("--stage", default="all", help=f"one of {', '.join(STAGES)} or all")
    p.add_argument("--heads", type=int, default=2, help="heads of the multihead stage (2)")
    p.add_argument("--d-out", type=int, default=2, help="d_out of the trainable stages (2)")
    p.add_argument("--dropout", type=float, default=0.5, help="dropout of the dropout stage (0.5)")
    p.add_argument(
        "--seed", type=int, help="seed for embeddings and modules (default: the book's seeds)"
    )
    p.add_argument(
        "--query",
        metavar="TOKEN",
        help="follow one token step by step; TOKEN#n picks the n-th of a repeated token",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="output format (text); html: the offline step-through page",
    )
    p.add_argument(
        "--lang",
        default="en",
        help=f"language of the html page: {', '.join(LANGS)} (default: en)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.stage != "all" and args.stage not in STAGES:
        raise CliError(f"unknown stage {args.stage!r}; choose from {', '.join(STAGES)} or all")
    if args.lang not in LANGS:
        raise CliError(f"unknown --lang {args.lang!r}; choose from {', '.join(LANGS)}")
    stages = STAGES if args.stage == "all" else (args.stage,)
    try:
        tokens, x, source = resolve_sentence_source(
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
        expl.options["embeddings"] = source
        text = render(expl, fmt=args.format, query=args.query, lang=args.lang)
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from None
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
