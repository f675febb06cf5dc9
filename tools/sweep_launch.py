"""Launch options (warps, register cap) of the chunk kernels, per kernel, on the current GPU.

Every configuration is applied to all stage-1 and backward chunk kernels at once; one training
step of a benchmark case runs under the PyTorch profiler and each kernel's time is read apart.
Compilation runs first in parallel processes (one per configuration, sharing the Triton cache),
the timing afterwards in one process:

    python tools/sweep_launch.py [--case "B1 T8192 H64"] [--gates safe,softplus] [--jobs 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_ops import case_named  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402

CONFIGS = [(2, None), (4, None), (8, None), (2, 128), (4, 128), (8, 128), (4, 96), (8, 96)]


def tuning(cfg, sets):
    """``plan.tuned`` with every stage-1 and chunk-backward launch at ``cfg`` (warps, register cap),
    after the ``--set`` overrides."""
    import ast

    from fastkda.backends.triton.plan import Launch, Tuning, tuned

    names = ("gates", "gates_whole", "intra", "intra_whole", "inverse", "wu", "wu_x16", "bwd_state", "bwd_v", "bwd_k",
             "bwd_gate", "bwd_gate_block", "bwd_dg", "bwd_dg_softplus")
    fields = {n: Launch(cfg[0], 1, cfg[1]) for n in names}
    for item in sets:
        name, value = item.split("=", 1)
        if name not in Tuning.__dataclass_fields__:
            raise SystemExit(f"--set: no Tuning field {name!r}")
        fields[name] = ast.literal_eval(value)
    return tuned(**fields)


def step(case, gate):
    import fastkda

    x, kw = case_named(case).inputs(gate, grad=True)
    leaves = [*x.values(), kw["A_log"], kw["dt_bias"]]
    do = torch.randn_like(x["v"])
    return lambda: torch.autograd.grad(fastkda.chunk_kda(**x, **kw)[0], leaves, do)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="B1 T8192 H64")
    ap.add_argument("--gates", default="safe,softplus")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a Tuning field (fastkda.backends.triton.plan) for every configuration, e.g. slice=64")
    ap.add_argument("--configs", default=None, metavar="W:CAP,...",
                    help="the (warps, register cap) pairs to try, e.g. 4:0,8:0,2:128 (0: no cap); default: all")
    ap.add_argument("--only", type=int, default=None, help="(internal) compile configuration i and exit")
    a = ap.parse_args()
    if a.configs:
        CONFIGS[:] = [(int(w), int(c) or None) for w, c in (x.split(":") for x in a.configs.split(","))]
    os.environ.setdefault("FASTKDA_BACKEND", "triton")
    gates = a.gates.split(",")
    if a.only is not None:
        with tuning(CONFIGS[a.only], a.set):
            for gate in gates:
                step(a.case, gate)()
        torch.cuda.synchronize()
        return
    procs, running = list(range(len(CONFIGS))), []
    while procs or running:
        while procs and len(running) < a.jobs:
            i = procs.pop(0)
            extra = [*(f"--set={x}" for x in a.set), *(["--configs", a.configs] if a.configs else [])]
            running.append(subprocess.Popen([sys.executable, __file__, "--case", a.case, "--gates", a.gates, *extra,
                                             "--only", str(i)]))
        running[0].wait()
        running.pop(0)
    for gate in gates:
        fn = step(a.case, gate)
        rows = {}
        for cfg in CONFIGS:
            with tuning(cfg, a.set):
                times = kernel_times(fn)
            for name, (ms, _) in times.items():
                if "kda_fwd" in name or "kda_bwd" in name:
                    rows.setdefault(name, {})[cfg] = ms
        print(f"\n{a.case}, {gate} gate {' '.join(a.set)}: ms per kernel and (warps, register cap)")
        print(f"{'kernel':28s}" + "".join(f"{str(c):>12s}" for c in CONFIGS))
        for name, row in sorted(rows.items()):
            print(f"{name[:28]:28s}" + "".join(f"{row.get(c, float('nan')):12.3f}" for c in CONFIGS), flush=True)


if __name__ == "__main__":
    main()
