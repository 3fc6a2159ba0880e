"""Decode benchmark: tokens/s of a GPT-2-small-shaped GPT against Hugging Face
``GPT2LMHeadModel.generate`` holding the same weights, at batch 1 and for a batch of
left-padded prompts; where a batch-1 token's time goes; KV-cache memory at 4k context.

Run: ``python -m attnkit.bench.decode [--new-tokens 128] [--batch 8]``.
Weights are random (seeded); nothing is downloaded. Greedy decoding, fp32. attnkit and
HF runs are interleaved (round-robin) and the best of ``--repeats`` counts, so the
ratios hold on a shared machine even when the absolute numbers move.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from attnkit.bench.report import check_output
from attnkit.models import GPT, GPTConfig

__all__ = ["kv_cache_bytes", "kv_memory_table", "run"]

# DeepSeek-V2's proportions: a latent of 4 head_dims, a decoupled RoPE key of half a head.
_MLA_RANK_HEADS, _MLA_ROPE_FRACTION = 4, 2


def kv_cache_bytes(cfg: GPTConfig, context: int, batch_size: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of every layer's cache for ``context`` positions (windows keep a ring)."""
    head_dim = cfg.emb_dim // cfg.n_heads
    if cfg.mla_kv_rank is not None:
        per_token = cfg.mla_kv_rank + cfg.rope_dim()  # one latent + the RoPE key
    else:
        per_token = 2 * (cfg.n_kv_heads or cfg.n_heads) * head_dim
    total = 0
    for w in cfg.windows():
        length = min(context, w) if w else context
        total += batch_size * length * per_token * dtype_bytes
    return total


def kv_memory_table(preset: str = "gpt2-small", context: int = 4096) -> dict[str, float]:
    """MiB of the KV caches at ``context`` tokens, batch 1, fp32: MHA, GQA-4, MQA, MLA.

    Measured on the caches :meth:`GPT.setup_cache` really allocates (on the ``meta``
    device: no memory is touched) and checked against :func:`kv_cache_bytes`.
    """
    base = GPTConfig.preset(preset, context_length=context)
    head_dim = base.emb_dim // base.n_heads
    variants: dict[str, dict[str, Any]] = {
        "MHA": {},
        "GQA-4": dict(n_kv_heads=4),
        "MQA": dict(n_kv_heads=1),
        "MLA": dict(
            rope=True,
            mla_kv_rank=_MLA_RANK_HEADS * head_dim,
            mla_rope_dim=head_dim // _MLA_ROPE_FRACTION,
        ),
    }
    table = {}
    for name, kw in variants.items():
        if base.n_heads % kw.get("n_kv_heads", 1):
            continue
        cfg = GPTConfig.preset(preset, context_length=context, **kw)
        with torch.device("meta"):
            model = GPT(cfg)
            model.setup_cache(1, context)
        measured = sum(c.nbytes() for c in model.caches or ())  # type: ignore[operator]
        if measured != kv_cache_bytes(cfg, context):  # pragma: no cover - a bug in one or the other
            raise RuntimeError(f"{name}: allocated {measured} B, formula says otherwise")
        table[name] = measured / 2**20
    return table


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def padded_prompts(
    batch: int, low: int, high: int, vocab: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random prompts of lengths in ``[low, high]`` (both ends included when
    ``batch >= 2``), left-padded with id 0: ``(ids, attention_mask)``."""
    lengths = torch.randint(low, high + 1, (batch,), generator=generator)
    if batch >= 2:
        lengths[0], lengths[1] = low, high
    t = int(lengths.max())
    ids = torch.zeros(batch, t, dtype=torch.long)
    mask = torch.zeros(batch, t, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, t - n :] = torch.randint(0, vocab, (n,), generator=generator)
        mask[i, t - n :] = 1
    return ids, mask


def _race(
    ours: Callable[[], torch.Tensor], theirs: Callable[[], torch.Tensor] | None, repeats: int
) -> tuple[float, float, torch.Tensor, torch.Tensor | None]:
    """Best-of-``repeats`` seconds of each, interleaved; returns both outputs too."""
    t_ours, t_theirs = float("inf"), float("inf")
    out_ours, out_theirs = None, None
    for _ in range(repeats):
        t, out_ours = _time(ours)
        t_ours = min(t_ours, t)
        if theirs is not None:
            t, out_theirs = _time(theirs)
            t_theirs = min(t_theirs, t)
    assert out_ours is not None
    return t_ours, t_theirs, out_ours, out_theirs


def profile_step(model: GPT, prompt: torch.Tensor, steps: int = 16, top: int = 8) -> dict[str, Any]:
    """Where a batch-1 decode step's time goes: ``torch.profiler`` self-times per token.

    Returns ms per token: the wall time, the top ops by self time, and what no op
    accounts for (Python and dispatch overhead).
    """
    from torch.profiler import ProfilerActivity, profile

    t0 = prompt.shape[1]
    model.pack_weights()  # as generate() does
    model.setup_cache(1, t0 + steps + 1)
    try:
        with torch.inference_mode():
            model(prompt, input_pos=torch.arange(t0))
            token = prompt[:, -1:]
            times = torch.arange(t0 + steps)

            def decode() -> None:
                for i in range(t0, t0 + steps):
                    model.step(token, times[i : i + 1])

            decode()  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall, _ = _time(decode)
    finally:
        model.delete_cache()
    rows = [(e.key, e.self_cpu_time_total / 1000 / steps) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    accounted = sum(ms for _, ms in rows)
    return {
        "wall_ms_per_token": 1000 * wall / steps,
        "ops_ms_per_token": accounted,
        "top_ops_ms_per_token": {name: round(ms, 3) for name, ms in rows[:top]},
        "unaccounted_ms_per_token": 1000 * wall / steps - accounted,
    }


def run(
    preset: str = "gpt2-small",
    prompt_len: int = 64,
    new_tokens: int = 128,
    batch: int = 8,
    min_len: int = 16,
    uncached_tokens: int = 32,
    compare_hf: bool = True,
    profile: bool = True,
    seed: int = 0,
    repeats: int = 2,
) -> dict[str, Any]:
    """Measure decoding; returns a dict of the numbers (tokens/s, ratios, profile, memory).

    Args:
        preset: the :class:`GPTConfig` preset.
        prompt_len: batch-1 prompt tokens, and the longest prompt of the batch.
        new_tokens: greedy tokens generated per row and timed run.
        batch: rows of the padded batch (prompt lengths ``min_len .. prompt_len``).
        min_len: the shortest prompt of the batch.
        uncached_tokens: tokens of the (slow) uncached batch-1 run.
        compare_hf: also time ``transformers``' ``GPT2LMHeadModel.generate``.
        profile: profile batch-1 decode steps (where the time goes).
        seed: seed of the weights and the prompts.
        repeats: timed runs of each contender, interleaved; the best counts.
    """
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(preset, qkv_bias=True)  # GPT-2 has qkv biases
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)
    ids, mask = padded_prompts(batch, min_len, prompt_len, cfg.vocab_size, g)
    res: dict[str, Any] = {
        "preset": preset,
        "params": model.num_parameters(),
        "threads": torch.get_num_threads(),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batch": batch,
        "batch_prompt_lens": mask.sum(1).tolist(),
    }
    hf = _hf_model(model) if compare_hf else None
    model.generate(prompt, 4)  # warm-up
    contests = {
        "b1": (lambda: model.generate(prompt, new_tokens), prompt, None),
        f"b{batch}": (
            lambda: model.generate(ids, new_tokens, attention_mask=mask),
            ids,
            mask,
        ),
    }
    for name, (ours, inp, am) in contests.items():
        theirs = None if hf is None else _hf_generate(hf, inp, am, new_tokens)
        t_ours, t_hf, out_ours, out_hf = _race(ours, theirs, repeats)
        rows = inp.shape[0]
        res[f"{name}_tok_s"] = rows * new_tokens / t_ours
        if hf is not None:
            res[f"{name}_hf_tok_s"] = rows * new_tokens / t_hf
            res[f"{name}_vs_hf"] = t_hf / t_ours
            same = out_hf is not None and torch.equal(out_hf, out_ours)
            res[f"{name}_hf_tokens_identical"] = bool(same)
    t_unc, out_unc = _time(lambda: model.generate(prompt, uncached_tokens, use_cache=False))
    cached = model.generate(prompt, uncached_tokens)
    res["b1_uncached_tok_s"] = uncached_tokens / t_unc
    res["uncached_tokens_identical"] = bool(torch.equal(out_unc, cached))
    if hf is not None:
        with torch.no_grad():
            ours_l = model(cached)[:, -uncached_tokens:]
            theirs_l = hf(cached).logits[:, -uncached_tokens:]
        res["hf_max_logit_diff"] = float((ours_l - theirs_l).abs().max())
    if profile:
        res["b1_profile"] = profile_step(model, prompt)
    res["kv_cache_MiB_at_4096"] = kv_memory_table(preset, 4096)
    return res


def _hf_model(model: GPT) -> Any:
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
    return hf


def _hf_generate(
    hf: Any, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int
) -> Callable[[], torch.Tensor]:
    """Greedy ``generate`` (cache on) with the same prompts and padding."""
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=None,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
    )

    @torch.no_grad()
    def call() -> torch.Tensor:
        return hf.generate(ids, **kwargs)

    with torch.no_grad():  # warm-up
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    return call


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: print the numbers as a table and as JSON."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--uncached-tokens", type=int, default=32)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    check_output(p, "--out", args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(
        args.preset,
        args.prompt_len,
        args.new_tokens,
        args.batch,
        args.min_len,
        args.uncached_tokens,
        compare_hf=not args.no_hf,
        profile=not args.no_profile,
        repeats=args.repeats,
    )
    for key, value in res.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    text = json.dumps(res)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
