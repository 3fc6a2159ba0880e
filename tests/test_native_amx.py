"""The avx512-amx build (``native/amx.h``): bf16 products on AMX tiles.

Where the CPU has AMX and Linux grants it, that build comes first; its bf16 results are
checked against float64 with flash-attn's rule beside the avx512-bf16 build's (vdpbf16ps,
the same kernel around other products), and torch's own AMX work (oneDNN keeps a tile
configuration per thread) is unchanged by calls between its own. Elsewhere the build is
left out: where Linux refuses the tiles, and on any CPU without them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit import attention
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build
from tests.reference import plain_attention, ref_attention_lse

AMX = "avx512-amx" in build.host_isas()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU (or its Linux) runs no avx512-amx build")


def test_the_amx_build_needs_the_cpu_flags_and_linux_permission(monkeypatch):
    """avx512-amx is offered only with amx_tile and amx_bf16 on top of avx512-bf16's flags,
    and only where Linux grants this process the tile state."""
    flags = build._NEEDS["avx512-amx"]
    assert build._NEEDS["avx512-bf16"] < flags and {"amx_tile", "amx_bf16"} <= flags
    assert build.ISA_FLAGS["avx512-amx"][-2:] == ("-mamx-tile", "-mamx-bf16")
    monkeypatch.setattr(build.platform, "system", lambda: "Linux")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "_cpu_flags", lambda: frozenset(flags))
    for granted, compiles, first in (
        (True, True, "avx512-amx"),
        (False, True, "avx512-bf16"),  # Linux refuses the tiles
        (True, False, "avx512-bf16"),  # a compiler without AMX (GCC before 11)
    ):
        build._host_isas.cache_clear()
        monkeypatch.setattr(build, "_amx_permitted", lambda granted=granted: granted)
        monkeypatch.setattr(build, "_compiles", lambda isa, compiles=compiles: compiles)
        try:
            assert build.host_isas()[0] == first
        finally:
            build._host_isas.cache_clear()
    build._host_isas.cache_clear()
    monkeypatch.setattr(build, "_cpu_flags", lambda: frozenset(build._NEEDS["avx512-bf16"]))
    try:
        assert "avx512-amx" not in build.host_isas()  # no AMX: never offered
    finally:
        build._host_isas.cache_clear()


def test_the_compiler_check_runs_the_compiler(monkeypatch, tmp_path):
    """_compiles asks the compiler with the build's flags: a compiler refusing them (a
    stand-in script that fails on -mamx-tile) leaves the build out."""
    fake = tmp_path / "old-g++"
    fake.write_text('#!/bin/sh\ncase "$*" in *-mamx-tile*) exit 1;; esac\nexit 0\n')
    fake.chmod(0o755)
    monkeypatch.setattr(build, "_compiler", lambda: ([str(fake)], "g++ (old) 10.2"))
    assert not build._compiles("avx512-amx") and build._compiles("avx512-bf16")


@needs_amx
def test_an_amx_cpu_runs_the_amx_build_first():
    assert build.host_isas()[0] == "avx512-amx"
    assert build._amx_permitted()  # (asked again: the grant is the process's, idempotent)


def _inputs(b, h, h_kv, t, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g).bfloat16()
    k, v = (torch.randn(b, h_kv, s, d, generator=g).bfloat16() for _ in range(2))
    return q, k, v


def _keep(t, s, causal, window):
    """Which keys each query keeps (bottom-right aligned, as attention()'s causal)."""
    i, j = torch.arange(t).view(-1, 1) + (s - t), torch.arange(s).view(1, -1)
    keep = (j <= i) if causal else torch.ones(t, s, dtype=torch.bool)
    return keep if window is None else keep & (i - j < window)


def _errors(fn, q, k, v, keep, g_out):
    """Max error of out, dq, dk, dv of ``fn(q, k, v)`` (bf16 autograd) against float64."""
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    fn(*xs).backward(g_out)
    rs = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = ref_attention_lse(*rs, keep=keep)
    ref.backward(g_out.double())
    got = [fn(q, k, v), *(x.grad for x in xs)]  # (the output again: same inputs, same bits)
    want = [ref.detach(), *(r.grad for r in rs)]
    return [(a.double() - b).abs().max().item() for a, b in zip(got, want, strict=True)]


@needs_amx
@pytest.mark.parametrize(
    ("b", "h", "h_kv", "t", "s", "d", "causal", "window"),
    [
        (1, 2, 2, 300, 300, 64, True, None),  # causal, odd length: whole and partial tiles
        (2, 4, 2, 145, 145, 32, False, None),  # GQA, 145 rows: a 1-row block
        (1, 2, 1, 77, 200, 128, "bottom_right", None),  # T < S, d=128 (4 pairs of tiles)
        (1, 2, 2, 400, 400, 48, True, 100),  # a window: short rows, pairs past 16 (d=48)
    ],
)  # fmt: skip
def test_amx_matches_float64_and_the_avx512_bf16_build(
    monkeypatch, b, h, h_kv, t, s, d, causal, window
):
    """bf16 forward and backward on AMX tiles against float64, within 2x plain bf16 math's
    error (flash-attn's rule, plus a floor of bf16's rounding of the result), as the
    vdpbf16ps build is on the same inputs."""
    q, k, v = _inputs(b, h, h_kv, t, s, d, seed=t + d)
    g_out = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(1)).bfloat16()
    keep = _keep(t, s, causal, window)
    base = _errors(lambda q, k, v: plain_attention(q, k, v, keep), q, k, v, keep, g_out)
    for isa in ("avx512-amx", "avx512-bf16"):
        monkeypatch.setenv("ATTNKIT_NATIVE_ISA", isa)
        assert native.isa() == isa and native.bf16()

        def ours(q, k, v):
            return attention(q, k, v, causal=causal, window=window, backend="blockwise")

        got = _errors(ours, q, k, v, keep, g_out)
        for name, e, e_plain in zip(("out", "dq", "dk", "dv"), got, base, strict=True):
            assert e <= 2 * e_plain + 1e-2, (isa, name, e, e_plain)


@needs_amx
def test_torchs_own_amx_work_is_unchanged_between_ours(one_thread):
    """torch runs bf16 matmuls and SDPA on AMX tiles on the same threads as the kernel: a
    bf16 matmul and a bf16 SDPA give the same bits before, between and after our calls.
    (That the products put back a tile configuration they found loaded, as oneDNN's
    micro-kernels may leave one between calls, is checked where it can be seen: the
    self-test's "bf16 products" check, tests/native/selftest.cpp.)"""
    a = torch.randn(96, 80).bfloat16()
    bm = torch.randn(80, 112).bfloat16()
    q, k, v = _inputs(1, 2, 2, 256, 256, 64, seed=3)

    def theirs():
        return a @ bm, F.scaled_dot_product_attention(q, k, v, is_causal=True)

    first = theirs()
    for _ in range(3):
        attention(q, k, v, causal=True, backend="blockwise")
        again = theirs()
        assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
