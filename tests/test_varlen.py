"""Packed variable-length batches (``attention(..., cu_seqlens_q=, cu_seqlens_k=)``) against
an independent float64 reference computed for each sequence alone: every length (0 and 1
included), GQA, causal both ways, windows, sinks, mods with per-sequence positions, the
log-sum-exp and gradients, on each native build and on the per-sequence fallback; and
the checks of the offsets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import attention
from attnkit.varlen import why_not_native
from tests.reference import plain_attention, ref_attention_lse, ref_band_keep

pytestmark = pytest.mark.usefixtures("one_thread")


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])


def pack(lens_q, lens_k, h, h_kv, d, d_v, dtype=torch.float32, grad=True):
    """Random packed ``q (tq, h, d)``, ``k``/``v (tk, h_kv, d|d_v)`` and their offsets."""
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(tk, h_kv, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(tk, h_kv, d_v, dtype=dtype, requires_grad=grad)
    return q, k, v, offsets(lens_q), offsets(lens_k)


def reference(q, k, v, cu_q, cu_k, *, causal, window, sinks=None, bias=None, keep_fn=None):
    """float64 ``(out (tq, h, d_v), lse (tq, h))``: each sequence on its own, as a batch of
    one of the test's reference. ``bias(i, lq, lk) -> (h, lq, lk)`` and
    ``keep_fn(i, lq, lk) -> (h|1, lq, lk)`` see sequence ``i``'s own positions."""
    outs, lses = [], []
    for i in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if lk == 0:  # no keys: zeros; lse = the sink's logit (its share dropped) or -inf
            h = q.shape[1]
            outs.append(torch.zeros(lq, h, v.shape[-1], dtype=torch.float64))
            lse0 = torch.full((lq, h), float("-inf"), dtype=torch.float64)
            lses.append(lse0 if sinks is None else sinks.double().expand(lq, h))
            continue
        qi = q[q0:q1].double().transpose(0, 1)[None]  # (1, h, lq, d)
        ki = k[k0:k1].double().transpose(0, 1)[None]
        vi = v[k0:k1].double().transpose(0, 1)[None]
        keep = ref_band_keep(lq, lk, causal, window)[None, None]
        if keep_fn is not None:
            keep = keep & keep_fn(i, lq, lk)[None]
        b = None if bias is None else bias(i, lq, lk)[None]
        out, lse = ref_attention_lse(qi, ki, vi, keep, b, sinks)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    if not outs:
        return torch.zeros(0, q.shape[1], v.shape[-1]).double(), torch.zeros(0, q.shape[1]).double()
    return torch.cat(outs), torch.cat(lses)


def check_close(out, lse, ref_out, ref_lse, atol=2e-5):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=atol, rtol=atol)


def grads(out, lse, inputs, seed=1):
    """Gradients of a random projection of ``out`` and of the finite ``lse``."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    gl = torch.randn(
        lse.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    loss = (out.double() * g).sum() + torch.where(torch.isfinite(lse), lse.double() * gl, 0.0).sum()
    if not loss.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs, strict=True)]


lengths = st.lists(st.integers(0, 150), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(
    lens=lengths,
    same=st.booleans(),
    extra=st.lists(st.integers(0, 150), min_size=4, max_size=4),
    h_kv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    causal=st.sampled_from([None, "top_left", "bottom_right"]),
    window=st.sampled_from([None, 1, 37]),
    with_sinks=st.booleans(),
)
def test_native_equals_each_sequence_alone(
    isa, lens, same, extra, h_kv, groups, causal, window, with_sinks
):
    """Property: the packed call equals each sequence alone (float64), out, lse and every
    gradient, on each native build: it never attends across sequences."""
    lens_k = lens if same else extra[: len(lens)]
    h = h_kv * groups
    q, k, v, cu_q, cu_k = pack(lens, lens_k, h, h_kv, 32, 16)
    sinks = torch.randn(h, requires_grad=True) if with_sinks else None
    assert (
        why_not_native(
            q, k, v, backend="auto", dropout_p=0.0, mask_mod=None, score_mod=None, window=window
        )
        is None
    )
    out, lse = attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal or False,
        window=window, sinks=sinks, return_lse=True,
    )  # fmt: skip
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, causal=causal, window=window, sinks=sinks)
    check_close(out, lse, ref_out, ref_lse)
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    got = grads(out, lse, inputs)
    want = grads(ref_out, ref_lse, inputs)
    for name, a, b in zip(["q", "k", "v", "sinks"], got, want, strict=False):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend", ["blockwise-tiles", "reference", "blockwise-flash"])
def test_fallback_engines_give_the_same_answer(backend):
    """The per-sequence loop (any backend) equals the native path and the reference."""
    q, k, v, cu_q, cu_k = pack([7, 0, 1, 130, 33], [9, 3, 1, 130, 0], 4, 2, 32, 32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, window=20, return_lse=True)
    assert (
        why_not_native(
            q, k, v, backend=backend, dropout_p=0.0, mask_mod=None, score_mod=None, window=20
        )
        == f"backend={backend!r} (the kernel is blockwise's)"
    )
    out, lse = attention(q, k, v, backend=backend, **kw)
    nat_out, nat_lse = attention(q, k, v, **kw)
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, causal="bottom_right", window=20)
    check_close(out, lse, ref_out, ref_lse)
    check_close(nat_out, nat_lse, ref_out, ref_lse)
    for a, b in zip(grads(out, lse, (q, k, v)), grads(nat_out, nat_lse, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_mods_see_per_sequence_positions():
    """A score_mod and a mask_mod see q_idx, kv_idx from 0 in each sequence and b = the
    sequence's index (the per-sequence path), gradients included."""
    lens_q, lens_k = [5, 12, 1, 9], [8, 12, 4, 9]
    q, k, v, cu_q, cu_k = pack(lens_q, lens_k, 2, 1, 16, 16)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + 0.3 * b + 0.05 * (h + 1) * (q_idx - kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx + b) % 3 != 1

    out, lse = attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, score_mod=score_mod, mask_mod=mask_mod,
        causal=True, return_lse=True,
    )  # fmt: skip

    def bias(i, lq, lk):
        qi, ki = torch.arange(lq).view(1, -1, 1), torch.arange(lk).view(1, 1, -1)
        hi = torch.arange(2).view(-1, 1, 1)
        return (0.3 * i + 0.05 * (hi + 1) * (qi - ki)).double().expand(2, lq, lk)

    def keep(i, lq, lk):
        return ((torch.arange(lk) + i) % 3 != 1).view(1, 1, lk).expand(1, lq, lk)

    ref_out, ref_lse = reference(
        q, k, v, cu_q, cu_k, causal="bottom_right", window=None, bias=bias, keep_fn=keep
    )
    check_close(out, lse, ref_out, ref_lse)
    for a, b in zip(grads(out, lse, (q, k, v)), grads(ref_out, ref_lse, (q, k, v)), strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4)


def test_relative_bias_runs_natively(isa):
    """ALiBi (a relative bias) runs on the kernel, one bias vector for every sequence."""
    from attnkit import masks as M

    q, k, v, cu_q, cu_k = pack([70, 3, 129], [70, 10, 129], 4, 2, 16, 16)
    alibi = M.alibi(4)
    assert (
        why_not_native(
            q, k, v, backend="auto", dropout_p=0.0, mask_mod=None, score_mod=alibi, window=None
        )
        is None
    )
    out, lse = attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, score_mod=alibi, causal=True,
        return_lse=True,
    )  # fmt: skip
    tiles = attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, score_mod=alibi, causal=True,
        return_lse=True, backend="reference",
    )  # fmt: skip
    torch.testing.assert_close(out, tiles[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, tiles[1], atol=2e-5, rtol=2e-5)


def test_other_sequences_never_leak():
    """NaN and huge keys in one sequence change nothing in the others (bit for bit the same
    as each alone)."""
    lens = [40, 70, 25]
    q, k, v, cu_q, cu_k = pack(lens, lens, 2, 2, 16, 16, grad=False)
    base = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[40:110] = float("nan")
    v2[40:110] = 1e30
    poisoned = attention(q, k2, v2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    keep = torch.ones(135, dtype=torch.bool)
    keep[40:110] = False
    assert torch.equal(base[keep], poisoned[keep])
    assert torch.isnan(poisoned[40:110]).all()
    alone = attention(q[110:], k[110:], v[110:], cu_seqlens_q=offsets([25]),
                      cu_seqlens_k=offsets([25]), causal=True)  # fmt: skip
    torch.testing.assert_close(base[110:], alone, atol=1e-6, rtol=1e-6)


def test_bf16_follows_flash_attn_rule(isa):
    """bf16 (bf16 products on an avx512-bf16 build, else upcast): error at most twice that
    of plain bf16 math per sequence, plus a small floor."""
    lens = [100, 1, 64]
    q, k, v, cu_q, cu_k = pack(lens, lens, 4, 2, 32, 32, dtype=torch.bfloat16, grad=False)
    out = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert out.dtype == torch.bfloat16
    ref_out, _ = reference(q, k, v, cu_q, cu_k, causal="bottom_right", window=None)
    plain = []
    for i in range(3):
        s = slice(int(cu_q[i]), int(cu_q[i + 1]))
        keep = ref_band_keep(lens[i], lens[i], "bottom_right", None)
        p = plain_attention(*(x[s].transpose(0, 1)[None] for x in (q, k, v)), keep)
        plain.append(p[0].transpose(0, 1))
    err = (out.double() - ref_out).abs().max()
    plain_err = (torch.cat(plain).double() - ref_out).abs().max()
    assert err <= 2 * plain_err + 1e-2, (err, plain_err)


def test_empty_batch_and_keyless_sequences():
    """All sequences empty: empty outputs; a sequence with no keys: zeros and -inf (or its
    sink's logit, whose share is dropped)."""
    q, k, v, cu_q, cu_k = pack([0, 0], [0, 5], 2, 1, 16, 16)
    out, lse = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)
    q, k, v, cu_q, cu_k = pack([3, 2], [0, 4], 2, 1, 16, 16)
    sinks = torch.tensor([0.5, -1.0])
    for backend in ("auto", "reference"):
        out, lse = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True,
                             sinks=sinks, backend=backend)  # fmt: skip
        assert torch.equal(out[:3], torch.zeros(3, 2, 16))
        assert torch.equal(lse[:3], sinks.expand(3, 2))


def _bad(**over):
    q, k, v, cu_q, cu_k = pack([3, 4], [3, 4], 2, 1, 16, 16, grad=False)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    kw.update(over)
    return attention(q, k, v, **kw)


@pytest.mark.parametrize(
    "over, err, match",
    [
        (
            dict(cu_seqlens_q=torch.tensor([0.0, 3.0, 7.0])),
            TypeError,
            "cu_seqlens_q must be an int32",
        ),
        (dict(cu_seqlens_k=[0, 3, 7]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
        (dict(cu_seqlens_q=torch.tensor([[0, 3, 7]])), ValueError, "cu_seqlens_q must be 1-D"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 7])), ValueError, "must start at 0, got 1"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 7])), ValueError, r"cu_seqlens_q\[1\] = 5 >"),
        (dict(cu_seqlens_k=torch.tensor([0, 3, 6])), ValueError, r"cu_seqlens_k\[-1\] \(6\)"),
        (dict(cu_seqlens_k=torch.tensor([0, 7])), ValueError, "2 sequences but cu_seqlens_k has 1"),
        (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k is None"),
        (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q \(3\) is less than the longest"),
        (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int"),
        (dict(mask=torch.ones(7, 7, dtype=torch.bool)), ValueError, "mask is not taken"),
        (dict(need_weights=True), ValueError, "need_weights=True is not taken"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be .* \(2,\)"),
    ],
)
def test_bad_arguments_are_named(over, err, match):
    with pytest.raises(err, match=match):
        _bad(**over)


def test_bad_packed_shapes():
    cu = offsets([3, 4])
    q = torch.randn(7, 2, 16)
    with pytest.raises(ValueError, match="must be packed"):
        attention(q[None], q[None], q[None], cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"query heads \(2\) must be a multiple"):
        attention(q, torch.randn(7, 3, 16), torch.randn(7, 3, 16), cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = attention(q, q, q, cu_seqlens_q=cu.int(), cu_seqlens_k=cu, max_seqlen_q=4,
                    max_seqlen_k=9)  # fmt: skip
    assert out.shape == (7, 2, 16)


def test_strided_expanded_and_half_inputs():
    """q, k, v sliced from one packed qkv tensor, keys expanded over heads (stride 0),
    float16 (upcast) and odd bf16 heads: the same as contiguous float32."""
    cu = offsets([33, 1, 70])
    qkv = torch.randn(104, 3, 4, 32)
    q, k, v = qkv[:, 0], qkv[:, 1, :1].expand(104, 2, 32), qkv[:, 2, :1].expand(104, 2, 32)
    out = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    kc, vc = k[:, :1].contiguous(), v[:, :1].contiguous()
    want = attention(q.contiguous(), kc, vc, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    half = attention(q.half(), k.half(), v.half(), cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), want, atol=5e-3, rtol=5e-3)
    odd = torch.randn(104, 2, 17).bfloat16()
    got = attention(odd, odd, odd[..., :16], cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref = attention(odd.float(), odd.float(), odd[..., :16].float(), cu_seqlens_q=cu,
                    cu_seqlens_k=cu)  # fmt: skip
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


def test_gradients_are_bitwise_the_same_for_any_thread_count(isa):
    """The packed backward's work and its dQ sums depend on the shapes alone: 1, 2 and 3
    threads give the same bits (sequences of every size, one with no keys)."""
    q, k, v, cu_q, cu_k = pack([300, 5, 0, 77, 1], [300, 9, 4, 77, 0], 4, 2, 32, 32)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        out, lse = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                             return_lse=True)  # fmt: skip
        results.append((out, *grads(out, lse, (q, k, v))))
    torch.set_num_threads(1)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
