"""The test harness itself: FASTKDA_TEST_SHARD splits a selection into disjoint shards that
together run every test, and refuses a malformed value."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def collected(shard: str | None, target: str = "tests/test_registry.py") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FASTKDA_TEST_SHARD", "PYTEST_XDIST_WORKER")}
    if shard is not None:
        env["FASTKDA_TEST_SHARD"] = shard
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                           "no:xdist", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def ids(out: subprocess.CompletedProcess) -> set[str]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_shards_partition_the_selection():
    whole = ids(collected(None))
    shards = [ids(collected(f"{i}/3")) for i in (1, 2, 3)]
    assert len(whole) >= 6 and all(shards), [len(s) for s in shards]
    assert set().union(*shards) == whole
    assert sum(len(s) for s in shards) == len(whole)  # disjoint


@pytest.mark.parametrize("spec", ["0/3", "4/3", "1", "a/b", "1/0"])
def test_bad_shard_refused(spec):
    out = collected(spec)
    assert out.returncode != 0
    assert f"FASTKDA_TEST_SHARD must be i/n with 1 <= i <= n, got {spec!r}" in out.stdout + out.stderr
