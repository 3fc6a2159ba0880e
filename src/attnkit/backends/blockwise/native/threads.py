"""Which threads the native kernel's parallel calls run on.

torch runs its own CPU ops on an OpenMP runtime (libgomp for GCC builds; Intel's and LLVM's
runtimes export libgomp's entry points too). After each parallel op its threads spin a
while, waiting for the next parallel region. A second pool of threads beside them (the
kernel's own) spins for the same cores: on a 2-core AMD EPYC a causal forward+backward at
T=1024 (bf16) took 7.4-8.0 ms with the kernel's own pool and 4.5-4.7 ms on torch's
runtime, and a 12-layer decode-like loop of matmuls and attention 3.1-3.5 ms against
2.2-2.6 ms. So, where torch's runtime is loaded in this process, the kernel runs its
parallel calls on it (:func:`attach` hands the library ``GOMP_parallel``); elsewhere on
its own pool. The work is split the same way on either (each thread takes the next item
as it is free), so the bits never depend on it.

``ATTNKIT_NATIVE_THREADS`` chooses: ``"openmp"`` (the default: torch's runtime where there
is one) or ``"own"`` (always the kernel's pool). A forked child always uses a pool of its
own (neither set of threads survives fork, and libgomp does not restart its threads in a
child). On torch's runtime, a thread that cannot be started is the runtime's affair, as
for torch's own ops (libgomp ends the process); the kernel's own pool catches it and runs
the call on the threads it has.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import torch

__all__ = ["CHOICES", "attach", "openmp_runtime"]

#: The values ``ATTNKIT_NATIVE_THREADS`` takes.
CHOICES = ("openmp", "own")

# an OpenMP runtime's file name: GNU's libgomp (also as torch wheels rename it,
# libgomp-<hash>.so.1), Intel's libiomp5, LLVM's libomp
_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.\d+)*$")


def openmp_runtime() -> tuple[int | None, str]:
    """``(address of GOMP_parallel, the runtime's file)`` of the OpenMP runtime torch runs
    its ops on, already loaded in this process, or ``(None, why there is none)``."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None, "torch's CPU ops do not run on OpenMP"
    try:
        with open("/proc/self/maps") as maps:
            files = {parts[5] for parts in map(str.split, maps) if len(parts) >= 6}
    except OSError as err:
        return None, f"the loaded libraries cannot be listed ({err.strerror})"
    runtimes = sorted(f for f in files if _RUNTIME.match(Path(f).name))
    torch_lib = str(Path(torch.__file__).parent)
    runtimes.sort(key=lambda f: not f.startswith(torch_lib))  # torch's own first
    for path in runtimes:
        try:  # a handle to the copy already loaded, never a second one
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            entry = lib.GOMP_parallel
        except (OSError, AttributeError):
            continue
        return ctypes.cast(entry, ctypes.c_void_p).value, path
    return None, "no OpenMP runtime with GOMP_parallel is loaded"


def attach(lib: ctypes.CDLL) -> tuple[str, str]:
    """Point ``lib``'s parallel calls at torch's OpenMP runtime or at its own pool, as
    ``ATTNKIT_NATIVE_THREADS`` says (see the module docs): ``("openmp" or "own", which
    and why, for :func:`attnkit.backends.blockwise.native.status`)``."""
    want = os.environ.get("ATTNKIT_NATIVE_THREADS") or "openmp"
    entry, where = openmp_runtime() if want == "openmp" else (None, "")
    lib.attnkit_use_gomp(entry)
    if entry is not None:
        return "openmp", f"torch's OpenMP runtime ({Path(where).name})"
    if want not in CHOICES:
        where = f"ATTNKIT_NATIVE_THREADS={want!r} is not one of {', '.join(CHOICES)}"
    return "own", f"its own pool ({where or 'ATTNKIT_NATIVE_THREADS=own'})"
