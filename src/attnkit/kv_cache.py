"""Key/value caches for autoregressive decoding.

Notation: b batch, h_kv key/value heads, t new tokens, L buffer length, d head_dim.

:class:`KVCache` preallocates static buffers ``(b, h_kv, L, d)`` and tracks the
number of tokens seen in a tensor (``pos``), so its shapes never change between
steps. In a full cache slot ``j`` holds position ``j``; in a sliding-window ring
every slot remembers the absolute position it holds (``slot_pos``, -1 = empty).
The attention mask is derived from those positions:

    full cache (L = max_seq_len)      sliding-window ring (L = window)
    slot:  0 1 2 3 4 5 . .            slot:  0 1 2      (window 3, pos 5)
    pos:   0 1 2 3 4 5 - -            pos:   3 4 5  <- position p lives in slot p % 3

A chunk of ``t`` new tokens (chunked prefill, or ``t = 1`` when decoding) is
written at positions ``pos .. pos + t - 1``; each new query may attend to every
cached position ``<=`` its own (and, with a window, ``> its own - window``).
:class:`CrossKVCache` holds encoder keys/values computed once.
"""

from __future__ import annotations

import torch
from torch import nn

from attnkit._validate import check_bool, check_int, check_optional_int

__all__ = ["CrossKVCache", "KVCache"]


class KVCache(nn.Module):
    """Static key/value buffers for one attention layer.

    Args:
        batch_size: sequences decoded together.
        max_seq_len: the most tokens the cache may ever see; writing past it raises.
        num_kv_heads: key/value heads (h_kv).
        head_dim: size of each head vector.
        window: sliding window: keep only the last ``window`` positions in a ring buffer.
        static: return the whole buffer plus a mask (shapes fixed, for
            ``torch.compile``) instead of slicing it to the tokens seen so far.
        dtype: buffer dtype.
        device: buffer device.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        static: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("max_seq_len", max_seq_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            check_int(value, name)
        check_optional_int(window, "window")
        check_bool(static, "static")
        self.max_seq_len, self.window, self.static = max_seq_len, window, static
        self.size = max_seq_len if window is None else min(window, max_seq_len)
        shape = (batch_size, num_kv_heads, self.size, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), False)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=device), False)
        if self.is_ring:  # a full cache needs none: its slot j holds position j
            self.register_buffer(
                "slot_pos", torch.full((self.size,), -1, dtype=torch.long, device=device), False
            )

    @property
    def is_ring(self) -> bool:
        """True when the buffer is smaller than ``max_seq_len`` and wraps around."""
        return self.size < self.max_seq_len

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept, nothing is reallocated)."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.pos.zero_()
        if self.is_ring:
            self.slot_pos.fill_(-1)

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def update(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append ``t`` new keys/values and return what the new queries attend to.

        Args:
            key: ``(b, h_kv, t, d)`` new keys (already rotated, with RoPE).
            value: ``(b, h_kv, t, d)`` new values.

        Returns:
            ``(keys, values, mask)``: keys/values ``(b, h_kv, s, d)``; ``mask``
            ``(t, s)`` bool (True = may attend), or None when the keys are exactly
            positions ``0 .. pos + t - 1`` and bottom-right causal masking is what is
            needed.

        Raises:
            ValueError: shapes that do not match the buffers, or writing past ``max_seq_len``.
        """
        k_cache, v_cache, pos = self.k_cache, self.v_cache, self.pos
        b, h, t, d = key.shape
        if value.shape != key.shape or (b, h, d) != (
            k_cache.shape[0],
            k_cache.shape[1],
            k_cache.shape[3],
        ):
            raise ValueError(
                f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the cache "
                f"buffers {tuple(k_cache.shape)} (batch, kv heads, length, head_dim)"
            )
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        if not torch.compiler.is_compiling():
            start = int(pos)
            if start + t > self.max_seq_len:
                raise ValueError(
                    f"KV cache overflow: writing {t} tokens at position {start} exceeds "
                    f"max_seq_len={self.max_seq_len}; call reset() or allocate a longer cache"
                )
            if not (self.static or self.is_ring):
                # Eager decoding: write and read plain slices (narrow: the cheapest
                # call per token); the keys are exactly positions 0 .. start + t - 1.
                k_cache.narrow(2, start, t).copy_(key)
                v_cache.narrow(2, start, t).copy_(value)
                pos.add_(t)
                return k_cache.narrow(2, 0, start + t), v_cache.narrow(2, 0, start + t), None
        positions = pos + torch.arange(t, device=key.device)  # (t,)
        if self.is_ring:
            # Old slots plus the new chunk, so a chunk longer than the window still
            # sees every key it needs; then keep the last `size` positions.
            keys = torch.cat((k_cache, key), dim=2)  # (b, h_kv, size + t, d)
            values = torch.cat((v_cache, value), dim=2)
            key_pos = torch.cat((self.slot_pos, positions))  # (size + t,)
            n = min(t, self.size)
            slots = positions[-n:] % self.size
            k_cache.index_copy_(2, slots, key[:, :, -n:])
            v_cache.index_copy_(2, slots, value[:, :, -n:])
            self.slot_pos.index_copy_(0, slots, positions[-n:])
            pos.add_(t)
            return keys, values, self._mask(positions, key_pos)
        # Static shapes (torch.compile): the whole buffer and a mask. Slot j holds
        # position j; slots not yet written lie after every new query, so `k <= q`
        # leaves them out.
        k_cache.index_copy_(2, positions, key)
        v_cache.index_copy_(2, positions, value)
        pos.add_(t)
        slots = torch.arange(self.size, device=key.device)  # (size,)
        return k_cache, v_cache, self._mask(positions, slots)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        q, k = q_pos[:, None], k_pos[None, :]  # (t, 1), (1, s)
        keep = (k >= 0) & (k <= q)  # (t, s); k = -1 marks an empty ring slot
        if self.window is not None:
            keep = keep & (q - k < self.window)
        return keep

    def extra_repr(self) -> str:
        return (
            f"shape={tuple(self.k_cache.shape)}, max_seq_len={self.max_seq_len}, "
            f"window={self.window}, static={self.static}"
        )


class CrossKVCache(nn.Module):
    """Encoder keys/values for cross-attention, computed on the first call and reused."""

    def __init__(self) -> None:
        super().__init__()
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    @property
    def filled(self) -> bool:
        """True once keys and values are stored."""
        return self.key is not None

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep ``key``/``value`` ``(b, h_kv, s, d)`` for the next calls."""
        self.key, self.value = key, value

    def reset(self) -> None:
        """Drop the stored keys/values (e.g. for a new encoder input)."""
        self.key = self.value = None
