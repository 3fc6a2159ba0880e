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

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from attnkit.backends.blockwise.native import build
from attnkit.backends.blockwise.native.calibrate import LIBRARY_LEVELS

__all__ = ["CHILD", "HELD", "held_env", "in_held_child", "torch_capability", "torch_libraries"]

#: Set in a held child's environment (a child never starts another).
CHILD = "ATTNKIT_BENCH_HELD_CHILD"

#: The environment that holds torch (ATen, oneDNN, MKL) to each build's instruction set.
#: The AVX-512 builds below the host's best keep ATen's AVX-512 code and hold oneDNN and
#: MKL (whose bf16 products run on AMX tiles where the CPU has them: on the AMX Xeon of
#: session 26 a bf16 matmul took 7.8 ms, 87 ms held to AVX512_CORE_BF16, and SDPA's bf16
#: causal forward 4.3 ms, 16.5 ms with MKL held to AVX512_E3 as well).
HELD: dict[str, dict[str, str]] = {
    "avx512-bf16": {  # AVX-512 with bf16 dot products, no AMX (Zen 4, Cooper Lake)
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3",
    },
    "avx512": {  # AVX-512 with int8 dot products only (Cascade Lake, Ice Lake)
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}


def torch_capability() -> str:
    """The vector code torch's CPU kernels run in this process (``"AVX512"``, ``"AVX2"``, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def torch_libraries() -> str:
    """How this process holds oneDNN and MKL (``"oneDNN up to AVX512_CORE_BF16, MKL up to
    AVX512_E3"``), or ``""`` where they run at the CPU's own level."""
    return ", ".join(
        f"{lib} up to {os.environ[var]}" for var, lib in LIBRARY_LEVELS.items() if var in os.environ
    )


def held_env(isa: str) -> dict[str, str] | None:
    """The variables that hold torch to ``isa``, or None where this process already runs
    torch at that level (or no holding is known for ``isa``), or where ``isa`` is the
    machine's best build (torch then runs at its own level)."""
    env = HELD.get(isa)
    if env is None or build.host_isas()[:1] == [isa]:
        return None
    if "ATEN_CPU_CAPABILITY" in env:  # held already: ATen runs at that level
        held = torch_capability().lower() == env["ATEN_CPU_CAPABILITY"]
    else:  # ... or oneDNN is held there
        held = os.environ.get("ONEDNN_MAX_CPU_ISA") == env["ONEDNN_MAX_CPU_ISA"]
    return None if held else dict(env)


def in_held_child(module: str, isa: str, held: dict[str, str], args: list[str]) -> dict:
    """``isa``'s result from ``python -m MODULE --isa ISA --json FILE ARGS`` run with
    ``held`` in its environment (torch reads it when it loads), or ``{"status": why}``
    where the child failed. The child runs ``isa``'s build, measures its own speed
    (``ATTNKIT_NATIVE_SPEED`` unset) and is marked :data:`CHILD`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", module, "--isa", isa, "--json", str(out), *args]
        child_env = {**os.environ, **held, "ATTNKIT_NATIVE_ISA": isa, CHILD: "1"}
        child_env.pop("ATTNKIT_NATIVE_SPEED", None)
        done = subprocess.run(argv, env=child_env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"status": f"the held-{isa} child process failed: {tail[0]}"}
        return json.loads(out.read_text())["builds"][isa]
