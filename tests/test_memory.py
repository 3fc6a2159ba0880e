"""attnkit._memory: cache buffers in transparent huge pages where the system allows."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from attnkit import KVCache, PagedKVCache, _memory

BIG = (4, 1024, 1024)  # 16 MiB of float32: over MIN_BYTES
needs_thp = pytest.mark.skipif(
    not _memory.huge_pages(), reason="no transparent huge pages on this system"
)


def test_small_buffers_and_other_devices_are_torch_zeros(monkeypatch):
    monkeypatch.setattr(_memory.mmap, "mmap", _fail("mapped a small buffer"))
    x = _memory.zeros((3, 5), dtype=torch.float64)
    assert x.shape == (3, 5) and x.dtype == torch.float64
    assert bool((x == 0).all())
    assert _memory.zeros((7, 0), dtype=torch.float32).shape == (7, 0)
    assert _memory.zeros(BIG, dtype=torch.float32, device="meta").device.type == "meta"


@needs_thp
def test_a_large_buffer_is_huge_page_aligned_zero_and_outlives_its_mapping():
    x = _memory.zeros(BIG, dtype=torch.bfloat16)
    assert x.shape == BIG and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert x.data_ptr() % _memory.HUGE_PAGE == 0
    assert bool((x == 0).all())
    gc.collect()  # nothing but the tensor holds the mapping now
    x.copy_(torch.arange(x.numel(), dtype=torch.float32).view(BIG))
    y = x.clone()
    del x
    gc.collect()
    assert torch.equal(y, torch.arange(y.numel(), dtype=torch.float32).view(BIG).bfloat16())


@needs_thp
def test_the_mapping_is_advised_huge(monkeypatch):
    advised = []

    class Recording(mmap.mmap):
        def madvise(self, option, *args):
            advised.append(option)
            return super().madvise(option, *args)

    monkeypatch.setattr(_memory.mmap, "mmap", Recording)
    _memory.zeros(BIG, dtype=torch.float32)
    assert advised == [mmap.MADV_HUGEPAGE]


def test_switched_off_or_refused_it_falls_back_to_torch_zeros(monkeypatch):
    monkeypatch.setenv("ATTNKIT_HUGE_PAGES", "0")
    assert not _memory.huge_pages()
    monkeypatch.setattr(_memory.mmap, "mmap", _fail("mapped with ATTNKIT_HUGE_PAGES=0"))
    assert bool((_memory.zeros(BIG, dtype=torch.float32) == 0).all())
    monkeypatch.delenv("ATTNKIT_HUGE_PAGES")

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(_memory, "_system_allows", lambda: True)
    monkeypatch.setattr(_memory.mmap, "mmap", no_memory)
    x = _memory.zeros(BIG, dtype=torch.float32)  # a refused mapping: ordinary pages
    assert x.shape == BIG and bool((x == 0).all())


@needs_thp
def test_the_caches_allocate_through_it():
    paged = PagedKVCache(64, 16, num_kv_heads=8, head_dim=64, num_layers=2)  # 4 MiB a pool
    contiguous = KVCache(1, 4096, 4, 64)
    for x in (paged.k_pages, paged.v_pages, contiguous.k_cache, contiguous.v_cache):
        assert x is not None and x.data_ptr() % _memory.HUGE_PAGE == 0
        assert bool((x == 0).all())


def _fail(why: str):
    def mapped(*args, **kwargs):
        raise AssertionError(why)

    return mapped
