"""A paged key/value cache: one pool of fixed-size pages, a page table per sequence.

Notation: P pages, n layers, h_kv key/value heads, p page_size, d head_dim, d_v value_dim.

:class:`PagedKVCache` holds every layer's keys and values in one pool of pages,
``(n, P, h_kv, p, d)`` (values ``(n, P, h_kv, p, d_v)``); a page id names the same page
in every layer. A sequence is a list of page ids (its *page table*): time index ``j``
of the sequence lives in row ``j % p`` of page ``table[j // p]``::

    pool:   page 0   page 1   page 2   page 3   page 4   ...       (p = 4 tokens a page)
    seq A:  [3, 0, 4]    times 0-3 in page 3, 4-7 in page 0, 8-9 in page 4
    seq B:  [3, 0, 1]    a fork of A after 8 tokens: pages 3 and 0 shared (refcount 2),
                         its own page 1 for times 8..; a shared page written to is
                         copied first (copy-on-write)

Sequences are allocated, grown (:meth:`~PagedKVCache.reserve`), forked (beam search,
prefix sharing) and freed; pages are reference-counted and come back to the pool when
no sequence holds them. The cache keeps no position: the caller (the model, the server)
says which time indices it writes, and how many keys each sequence attends to; the
cache stores and returns (the house rule of :mod:`attnkit.kv_cache`).

Attention reads keys and values through the page tables
(:func:`attnkit.paged_attention.paged_attention`): attnkit's native kernel reads the
pages in place; elsewhere the pages are gathered (:meth:`PagedKVCache.gather`) and
:func:`attnkit.attention` runs on the contiguous copy, with the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnkit import _memory
from attnkit._validate import check_float_dtype, check_int, check_positions

__all__ = ["PackedLayout", "PagedBatch", "PagedKVCache", "PagedLayer"]


@dataclass(frozen=True)
class PagedBatch:
    """One forward's sequences on a :class:`PagedKVCache`, handed down by the caller
    (built by :meth:`PagedKVCache.batch` after :meth:`PagedKVCache.reserve`).

    Attributes:
        seq_ids: the sequences, in batch order.
        page_table: int64 ``(len(seq_ids), max_pages)``, each row a sequence's pages
            (padded with page 0, never read past a sequence's keys).
        starts: the time index of each sequence's first new token.
        counts: new tokens per sequence when the forward packs them into one row
            (``idx`` ``(1, sum(counts))``, sequence after sequence); None when ``idx`` is
            ``(len(seq_ids), t)``, row ``i`` the new tokens of sequence ``i`` (all
            starting at ``starts[0]``).
        packed: with ``counts``, where the packed tokens go, computed once by
            :meth:`PagedKVCache.batch` and read by every layer (:class:`PackedLayout`).
    """

    seq_ids: tuple[int, ...]
    page_table: torch.Tensor
    starts: tuple[int, ...]
    counts: tuple[int, ...] | None = None
    packed: PackedLayout | None = None

    def ends(self, t: int) -> tuple[int, ...]:
        """Keys each sequence attends to once this forward's ``t`` tokens (a ``(b, t)``
        batch) or its ``counts`` are written."""
        if self.counts is None:
            return tuple(s + t for s in self.starts)
        return tuple(s + c for s, c in zip(self.starts, self.counts, strict=True))

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(sum(counts),)`` the time index of every packed token (``counts`` set)."""
        if self.counts is None:
            raise ValueError("positions() is for a packed batch (counts set)")
        if self.packed is not None:
            return self.packed.positions.to(device)
        return torch.cat(
            [
                torch.arange(s, s + c, device=device)
                for s, c in zip(self.starts, self.counts, strict=True)
            ]
        )


@dataclass(frozen=True)
class PackedLayout:
    """Where the tokens of a packed :class:`PagedBatch` go, computed once a forward.

    Attributes:
        positions: ``(N,)`` the time index of every packed token.
        pages: ``(N,)`` the page each token's key and value are written to.
        rows: ``(N,)`` their row in that page.
        offsets: where each sequence's tokens start in the packed row (and ``N`` last).
        decode: the sequences with one new token (decoding), by index.
        decode_rows: ``(len(decode),)`` their tokens' places in the packed row.
        decode_table: ``(len(decode), max_pages)`` their page tables.
        decode_lens: the keys each of them attends to.
    """

    positions: torch.Tensor
    pages: torch.Tensor
    rows: torch.Tensor
    offsets: tuple[int, ...]
    decode: tuple[int, ...]
    decode_rows: torch.Tensor
    decode_table: torch.Tensor
    decode_lens: tuple[int, ...]

    @staticmethod
    def of(page_table: torch.Tensor, starts, counts, page_size: int) -> PackedLayout:
        """The layout of sequences with pages ``page_table`` ``(n, max_pages)`` writing
        ``counts[i]`` tokens from time index ``starts[i]``."""
        device = page_table.device
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        positions = torch.cat(
            [torch.arange(s, s + c, device=device) for s, c in zip(starts, counts, strict=True)]
        )
        owner = torch.repeat_interleave(
            torch.arange(len(counts), device=device), torch.tensor(counts, device=device)
        )  # (N,) the sequence of every packed token
        pages = page_table[owner].gather(1, (positions // page_size)[:, None])[:, 0]
        decode = tuple(i for i, c in enumerate(counts) if c == 1)
        index = torch.tensor(decode, dtype=torch.int64, device=device)
        return PackedLayout(
            positions,
            pages,
            positions % page_size,
            tuple(offsets),
            decode,
            torch.tensor([offsets[i] for i in decode], dtype=torch.int64, device=device),
            page_table[index],
            tuple(starts[i] + 1 for i in decode),
        )


class PagedKVCache(nn.Module):
    """A pool of key/value pages shared by many sequences (see the module docs).

    Args:
        num_pages: pages in the pool (P).
        page_size: tokens per page (p).
        num_kv_heads: key/value heads (h_kv).
        head_dim: size of each key vector (d).
        num_layers: layers sharing the pool (a page id holds that page in every layer).
        value_dim: size of each value vector (default ``head_dim``).
        dtype: pool dtype.
        device: pool device.

    Example:
        >>> cache = PagedKVCache(8, 4, num_kv_heads=2, head_dim=16)
        >>> seq = cache.allocate()
        >>> cache.reserve(seq, 0, 6)  # room for time indices 0..5: two pages
        >>> len(cache.pages_of(seq)), cache.num_free_pages
        (2, 6)
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_layers: int = 1,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_pages = check_int(num_pages, "num_pages")
        self.page_size = check_int(page_size, "page_size")
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads")
        self.head_dim = check_int(head_dim, "head_dim")
        self.num_layers = check_int(num_layers, "num_layers")
        self.value_dim = head_dim if value_dim is None else check_int(value_dim, "value_dim")
        dtype = check_float_dtype(dtype, "dtype")
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        # (large CPU pools in transparent huge pages: a page table's reads hop across the
        # pool, each 4 KiB piece a page walk on ordinary pages; see attnkit._memory)
        self.register_buffer("k_pages", _memory.zeros(shape, dtype=dtype, device=device), False)
        v_shape = (*shape[:-1], self.value_dim)
        self.register_buffer("v_pages", _memory.zeros(v_shape, dtype=dtype, device=device), False)
        self._refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._tables: dict[int, list[int]] = {}
        self._next_id = 0

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> tuple[int, ...]:
        """The ids of the sequences allocated and not freed."""
        return tuple(self._tables)

    def pages_of(self, seq: int) -> tuple[int, ...]:
        """The page table of sequence ``seq``: its page ids in order."""
        return tuple(self._table(seq))

    def refcount(self, page: int) -> int:
        """How many sequences hold page ``page``."""
        check_int(page, "page", minimum=0, maximum=self.num_pages - 1)
        return self._refcount[page]

    def capacity(self, seq: int) -> int:
        """Time indices sequence ``seq`` has pages for."""
        return len(self._table(seq)) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` time indices take."""
        return -(-check_int(num_tokens, "num_tokens", minimum=0) // self.page_size)

    def nbytes(self) -> int:
        """Bytes held by the key and value pools."""
        return (self.k_pages.numel() + self.v_pages.numel()) * self.k_pages.element_size()

    def _table(self, seq: int) -> list[int]:
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int sequence id, got {type(seq).__name__} ({seq!r})")
        table = self._tables.get(seq)
        if table is None:
            raise ValueError(
                f"seq {seq} is not a sequence of this cache (freed, or never allocated)"
            )
        return table

    def _take(self, n: int, why: str) -> list[int]:
        if n > len(self._free):
            raise MemoryError(
                f"PagedKVCache out of pages: {why} needs {n} more page(s) of {self.page_size} "
                f"tokens, {len(self._free)} of {self.num_pages} free; free finished sequences "
                "or make a cache with more pages"
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def _release(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._free.append(page)

    # -- sequences ------------------------------------------------------------------------
    def allocate(self, num_tokens: int = 0) -> int:
        """A new sequence with pages for ``num_tokens`` time indices; returns its id.

        Raises:
            MemoryError: not enough free pages (nothing is allocated then).
        """
        pages = self._take(self.pages_needed(num_tokens), f"a sequence of {num_tokens} tokens")
        seq = self._next_id
        self._next_id += 1
        self._tables[seq] = pages
        return seq

    def reserve(self, seq: int, start: int, end: int) -> None:
        """Make sequence ``seq`` ready to write time indices ``[start, end)``: pages up to
        ``end``, and its own copy of any shared page among those holding them
        (copy-on-write, every layer at once). Call before a forward writes them: the page
        table a forward reads must not change under it.

        Raises:
            ValueError: ``start > end`` or negative.
            MemoryError: not enough free pages (nothing changes then).
        """
        table = self._table(seq)
        start = check_int(start, "start", minimum=0)
        end = check_int(end, "end", minimum=start)
        grow = max(0, self.pages_needed(end) - len(table))
        first = start // self.page_size
        shared = [
            i
            for i in range(first, min(len(table), self.pages_needed(end)))
            if self._refcount[table[i]] > 1
        ]
        new = self._take(grow + len(shared), f"sequence {seq} up to {end} tokens")
        for i, page in zip(shared, new[: len(shared)], strict=True):
            self.k_pages[:, page] = self.k_pages[:, table[i]]
            self.v_pages[:, page] = self.v_pages[:, table[i]]
            self._release(table[i])
            table[i] = page
        table.extend(new[len(shared) :])

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of ``seq``'s pages (beam search, a shared prefix);
        returns its id. A shared page is copied when either sequence next writes to it
        (:meth:`reserve`), so the two go their own ways from there."""
        table = self._table(seq)
        for p in table:
            self._refcount[p] += 1
        child = self._next_id
        self._next_id += 1
        self._tables[child] = list(table)
        return child

    def free(self, seq: int) -> None:
        """Drop sequence ``seq``; its pages return to the pool when no other holds them."""
        for p in self._table(seq):
            self._release(p)
        del self._tables[seq]

    def truncate(self, seq: int, num_tokens: int) -> None:
        """Keep only the pages holding ``seq``'s first ``num_tokens`` time indices."""
        table = self._table(seq)
        keep = self.pages_needed(num_tokens)
        for p in table[keep:]:
            self._release(p)
        del table[keep:]

    def reset(self) -> None:
        """Free every sequence and zero the pools."""
        for seq in list(self._tables):
            self.free(seq)
        self.k_pages.zero_()
        self.v_pages.zero_()

    # -- reading and writing --------------------------------------------------------------
    def batch(
        self,
        seq_ids: list[int] | tuple[int, ...],
        starts: list[int] | tuple[int, ...],
        counts: list[int] | tuple[int, ...] | None = None,
    ) -> PagedBatch:
        """The :class:`PagedBatch` of one forward over ``seq_ids`` (after :meth:`reserve`)."""
        seq_ids = tuple(seq_ids)
        tables = [self._table(s) for s in seq_ids]
        width = max(1, max(len(t) for t in tables))
        rows = [t + [0] * (width - len(t)) for t in tables]
        device = self.k_pages.device
        page_table = torch.tensor(rows, dtype=torch.int64, device=device)  # (b, max_pages)
        if counts is None:
            return PagedBatch(seq_ids, page_table, tuple(starts))
        packed = PackedLayout.of(page_table, tuple(starts), tuple(counts), self.page_size)
        return PagedBatch(seq_ids, page_table, tuple(starts), tuple(counts), packed)

    def write(
        self,
        layer: int,
        page_table: torch.Tensor,
        input_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store keys and values of new tokens through page tables (trusts its inputs:
        the pages were reserved, so none is shared).

        Args:
            layer: the layer whose pool is written.
            page_table: int64 ``(b, n)`` or ``(n,)``: the rows' page tables.
            input_pos: ``(t,)`` time indices (the same for every row), or ``(b, t)``.
            k: ``(b, h_kv, t, d)`` (``(h_kv, t, d)`` with a 1-D page table).
            v: ``(b, h_kv, t, d_v)`` likewise.
        """
        if page_table.dim() == 1:
            page_table, k, v = page_table[None], k[None], v[None]
        ps = self.page_size
        b = page_table.shape[0]
        pos = input_pos.expand(b, -1) if input_pos.dim() == 1 else input_pos  # (b, t)
        pages = page_table.gather(1, pos // ps)  # (b, t)
        rows = pos % ps
        dtype = self.k_pages.dtype
        self.k_pages[layer][pages, :, rows] = k.transpose(1, 2).to(dtype)  # (b, t, h_kv, d)
        self.v_pages[layer][pages, :, rows] = v.transpose(1, 2).to(dtype)

    def gather(
        self, layer: int, page_table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(b, h_kv, length, d)`` / ``(..., d_v)`` of the first ``length``
        time indices of the rows of ``page_table`` ``(b, n)``, gathered into contiguous
        tensors (differentiable in the pools): what attention reads where the pages are
        not read in place."""
        return gather_pages(self.k_pages[layer], self.v_pages[layer], page_table, length)

    def extra_repr(self) -> str:
        return (
            f"num_pages={self.num_pages}, page_size={self.page_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, num_layers={self.num_layers}, "
            f"free={self.num_free_pages}"
        )


def check_page_ids(
    page_table: torch.Tensor, key_lens: torch.Tensor | int, page_size: int, num_pages: int
) -> None:
    """Raise a ValueError if a page id a row reads is outside ``[0, num_pages)``: its first
    ``ceil(key_len / page_size)`` (``key_lens``: one length for every row, or ``(b,)``)."""
    if isinstance(key_lens, int):
        used = page_table[:, : -(-key_lens // page_size)]
    else:
        need = (key_lens.reshape(-1, 1).to(page_table.device) + page_size - 1) // page_size
        used = page_table[torch.arange(page_table.shape[1], device=page_table.device) < need]
    if used.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(used))
    if low < 0 or high >= num_pages:
        raise ValueError(
            f"page_table holds page ids {low}..{high}; they must be in [0, {num_pages})"
        )


def gather_pages(
    k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous keys/values ``(b, h_kv, length, d)`` from pages ``(P, h_kv, p, d)``
    through ``page_table`` ``(b, n)`` (``n * p >= length``)."""
    ps = k_pages.shape[2]
    n = -(-length // ps)
    table = page_table[:, :n]  # (b, n)

    def one(pages: torch.Tensor) -> torch.Tensor:
        x = pages[table]  # (b, n, h_kv, p, d)
        b, _, h, _, d = x.shape
        x = x.transpose(1, 2).reshape(b, h, n * ps, d)  # (b, h_kv, n * p, d)
        return x[:, :, :length]

    return one(k_pages), one(v_pages)


class PagedLayer(nn.Module):
    """One layer's view of a :class:`PagedKVCache`: what :class:`attnkit.models.GPT` holds
    in its ``caches`` list when it decodes on pages (:meth:`attnkit.models.GPT.setup_paged_cache`).

    It answers what planning asks of a contiguous cache (a full cache: no ring, no sinks,
    not static; the keys a query sees are the times ``0 .. end - 1``), and
    :meth:`attend` writes a forward's new keys and values and attends through the pages.
    """

    window = None
    sink_tokens = 0
    static = False
    max_seq_len = None
    cache: PagedKVCache

    def __init__(self, cache: PagedKVCache, layer: int) -> None:
        super().__init__()
        self.__dict__["cache"] = cache  # not a submodule: every layer's view shares it
        self.layer = check_int(layer, "layer", minimum=0, maximum=cache.num_layers - 1)

    def key_positions(self, input_pos: torch.Tensor) -> torch.Tensor:
        """``(s,)`` the time index of every key attention reads: ``0 .. input_pos[-1]``."""
        check_positions(input_pos, "input_pos")
        return torch.arange(int(input_pos[-1]) + 1, device=input_pos.device)

    def attend(
        self,
        batch: PagedBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        causal: bool,
        window: int | None,
        sinks: torch.Tensor | None,
        backend: str,
    ) -> torch.Tensor:
        """Write the new keys/values ``(b, h_kv, t, d)`` of ``batch`` and attend to each
        sequence's keys through its pages; returns ``(b, h, t, d_v)``.

        A ``(b, t)`` batch (``batch.counts`` None) is one call with ``mask`` / ``causal``
        / ``window`` as the model planned them for a contiguous cache. A packed batch
        (``(1, h, N, d)``, sequence after sequence) attends sequence by sequence, each
        bottom-right causal over its own keys (nothing crosses between sequences).
        """
        from attnkit.paged_attention import paged_attention

        cache, layer = self.cache, self.layer
        kp, vp = cache.k_pages[layer], cache.v_pages[layer]
        table = batch.page_table
        if batch.counts is None:
            t = q.shape[2]
            start = batch.starts[0]
            pos = torch.arange(start, start + t, device=q.device)
            cache.write(layer, table, pos, k, v)
            return paged_attention(
                q,
                kp,
                vp,
                table,
                start + t,
                mask=mask,
                causal=causal,
                window=window,
                sinks=sinks,
                backend=backend,
            )
        lay = batch.packed or PackedLayout.of(table, batch.starts, batch.counts, cache.page_size)
        # every packed token's key and value to its page and row: (N, h_kv, d) each
        kp[lay.pages, :, lay.rows] = k[0].transpose(0, 1).to(kp.dtype)
        vp[lay.pages, :, lay.rows] = v[0].transpose(0, 1).to(vp.dtype)
        if window is None and len(lay.decode) > 1:  # the decode tokens: one call for them all
            from attnkit.paged_attention import paged_decode

            out = torch.empty(*q.shape[:-1], vp.shape[-1], dtype=q.dtype, device=q.device)
            q_dec = q[0, :, lay.decode_rows].transpose(0, 1)[:, :, None]  # (n, h, 1, d)
            ctx = paged_decode(
                q_dec, kp, vp, lay.decode_table, lay.decode_lens, sinks=sinks, backend=backend
            )  # (n, h, 1, d_v)
            out[0, :, lay.decode_rows] = ctx[:, :, 0].transpose(0, 1)
            for i, (s, c) in enumerate(zip(batch.starts, batch.counts, strict=True)):
                if c > 1:  # a prompt chunk: causal over its own keys
                    at = lay.offsets[i]
                    out[:, :, at : at + c] = paged_attention(
                        q[:, :, at : at + c],
                        kp,
                        vp,
                        table[i : i + 1],
                        s + c,
                        sinks=sinks,
                        backend=backend,
                    )
            return out
        outs = []
        at = 0
        for i, (s, c) in enumerate(zip(batch.starts, batch.counts, strict=True)):
            outs.append(
                paged_attention(
                    q[:, :, at : at + c],
                    kp,
                    vp,
                    table[i : i + 1],
                    s + c,
                    causal=c > 1,
                    window=window,
                    sinks=sinks,
                    backend=backend,
                )
            )
            at += c
        return torch.cat(outs, dim=2)  # (1, h, N, d_v)
