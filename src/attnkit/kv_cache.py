"""Key/value caches for autoregressive decoding: buffers that keep no position.

Notation: b batch, h_kv key/value heads, t new tokens, L buffer length, d head_dim.

:class:`KVCache` preallocates ``(b, h_kv, L, d)`` buffers. It keeps **no counter**:
the caller (the model) says where the new tokens go with ``update(input_pos, k, v)``,
``input_pos`` being the ``(t,)`` time indices of the new tokens (the same for every
row of the batch; a left-padded row simply holds padding in its first slots, which
the model's mask hides). Which time index each returned key holds is a pure function
of ``input_pos`` and the cache's geometry (:meth:`KVCache.key_positions`), so the
model builds the mask without reading anything back::

    full cache (L = max_seq_len)      ring (window 3)            StreamingLLM (2 sinks + window 3)
    slot:  0 1 2 3 4 5 . .            slot:  0 1 2               slot:  0 1 | 2 3 4
    time:  0 1 2 3 4 5 - -            time:  3 4 5 (after 6)     time:  0 1 | 6 7 5 (after 8)
                                      time p lives in p % 3      time p >= 2 lives in 2 + (p - 2) % 3

A ring or a StreamingLLM cache holds the last positions *written*: rewinding
``input_pos`` is only meaningful for a full cache. A chunk of ``t > 1`` tokens
(chunked prefill) written to a ring returns the old slots followed by the chunk, so a
chunk longer than the window still sees every key it needs.
"""

from __future__ import annotations

import torch
from torch import nn

from attnkit import _memory
from attnkit._validate import (
    check_bool,
    check_float_dtype,
    check_int,
    check_optional_int,
    check_positions,
    check_window,
)

__all__ = ["KVCache"]


class KVCache(nn.Module):
    """Static key/value buffers for one attention layer.

    Args:
        batch_size: sequences decoded together.
        max_seq_len: the most time indices the cache serves (writing past it raises);
            None = unbounded, allowed for a ring (``window`` set).
        num_kv_heads: key/value heads (h_kv).
        head_dim: size of each key vector.
        window: keep only the last ``window`` positions (a ring buffer).
        sink_tokens: with ``window``, also keep the first ``sink_tokens`` positions
            for ever (StreamingLLM's attention sinks).
        value_dim: size of each value vector (default ``head_dim``); 0 = keys only
            (multi-head latent attention caches one latent per token).
        static: return the whole buffer (fixed shapes, for ``torch.compile``) instead
            of slicing a full cache to the tokens written so far.
        dtype: buffer dtype.
        device: buffer device.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor | None

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int | None,
        num_kv_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        sink_tokens: int = 0,
        value_dim: int | None = None,
        static: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_int(batch_size, "batch_size")
        check_int(num_kv_heads, "num_kv_heads")
        check_int(head_dim, "head_dim")
        window = check_window(window)
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", minimum=0)
        self.static = check_bool(static, "static")
        dtype = check_float_dtype(dtype, "dtype")
        if max_seq_len is None and window is None:
            raise ValueError("max_seq_len may be None only for a ring buffer (window set)")
        self.max_seq_len = check_optional_int(max_seq_len, "max_seq_len")
        if self.sink_tokens and window is None:
            raise ValueError("sink_tokens needs a window (StreamingLLM: sinks + the last window)")
        value_dim = head_dim if value_dim is None else check_int(value_dim, "value_dim", minimum=0)
        ring = window is not None and (
            self.max_seq_len is None or self.sink_tokens + window < self.max_seq_len
        )
        self.window = window if ring else None  # a window as long as the cache is no ring
        self.size = self.sink_tokens + window if ring and window else int(self.max_seq_len or 0)
        shape = (batch_size, num_kv_heads, self.size, head_dim)
        # (large CPU buffers in transparent huge pages: attnkit._memory)
        self.register_buffer("k_cache", _memory.zeros(shape, dtype=dtype, device=device), False)
        v_shape = (*shape[:-1], value_dim)
        v_cache = _memory.zeros(v_shape, dtype=dtype, device=device) if value_dim else None
        self.register_buffer("v_cache", v_cache, False)

    @property
    def is_ring(self) -> bool:
        """True when the buffer wraps around (a window shorter than ``max_seq_len``)."""
        return self.window is not None

    def reset(self) -> None:
        """Zero the buffers (nothing is reallocated; the cache holds no position anyway)."""
        self.k_cache.zero_()
        if self.v_cache is not None:
            self.v_cache.zero_()

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        n = self.k_cache.numel() + (0 if self.v_cache is None else self.v_cache.numel())
        return n * self.k_cache.element_size()

    # -- geometry: which time index lives where (pure functions of input_pos) -----------
    def _slots(self, times: torch.Tensor) -> torch.Tensor:
        """The slot of each time index."""
        if self.window is None:
            return times
        n = self.sink_tokens
        return torch.where(times < n, times, n + torch.remainder(times - n, self.window))

    def _slot_times(self, end: torch.Tensor) -> torch.Tensor:
        """``(size,)``: the time index each slot holds once times ``0 .. end - 1`` are written
        (-1 = empty)."""
        device = self.k_cache.device
        slots = torch.arange(self.size, device=device)
        if self.window is None:
            return slots
        n, w = self.sink_tokens, self.window
        sink = torch.where(slots < end, slots, -1)
        m = end - n  # non-sink times written
        rel = (m - 1) - torch.remainder(m - 1 - (slots - n), w)  # latest such time, relative
        ring = torch.where(rel >= 0, n + rel, -1)
        return torch.where(slots < n, sink, ring)

    def key_positions(self, input_pos: torch.Tensor) -> torch.Tensor:
        """``(s,)``: the time index of every key :meth:`update` returns for ``input_pos``
        (-1 marks an empty slot)."""
        t = check_positions(input_pos, "input_pos").shape[0]
        if self.window is None:
            if self.static:  # the whole buffer; slots not written yet are empty (-1)
                slots = torch.arange(self.size, device=input_pos.device)
                return torch.where(slots <= input_pos[-1], slots, -1)
            return torch.arange(int(input_pos[-1]) + 1, device=input_pos.device)
        if t == 1:
            return self._slot_times(input_pos[-1] + 1)
        return torch.cat((self._slot_times(input_pos[0]), input_pos))

    # -- writing --------------------------------------------------------------------------
    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write ``t`` new keys/values at the time indices ``input_pos`` and return the keys
        and values the new queries attend to (see :meth:`key_positions` for their times).

        Args:
            input_pos: ``(t,)`` consecutive time indices of the new tokens.
            k: ``(b, h_kv, t, d)`` new keys.
            v: ``(b, h_kv, t, d_v)`` new values (None for a keys-only cache).

        Returns:
            ``(keys, values)``, ``(b, h_kv, s, d)`` and ``(b, h_kv, s, d_v)`` (values None
            for a keys-only cache).

        Raises:
            TypeError: ``input_pos`` not an integer tensor.
            ValueError: shapes that do not fit the buffers, a negative time index, or
                writing past ``max_seq_len``.
        """
        k_cache, v_cache = self.k_cache, self.v_cache
        check_positions(input_pos, "input_pos")
        for name, x in (("k", k), ("v", v)):
            if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 4):
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be (batch, kv heads, tokens, head_dim), got {shape}")
        b, h, t, d = k.shape
        if (b, h, d) != (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) or (
            (v is None) != (v_cache is None)
            or (v is not None and v.shape[:-1] != k.shape[:-1])
            or (v is not None and v_cache is not None and v.shape[-1] != v_cache.shape[-1])
        ):
            raise ValueError(
                f"k {tuple(k.shape)} / v {None if v is None else tuple(v.shape)} do not fit the "
                f"cache buffers {tuple(k_cache.shape)} (batch, kv heads, length, head_dim)"
            )
        if input_pos.shape != (t,):
            raise ValueError(f"input_pos must have shape ({t},), got {tuple(input_pos.shape)}")
        k = k.to(k_cache.dtype)
        v = None if v is None else v.to(k_cache.dtype)
        eager = not torch.compiler.is_compiling()
        start = int(input_pos[0]) if eager else 0  # input_pos is consecutive: one read
        if start < 0:
            raise ValueError(f"input_pos must hold time indices >= 0, got {input_pos.tolist()}")
        if eager and self.max_seq_len is not None and start + t > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: writing time index {start + t - 1} exceeds max_seq_len="
                f"{self.max_seq_len}; allocate a longer cache"
            )
        if self.window is None:
            if not self.static and eager:
                # Eager decoding: plain slices (narrow: the cheapest call per token).
                k_cache.narrow(2, start, t).copy_(k)
                keys = k_cache.narrow(2, 0, start + t)
                if v is None or v_cache is None:
                    return keys, None
                v_cache.narrow(2, start, t).copy_(v)
                return keys, v_cache.narrow(2, 0, start + t)
            k_cache.index_copy_(2, input_pos, k)
            if v is not None and v_cache is not None:
                v_cache.index_copy_(2, input_pos, v)
            return k_cache, v_cache
        if t == 1:  # decoding: write the slot, attend to the buffer
            slot = self._slots(input_pos)
            k_cache.index_copy_(2, slot, k)
            if v is not None and v_cache is not None:
                v_cache.index_copy_(2, slot, v)
            return k_cache, v_cache
        # A chunk: the old slots plus the chunk, then keep what the ring can hold.
        keys = torch.cat((k_cache, k), dim=2)  # (b, h_kv, size + t, d)
        values = None if v is None or v_cache is None else torch.cat((v_cache, v), dim=2)
        end = input_pos[-1] + 1
        keep = (input_pos < self.sink_tokens) | (input_pos >= end - self.window)
        idx = keep.nonzero().squeeze(1)  # the sinks and the last `window` times of the chunk
        slots = self._slots(input_pos[idx])
        k_cache.index_copy_(2, slots, k.index_select(2, idx))
        if v is not None and v_cache is not None:
            v_cache.index_copy_(2, slots, v.index_select(2, idx))
        return keys, values

    def extra_repr(self) -> str:
        return (
            f"shape={tuple(self.k_cache.shape)}, max_seq_len={self.max_seq_len}, "
            f"window={self.window}, sink_tokens={self.sink_tokens}, static={self.static}"
        )
