"""Test tiers: CPU (default; Triton kernels under TRITON_INTERPRET=1 on CPU tensors) and GPU
(the same tests at larger shapes, plus tests marked ``gpu``). FASTKDA_TEST_SHARD=i/n runs the i-th
of n disjoint shards of whatever is selected (a tier split over several time-limited runs)."""

import contextlib
import os
import sys
import zlib

import torch

if not torch.cuda.is_available():  # must precede the first import of the Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif torch.cuda.device_count() > 1 and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    # GPU tier under pytest-xdist: worker i runs on GPU i mod n, so one run uses every visible GPU
    torch.cuda.set_device(int(os.environ["PYTEST_XDIST_WORKER"][2:]) % torch.cuda.device_count())

import pytest  # noqa: E402

from fastkda import platform  # noqa: E402
from fastkda.backends import backends  # noqa: E402
from fastkda.testing import poisoned  # noqa: E402

GPU = platform.device == "cuda"
DEVICE = platform.device
BACKENDS = [b.name for b in backends()]
BACKWARD_BACKENDS = [b.name for b in backends() if "chunk_kda" in b.differentiable]


def _record_launches(path: str):
    """Append every interpreted kernel launch (module, kernel, argument types, constexprs, launch
    options) to ``path``, for tools/compile_check.py."""
    import json

    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    from compile_check import launch_record

    def recording_run(self, *args, grid, warmup, **kwargs):
        bound = {**dict(zip(self.arg_names, args)), **kwargs}
        rec = launch_record(self, {k: v for k, v in bound.items() if k not in ("num_warps", "num_stages", "maxnreg")},
                            kwargs)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


if os.environ.get("FASTKDA_RECORD_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    _record_launches(os.environ["FASTKDA_RECORD_LAUNCHES"])

BOUNDS_CHECKED = platform.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
if BOUNDS_CHECKED:  # every interpreted load, store and atomic inside the launch's tensors (bounds.py)
    import bounds

    bounds.install()


def pytest_runtest_logreport(report):
    """With FASTKDA_FAILURE_LOG set, every failure's report is appended there as it happens (a GPU
    run cut short by a time limit still says why its tests failed)."""
    path = os.environ.get("FASTKDA_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # once, from the controller
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def shard_of(spec: str) -> tuple[int, int]:
    """FASTKDA_TEST_SHARD's "i/n" as (i, n), 1 <= i <= n; anything else is a usage error."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"FASTKDA_TEST_SHARD must be i/n with 1 <= i <= n, got {spec!r}")
    return i, n


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="GPU tier: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
    spec = os.environ.get("FASTKDA_TEST_SHARD")
    if spec:  # shard i of n: the tests whose id hashes to i - 1 modulo n (the same split on every machine)
        i, n = shard_of(spec)
        keep, drop = [], []
        for it in items:
            (keep if zlib.crc32(it.nodeid.encode()) % n == i - 1 else drop).append(it)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _within_bounds():
    """No interpreted kernel touched memory outside its tensor arguments during the test."""
    if BOUNDS_CHECKED:
        bounds.take()
    yield
    if BOUNDS_CHECKED:
        seen = bounds.take()
        assert not seen, "out of bounds: " + "; ".join(seen[:3])


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every output a kernel allocates starts as NaN."""
    with poisoned():
        yield
    if GPU:  # hand cached blocks back: test workers share one GPU
        torch.cuda.empty_cache()


TEST_SEED = 0  # this test's seed (set by _fresh_seed)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """A fresh seed per test, printed so that ``FASTKDA_TEST_SEED=<seed>`` replays a failure: it
    seeds torch's global generator (what a test draws without ``rng``) and ``rng``, and
    ``TEST_SEED`` holds it for tests that build identical modules twice."""
    global TEST_SEED
    TEST_SEED = int(os.environ.get("FASTKDA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={TEST_SEED}")
    torch.manual_seed(TEST_SEED)
    yield


@pytest.fixture
def tune():
    """``tune(**fields)``: Triton tuning overrides (``plan.tuned``) until the test ends."""
    from fastkda.backends.triton.plan import tuned

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tuned(**changes))


@pytest.fixture(params=["inline", "kernel"])
def check_path(request, tune):
    """Where a Triton pool call checks its indices: in the decode programs (the small calls of
    these tests) or, with the inline limit at 0, in the check kernel launched first."""
    if request.param == "kernel":
        tune(decode_inline_check=0)
    return request.param


@pytest.fixture
def launch_log():
    """The Triton launches of the test (``common.recorded_launches``), in order."""
    from fastkda.backends.triton.common import recorded_launches

    with recorded_launches() as log:
        yield log


@pytest.fixture
def rng():
    """A generator seeded with this test's seed."""
    return torch.Generator().manual_seed(TEST_SEED)
