import os

import pytest
import torch

from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build

# Without a GPU the triton backend's kernels run on Triton's interpreter. Triton reads
# the variable when a kernel is defined, so it is set here, before any test module can
# import them (tests/test_triton.py and the cross-backend fuzz test both reach them).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The native kernel's speed against torch's is measured once per machine and decides
# whether dense plans run on it (backends/blockwise/native/calibrate.py). Tests of results
# want the kernel to run every plan it can, whatever this machine's speed; the tests of
# that decision (and the speed guard) set or clear the variable themselves.
os.environ.setdefault("ATTNKIT_NATIVE_SPEED", "fast")

# Tolerances against the float64 reference, keyed by dtype.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """xdist already runs one process per core; intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def kernel_isas() -> list[str]:
    """One build of each vector width this CPU can execute, best first: an AVX-512 machine
    runs this whole module on its AVX-512 build and again on its AVX2 build."""
    widths = {"avx512-amx": 16, "avx512-bf16": 16, "avx512": 16, "avx2": 8, "neon": 4}
    chosen: dict[int, str] = {}
    for name in build.host_isas():
        chosen.setdefault(widths[name], name)
    return list(chosen.values()) or ["none"]


@pytest.fixture(scope="module", params=kernel_isas())
def isa(request):
    """The requesting test (or module, by ``usefixtures``) once per native build this CPU
    runs, one per vector width (``ATTNKIT_NATIVE_ISA``)."""
    before = os.environ.get("ATTNKIT_NATIVE_ISA")
    os.environ["ATTNKIT_NATIVE_ISA"] = request.param
    try:
        if not native.available():
            pytest.skip(f"no native kernel: {native.status()}")
        assert native.isa() == request.param
        yield request.param
    finally:
        if before is None:
            os.environ.pop("ATTNKIT_NATIVE_ISA", None)
        else:
            os.environ["ATTNKIT_NATIVE_ISA"] = before


@pytest.fixture
def native_routes(monkeypatch) -> list[str]:
    """The native entry points a call ran, in order: "forward" (one pass), "suffix mask"
    (one pass whose mask covers the last keys alone: a draft tree over cache ++ tree) or
    "cascade" (a cascade's two passes and their merge). Clear it between hypothesis
    examples."""
    seen: list[str] = []
    forward, cascade = native.forward, native.cascade

    def spy_forward(*args, **kwargs):
        seen.append("forward" if kwargs.get("suffix_mask") is None else "suffix mask")
        return forward(*args, **kwargs)

    def spy_cascade(*args, **kwargs):
        seen.append("cascade")
        return cascade(*args, **kwargs)

    monkeypatch.setattr(native, "forward", spy_forward)
    monkeypatch.setattr(native, "cascade", spy_cascade)
    return seen


# The modules that take longest (seconds on a 2-core Zen 3, session 13), longest first.
# `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder: each worker
# takes the next whole module when it runs low, in collection order, so the long ones go
# first and the short ones fill in at the end (xdist's default order, most tests first,
# left a single 28-45 s module running alone at the end: 378 s instead of about 325).
# Scheduling only: a module missing here runs after these, in its usual order.
LONGEST_FIRST = (
    "test_distributed.py",  # 44 s
    "test_triton_compile.py",  # 42
    "test_compile.py",  # 42
    "test_gpt.py",  # 34
    "test_cli_train.py",  # 33
    "test_native_build.py",  # 26
    "test_viz_page.py",  # 25
    "test_native_selftest.py",  # 25
    "test_triton.py",  # 24
    "test_explain_page.py",  # 24
    "test_fuzz.py",  # 21
    "test_viz.py",  # 21
    "test_backends_matrix.py",  # 19
    "test_triton_codegen.py",  # 18
    "test_bare_install.py",  # 18
    "test_bench.py",  # 17
    "test_mods_catalogue.py",  # 15
    "test_checkpoint_kill.py",  # 15
    "test_readme.py",  # 14
    "test_native_mask_mods.py",  # 13
)


#: ``ATTNKIT_FUZZ_EXAMPLES=N`` (``make fuzz``): every hypothesis test runs at least N
#: random examples (not derandomized, no example database) instead of the few a CI run
#: can afford. Session 20's run at 1,000 found a double rounding of bf16 outputs in
#: cascade_attention and tree_attention with sinks, and two yardsticks too weak to judge.
FUZZ_EXAMPLES = "ATTNKIT_FUZZ_EXAMPLES"


def _widen(item) -> None:
    """``item``'s hypothesis settings with :data:`FUZZ_EXAMPLES` random examples. (Hypothesis
    refuses a second ``@settings`` on a test, so this sets the attribute it reads, an
    internal one: tests/test_fuzz_examples.py checks that it still takes effect.)"""
    from hypothesis import Phase, settings

    fn = item.obj
    base = getattr(fn, "_hypothesis_internal_use_settings", None) or settings()
    fn._hypothesis_internal_use_settings = settings(
        base, max_examples=max(int(os.environ[FUZZ_EXAMPLES]), base.max_examples),
        derandomize=False, database=None, deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Modules in :data:`LONGEST_FIRST` order, then the rest as collected (each module's
    own tests keep their order: only whole modules move); with :data:`FUZZ_EXAMPLES`
    set, every hypothesis test widened (:func:`_widen`)."""
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (a stable sort)
    if os.environ.get(FUZZ_EXAMPLES):
        for item in items:
            if hasattr(getattr(item, "obj", None), "hypothesis"):
                _widen(item)
