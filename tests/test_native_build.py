"""Building and loading the native kernel (``backends/blockwise/native/build.py``): every
way it can fail is a one-line reason and torch's kernel runs; a library that is not this
user's, is writable by others, or whose bytes do not match its hash is never loaded."""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from attnkit import attention
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import abi, build

needs_host_build = pytest.mark.skipif(not build.host_isas(), reason="this CPU runs no native build")


#: The loader's rules do not depend on the code's speed: these tests build at -O0 (3 s a
#: build on a 2-core Zen 3 instead of 8; the real flags are built by every other module).
QUICK_FLAGS = tuple("-O0" if f == "-O3" else f for f in build.FLAGS)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process with nothing built or loaded yet, caching under ``tmp_path / "cache"``,
    building with :data:`QUICK_FLAGS`."""
    monkeypatch.setattr(build, "FLAGS", QUICK_FLAGS)
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_files", {})
    monkeypatch.setattr(build, "_warned", set())
    monkeypatch.delenv("ATTNKIT_NATIVE", raising=False)
    monkeypatch.delenv("ATTNKIT_NATIVE_ISA", raising=False)
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache holding every build this CPU runs (:data:`QUICK_FLAGS`), compiled once for
    the module's tests."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    saved, files, flags = dict(build._state), dict(build._files), build.FLAGS
    build.FLAGS = QUICK_FLAGS
    old = {n: os.environ.get(n) for n in ("ATTNKIT_CACHE_DIR", "ATTNKIT_NATIVE_ISA")}
    os.environ["ATTNKIT_CACHE_DIR"] = str(cache)
    try:
        for isa in build.host_isas():
            os.environ["ATTNKIT_NATIVE_ISA"] = isa
            build._state.clear()
            assert build.library() is not None, build.status()
    finally:
        build.FLAGS = flags
        build._state.clear()
        build._state.update(saved)
        build._files.clear()
        build._files.update(files)
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return cache


@pytest.fixture
def fresh_built(fresh, built):
    """:func:`fresh`, its cache already holding the builds (nothing compiles)."""
    shutil.copytree(built, fresh)
    os.chmod(fresh, 0o700)
    return fresh


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 100, 16, generator=g) for _ in range(3))


def _library_file(cache) -> os.PathLike:
    (so,) = cache.glob(f"attention-{build.selected_isa()}-*.so")
    return so


def test_turned_off_or_without_a_compiler(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    assert build.library() is None and "ATTNKIT_NATIVE=0" in build.status()
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.delenv("ATTNKIT_NATIVE")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert build.library() is None and "no C++ compiler" in build.status()
    q, k, v = _qkv(20)
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        out = attention(q, k, v, causal=True, window=10, backend="blockwise")  # torch's kernel
    ref = attention(q, k, v, causal=True, window=10, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_the_fallback_warning_comes_once(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    q, k, v = _qkv(21)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            attention(q, k, v, causal=True, window=10, backend="blockwise")
    native_warnings = [w for w in seen if "native CPU kernel is not used" in str(w.message)]
    assert len(native_warnings) == 1


def test_a_missing_source_or_a_failing_compiler_is_a_reason(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "SOURCE", tmp_path / "missing.cpp")
    assert build.library() is None and "source is missing" in build.status()
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "SOURCE", broken)
    assert build.library() is None and "building the native kernel failed" in build.status()
    assert not list(fresh.glob("*.so"))  # nothing half-written is left to load


def test_isa_choice_is_checked(fresh, monkeypatch):
    monkeypatch.setenv("ATTNKIT_NATIVE_ISA", "avx1024")
    assert build.library() is None and "is not one of" in build.status()
    foreign = "neon" if "neon" not in build.host_isas() else "avx2"
    monkeypatch.setenv("ATTNKIT_NATIVE_ISA", foreign)
    assert build.library() is None and "cannot run the" in build.status()


@needs_host_build
def test_builds_into_a_fresh_private_cache(fresh):
    assert build.library() is not None, build.status()
    names = sorted(p.suffix for p in fresh.iterdir())
    assert names == [".sha256", ".so"]  # no temporary left behind
    assert str(fresh) in build.status() and build.selected_isa() in build.status()
    assert build.library_file() == _library_file(fresh)  # where calibration keeps its speed
    assert fresh.stat().st_mode & 0o777 == 0o700


@needs_host_build
def test_a_compiler_with_a_wrapper_is_used(fresh_built, monkeypatch):
    """``CXX="ccache g++"`` style commands (here ``env g++``) build as the plain one, and
    into a library of their own: a build is never loaded for another compiler command
    (one ``CXX`` may carry flags the other lacks)."""
    plain = _library_file(fresh_built)
    monkeypatch.setenv("CXX", "env g++")
    assert build.library() is not None, build.status()
    libraries = set(fresh_built.glob(f"attention-{build.selected_isa()}-*.so"))
    assert plain in libraries and len(libraries) == 2


TILE_SOURCE = """#include "simd.h"
extern "C" void product(float *c, const float *a, const float *b, long rows, long k) {
  simd::gemm<false>(c, 64, rows, 64, a, k, 1, b, 64, k, nullptr);
}
"""


@pytest.mark.skipif("avx2" not in build.host_isas(), reason="needs an x86-64-v3 compiler and CPU")
def test_a_tuning_in_cxx_does_not_change_the_code(tmp_path, monkeypatch):
    """The register tiles are laid out for GCC's generic tuning: ``CXX="g++ -mtune=haswell"``
    (or a GCC configured with another default) must build the same bytes as plain g++. Under
    haswell tuning GCC 12 folds every load of the AVX2 tile's B vectors into its FMAs, and
    the AVX2 forward took 1.30x as long on a Zen 4."""
    source = tmp_path / "tile.cpp"
    source.write_text(TILE_SOURCE)
    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    gxx = compiler[0]
    include = ("-I", str(build.SOURCE.parent))

    def compiled(command, name):
        target = tmp_path / name
        assert build._compile(command, "avx2", target, source, include) is None
        return target.read_bytes()

    plain = compiled(gxx, "plain.so")
    with monkeypatch.context() as m:  # first: the code does differ without the pin
        m.setattr(build, "FLAGS", tuple(f for f in build.FLAGS if f != "-mtune=generic"))
        if compiled([*gxx, "-mtune=haswell"], "haswell-unpinned.so") == plain:
            pytest.skip("this compiler writes the same tile under haswell tuning")
    assert compiled([*gxx, "-mtune=haswell"], "haswell.so") == plain


@needs_host_build
def test_a_truncated_library_is_rebuilt_not_loaded(fresh_built):
    so = _library_file(fresh_built)
    so.write_bytes(so.read_bytes()[:4096])  # a crash mid-write, a full disk, ...
    os.chmod(so, 0o600)
    build._state.clear()
    assert build.library() is not None, build.status()
    assert so.stat().st_size > 4096  # built again


@needs_host_build
def test_a_library_planted_by_another_user_is_never_loaded(fresh_built):
    so = _library_file(fresh_built)
    lib, why = build._load(so)
    assert lib is not None, why  # this user's own file loads
    os.chmod(so, 0o666)
    lib, why = build._load(so)
    assert lib is None and "writable by other users" in str(why)
    os.chmod(so, 0o600)
    if os.getuid() == 0:  # root can hand the file to another user
        os.chown(so, 12345, -1)
        lib, why = build._load(so)
        assert lib is None and "belongs to another user" in str(why)


@needs_host_build
def test_a_shared_or_unwritable_cache_builds_privately(fresh, monkeypatch, tmp_path):
    """A cache directory others may write (or that cannot be made) is not used: the library
    is built in a private temporary directory, loaded, and the directory removed."""
    fresh.mkdir(mode=0o777)
    os.chmod(fresh, 0o777)  # as under umask 000
    assert build.library() is not None, build.status()
    assert "writable by other users" in build.status()
    assert not list(fresh.iterdir())  # nothing written into the shared directory
    assert build.library_file() is None  # a private build: nothing is kept beside it
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(not_a_dir / "cache"))
    build._state.clear()
    assert build.library() is not None, build.status()
    assert "cannot create" in build.status()


@needs_host_build
def test_every_build_loads_its_own_library(fresh_built, monkeypatch):
    """The loader knows libraries by the name they were opened with; each ISA's build must
    still be its own library (a reused descriptor name once handed back the first)."""
    for isa in build.host_isas():
        monkeypatch.setenv("ATTNKIT_NATIVE_ISA", isa)
        lib = build.library()
        assert lib is not None and lib.attnkit_isa().decode() == isa


@needs_host_build
def test_a_library_of_another_abi_is_refused(fresh_built):
    lib = build.library()
    assert abi.check(lib) is None

    class Foreign:  # what a stale build reports
        def __getattr__(self, name):
            return getattr(lib, name)

    foreign = Foreign()
    foreign.attnkit_abi = lambda sizes: abi.ABI_VERSION + 1
    why = abi.check(foreign)
    assert why is not None and "ABI" in why


def test_forward_blocks_end_in_whole_register_tiles():
    """The forward's query blocks (``native.BLOCK_Q`` rows) are a multiple of every build's
    register tile height and vector width as simd.h defines them, so that no block ends in
    a short tile (AVX2: 3 rows of 8 floats; AVX-512: 6 of 16; NEON: 6 of 4)."""
    text = Path(build.__file__).with_name("simd.h").read_text()
    targets = re.findall(r"#define ATTNKIT_W (\d+)\n#define ATTNKIT_TILE_R_ (\d+)", text)
    assert len(targets) == 3, targets  # AVX-512, AVX2, NEON
    for width, rows in targets:
        assert native.BLOCK_Q % math.lcm(int(width), int(rows)) == 0, (width, rows)
