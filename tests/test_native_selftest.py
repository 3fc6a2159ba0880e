"""The native kernel's own torch-free self-test (``tests/native/selftest.cpp``) built for
every instruction set: each x86 build this CPU executes, and aarch64 NEON with the cross
compiler, run under qemu-user (Debian's ``g++-aarch64-linux-gnu`` and ``qemu-user``,
which ``.ci/run`` installs). It checks out/lse/dq/dk/dv against float64 with flash-attn's
rule (on builds with bf16 products, those products too: AMX tiles or vdpbf16ps), and the
disassembly of each x86 build for vector width and scalarised loops."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attnkit.backends.blockwise.native import build

DRIVER = Path(__file__).with_name("native") / "selftest.cpp"
CXXFLAGS = ["-O2", "-std=c++17", "-pthread", "-ffp-contract=fast", "-fno-math-errno"]
X86 = [isa for isa in build.host_isas() if isa != "neon"]


def _build_and_run(
    compiler: str,
    isa: str,
    tmp_path: Path,
    runner: list[str],
    flags: list[str] | None = None,
    checks: tuple[str, ...] = (),
) -> str:
    """Build the driver for ``isa`` and run it (under ``runner``, a qemu-user, where
    given); ``checks``: only the checks whose names contain one of these."""
    exe = tmp_path / f"selftest-{isa}"
    flags = [*(CXXFLAGS if flags is None else flags), *build.ISA_FLAGS[isa]]
    if runner:
        flags.append("-static")  # qemu-user then needs no sysroot of the target at run time
    made = subprocess.run([compiler, *flags, "-o", str(exe), str(DRIVER)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if made.returncode and "-fsanitize" in " ".join(flags) and "cannot find" in made.stderr:
        pytest.skip(f"no sanitizer runtime here: {made.stderr.strip().splitlines()[-1]}")
    assert made.returncode == 0, made.stderr[-3000:]
    run = subprocess.run([*runner, str(exe), *checks], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return run.stdout


@pytest.mark.skipif(not X86 or shutil.which("g++") is None, reason="no x86 build runs here")
@pytest.mark.parametrize("isa", X86)
def test_x86_builds_pass_the_self_test(isa, tmp_path):
    out = _build_and_run("g++", isa, tmp_path, [])
    checks = 26 if "-mavx512bf16" in build.ISA_FLAGS[isa] else 25  # (+ the bf16 products)
    assert f"{isa} build" in out and f"{checks} passed, 0 failed" in out


#: Sanitizer builds of the driver: every out-of-bounds access, use after free, undefined
#: operation (UBSan, which stops at the first) or data race between the kernel's threads
#: fails the run. -O1 -g keeps the reports readable; _GLIBCXX_ASSERTIONS checks the
#: standard containers' indices too.
SANITIZERS = {
    "address,undefined": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                          "-D_GLIBCXX_ASSERTIONS"],
    "thread": ["-fsanitize=thread"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not X86 or shutil.which("g++") is None, reason="no x86 build runs here")
@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
@pytest.mark.parametrize("isa", X86)
def test_x86_builds_pass_the_self_test_under_sanitizers(isa, sanitizer, tmp_path):
    """The same cases, built with ASan + UBSan or with TSan (about 25 s a build): the
    kernel's loops, its thread pool and its merges touch nothing they should not. (Slow
    tier: the plain self-test above checks the same answers.)"""
    flags = ["-O1", "-g", "-std=c++17", "-pthread", "-fno-math-errno", *SANITIZERS[sanitizer]]
    out = _build_and_run("g++", isa, tmp_path, [], flags)
    assert f"{isa} build" in out and ", 0 failed" in out


AARCH64_GXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


@pytest.mark.skipif(
    platform.machine() == "aarch64" or not (shutil.which(AARCH64_GXX) and shutil.which(QEMU)),
    reason=f"needs {AARCH64_GXX} and {QEMU} (Debian: g++-aarch64-linux-gnu, qemu-user)",
)
def test_the_aarch64_neon_build_passes_under_qemu(tmp_path):
    out = _build_and_run(AARCH64_GXX, "neon", tmp_path, [QEMU])
    assert "neon build (4 floats a vector)" in out and "25 passed, 0 failed" in out


@pytest.mark.skipif(not X86 or shutil.which("objdump") is None, reason="no x86 build or objdump")
@pytest.mark.parametrize("isa", X86)
def test_x86_builds_use_their_vector_width(isa):
    """The AVX2 build once lowered 16-float vectors to ~2,300 scalar inserts/extracts; each
    build must now compute at its own width (zmm for AVX-512, ymm only for AVX2). Read from
    the library this process loads (built with the kernel's own flags, or found cached)."""
    if build.library(isa) is None:
        pytest.skip(f"no {isa} build: {build.status(isa)}")
    so = build.library_file(isa)
    if so is None:
        pytest.skip(f"the {isa} build is in a private temporary directory: {build.status(isa)}")
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)],
                          capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    scalar = sum(text.count(op) for op in ("vinsertps", "vextractps"))
    assert scalar < 100, scalar
    zmm = text.count("zmm")
    assert (zmm > 1000) if isa.startswith("avx512") else (zmm == 0), zmm
    # AVX-512's other marks, which 256-bit code can carry too (EVEX: the mask registers,
    # xmm/ymm 16-31): an AVX2 machine would stop on any of them (SIGILL)
    evex = len(re.findall(r"%k[0-7]\b|%[xy]mm(?:1[6-9]|2[0-9]|3[01])\b", text))
    assert (evex > 100) if isa.startswith("avx512") else (evex == 0), evex


QEMU_X86 = "qemu-x86_64"


@pytest.mark.slow
@pytest.mark.skipif(
    "avx2" not in X86 or not (shutil.which("g++") and shutil.which(QEMU_X86)),
    reason=f"needs the avx2 build, g++ and {QEMU_X86} (Debian: qemu-user)",
)
def test_the_avx2_build_passes_on_a_cpu_without_avx512(tmp_path):
    """The AVX2 build's self-test on an emulated Haswell (qemu-user's TCG: AVX2 and FMA,
    no AVX-512), where an AVX-512 instruction on any path it runs stops it with SIGILL:
    what an AVX2-only machine would do, shown on this one. TCG emulates each vector
    instruction (all 25 checks: 5 minutes), so it runs one check of each loop family
    (about a minute); the objdump test above reads every instruction of the build."""
    checks = ("dense", "window 40", "decode, GQA, split", "16 rows", "varlen",
              "paged, 12 heads", "cascade, decode", "exp2", "skinny linear")  # fmt: skip
    out = _build_and_run("g++", "avx2", tmp_path, [QEMU_X86, "-cpu", "Haswell"], checks=checks)
    assert "avx2 build" in out and f"{len(checks)} passed, 0 failed" in out
