"""The native kernel's per-call buffers come from a cache of recent ones (attention.cpp's
feature "reuse"): calls of different sizes, one after another, give the bits each gives
first (a reused buffer's old values never reach a result), and the calling thread keeps
its buffers for its next call, up to a bound, instead of faulting in new pages each time."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.backends.blockwise import native

pytestmark = pytest.mark.usefixtures("isa")


def _calls() -> list:
    """Closures of different sizes, each reaching a buffer of its own kind: packed keys
    (a prefill), split-KV partials (a long decode step), dQ partials (a backward)."""
    gen = torch.Generator().manual_seed(5)

    def r(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    q1, k1, v1 = r(1, 4, 300, 32), r(1, 2, 300, 32), r(1, 2, 300, 32)
    q2, k2, v2 = r(2, 8, 1, 64), r(2, 2, 5000, 64), r(2, 2, 5000, 64)
    q3, k3, v3 = (r(1, 2, 200, 48, grad=True) for _ in range(3))

    def backward() -> tuple[torch.Tensor, ...]:
        out = attention(q3, k3, v3, causal=True, backend="blockwise")
        return (out.detach(), *torch.autograd.grad(out.square().sum(), (q3, k3, v3)))

    def prefill() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return (attention(q1, k1, v1, causal=True, backend="blockwise"),)

    def decode() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return (attention(q2, k2, v2, backend="blockwise"),)

    return [prefill, decode, backward]


def test_reused_buffers_give_each_call_its_first_bits():
    calls = _calls()
    first = [c() for c in calls]
    for _ in range(3):
        for call, want in zip(calls[::-1] + calls, first[::-1] + first, strict=True):
            got = call()
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_calling_thread_keeps_its_buffers_up_to_a_bound():
    """A call's packed keys stay in the calling thread's cache for the next call (no new
    memory, so no page faults: about 340 a call for a bf16 cascade step beside float32
    ones before); a buffer over the bound (80 MB: KEEP in attention.cpp) is freed, as before."""
    lib = native.library()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 32, 64, generator=gen)  # (GQA: two blocks read each kv head's keys)
    with torch.no_grad():
        k, v = (torch.randn(1, 2, 4096, 64, generator=gen) for _ in range(2))
        attention(q, k, v, return_lse=True, backend="blockwise")
        held = lib.attnkit_reused_bytes()
        assert held >= 2 * 4096 * 64 * 4  # the keys, packed float32
        attention(q, k, v, return_lse=True, backend="blockwise")
        assert lib.attnkit_reused_bytes() == held  # taken and given back, not grown
        big_k, big_v = (torch.randn(1, 2, 180_000, 64, generator=gen) for _ in range(2))
        out = attention(q, big_k, big_v, return_lse=True, backend="blockwise")[0]
        assert torch.isfinite(out).all()
        assert lib.attnkit_reused_bytes() <= 80 << 20  # 92 MB of packed keys not kept
