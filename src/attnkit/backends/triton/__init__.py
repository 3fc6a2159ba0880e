"""attnkit's own GPU attention kernels, in Triton (FlashAttention-2 style).

The backend is registered as ``"triton"`` only where the ``triton`` package can be
found (``pip install attnkit[gpu]``); triton itself is imported on the first call, so
``import attnkit`` never loads it. Without a GPU the same kernels run on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first call): slow,
but exact, which is how the test suite checks them.

Layout: :mod:`.plan` (what a call needs, torch only), :mod:`._tile` (the score tile
shared by every kernel), :mod:`._fwd` and :mod:`._bwd` (kernels), :mod:`.autograd`
(launches + the autograd function), :mod:`.backend` (supports + the call).
"""

from __future__ import annotations

import importlib.util

from attnkit.backends.registry import register_backend
from attnkit.backends.triton.backend import auto_supports, supports, triton_attention

__all__ = ["AVAILABLE", "supports", "triton_attention"]

#: Whether the ``triton`` package is installed (the backend is registered only then).
AVAILABLE = importlib.util.find_spec("triton") is not None

if AVAILABLE:
    register_backend("triton", triton_attention, supports=supports, auto_supports=auto_supports)
