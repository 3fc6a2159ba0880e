"""The implementations the attention benchmark compares, each built as a ``run()`` closure.

Two families:
    - kernels take ``(b, h, t, head_dim)`` query/key/value: attnkit's backends, torch
      SDPA (with ``is_causal`` or a dense bool mask) and FlexAttention (eager, compiled);
    - modules take ``x (b, t, d_model)``: attnkit ``MultiHeadAttention`` (auto),
      ``nn.MultiheadAttention`` (need_weights True/False), an SDPA-based MHA and the
      seed tutorial's hand-written MHA (explicit scores, mask, softmax, dropout off).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import attention
from attnkit import masks as M
from attnkit.bench.timing import Unsupported
from attnkit.modules import MultiHeadAttention

Runner = Callable[[], object]

KERNELS = [
    "attnkit-auto",
    "attnkit-blockwise",
    "attnkit-reference",
    "sdpa",
    "flex-eager",
    "flex-compiled",
]
MODULES = [
    "attnkit-mha",
    "nn.MHA(need_weights=False)",
    "nn.MHA(need_weights=True)",
    "sdpa-mha",
    "seed-mha",
]


def kernel_runner(
    name: str, *, b: int, h: int, t: int, d: int, dtype: torch.dtype, pattern: str, backward: bool
) -> Runner:
    """Return a closure running one forward (and backward) of kernel ``name``.

    ``pattern`` is ``"causal"``, ``"window256"`` or ``"alibi"`` (ALiBi + causal).
    """
    q, k, v = (torch.randn(b, h, t, d, dtype=dtype, requires_grad=backward) for _ in range(3))
    kwargs: dict = {"causal": True}
    fn: Callable[[], object]
    if pattern == "window256":
        kwargs["window"] = 256
    elif pattern == "alibi":
        kwargs["score_mod"] = M.alibi(h)
    if name.startswith("attnkit-"):
        backend = name.removeprefix("attnkit-")
        if backend == "reference" and pattern != "causal":  # a materialised mask / bias
            dense = _dense_bias(pattern, h, t, dtype)
            fn = lambda: attention(q, k, v, mask=dense, backend="reference")  # noqa: E731
        else:
            fn = lambda: attention(q, k, v, backend=backend, **kwargs)  # noqa: E731
    elif name == "sdpa":
        if pattern == "causal":
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        else:
            dense = _dense_bias(pattern, h, t, dtype)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
    elif name.startswith("flex-"):
        fn = _flex(q, k, v, pattern, compiled=name == "flex-compiled", backward=backward)
    else:
        raise ValueError(f"unknown kernel {name!r}; valid: {', '.join(KERNELS)}")
    return _with_backward(fn, backward)


def _dense_bias(pattern: str, h: int, t: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(t).view(-1, 1)
    j = torch.arange(t).view(1, -1)
    if pattern == "window256":
        return (j <= i) & (j > i - 256)  # (t, t) bool, True = attend
    slopes = M.alibi_slopes(h).to(dtype).view(h, 1, 1)
    bias = -slopes * (i - j).abs().to(dtype)  # (h, t, t)
    return bias.masked_fill(j > i, float("-inf"))


def _flex(q, k, v, pattern: str, *, compiled: bool, backward: bool) -> Runner:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as err:  # pragma: no cover
        raise Unsupported(f"FlexAttention unavailable: {err}") from err
    if backward and q.device.type == "cpu":
        raise Unsupported("FlexAttention has no backward on CPU")
    t = q.shape[-2]
    slopes = M.alibi_slopes(q.shape[1]).to(q.device)

    def causal(b, h, qi, ki):
        return ki <= qi

    def window(b, h, qi, ki):
        return (ki <= qi) & (ki > qi - 256)

    def alibi(score, b, h, qi, ki):
        return score - slopes[h] * (qi - ki).abs()

    block = create_block_mask(
        window if pattern == "window256" else causal, None, None, t, t, device=q.device.type
    )
    flex = torch.compile(flex_attention) if compiled else flex_attention
    score_mod = alibi if pattern == "alibi" else None

    def run():
        with warnings.catch_warnings():  # eager flex warns that it is unfused: measured as such
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex(q, k, v, score_mod=score_mod, block_mask=block)

    return run


def _with_backward(fn: Runner, backward: bool) -> Runner:
    if not backward:

        def run_no_grad():
            with torch.no_grad():
                return fn()

        return run_no_grad

    def run_backward():
        out = fn()
        out.sum().backward()
        return out

    return run_backward


class SeedMHA(nn.Module):
    """The seed tutorial's multi-head attention, written the way the tutorial writes it."""

    def __init__(self, d_in: int, d_out: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, d_out) -> (b, h, t, head_dim)
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(2, 3)  # (b, h, t, t)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        weights = torch.softmax(scores / math.sqrt(self.head_dim), dim=-1)
        context = (weights @ v).transpose(1, 2).reshape(b, t, -1)  # (b, t, d_out)
        return self.out_proj(context)


class SdpaMHA(SeedMHA):
    """The same module with the attention step replaced by torch SDPA (is_causal)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, head_dim)
        return self.out_proj(context.transpose(1, 2).reshape(b, t, -1))


def module_runner(
    name: str, *, b: int, t: int, d_model: int, num_heads: int, dtype: torch.dtype, backward: bool
) -> Runner:
    """Return a closure running causal self-attention with module ``name`` on ``(b, t, d_model)``."""
    x = torch.randn(b, t, d_model, dtype=dtype, requires_grad=backward)
    mod: nn.Module
    if name == "attnkit-mha":
        mod = MultiHeadAttention(d_model, d_model, t, 0.0, num_heads).to(dtype)
        fn = lambda: mod(x)  # noqa: E731
    elif name.startswith("nn.MHA"):
        mod = nn.MultiheadAttention(d_model, num_heads, batch_first=True, bias=False).to(dtype)
        need = name.endswith("True)")
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)  # True = masked out (nn's polarity)
        fn = lambda: mod(x, x, x, attn_mask=causal, need_weights=need, is_causal=True)[0]  # noqa: E731
    elif name in ("sdpa-mha", "seed-mha"):
        mod = (SdpaMHA if name == "sdpa-mha" else SeedMHA)(d_model, d_model, num_heads).to(dtype)
        fn = lambda: mod(x)  # noqa: E731
    else:
        raise ValueError(f"unknown module {name!r}; valid: {', '.join(MODULES)}")
    mod.train(backward)
    return _with_backward(fn, backward)
