"""The native skinny linear (``native/linear.py``, ``linear.h``) on every build this CPU
runs: float64 references with flash-attn's rule, odd and strided shapes, the same bits on
any thread count, and :class:`attnkit.models.linear.Linear` sending a decode step's rows
to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnkit.backends.blockwise.native import linear as native_linear
from attnkit.models.linear import Linear, pack_linears, packing_available

pytestmark = pytest.mark.usefixtures("isa")


def _plain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + b`` as plain float32 math: each dot product summed input by input."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.zeros(rows.shape[0], w.shape[0])
    for k in range(w.shape[1]):
        y = y + rows[:, k : k + 1] * w[:, k]  # (m, n)
    return (y if b is None else y + b).reshape(*x.shape[:-1], w.shape[0])


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """The kernel's error against float64 is at most twice that of plain float32 math
    (flash-attn's rule; F.linear's error, where larger, is the yardstick too), give or
    take two float32 roundings of the largest sum of |products| an output adds up: with
    few outputs the plain sums can all be lucky (session 34's widened fuzzing: one output
    of 93 products, 12.34, plain off by 0.1 of its ulp, the kernel's blocked sum by 1.9)."""
    assert native_linear.takes(x, w)
    got = native_linear.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch_out = F.linear(x, w, b)
    assert got.shape == torch_out.shape and got.dtype == torch.float32
    err = (got.double() - ref).abs().max().item()
    plain_err = max(
        (_plain(x, w, b).double() - ref).abs().max().item(),
        (torch_out.double() - ref).abs().max().item(),
    )
    rows_abs = x.double().abs().reshape(-1, x.shape[-1])  # (m, k)
    magnitude = (rows_abs @ w.double().abs().T).max().item() if rows_abs.numel() else 0.0
    floor = 1e-6 + 2 * 2**-24 * magnitude
    assert err <= 2 * plain_err + floor, (err, plain_err, floor)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "rows, d_in, d_out",
    [(1, 768, 768), (8, 768, 2304), (3, 3072, 100), (5, 17, 3), (8, 1, 49), (2, 100, 1)],
)
def test_against_float64(rows, d_in, d_out, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + d_in + d_out)
    x = torch.randn(rows, d_in, generator=gen)
    w = torch.randn(d_out, d_in, generator=gen)
    b = torch.randn(d_out, generator=gen) if bias else None
    _check(x, w, b)


def test_strided_expanded_and_batched_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 48, generator=gen)
    b = torch.randn(37, generator=gen)
    base = torch.randn(4, 6, 48, generator=gen)
    wide = torch.randn(8, 100, generator=gen)
    for x in (
        base[:, 0],  # rows 6 * 48 apart
        base[0, ::2],  # every other row
        base.transpose(0, 1)[:2],  # (2, 4, 48): rows through a transpose
        torch.randn(1, 48, generator=gen).expand(8, 48),  # one row, stride 0
        wide[:, 10:58],  # columns of a wider tensor
        torch.randn(48, 3, generator=gen).t(),  # inputs strided: copied first
    ):
        _check(x, w, b)
    w_rows = torch.randn(37, 60, generator=gen)[:, :48]  # the weight's rows 60 apart
    _check(base[0], w_rows, b)


def test_the_same_bits_on_any_thread_count():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3072, generator=gen)
    w = torch.randn(1000, 3072, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_linear.linear(x, w, None)
        torch.set_num_threads(max(2, before))
        many = native_linear.linear(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_what_it_takes():
    w = torch.randn(10, 16)
    assert native_linear.takes(torch.randn(native_linear.MAX_ROWS, 16), w)
    assert native_linear.takes(torch.randn(2, 4, 16), w)  # 8 rows in two dims
    assert not native_linear.takes(torch.randn(native_linear.MAX_ROWS + 1, 16), w)
    assert not native_linear.takes(torch.randn(0, 16), w)
    assert not native_linear.takes(torch.randn(2, 16, dtype=torch.float64), w.double())
    assert not native_linear.takes(torch.randn(2, 16), torch.randn(16, 10).t())  # rows strided
    assert not native_linear.takes(torch.randn(2, 8), w)  # the wrong width: F.linear's error


def test_a_prepared_linear_given_the_wrong_width_raises_torchs_error():
    layer = Linear(16, 10)
    pack_linears(layer)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        layer(torch.randn(2, 8))  # 16 floats: as many as one row of 16, never read as one


@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    rows=st.integers(1, native_linear.MAX_ROWS),
    d_in=st.integers(1, 300),
    d_out=st.integers(1, 160),
    bias=st.booleans(),
    pad=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
)
@example(rows=1, d_in=93, d_out=1, bias=False, pad=1, seed=1_221_703_815)
def test_fuzz_against_float64(rows, d_in, d_out, bias, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in + pad, generator=gen)[:, pad:]  # rows d_in + pad apart
    w = torch.randn(d_out, d_in + pad, generator=gen)[:, :d_in]
    b = torch.randn(d_out, generator=gen) if bias else None
    _check(x, w, b)


@pytest.mark.skipif(not packing_available(), reason="no oneDNN in this torch")
def test_a_prepared_linear_sends_a_decode_steps_rows_here(monkeypatch):
    torch.manual_seed(3)
    layer = Linear(64, 40)
    pack_linears(layer)
    calls: list[int] = []
    real = native_linear.linear

    def spy(x, w, b):
        calls.append(x.numel() // x.shape[-1])
        return real(x, w, b)

    monkeypatch.setattr(native_linear, "linear", spy)
    with torch.no_grad():
        for rows in (1, native_linear.MAX_ROWS, native_linear.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [1, native_linear.MAX_ROWS]  # more rows: oneDNN's copy
    layer(torch.randn(2, 64)).sum()  # recording a gradient: F.linear
    assert calls == [1, native_linear.MAX_ROWS]
