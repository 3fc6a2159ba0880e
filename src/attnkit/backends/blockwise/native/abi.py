"""The C boundary of ``attention.cpp``, in one place: its argument structs as
:mod:`ctypes` sees them, the ABI version they are checked against at load, and the
names of its return codes.

A library is loaded only when it reports the same ABI version and the same sizes of
``Args`` and ``Grads`` as below (:func:`check`), so a stale or foreign build is a
:func:`~attnkit.backends.blockwise.native.status` reason, never a corrupt call.
"""

from __future__ import annotations

import ctypes

__all__ = ["ABI_VERSION", "CODES", "DT_BF16", "DT_F32", "Args", "Grads", "check", "typed"]

#: ``ABI_VERSION`` of attention.cpp: bumped whenever ``Args``, ``Grads`` or the exported
#: functions change (9: ``attnkit_cascade``; 10: ``num_pages``, page ids checked; 11:
#: ``mask_c0``; 12: ``attnkit_cascade`` gathers the prefix pass's rows from the queries;
#: 13: ``attnkit_linear``; 14: ``out16``, and ``lse`` may be null; 15:
#: ``page_heads_apart``).
ABI_VERSION = 15

#: attention.cpp's return codes (``enum Code``) that the binding treats apart.
OK, BAD_SHAPE, NO_MEMORY, BAD_PAGE = 0, 1, 4, 9

#: attention.cpp's return codes (``enum Code``), described.
CODES = {
    1: "head sizes, heads, block rows or a mask column the kernel cannot take",
    2: "a block mask whose rows differ from the kernel's blocks",
    3: "query heads not a multiple of 16 wide (backward)",
    4: "out of memory",
    5: "no thread could be started",
    6: "an internal error",
    7: "bf16 inputs to a build without bf16 products",
    8: "paged keys and values to the backward (the kernel runs their forward only)",
    9: "a page id outside the pool",
}

#: ``Args.dtype``: what ``q``, ``k``, ``v`` (and the backward's ``dout``) point to.
DT_F32, DT_BF16 = 0, 1

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Args(ctypes.Structure):
    """``struct Args`` of attention.cpp, field for field (all 8 bytes wide)."""

    _fields_ = [
        *((name, _P) for name in ("q", "k", "v", "out", "lse")),
        *((f"s{x}_{y}", _I) for x in "qkvo" for y in "bht"),  # element strides
        *((name, _I) for name in ("B", "H", "HKV", "T", "S", "D", "DV")),
        ("scale", ctypes.c_double),
        ("band_lo", _I),
        ("band_hi", _I),
        ("bq", _I),
        ("bm_kind", _P),
        ("bm_index", _P),
        ("bm_masks", _P),
        *((name, _I) for name in ["bm_sb", "bm_sh", "bm_si", "bm_qb", "bm_kb"]),
        ("rel", _P),
        ("rel_sh", _I),
        ("rel_lo", _I),
        ("mask", _P),
        ("mask_kind", _I),
        *((f"sm_{x}", _I) for x in "bhts"),
        ("mask_c0", _I),  # the key the mask's column 0 is (keys before it all kept)
        ("threads", _I),
        ("dtype", _I),
        # compiled score_mods (native/codegen.py): row functions and their context
        ("mod_forward", _P),
        ("mod_backward", _P),
        ("mod_ctx", _P),
        ("mod_ngrad", _I),
        ("mod_dgrad", _P),
        # packed variable-length batches and split-KV decoding (attention.cpp, "varlen")
        ("cu_q", _P),
        ("cu_k", _P),
        ("nseq", _I),
        ("varlen_align", _I),
        ("kv_splits", _I),
        # paged keys and values (attnkit.PagedKVCache): the page table and its geometry
        ("pages", _P),
        *((name, _I) for name in ("pages_sb", "page_size", "sk_page", "sv_page", "num_pages")),
        ("key_lens", _P),
        # generated mask tests (native/codegen.py, compiled mask_mods): a block mask's
        # PARTIAL tiles made row by row, no stored tile
        ("mask_row", _P),
        ("mask_ctx", _P),
        # the output as the caller keeps it: bf16 (out16 set, `out` unused); lse null: not
        # written (attnkit_forward only)
        ("out16", _P),
        # a float32 paged decode step's items read a head at a time instead of walking
        # each page whole (what this machine measured faster: calibrate.heads_apart)
        ("page_heads_apart", _I),
    ]


class Grads(ctypes.Structure):
    """``struct Grads`` of attention.cpp."""

    _fields_ = [(name, _P) for name in ("dout", "delta", "dq", "dk", "dv")]


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with the argument and return types of its exported functions set."""
    lib.attnkit_abi.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.attnkit_abi.restype = ctypes.c_int64
    lib.attnkit_isa.argtypes = []
    lib.attnkit_isa.restype = ctypes.c_char_p
    lib.attnkit_bf16.argtypes = []
    lib.attnkit_bf16.restype = ctypes.c_int
    lib.attnkit_forward.argtypes = [ctypes.POINTER(Args)]
    lib.attnkit_forward.restype = ctypes.c_int
    lib.attnkit_cascade.argtypes = [ctypes.POINTER(Args), ctypes.POINTER(Args)]
    lib.attnkit_cascade.restype = ctypes.c_int
    lib.attnkit_backward.argtypes = [ctypes.POINTER(Args), ctypes.POINTER(Grads)]
    lib.attnkit_backward.restype = ctypes.c_int
    lib.attnkit_fma_probe.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.attnkit_fma_probe.restype = ctypes.c_double
    lib.attnkit_linear.argtypes = [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I]
    lib.attnkit_linear.restype = ctypes.c_int
    lib.attnkit_use_gomp.argtypes = [ctypes.c_void_p]
    lib.attnkit_use_gomp.restype = None
    if hasattr(lib, "attnkit_reused_bytes"):  # (for the tests; older sources lack it)
        lib.attnkit_reused_bytes.argtypes = []
        lib.attnkit_reused_bytes.restype = ctypes.c_int64
    return lib


def check(lib: ctypes.CDLL) -> str | None:
    """Why ``lib`` must not be called (None when its ABI is this module's)."""
    try:
        typed(lib)
    except AttributeError as err:
        return f"the native library lacks an entry point ({err})"
    sizes = (ctypes.c_int64 * 2)()
    version = lib.attnkit_abi(sizes)
    want = (ctypes.sizeof(Args), ctypes.sizeof(Grads))
    if version != ABI_VERSION or tuple(sizes) != want:
        return (
            f"the native library's ABI (version {version}, sizes {tuple(sizes)}) is not "
            f"attnkit's (version {ABI_VERSION}, sizes {want})"
        )
    return None
