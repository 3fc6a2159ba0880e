"""The composable mask mods and score mods against index-by-index loops."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit import masks as M
from tests.conftest import TOL


def dense(mod, b=2, h=3, lq=11, lk=13) -> torch.Tensor:
    """Evaluate a mask mod on the full (b, h, lq, lk) index grid."""
    grids = (
        torch.arange(b).view(-1, 1, 1, 1),
        torch.arange(h).view(1, -1, 1, 1),
        torch.arange(lq).view(1, 1, -1, 1),
        torch.arange(lk).view(1, 1, 1, -1),
    )
    return mod(*grids).expand(b, h, lq, lk)


def loops(pred, b=2, h=3, lq=11, lk=13) -> torch.Tensor:
    out = torch.zeros(b, h, lq, lk, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                for j in range(lk):
                    out[bi, hi, i, j] = bool(pred(bi, hi, i, j))
    return out


LENGTHS = torch.tensor([13, 4])
IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])

CASES = {
    "causal_tl": (M.causal("top_left"), lambda b, h, i, j: j <= i),
    "causal_br": (M.causal("bottom_right", 11, 13), lambda b, h, i, j: j <= i + 2),
    "window": (M.sliding_window(3, alignment="top_left"), lambda b, h, i, j: i - 3 < j <= i),
    "window_br": (
        M.sliding_window(3, True, "bottom_right", 11, 13),
        lambda b, h, i, j: i - 1 < j <= i + 2,
    ),
    "window_sym": (
        M.sliding_window(3, causal=False, alignment="top_left"),
        lambda b, h, i, j: abs(i - j) < 3,
    ),
    "padding": (M.padding(LENGTHS), lambda b, h, i, j: j < int(LENGTHS[b])),
    "prefix_lm": (M.prefix_lm(5), lambda b, h, i, j: j < 5 or j <= i),
    "and": (
        M.and_masks(M.causal("top_left"), M.padding(LENGTHS)),
        lambda b, h, i, j: j <= i and j < int(LENGTHS[b]),
    ),
    "or": (
        M.or_masks(M.sliding_window(2, alignment="top_left"), M.document(IDS)),
        lambda b, h, i, j: i - 2 < j <= i or IDS[i] == IDS[j],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_mask_mods_match_loops(name):
    mod, pred = CASES[name]
    torch.testing.assert_close(dense(mod), loops(pred))


def test_document_mask_is_block_diagonal():
    got = dense(M.document(IDS), lq=13, lk=13)
    want = loops(lambda b, h, i, j: IDS[i] == IDS[j], lq=13, lk=13)
    torch.testing.assert_close(got, want)
    per_batch = torch.stack([IDS, IDS.flip(0)])  # (b, seq)
    got = dense(M.document(per_batch), lq=13, lk=13)
    want = loops(lambda b, h, i, j: per_batch[b, i] == per_batch[b, j], lq=13, lk=13)
    torch.testing.assert_close(got, want)


def test_alibi_slopes_follow_the_paper():
    torch.testing.assert_close(
        M.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)], dtype=torch.float64)
    )
    six = M.alibi_slopes(6)  # 4 from the power of two, then odd ones of the 8-head sequence
    want = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(six, torch.tensor(want, dtype=torch.float64))


def test_score_mods_match_loops():
    s = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    grids = [
        g.view(*g.shape)
        for g in (
            torch.arange(2).view(-1, 1, 1, 1),
            torch.arange(3).view(1, -1, 1, 1),
            torch.arange(5).view(1, 1, -1, 1),
            torch.arange(7).view(1, 1, 1, -1),
        )
    ]
    slopes = M.alibi_slopes(3).double()
    table = torch.randn(3, 5, dtype=torch.float64)  # max distance 3
    got_a, got_c, got_r = (
        m(s, *grids) for m in (M.alibi(3), M.softcap(2.0), M.relative_bias(table))
    )
    for b in range(2):
        for h in range(3):
            for i in range(5):
                for j in range(7):
                    x = s[b, h, i, j]
                    assert torch.isclose(got_a[b, h, i, j], x - slopes[h] * abs(i - j))
                    assert torch.isclose(got_c[b, h, i, j], 2.0 * torch.tanh(x / 2.0))
                    rel = max(-2, min(2, j - i)) + 2
                    assert torch.isclose(got_r[b, h, i, j], x + table[h, rel])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blockwise"])
def test_mask_mods_run_on_every_backend(backend):
    q, k, v = (torch.randn(2, 3, 13, 8, dtype=torch.float64) for _ in range(3))
    mod = M.and_masks(M.document(IDS), M.causal("bottom_right", 13, 13), M.padding(LENGTHS))
    out = attention(q, k, v, mask_mod=mod, backend=backend)
    keep = dense(mod, lq=13, lk=13)
    want = attention(q, k, v, mask=keep, backend="reference")
    torch.testing.assert_close(out, want, **TOL[torch.float64])
    assert out[1, :, 4:].abs().max() > 0 and not torch.isnan(out).any()


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: M.sliding_window(0), "window"),
        (lambda: M.padding(torch.tensor([1.5])), "lengths"),
        (lambda: M.padding(torch.tensor([-1])), "lengths"),
        (lambda: M.prefix_lm(-2), "prefix"),
        (lambda: M.document(torch.rand(4)), "ids"),
        (lambda: M.and_masks(), "at least one"),
        (lambda: M.or_masks(), "at least one"),
        (lambda: M.alibi(4, torch.ones(3)), r"\(4,\)"),
        (lambda: M.softcap(0), "cap"),
        (lambda: M.relative_bias(torch.ones(2, 4)), "table"),
        (lambda: M.causal("middle"), "alignment"),
        (lambda: M.causal(), "bottom_right alignment .* needs q_len and k_len"),
        (lambda: M.causal("bottom_right", 4), "needs q_len and k_len"),
        (lambda: M.sliding_window(3), "sliding_window: bottom_right alignment"),
        (lambda: M.causal("top_left", 3, 4), "top_left alignment takes no q_len"),
    ],
)
def test_bad_arguments_name_the_value(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_mods_print_their_recipe():
    mod = M.and_masks(M.sliding_window(4, alignment="top_left"), M.prefix_lm(2))
    assert repr(mod) == "and_masks(sliding_window(4, causal=True, 'top_left'), prefix_lm(2))"


@pytest.mark.parametrize("lens", [(5, 5), (3, 9), (9, 4), (1, 7)])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("is_causal", [True, False])
def test_mod_defaults_agree_with_attention_flags(lens, window, is_causal):
    """causal()/sliding_window() default to the alignment of causal=True / window=."""
    if window is None and not is_causal:
        return
    lq, lk = lens
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (lq, lk, lk))
    if window is None:
        mod = M.causal(q_len=lq, k_len=lk)
    else:
        mod = M.sliding_window(window, is_causal, q_len=lq, k_len=lk)
    flags = attention(q, k, v, causal=is_causal, window=window, backend="reference")
    via_mod = attention(q, k, v, mask_mod=mod, backend="reference")
    torch.testing.assert_close(via_mod, flags, **TOL[torch.float64])


# --- sizes checked before computing (issue 13: IndexError from inside a mod) -----------


@pytest.mark.parametrize(
    "mod, kind, match",
    [
        (
            M.padding(torch.tensor([3, 4, 5])),
            "mask_mod",
            "lengths has 3 entries but the batch has 2",
        ),
        (
            M.document(torch.zeros(2, 9, dtype=torch.long).repeat(2, 1)[:3]),
            "mask_mod",
            "ids has 3 rows",
        ),
        (
            M.document(torch.zeros(7, dtype=torch.long)),
            "mask_mod",
            "ids has 7 positions but the call has 6",
        ),
        (M.alibi(4), "score_mod", r"4 slopes \(num_heads\) but the query has 3 heads"),
        (
            M.relative_bias(torch.zeros(2, 5)),
            "score_mod",
            r"table has 2 rows \(num_heads\) but the query has 3",
        ),
        (
            M.and_masks(M.causal("top_left"), M.padding(torch.tensor([1, 2, 3]))),
            "mask_mod",
            "lengths has 3 entries",
        ),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "blockwise"])
def test_mod_built_for_other_sizes_is_a_clear_value_error_not_index_error(
    mod, kind, match, backend
):
    """Regression: padding/document/alibi/relative_bias with wrong sizes raised IndexError."""
    if kind == "score_mod" and backend == "sdpa":
        pytest.skip("sdpa takes no score_mod")
    q = torch.rand(2, 3, 6, 4)
    with pytest.raises(ValueError, match=match) as err:
        attention(q, q, q, backend=backend, **{kind: mod})
    assert kind in str(err.value)


def test_padding_with_one_length_broadcasts_over_the_batch():
    q = torch.rand(2, 1, 5, 4)
    out = attention(q, q, q, mask_mod=M.padding(torch.tensor([2])))
    keep = torch.arange(5) < 2
    torch.testing.assert_close(out, attention(q, q, q, mask=keep), **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blockwise", "blockwise-tiles"])
def test_mask_mod_returning_the_wrong_shape_names_the_mod_and_shapes(backend):
    """Regression: a mod returning the wrong shape raised a RuntimeError from inside.

    Mods have FlexAttention's scalar semantics (attnkit.mods, k10): one value per index.
    """

    def bad_mask(b, h, q, kv):
        return torch.stack([q >= kv, q >= kv])  # two values per (b, h, q_idx, kv_idx)

    q = torch.rand(1, 2, 6, 4)
    with pytest.raises(TypeError, match=r"mask_mod .*bad_mask must return one value per .*shape"):
        attention(q, q, q, backend=backend, mask_mod=bad_mask)


@pytest.mark.parametrize(
    "backend, err",
    # mods.eval_score_mod raises TypeError; blockwise probes the mod in supports() and
    # so refuses with "cannot run this call" (a ValueError): both name the mod and shapes.
    [("reference", TypeError), ("blockwise", ValueError), ("blockwise-tiles", ValueError)],
)
def test_score_mod_returning_the_wrong_shape_names_the_mod_and_shapes(backend, err):
    def bad_score(score, b, h, q, kv):
        return score.expand(3)  # three values per score

    q = torch.rand(1, 2, 6, 4)
    with pytest.raises(err, match=r"score_mod .*bad_score must return one value per .*shape"):
        attention(q, q, q, backend=backend, score_mod=bad_score)


@pytest.mark.parametrize(
    "backend, err",
    [
        ("reference", TypeError),
        ("auto", TypeError),
        ("blockwise", ValueError),
        ("blockwise-tiles", ValueError),
    ],
)
@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_score_mod_returning_integer_scores_names_the_mod_and_dtype(backend, err, dtype):
    # once torch's "softmax ... not implemented for 'Long'", naming no mod
    def rounded(score, b, h, q, kv):
        return score.to(dtype)

    q = torch.rand(1, 2, 6, 4)
    with pytest.raises(err, match=f"score_mod .*rounded must return floating scores.*{dtype}"):
        attention(q, q, q, backend=backend, score_mod=rounded)


def test_alibi_is_exact_in_float64():
    """Regression: ALiBi slopes were float32, so a float64 call was only float32-accurate."""
    heads = 12  # not a power of 2: the interleaved slopes 2^(-k/2) are irrational
    slopes = M.alibi_slopes(heads)
    assert slopes.dtype == torch.float64
    assert slopes[8].item() == 2 ** (-8 * 1 / 16)  # interleaved: 2^(-0.5), exactly as in Python
    score = torch.zeros(1, heads, 1, 2, dtype=torch.float64)
    grids = (
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(heads).view(1, -1, 1, 1),
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(2).view(1, 1, 1, -1),
    )
    out = M.alibi(heads)(score, *grids)
    assert out[0, 8, 0, 1].item() == -(2**-0.5)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: M.sliding_window(True), "window"),
        (lambda: M.prefix_lm(True), "prefix"),
        (lambda: M.alibi(True), "num_heads"),
        (lambda: M.alibi_slopes(2.0), "num_heads"),
    ],
)
def test_mods_refuse_bool_or_float_where_an_int_is_meant(make, name):
    with pytest.raises(TypeError, match=rf"{name} must be an int"):
        make()


@pytest.mark.parametrize("align", ["top_left", "bottom_right", None])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("lq, lk", [(4, 9), (9, 4), (5, 5), (1, 7)])
def test_reachable_keys_match_the_dense_mask(align, window, lq, lk):
    if align is None and window is None:
        assert M.reachable_keys(lq, lk, None, None) == (0, lk)
        return
    if window is None:
        keep = M.causal_mask(lq, lk, align)
    else:
        keep = M.window_mask(lq, lk, window, align or "bottom_right", causal=align is not None)
    cols = keep.any(dim=0).nonzero().flatten().tolist()
    lo, hi = M.reachable_keys(lq, lk, align, window)
    assert list(range(lo, hi)) == cols


def test_alignment_and_window_are_checked_alike_everywhere():
    # one check (attnkit._validate) for every place that takes them: a typo'd alignment
    # once built the top-left mask silently, window 0 an all-False one
    bad_alignment = "alignment must be 'top_left' or 'bottom_right', got 'botom_right'"
    with pytest.raises(ValueError, match=bad_alignment):
        M.causal_mask(2, 3, "botom_right")
    with pytest.raises(ValueError, match=bad_alignment):
        M.window_mask(2, 3, 2, "botom_right")
    with pytest.raises(ValueError, match=bad_alignment):
        M.causal("botom_right", 2, 3)
    with pytest.raises(ValueError, match=bad_alignment):
        M.sliding_window(2, alignment="botom_right", q_len=2, k_len=3)
    with pytest.raises(ValueError, match="causal must be 'top_left' or 'bottom_right'"):
        M.normalize_causal("sideways")
    q = torch.randn(1, 1, 3, 4)
    for make in (
        lambda: M.window_mask(3, 3, 0),
        lambda: M.sliding_window(0, alignment="top_left"),
        lambda: attention(q, q, q, window=0),
    ):
        with pytest.raises(ValueError, match="window must be >= 1, got 0"):
            make()
    with pytest.raises(TypeError, match="window must be an int, got bool"):
        M.window_mask(3, 3, True)
    assert M.causal_mask(2, 3, "top_left").tolist() == [[True, False, False], [True, True, False]]


@pytest.mark.parametrize(
    "q_len, k_len, causal, keeps_all",
    [
        (1, 9, "bottom_right", True),  # a decode step: the query is the last position
        (2, 9, "bottom_right", False),
        (1, 1, "top_left", True),
        (1, 2, "top_left", False),
        (5, 1, "top_left", True),
        (3, 3, "bottom_right", False),
        (4, 2, None, True),
    ],
)
def test_causal_keeps_every_key_only_where_no_query_loses_a_key(q_len, k_len, causal, keeps_all):
    assert M.causal_keeps_every_key(q_len, k_len, causal) is keeps_all
    # the same answer as the rule itself, key by key
    keep = M.causal_mask(q_len, k_len, causal or "bottom_right")
    assert bool(keep.all()) == keeps_all or causal is None
