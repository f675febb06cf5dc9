"""Forward (and training-step) times of tuning variants in one process, interleaved: which of two
settings of a knob is faster, measured side by side.

    VARIANTS='{"on": {}, "off": {"fast_softplus": false}}' \\
        python tools/variant_times.py --cases "B1 T8192 H64 softplus" --profile --train

A variant maps fields of the Triton backend's ``plan.Tuning`` to the values they take while that
variant runs (``plan.tuned``; a launch field as a list [warps, stages, register cap]); every variant is timed ``--rounds`` times (triton.testing.do_bench
medians), round by round, so that drifts of the GPU's clock fall on all of them alike. ``--profile``
prints the per-kernel times of each variant's first round (tools/profile_kernels.py; with
``--train``, of the training step too), ``--error``
the relative RMS error against the float64 reference, ``--train`` a training step's time too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing as tt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import _reference, case_named  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402


def tuning(settings: dict):
    """``plan.tuned`` with a variant's settings (lists become tuples: launch fields)."""
    from fastkda.backends.triton.plan import Launch, Tuning, tuned

    launches = {n for n, f in Tuning.__dataclass_fields__.items() if f.default.__class__ is Launch}
    return tuned(**{k: Launch(*v) if k in launches else tuple(v) if isinstance(v, list) else v
                    for k, v in settings.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="B1 T8192 H64", type=lambda x: x.split(","))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--error", action="store_true")
    ap.add_argument("--train", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("FASTKDA_BACKEND", "triton")
    import fastkda
    from fastkda.testing import rel_rms

    variants = json.loads(os.environ.get("VARIANTS", '{"as is": {}}'))
    for case in a.cases:
        c = case_named(case)
        x, kw = c.inputs()
        if a.train:
            xg, kwg = c.inputs(grad=True)
            leaves = [*xg.values(), kwg["A_log"], kwg["dt_bias"]]
            do = torch.randn_like(xg["v"])
        fwd = {n: [] for n in variants}
        step = {n: [] for n in variants}
        for rnd in range(a.rounds):
            for name, settings in variants.items():
                scope = tuning(settings)
                scope.__enter__()
                with torch.inference_mode():
                    call = lambda: fastkda.chunk_kda(**x, **kw)  # noqa: E731
                    if rnd == 0 and a.error:
                        ref = _reference(x, kw)
                        print(f"  error [{case} / {name}] {rel_rms(call()[0][ref[1]], ref[0]):.3e}", flush=True)
                    fwd[name].append(tt.do_bench(call, warmup=25, rep=150, return_mode="median"))
                    if rnd == 0 and a.profile:
                        times = sorted(kernel_times(call).items(), key=lambda r: -r[1][0])
                        print(f"  [{case} / {name}] " + ", ".join(f"{k[:28]} {v[0]:.3f}" for k, v in times), flush=True)
                if a.train:
                    train = lambda: torch.autograd.grad(fastkda.chunk_kda(**xg, **kwg)[0], leaves, do)  # noqa: E731
                    step[name].append(tt.do_bench(train, warmup=10, rep=100, return_mode="median"))
                    if rnd == 0 and a.profile:
                        times = sorted(kernel_times(train).items(), key=lambda r: -r[1][0])
                        print(f"  [{case} / {name} / training] " + ", ".join(
                            f"{k[:28]} {v[0]:.3f}" for k, v in times if v[0] >= 0.01), flush=True)
                scope.__exit__(None, None, None)
        for label, res in (("forward", fwd), ("training step", step)):
            if any(res.values()):
                print(f"{case} {label}: " + "  ".join(
                    f"{n} {min(v):.3f} ms ({' / '.join(f'{t:.3f}' for t in v)})" for n, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
