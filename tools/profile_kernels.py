"""Per-kernel GPU time of one chunk_kda forward (and training step) of fastkda and fla-core, from
the PyTorch profiler: which launch costs what.

    python tools/profile_kernels.py [--case "B1 T8192 H64"] [--backward] [--libs fastkda]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_ops import _impls, case_named  # noqa: E402


def kernel_times(fn, reps=5) -> dict:
    """{kernel name: (GPU ms per call of fn, launches per call)} from the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.self_device_time_total / reps / 1e3, e.count // reps) for e in p.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0}


def report(fn, reps=5):
    rows = kernel_times(fn, reps)
    print(f"  {'kernel':60s} {'ms':>8s} {'calls':>6s}")
    for k, (ms, n) in sorted(rows.items(), key=lambda r: -r[1][0]):
        print(f"  {k[:60]:60s} {ms:8.3f} {n:6d}")
    print(f"  {'total':60s} {sum(ms for ms, _ in rows.values()):8.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="B1 T8192 H64")
    ap.add_argument("--gate", default=None, help="override the case's gate: safe or softplus")
    ap.add_argument("--backward", action="store_true", help="profile a training step too")
    ap.add_argument("--libs", default=None, help="comma list of the libraries to profile (default: all found)")
    a = ap.parse_args()
    os.environ.setdefault("FASTKDA_BACKEND", "triton")
    case = case_named(a.case)
    for lib, fn in _impls().items():
        if a.libs and lib not in a.libs.split(","):
            continue
        x, kw = case.inputs(a.gate, grad=a.backward)
        print(f"{lib}: forward, {a.case}")
        with torch.inference_mode():
            report(lambda: fn(**x, **kw))
        if a.backward:
            leaves = [*x.values(), kw["A_log"], kw["dt_bias"]]
            do = torch.randn_like(x["v"])
            print(f"{lib}: forward + backward, {a.case}")
            report(lambda: torch.autograd.grad(fn(**x, **kw)[0], leaves, do))


if __name__ == "__main__":
    main()
