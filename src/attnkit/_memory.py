"""Buffers for long-lived caches: large CPU ones in transparent huge pages.

A key/value cache is allocated once and read on every decode step. With the 4 KiB pages
the operating system hands out by default, every 4 KiB of keys is another TLB entry and,
read in the order of a page table (:class:`attnkit.PagedKVCache`, whose pages of 16
tokens x 64 floats are exactly 4 KiB a head), another page walk. Measured on a 2-core
Zen 3 (AVX2, 32 MiB L3) through attnkit's native kernel, one decode step over 4096 keys,
12 heads x 64 fp32, old and new alternating in one process: a contiguous cache 985 ->
926 us, 16-token pages in shuffled order 1563 -> 1440 us. (Most of the paged step's gap
to the contiguous one is the scattered 4 KiB runs themselves, not the TLB: see
docs/serving.md.)

:func:`zeros` gives such buffers on Linux where transparent huge pages are available
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``): an
anonymous mapping, 2 MiB-aligned, marked ``MADV_HUGEPAGE``, wrapped as a tensor (the
mapping lives as long as the tensor; its memory is zero until written, and taken from
the system only where touched). Everywhere else (other devices, other systems, small
buffers, ``ATTNKIT_HUGE_PAGES=0``) it is :func:`torch.zeros`.
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE", "huge_pages", "zeros"]

#: The huge page size buffers are aligned to (x86-64 and most aarch64 kernels).
HUGE_PAGE = 2 << 20
#: Smaller buffers take ordinary pages (a huge page would be mostly empty).
MIN_BYTES = 2 * HUGE_PAGE
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _system_allows() -> bool:
    """Whether this OS honours ``MADV_HUGEPAGE`` (read once)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_pages() -> bool:
    """Whether :func:`zeros` backs large CPU buffers with transparent huge pages here
    (off with the environment variable ``ATTNKIT_HUGE_PAGES=0``)."""
    return os.environ.get("ATTNKIT_HUGE_PAGES", "1") != "0" and _system_allows()


def zeros(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """A zero-filled contiguous tensor, in transparent huge pages where that helps (see the
    module docs): a CPU tensor of at least :data:`MIN_BYTES` on a system that allows it.

    Args:
        shape: the tensor's shape.
        dtype: its dtype.
        device: its device (None: the default device).

    Returns:
        The tensor (an ordinary one: resizing aside, it behaves as :func:`torch.zeros`'s).
    """
    dev = torch.get_default_device() if device is None else torch.device(device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if dev.type != "cpu" or nbytes < MIN_BYTES or not huge_pages():
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no memory to map, or a kernel that refuses the advice: ordinary pages
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # (anonymous memory is zero until written)
    return raw[start : start + nbytes].view(dtype).view(shape)
