"""Compile a library's kernels for benchmark cases ahead of a timed run, one call per case.

    FLA_CACHE_RESULTS=0 python benchmarks/warm.py fla forward "B1 T8192 H96,varlen 6 seqs H96"
    python benchmarks/warm.py fla backward "B4 T4096 H32 safe"

Several such processes side by side (one per case) fill a Triton cache that the timed run
(bench_ops.py, on a quiet GPU) then loads instead of compiling: fla-core's cold compilation takes
1.5 to 4 minutes per case. With FLA_CACHE_RESULTS=0 fla-core keeps no autotuning results, so its
timed run still autotunes, on the quiet GPU, from the compiled kernels.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("FASTKDA_BACKEND", "triton")
from bench_ops import _impls, case_named  # noqa: E402


def warm(lib: str, suite: str, case: str) -> float:
    """Seconds of one call (forward, or forward and backward) of ``lib`` on ``case``."""
    c = case_named(case, suite)  # exits naming the cases if there is none of that name
    fn = _impls()[lib]
    t0 = time.perf_counter()
    if suite == "forward":
        x, kw = c.inputs()
        with torch.inference_mode():
            fn(**x, **kw)
    else:
        x, kw = c.inputs(grad=True)
        o, _ = fn(**x, **kw)
        torch.autograd.grad(o, [*x.values(), kw["A_log"], kw["dt_bias"]], torch.randn_like(o))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    if len(sys.argv) != 4 or sys.argv[2] not in ("forward", "backward"):
        raise SystemExit("usage: warm.py LIB {forward|backward} \"case1,case2\"")
    lib, suite, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    for case in cases:
        print(f"warm {lib} {suite} {case}: {warm(lib, suite, case):.1f} s", flush=True)


if __name__ == "__main__":
    main()
