"""PyTorch backend vs the per-token reference loop on the CPU (same process, median of runs).

    python benchmarks/cpu_reference.py [--write]

chunk_kda forward and forward+backward at B=1, T=4096, H=4, K=V=64, float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fastkda import chunk_kda, naive_recurrent_kda, use_backend

from _report import environment, write_section


def inputs(B, T, H, K, V, grad):
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H, K) * 2)
    beta = torch.rand(B, T, H)
    ts = [q, k, v, g, beta]
    return [t.requires_grad_(grad) for t in ts]


def timed_pair(fa, fb, runs_a, runs_b):
    """Medians of fa and fb, runs interleaved so that machine noise hits both alike."""
    ta, tb = [], []
    for i in range(max(runs_a, runs_b)):
        for fn, out, n in ((fa, ta, runs_a), (fb, tb, runs_b)):
            if i < n:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    B, T, H, K, V = 1, 4096, 4, 64, 64
    rows = []
    for mode in ("forward", "forward+backward"):
        grad = mode != "forward"
        x = inputs(B, T, H, K, V, grad)

        def run_chunk():
            with use_backend("torch"), torch.set_grad_enabled(grad):
                o, _ = chunk_kda(*x)
                if grad:
                    o.sum().backward()

        def run_loop():
            with torch.set_grad_enabled(grad):
                o, _ = naive_recurrent_kda(*x, dtype=torch.float32)
                if grad:
                    o.sum().backward()

        run_chunk()  # warm-up
        t_chunk, t_loop = timed_pair(run_chunk, run_loop, args.runs, args.runs if not grad else 3)
        rows.append((mode, t_chunk, t_loop))
        print(f"{mode:18s} chunked {t_chunk * 1e3:9.1f} ms   per-token loop {t_loop * 1e3:9.1f} ms   {t_loop / t_chunk:6.1f}x")
    md = [
        f"Shape B={B}, T={T}, H={H}, K=V={K}, float32, pre-gated; {environment('cpu')}.",
        "",
        "| op | PyTorch backend `chunk_kda` (ms) | per-token reference loop (ms) | speed-up |",
        "|---|---:|---:|---:|",
    ]
    md += [f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.1f}x |" for m, a, b in rows]
    print("\n".join(md))
    if args.write:
        write_section("cpu-reference", "\n".join(md))


if __name__ == "__main__":
    main()
