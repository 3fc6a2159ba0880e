"""``attnkit serve``: continuous batching on a paged KV cache, for a checkpoint's prompts
or on a small random GPT (the demo)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from attnkit.cli import CliError, HelpFormatter, encode_prompt, new_tokens_for

if TYPE_CHECKING:
    from attnkit.models import GPT
    from attnkit.models.serving import Server

EXAMPLES = """\
examples:
  attnkit serve --checkpoint runs/rev --prompt "31415926>" --prompt "2718>" --prompt "1>"
  attnkit serve --checkpoint runs/notes --prompts-file prompts.txt --max-new-tokens 40
  attnkit serve --demo
  attnkit serve --demo --requests 12 --max-batch 4 --page-size 8 --check

With --checkpoint (one written by `attnkit train`), every prompt is a request: they are
served together, greedily, and each continuation is printed on stdout in the order the
prompts were given (the server's joins, finishes and speed go to stderr). A request
gets at most the context_length of the checkpoint: a longer --max-new-tokens is cut
there, with a note (`attnkit generate` slides its input past it instead).

The demo builds a small GPT with random weights (nothing is downloaded), submits
requests with prompts of different lengths, and steps the server: requests join as
slots and pages free up, prompts are prefilled in chunks beside the running decodes,
and each request leaves when it has its tokens. --check decodes every request alone
as well and compares the tokens (they must be identical).
"""

#: Tokens a demo request gets when --max-new-tokens is not given.
DEMO_NEW_TOKENS = 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="continuous batching on a paged KV cache (a checkpoint's prompts, or a demo)",
        description=(
            "Serve concurrent greedy generation requests with one GPT on a paged KV cache "
            "(attnkit.models.serving.Server): the prompts given, with a checkpoint of "
            "`attnkit train`, or --demo's on a small random model."
        ),
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", metavar="DIR", help="serve this checkpoint")
    source.add_argument("--demo", action="store_true", help="serve a small random GPT")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt to continue (with --checkpoint; give the flag once per request)",
    )
    p.add_argument(
        "--prompts-file",
        metavar="FILE",
        default=None,
        help="prompts to continue, one a line (with --checkpoint; blank lines skipped)",
    )
    p.add_argument("--requests", type=int, default=6, help="requests the demo submits")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=(
            f"tokens each request gets (default: a checkpoint's answer length, or the rest "
            f"of its context for text; {DEMO_NEW_TOKENS} in the demo)"
        ),
    )
    p.add_argument("--max-batch", type=int, default=4, help="most requests running at once")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--prefill-chunk", type=int, default=32, help="prompt tokens a step")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo's weights and prompts")
    p.add_argument("--check", action="store_true", help="compare with each request alone")
    p.set_defaults(func=run)


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise CliError(f"{flag} must be >= 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is None and not args.demo:
        raise CliError("serve needs --checkpoint DIR with --prompt (or --prompts-file), or --demo")
    if args.demo and (args.prompt or args.prompts_file):
        raise CliError("--prompt and --prompts-file go with --checkpoint, not --demo")
    flags = ["max_batch", "page_size", "prefill_chunk"]
    flags += ["requests"] if args.demo else []
    flags += ["max_new_tokens"] if args.max_new_tokens is not None else []
    for flag in flags:
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    return _demo(args) if args.demo else _checkpoint(args)


def _checkpoint(args: argparse.Namespace) -> int:
    """Serve the prompts given with a checkpoint; continuations on stdout, in order."""
    from attnkit.train import CheckpointError, load_checkpoint

    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise CliError(f"--prompts-file {str(path)!r}: {err}") from None
        texts += [line for line in lines if line.strip()]
    if not texts:
        raise CliError("no prompt: give --prompt TEXT (once per request) or --prompts-file FILE")
    try:
        model, tokenizer, meta, _ = load_checkpoint(args.checkpoint)
    except CheckpointError as err:
        raise CliError(str(err)) from None
    ctx = model.cfg.context_length
    prompts, news = [], []
    for i, text in enumerate(texts, 1):
        ids = encode_prompt(tokenizer, text, f"prompt {i}")
        if len(ids) >= ctx:
            raise CliError(
                f"prompt {i} has {len(ids)} tokens: no room for a new one in the "
                f"context_length of {ctx}"
            )
        n = args.max_new_tokens
        if n is None:
            n = new_tokens_for(meta, ctx, len(ids))
        elif n > ctx - len(ids):
            print(
                f"note: prompt {i} gets {ctx - len(ids)} new tokens, not {n}: the rest of "
                f"the context_length of {ctx}",
                file=sys.stderr,
            )
            n = ctx - len(ids)
        prompts.append(ids)
        news.append(n)
    server = _server(model, args)
    ids = [server.submit(p, n) for p, n in zip(prompts, news, strict=True)]

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    log(
        f"attnkit serve: {len(ids)} requests, at most {args.max_batch} at once, pages of "
        f"{args.page_size} tokens ({server.cache.num_pages} in the pool)"
    )
    _drive(server, ids, log)
    for rid, text, p in zip(ids, texts, prompts, strict=True):
        print(text + tokenizer.decode(server.result(rid)[len(p) :]))
    return _check(model, server, ids, prompts, news, log) if args.check else 0


def _demo(args: argparse.Namespace) -> int:
    """Serve random prompts with a small random GPT, showing the server's steps."""
    from attnkit.models import GPT, GPTConfig

    new = DEMO_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    torch.manual_seed(args.seed)
    cfg = GPTConfig.preset("tiny", context_length=256, emb_dim=128, n_layers=4, rope=True)
    max_prompt = cfg.context_length - new
    if max_prompt < 1:
        raise CliError(
            f"--max-new-tokens {new} leaves no room for a prompt in the demo model's "
            f"context of {cfg.context_length}"
        )
    model = GPT(cfg)
    server = _server(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(1, min(96, max_prompt) + 1, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    print(
        f"attnkit serve --demo: a random GPT ({cfg.n_layers} layers, d={cfg.emb_dim}), "
        f"{args.requests} requests (prompts {min(lengths)}-{max(lengths)} tokens, "
        f"{new} new each), at most {args.max_batch} at once, pages of "
        f"{args.page_size} tokens ({server.cache.num_pages} in the pool)"
    )
    ids = [server.submit(p, new) for p in prompts]
    _drive(server, ids, print)
    for rid, p in zip(ids, prompts, strict=True):
        got = server.result(rid)[len(p) :]
        print(f"  #{rid}: prompt {len(p):3d} tokens -> {got[:8]}{' ...' if len(got) > 8 else ''}")
    news = [new] * len(ids)
    return _check(model, server, ids, prompts, news, print) if args.check else 0


def _server(model: GPT, args: argparse.Namespace) -> Server:
    from attnkit.models.serving import Server

    return Server(
        model, page_size=args.page_size, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk
    )


def _drive(server: Server, ids: list[int], log: Callable[[str], None]) -> None:
    """Step ``server`` until every request has its tokens, logging who joins and leaves
    and, at the end, the throughput."""
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
            log(" ".join(parts) + f"  (free pages {server.cache.num_free_pages})")
        running = now
    dt = time.perf_counter() - t0
    log(
        f"{len(ids)} requests, {tokens} new tokens in {steps} steps, {dt:.2f} s "
        f"({tokens / dt:.0f} tokens/s)"
    )


def _check(
    model: GPT,
    server: Server,
    ids: list[int],
    prompts: list[list[int]],
    news: list[int],
    log: Callable[[str], None],
) -> int:
    """Decode every request alone (greedy, ``GPT.generate``) and compare the tokens: 0
    where all are identical, else 1."""
    same = sum(
        model.generate(torch.tensor([p]), n)[0].tolist() == server.result(rid)
        for rid, p, n in zip(ids, prompts, news, strict=True)
    )
    log(f"check: {same} of {len(ids)} requests got the tokens they get alone")
    return 0 if same == len(ids) else 1
