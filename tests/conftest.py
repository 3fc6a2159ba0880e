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
    widths = {"avx512-bf16": 16, "avx512": 16, "avx2": 8, "neon": 4}
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
