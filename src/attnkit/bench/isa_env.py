"""Holding torch to an instruction set, so a build's rows compare with what that CPU runs.

An AVX-512 machine can execute the native kernel's AVX2 build, but torch's own kernels
(ATen's dispatch, oneDNN, MKL, inductor's generated C++) would still use AVX-512 there,
and a ratio against them says nothing about an AVX2 machine. These variables make torch
choose its AVX2 code too; they are read when torch loads, so the rows run in a child
process started with them. One home: every bench that compares a lower build with torch
(``native_kernel``'s per-build rows; ``kernel_layer``'s FlexAttention row when run under
them) takes the variables from here.
"""

from __future__ import annotations

import torch

__all__ = ["HELD", "held_env", "torch_capability"]

#: The environment that holds torch (ATen, oneDNN, MKL) to each build's instruction set.
HELD: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}


def torch_capability() -> str:
    """The vector code torch's CPU kernels run in this process (``"AVX512"``, ``"AVX2"``, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def held_env(isa: str) -> dict[str, str] | None:
    """The variables that hold torch to ``isa``, or None where this process already runs
    torch at that level (or no holding is known for ``isa``: the build's own width is
    torch's, e.g. the best build of the machine)."""
    env = HELD.get(isa)
    if env is None or torch_capability().lower() == isa:
        return None
    return dict(env)
