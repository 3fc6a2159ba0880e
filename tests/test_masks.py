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
    torch.testing.assert_close(M.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    six = M.alibi_slopes(6)  # 4 from the power of two, then odd ones of the 8-head sequence
    want = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(six, torch.tensor(want))


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
