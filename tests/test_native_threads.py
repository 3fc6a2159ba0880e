"""attnkit.backends.blockwise.native.threads: the kernel's parallel calls run on torch's
OpenMP runtime or on the kernel's own pool, with the same bits either way; the choice is
named by ``native.status()``, follows ``ATTNKIT_NATIVE_THREADS``, holds with concurrent
callers, and a forked child still computes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import pytest
import torch

from attnkit import attention
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build, threads
from attnkit.paged_attention import paged_attention

pytestmark = pytest.mark.usefixtures("isa")

OPENMP = "OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def pool(kind: str):
    """The loaded build's parallel calls on ``kind`` ("own" or "openmp"), two threads."""
    lib, before_threads = build.library(), torch.get_num_threads()
    before = os.environ.get("ATTNKIT_NATIVE_THREADS")
    os.environ["ATTNKIT_NATIVE_THREADS"] = kind
    torch.set_num_threads(2)
    try:
        yield threads.attach(lib)[1]
    finally:
        if before is None:
            del os.environ["ATTNKIT_NATIVE_THREADS"]
        else:
            os.environ["ATTNKIT_NATIVE_THREADS"] = before
        threads.attach(lib)
        torch.set_num_threads(before_threads)


def _reference(q, k, v, causal=False, dtype=torch.float64):
    """softmax(q k^T / sqrt(d)) v in ``dtype``, written out, GQA by repeating kv heads."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        t, n = s.shape[-2:]
        keep = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        s = s.masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v


def _calls() -> list[torch.Tensor]:
    """Outputs (and gradients) of the kernel's parallel paths: a causal forward and
    backward, a split-KV decode step, a packed batch and a paged decode step."""
    g = torch.Generator().manual_seed(5)
    out = []
    q, k, v = (torch.randn(1, h, 333, 64, generator=g) for h in (4, 2, 2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = attention(q, k, v, causal=True, backend="blockwise")
    o.backward(torch.randn(o.shape, generator=g))
    out += [o.detach(), q.grad, k.grad, v.grad]
    with torch.no_grad():
        q1, k1, v1 = (
            torch.randn(1, h, t, 64, generator=g) for h, t in ((8, 1), (2, 5000), (2, 5000))
        )
        out.append(attention(q1, k1, v1, backend="blockwise"))
        lens = torch.tensor([0, 70, 250, 251])
        qp, kp, vp = (torch.randn(251, h, 32, generator=g) for h in (4, 2, 2))
        out.append(attention(qp, kp, vp, cu_seqlens_q=lens, cu_seqlens_k=lens, causal=True,
                             backend="blockwise"))  # fmt: skip
        pages, table = (
            torch.randn(2, 40, 2, 16, 64, generator=g),
            torch.randperm(40, generator=g)[None],
        )
        out.append(paged_attention(q1, pages[0], pages[1], table, 600, backend="blockwise"))
    return out


def test_status_names_the_threads():
    line = native.status()
    assert "; threads: " in line
    assert ("torch's OpenMP runtime" in line) == OPENMP, line
    assert build.pool() == ("openmp" if OPENMP else "own")


def test_the_runtime_found_is_the_one_loaded():
    entry, where = threads.openmp_runtime()
    if not OPENMP:
        assert entry is None and where
        return
    assert entry, where
    with open("/proc/self/maps") as maps:
        assert where in maps.read()


def test_the_choice_follows_the_environment():
    with pool("own") as how:
        assert how == "its own pool (ATTNKIT_NATIVE_THREADS=own)"
    with pool("openmp") as how:
        assert ("torch's OpenMP runtime" in how) == OPENMP, how
    with pool("two") as how:
        assert how == "its own pool (ATTNKIT_NATIVE_THREADS='two' is not one of openmp, own)"


def test_both_pools_give_the_same_bits():
    with pool("own"):
        own = _calls()
    with pool("openmp"):
        omp = _calls()
    for a, b in zip(own, omp, strict=True):
        assert torch.equal(a, b)
    # the first output is the causal forward of _calls' first inputs: its values too
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 333, 64, generator=g) for h in (4, 2, 2))
    want = _reference(q, k, v, causal=True)
    plain = _reference(q, k, v, causal=True, dtype=torch.float32).double() - want
    assert (omp[0].double() - want).abs().max() <= 2 * plain.abs().max() + 1e-7


def test_concurrent_callers_get_their_own_answers():
    """Two Python threads calling the kernel at once (each the master of its own team)."""
    with pool("openmp"):
        g = torch.Generator().manual_seed(9)
        inputs = [
            tuple(torch.randn(1, 4, 400, 64, generator=g) for _ in range(3)) for _ in range(2)
        ]
        alone = [attention(*x, causal=True, backend="blockwise") for x in inputs]
        got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

        def work(n: int) -> None:
            for _ in range(20):
                got[n].append(attention(*inputs[n], causal=True, backend="blockwise"))

        workers = [threading.Thread(target=work, args=(n,)) for n in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    for n in range(2):
        assert len(got[n]) == 20 and all(torch.equal(o, alone[n]) for o in got[n])


# A child forked after the kernel's threads ran, two ways: on the kernel's own pool the
# child may run torch ops freely (the pool is the only one started, and the child makes a
# new one); on torch's OpenMP runtime it must not run a parallel torch op (torch's runtime
# hangs in a forked child), so its answer comes back as bytes through a pipe.
_FORK_SCRIPTS = {
    "own": """
import multiprocessing, sys, torch
from attnkit import attention

def child(q, k, v):
    return attention(q, k, v, causal=True, backend="blockwise")

if __name__ == "__main__":
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(36)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    want = attention(q, k, v, causal=True, backend="blockwise")  # the pool exists now
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply(child, (q, k, v))
    sys.exit(0 if torch.equal(got, want) else 3)
""",
    "openmp": """
import os, sys, torch
from attnkit import attention

torch.set_num_threads(2)
g = torch.Generator().manual_seed(36)
q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
want = attention(q, k, v, causal=True, backend="blockwise")  # torch's runtime started
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    out = attention(q, k, v, causal=True, backend="blockwise")
    os.write(write, out.numpy().tobytes())
    os._exit(0)
os.close(write)
data = b""
while chunk := os.read(read, 1 << 16):
    data += chunk
os.waitpid(pid, 0)
got = torch.frombuffer(bytearray(data), dtype=torch.float32).view(want.shape)
sys.exit(0 if torch.equal(got, want) else 3)
""",
}


@pytest.mark.parametrize("kind", list(_FORK_SCRIPTS))
def test_a_forked_child_computes_on_a_pool_of_its_own(isa, tmp_path, kind):
    """The parent's kernel calls ran on threads (the kernel's own pool, or torch's OpenMP
    runtime) that a forked child does not have: the child's calls run on a new pool of its
    own and give the parent's bits. In a fresh process: the test process's torch runtime
    has been used, so it cannot fork."""
    if kind == "openmp" and not OPENMP:
        pytest.skip("torch's CPU ops do not run on OpenMP here")
    script = tmp_path / "fork_child.py"
    script.write_text(_FORK_SCRIPTS[kind])
    env = {**os.environ, "ATTNKIT_NATIVE_ISA": isa, "ATTNKIT_NATIVE_SPEED": "fast",
           "ATTNKIT_NATIVE_THREADS": kind}  # fmt: skip
    run = subprocess.run([sys.executable, str(script)], env=env, timeout=120,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
