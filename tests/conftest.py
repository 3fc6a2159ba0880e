import os

import pytest
import torch

# Without a GPU the triton backend's kernels run under Triton's interpreter, which must be
# on before anything imports triton (torch.compile does): set here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
