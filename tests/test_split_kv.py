"""Split-KV decoding in the native kernel (flash-decoding): a call with few query blocks
(a decode step against a long cache) cuts its keys into ranges computed apart and merged
by their log-sum-exps in a fixed order. Checked against float64 (causal, windows that
leave whole ranges empty, GQA, sinks, bf16), against the unsplit kernel, and bit for bit
across thread counts (the ranges depend on the shapes alone)."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.backends.blockwise import native
from tests.reference import plain_attention, ref_attention_lse, ref_band_keep

pytestmark = pytest.mark.usefixtures("one_thread", "isa")


def decode_case(t, h, h_kv, length, d=64, dtype=torch.float32):
    q = torch.randn(1, h, t, d, dtype=dtype)
    k = torch.randn(1, h_kv, length, d, dtype=dtype)
    v = torch.randn(1, h_kv, length, d, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "t, h, h_kv, length, causal, window",
    [
        (1, 2, 2, 5000, False, None),  # keys read in place, 4 ranges
        (1, 4, 2, 3001, True, 700),  # a window: most ranges empty
        (3, 2, 1, 2500, True, None),  # a few queries, bottom-right
        (8, 4, 1, 4100, "top_left", 2000),  # keys packed (32 rows per kv head), ranges split
    ],
)
def test_split_decode_matches_float64(t, h, h_kv, length, causal, window):
    q, k, v = decode_case(t, h, h_kv, length)
    sinks = torch.randn(h)
    out, lse = attention(q, k, v, causal=causal, window=window, sinks=sinks, return_lse=True,
                         backend="blockwise")  # fmt: skip
    align = None if not causal else ("top_left" if causal == "top_left" else "bottom_right")
    keep = ref_band_keep(t, length, align, window)
    ref_out, ref_lse = ref_attention_lse(q, k, v, keep, None, sinks)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=2e-5)


def test_split_equals_unsplit_and_threads_agree_bitwise(monkeypatch):
    """The split result is the unsplit one up to rounding, and 1 or 2 threads (or 3) give
    the same bits."""
    q, k, v = decode_case(1, 4, 2, 6000)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(attention(q, k, v, backend="blockwise", return_lse=True))
    torch.set_num_threads(1)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    monkeypatch.setattr(native, "KV_SPLITS", 1)
    unsplit = attention(q, k, v, backend="blockwise", return_lse=True)
    torch.testing.assert_close(unsplit[0], results[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(unsplit[1], results[0][1], atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(native, "KV_SPLITS", 7)  # forced: 7 uneven ranges
    forced = attention(q, k, v, backend="blockwise", return_lse=True)
    torch.testing.assert_close(forced[0], results[0][0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 900])
def test_more_ranges_than_the_merge_weighs_on_its_stack(monkeypatch, window):
    """A split forced past the 32 partials the kernel's merge weighs on its stack (40
    ranges; with a window most of them hold no key) still gives float64's values."""
    monkeypatch.setattr(native, "KV_SPLITS", 40)
    q, k, v = decode_case(1, 2, 1, 40 * native.KEY_CHUNK + 17)
    out, lse = attention(q, k, v, causal=True, window=window, backend="blockwise",
                         return_lse=True)  # fmt: skip
    keep = ref_band_keep(1, k.shape[2], "bottom_right", window)
    ref_out, ref_lse = ref_attention_lse(q, k, v, keep, None, None)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=2e-5)


def test_units_of_several_query_blocks_merge_on_any_thread_with_the_same_bits(monkeypatch):
    """Each (head, query block) unit is merged by whichever item finishes its last key
    range: 3 query blocks x 2 heads x 4 ranges give the same bits on 1, 2 and 3 threads,
    and float64's values."""
    monkeypatch.setattr(native, "KV_SPLITS", 4)  # (what the shapes choose here, pinned)
    t, length = 2 * native.BLOCK_Q + 11, 5000
    q, k, v = decode_case(t, 2, 2, length)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(attention(q, k, v, causal=True, backend="blockwise", return_lse=True))
    torch.set_num_threads(1)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    ref_out, ref_lse = ref_attention_lse(q, k, v, ref_band_keep(t, length, "bottom_right", None))
    torch.testing.assert_close(results[0][0].double(), ref_out, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(results[0][1].double(), ref_lse, atol=2e-6, rtol=2e-5)


def test_split_decode_nan_and_dead_rows():
    """A NaN key reaches its rows as NaN through the merge; a row no key reaches gets zeros
    and -inf."""
    q, k, v = decode_case(1, 2, 2, 4096)
    k[0, 0, 3000] = float("nan")
    mask = torch.ones(1, 2, 1, 4096, dtype=torch.bool)
    mask[0, 1] = False
    out, lse = attention(q, k, v, mask=mask, backend="blockwise", return_lse=True)
    assert torch.isnan(out[0, 0]).all()
    assert torch.equal(out[0, 1], torch.zeros(1, 64)) and torch.isneginf(lse[0, 1]).all()


def test_split_decode_bf16_rule():
    q, k, v = decode_case(1, 2, 2, 4096, dtype=torch.bfloat16)
    out = attention(q, k, v, backend="blockwise")
    ref_out, _ = ref_attention_lse(q, k, v)
    plain = plain_attention(q, k, v, torch.ones(1, 4096, dtype=torch.bool))
    err = (out.double() - ref_out).abs().max()
    assert err <= 2 * (plain.double() - ref_out).abs().max() + 1e-3


def test_decode_gradients_through_split_forward():
    """The backward reads the merged output and log-sum-exp: gradients as float64's."""
    q, k, v = decode_case(2, 2, 1, 3000, d=32)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = attention(q, k, v, causal=True, backend="blockwise")
    ref, _ = ref_attention_lse(q, k, v, ref_band_keep(2, 3000, "bottom_right", None))
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out.double() * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=1e-4)


def test_auto_sends_decode_steps_where_the_kernel_measured_faster(monkeypatch):
    """``auto`` runs a decode step on the native kernel (split-KV) where this machine
    measured it faster than SDPA at the step's work or below (calibrate.decode_pays, each
    dtype and grouping apart; faked here: float32 GQA from 512 keys, float32 without GQA
    never, bf16 GQA from 128 keys), and leaves the rest, gradients and prefills to the
    others."""
    from attnkit.backends.blockwise.native import calibrate

    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED", raising=False)
    monkeypatch.setattr(
        calibrate,
        "speed",
        lambda dtype=None, keys=None, bias=False: calibrate.Speed(0.5, 0.5, "measured"),
    )
    monkeypatch.setattr(calibrate, "_cache", {})
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: None)
    measured: list[tuple] = []

    def fake(dtype, grouped, keys):
        measured.append((dtype, grouped, keys))
        fast = grouped and keys >= (512 if dtype == torch.float32 else 128)
        ratio = 0.6 if fast else 1.4  # (clear: one take each)
        return ratio, ratio, False

    monkeypatch.setattr(calibrate, "_time_decode", fake)
    seen: list[tuple] = []
    original = native.forward

    def spy(plan, q, k, v):
        seen.append((plan.t, plan.s))
        return original(plan, q, k, v)

    monkeypatch.setattr(native, "forward", spy)
    long_keys = 2048  # 8 query heads x 2048 keys: the work of the GQA case at 512 keys
    q, k, v = decode_case(1, 8, 2, long_keys)  # 4 rows per kv head: a decode step
    out = attention(q, k, v)
    assert seen == [(1, long_keys)]
    assert measured == [(torch.float32, True, 128), (torch.float32, True, 512)]
    ref, _ = ref_attention_lse(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    seen.clear()
    half = [x.to(torch.bfloat16) for x in decode_case(1, 8, 2, 1024)]
    attention(*half)  # bf16 GQA: its own measurement, faster from 128 keys
    assert seen == [(1, 1024)]
    seen.clear()
    attention(*decode_case(1, 8, 2, long_keys // 2))  # a shorter float32 cache: SDPA
    attention(*decode_case(1, 2, 2, 20_000))  # without GQA: never faster here
    attention(*decode_case(1, 8, 2, 100))  # under the shortest measured: not measured
    attention(q.requires_grad_(), k, v)  # gradients wanted: as before
    attention(*decode_case(4, 8, 2, long_keys))  # 16 rows per kv head: as before
    assert seen == []
    assert (torch.float32, True, 2048) not in measured  # (only what a call needed)
    # a few queries bottom-right causal: SDPA would need a dense mask, the kernel takes
    # any size (2 x 4 rows per kv head against a short cache)
    q2, k2, v2 = decode_case(2, 8, 2, 300)
    out = attention(q2, k2, v2, causal=True)
    assert seen == [(2, 300)]
    ref, _ = ref_attention_lse(q2, k2, v2, keep=ref_band_keep(2, 300, "bottom_right", None))
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    seen.clear()
    attention(q2, k2, v2, causal="top_left")  # (keys past the queries removed: SDPA's own)
    attention(*decode_case(1, 8, 2, 300), causal=True)  # one query: nothing masked, SDPA
    assert seen == []
