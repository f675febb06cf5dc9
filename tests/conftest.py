"""Test tiers: CPU (default; Triton kernels under TRITON_INTERPRET=1 on CPU tensors) and GPU
(the same tests at larger shapes, plus tests marked ``gpu``)."""

import os

import torch

if not torch.cuda.is_available():  # must precede the first import of the Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastkda import platform  # noqa: E402
from fastkda.backends import backends  # noqa: E402
from fastkda.testing import poisoned  # noqa: E402

GPU = platform.device == "cuda"
DEVICE = platform.device
BACKENDS = [b.name for b in backends()]
BACKWARD_BACKENDS = [b.name for b in backends() if "chunk_kda" in b.differentiable]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="GPU tier: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every output a kernel allocates starts as NaN."""
    with poisoned():
        yield


@pytest.fixture
def rng():
    """A freshly seeded generator; the seed is printed so that ``FASTKDA_TEST_SEED=<seed>`` replays a
    failure."""
    seed = int(os.environ.get("FASTKDA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
