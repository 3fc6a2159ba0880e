import os

import pytest
import torch

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
