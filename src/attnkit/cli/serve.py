"""``attnkit serve``: continuous batching on a paged KV cache, shown on a small GPT."""

from __future__ import annotations

import argparse
import time

import torch

from attnkit.cli import CliError, HelpFormatter

EXAMPLES = """\
examples:
  attnkit serve --demo
  attnkit serve --demo --requests 12 --max-batch 4 --page-size 8 --check

The demo builds a small GPT with random weights (nothing is downloaded), submits
requests with prompts of different lengths, and steps the server: requests join as
slots and pages free up, prompts are prefilled in chunks beside the running decodes,
and each request leaves when it has its tokens. --check decodes every request alone
as well and compares the tokens (they must be identical).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="continuous batching on a paged KV cache (a demo with a random GPT)",
        description=(
            "Serve concurrent generation requests with one GPT on a paged KV cache "
            "(attnkit.models.serving.Server). --demo runs it on a small random model."
        ),
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--demo", action="store_true", help="run the demo (required for now)")
    p.add_argument("--requests", type=int, default=6, help="requests to submit")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each request gets")
    p.add_argument("--max-batch", type=int, default=4, help="most requests running at once")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--prefill-chunk", type=int, default=32, help="prompt tokens a step")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    p.add_argument("--check", action="store_true", help="compare with each request alone")
    p.set_defaults(func=run)


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise CliError(f"{flag} must be >= 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from attnkit.models import GPT, GPTConfig
    from attnkit.models.serving import Server

    if not args.demo:
        raise CliError("serve runs only as a demo for now: pass --demo")
    for flag in ("requests", "max_new_tokens", "max_batch", "page_size", "prefill_chunk"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    torch.manual_seed(args.seed)
    cfg = GPTConfig.preset("tiny", context_length=256, emb_dim=128, n_layers=4, rope=True)
    max_prompt = cfg.context_length - args.max_new_tokens
    if max_prompt < 1:
        raise CliError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
            f"demo model's context of {cfg.context_length}"
        )
    model = GPT(cfg)
    server = Server(
        model,
        page_size=args.page_size,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
    )
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(1, min(96, max_prompt) + 1, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    print(
        f"attnkit serve --demo: a random GPT ({cfg.n_layers} layers, d={cfg.emb_dim}), "
        f"{args.requests} requests (prompts {min(lengths)}-{max(lengths)} tokens, "
        f"{args.max_new_tokens} new each), at most {args.max_batch} at once, pages of "
        f"{args.page_size} tokens ({server.cache.num_pages} in the pool)"
    )
    ids = [server.submit(p, args.max_new_tokens) for p in prompts]
    running: set[int] = set()
    steps = tokens = 0
    t0 = time.perf_counter()
    while server.pending:
        out = server.step()
        steps += 1
        tokens += len(out)
        now = {rid for rid in ids if not server.done(rid) and rid in server.running}
        joined, left = sorted(now - running), sorted(r for r in running - now)
        left += [r for r in out if server.done(r) and r not in running]  # in and out at once
        if joined or left:
            parts = [f"step {steps:4d}:"]
            if joined:
                parts.append("joined " + ", ".join(f"#{r}" for r in joined))
            if left:
                parts.append("finished " + ", ".join(f"#{r}" for r in sorted(set(left))))
            print(" ".join(parts) + f"  (free pages {server.cache.num_free_pages})")
        running = now
    dt = time.perf_counter() - t0
    print(
        f"{args.requests} requests, {tokens} new tokens in {steps} steps, {dt:.2f} s "
        f"({tokens / dt:.0f} tokens/s)"
    )
    for rid, p in zip(ids, prompts, strict=True):
        new = server.result(rid)[len(p) :]
        print(f"  #{rid}: prompt {len(p):3d} tokens -> {new[:8]}{' ...' if len(new) > 8 else ''}")
    if args.check:
        same = sum(
            model.generate(torch.tensor([p]), args.max_new_tokens)[0].tolist() == server.result(rid)
            for rid, p in zip(ids, prompts, strict=True)
        )
        print(f"check: {same} of {len(ids)} requests got the tokens they get alone")
        if same != len(ids):
            return 1
    return 0
