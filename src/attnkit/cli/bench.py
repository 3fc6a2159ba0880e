"""``attnkit bench``: the attention benchmark suite (see :mod:`attnkit.bench.suite`)."""

from __future__ import annotations

import argparse

from attnkit.cli import CliError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from attnkit.bench.suite import build_arg_parser

    parser = sub.add_parser("bench", help="benchmark attnkit's backends and modules against peers")
    build_arg_parser(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.bench.suite import run_suite

    if args.reps < 1:
        raise CliError(f"--reps must be at least 1, got {args.reps}")
    run_suite(args.out, quick=args.quick, grid=args.grid, reps=args.reps, note=args.note)
    print((args.out / "results.md").read_text())
    return 0
