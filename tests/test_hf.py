"""attnkit as a transformers attention implementation, checked against eager attention.

Every model is a tiny random one built from a config (2 layers, hidden 32): nothing is
downloaded. Padded positions are excluded from comparisons where noted: attnkit returns
zeros for a query row with no key left, eager a uniform spread; real tokens never read them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tests.reference import ref_attention  # noqa: E402

#: attnkit.integrations.hf, imported when this module's first test runs (it imports
#: transformers' attention and masking code: about 1.5 s every xdist worker paid while
#: collecting).
hf: Any = None


@pytest.fixture(autouse=True, scope="module")
def _import_hf() -> None:
    global hf
    from attnkit.integrations import hf as module

    hf = module


VOCAB = 97
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)


def _gpt2() -> transformers.PreTrainedModel:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.GPT2LMHeadModel(cfg)


# name -> (config class, model class, extra config): each family exercises something.
FAMILIES = {
    "gpt2": None,  # MHA, learned positions, weights not passed output_attentions
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),  # GQA
    "mistral": (  # sliding window shorter than the batch
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_key_value_heads=2, sliding_window=4),
    ),
    "qwen2": (  # MQA, sliding window on some layers only
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "gemma2": (  # logit softcapping, alternating sliding/global layers
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=None,
            initializer_range=0.2,  # scores large enough for the cap to bite
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
}


def _build(family: str, **overrides: object) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if family == "gpt2":
        return _gpt2().eval()
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **extra, **overrides})
    return getattr(transformers, model_name)(cfg).eval()


def _padded_batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 9) token ids and attention mask; rows 0 and 1 padded on ``side``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    pads = {0: 3, 1: 1}
    for row, n in pads.items():
        if side == "left":
            mask[row, :n] = 0
        else:
            mask[row, -n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _run(model, impl: str, ids, mask, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    hf.register()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_attentions_equal_eager(family: str, side: str) -> None:
    model = _build(family)
    ids, mask = _padded_batch(side)
    real = mask.bool()  # (b, t)
    eager = _run(model, "eager", ids, mask, output_attentions=True)
    ours = _run(model, "attnkit", ids, mask, output_attentions=True)
    assert model.config._attn_implementation == "attnkit"
    torch.testing.assert_close(ours.logits[real], eager.logits[real], atol=1e-5, rtol=1e-5)
    assert len(ours.attentions) == len(eager.attentions) == 2
    rows = real[:, None, :, None]  # (b, 1, t, 1): query rows of real tokens
    for a, e in zip(ours.attentions, eager.attentions, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a * rows, e * rows, atol=1e-6, rtol=1e-5)
    # Without output_attentions the fused path runs (sdpa, unless softcapping needs reference).
    fast = _run(model, "attnkit", ids, mask)
    torch.testing.assert_close(fast.logits[real], eager.logits[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_matches_eager(family: str) -> None:
    model = _build(family)
    ids, mask = _padded_batch("left")
    tokens = {}
    for impl in ("eager", "attnkit"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(
                ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
    assert tokens["attnkit"].shape == (3, 15)
    assert torch.equal(tokens["attnkit"], tokens["eager"])


@pytest.mark.parametrize(
    ("family", "override"),
    [("mistral", {"sliding_window": None}), ("gemma2", {"attn_logit_softcapping": None})],
)
def test_window_and_softcap_are_exercised(family: str, override: dict) -> None:
    """The test configs must make the window / softcap matter, or the equalities above prove little."""
    ids, mask = _padded_batch("left")
    real = mask.bool()
    with_feature = _run(_build(family), "attnkit", ids, mask).logits
    without = _run(_build(family, **override), "attnkit", ids, mask).logits
    assert (with_feature - without)[real].abs().max() > 1e-3


def test_register_installs_both_interfaces() -> None:
    name = hf.register("attnkit_ref", backend="reference")
    assert name == "attnkit_ref"
    assert name in transformers.AttentionInterface()
    assert name in transformers.AttentionMaskInterface()
    model = _build("llama")
    ids, mask = _padded_batch("left")
    ref = _run(model, "attnkit_ref", ids, mask).logits
    eager = _run(model, "eager", ids, mask).logits
    torch.testing.assert_close(ref[mask.bool()], eager[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["", "sdpa", "eager"])
def test_register_rejects_reserved_names(name: str) -> None:
    with pytest.raises(ValueError, match="name must be"):
        hf.register(name)


def test_register_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        hf.register("attnkit_nope", backend="nope")


def test_mask_function_never_skips() -> None:
    """transformers' sdpa mask returns None for a plain causal batch; ours always builds it."""
    mask = hf.attnkit_mask(batch_size=2, q_length=4, kv_length=4, attention_mask=None)
    assert mask is not None and mask.dtype == torch.bool
    assert mask.shape == (2, 1, 4, 4)
    expected = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.equal(mask[0, 0], expected)


# --- the attention function itself, against the independent float64 reference ---------------


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(b: int = 2, h_q: int = 4, h_kv: int = 2, t: int = 5, s: int = 5, d: int = 8):
    q = torch.randn(b, h_q, t, d, dtype=torch.float64)
    k = torch.randn(b, h_kv, s, d, dtype=torch.float64)
    v = torch.randn(b, h_kv, s, d, dtype=torch.float64)
    return q, k, v


def test_function_gqa_mask_and_layout() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv(t=3, s=6)
    mask = torch.rand(2, 1, 3, 6) > 0.3
    mask[..., -1] = True  # keep every row alive
    out, weights = fn(_Module(), q, k, v, mask, scaling=0.5, output_attentions=True)
    ref_out, ref_w = ref_attention(q, k, v, mask=mask, scale=0.5)
    assert out.shape == (2, 3, 4, 8)  # (b, l_q, h_q, d)
    torch.testing.assert_close(out, ref_out.transpose(1, 2), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(weights, ref_w, atol=1e-10, rtol=1e-10)


def test_function_softcap_against_hand_computation() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv(h_kv=4)
    q = q * 4  # large scores, so the cap bites
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    out, _ = fn(_Module(), q, k, v, mask, softcap=1.5)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    scores = 1.5 * torch.tanh(scores / 1.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v  # (b, h, t, d)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-10, rtol=1e-10)


def test_function_softcap_on_fused_backend_raises() -> None:
    fn = hf.make_attention_function("sdpa")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="score_mod"):
        fn(_Module(), q.float(), k.float(), v.float(), None, softcap=30.0)


def test_function_without_mask_applies_causal_and_window() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv(t=6, s=6)
    out, _ = fn(_Module(), q, k, v, None, sliding_window=3)
    i = torch.arange(6)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)  # (t, s)
    ref_out, _ = ref_attention(q, k, v, mask=keep)
    torch.testing.assert_close(out, ref_out.transpose(1, 2), atol=1e-10, rtol=1e-10)


def test_function_without_mask_rejects_ambiguous_alignment() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv(t=3, s=6)
    with pytest.raises(ValueError, match="ambiguous"):
        fn(_Module(), q, k, v, None)


def test_function_rejects_unknown_keywords() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"\['s_aux'\]"):
        fn(_Module(), q, k, v, None, s_aux=torch.zeros(4))
    # Bookkeeping keywords and unused (None) ones are accepted.
    out, _ = fn(_Module(), q, k, v, None, position_ids=torch.arange(5), s_aux=None)
    assert out.shape == (2, 5, 4, 8)


def test_function_rejects_non_tensor_masks() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="dense bool or float attention_mask"):
        fn(_Module(), q, k, v, object())
    with pytest.raises(ValueError, match="must be 4-D"):
        fn(_Module(), q, k, v, torch.ones(2, 5, dtype=torch.bool))


# --- families whose keywords once made the backend refuse the model ---------------------------


def _families_beyond_the_six():
    t = transformers
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return {
        "mixtral": lambda: t.MixtralForCausalLM(
            t.MixtralConfig(
                **_COMMON,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
            )
        ),
        "qwen3_moe": lambda: t.Qwen3MoeForCausalLM(
            t.Qwen3MoeConfig(
                **_COMMON,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                head_dim=8,
                output_router_logits=True,
            )
        ),
        "modernbert": lambda: t.ModernBertModel(
            t.ModernBertConfig(
                **common,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                max_position_embeddings=64,
                local_attention=4,
                global_attn_every_n_layers=2,
                cls_token_id=1,
                sep_token_id=2,
            )
        ),
        "t5": lambda: t.T5ForConditionalGeneration(
            t.T5Config(
                **common,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                decoder_start_token_id=0,
            )
        ),
    }


@pytest.mark.parametrize(
    "family",
    ["mixtral", "qwen3_moe", "modernbert", "t5"],
)
def test_router_logits_deterministic_and_t5_position_bias_match_eager(family: str) -> None:
    """output_router_logits / deterministic are ignored (they cannot change attention);
    T5's position_bias is applied as an additive bias, not refused."""
    torch.manual_seed(0)
    model = _families_beyond_the_six()[family]().eval()
    ids, mask = _padded_batch("right")
    real = mask.bool()
    kwargs: dict = {}
    if family == "t5":
        kwargs["decoder_input_ids"] = ids[:, :5]
    outs = {}
    for impl in ("eager", "attnkit"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(input_ids=ids, attention_mask=mask, output_attentions=True, **kwargs)
    if family == "modernbert":
        got, want = outs["attnkit"].last_hidden_state, outs["eager"].last_hidden_state
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    else:
        got, want = outs["attnkit"].logits, outs["eager"].logits
        sel = real if family != "t5" else slice(None)
        torch.testing.assert_close(got[sel], want[sel], atol=1e-5, rtol=1e-5)
    if family == "t5":  # the bias really matters: without it the outputs differ
        for a, e in zip(
            outs["attnkit"].encoder_attentions, outs["eager"].encoder_attentions, strict=True
        ):
            rows = real[:, None, :, None]
            torch.testing.assert_close(a * rows, e * rows, atol=1e-6, rtol=1e-5)


def test_function_adds_position_bias_to_the_scores() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv(h_kv=4)
    bias = torch.randn(1, 4, 5, 5)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    out, w = fn(_Module(), q, k, v, mask, scaling=1.0, position_bias=bias, output_attentions=True)
    scores = (q @ k.transpose(-2, -1) + bias).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(w, scores.softmax(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, (scores.softmax(-1) @ v).transpose(1, 2), atol=1e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="position_bias must be a float tensor"):
        fn(_Module(), q, k, v, mask, position_bias=torch.ones(1, 4, 5, 5, dtype=torch.long))


def test_function_ignores_keywords_that_cannot_change_attention() -> None:
    fn = hf.make_attention_function()
    q, k, v = _qkv()
    base, _ = fn(_Module(), q, k, v, None)
    out, _ = fn(_Module(), q, k, v, None, output_router_logits=True, deterministic=True)
    torch.testing.assert_close(out, base, atol=0, rtol=0)
