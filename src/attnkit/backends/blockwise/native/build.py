"""Build and load the native kernel (``attention.cpp``) once per machine, on first use.

One ``g++`` call (``$CXX`` if set) of about a second: no torch headers, plain C ABI,
loaded with :mod:`ctypes`. The shared library is cached under
``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else ``~/.cache/attnkit``, named
by a hash of the source, the compiler, its flags and this CPU's features, and written
atomically (parallel test workers may build it at once). Where there is no compiler or
the build fails, :func:`library` returns None and :func:`status` says why; the blockwise
backend then runs torch's fused kernel instead (same results, slower).
``ATTNKIT_NATIVE=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("attention.cpp")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docs)."""
    explicit = os.environ.get("ATTNKIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> tuple[str, str] | None:
    """``(path, version line)`` of the C++ compiler, or None."""
    path = shutil.which(os.environ.get("CXX", "g++"))
    if path is None:
        return None
    try:
        run = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, (run.stdout.splitlines() or [""])[0]


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
        return None, "turned off by ATTNKIT_NATIVE=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            None,
            f"built for x86-64 Linux only (this is {platform.system()} {platform.machine()})",
        )
    compiler = _compiler()
    if compiler is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
    cxx, version = compiler
    if "clang" in version.lower():
        return None, f"the native kernel needs GCC (its vector extensions), found {version}"
    try:
        source = SOURCE.read_bytes()
    except OSError as err:
        return None, f"the native kernel's source is missing: {err}"
    digest = hashlib.sha256(
        b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), _cpu_features().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"attention-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            where = target.parent
        except OSError:
            where = Path(tempfile.mkdtemp(prefix="attnkit-"))
            target = where / target.name
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=where)
        os.close(fd)
        try:
            run = subprocess.run(
                [cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300
            )
            if run.returncode != 0:
                last = (run.stderr.strip().splitlines() or ["?"])[-1]
                return None, f"building the native kernel failed: {last}"
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as err:
            return None, f"building the native kernel failed: {err}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return None, f"loading the native kernel failed: {err}"
    return lib, f"built with {version} ({target})"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on the first call), or None (see :func:`status`)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["status"] = _build()
    return _state["lib"]  # type: ignore[return-value]


def status() -> str:
    """One line: where the native kernel was built from, or why it is not available."""
    library()
    return str(_state["status"])
