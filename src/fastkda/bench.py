"""``fastkda bench``: time the operators on this machine over a sweep of sequence lengths.

Implementations: fastkda (the backend it picks for the call, named in the table, or the one forced
with ``--backend``), fla-core's ``fla.ops.kda`` when it is installed and the device is a GPU, and
the per-token reference loop otherwise (float32, short lengths only).
Prints a table and writes ``bench.md`` and, with matplotlib, ``bench.png`` (time against sequence
length, one line per implementation) into ``--out``. A fastkda backend that cannot run is an error
(exit code 2 before the sweep, 1 during it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import textwrap
import time

import torch
import torch.nn.functional as F

from . import platform
from .api import chunk_kda, explain, fused_recurrent_kda
from .backends import use_backend
from .cli_args import Parser, backend_arg, backend_error, device_arg
from .naive import naive_recurrent_kda

DESCRIPTION = """Times chunk_kda and fused_recurrent_kda on this machine over a sweep of sequence lengths,
beside fla-core's fla.ops.kda (when it is installed and the device is a GPU) or the per-token
reference loop (otherwise; short lengths only). Prints a table naming the backend that served
fastkda and writes bench.md and bench.png (with matplotlib) into --out. Exit code 0 on success,
1 when fastkda fails during the sweep, 2 for an argument error or a backend that cannot run here."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Progress:
    """A tqdm bar over ``items`` when tqdm is installed, else one line per item on stderr; ``note``
    prints a line outside the bar."""

    def __init__(self, items, desc):
        self.items, self.desc = list(items), desc
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(self.items, desc=desc, file=sys.stderr)

    def __iter__(self):
        if self.bar is not None:
            yield from self.bar
            return
        for i, item in enumerate(self.items):
            print(f"{self.desc}: {i + 1}/{len(self.items)}", file=sys.stderr)
            yield item

    def note(self, msg):
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()


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


class FastkdaFailed(Exception):
    """fastkda itself could not run a case of the sweep."""


def run(args) -> list[dict]:
    """The timed rows; raises FastkdaFailed when fastkda cannot run a case (a comparison
    implementation that cannot is noted and left out)."""
    device = args.device or platform.device
    dtype = DTYPES[args.dtype]
    rows = []
    cases = [(op, T) for op in args.ops for T in args.seqlens]
    progress = _Progress(cases, "fastkda bench")
    try:
        for op, T in progress:
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
                except Exception as e:
                    msg = f"{name} {op} T={T}: {type(e).__name__}: {e}"
                    if name.startswith("fastkda"):
                        raise FastkdaFailed(msg) from e
                    progress.note(msg)
                    continue
                rows.append({"op": op, "impl": name, "T": T, "ms": ms})
    finally:
        progress.close()
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


def _int_list(value: str) -> list[int]:
    """argparse type of --seqlens: comma-separated positive integers."""
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers such as 256,1024; got {value!r}")
    return out


def _ops(value: str) -> list[str]:
    """argparse type of --ops: chunk and/or recurrent, comma-separated."""
    out = value.split(",")
    bad = [op for op in out if op not in ("chunk", "recurrent")]
    if bad:
        raise argparse.ArgumentTypeError(f"takes chunk and/or recurrent, comma-separated; got {value!r}")
    return out


def _positive(value: str) -> int:
    """argparse type of the sizes: a positive integer."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a positive integer; got {value!r}")
    return n


def parser() -> Parser:
    p = Parser(prog="fastkda bench", description=DESCRIPTION)
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N (default: the GPU when there is one, else cpu)")
    p.add_argument("--ops", default="chunk,recurrent", type=_ops,
                   help="operators to time: chunk (chunk_kda) and/or recurrent (fused_recurrent_kda); "
                        "default chunk,recurrent")
    p.add_argument("--seqlens", default="256,512,1024,2048,4096", type=_int_list,
                   help="sequence lengths T, comma-separated; default 256,512,1024,2048,4096")
    p.add_argument("--batch", type=_positive, default=1, help="batch size B; default 1")
    p.add_argument("--heads", type=_positive, default=4, help="heads H; default 4")
    p.add_argument("--dim", type=_positive, default=64, help="head dimension K = V; default 64")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="input dtype; default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--backward", action="store_true", help="time forward+backward of chunk_kda")
    p.add_argument("--backend", type=backend_arg, default=None,
                   help="force fastkda's backend, as FASTKDA_BACKEND does (torch or triton)")
    p.add_argument("--repeats", type=_positive, default=5,
                   help="timed calls per case on the CPU, after one warm-up (GPU: triton.testing.do_bench); default 5")
    p.add_argument("--max-reference-len", type=_positive, default=1024,
                   help="longest T timed with the per-token reference loop; default 1024")
    p.add_argument("--out", default="bench-out", help="folder for bench.md and bench.png; default bench-out")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    device = args.device or platform.device
    if args.dtype is None:
        args.dtype = "bf16" if device != "cpu" else "fp32"
    problem = backend_error(args.backend, device, DTYPES[args.dtype], args.backward, args.heads, args.dim)
    if problem:
        print(f"{p.prog}: error: {problem}", file=sys.stderr)
        return 2
    # optional dependencies (the bench extra), checked before the sweep
    can_plot = importlib.util.find_spec("matplotlib") is not None
    lacking = [what for mod, what in (("matplotlib", "no plot"), ("tqdm", "no progress bar"))
               if importlib.util.find_spec(mod) is None]
    if lacking:
        print(f"{p.prog}: {', '.join(lacking)}: matplotlib and tqdm come with pip install 'fastkda[bench]'",
              file=sys.stderr)
    try:
        with use_backend(args.backend) if args.backend else contextlib.nullcontext():  # else FASTKDA_BACKEND holds
            rows = run(args)
    except FastkdaFailed as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    md = report(rows, args)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md + "\n")
    wrote = [os.path.join(args.out, "bench.md")]
    if can_plot:
        plot(rows, os.path.join(args.out, "bench.png"), md.splitlines()[0])
        wrote.append(os.path.join(args.out, "bench.png"))
    missing_plot = "" if can_plot else " (no plot without matplotlib: pip install 'fastkda[bench]')"
    print(f"wrote {' and '.join(wrote)}{missing_plot}")
    return 0
