"""The functional core against the independent float64 reference (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import attention
from tests.conftest import TOL
from tests.reference import ref_attention

BACKENDS = ["reference", "sdpa"]


def _qkv(b=2, hq=4, hkv=4, lq=7, lk=7, d=8, dtype=torch.float32, grad=False):
    q = torch.randn(b, hq, lq, d, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _plain(q, k, v, keep):
    """A plain same-dtype PyTorch implementation (the 'peer' error baseline)."""
    if k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~keep, float("-inf"))
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


MASK_CASES = ["none", "causal_br", "causal_tl", "bool", "float", "bool+causal"]


def _mask_for(case, b, hq, lq, lk):
    if case in ("bool", "bool+causal"):
        m = torch.rand(b, 1, lq, lk) > 0.3
        m[..., 0] = True  # keep at least one key per row (fully masked rows tested apart)
        return m, ("bottom_right" if case == "bool+causal" else None)
    if case == "float":
        return torch.randn(1, hq, lq, lk), None
    if case == "causal_br":
        return None, "bottom_right"
    if case == "causal_tl":
        return None, "top_left"
    return None, None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("lens", [(7, 7), (3, 9), (9, 5)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_reference(backend, dtype, case, lens, heads):
    lq, lk = lens
    hq, hkv = heads
    q, k, v = _qkv(hq=hq, hkv=hkv, lq=lq, lk=lk, dtype=dtype)
    mask, causal = _mask_for(case, 2, hq, lq, lk)
    out = attention(q, k, v, mask=mask, causal=causal or False, backend=backend)
    ref, _ = ref_attention(q, k, v, mask=mask, causal=causal)
    assert out.dtype == dtype and out.shape == (2, hq, lq, 8)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_bf16_error_within_twice_plain_pytorch(backend, heads):
    hq, hkv = heads
    q, k, v = _qkv(hq=hq, hkv=hkv, lq=33, lk=33, d=16, dtype=torch.bfloat16)
    ref, _ = ref_attention(q, k, v, causal="bottom_right")
    ours = attention(q, k, v, causal=True, backend=backend).double()
    keep = torch.ones(33, 33, dtype=torch.bool).tril()
    plain = _plain(q, k, v, keep).double()
    assert (ours - ref).abs().max() <= 2 * (plain - ref).abs().max() + 1e-3


def test_weights_returned_and_consistent():
    q, k, v = _qkv(dtype=torch.float64)
    mask = torch.rand(7, 7) > 0.5
    mask[:, 0] = True
    out, w = attention(q, k, v, mask=mask, need_weights=True)
    ref_out, ref_w = ref_attention(q, k, v, mask=mask)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 7, dtype=torch.float64))


def test_rank2_inputs_and_custom_scale():
    q, k, v = (torch.randn(5, 3, dtype=torch.float64) for _ in range(3))
    for backend in BACKENDS:
        out = attention(q, k, v, scale=1.0, backend=backend)
        torch.testing.assert_close(out, ref_attention(q, k, v, scale=1.0)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_reference(backend):
    q, k, v = _qkv(hq=4, hkv=2, lq=5, lk=6, dtype=torch.float64, grad=True)
    mask = torch.rand(2, 1, 5, 6) > 0.4
    mask[..., -1] = True
    g = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    (attention(q, k, v, mask=mask, causal=True, backend=backend) * g).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (ref_attention(q, k, v, mask=mask, causal="bottom_right")[0] * g).sum().backward()
    for a, b in zip(ours, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_with_masks(backend):
    q, k, v = _qkv(b=1, hq=2, hkv=1, lq=3, lk=4, d=3, dtype=torch.float64, grad=True)
    bool_mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    float_mask = torch.randn(3, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, mask=bool_mask, causal="top_left", backend=backend),
        (q, k, v),
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, mask=float_mask, backend=backend), (q, k, v)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float", "causal_lq_gt_lk"])
def test_fully_masked_rows_are_zero_forward_and_backward(backend, kind):
    q, k, v = _qkv(lq=6, lk=4, grad=True)
    mask, causal = None, False
    if kind == "bool":
        mask = torch.rand(6, 4) > 0.5
        mask[0] = False  # row 0 sees nothing
        mask[1:, 0] = True
    elif kind == "float":
        mask = torch.zeros(6, 4)
        mask[2] = float("-inf")
    else:
        causal = "bottom_right"  # 6 queries, 4 keys: rows 0 and 1 see nothing
    out = attention(q, k, v, mask=mask, causal=causal, backend=backend)
    ref, _ = ref_attention(q, k, v, mask=mask, causal=causal or None)
    dead = {"bool": [0], "float": [2], "causal_lq_gt_lk": [0, 1]}[kind]
    assert torch.isfinite(out).all()
    assert (out[:, :, dead] == 0).all()
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, dead] == 0).all()


class TestDropout:
    def test_statistics(self):
        q, k, v = _qkv(b=4, hq=4, lq=64, lk=64, dtype=torch.float64)
        p = 0.3
        _, w_full = attention(q, k, v, need_weights=True)
        _, w_drop = attention(q, k, v, dropout_p=p, need_weights=True)
        zero_frac = (w_drop == 0).double().mean().item()
        assert abs(zero_frac - p) < 0.02
        kept = w_drop != 0
        # kept weights are scaled by exactly 1/(1-p)
        torch.testing.assert_close(w_drop[kept], w_full[kept] / (1 - p))
        # mean preserved in expectation
        assert abs(w_drop.mean().item() - w_full.mean().item()) < 0.02 * w_full.mean().item()

    def test_zero_p_is_deterministic(self):
        q, k, v = _qkv()
        torch.testing.assert_close(attention(q, k, v, dropout_p=0.0), attention(q, k, v))

    def test_sdpa_backend_honours_dropout(self):
        q, k, v = _qkv(lq=64, lk=64)
        a = attention(q, k, v, dropout_p=0.5, backend="sdpa")
        assert not torch.allclose(a, attention(q, k, v, backend="sdpa"))


class TestErrors:
    def test_head_dim_mismatch(self):
        q, k, v = _qkv()
        with pytest.raises(ValueError, match=r"query head_dim \(8\) must equal key head_dim \(5\)"):
            attention(q, k[..., :5], v)

    def test_mask_not_broadcastable(self):
        q, k, v = _qkv()
        with pytest.raises(ValueError, match=r"mask of shape \(3, 3\) does not broadcast"):
            attention(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool))

    def test_mask_wrong_dtype(self):
        q, k, v = _qkv()
        with pytest.raises(TypeError, match="torch.int64"):
            attention(q, k, v, mask=torch.ones(7, 7, dtype=torch.long))

    @pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
    def test_bad_dropout(self, p):
        q, k, v = _qkv()
        with pytest.raises(ValueError, match=rf"dropout_p must be (>= 0.0|< 1.0), got {p}"):
            attention(q, k, v, dropout_p=p)

    def test_unknown_backend_lists_valid(self):
        q, k, v = _qkv()
        with pytest.raises(
            ValueError, match="unknown attention backend 'nope'; valid: auto, .*reference.*sdpa"
        ):
            attention(q, k, v, backend="nope")

    def test_backend_that_cannot_honour_raises(self):
        q, k, v = _qkv()
        with pytest.raises(ValueError, match="'sdpa' cannot run this call: .*weights"):
            attention(q, k, v, need_weights=True, backend="sdpa")

    def test_heads_not_divisible(self):
        q, k, v = _qkv(hq=4, hkv=3)
        with pytest.raises(
            ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"
        ):
            attention(q, k, v)

    def test_integer_inputs_and_mixed_dtypes(self):
        q, k, v = _qkv()
        with pytest.raises(TypeError, match="floating dtype"):
            attention(q.long(), k, v)
        with pytest.raises(TypeError, match="share a dtype"):
            attention(q.double(), k, v)

    def test_bad_causal(self):
        q, k, v = _qkv()
        with pytest.raises(ValueError, match="'diagonal'"):
            attention(q, k, v, causal="diagonal")


def test_auto_picks_sdpa_without_dropout_and_reference_with_it():
    q, k, v = _qkv()
    call = attnkit.backends.AttentionCall(q, k, v, None, None, 0.35, 0.0, False)
    assert attnkit.backends.select("auto", call).name == "sdpa"
    call = attnkit.backends.AttentionCall(q, k, v, None, None, 0.35, 0.1, False)
    assert attnkit.backends.select("auto", call).name == "reference"


def _ref_window_keep(lq, lk, w, causal):
    keep = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        p = i + lk - lq
        for j in range(lk):
            keep[i, j] = (p - w < j <= p) if causal else abs(p - j) < w
    return keep


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", [(9, 9), (4, 11)])
def test_sliding_window(backend, causal, lens):
    lq, lk = lens
    q, k, v = _qkv(lq=lq, lk=lk, dtype=torch.float64)
    out = attention(q, k, v, causal=causal, window=3, backend=backend)
    ref, _ = ref_attention(q, k, v, mask=_ref_window_keep(lq, lk, 3, causal))
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_mod_equals_dense_mask(backend):
    q, k, v = _qkv(b=2, hq=2, hkv=2, lq=6, lk=6, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])  # packed documents

    def same_doc(b, h, qi, ki):
        return ids[b, qi] == ids[b, ki]

    out = attention(q, k, v, mask_mod=same_doc, causal=True, backend=backend)
    dense = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    for b in range(2):
        for i in range(6):
            for j in range(6):
                dense[b, 0, i, j] = bool(ids[b, i] == ids[b, j])
    ref, _ = ref_attention(q, k, v, mask=dense, causal="bottom_right")
    torch.testing.assert_close(out, ref)


def test_score_mod_gradients_reach_its_tensors():
    q, k, v = _qkv(b=1, hq=2, hkv=2, lq=5, lk=5, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)

    def alibi(score, b, h, qi, ki):
        return score - slopes[h] * (qi - ki).abs()

    out = attention(q, k, v, score_mod=alibi, causal=True)
    dist = (torch.arange(5).view(-1, 1) - torch.arange(5).view(1, -1)).abs().double()
    bias = -slopes.detach().view(1, 2, 1, 1) * dist
    ref, _ = ref_attention(q, k, v, mask=bias, causal="bottom_right")
    torch.testing.assert_close(out, ref)
    assert torch.autograd.gradcheck(
        lambda s: attention(
            q, k, v, causal=True, score_mod=lambda sc, b, h, qi, ki: sc - s[h] * (qi - ki).abs()
        ),
        (slopes,),
    )
    with pytest.raises(ValueError, match="'sdpa' cannot run this call: .*score_mod"):
        attention(q, k, v, score_mod=alibi, backend="sdpa")


def test_mod_and_window_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        attention(q, k, v, window=0)
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        attention(q, k, v, mask_mod=3)
    with pytest.raises(ValueError, match="needs a 4-D"):
        attention(q[0], k[0], v[0], mask_mod=lambda b, h, i, j: i >= j)


# --- issue 13: bad input and the numerics of every backend -------------------------------

ALL = ["auto", "reference", "sdpa", "blockwise", "blockwise-tiles"]


def test_head_dim_zero_is_a_clear_value_error_not_zero_division():
    """Regression: a head_dim of 0 raised ZeroDivisionError computing the default scale."""
    q = torch.rand(1, 2, 4, 0)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        attention(q, q, q)
    with pytest.raises(ValueError, match="value head_dim 0"):
        attention(torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 0))


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(window=True), TypeError, "window must be an int, got bool"),
        (dict(window=2.0), TypeError, "window must be an int, got float"),
        (dict(scale=True), TypeError, "scale must be a number, got bool"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(dropout_p=True), TypeError, "dropout_p must be a number, got bool"),
        (dict(need_weights=1), TypeError, "need_weights must be True or False"),
    ],
)
def test_bool_where_a_number_is_meant_is_refused(kw, err, match):
    """Regression: window=True was accepted as a window of 1 (bool is not an int)."""
    q, k, v = _qkv()
    with pytest.raises(err, match=match):
        attention(q, k, v, **kw)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("scale", [0.0, -0.7])
@pytest.mark.parametrize("causal", [True, "top_left"])
def test_causal_scale_zero_or_negative_is_honoured_not_nan(backend, scale, causal):
    """Regression: causal=True with scale <= 0 returned NaN (torch's fused is_causal kernel)."""
    q, k, v = _qkv(lq=9, lk=9, grad=True)
    out = attention(q, k, v, causal=causal, scale=scale, backend=backend)
    align = "bottom_right" if causal is True else causal
    want, _ = ref_attention(q, k, v, causal=align, scale=scale)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    if scale == 0.0:  # uniform weights over the kept keys: q gets no gradient
        assert q.grad.abs().max() == 0


def test_reference_float16_does_not_overflow_with_dropout():
    """Regression: the reference computed q @ k^T before scaling: fp16 overflowed to NaN
    (256/256 NaN on auto with dropout_p=0.1, which auto sends to the reference)."""
    x = (torch.randn(2, 2, 16, 64) * 40).half()  # |x_i|^2 ~ 1e5 > 65504: q @ k^T overflows
    v = torch.randn(2, 2, 16, 64).half()
    assert (x @ x.transpose(-2, -1)).isinf().any()
    want, _ = ref_attention(x, x, v)  # float64
    for backend in ("auto", "reference"):
        out = attention(x, x, v, backend=backend, dropout_p=0.1)
        assert torch.isfinite(out).all()
        out = attention(x, x, v, backend=backend)
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kind", ["bool", "float", "padding_gqa"])
def test_nan_in_a_masked_out_key_is_ignored_on_every_backend(backend, kind):
    """Regression: reference ignored a NaN in a masked-out key, sdpa/blockwise/auto gave NaN."""
    hq = 4
    q, k, v = _qkv(b=2, hq=hq, hkv=2 if kind == "padding_gqa" else 4, lq=6, lk=8)
    if kind == "padding_gqa":
        keep = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        keep[1, ..., 5:] = False  # batch element 1 pads its last 3 keys
        k[1, :, 5:], v[1, :, 5:] = float("nan"), float("inf")
    else:
        keep = torch.ones(6, 8, dtype=torch.bool)
        keep[:, 3] = False
        k[..., 3, :], v[..., 3, :] = float("nan"), float("nan")
    mask = keep if kind != "float" else torch.zeros(6, 8).masked_fill(~keep, float("-inf"))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = attention(q, k, v, mask=mask, backend=backend)
    clean = [t.detach().nan_to_num(0.0, posinf=0.0) for t in (k, v)]
    want, _ = ref_attention(q, *clean, mask=keep)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", ALL)
def test_nan_in_a_kept_key_reaches_the_rows_that_keep_it(backend):
    """Documented (README): NaN in a kept key is not checked; the rows keeping it are NaN."""
    q, k, v = _qkv(b=1, hq=2, hkv=2, lq=5, lk=5)
    k[..., 2, :] = float("nan")
    out = attention(q, k, v, causal=True, backend=backend)
    assert out[..., 2:, :].isnan().all()  # rows 2.. keep key 2
    assert torch.isfinite(out[..., :2, :]).all()  # causal removes it for rows 0, 1 only...
    # ...but rows 0, 1 do not remove it for *every* query, so on the fused backends a NaN
    # could also spread there; the check above holds because causal tiles skip it.


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_mask_huge_negative_is_a_bias_in_every_dtype(backend, dtype):
    """Regression: -1e9 cast to float16 became -inf, so an all -1e9 row gave zeros in
    float16 but uniform weights in float32. Finite stays finite: a bias, not a removal."""
    q, k, v = _qkv(b=1, hq=2, hkv=2, lq=4, lk=5, dtype=dtype)
    mask = torch.zeros(4, 5, dtype=torch.float64)
    mask[0] = -1e9  # every key of row 0 gets the same huge negative bias
    mask[1, 1:] = float("-inf")  # row 1 keeps key 0 only
    out = attention(q, k, v, mask=mask, backend=backend)
    # row 0 is not removed (never zeros): its weights still sum to 1, so its output lies
    # within the values' range (how the weights spread depends on rounding)
    assert torch.isfinite(out).all() and out[..., 0, :].abs().sum() > 0
    lo, hi = v.amin(dim=-2), v.amax(dim=-2)  # (b, h, d)
    assert ((out[..., 0, :] >= lo - 1e-2) & (out[..., 0, :] <= hi + 1e-2)).all()
    torch.testing.assert_close(out[..., 1, :], v[..., 0, :], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "change, err, match",
    [
        (dict(value="meta"), ValueError, "value is on meta but query is on cpu"),
        (dict(key="meta"), ValueError, "key is on meta but query is on cpu"),
        (dict(value=torch.float64), TypeError, "value has dtype torch.float64 but query has"),
        (dict(key=torch.float16), TypeError, "key has dtype torch.float16 but query has"),
        (dict(mask="meta"), ValueError, "mask is on meta but query is on cpu"),
        (dict(sinks="meta"), ValueError, "sinks is on meta but query is on cpu"),
        (dict(mask=torch.int32), TypeError, "mask must be bool"),
        (dict(sinks=torch.long), TypeError, "sinks must be a float tensor"),
    ],
)
def test_devices_and_dtypes_are_checked_before_any_backend_runs(monkeypatch, change, err, match):
    # attention(q, k, v.to("meta")) once reached a kernel and killed the process (segfault)
    import attnkit.backends

    def no_kernel(*args, **kwargs):
        raise AssertionError("a backend ran before the inputs were checked")

    monkeypatch.setattr(attnkit.backends, "dispatch", no_kernel)
    monkeypatch.setattr(attnkit.backends, "run", no_kernel)
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    tensors = dict(
        query=q, key=k, value=v, mask=torch.ones(256, 256, dtype=torch.bool), sinks=torch.zeros(2)
    )
    for name, to in change.items():
        tensors[name] = tensors[name].to(to)
    with pytest.raises(err, match=match):
        attention(
            tensors["query"],
            tensors["key"],
            tensors["value"],
            mask=tensors["mask"],
            sinks=tensors["sinks"],
            backend="blockwise",
        )


@pytest.mark.parametrize("seed", range(40))
def test_the_one_reduction_test_agrees_with_removed_keys(seed):
    """keeps_every_key (one reduction, taken before building the removed set) never says
    "nothing removed" where removed_keys finds a key, and says it whenever removed_keys
    finds none per head: bool and float masks of random broadcast shapes."""
    from attnkit.masks import keeps_every_key, removed_keys

    g = torch.Generator().manual_seed(seed)
    shape = [int(n) for n in torch.randint(1, 4, (4,), generator=g)]
    shape = shape[int(torch.randint(0, 3, (1,), generator=g)) :]  # rank 2 to 4
    density = float(torch.rand(1, generator=g)) * 0.6 + 0.2
    keep = torch.rand(shape, generator=g) < density
    masks = [keep, torch.randn(shape, generator=g).masked_fill(~keep, float("-inf"))]
    for mask in masks:
        heads = mask.shape[-3] if mask.dim() >= 3 else 1
        none_removed = not removed_keys(mask, heads).any()
        assert keeps_every_key(mask) == none_removed, (shape, mask)
        if keeps_every_key(mask):  # and for any GQA grouping of those heads
            assert not removed_keys(mask, 1).any()
    for row in (keep[..., 0, :].reshape(-1), torch.ones(5, dtype=torch.bool)):  # 1-D (l_k,)
        assert keeps_every_key(row) == (not removed_keys(row, 1).any())


@pytest.mark.parametrize("causal, lq, lk", [(True, 1, 9), ("top_left", 3, 1)])
def test_a_causal_flag_that_masks_nothing_is_dropped(monkeypatch, causal, lq, lk):
    """causal=True on a decode step (one query, bottom-right: every key is in its past)
    masks nothing: the call runs as an unmasked one (SDPA without a mask, not a dense
    causal mask), with the float64 reference's answer and gradients."""
    import attnkit.backends.sdpa as sdpa_module

    seen: list[tuple] = []
    original = sdpa_module.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append((attn_mask, kwargs["is_causal"]))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(lq=lq, lk=lk, grad=True)
    out = attention(q, k, v, causal=causal, backend="sdpa")
    assert seen == [(None, False)]
    ref, _ = ref_attention(q, k, v, causal=None)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want, _ = ref_attention(qd, kd, vd, causal=None)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.sum(), (qd, kd, vd))
    for got, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), w, **TOL[torch.float32])
    # with a window the flag sets how the window lines up: it stays
    seen.clear()
    attention(q, k, v, causal=causal, window=2, backend="sdpa")
    assert seen[0][0] is not None
