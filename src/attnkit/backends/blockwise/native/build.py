"""Build and load the native kernel (``attention.cpp`` + ``simd.h``) on first use, once per
instruction set.

One ``g++`` call (``$CXX`` if set, e.g. ``"ccache g++"``) of about two seconds: no torch
headers, a plain C ABI loaded with :mod:`ctypes`. Each build targets one instruction set
(:data:`ISA_FLAGS`), and this machine uses the best one its CPU runs (:func:`host_isas`),
or the one ``ATTNKIT_NATIVE_ISA`` names (the tests run every build the CPU can execute,
so an AVX-512 machine proves the AVX2 code too). ``ATTNKIT_NATIVE=0`` turns the kernel off.

Where libraries are kept, and what is loaded:

* the cache directory is ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
  ``~/.cache/attnkit``, created private (0700). It is used only when this user owns it and
  nobody else may write it; otherwise each process builds into a private temporary
  directory, loads the library and removes the directory again;
* a library is named by a hash of the sources, the compiler, its flags and the ISA,
  written atomically (parallel test workers may build at once), with the SHA-256 of its
  bytes beside it;
* it is loaded only when it is a regular file this user owns, writable by nobody else,
  whose bytes (read through the same open descriptor that is then loaded) match that
  hash, so a truncated or planted file is rebuilt, never mapped; and only when it reports
  the ABI version and struct sizes of :mod:`.abi`.

Once loaded, a build's parallel calls are pointed at torch's OpenMP runtime or at its own
pool of threads (:mod:`.threads`, :func:`pool`); the status line names which.

Every failure is one line from :func:`status`, and the blockwise backend then runs torch's
fused kernel instead (same results, slower); :func:`warn_once` says so once per process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from attnkit import _env
from attnkit.backends.blockwise.native import abi, threads

SOURCE = Path(__file__).with_name("attention.cpp")
HEADERS = tuple(Path(__file__).with_name(name) for name in ("simd.h", "amx.h", "linear.h"))
#: Flags of every build; -ffp-contract=fast lets a * b + c be one FMA under -std=c++17.
#: -mtune=generic: the register tiles of simd.h are laid out for the code GCC writes under
#: its generic tuning, and the flag comes after any in ``CXX``, so neither those nor a GCC
#: configured with another default tuning change it. (GCC 12's haswell and znver3 tunings,
#: and -mtune=native on a Zen 4, fold every load of the AVX2 tile's B vectors into its FMAs:
#: 15 loads a step for 12 FMAs, and the AVX2 build's forward took 1.30x as long, causal
#: T=4096, 1 thread, session 24. The AVX-512 build: 0.99-1.01x under any tuning tried.)
FLAGS = (
    "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=fast",
    "-fno-math-errno", "-fvisibility=hidden", "-mtune=generic",
)  # fmt: skip
#: The instruction sets attention.cpp is built for, best first, and their flags.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512-amx": ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
    "avx512-bf16": ("-march=x86-64-v4", "-mavx512bf16"),
    "avx512": ("-march=x86-64-v4",),
    "avx2": ("-march=x86-64-v3",),
    "neon": ("-march=armv8-a",),
}
#: CPU flags (/proc/cpuinfo) each build needs.
_NEEDS = {
    "avx512-amx": {
        "avx512f",
        "avx512bw",
        "avx512cd",
        "avx512dq",
        "avx512vl",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
    },
    "avx512-bf16": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "avx2": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"},
}

_lock = threading.Lock()
_state: dict[str, tuple[ctypes.CDLL | None, str]] = {}  # isa -> (library, status line)
_files: dict[str, Path] = {}  # isa -> the cached library file loaded (not a private build)
_pools: dict[str, str] = {}  # isa -> "openmp" or "own": the threads of its parallel calls
_warned: set[str] = set()
_held_fds: list[int] = []  # descriptors of loaded libraries (see _load)


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docs)."""
    explicit = os.environ.get("ATTNKIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_isas() -> list[str]:
    """The builds this CPU can execute, best first (empty: none; torch's kernel runs)."""
    return list(_host_isas())


@functools.cache
def _host_isas() -> tuple[str, ...]:
    # (asked on every call that may reach the kernel: the CPU does not change)
    if platform.system() != "Linux":
        return ()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ("neon",)  # NEON (Advanced SIMD) is part of every AArch64 CPU
    if machine not in ("x86_64", "amd64"):
        return ()
    flags = _cpu_flags()
    isas = tuple(isa for isa, needs in _NEEDS.items() if needs <= flags)
    if "avx512-amx" in isas and not (_amx_permitted() and _compiles("avx512-amx")):
        isas = tuple(isa for isa in isas if isa != "avx512-amx")
    return isas


def _compiles(isa: str) -> bool:
    """Whether the C++ compiler takes ``isa``'s flags (GCC before 11 has no AMX): a CPU
    with AMX and an older compiler runs the avx512-bf16 build, not none. True where there
    is no compiler at all (that reason is :func:`status`'s)."""
    compiler = _compiler()
    if compiler is None:
        return True
    try:
        run = subprocess.run(
            [*compiler[0], *ISA_FLAGS[isa], "-x", "c++", "-E", "-o", os.devnull, os.devnull],
            capture_output=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode == 0


#: Linux's arch_prctl system call on x86-64, and its request for the AMX tile data state.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _amx_permitted() -> bool:
    """Whether Linux lets this process use the AMX tiles (asked here: Linux 5.16 and
    later grant them on request; an older kernel, or one that refuses, leaves the
    avx512-amx build out of :func:`host_isas`)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def selected_isa() -> str | None:
    """The build this process uses: ``ATTNKIT_NATIVE_ISA`` if set, else the best one."""
    forced = _env.get("ATTNKIT_NATIVE_ISA")
    if forced:
        return forced
    isas = _host_isas()
    return isas[0] if isas else None


def _compiler() -> tuple[list[str], str] | None:
    """``(command, version line)`` of the C++ compiler, or None."""
    command = shlex.split(os.environ.get("CXX", "g++"))
    if not command or shutil.which(command[-1]) is None:
        return None
    command = [*command[:-1], str(shutil.which(command[-1]))]
    try:
        run = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return command, (run.stdout.splitlines() or [""])[0]


def _private_dir(path: Path) -> str | None:
    """Why ``path`` is not a safe cache (None when it is): made 0700 if missing, and then
    owned by this user, writable by nobody else, and writable by us."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as err:
        return f"cannot create {path}: {err.strerror}"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{path} belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None


def _compile(
    command: list[str],
    isa: str,
    target: Path,
    source: Path | None = None,
    extra: tuple[str, ...] = (),
) -> str | None:
    """Build ``source`` (default: the kernel's) into ``target`` (atomically, with its hash
    beside it); why not, or None."""
    source = SOURCE if source is None else source
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [*command, *FLAGS, *ISA_FLAGS[isa], *extra, "-o", tmp, str(source)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["?"])[-1]
            return f"building the native kernel failed: {last}"
        os.chmod(tmp, 0o600)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, target)
        _write_atomic(_hash_path(target), digest)
        return None
    except (OSError, subprocess.SubprocessError) as err:
        return f"building the native kernel failed: {err}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _key(sources: list[bytes], command: list[str], version: str, isa: str) -> str:
    """The name a build is cached under: a hash of everything that makes its bytes (the
    sources, the compiler's command with any wrapper or flags ``CXX`` holds, its version
    line, and the flags), so that no build is ever loaded for another."""
    flags = " ".join((*FLAGS, *ISA_FLAGS[isa]))
    parts = [*sources, "\0".join(command).encode(), version.encode(), flags.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _hash_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(
    target: Path, check: Callable[[ctypes.CDLL], str | None] | None = None
) -> tuple[ctypes.CDLL | None, str | None]:
    """Load ``target`` if it is this user's, private, and its bytes match its hash, and
    ``check`` finds nothing against it; ``(library, None)``, or ``(None, why not)``."""
    try:
        want = _hash_path(target).read_text().strip()
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        return None, f"no intact build ({err.strerror})"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, f"{target} is not a regular file"
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            return None, f"{target} belongs to another user"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None, f"{target} is writable by other users"
        with os.fdopen(os.dup(fd), "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        if got != want:
            return None, f"{target} does not match its hash (truncated or replaced)"
        # Load the very bytes just checked, through the descriptor. It stays open for the
        # life of the process: the dynamic loader knows a library by the name it was opened
        # with, so a closed (and reused) descriptor's name would hand a later build the
        # library loaded first.
        by_fd = f"/proc/self/fd/{fd}"
        try:
            lib = ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(target))
        except OSError as err:
            return None, f"loading the native kernel failed: {err}"
        _held_fds.append(fd)
    finally:
        if fd not in _held_fds:
            os.close(fd)
    why = (check or abi.check)(lib)
    return (None, why) if why else (lib, None)


def _build(isa: str | None) -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
        return None, "turned off by ATTNKIT_NATIVE=0"
    host = host_isas()
    if isa is None:
        return None, (
            f"no build for this CPU ({platform.system()} {platform.machine()}): the native "
            "kernel targets AVX-512, AVX2+FMA (x86-64 Linux) and NEON (aarch64 Linux)"
        )
    if isa not in ISA_FLAGS:
        return None, f"ATTNKIT_NATIVE_ISA={isa!r} is not one of {', '.join(ISA_FLAGS)}"
    if isa not in host:
        return None, f"this CPU cannot run the {isa} build (it runs: {', '.join(host) or 'none'})"
    compiler = _compiler()
    if compiler is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
    command, version = compiler
    if "clang" in version.lower():
        return None, f"the native kernel needs GCC (its vector extensions), found {version}"
    try:
        sources = [p.read_bytes() for p in (SOURCE, *HEADERS)]
    except OSError as err:
        return None, f"the native kernel's source is missing: {err}"
    name = f"attention-{isa}-{_key(sources, command, version, isa)}.so"
    where = cache_dir()
    unsafe = _private_dir(where)
    if unsafe is None:
        target = where / name
        lib, why = _load(target)  # built before and intact?
        if lib is None:
            lib, why = _compile_and_load(command, isa, target)
        if lib is None:
            return None, str(why)
        _files[isa] = target
        return lib, f"{isa} build, {version} ({target})"
    with tempfile.TemporaryDirectory(prefix="attnkit-") as private:  # removed after loading
        lib, why = _compile_and_load(command, isa, Path(private) / name)
    return (
        (lib, f"{isa} build, {version} (in a temporary directory: {unsafe})")
        if lib
        else (None, why)
    )


def _compile_and_load(command: list[str], isa: str, target: Path) -> tuple[ctypes.CDLL | None, str]:
    """Build ``target`` and load it: ``(library, "")``, or ``(None, why not)``."""
    failed = _compile(command, isa, target)
    if failed:
        return None, failed
    lib, why = _load(target)
    return lib, str(why or "")


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernel library for ``isa`` (default :func:`selected_isa`), built on the
    first call, or None (see :func:`status`)."""
    isa = isa or selected_isa()
    key = isa or ""
    known = _state.get(key)  # (every call after the first: no lock)
    if known is not None:
        return known[0]
    with _lock:
        if key not in _state:
            _files.pop(key, None)
            lib, why = _build(isa)
            if lib is not None:
                _pools[key], how = threads.attach(lib)
                why = f"{why}; threads: {how}"
            _state[key] = (lib, why)
    return _state[key][0]


def pool(isa: str | None = None) -> str | None:
    """The threads the loaded build for ``isa`` runs its parallel calls on: ``"openmp"``
    (torch's runtime) or ``"own"`` (see :mod:`.threads`); None when none is loaded."""
    isa = isa or selected_isa()
    return _pools.get(isa or "") if library(isa) is not None else None


def library_file(isa: str | None = None) -> Path | None:
    """The file of the loaded library for ``isa`` in the cache directory, or None (none
    loaded, or built in a private temporary directory that is gone)."""
    isa = isa or selected_isa()
    return _files.get(isa or "") if library(isa) is not None else None


def status(isa: str | None = None) -> str:
    """One line: which build is loaded and from where, or why there is none."""
    isa = isa or selected_isa()
    library(isa)
    return _state[isa or ""][1]


def warn_once() -> None:
    """A :class:`RuntimeWarning` naming :func:`status`'s reason, once per process and reason:
    the native kernel could not be used, so torch's (slower) kernel runs."""
    why = status()
    if why in _warned or why.startswith("turned off"):
        return
    _warned.add(why)
    with contextlib.suppress(Exception):
        warnings.warn(
            f"attnkit's native CPU kernel is not used ({why}); torch's kernel runs instead",
            RuntimeWarning,
            stacklevel=3,
        )


# -- generated sources (native/codegen.py: compiled score_mods) ------------------------


def build_generated(
    text: str, stem: str, check: Callable[[ctypes.CDLL], str | None], isa: str | None = None
) -> tuple[ctypes.CDLL | None, str]:
    """Build and load a generated C++ source ``text`` (it may include ``simd.h``) for
    ``isa`` (default :func:`selected_isa`) with the kernel's flags, under the same rules
    as the kernel (the cache directory, a name hashed from the text, the compiler, its
    flags and the headers, written atomically, loaded only when owned, private, matching
    its hash, and passing ``check``): ``(library, status line)`` or ``(None, why not)``."""
    if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
        return None, "turned off by ATTNKIT_NATIVE=0"
    isa = isa or selected_isa()
    if isa is None or isa not in ISA_FLAGS or isa not in host_isas():
        return None, f"no native build for this CPU or ISA ({isa})"
    compiler = _compiler()
    if compiler is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
    command, version = compiler
    try:
        headers = [p.read_bytes() for p in HEADERS]
    except OSError as err:
        return None, f"the native kernel's headers are missing: {err}"
    extra = ("-I", str(SOURCE.parent))
    name = f"{stem}-{isa}-{_key([text.encode(), *headers], command, version, isa)}"

    def make(where: Path) -> tuple[ctypes.CDLL | None, str]:
        target = where / f"{name}.so"
        lib, why = _load(target, check)
        if lib is not None:
            return lib, ""
        src = where / f"{name}.cpp"
        try:
            _write_atomic(src, text)
        except OSError as err:
            return None, f"cannot write {src}: {err.strerror}"
        failed = _compile(command, isa, target, src, extra)
        if failed:
            return None, failed
        lib, why = _load(target, check)
        return lib, str(why or "")

    where = cache_dir()
    unsafe = _private_dir(where)
    if unsafe is None:
        lib, why = make(where)
        return (lib, f"{isa} build ({where / name}.so)") if lib else (None, why)
    with tempfile.TemporaryDirectory(prefix="attnkit-") as private:
        lib, why = make(Path(private))
    return (lib, f"{isa} build (in a temporary directory: {unsafe})") if lib else (None, why)
