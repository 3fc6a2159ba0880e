"""The GPT: cached = uncached, chunked prefill = one shot, padded batches = rows alone,
layer patterns, StreamingLLM, argument errors, presets, HF GPT-2 weight mapping."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnkit.models import GPT, CausalSelfAttention, GPTConfig, MultiHeadLatentAttention
from attnkit.rope import RotaryEmbedding

VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "rope": dict(rope=True),
    "rope_gqa": dict(rope=True, n_kv_heads=2),
    "window": dict(window=5),
    "local_global": dict(rope=True, window=4, global_every=2, n_layers=3),
    "layer_list": dict(layer_windows=[3, None, 6], n_layers=3, n_kv_heads=1),
    "mla": dict(rope=True, mla_kv_rank=12),
    "mla_window": dict(rope=True, mla_kv_rank=12, mla_rope_dim=4, window=4, global_every=2),
    "sinks": dict(rope=True, n_kv_heads=2, window=4, global_every=2, attn_sinks=True),
    "mla_sinks": dict(rope=True, mla_kv_rank=12, attn_sinks=True),
}


def small(**kw) -> GPT:
    base = dict(vocab_size=40, context_length=32, emb_dim=32, n_layers=2, n_heads=4)
    model = GPT(GPTConfig(**{**base, **kw}))
    with torch.no_grad():  # learned sinks start at 0; make them matter
        for block in model.trf_blocks:
            if block.att.sinks is not None:
                block.att.sinks.uniform_(-1.0, 2.0)
    return model


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, t - len(p) :], mask[i, t - len(p) :] = p, 1
    return idx, mask


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_generation_equals_uncached(name):
    model = small(**VARIANTS[name]).eval()
    prompt = torch.randint(0, 40, (2, 6))
    cached = model.generate(prompt, 20, use_cache=True)
    uncached = model.generate(prompt, 20, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():  # logits of every position, recomputed vs decoded one by one
        full = model(cached)
        model.setup_cache(2)
        steps = [model(cached[:, :6], input_pos=torch.arange(6))]
        steps += [model(cached[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(6, 26)]
        model.delete_cache()
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", ["mha", "rope_gqa", "window", "local_global", "mla_window"])
def test_chunked_prefill_equals_one_shot(name, static):
    """Chunks longer and shorter than the window, then single tokens, through ring caches."""
    model = small(**VARIANTS[name]).eval()
    tokens = torch.randint(0, 40, (2, 23))
    with torch.no_grad():
        full = model(tokens)
        model.setup_cache(2, 23, static=static)
        bounds = [0, 9, 11, 12, 18, *range(19, 24)]
        chunks = [
            model(tokens[:, a:b], input_pos=torch.arange(a, b))
            for a, b in itertools.pairwise(bounds)
        ]
        model.delete_cache()
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name, use_cache",
    [(name, True) for name in VARIANTS]
    + [(name, False) for name in ("mha", "local_global", "mla_window", "sinks")],
)
def test_padded_batch_generates_what_each_prompt_generates_alone(name, use_cache):
    torch.manual_seed(1)
    model = small(**VARIANTS[name]).eval()
    prompts = [torch.randint(0, 40, (n,)) for n in (3, 9, 1, 6)]
    idx, mask = left_pad(prompts)
    out = model.generate(idx, 12, attention_mask=mask, use_cache=use_cache)
    for row, p in zip(out, prompts, strict=True):
        alone = model.generate(p[None], 12)[0, len(p) :]
        assert torch.equal(row[idx.shape[1] :], alone)


@pytest.mark.parametrize("name", ["rope_gqa", "local_global", "mla"])
def test_padded_forward_logits_equal_unpadded_rows(name):
    """Left and right padding: every real token's logits equal the row computed alone."""
    model = small(**VARIANTS[name]).eval()
    rows = [torch.randint(0, 40, (n,)) for n in (5, 11, 8)]
    idx, mask = left_pad(rows)
    right = torch.zeros_like(idx)
    right_mask = torch.zeros_like(mask)
    for i, r in enumerate(rows):
        right[i, : len(r)], right_mask[i, : len(r)] = r, 1
    with torch.no_grad():
        left_logits = model(idx, attention_mask=mask)
        right_logits = model(right, attention_mask=right_mask)
        for i, r in enumerate(rows):
            alone = model(r[None])[0]
            torch.testing.assert_close(left_logits[i, 11 - len(r) :], alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(right_logits[i, : len(r)], alone, atol=1e-5, rtol=1e-5)


def test_rows_that_reach_eos_stop_and_are_padded():
    model = small().eval()
    prompts = [torch.randint(0, 40, (n,)) for n in (4, 7)]
    idx, mask = left_pad(prompts)
    free = model.generate(idx, 10, attention_mask=mask)
    eos = int(free[0, 9])  # row 0's third new token becomes the end-of-sequence id
    out = model.generate(idx, 10, attention_mask=mask, eos_id=eos)
    for row, ref in zip(out, free, strict=True):
        hits = (ref[7:] == eos).nonzero()
        stop = 7 + int(hits[0]) + 1 if len(hits) else 17
        assert torch.equal(row[:stop], ref[:stop])
        assert (row[stop:] == eos).all()
    # every row stopped: generation ends early
    first = 7 + int((free[0, 7:] == eos).nonzero()[0]) + 1
    alone = model.generate(idx[:1], 10, attention_mask=mask[:1], eos_id=eos)
    assert alone.shape[1] == first and alone[0, -1] == eos


def test_streaming_runs_past_context_length_with_bounded_memory():
    model = small(rope=True, window=6, global_every=2, n_kv_heads=2).eval()
    ctx = model.cfg.context_length
    prompt = torch.randint(0, 40, (2, 10))
    with pytest.raises(ValueError, match="exceeds context_length"):
        model.generate(prompt, ctx)
    out = model.generate(prompt, 3 * ctx, streaming=(4, 12))
    assert out.shape == (2, 10 + 3 * ctx)
    # step by step: the caches never grow and the logits stay finite
    with torch.no_grad():
        model.setup_cache(2, streaming=(4, 12))
        sizes = {c.nbytes() for c in model.caches}
        model(out[:, :10], input_pos=torch.arange(10))
        for i in range(10, out.shape[1]):
            logits = model(out[:, i : i + 1], input_pos=torch.tensor([i]))
            assert torch.isfinite(logits).all()
        assert {c.nbytes() for c in model.caches} == sizes
        assert max(c.k_cache.shape[2] for c in model.caches) == 4 + 12
        model.delete_cache()
    # while everything fits (sinks + window), streaming is exact
    assert torch.equal(model.generate(prompt, 6, streaming=(4, 12)), model.generate(prompt, 6))


def test_streaming_refusals():
    with pytest.raises(ValueError, match="streaming needs rope=True"):
        small().setup_cache(1, streaming=(4, 8))
    with pytest.raises(ValueError, match="exceeds context_length"):
        small(rope=True).setup_cache(1, streaming=(4, 30))
    model = small(rope=True)
    idx, mask = left_pad([torch.arange(3), torch.arange(5)])
    with pytest.raises(ValueError, match="streaming takes no padding"):
        model.generate(idx, 3, attention_mask=mask, streaming=(2, 8))


def test_one_rope_table_per_model_and_layer_kinds():
    model = small(rope=True, window=4, global_every=2, n_layers=4)
    tables = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(tables) == 1 and tables[0] is model.rope
    assert model.windows == [4, None, 4, None]
    assert all(isinstance(b.att, CausalSelfAttention) for b in model.trf_blocks)
    assert [b.att.window for b in model.trf_blocks] == [4, None, 4, None]
    assert not any(name.endswith(("cos", "sin")) for name in model.state_dict())
    mla = small(rope=True, mla_kv_rank=8)
    assert all(isinstance(b.att, MultiHeadLatentAttention) for b in mla.trf_blocks)
    assert len([m for m in mla.modules() if isinstance(m, RotaryEmbedding)]) == 1


def test_state_dict_names_unchanged_and_old_configs_load():
    """Checkpoints written before the redesign load as they are."""
    old = dict(
        vocab_size=40, context_length=16, emb_dim=16, n_layers=1, n_heads=2, n_kv_heads=None,
        drop_rate=0.0, qkv_bias=False, rope=False, rope_theta=10000.0, window=None,
        attn_backend="auto",
    )  # fmt: skip
    model = GPT(GPTConfig.from_dict(old))
    assert sorted(model.state_dict()) == sorted(
        ["tok_emb.weight", "pos_emb.weight", "final_norm.weight", "final_norm.bias"]
        + ["out_head.weight"]
        + [f"trf_blocks.0.att.{n}.{p}" for n in ("W_query", "W_key", "W_value") for p in ["weight"]]
        + ["trf_blocks.0.att.out_proj.weight", "trf_blocks.0.att.out_proj.bias"]
        + [f"trf_blocks.0.{n}.{p}" for n in ("norm1", "norm2") for p in ("weight", "bias")]
        + [f"trf_blocks.0.ff.layers.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")]
    )


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    model = small().eval()
    prompt = torch.randint(0, 40, (1, 4))
    kw = dict(temperature=1.0, top_k=3)
    a = model.generate(prompt, 10, **kw, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 10, **kw, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 14)
    with torch.no_grad():
        logits = model(a[:, :-1])[0, 3:]  # (10, vocab): the logits each new token came from
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[0, 4:, None]).any(dim=-1).all()
    # a tiny nucleus keeps only the most likely token: greedy
    nucleus = model.generate(prompt, 10, temperature=1.0, top_p=1e-6)
    assert torch.equal(nucleus, model.generate(prompt, 10))


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-30])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    # logits / 1e-45 overflows float32 to inf (softmax NaN, multinomial raised): it is the
    # limit temperature -> 0 instead, the most likely token as at temperature 0
    model = small().eval()
    prompt = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(0))
    greedy = model.generate(prompt, 6)
    tiny = model.generate(prompt, 6, temperature=temperature, top_k=5, top_p=0.9)
    assert torch.equal(tiny, greedy)
    assert torch.equal(model.generate(prompt, 6, temperature=temperature), greedy)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
        (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
        (dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        (dict(temperature=math.nan), ValueError, "temperature must be finite"),
        (dict(temperature=True), TypeError, "temperature must be a number"),
        (dict(top_k=0), ValueError, "top_k must be >= 1"),
        (dict(top_k=41), ValueError, "top_k must be <= 40"),
        (dict(top_k=True), TypeError, "top_k must be an int"),
        (dict(top_p=0.0), ValueError, "top_p must be > 0"),
        (dict(top_p=1.5), ValueError, "top_p must be <= 1"),
        (dict(top_p=True), TypeError, "top_p must be a number"),
        (dict(eos_id=40), ValueError, "eos_id must be <= 39"),
        (dict(eos_id=False), TypeError, "eos_id must be an int"),
        (dict(use_cache="yes"), TypeError, "use_cache must be True or False"),
        (dict(generator=1), TypeError, "generator must be a torch.Generator"),
        (dict(attention_mask=torch.ones(2, 3)), TypeError, "attention_mask must be a bool"),
        (dict(attention_mask=torch.ones(2, 4, dtype=torch.long)), ValueError, "idx's shape"),
        (
            dict(attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])),
            ValueError,
            "left-padded: every row must end with a token",
        ),
        (
            dict(attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]])),
            ValueError,
            "left-padded: zeros, then ones",
        ),
        (dict(attention_mask=torch.tensor([[2, 1, 1], [1, 1, 1]])), ValueError, "only 0"),
    ],
)
def test_generate_argument_errors_name_the_argument(kw, err, match):
    model = small()
    args = dict(max_new_tokens=kw.pop("max_new_tokens", 3))
    with pytest.raises(err, match=match):
        model.generate(torch.zeros(2, 3, dtype=torch.long), args["max_new_tokens"], **kw)


def test_forward_and_length_errors():
    model = small()
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_new_tokens \(5\) exceeds"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.full((1, 3), 40))
    with pytest.raises(ValueError, match="33 tokens exceed context_length=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="consecutive"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="contiguous"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 0, 1]]))
    model.setup_cache(1, 8)
    with pytest.raises(ValueError, match="with a KV cache, pass input_pos"):
        model(torch.zeros(1, 3, dtype=torch.long))
    # the limit here is the cache's (context_length is 32): the message names the cache
    with pytest.raises(ValueError, match=r"9 tokens exceed the KV cache's max_seq_len=8 \(set by"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.arange(6, 9))
    with pytest.raises(ValueError, match="must cover all 3"):
        model(
            torch.zeros(1, 3, dtype=torch.long),
            input_pos=torch.arange(3),
            attention_mask=torch.ones(1, 2, dtype=torch.long),
        )


def test_generate_checks_once_and_its_steps_trust_the_inputs(monkeypatch):
    """generate validates idx, the mask and the context bound once; each token's step
    (``GPT.step``) re-validates nothing (it used to run every forward check per token)."""
    from attnkit.models import generate as gen
    from attnkit.models import plan

    calls: dict[str, int] = {}

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[f"{module.__name__}.{name}"] = calls.get(f"{module.__name__}.{name}", 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("check_inputs", "check_context", "check_idx", "_check_input_pos", "_check_mask"):
        counting(plan, name)
    counting(gen, "_check_prompt")
    counting(gen, "check_idx")
    model = small(rope=True)
    idx = torch.randint(0, 40, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for use_cache in (True, False):
        calls.clear()
        out = model.generate(idx, 12, attention_mask=mask, use_cache=use_cache)
        assert out.shape == (2, 17)
        assert calls == {
            "attnkit.models.generate._check_prompt": 1,
            "attnkit.models.generate.check_idx": 1,
        }, calls
    calls.clear()
    model(idx, attention_mask=mask)  # the counters see a forward's checks
    assert (
        calls["attnkit.models.plan.check_inputs"] == 1
        and calls["attnkit.models.plan._check_mask"] == 1
    )


def test_step_equals_forward_on_checked_inputs():
    model = small(rope=True).eval()
    idx = torch.randint(0, 40, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        full = model(idx, attention_mask=mask)
        step = model.step(idx, torch.arange(6), mask.bool(), last_only=False)
        last = model.step(idx, torch.arange(6), mask.bool())
    torch.testing.assert_close(step, full)
    torch.testing.assert_close(last, full[:, -1:])


def test_feeding_past_a_short_cache_names_the_cache_not_context_length():
    model = GPT(GPTConfig(vocab_size=10, context_length=8, emb_dim=8, n_layers=1, n_heads=2))
    model.setup_cache(1, 4)
    with pytest.raises(ValueError, match="exceed the KV cache's max_seq_len=4") as info:
        model(torch.zeros(1, 5, dtype=torch.long), input_pos=torch.arange(5))
    assert "context_length=4" not in str(info.value)
    with pytest.raises(ValueError, match="9 tokens exceed context_length=8"):  # the model's own
        model(torch.zeros(1, 9, dtype=torch.long), input_pos=torch.arange(9))


def test_generate_output_and_cache_work_outside_inference_mode():
    # generate decodes under torch.inference_mode; what it leaves behind must not be
    # inference tensors: the ids feed a training step, a cache set up before goes on.
    model = small()
    prompt = torch.randint(0, 40, (2, 5))
    out = model.generate(prompt, 4)
    assert not out.is_inference()
    model(out).sum().backward()  # embedding saves the ids for backward
    assert model.tok_emb.weight.grad is not None and model.training
    model.eval()
    model.setup_cache(2)
    before = model.caches
    model.generate(prompt, 3)
    assert model.caches is before  # the caller's cache is left in place
    with torch.no_grad():
        model.reset_cache()
        first = model(prompt, input_pos=torch.arange(5))  # buffers writable outside inference
    model.delete_cache()
    with torch.no_grad():
        torch.testing.assert_close(first, model(prompt), atol=1e-6, rtol=1e-6)


def test_presets():
    cfg = GPTConfig.preset("gpt2-small")
    assert (cfg.n_layers, cfg.n_heads, cfg.emb_dim, cfg.context_length, cfg.vocab_size) == (
        12,
        12,
        768,
        1024,
        50257,
    )
    assert GPTConfig.preset("tiny", vocab_size=10).vocab_size == 10
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'; valid: tiny, gpt2-small"):
        GPTConfig.preset("huge")


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(n_heads=5), ValueError, r"emb_dim \(64\) must be divisible by n_heads \(5\)"),
        (dict(n_kv_heads=3), ValueError, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (dict(n_kv_heads=True), TypeError, "n_kv_heads must be an int"),
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(window=True), TypeError, "window must be an int"),
        (dict(qkv_bias="no"), TypeError, "qkv_bias must be True or False"),
        (dict(global_every=2), ValueError, "global_every needs a window"),
        (dict(layer_windows=[4]), ValueError, "layer_windows has 1 entries, n_layers is 2"),
        (dict(layer_windows=[4, 0]), ValueError, r"layer_windows\[1\] must be >= 1"),
        (dict(layer_windows=[4, None], window=3), ValueError, "not both"),
        (dict(mla_kv_rank=8), ValueError, "mla_kv_rank needs rope=True"),
        (dict(mla_rope_dim=4, rope=True), ValueError, "mla_rope_dim needs mla_kv_rank"),
        (dict(mla_kv_rank=8, mla_rope_dim=3, rope=True), ValueError, "even"),
    ],
)
def test_bad_config(kw, err, match):
    with pytest.raises(err, match=match):
        GPTConfig(**kw)


def test_hf_gpt2_mapping_round_trip():
    transformers = pytest.importorskip("transformers")
    from attnkit.models.hf_gpt2 import (
        config_from_hf,
        export_hf_gpt2_state_dict,
        load_hf_gpt2_state_dict,
    )

    hf_cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    model = load_hf_gpt2_state_dict(GPT(config_from_hf(hf_cfg)), hf.state_dict()).eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)
    exported = export_hf_gpt2_state_dict(model)
    for k, v in exported.items():
        torch.testing.assert_close(v, hf.state_dict()[k])
    for bad in (dict(rope=True), dict(window=4, global_every=2), dict(attn_sinks=True)):
        with pytest.raises(ValueError, match="GPT-2 has"):
            export_hf_gpt2_state_dict(small(qkv_bias=True, **bad))
