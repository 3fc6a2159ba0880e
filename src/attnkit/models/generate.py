"""Generation for real batches: left padding, per-row positions, eos, sampling.

A left-padded batch (``attention_mask`` 1 = token, 0 = pad) gives every row exactly
the tokens it gets alone (greedy): the model's mask hides the pads and each row's
positions start at its first real token. New tokens are written at the same time
index for every row, so the cache needs no per-row bookkeeping::

    time:        0   1   2   3   4 | 5   6        (prefill 0..4, then one step each)
    row 0:      pad pad  a   b   c | x   y        positions: -  -  0  1  2 | 3  4
    row 1:       d   e   f   g   h | z   eos      positions: 0  1  2  3  4 | 5  6
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnkit._validate import check_bool, check_float, check_int, check_optional_int
from attnkit.models.plan import check_idx

if TYPE_CHECKING:
    from attnkit.models.gpt import GPT

__all__ = ["generate", "sample"]

#: Half the smallest float32 subnormal: a temperature below it is 0 in float32 arithmetic.
_FLOAT32_TINY = 2.0**-150


def _check_prompt(model: GPT, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Check the prompt and its mask once: the decoding steps trust them (``GPT.step``)."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.long, torch.int):
        raise TypeError("idx must be an integer (long) tensor of token ids")
    if idx.dim() != 2 or idx.shape[1] == 0 or idx.shape[0] == 0:
        raise ValueError(f"idx must be a non-empty (batch, tokens) tensor, got {tuple(idx.shape)}")
    check_idx(model.layout(), idx)  # ids in the vocabulary
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_floating_point():
        raise TypeError("attention_mask must be a bool or integer tensor (1 = token, 0 = padding)")
    if attention_mask.shape != idx.shape:
        raise ValueError(
            f"attention_mask must have idx's shape {tuple(idx.shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool and not bool(
        ((attention_mask == 0) | (attention_mask == 1)).all()
    ):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    real = attention_mask.bool()
    if not bool(real[:, -1].all()):
        raise ValueError("attention_mask must be left-padded: every row must end with a token")
    if not bool((real[:, 1:] >= real[:, :-1]).all()):
        raise ValueError("attention_mask must be left-padded: zeros, then ones, in every row")


def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    streaming: tuple[int, int] | None = None,
    pack_weights: bool = True,
    page_size: int | None = None,
) -> torch.Tensor:
    """Append up to ``max_new_tokens`` tokens to every row of ``idx``.

    Args:
        model: the GPT.
        idx: prompts ``(b, t)``, left-padded when their lengths differ.
        max_new_tokens: tokens to add (0 returns the prompt).
        temperature: softmax temperature; 0 (default) is greedy (argmax). A positive one so
            small that the logits divided by it overflow (``1e-45``) is the limit
            ``temperature -> 0``: the most likely token (exact ties share the draw), as
            greedy; never an error. The logits are shifted by their maximum before the
            division (softmax is unchanged by the shift), so nothing overflows to NaN.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: nucleus sampling: among the most likely tokens whose probabilities add
            up to ``top_p`` (at least one).
        attention_mask: ``(b, t)`` 1 = token, 0 = padding (left padding only).
        eos_id: a row that emits it stops; its later columns are filled with ``eos_id``.
            Generation ends early when every row has stopped.
        use_cache: decode with KV caches (one token per step) instead of recomputing
            the whole sequence each step; same tokens.
        generator: random generator for sampling.
        streaming: ``(sink_tokens, window)``: StreamingLLM caches (see
            :meth:`GPT.setup_cache`), so generation may go past ``context_length``
            with bounded memory. Needs RoPE, ``use_cache`` and no padding.
        pack_weights: run the linear layers on oneDNN-prepacked weight copies
            (:meth:`GPT.pack_weights`: made on the first call and kept, as much memory
            as the weights; same tokens, ~2.7x faster decoding on CPU). False packs
            nothing (copies made earlier stay in use until
            :meth:`GPT.unpack_weights`).
        page_size: decode on a :class:`~attnkit.PagedKVCache` with pages of this many
            tokens (:meth:`GPT.setup_paged_cache`: every row a sequence of pages, read
            in place by the native kernel) instead of contiguous caches; same tokens.
            Needs ``use_cache`` and no ``streaming``.

    Returns:
        ``(b, t + n)`` token ids, ``n <= max_new_tokens`` (less only when every row hit
        ``eos_id``).

    Raises:
        TypeError / ValueError: naming the bad argument (``bool`` is not an int).
    """
    cfg = model.cfg
    _check_prompt(model, idx, attention_mask)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=0)
    temperature = check_float(temperature, "temperature", minimum=0.0)
    top_k = check_optional_int(top_k, "top_k", maximum=cfg.vocab_size)
    if top_p is not None:
        top_p = check_float(top_p, "top_p", minimum=0.0, maximum=1.0, min_inclusive=False)
    eos_id = check_optional_int(eos_id, "eos_id", minimum=0, maximum=cfg.vocab_size - 1)
    use_cache = check_bool(use_cache, "use_cache")
    pack_weights = check_bool(pack_weights, "pack_weights")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    page_size = check_optional_int(page_size, "page_size")
    if page_size is not None and (not use_cache or streaming is not None):
        raise ValueError("page_size (a paged cache) needs use_cache=True and no streaming")
    b, t0 = idx.shape
    total = t0 + max_new_tokens
    if streaming is not None:
        if not use_cache:
            raise ValueError("streaming needs use_cache=True")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("streaming takes no padding: generate rows of equal length")
        attention_mask = None
        if t0 > cfg.context_length:
            raise ValueError(f"prompt ({t0} tokens) exceeds context_length ({cfg.context_length})")
    elif total > cfg.context_length:
        raise ValueError(
            f"prompt ({t0} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"context_length ({cfg.context_length})"
        )
    mask = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        mask = torch.ones(b, total, dtype=torch.bool, device=idx.device)
        mask[:, :t0] = attention_mask.bool()
    was_training, old = model.training, (model.caches, model.streaming)
    model.eval()
    if pack_weights:
        model.pack_weights()
    try:
        paged = None
        if page_size is not None:  # every row a sequence with all its pages from the start
            pool = model.setup_paged_cache(b * -(-total // page_size), page_size)
            paged = pool.batch([pool.allocate(total) for _ in range(b)], [0] * b)
        elif use_cache:  # allocated outside inference mode: the cache may outlive this call
            model.setup_cache(b, None if streaming else total, streaming=streaming)
        times = torch.arange(total, device=idx.device)
        # inference_mode rather than no_grad: less bookkeeping per op, which is
        # what a batch-1 decode step mostly spends its non-matmul time on.
        with torch.inference_mode():
            columns = [idx]
            done = torch.zeros(b, 1, dtype=torch.bool, device=idx.device)
            step_input, end = idx, t0
            # Checked above, once: the prompt, its mask and the context bound; the new
            # tokens are the model's own. The steps trust them (no checks per token).
            for _ in range(max_new_tokens):
                if use_cache:
                    start = end - step_input.shape[1]
                    pos = times[start:end]
                    if paged is not None:
                        paged = dataclasses.replace(paged, starts=(start,) * b)
                    logits = model.step(step_input, pos, mask, paged=paged)
                else:
                    seq = torch.cat(columns, dim=1)
                    logits = model.step(seq, times[:end], None if mask is None else mask[:, :end])
                next_id = sample(logits[:, -1], temperature, top_k, top_p, generator)  # (b, 1)
                if eos_id is not None:
                    next_id = next_id.masked_fill(done, eos_id)
                    done = done | (next_id == eos_id)
                columns.append(next_id)
                step_input, end = next_id, end + 1
                if eos_id is not None and bool(done.all()):
                    break
            out = torch.cat(columns, dim=1)
    finally:
        if use_cache:
            model.caches, model.streaming = old
        model.train(was_training)
    return out.clone()  # a normal tensor: inference tensors cannot be saved for backward


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` ``(b, v)``: argmax at temperature 0.

    The logits are shifted by their row maximum before dividing by ``temperature``: the
    softmax is the same, and a tiny positive temperature (``1e-45``) sends every token
    but the most likely to ``-inf`` instead of overflowing to ``inf``/NaN (greedy, the
    limit ``temperature -> 0``); one that float32 rounds to 0 (``5e-324``) is argmax.
    """
    if temperature < _FLOAT32_TINY:  # 0, or a temperature float32 rounds to 0
        return logits.argmax(dim=-1, keepdim=True)  # (b, 1)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # <= 0: no overflow
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (b, v)
        probs = F.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        drop = before >= top_p  # the first token always stays
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)  # (b, 1)
