"""``attnkit viz``: write attention maps as PNG, SVG or one offline HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli import CliError

_SUFFIXES = (".png", ".svg", ".html", ".htm")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "viz",
        help="draw attention maps (PNG, SVG, offline HTML)",
        description=(
            "Draw attention maps from an `attnkit explain --format json` run, a saved "
            "attnkit.trace recording, or Hugging Face `outputs.attentions` saved with "
            "torch.save / numpy .npz / safetensors. Without INPUT: the default explain run."
        ),
    )
    p.add_argument("input", nargs="?", help="a .json explain run, .pt/.pth, .npz or .safetensors")
    p.add_argument("--tokens", help="token labels, separated by spaces")
    p.add_argument("--tokens-file", metavar="FILE", help="token labels, one per line")
    p.add_argument(
        "-o",
        "--out",
        action="append",
        metavar="PATH",
        help="output file(s); the suffix picks .png, .svg or .html (default attention.html)",
    )
    p.add_argument("--layer", type=int, default=0, help="layer (or stage) index for PNG/SVG (0)")
    p.add_argument("--batch-index", type=int, default=0, help="which sequence of a batch (0)")
    p.add_argument("--title", default="attention", help="heading of the HTML view")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnkit import viz

    outs = [Path(o) for o in (args.out or ["attention.html"])]
    for out in outs:
        if out.suffix.lower() not in _SUFFIXES:
            raise CliError(f"output {str(out)!r}: suffix must be one of {', '.join(_SUFFIXES)}")
    try:
        tokens = _tokens(args)
        if args.input is None:
            from attnkit.examples import YOUR_JOURNEY
            from attnkit.explain import explain

            expl = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor())
            maps = viz.from_explanation(expl)
        else:
            maps = viz.load_attentions(args.input, tokens, batch_index=args.batch_index)
        for out in outs:
            written = viz.save(maps, out, layer=args.layer, title=args.title)
            print(f"wrote {written}")
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from None
    except ImportError as err:
        raise CliError(f"{err}; PNG/SVG need matplotlib: pip install 'attnkit[viz]'") from None
    return 0


def _tokens(args: argparse.Namespace) -> list[str] | None:
    if args.tokens is not None and args.tokens_file is not None:
        raise ValueError("give --tokens or --tokens-file, not both")
    if args.tokens is not None:
        tokens = args.tokens.split()
    elif args.tokens_file is not None:
        try:
            text = Path(args.tokens_file).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot read {args.tokens_file!r}: {err.strerror}") from None
        tokens = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        return None
    if not tokens:
        raise ValueError("the token list is empty")
    return tokens
