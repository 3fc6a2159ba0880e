"""``attnkit demo``: the main job — every seed stage on the tutorial's example."""

from __future__ import annotations

import argparse

import torch

from attnkit import modules
from attnkit.cli import HelpFormatter, writable_output
from attnkit.examples import HELLO_SHINY_SUN, YOUR_JOURNEY

EXAMPLES = """\
examples:
  attnkit demo                      # the whole tour (about a minute on 2 cores)
  attnkit demo --no-gpt --out /tmp/tour
  attnkit generate --checkpoint attnkit-out/gpt/checkpoint --prompt "12345678>"
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the tour: every seed stage, the explain walkthrough, a tiny GPT trained",
        description=(
            "Run every stage of the seed tutorial on its example sentence, walk through how "
            '"journey" gets its context vector, draw the attention maps, then train a tiny '
            "GPT to reverse digits and save it for `attnkit generate`. Pictures (PNG/SVG) "
            "need the [viz] extra; the HTML view does not."
        ),
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", default="attnkit-out", help="folder for what the demo writes")
    p.add_argument("--no-gpt", action="store_true", help="skip training the tiny GPT")
    p.set_defaults(func=run)


def _show(title: str, t: torch.Tensor) -> None:
    print(f"\n== {title}  shape={tuple(t.shape)}")
    print(_fmt(t))


def _fmt(t: torch.Tensor) -> str:
    rows = t.reshape(-1, t.shape[-1]).tolist()
    return "\n".join("  " + " ".join(f"{v:8.4f}" for v in row) for row in rows)


def run(args: argparse.Namespace) -> int:
    out = writable_output(args.out)
    writable_output(out / "maps")
    writable_output(out / "gpt")
    torch.set_printoptions(precision=4, sci_mode=False)
    hello = HELLO_SHINY_SUN.tensor()
    print("attnkit demo: the seed tutorial, stage by stage\n")
    print('"Hello shiny sun!": the context vector of "shiny" (simplified self-attention)')
    print("  " + " ".join(f"{v:.4f}" for v in modules.SimplifiedSelfAttention()(hello)[1].tolist()))

    x = YOUR_JOURNEY.tensor()
    batch = torch.stack((x, x))  # (2, 6, 3)
    print(f'\n"{" ".join(YOUR_JOURNEY.tokens)}": {x.shape[0]} tokens, d_in={x.shape[1]}')
    with torch.no_grad():
        _show("simplified self-attention (softmax)", modules.SimplifiedSelfAttention()(x))
        _show(
            "simplified self-attention (sum-normalised)", modules.SimplifiedSelfAttention("sum")(x)
        )
        torch.manual_seed(123)
        _show("SelfAttentionV1(3, 2), seed 123", modules.SelfAttentionV1(3, 2)(x))
        torch.manual_seed(789)
        _show("SelfAttentionV2(3, 2), seed 789", modules.SelfAttentionV2(3, 2)(x))
        torch.manual_seed(123)
        ca = modules.CausalAttention(3, 2, context_length=6, dropout=0.0)
        _show("CausalAttention(3, 2, 6, 0.0), seed 123, batch of 2", ca(batch))
        torch.manual_seed(123)
        wrap = modules.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
        _show("MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2), seed 123", wrap(batch))
        torch.manual_seed(123)
        mha = modules.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
        _show("MultiHeadAttention(3, 2, 6, 0.0, num_heads=2), seed 123", mha(batch))
    from attnkit.explain import demo_section as explain_section

    explain_section(out / "maps")  # the explain walkthrough and attention maps
    if not args.no_gpt:
        from attnkit.train import demo_section as gpt_section

        gpt_section(out / "gpt")  # train, evaluate and sample the tiny GPT
    return 0
