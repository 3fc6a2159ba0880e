"""torch.compile(fullgraph=True): attnkit's modules and core trace as one graph, per backend.

Graphs are counted with dynamo's ``CompileCounter`` backend (no inductor code generation,
so these stay fast); ``fullgraph=True`` turns any graph break into an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

import attnkit
from attnkit.models import GPT, GPTConfig
from tests.conftest import TOL
from tests.reference import ref_attention

if TYPE_CHECKING:
    from torch._dynamo.testing import CompileCounter


def _counter() -> CompileCounter:
    """A fresh dynamo ``CompileCounter``, imported when a test runs: importing dynamo takes
    about 2 s, which every xdist worker paid while collecting this module."""
    from torch._dynamo.testing import CompileCounter

    return CompileCounter()


# Adding a backend to the compile guarantees is one entry here (e.g. "blockwise").
BACKENDS = ["reference", "sdpa", "blockwise"]

D_IN, D_OUT, CONTEXT_LENGTH = 6, 8, 12


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


MODULES: dict[str, Callable[[str], torch.nn.Module]] = {
    "SelfAttentionV1": lambda b: attnkit.SelfAttentionV1(D_IN, D_OUT, backend=b),
    "SelfAttentionV2": lambda b: attnkit.SelfAttentionV2(D_IN, D_OUT, backend=b),
    "CausalAttention": lambda b: attnkit.CausalAttention(
        D_IN, D_OUT, CONTEXT_LENGTH, 0.0, backend=b
    ),
    "MultiHeadAttentionWrapper": lambda b: attnkit.MultiHeadAttentionWrapper(
        D_IN, D_OUT, CONTEXT_LENGTH, 0.0, num_heads=2, backend=b
    ),
    "MultiHeadAttention": lambda b: attnkit.MultiHeadAttention(
        D_IN, D_OUT, CONTEXT_LENGTH, 0.0, num_heads=2, backend=b
    ),
}


def _compile(fn: Callable) -> tuple[Callable, CompileCounter]:
    counter = _counter()
    return torch.compile(fn, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODULES))
def test_module_compiles_to_one_graph(name: str, backend: str) -> None:
    module = MODULES[name](backend).eval()
    compiled, counter = _compile(module)
    x = torch.randn(2, 7, D_IN)  # (b, t, d_in)
    out = compiled(x)
    compiled(torch.randn(2, 7, D_IN))  # same shapes: no recompilation
    assert counter.frame_count == 1
    assert counter.op_count > 0
    torch.testing.assert_close(out, module(x), **TOL[torch.float32])


def test_simplified_self_attention_compiles() -> None:
    module = attnkit.SimplifiedSelfAttention()
    compiled, counter = _compile(module)
    x = torch.randn(6, 3)
    torch.testing.assert_close(compiled(x), module(x), **TOL[torch.float32])
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_mask_window_gqa_compiles(backend: str) -> None:
    """Regression: the sdpa backend branched on ``bool(dead.any())`` and broke the graph."""

    def fn(q, k, v, mask):
        return attnkit.attention(q, k, v, mask=mask, causal=True, window=4, backend=backend)

    compiled, counter = _compile(fn)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)  # (b, h_q, t, d)
    k = torch.randn(2, 2, 9, 8, dtype=torch.float64)  # (b, h_kv, s, d)
    v = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 9) > 0.3
    mask[0, 0, 0] = False  # one fully masked row: zeros, not NaN
    out = compiled(q, k, v, mask)
    assert counter.frame_count == 1
    i = torch.arange(5)[:, None] + 4  # bottom-right aligned query positions
    j = torch.arange(9)[None, :]
    keep = mask & (j <= i) & (j > i - 4)
    expected, _ = ref_attention(q, k, v, mask=keep)
    torch.testing.assert_close(out, expected, **TOL[torch.float64])
    assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))


def test_blockwise_band_layout_compiles_to_one_graph() -> None:
    """The fused engine's mask-free layouts branch on data; compiled, the general path
    runs instead, in one graph, with the eager answer."""

    def fn(q, k, v):
        return attnkit.attention(q, k, v, causal=True, window=16, backend="blockwise")

    compiled, counter = _compile(fn)
    q, k, v = (torch.randn(1, 2, 160, 8) for _ in range(3))  # long enough for the band
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), **TOL[torch.float32])
    assert counter.frame_count == 1


def test_a_score_mod_compiles_with_graph_breaks() -> None:
    """A score mod is probed with data-dependent Python: compiled, it breaks the graph (no
    fullgraph) and still gives the eager answer."""

    def fn(q, k, v):
        return attnkit.attention(
            q, k, v, backend="blockwise", causal=True, score_mod=attnkit.masks.alibi(2)
        )

    counter = _counter()
    compiled = torch.compile(fn, backend=counter)
    q, k, v = (torch.randn(1, 2, 160, 8) for _ in range(3))
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), **TOL[torch.float32])
    assert counter.frame_count >= 1


@pytest.mark.parametrize("backend", ["blockwise", "auto"])
@pytest.mark.parametrize("kind", ["mask_mod", "block_mask"])
def test_a_block_mask_call_compiles_with_inductor(kind: str, backend: str) -> None:
    """A block mask's tiles are data: under torch.compile (inductor, the default) the call
    runs eagerly behind one graph break. Traced, its branches broke the graph dozens of
    times and inductor failed on the fragments (an IndexError, a C++ compile error)."""

    def mod(b, h, q, kv):
        return (kv <= q) & (q - kv < 100)

    t = 1100  # auto goes to blockwise from 1024 keys
    kwargs = dict(mask_mod=mod) if kind == "mask_mod" else dict(
        block_mask=attnkit.create_block_mask(mod, None, None, t, t)
    )  # fmt: skip

    def fn(q, k, v):
        return attnkit.attention(q, k, v, backend=backend, **kwargs)

    q, k, v = (torch.randn(1, 2, t, 8, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, t, 8)
    compiled = torch.compile(fn)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    eager = fn(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v), g)
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    ref, _ = ref_attention(*(x.detach() for x in (q, k, v)), mask=mod(0, 0, i, j))
    assert torch.equal(out, eager)
    for a, b in zip(grads, eager_grads, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_dropout_in_training_compiles() -> None:
    module = attnkit.MultiHeadAttention(D_IN, D_OUT, CONTEXT_LENGTH, 0.1, num_heads=2).train()
    compiled, counter = _compile(module)
    out = compiled(torch.randn(2, 7, D_IN))
    assert counter.frame_count == 1
    assert out.shape == (2, 7, D_OUT) and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_kv_cache_decode_compiles_once(backend: str) -> None:
    """A preallocated cache and a tensor position: one graph for every decoded token.

    Also a regression test: the sdpa backend failed on the 1-D ``(l_k,)`` mask used here.
    """
    b, h_q, h_kv, max_len, d, steps = 2, 4, 2, 16, 8, 10
    k_cache = torch.zeros(b, h_kv, max_len, d)  # (b, h_kv, max_len, d)
    v_cache = torch.zeros(b, h_kv, max_len, d)

    def decode_step(q, k_new, v_new, pos):
        k_cache.index_copy_(2, pos.view(1), k_new)  # write slot `pos`
        v_cache.index_copy_(2, pos.view(1), v_new)
        keep = torch.arange(max_len) <= pos  # (max_len,): the filled slots
        return attnkit.attention(q, k_cache, v_cache, mask=keep, backend=backend)

    compiled, counter = _compile(decode_step)
    q_all = torch.randn(b, h_q, steps, d)
    k_all = torch.randn(b, h_kv, steps, d)
    v_all = torch.randn(b, h_kv, steps, d)
    outs = [
        compiled(
            q_all[:, :, i : i + 1], k_all[:, :, i : i + 1], v_all[:, :, i : i + 1], torch.tensor(i)
        )
        for i in range(steps)
    ]
    assert counter.frame_count == 1  # compiled once, not once per token
    # Token-by-token decoding equals causal attention over the whole sequence.
    expected, _ = ref_attention(q_all, k_all, v_all, causal="bottom_right")
    torch.testing.assert_close(torch.cat(outs, dim=2), expected.float(), **TOL[torch.float32])


def _tiny_gpt(backend: str, **overrides) -> GPT:
    cfg = GPTConfig(
        vocab_size=40, context_length=24, emb_dim=16, n_layers=2, n_heads=4, attn_backend=backend
    )
    return GPT(GPTConfig.from_dict({**cfg.to_dict(), **overrides})).eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_forward_compiles_to_one_graph(backend: str) -> None:
    """Regression: ``int(idx.min())`` id validation in ``GPT.forward`` broke the graph."""
    model = _tiny_gpt(backend)
    assert all(block.att.backend == backend for block in model.trf_blocks)
    compiled, counter = _compile(model)
    idx = torch.randint(0, 40, (2, 9))  # (b, t)
    with torch.no_grad():
        out = compiled(idx)
        compiled(torch.randint(0, 40, (2, 9)))  # same shapes: no recompilation
        expected = model(idx)
    assert counter.frame_count == 1
    assert counter.op_count > 0
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize(
    "variant", [{}, {"rope": True}, {"n_kv_heads": 2, "window": 4, "global_every": 2}]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_static_cache_decode_compiles_once(backend: str, variant: dict) -> None:
    """Eager prefill, then a compiled one-token step: one graph for every decoded token.

    The time index is a tensor (``input_pos``), not a Python int that dynamo would
    specialise on and recompile for at every token; a padded batch's mask is data too.
    """
    model = _tiny_gpt(backend, **variant)
    b, prompt_len, steps = 2, 5, 12
    tokens = torch.randint(0, 40, (b, prompt_len + steps))  # (b, t)
    mask = torch.ones(b, prompt_len + steps, dtype=torch.long)
    mask[1, :2] = 0  # row 1 is left-padded by two

    def decode(step: Callable[..., torch.Tensor]) -> torch.Tensor:
        model.setup_cache(b, prompt_len + steps, static=True)
        pos = torch.arange(prompt_len)
        logits = [model(tokens[:, :prompt_len], attention_mask=mask, input_pos=pos)]  # eager
        for i in range(prompt_len, prompt_len + steps):
            pos = torch.tensor([i])
            logits.append(step(tokens[:, i : i + 1], attention_mask=mask, input_pos=pos))
        model.delete_cache()
        return torch.cat(logits, dim=1)  # (b, t, v)

    compiled, counter = _compile(model)
    with torch.no_grad():
        compiled_logits = decode(compiled)
        eager_logits = decode(model)
        full = model(tokens, attention_mask=mask)  # uncached forward over the whole sequence
    assert counter.frame_count == 1  # compiled once, not once per token
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_logits[:, 2:], full[:, 2:], atol=1e-5, rtol=1e-5)


def test_gpt_config_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match="nope"):
        _tiny_gpt("nope")
