"""attnkit.bench.call_overhead: the rows it reports, and that its no-kernel row puts the
kernel back (a later call computes again)."""

from __future__ import annotations

import torch

from attnkit import attention
from attnkit.bench import call_overhead
from attnkit.bench.call_overhead import main, measure
from tests.reference import ref_attention_lse


def test_measure_reports_every_row_and_restores_the_kernel():
    real = call_overhead.native._kernel
    rows = measure(keys=64, calls=5)
    assert set(rows) == {"sdpa", "auto", "blockwise", "blockwise, no kernel"}
    assert all(us > 0 for us in rows.values())
    assert call_overhead.native._kernel is real
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    ref, _ = ref_attention_lse(q, k, v)
    out = attention(q, k, v, backend="blockwise")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_main_prints_the_rows(capsys):
    assert main(["--keys", "64", "--calls", "3"]) == 0
    printed = capsys.readouterr().out
    assert "blockwise, no kernel" in printed and "backend: blockwise" in printed
