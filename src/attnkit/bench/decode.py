"""Decode benchmark: tokens/s of a GPT-2-small-shaped GPT, with and without the KV cache,
and against Hugging Face ``GPT2LMHeadModel.generate`` holding the same weights.

Run: ``python -m attnkit.bench.decode [--new-tokens 200] [--uncached-tokens 200]``.
Weights are random (seeded); nothing is downloaded. Greedy decoding, batch 1, fp32.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from attnkit.models import GPT, GPTConfig

__all__ = ["kv_cache_bytes", "run"]


def kv_cache_bytes(cfg: GPTConfig, context: int, batch_size: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of the K and V buffers of every layer for ``context`` positions."""
    h_kv = cfg.n_kv_heads or cfg.n_heads
    length = min(context, cfg.window) if cfg.window else context
    head_dim = cfg.emb_dim // cfg.n_heads
    return 2 * cfg.n_layers * batch_size * h_kv * length * head_dim * dtype_bytes


def _time(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(
    preset: str = "gpt2-small",
    prompt_len: int = 64,
    new_tokens: int = 200,
    uncached_tokens: int | None = None,
    compare_hf: bool = True,
    seed: int = 0,
    repeats: int = 2,
) -> dict[str, Any]:
    """Measure decoding speed; returns a dict of the numbers (tokens/s and ratios).

    Args:
        preset: the :class:`GPTConfig` preset.
        prompt_len: prompt tokens.
        new_tokens: greedy tokens generated per timed run.
        uncached_tokens: tokens for the (slow) uncached run; default ``new_tokens``.
            Its tokens/s is measured over the first ``uncached_tokens`` steps, which
            favours it (later steps are longer), so the reported ratio is a lower bound.
        compare_hf: also time ``transformers``' ``GPT2LMHeadModel.generate``.
        seed: seed of the weights and the prompt.
        repeats: timed runs of the cached and HF decoders, interleaved; the best counts.
    """
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(preset)
    model = GPT(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len))
    res: dict[str, Any] = {
        "preset": preset,
        "params": model.num_parameters(),
        "threads": torch.get_num_threads(),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }
    model.generate(prompt, 4, temperature=0)  # warm-up
    hf_gen = _hf_generator(model, prompt, new_tokens) if compare_hf else None
    t_cached, t_hf = float("inf"), float("inf")
    for _ in range(repeats):  # interleaved, best of: the CPU may be shared
        t, out_cached = _time(lambda: model.generate(prompt, new_tokens, temperature=0))
        t_cached = min(t_cached, t)
        if hf_gen is not None:
            t, out_hf = _time(hf_gen)
            t_hf = min(t_hf, t)
    res["cached_tok_s"] = new_tokens / t_cached
    n_unc = new_tokens if uncached_tokens is None else uncached_tokens
    t_unc, out_unc = _time(lambda: model.generate(prompt, n_unc, temperature=0, use_cache=False))
    res["uncached_tokens"] = n_unc
    res["uncached_tok_s"] = n_unc / t_unc
    res["cache_speedup"] = res["cached_tok_s"] / res["uncached_tok_s"]
    res["uncached_tokens_identical"] = bool(torch.equal(out_unc, out_cached[:, : out_unc.shape[1]]))
    if hf_gen is not None:
        res["hf_tok_s"] = new_tokens / t_hf
        res["vs_hf"] = res["cached_tok_s"] / res["hf_tok_s"]
        res["hf_tokens_identical"] = bool(torch.equal(out_hf, out_cached))
        with torch.no_grad():
            ours = model(out_cached[:, :-1])[:, -new_tokens:]
            theirs = hf_gen.model(out_cached[:, :-1]).logits[:, -new_tokens:]
        res["hf_max_logit_diff"] = float((ours - theirs).abs().max())
    ctx = cfg.context_length
    res["kv_cache_MiB_at_context"] = {
        name: kv_cache_bytes(GPTConfig.preset(preset, n_kv_heads=kv), ctx) / 2**20
        for name, kv in (("MHA", cfg.n_heads), ("GQA-4", 4), ("MQA", 1))
        if cfg.n_heads % kv == 0
    }
    return res


class _HFGenerate:
    """Greedy ``GPT2LMHeadModel.generate`` (cache on) with attnkit's weights copied in."""

    def __init__(self, model: Any, prompt: torch.Tensor, new_tokens: int) -> None:
        self.model, self.prompt = model, prompt
        self.kwargs = dict(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            eos_token_id=None,
            attention_mask=torch.ones_like(prompt),
        )

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        return self.model.generate(self.prompt, **self.kwargs)


def _hf_generator(model: GPT, prompt: torch.Tensor, new_tokens: int) -> _HFGenerate:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from attnkit.models.hf_gpt2 import export_hf_gpt2_state_dict

    hf_logging.set_verbosity_error()
    c = model.cfg
    hf_cfg = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.context_length,
        n_embd=c.emb_dim,
        n_layer=c.n_layers,
        n_head=c.n_heads,
        tie_word_embeddings=False,  # attnkit's out_head is its own matrix
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = GPT2LMHeadModel(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(export_hf_gpt2_state_dict(model), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"HF GPT-2 weights did not map: missing {missing}, unexpected {unexpected}"
        )
    gen = _HFGenerate(hf, prompt, new_tokens)
    with torch.no_grad():
        hf.generate(prompt, **{**gen.kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    return gen


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: print the numbers as a table and as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--uncached-tokens", type=int, default=None)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(
        args.preset,
        args.prompt_len,
        args.new_tokens,
        args.uncached_tokens,
        compare_hf=not args.no_hf,
        repeats=args.repeats,
    )
    for key, value in res.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
