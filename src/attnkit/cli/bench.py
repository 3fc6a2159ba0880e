"""``attnkit bench``: the attention benchmark suite (see :mod:`attnkit.bench.suite`)."""

from __future__ import annotations

import argparse
import importlib.util

from attnkit.cli import CliError, HelpFormatter, writable_output

EXAMPLES = """\
examples:
  attnkit bench --quick --out /tmp/bench     # smoke run: toy sizes, seconds, not graded
  attnkit bench                              # the targets (~4 min on 2 cores)
  attnkit bench --grid --note "idle VM"      # plus the full grid (~20 min more)
  attnkit bench --kernel                     # plus the native kernel, once per CPU build
  attnkit bench --mods                       # plus compiled score_mods over plain causal
  attnkit bench --serving                    # plus paged decode, continuous batching vs HF
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from attnkit.bench.suite import build_arg_parser

    parser = sub.add_parser(
        "bench",
        help="benchmark attnkit's backends and modules against peers",
        description=(
            "Time attnkit's backends and MultiHeadAttention against torch SDPA, "
            "nn.MultiheadAttention, FlexAttention and the seed tutorial's MHA; every ratio "
            "is measured within this run. Writes results.json, results.md and PNG plots "
            "(plots need the [viz] extra)."
        ),
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    build_arg_parser(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar (for logs)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.bench.suite import run_suite

    if args.reps < 1:
        raise CliError(f"--reps must be at least 1, got {args.reps}")
    out = writable_output(args.out, keep=True)  # (before minutes of timing, not after)
    result = run_suite(
        out, quick=args.quick, grid=args.grid, reps=args.reps, note=args.note, quiet=args.quiet
    )
    print((out / "results.md").read_text())
    if args.kernel:
        from attnkit.bench import native_kernel

        kernel = native_kernel.run(args.quick, args.reps)
        native_kernel.write(kernel, out)
        print(native_kernel.markdown(kernel))
    if args.mods:
        from attnkit.bench import mods

        mod_result = mods.run(args.quick, args.reps)
        mods.write(mod_result, out)
        print(mods.markdown(mod_result))
    if args.serving:
        from attnkit.bench import serving

        serving_result = serving.run(args.quick)
        serving.write(serving_result, out)
        print(serving.markdown(serving_result))
    print(f"results: {out / 'results.json'}, {out / 'results.md'}")
    if result.get("plots"):
        print(f"plots: {', '.join(result['plots'])}")
    elif importlib.util.find_spec("matplotlib") is None:
        print("plots: skipped (they need matplotlib: pip install 'attnkit[viz]')")
    if args.quick:
        print("this was a smoke run (--quick): toy sizes, ratios not graded against the targets")
    return 0
