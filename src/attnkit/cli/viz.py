"""``attnkit viz``: write attention maps as PNG, SVG, PDF or one offline HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli import CliError, HelpFormatter, output_file

_PICTURES = (".png", ".svg", ".pdf")
_SUFFIXES = (*_PICTURES, ".html", ".htm")

EXAMPLES = """\
examples:
  attnkit viz -o journey.html                        # the seeds' example, every stage
  attnkit explain "The cat sat" --format json > run.json && attnkit viz run.json -o cat.png
  attnkit viz attn.pt --tokens "The cat sat" -o maps.png --layer all --head 0 --head 3
  attnkit viz trace.pt --tokens "a b c d" -o trace.pdf --layer 1

Saving inputs:
  Hugging Face: out = model(**enc, output_attentions=True)   (or model.generate(...,
    output_attentions=True, return_dict_in_generate=True)); torch.save(list(out.attentions),
    "attn.pt") and pass the tokens with --tokens.
  attnkit.trace: with attnkit.trace.record() as rec: model(x); then
    torch.save(dict(rec), "trace.pt") (every "...weights" entry becomes a layer).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "viz",
        help="draw attention maps (PNG, SVG, PDF, offline HTML)",
        description=(
            "Draw attention maps from an `attnkit explain --format json` run, a saved "
            "attnkit.trace recording, or Hugging Face `outputs.attentions` saved with "
            "torch.save / numpy .npz / safetensors. Without INPUT: the default explain run. "
            "PNG/SVG/PDF need the [viz] extra; HTML needs nothing."
        ),
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("input", nargs="?", help="a .json explain run, .pt/.pth, .npz or .safetensors")
    p.add_argument("--tokens", help="token labels, separated by spaces")
    p.add_argument("--tokens-file", metavar="FILE", help="token labels, one per line")
    p.add_argument(
        "-o",
        "--out",
        action="append",
        metavar="PATH",
        help="output file(s), repeatable; the suffix picks .png, .svg, .pdf or .html "
        "(default: attention.html)",
    )
    p.add_argument(
        "--layer",
        default="0",
        help="layer (or stage) index for PNG/SVG/PDF, or 'all' (one file per layer)",
    )
    p.add_argument(
        "--head",
        type=int,
        action="append",
        metavar="H",
        help="draw only these heads, repeatable (default: every head)",
    )
    p.add_argument("--batch-index", type=int, default=0, help="which sequence of a batch")
    p.add_argument("--title", default="attention", help="heading of the HTML view")
    p.set_defaults(func=run)


def _layers(arg: str, n: int) -> list[int]:
    if arg == "all":
        return list(range(n))
    try:
        layer = int(arg)
    except ValueError:
        raise CliError(f"--layer must be an index or 'all', got {arg!r}") from None
    if not 0 <= layer < n:
        raise CliError(f"--layer {layer} out of range: the maps have {n} layers")
    return [layer]


def run(args: argparse.Namespace) -> int:
    from attnkit import viz

    outs = [output_file(o, "-o") for o in (args.out or ["attention.html"])]
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
        layers = _layers(args.layer, len(maps.weights))
        for out in outs:
            if out.suffix.lower() not in _PICTURES:
                print(f"wrote {viz.save(maps, out, title=args.title)}")
                continue
            for layer in layers:
                path = out if len(layers) == 1 else out.with_stem(f"{out.stem}-layer{layer}")
                written = viz.plot_attention(maps, path, layer=layer, heads=args.head)
                print(f"wrote {written}")
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from None
    except ImportError:
        raise CliError("PNG/SVG/PDF need matplotlib: pip install 'attnkit[viz]'") from None
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
