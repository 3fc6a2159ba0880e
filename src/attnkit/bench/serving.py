"""Serving benchmarks (issue 20): the paged KV cache and continuous batching.

* **paged decode step**: one decode attention call (GPT-2-small heads: 12 x 64, batch 1)
  against ``L`` cached keys held in pages of ``page_size`` tokens, in a shuffled page
  order, vs the same call on a contiguous cache (what :class:`attnkit.KVCache` returns)
  on the same native kernel (``backend="blockwise"``): what the page table costs; fp32
  and bf16; goal <= 1.1. Beside it, the contiguous call through ``auto``, which takes
  torch's SDPA where this machine measured that faster (``calibrate.decode_pays``; the
  Xeon of session 28 did for steps without GQA), and the paged step over it. Both sides
  live where attnkit allocates them (a :class:`attnkit.KVCache`'s buffers, a
  :class:`attnkit.PagedKVCache`'s pool: large CPU ones in transparent huge pages, see
  ``attnkit._memory``).
* **continuous batching**: GPT-2-small shape, random weights (seeded; nothing is
  downloaded), ``--requests`` requests with prompts of 16-256 tokens and 64 new tokens
  each, greedy: :class:`attnkit.models.serving.Server` vs transformers'
  ``generate_batch`` (``attn_implementation="sdpa"``, its paged cache) holding the same
  weights; tokens compared, throughput ratio (goal >= 2).

Run: ``python -m attnkit.bench.serving [--quick] [--threads N] [--out results.json]``. The
two sides of each ratio are measured in one run, interleaved (best of ``--repeats`` for the
serving race; for the decode step, shuffled rounds of one call each and the median of the
per-round ratios, :func:`attnkit.bench.timing.ratio_row`), with the same torch thread
count (recorded).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any, cast

import torch

from attnkit.attention import attention
from attnkit.bench import report
from attnkit.bench.timing import interleaved, ratio_row, ratio_text
from attnkit.kv_cache import KVCache
from attnkit.paged_attention import paged_attention
from attnkit.paged_kv_cache import PagedKVCache

__all__ = ["continuous_batching", "paged_decode", "run"]


def paged_decode(
    length: int = 4096, page_size: int = 16, dtype: torch.dtype = torch.float32, reps: int = 200
) -> dict[str, Any]:
    """One decode attention call on pages vs on a contiguous cache (see the module docs)."""
    gen = torch.Generator().manual_seed(0)
    h, d = 12, 64
    q = torch.randn(1, h, 1, d, generator=gen).to(dtype)
    k = torch.randn(1, h, length, d, generator=gen).to(dtype)
    v = torch.randn(1, h, length, d, generator=gen).to(dtype)
    # both sides as attnkit allocates them: a KVCache's buffers, a PagedKVCache's pool
    contiguous = KVCache(1, length, h, d, dtype=dtype)
    with torch.no_grad():
        k, cached = contiguous.update(torch.arange(length), k, v)  # (1, h, length, d) views
    v = cast(torch.Tensor, cached)  # (a cache with values)
    n = -(-length // page_size)
    order = torch.randperm(n, generator=gen)  # page i of the sequence is pool page order[i]
    pool = PagedKVCache(n, page_size, h, d, dtype=dtype)
    k_pages, v_pages = pool.k_pages[0], pool.v_pages[0]  # (n, h, page_size, d)
    pad = n * page_size - length
    k_pages[order] = (
        torch.nn.functional.pad(k[0], (0, 0, 0, pad)).view(h, n, page_size, d).transpose(0, 1)
    )
    v_pages[order] = (
        torch.nn.functional.pad(v[0], (0, 0, 0, pad)).view(h, n, page_size, d).transpose(0, 1)
    )
    table = order[None]  # (1, n)
    with torch.inference_mode():
        ref = attention(q, k, v, backend="blockwise")
        out = paged_attention(q, k_pages, v_pages, table, length, causal=False)
        err = (out.float() - ref.float()).abs().max().item()  # type: ignore[union-attr]
        times = interleaved(
            {
                "contiguous": lambda: attention(q, k, v, backend="blockwise"),
                "auto": lambda: attention(q, k, v),
                "paged": lambda: paged_attention(q, k_pages, v_pages, table, length, causal=False),
            },
            reps,
        )
    return {
        "length": length,
        "page_size": page_size,
        "dtype": str(dtype).removeprefix("torch."),
        "contiguous_us": statistics.median(times["contiguous"]) * 1e6,
        "paged_us": statistics.median(times["paged"]) * 1e6,
        **ratio_row(times["paged"], times["contiguous"]),
        "max_abs_diff": err,
        "auto_us": statistics.median(times["auto"]) * 1e6,
        "paged_over_auto": ratio_row(times["paged"], times["auto"])["ratio"],
    }


def continuous_batching(
    requests: int = 8,
    new_tokens: int = 64,
    prompt_range: tuple[int, int] = (16, 256),
    repeats: int = 2,
    small: bool = False,
) -> dict[str, Any]:
    """attnkit's :class:`~attnkit.models.serving.Server` vs transformers' ``generate_batch``
    on the same random GPT-2-small-shaped weights (``small``: a 2-layer model, for tests)."""
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from attnkit.models import GPT
    from attnkit.models.hf_gpt2 import config_from_hf, load_hf_gpt2_state_dict
    from attnkit.models.serving import Server

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=512) if small else {}
    hf_cfg = GPT2Config(**shape, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    hf.set_attn_implementation("sdpa")
    ours = load_hf_gpt2_state_dict(GPT(config_from_hf(hf_cfg)), hf.state_dict()).eval()
    gen = torch.Generator().manual_seed(1)
    lo, hi = prompt_range
    lengths = torch.randint(lo, hi + 1, (requests,), generator=gen).tolist()
    if requests >= 2:
        lengths[0], lengths[1] = lo, hi
    prompts = [torch.randint(0, hf_cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    page = 16
    pages = sum(-(-(n + new_tokens) // page) for n in lengths)

    def run_ours() -> list[list[int]]:
        server = Server(
            ours, page_size=page, num_pages=pages, max_batch=requests, prefill_chunk=256
        )
        ids = [server.submit(p, new_tokens) for p in prompts]
        server.run()
        return [server.result(r)[len(p) :] for r, p in zip(ids, prompts, strict=True)]

    gcfg = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(
        num_blocks=2 * pages, page_size=page, max_batch_tokens=512, max_requests_per_batch=requests
    )

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate_batch(
                inputs=prompts,
                generation_config=gcfg,
                continuous_batching_config=cb,
                progress_bar=False,
            )
        return [list(out[f"req_{i}"].generated_tokens) for i in range(requests)]

    best = {"attnkit": float("inf"), "transformers": float("inf")}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, fn in (("attnkit", run_ours), ("transformers", run_hf)):
            t0 = time.perf_counter()
            outs[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    same = sum(a == b for a, b in zip(outs["attnkit"], outs["transformers"], strict=True))
    total = requests * new_tokens
    return {
        "requests": requests,
        "new_tokens": new_tokens,
        "prompt_lengths": lengths,
        "layers": hf_cfg.n_layer,
        "attnkit_s": best["attnkit"],
        "transformers_s": best["transformers"],
        "attnkit_tok_s": total / best["attnkit"],
        "transformers_tok_s": total / best["transformers"],
        "speedup": best["transformers"] / best["attnkit"],
        "identical_requests": same,
    }


#: What the continuous-batching race needs and this install may lack.
NEEDS_HF = "needs transformers: pip install 'attnkit[hf]'"


def run(quick: bool = False, repeats: int = 2) -> dict[str, Any]:
    """Every serving measurement (``quick``: toy sizes, seconds, not graded). Without
    transformers the continuous-batching race is skipped (``{"skipped": why}``)."""
    length, reps = (512, 20) if quick else (4096, 200)
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "quick": quick}
    result["paged_decode"] = [
        paged_decode(length, 16, dtype, reps) for dtype in (torch.float32, torch.bfloat16)
    ]
    if importlib.util.find_spec("transformers") is None:
        result["continuous_batching"] = {"skipped": NEEDS_HF}
    elif quick:
        result["continuous_batching"] = continuous_batching(3, 8, (4, 24), 1, small=True)
    else:
        result["continuous_batching"] = continuous_batching(repeats=repeats)
    return result


def markdown(result: dict[str, Any]) -> str:
    """The serving results as a Markdown section (``serving.md``)."""
    lines = [
        f"## Serving (issue 20): paged KV cache and continuous batching, "
        f"{result['threads']} threads",
        "",
        "| paged decode step | paged | contiguous, same kernel | paged / contiguous (goal <= 1.1) "
        "| contiguous through auto | paged / auto |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["paged_decode"]:
        lines.append(
            f"| L={row['length']}, page {row['page_size']}, {row['dtype']} "
            f"| {row['paged_us']:.0f} us | {row['contiguous_us']:.0f} us | {ratio_text(row)} "
            f"| {row['auto_us']:.0f} us | {row['paged_over_auto']:.3f} |"
        )
    cb = result["continuous_batching"]
    lines.append("")
    if "skipped" in cb:
        lines.append(
            f"Continuous batching against transformers' `generate_batch`: skipped ({cb['skipped']})."
        )
    else:
        lines.append(
            f"Continuous batching, {cb['requests']} requests x {cb['new_tokens']} new tokens "
            f"({cb['layers']} layers): attnkit {cb['attnkit_tok_s']:.1f} tok/s, transformers "
            f"`generate_batch` {cb['transformers_tok_s']:.1f} tok/s = **{cb['speedup']:.2f}x** "
            f"(goal >= 2); {cb['identical_requests']}/{cb['requests']} requests with identical "
            f"tokens."
        )
    if result.get("quick"):
        lines += ["", "(--quick: toy sizes, not graded against the goals)"]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path) -> None:
    """``serving.json`` and ``serving.md`` in ``out``."""
    report.write_pair(out, "serving", result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=2, help="serving races (best counts)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both sides (default: torch's)"
    )
    args = parser.parse_args(argv)
    report.check_output(parser, "--out", args.out)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    result = run(args.quick, args.repeats)
    print(markdown(result), end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
