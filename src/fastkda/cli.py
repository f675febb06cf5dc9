"""The fastkda command: ``fastkda check`` runs both operators over a matrix of options against the
float64 reference on the best available device and prints a pass/fail table; ``fastkda bench`` is
in :mod:`fastkda.bench`, and the argument types both take in :mod:`fastkda.cli_args`. Argument
errors are one line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from . import __version__, platform
from .api import chunk_kda, explain, fused_recurrent_kda
from .backends import use_backend
from .cli_args import Parser, backend_arg, backend_error, device_arg
from .testing import (AXES, Case, gate_input_error, gate_param_scales, gate_slope, grow, make_inputs, param_error,
                      reference, rel_rms, tolerance)

USAGE = """usage: fastkda {check,bench} [options]
       fastkda --version

  check  correctness of both operators against the float64 reference
  bench  timings over a sweep of sequence lengths

"fastkda check --help" and "fastkda bench --help" list their options."""

CHECK_DESCRIPTION = """Runs chunk_kda (forward and backward) and fused_recurrent_kda over a matrix of options
(dense, variable-length, grouped value heads, gates, dtypes) against the float64 reference and prints
a pass/fail table. Exit code 0 when every case passes, 1 when one fails, 2 for an argument error."""


GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def _check_case(name: str, case: Case, device: str, backward: bool, seed: int):
    """Rows (op, case, backend, error, limit) for one case."""
    gen = torch.Generator().manual_seed(seed)
    x = make_inputs(case, device=device, requires_grad=backward, generator=gen)
    rows = []
    backend, _ = explain(chunk_kda, **x, chunk_size=case.chunk_size)
    tol = tolerance(case.dtype, backend)
    o, s = chunk_kda(**x, chunk_size=case.chunk_size)
    o_r, s_r = reference(x)
    err = max(rel_rms(o, o_r), rel_rms(s, s_r) if s is not None else 0.0)
    rows.append(("chunk_kda fwd", name, backend, err, tol))
    if backward:
        leaves = [x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)]
        do = torch.randn(o.shape, generator=gen).to(o)
        ds = torch.randn(s.shape, generator=gen).to(s) if s is not None else None
        loss = (o.float() * do.float()).sum() + ((s * ds).sum() if s is not None else 0)
        loss_r = (o_r * do.double()).sum() + ((s_r * ds.double()).sum() if s is not None else 0)
        names = [n for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)]
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
        want = torch.autograd.grad(loss_r, leaves, allow_unused=True)
        # dA_log, ddt_bias: sums whose terms cancel, judged against the magnitude of their terms; dg of
        # an in-kernel activation in units of the activated gate's gradient (fastkda.testing)
        slope = gate_slope(x)
        scales = gate_param_scales(x, want[names.index("g")], slope)
        err = max(0.0 if b is None else param_error(a, b, scales[n]) if n in scales
                  else gate_input_error(a, b, slope) if n == "g" and slope is not None else rel_rms(a, b)
                  for n, a, b in zip(names, got, want))
        rows.append(("chunk_kda bwd", name, backend, err, tol))
    with torch.no_grad():
        rx = {k: (t.detach() if isinstance(t, torch.Tensor) else t) for k, t in x.items() if k != "safe_gate"}
        backend, _ = explain(fused_recurrent_kda, **rx)
        tol = tolerance(case.dtype, backend)
        o, s = fused_recurrent_kda(**rx)
        err = max(rel_rms(o, o_r), rel_rms(s, s_r) if s is not None else 0.0)
    rows.append(("fused_recurrent_kda", name, backend, err, tol))
    return rows


def check_parser() -> Parser:
    p = Parser(prog="fastkda check", description=CHECK_DESCRIPTION)
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N (default: the GPU when there is one, else cpu)")
    p.add_argument("--backend", type=backend_arg, default=None,
                   help="run every case on this backend, as FASTKDA_BACKEND does (torch or triton)")
    p.add_argument("--quick", action="store_true", help="six representative cases instead of all")
    p.add_argument("--no-backward", action="store_true", help="skip the gradients of chunk_kda")
    return p


def check(argv=None) -> int:
    p = check_parser()
    args = p.parse_args(argv)
    device = args.device or platform.device
    problem = backend_error(args.backend, device, torch.float32, not args.no_backward)
    if problem:
        print(f"{p.prog}: error: {problem}", file=sys.stderr)
        return 2
    names = list(AXES)
    if args.quick:
        names = ["dense", "varlen", "gva", "softplus", "safe_lb-5", "bf16"]
    print(f"fastkda check on {device} ({platform.device_name(device)}), torch {torch.__version__}")
    header = f"{'op':<22}{'case':<22}{'backend':<10}{'rel. RMS error':>16}{'limit':>10}  result"
    print(header)
    print("-" * len(header))
    failed, t0 = 0, time.perf_counter()
    with use_backend(args.backend) if args.backend else contextlib.nullcontext():  # else FASTKDA_BACKEND holds
        for i, name in enumerate(names):
            case = grow(AXES[name], device != "cpu")
            if device != "cpu" and case.T > 2048:
                case = case.replace(T=2048)
            try:
                rows = _check_case(name, case, device, not args.no_backward, seed=1234 + i)
            except Exception as e:  # report and carry on: the table is the product
                rows = [("chunk_kda", name, "?", float("inf"), 0.0)]
                print(f"  {name}: {type(e).__name__}: {e}", file=sys.stderr)
            for op, case_name, backend, err, tol in rows:
                ok = err <= tol
                failed += not ok
                print(f"{op:<22}{case_name:<22}{backend:<10}{err:>16.3e}{tol:>10.1e}  {'PASS' if ok else 'FAIL'}")
    print("-" * len(header))
    total = sum(1 for _ in names)
    print(f"{'all passed' if not failed else f'{failed} FAILED'} ({total} cases, {time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        print(f"fastkda {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        return check(rest)
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    print(f"fastkda: error: unknown command {cmd!r}; use check, bench or --version (see fastkda --help)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
