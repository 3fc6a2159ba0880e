"""The seed-stage modules: the tutorial's numbers, the reference, shapes and errors."""

from __future__ import annotations

import pytest
import torch

from attnkit import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    SimplifiedSelfAttention,
)
from attnkit.examples import HELLO_SHINY_SUN, YOUR_JOURNEY
from tests.reference import ref_attention

X = YOUR_JOURNEY.tensor()
BATCH = torch.stack((X, X))

# Printed by the book's chapter-3 code (the seed tutorial's code examples), 4 decimals.
BOOK_V1_SEED123 = [
    [0.2996, 0.8053],
    [0.3061, 0.8210],
    [0.3058, 0.8203],
    [0.2948, 0.7939],
    [0.2927, 0.7891],
    [0.2990, 0.8040],
]
BOOK_V2_SEED789 = [
    [-0.0739, 0.0713],
    [-0.0748, 0.0703],
    [-0.0749, 0.0702],
    [-0.0760, 0.0685],
    [-0.0763, 0.0679],
    [-0.0754, 0.0693],
]
BOOK_CAUSAL_SEED123 = [
    [-0.4519, 0.2216],
    [-0.5874, 0.0058],
    [-0.6300, -0.0632],
    [-0.5675, -0.0843],
    [-0.5526, -0.0981],
    [-0.5299, -0.1081],
]
BOOK_WRAPPER_SEED123 = [
    [-0.4519, 0.2216, 0.4772, 0.1063],
    [-0.5874, 0.0058, 0.5891, 0.3257],
    [-0.6300, -0.0632, 0.6202, 0.3860],
    [-0.5675, -0.0843, 0.5478, 0.3589],
    [-0.5526, -0.0981, 0.5321, 0.3428],
    [-0.5299, -0.1081, 0.5077, 0.3493],
]
BOOK_MHA_SEED123 = [
    [0.3190, 0.4858],
    [0.2943, 0.3897],
    [0.2856, 0.3593],
    [0.2693, 0.3873],
    [0.2639, 0.3928],
    [0.2575, 0.4028],
]
# Printed in the seed notebook (torch.manual_seed(42)).
NOTEBOOK_SELF_SEED42 = [
    [0.3755, 0.2777],
    [0.3761, 0.2831],
    [0.3761, 0.2833],
    [0.3768, 0.2763],
    [0.3754, 0.2836],
    [0.3772, 0.2746],
]
# The notebook's CausalSelfAttention keeps dropout=0.1 in training mode: the two
# batch rows differ where the dropout mask differs.
NOTEBOOK_CAUSAL_DROPOUT_SEED42 = [
    [
        [0.4921, 0.1196],
        [0.5174, 0.2886],
        [0.5257, 0.3366],
        [0.4595, 0.3246],
        [0.4531, 0.2852],
        [0.2807, 0.1521],
    ],
    [
        [0.4921, 0.1196],
        [0.5174, 0.2886],
        [0.5257, 0.3366],
        [0.4595, 0.3246],
        [0.3358, 0.1922],
        [0.4191, 0.3051],
    ],
]
NOTEBOOK_MHA_SEED42 = [
    [-0.1268, -0.1532],
    [-0.1070, -0.1730],
    [-0.1016, -0.1791],
    [-0.0842, -0.1591],
    [-0.0892, -0.1540],
    [-0.0760, -0.1452],
]


def close4(actual, expected):
    torch.testing.assert_close(actual.detach(), torch.tensor(expected), atol=6e-5, rtol=0)


class TestSeedNumbers:
    def test_hello_shiny_sun(self):
        # Exact value: [0.3990, 0.3854, 0.8610]. The seed's hand arithmetic rounds the
        # weights before summing and prints [0.3992, 0.3858, 0.8610]; we check the exact one.
        ctx = SimplifiedSelfAttention()(HELLO_SHINY_SUN.tensor())
        close4(ctx[1], [0.3990, 0.3854, 0.8610])

    def test_journey_simplified(self):
        x = X
        scores = x @ x[1]
        close4(scores, [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
        close4(SimplifiedSelfAttention()(x)[1], [0.4419, 0.6515, 0.5683])
        naive = scores / scores.sum()
        close4(naive, [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])
        close4(SimplifiedSelfAttention("sum")(x)[1], (naive @ x).tolist())

    def test_v1(self):
        torch.manual_seed(123)
        close4(SelfAttentionV1(3, 2)(X), BOOK_V1_SEED123)

    def test_v2(self):
        torch.manual_seed(789)
        close4(SelfAttentionV2(3, 2)(X), BOOK_V2_SEED789)

    def test_causal(self):
        torch.manual_seed(123)
        out = CausalAttention(3, 2, BATCH.shape[1], 0.0)(BATCH)
        assert out.shape == (2, 6, 2)
        close4(out[0], BOOK_CAUSAL_SEED123)
        close4(out[1], BOOK_CAUSAL_SEED123)

    def test_wrapper(self):
        torch.manual_seed(123)
        out = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(BATCH)
        assert out.shape == (2, 6, 4)
        close4(out[0], BOOK_WRAPPER_SEED123)

    def test_multihead(self):
        torch.manual_seed(123)
        out = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)(BATCH)
        assert out.shape == (2, 6, 2)
        close4(out[1], BOOK_MHA_SEED123)

    def test_notebook_self_attention(self):
        torch.manual_seed(42)
        close4(SelfAttentionV2(3, 2)(X), NOTEBOOK_SELF_SEED42)

    def test_notebook_causal_with_dropout_in_training(self):
        torch.manual_seed(42)
        module = CausalAttention(3, 2, context_length=6, dropout=0.1)
        close4(module(BATCH), NOTEBOOK_CAUSAL_DROPOUT_SEED42)

    def test_notebook_multihead_via_zero_out_bias(self):
        # The notebook's `output` layer has no bias; with ours zeroed, same function.
        torch.manual_seed(42)
        mha = MultiHeadAttention(3, 2, 6, 0.0, 2)
        with torch.no_grad():
            mha.out_proj.bias.zero_()
        close4(mha(BATCH)[0], NOTEBOOK_MHA_SEED42)


def _rand_linear_weights(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))


class TestAgainstReference:
    """Each module in float64 against projections + tests/reference.py."""

    def test_v2_and_causal(self):
        x = torch.randn(3, 9, 5, dtype=torch.float64)
        sa = SelfAttentionV2(5, 4, qkv_bias=True).double()
        q, k, v = sa.W_query(x), sa.W_key(x), sa.W_value(x)
        torch.testing.assert_close(sa(x), ref_attention(q, k, v)[0])
        ca = CausalAttention(5, 4, 9, 0.0, qkv_bias=True).double()
        q, k, v = ca.W_query(x), ca.W_key(x), ca.W_value(x)
        torch.testing.assert_close(ca(x), ref_attention(q, k, v, causal="top_left")[0])

    def test_v1(self):
        x = torch.randn(9, 5, dtype=torch.float64)
        sa = SelfAttentionV1(5, 4).double()
        ref = ref_attention(x @ sa.W_query, x @ sa.W_key, x @ sa.W_value)[0]
        torch.testing.assert_close(sa(x), ref)

    @pytest.mark.parametrize("backend", ["auto", "reference", "sdpa"])
    def test_multihead_self_and_cross(self, backend):
        mha = MultiHeadAttention(
            6, 8, 16, 0.0, num_heads=2, qkv_bias=True, backend=backend
        ).double()
        x = torch.randn(2, 5, 6, dtype=torch.float64)
        enc = torch.randn(2, 7, 6, dtype=torch.float64)

        def split(t):  # (b, t, 8) -> (b, 2, t, 4)
            return t.view(t.shape[0], t.shape[1], 2, 4).transpose(1, 2)

        for source, causal in ((x, "bottom_right"), (enc, None)):
            q, k, v = split(mha.W_query(x)), split(mha.W_key(source)), split(mha.W_value(source))
            ctx = ref_attention(q, k, v, causal=causal)[0].transpose(1, 2).reshape(2, 5, 8)
            out = mha(x) if source is x else mha(x, enc)
            torch.testing.assert_close(out, mha.out_proj(ctx))

    def test_simplified(self):
        x = torch.randn(4, 6, 3, dtype=torch.float64)
        torch.testing.assert_close(
            SimplifiedSelfAttention()(x), ref_attention(x, x, x, scale=1.0)[0]
        )


class TestCausalMasking:
    def test_after_softmax_renormalised_equals_before(self):
        torch.manual_seed(3)
        before = CausalAttention(3, 4, 6, 0.0)
        after = CausalAttention(3, 4, 6, 0.0, masking="after_softmax")
        after.load_state_dict(before.state_dict())
        x = torch.rand(2, 6, 3)
        from attnkit import trace

        with trace.record() as r1:
            y1 = before(x)
        with trace.record() as r2:
            y2 = after(x)
        torch.testing.assert_close(y1, y2)
        torch.testing.assert_close(r1["weights"], r2["renormalized_weights"])
        assert (r2["renormalized_weights"].triu(1) == 0).all()

    def test_fewer_tokens_than_context_length(self):
        ca = CausalAttention(3, 2, 10, 0.0)
        assert ca(torch.rand(4, 3)).shape == (4, 2)

    def test_no_peeking_at_future_tokens(self):
        mha = MultiHeadAttention(3, 4, 6, 0.0, 2)
        x = torch.rand(1, 6, 3)
        y = x.clone()
        y[0, 4:] = torch.rand(2, 3)  # change the future of tokens 0..3
        torch.testing.assert_close(mha(x)[0, :4], mha(y)[0, :4])


class TestDropoutInModules:
    def test_eval_mode_has_no_dropout(self):
        m = MultiHeadAttention(3, 4, 6, 0.5, 2).eval()
        x = torch.rand(2, 6, 3)
        torch.testing.assert_close(m(x), m(x))

    def test_training_mode_drops(self):
        m = MultiHeadAttention(3, 4, 6, 0.5, 2)
        x = torch.rand(2, 6, 3)
        assert not torch.allclose(m(x), m.eval()(x))


def test_unbatched_equals_batched():
    torch.manual_seed(1)
    for m in (
        SelfAttentionV1(3, 2),
        SelfAttentionV2(3, 2),
        CausalAttention(3, 2, 6, 0.0),
        MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2),
        MultiHeadAttention(3, 4, 6, 0.0, 2),
        SimplifiedSelfAttention(),
    ):
        torch.testing.assert_close(m(X), m(X.unsqueeze(0))[0])


def test_multihead_need_weights():
    mha = MultiHeadAttention(3, 4, 6, 0.0, 2)
    out, w = mha(BATCH, need_weights=True)
    assert out.shape == (2, 6, 4) and w.shape == (2, 2, 6, 6)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6))
    torch.testing.assert_close(out, mha(BATCH))


class TestErrors:
    def test_d_out_not_divisible(self):
        with pytest.raises(ValueError, match=r"d_out \(5\) must be divisible by num_heads \(2\)"):
            MultiHeadAttention(3, 5, 6, 0.0, 2)

    @pytest.mark.parametrize("shape", [(3,), (1, 2, 6, 3)])
    def test_wrong_rank(self, shape):
        with pytest.raises(
            ValueError, match="must be \\(batch, tokens, d_in\\) or \\(tokens, d_in\\)"
        ):
            MultiHeadAttention(3, 4, 6, 0.0, 2)(torch.rand(shape))

    def test_wrong_d_in(self):
        with pytest.raises(ValueError, match="4 features in its last dim, expected d_in=3"):
            CausalAttention(3, 2, 6, 0.0)(torch.rand(2, 6, 4))

    def test_too_many_tokens(self):
        with pytest.raises(ValueError, match="7 tokens, more than context_length=6"):
            MultiHeadAttention(3, 4, 6, 0.0, 2)(torch.rand(2, 7, 3))

    @pytest.mark.parametrize("p", [-0.1, 1.0])
    def test_bad_dropout(self, p):
        with pytest.raises(ValueError, match=r"dropout must be (>= 0.0|< 1.0), got"):
            CausalAttention(3, 2, 6, p)

    def test_bad_mask_through_module(self):
        with pytest.raises(ValueError, match="does not broadcast"):
            MultiHeadAttention(3, 4, 6, 0.0, 2)(
                torch.rand(2, 6, 3), mask=torch.ones(5, 5, dtype=torch.bool)
            )
        with pytest.raises(TypeError, match="bool .* or float"):
            MultiHeadAttention(3, 4, 6, 0.0, 2)(
                torch.rand(2, 6, 3), mask=torch.ones(6, 6, dtype=torch.int32)
            )

    def test_unknown_backend_at_construction(self):
        with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
            MultiHeadAttention(3, 4, 6, 0.0, 2, backend="fast")

    def test_non_positive_dims(self):
        with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
            MultiHeadAttention(3, 4, 6, 0.0, 0)

    @pytest.mark.parametrize(
        "kw, name",
        [
            (dict(num_kv_heads=True), "num_kv_heads"),
            (dict(window=True), "window"),
            (dict(num_heads=True), "num_heads"),
            (dict(context_length=6.0), "context_length"),
        ],
    )
    def test_bool_or_float_where_an_int_is_meant_is_refused(self, kw, name):
        """Regression: num_kv_heads=True silently became MQA (bool is not an int)."""
        args = dict(d_in=4, d_out=4, context_length=6, dropout=0.0, num_heads=2) | kw
        with pytest.raises(TypeError, match=rf"{name} must be an int, got"):
            MultiHeadAttention(**args)

    def test_context_batch_mismatch(self):
        with pytest.raises(ValueError, match="context batch"):
            MultiHeadAttention(3, 4, 6, 0.0, 2)(torch.rand(2, 6, 3), torch.rand(3, 4, 3))

    def test_bad_normalize_and_masking(self):
        with pytest.raises(ValueError, match="normalize"):
            SimplifiedSelfAttention("l1")
        with pytest.raises(ValueError, match="masking"):
            CausalAttention(3, 2, 6, 0.0, masking="during")


def test_simplified_sum_on_all_zero_input_refuses_instead_of_nan():
    """Regression: SimplifiedSelfAttention("sum") on all-zero input returned NaN."""
    with pytest.raises(ValueError, match="token 0 .* sum to 0"):
        SimplifiedSelfAttention("sum")(torch.zeros(3, 4))
    x = torch.rand(2, 3, 4) + 0.1  # positive scores: fine
    assert torch.isfinite(SimplifiedSelfAttention("sum")(x)).all()
