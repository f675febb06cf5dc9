"""``fastkda bench``: time the operators on this machine over a sweep of sequence lengths.

Implementations: fastkda (the backend it picks for the call, named in the table, or the one forced
with ``--backend``), fla-core's ``fla.ops.kda`` when it is installed and the device is a GPU, and
the per-token reference loop otherwise (float32, short lengths only).
Prints a table and writes ``bench.md`` and ``bench.png`` (time against sequence length, one line
per implementation) into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import textwrap
import time

import torch
import torch.nn.functional as F

from . import platform
from .api import chunk_kda, explain, fused_recurrent_kda
from .backends import backends, use_backend
from .naive import naive_recurrent_kda

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        return items


def _time_ms(fn, device: str, repeats: int) -> float:
    """Median wall time of fn in milliseconds, after one warm-up call."""
    if device.startswith("cuda"):
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(B, T, H, K, dtype, device, grad):
    q = torch.randn(B, T, H, K, device=device, dtype=dtype)
    k = torch.randn(B, T, H, K, device=device, dtype=dtype)
    v = torch.randn(B, T, H, K, device=device, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, device=device))
    beta = torch.rand(B, T, H, device=device)
    ts = dict(q=q, k=k, v=v, g=g, beta=beta)
    if grad:
        for t in ts.values():
            t.requires_grad_(True)
    return ts


def _impls(op: str, device: str):
    impls = {"fastkda": chunk_kda if op == "chunk" else fused_recurrent_kda}
    if device.startswith("cuda"):
        try:
            from fla.ops import kda as fla_kda

            impls["fla-core"] = fla_kda.chunk_kda if op == "chunk" else fla_kda.fused_recurrent_kda
        except ImportError:
            pass
    if "fla-core" not in impls:
        impls["reference loop"] = lambda q, k, v, g, beta, **kw: naive_recurrent_kda(
            q, k, v, g, beta, dtype=torch.float32, use_qk_l2norm_in_kernel=True)
    return impls


def run(args) -> list[dict]:
    device = args.device or platform.device
    dtype = DTYPES[args.dtype]
    rows = []
    cases = [(op, T) for op in args.ops for T in args.seqlens]
    for op, T in _progress(cases, "fastkda bench"):
        x = _inputs(args.batch, T, args.heads, args.dim, dtype, device, args.backward and op == "chunk")
        for name, fn in _impls(op, device).items():
            if name == "reference loop" and T > args.max_reference_len:
                continue

            def call(fn=fn, ref=name == "reference loop"):
                o, _ = fn(**x) if ref else fn(**x, use_qk_l2norm_in_kernel=True)
                if args.backward and op == "chunk":
                    o.float().sum().backward()

            try:
                if name == "fastkda":  # say which backend serves it
                    name = f"fastkda ({explain(fn, **x, use_qk_l2norm_in_kernel=True)[0]})"
                ms = _time_ms(call, device, args.repeats)
            except Exception as e:  # an implementation that cannot run this case is reported, not fatal
                print(f"{name} {op} T={T}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            rows.append({"op": op, "impl": name, "T": T, "ms": ms})
    return rows


def report(rows, args) -> str:
    device = args.device or platform.device
    mode = "forward+backward" if args.backward else "forward"
    head = (f"fastkda bench on {device} ({platform.device_name(device)}), torch {torch.__version__}; "
            f"B={args.batch}, H={args.heads}, K=V={args.dim}, {args.dtype}, {mode}")
    lines = [head, "", "| op | implementation | T | ms |", "|---|---|---:|---:|"]
    lines += [f"| {r['op']} | {r['impl']} | {r['T']} | {r['ms']:.3f} |" for r in rows]
    return "\n".join(lines)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, impl in sorted({(r["op"], r["impl"]) for r in rows}):
        pts = sorted((r["T"], r["ms"]) for r in rows if r["op"] == op and r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} ({op})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time (ms)")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fastkda bench", description=__doc__)
    p.add_argument("--device", default=None)
    p.add_argument("--ops", default="chunk,recurrent", type=lambda s: s.split(","))
    p.add_argument("--seqlens", default="256,512,1024,2048,4096", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--backward", action="store_true", help="time forward+backward of chunk_kda")
    p.add_argument("--backend", default=None, help="force one fastkda backend (as FASTKDA_BACKEND), e.g. triton")
    p.add_argument("--repeats", type=int, default=5, help="timed runs on the CPU")
    p.add_argument("--max-reference-len", type=int, default=1024)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    for op in args.ops:
        if op not in ("chunk", "recurrent"):
            p.error(f"--ops takes chunk and/or recurrent, got {op!r}")
    if args.dtype is None:
        args.dtype = "bf16" if (args.device or platform.device) != "cpu" else "fp32"
    if args.backend is not None and args.backend not in [b.name for b in backends()]:
        p.error(f"--backend takes one of {', '.join(b.name for b in backends())}, got {args.backend!r}")
    with use_backend(args.backend) if args.backend else contextlib.nullcontext():  # else FASTKDA_BACKEND holds
        rows = run(args)
    md = report(rows, args)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md + "\n")
    plot(rows, os.path.join(args.out, "bench.png"), md.splitlines()[0])
    print(f"wrote {os.path.join(args.out, 'bench.md')} and bench.png")
    return 0
