"""``attnkit viz``: write attention maps as PNG, SVG, PDF or one offline HTML file; record a
local Hugging Face model through attnkit (``--hf``) for the head, model and neuron views."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from attnkit.cli import CliError, HelpFormatter, writable_output

if TYPE_CHECKING:
    from attnkit.viz import ModelRecording

_PICTURES = (".png", ".svg", ".pdf")
_SUFFIXES = (*_PICTURES, ".html", ".htm")

EXAMPLES = """\
examples:
  attnkit viz -o journey.html                        # the seeds' example, every stage
  attnkit explain "The cat sat" --format json > run.json && attnkit viz run.json -o cat.png
  attnkit viz attn.pt --tokens "The cat sat" -o maps.png --layer all --head 0 --head 3
  attnkit viz trace.pt --tokens "a b c d" -o trace.pdf --layer 1
  attnkit viz --hf ./my-gpt2 --text "The cat sat" --qk --steps 3 -o views.html
  attnkit viz --hf ./my-llama --ids "1 5 9 2" --view neuron --layer 1 --head 0 --key 2 -o n.svg
  attnkit viz attn.pt --tokens "The cat sat" --view model -o model.png
  attnkit viz --checkpoint run/ --text "12+3=" --qk --steps 3 -o gpt.html   # attnkit train's GPT

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
    hf = p.add_argument_group("recording a model: Hugging Face (the [hf] extra) or attnkit's GPT")
    hf.add_argument(
        "--hf",
        metavar="DIR",
        help="a local transformers model folder (save_pretrained); recorded through attnkit's "
        "attention, never downloaded",
    )
    hf.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="instead of --hf: an attnkit GPT checkpoint (`attnkit train`), with its tokenizer",
    )
    hf.add_argument("--text", help="the input text (needs the model's tokenizer)")
    hf.add_argument("--ids", help="the input token ids, separated by spaces")
    hf.add_argument("--qk", action="store_true", help="record queries and keys for the neuron view")
    hf.add_argument(
        "--steps", type=int, default=0, help="next-token panel: depth of the recorded tree"
    )
    hf.add_argument("--branch", type=int, default=3, help="continuations recorded per step")
    hf.add_argument("--top", type=int, default=20, help="logits kept per step")
    views = p.add_argument_group("views (head, model, neuron)")
    views.add_argument(
        "--view",
        choices=("head", "model", "neuron", "next"),
        help="PNG/SVG/PDF: the view to draw (default head with --hf); HTML: the view shown "
        "first, in the page of every view",
    )
    views.add_argument(
        "--query", type=int, help="head view: only this query; neuron view: the query"
    )
    views.add_argument("--key", type=int, default=0, help="neuron view: the key")
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

    outs = [Path(o) for o in (args.out or ["attention.html"])]
    for out in outs:
        if out.suffix.lower() not in _SUFFIXES:
            raise CliError(f"output {str(out)!r}: suffix must be one of {', '.join(_SUFFIXES)}")
        writable_output(out, "-o", folder=False)  # (refused now, not after the model runs)
    try:
        tokens = _tokens(args)
        if args.hf is not None or args.checkpoint is not None or args.view is not None:
            return _views(args, outs, tokens)
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
    except ImportError as err:
        raise CliError(_missing(err)) from None
    return 0


def _missing(err: ImportError) -> str:
    if (err.name or "").startswith("transformers") or "transformers" in str(err):
        return "--hf needs transformers: pip install 'attnkit[hf]'"
    return "PNG/SVG/PDF need matplotlib: pip install 'attnkit[viz]'"


def _views(args: argparse.Namespace, outs: list[Path], tokens: list[str] | None) -> int:
    """The head/model/neuron/next-token views of a --hf recording (or of loaded maps)."""
    from attnkit import viz

    view = args.view
    qk = args.qk or view == "neuron"
    if args.hf is not None and args.checkpoint is not None:
        raise ValueError("give --hf or --checkpoint, not both")
    if args.hf is not None or args.checkpoint is not None:
        if args.input is not None:
            raise ValueError("an INPUT of attention maps and a model to record: give one")
        if (args.text is None) == (args.ids is None):
            raise ValueError("recording a model needs --text or --ids (one of them)")
        rec = _record_hf(args, tokens, qk=qk) if args.hf else _record_gpt(args, tokens, qk=qk)
    else:
        if view in ("neuron", "next"):
            raise ValueError(f"--view {view} needs --hf or --checkpoint (a recording of the model)")
        if args.input is None:
            raise ValueError("--view without --hf needs an INPUT of attention maps")
        rec = viz.ModelRecording(
            viz.load_attentions(args.input, tokens, batch_index=args.batch_index)
        )
    for out in outs:
        if out.suffix.lower() not in _PICTURES:
            page = viz.ModelView(rec, title=args.title, start=view or "model")
            print(f"wrote {page.save(out)}")
            continue
        drawn = view or "head"
        if drawn == "next":
            raise ValueError("--view next is a page only: write .html")
        layers = [0] if drawn == "model" else _layers(args.layer, rec.num_layers)
        for layer in layers:
            path = out if len(layers) == 1 else out.with_stem(f"{out.stem}-layer{layer}")
            written = viz.plot_view(
                rec, path, view=drawn, layer=layer, heads=args.head, query=args.query, key=args.key
            )
            print(f"wrote {written}")
    return 0


def _record_hf(args: argparse.Namespace, tokens: list[str] | None, *, qk: bool) -> ModelRecording:
    import transformers

    from attnkit import viz

    folder = Path(args.hf)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--hf {args.hf!r}: no config.json there (a save_pretrained folder)")
    tokenizer = None
    if args.text is not None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"--text needs a tokenizer in {args.hf!r} ({err}); use --ids"
            ) from None
        ids = tokenizer(args.text)["input_ids"]
    else:
        ids = _ids(args.ids)
    transformers.logging.disable_progress_bar()  # stderr keeps to errors
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    except ValueError:  # not a causal LM: the encoder itself
        model = transformers.AutoModel.from_pretrained(folder, local_files_only=True)
    return viz.record_hf(
        model,
        ids,
        tokenizer=tokenizer,
        tokens=tokens,
        qk=qk,
        steps=args.steps,
        branch=args.branch,
        top=args.top,
    )


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


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split()]
    except ValueError:
        raise ValueError(f"--ids must be integers separated by spaces, got {text!r}") from None


def _record_gpt(args: argparse.Namespace, tokens: list[str] | None, *, qk: bool) -> ModelRecording:
    from attnkit import viz
    from attnkit.train import CheckpointError, load_checkpoint

    try:
        model, tokenizer, _, _ = load_checkpoint(args.checkpoint)
    except CheckpointError as err:
        raise ValueError(str(err)) from None
    ids = tokenizer.encode(args.text) if args.text is not None else _ids(args.ids)
    return viz.record_gpt(
        model,
        ids,
        decode=lambda i: tokenizer.labels([i])[0],
        tokens=tokens,
        qk=qk,
        steps=args.steps,
        branch=args.branch,
        top=args.top,
    )
