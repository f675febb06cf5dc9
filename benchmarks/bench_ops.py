"""fastkda against fla-core in one process on a GPU: time, ratio, bandwidth, memory, accuracy.

    python benchmarks/bench_ops.py --suite forward --json out.json     # on the GPU
    python benchmarks/bench_ops.py --render out.json                   # writes BENCHMARKS.md

Times are medians of ``triton.testing.do_bench`` after warm-up; "first call" is the wall time of
the first call of a shape (Triton compilation and autotuning included, on top of whatever the
Triton cache holds); the ``compile`` suite times first calls in fresh processes with an empty
Triton cache (cold compilation, imports excluded). Errors are relative RMS against the float64
per-token reference where that is affordable.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _report import environment, write_section  # noqa: E402

# ---------------------------------------------------------------------------------------------
# cases

class Case(NamedTuple):
    """A benchmark case: B sequences of T tokens (or the lengths ``seqlens``), H heads, K = V."""
    name: str
    B: int
    T: int | None
    H: int
    seqlens: list[int] | None
    gate: str
    K: int = 128

    @property
    def tokens(self) -> int:
        return sum(self.seqlens) if self.seqlens else self.T

    def inputs(self, gate: str | None = None, **kw):
        """make()'s inputs of this case (another ``gate`` if given; make's keywords)."""
        return make(self.B, self.T, self.H, self.seqlens, gate or self.gate, K=self.K, V=self.K, **kw)


FORWARD = [
    Case("B1 T8192 H64", 1, 8192, 64, None, "safe"),
    Case("B1 T8192 H96", 1, 8192, 96, None, "safe"),
    Case("varlen 6 seqs H96", 1, None, 96, [1300, 547, 2048, 963, 271, 3063], "safe"),
    Case("B2 T8192 H64", 2, 8192, 64, None, "safe"),
    Case("B1 T32768 H16", 1, 32768, 16, None, "safe"),
    Case("B1 T8192 H64 softplus", 1, 8192, 64, None, "softplus"),
    Case("B1 T8192 H64 softplus init", 1, 8192, 64, None, "softplus init"),
]


GATE_PARAMS = ("Gate parameters (bench_ops.make): safe and softplus A_log = log U(0, 2.7), dt_bias ~ 0.5 randn; "
               "softplus init, as fla's layer initialises A_log (strong decays): A_log = log U(1, 16), dt_bias ~ 0.1 randn.")


def make(B, T, H, seqlens, gate, K=128, V=128, dtype=torch.bfloat16, device="cuda", grad=False):
    """Inputs (bf16 q, k, v, g, beta) and keyword options of one benchmark case (``gate``: "safe",
    "softplus" or "softplus init", GATE_PARAMS); with ``grad`` every input and the gate parameters
    require gradients."""
    if seqlens is not None:
        T = sum(seqlens)
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=device, dtype=dtype)
    k = torch.randn(B, T, H, K, device=device, dtype=dtype)
    v = torch.randn(B, T, H, V, device=device, dtype=dtype)
    g = torch.randn(B, T, H, K, device=device, dtype=dtype)
    beta = torch.randn(B, T, H, device=device, dtype=dtype)
    kw = dict(
        A_log=torch.empty(H, device=device).uniform_(0, 2.7).log(), dt_bias=torch.randn(H * K, device=device) * 0.5,
        use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
    )
    if gate == "safe":
        kw.update(safe_gate=True, lower_bound=-5.0)
    elif gate == "softplus init":  # strong decays: A_log as fla's layer initialises it, small dt_bias
        kw.update(A_log=torch.empty(H, device=device).uniform_(1, 16).log(),
                  dt_bias=torch.randn(H * K, device=device) * 0.1)
    if seqlens is not None:
        kw["cu_seqlens_cpu"] = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])  # nothing read back per call
        kw["cu_seqlens"] = kw["cu_seqlens_cpu"].to(device, torch.int32)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    if grad:
        for t in (*x.values(), kw["A_log"], kw["dt_bias"]):
            t.requires_grad_(True)
    return x, kw


def io_bytes(x, out_elems, out_bytes=2):
    return sum(t.numel() * t.element_size() for t in x.values()) + out_elems * out_bytes


def copy_bandwidth():
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    import triton.testing as tt

    ms = tt.do_bench(lambda: b.copy_(a), warmup=25, rep=100, return_mode="median")
    return 2 * a.numel() / ms / 1e9  # TB/s: bytes read + written


KNOWN_LIBS = ("fastkda", "fla", "flashkda", "fastkda-chunk")
# the libraries timed (--libs); flashkda and fastkda-chunk (fastkda with the short path off) in the
# forward suite only
LIBS = ("fastkda", "fla")


@functools.cache
def _imported(module: str, label: str):
    """The module ``module``, or None when it does not import (reported once per process)."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # report, do not hide
        print(f"{label} not importable: {type(e).__name__}: {e}")
        return None


def _fla_op(name):
    """fla.ops.kda.<name> when fla-core is timed (--libs) and importable, else None (reported)."""
    kda = _imported("fla.ops.kda", "fla-core") if "fla" in LIBS else None
    op = None if kda is None else getattr(kda, name, None)
    if kda is not None and op is None:
        print(f"fla-core has no fla.ops.kda.{name}")
    return op


def _with_fla(impls: dict, name: str) -> dict:
    """impls plus fla-core's operator ``name`` under "fla" when it is timed."""
    op = _fla_op(name)
    return impls if op is None else {**impls, "fla": op}


def _flashkda_forward():
    """FlashKDA's forward (``flash_kda.fwd``, built from github.com/MoonshotAI/FlashKDA) as a
    chunk_kda-like call returning (o, None), when it is timed (--libs) and importable, else None
    (reported). It takes the cases of ``flashkda_takes``."""
    flash_kda = _imported("flash_kda", "FlashKDA") if "flashkda" in LIBS else None
    if flash_kda is None:
        return None

    def forward(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, cu_seqlens=None, **_):
        o = torch.empty_like(v)
        flash_kda.fwd(q, k, v, g, beta, q.shape[-1] ** -0.5, o, A_log=A_log, dt_bias=dt_bias.view(v.shape[2], -1),
                      lower_bound=lower_bound, initial_state=None, final_state=None,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
        return o, None

    return forward


def flashkda_takes(x: dict, kw: dict) -> bool:
    """The forward cases FlashKDA's kernel takes: bfloat16, K = V = 128, no grouped value heads, the
    safe gate with its lower bound, gate, l2norm and beta sigmoid in the kernel."""
    q, v = x["q"], x["v"]
    return (q.dtype == torch.bfloat16 and q.shape[-1] == v.shape[-1] == 128 and q.shape[2] == v.shape[2]
            and bool(kw.get("safe_gate")) and kw.get("lower_bound") is not None and kw.get("use_gate_in_kernel")
            and kw.get("use_qk_l2norm_in_kernel") and kw.get("use_beta_sigmoid_in_kernel"))


def _chunk_wide(fn):
    """fastkda's ``fn`` on its chunk-wide path whatever the plan would take (Tuning.short_min_pairs off)."""
    from fastkda.backends.triton.plan import tuned

    def call(**kw):
        with tuned(short_min_pairs=None):
            return fn(**kw)

    return call


def _impls():
    import fastkda

    impls = _with_fla({"fastkda": fastkda.chunk_kda}, "chunk_kda")
    if "fastkda-chunk" in LIBS:
        impls["fastkda-chunk"] = _chunk_wide(fastkda.chunk_kda)
    flashkda = _flashkda_forward()
    return impls if flashkda is None else {**impls, "flashkda": flashkda}


def _reference(x, kw):
    """The float64 reference output (chunked form on the GPU; first 2048 tokens of dense inputs) and its slice."""
    from fastkda.testing import reference

    n = 2048 if "cu_seqlens" not in kw else None
    sub = {k: (t[:, :n] if n else t) for k, t in x.items()}
    o_r, _ = reference({**sub, **{k: v for k, v in kw.items() if k not in ("safe_gate", "cu_seqlens_cpu")}})
    return o_r, (slice(None), slice(0, n))


def timed_once(call):
    """(result, wall seconds) of one call of ``call()``, the GPU synchronised before and after: on
    a shape's first call, compilation included."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def bench_forward(cases, with_error=True, done=None):
    """Inference forward of each case, every library; ``done(rows)`` after each case (a run cut
    short keeps the cases measured)."""
    import triton.testing as tt

    from fastkda.testing import rel_rms

    rows = []
    impls = _impls()
    for case in cases:
        x, kw = case.inputs()
        row = {"case": case.name, "gate": case.gate, "B": case.B, "T": case.tokens, "H": case.H}
        ref = _reference(x, kw) if with_error else None
        for lib, fn in impls.items():
            if lib == "flashkda" and not flashkda_takes(x, kw):
                continue
            with torch.inference_mode():
                (o, _), first = timed_once(lambda: fn(**x, **kw))
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ms = tt.do_bench(lambda: fn(**x, **kw), warmup=25, rep=200, return_mode="median")
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                err = rel_rms(o[ref[1]], ref[0]) if ref else float("nan")
            row[lib] = {"ms": ms, "first_s": first, "peak_gib": peak, "err": err,
                        "gbps": io_bytes(x, o.numel()) / ms / 1e6}
            print(f"{case.name:28s} {lib:8s} {ms:8.3f} ms  first {first:6.1f} s  peak +{peak:5.2f} GiB  "
                  f"err {err:.2e}", flush=True)
        rows.append(row)
        if done is not None:
            done(rows)
    return rows


COMPILE = ["B1 T8192 H64", "B1 T8192 H64 softplus"]  # forward cases timed cold (one per intra path)


def cold_first_call(lib: str, case: str) -> float:
    """Seconds of the first forward call of ``lib`` on ``case`` in a fresh process whose Triton cache
    starts empty: cold compilation (and fla-core's autotuning), imports and input creation excluded."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--cold-one", lib, case], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"cold first call of {lib} on {case!r} failed:\n{out.stderr[-2000:]}")
        return float(out.stdout.strip().splitlines()[-1])


def _cold_one(lib: str, case: str):
    """(in the child process of ``cold_first_call``) print the first call's seconds."""
    fn = _impls()[lib]
    x, kw = case_named(case, "forward").inputs()
    with torch.inference_mode():
        _, seconds = timed_once(lambda: fn(**x, **kw))
    print(f"{seconds:.3f}")


def bench_compile(cases):
    rows = []
    libs = [lib for lib in _impls() if lib in ("fastkda", "fla")]  # the libraries whose compilation is Triton's
    for case in cases:
        row = {"case": case}
        for lib in libs:
            row[lib] = {"cold_s": cold_first_call(lib, case)}
            print(f"{case:28s} {lib:8s} cold first call {row[lib]['cold_s']:6.1f} s", flush=True)
        rows.append(row)
    return rows


def breakdown(name="B1 T8192 H64"):
    """Times of the two forward stages of fastkda's Triton backend, separately, on each path (the
    short one and the chunk-wide one, forced); the scan for a few launch configurations
    (tools/sweep_launch.py sweeps those of stage 1)."""
    import triton.testing as tt

    import dataclasses

    from fastkda.backends.triton import forward, scan, short
    from fastkda.backends.triton.function import plan_of
    from fastkda.backends.triton.plan import tuned
    from fastkda.options import chunk_options

    x, kw = case_named(name, "forward").inputs()
    call = dict(scale=None, initial_state=None, output_final_state=False, disable_recompute=False,
                return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                cp_context=None, chunk_size=64, allow_neg_eigval=False, **kw)
    rows = []

    def timed(what: str, fn, **row):
        try:
            fn()
            ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as e:  # an out-of-resources configuration
            print(f"{name}: {what}: {type(e).__name__}", flush=True)
            return
        rows.append({"case": name, **row, "ms": ms})
        print(f"{name}: {what}: {ms:.3f} ms", flush=True)

    with torch.inference_mode():
        opts, inp = chunk_options(*x.values(), **call)
        with tuned(short_min_pairs=1):
            plan = plan_of(opts, inp, train=False)
        if plan.short is None:
            print(f"{name}: not a case of the short path", flush=True)
        else:
            tables = forward.chunk_tables_of(opts, inp.cu_seqlens, inp.cu_seqlens_cpu, 16)
            out = short.short_stage1(opts, plan, inp, tables)
            timed("short path, stage 1 (one launch)", lambda: short.short_stage1(opts, plan, inp, tables),
                  path="short", stage="prepare")
            for bv, stages in ((64, 3), (64, 2), (32, 3)):
                sc = dataclasses.replace(plan.forward, BV=bv, launch=plan.forward.launch._replace(stages=stages))
                timed(f"short path, scan BV={bv} stages={stages}",
                      lambda: scan.fwd_scan(opts, plan, sc, out.w, out.u, out.xs, out.qg, out.kd, out.Aqk, out.gl,
                                            out.chunk_indices, out.chunk_offsets, out.NT_total, inp),
                      path="short", stage="scan", BV=bv, warps=sc.launch.warps, stages=stages)

        with tuned(short_min_pairs=None):
            plan = plan_of(opts, inp, train=False)

        def stage1():  # the path inference takes (u formed in the scan where the plan says so)
            return forward.stage1_wu(opts, plan, plan.forward, forward.stage1_intra(opts, plan, inp), inp)

        out = stage1()
        timed(f"chunk path, stage 1 (4 launches{', u left to the scan' if out.u is None else ''})", stage1,
              path="chunk", stage="prepare", u_in_scan=out.u is None)
        for bv, warps, stages in ((64, 8, 2), (64, 4, 2), (32, 4, 2), (32, 8, 2), (64, 8, 3), (128, 8, 2), (64, 4, 1)):
            # every width and stage count, whatever the shape would take by default
            with tuned(short_min_pairs=None, scan_bv=bv, scan_bv_narrow=bv, scan_warps=warps, scan_stages=stages,
                       scan_stages_crowded=stages):
                p2 = plan_of(opts, inp, train=False)
            sc = dataclasses.replace(p2.forward, form_u=plan.forward.form_u)  # stage 1 above decided u
            timed(f"chunk path, scan BV={bv} warps={warps} stages={stages}",
                  lambda: scan.fwd_scan(opts, p2, sc, out.w, out.u, forward.wu_x(out), out.qg, out.kd, out.Aqk,
                                        out.gl, out.chunk_indices, out.chunk_offsets, out.NT_total, inp),
                  path="chunk", stage="scan", BV=bv, warps=warps, stages=stages)
    return rows


BACKWARD = [
    *[Case(f"B1 T8192 H{h} {gate}", 1, 8192, h, None, gate) for h in (64, 96) for gate in ("safe", "softplus")],
    Case("B1 T8192 H64 softplus init", 1, 8192, 64, None, "softplus init"),
    *[Case(f"B4 T4096 H32 {gate}", 4, 4096, 32, None, gate) for gate in ("safe", "softplus")],
    *[Case(f"varlen 6 seqs H64 {gate}", 1, None, 64, [1300, 547, 2048, 963, 271, 3063], gate)
      for gate in ("safe", "softplus init")],
    *[Case(f"B8 T2048 H16 K64 {gate}", 8, 2048, 16, None, gate, K=64) for gate in ("safe", "softplus")],
]


def case_named(name: str, suite: str | None = None) -> Case:
    """The case of FORWARD (suite "forward"), BACKWARD ("backward") or either called ``name``."""
    lists = {"forward": FORWARD, "backward": BACKWARD}
    cases = [c for k, cs in lists.items() if suite in (None, k) for c in cs]
    for c in cases:
        if c.name == name:
            return c
    raise SystemExit(f"no {suite or 'benchmark'} case {name!r}; cases: {', '.join(c.name for c in cases)}")


def bench_backward(cases, done=None):
    """One training step of the operator: forward + backward, and backward alone (the graph of one
    forward replayed), gradients of q, k, v, g, beta, A_log, dt_bias; peak memory above the inputs.
    ``done(rows)`` is called after each case (a run cut short keeps the cases measured)."""
    import triton.testing as tt

    rows = []
    impls = _impls()
    for case in cases:
        x, kw = case.inputs(grad=True)
        leaves = [*x.values(), kw["A_log"], kw["dt_bias"]]
        do = torch.randn_like(x["v"])
        row = {"case": case.name, "gate": case.gate, "B": case.B, "T": case.tokens, "H": case.H, "K": case.K}
        for lib, fn in impls.items():
            def step():
                o, _ = fn(**x, **kw)
                return torch.autograd.grad(o, leaves, do)

            _, first = timed_once(step)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            ms_fb = tt.do_bench(step, warmup=10, rep=100, return_mode="median")
            o, _ = fn(**x, **kw)
            ms_b = tt.do_bench(lambda o=o: torch.autograd.grad(o, leaves, do, retain_graph=True), warmup=10, rep=100,
                               return_mode="median")
            del o
            row[lib] = {"ms_fwd_bwd": ms_fb, "ms_bwd": ms_b, "first_s": first, "peak_gib": peak}
            print(f"{case.name:28s} {lib:8s} fwd+bwd {ms_fb:8.3f} ms  bwd {ms_b:8.3f} ms  first {first:6.1f} s  "
                  f"peak +{peak:5.2f} GiB", flush=True)
        rows.append(row)
        if done:
            done(rows)
    return rows


DECODE = ([(n, h, 32, 128) for h in (32, 16) for n in (1, 16, 64, 256, 512)]  # (N, H, HV, K = V)
          + [(n, h, 32, 64) for h in (32, 16) for n in (1024, 2048)])
DECODE_POOLS = (torch.float32, torch.bfloat16)
# decode launches timed at DECODE_SWEEP's sizes: (value columns, warps, stages, programs per SM);
# 10**6 programs per SM: one program per tile
DECODE_LAUNCH = [(64, 2, 1, 32), (32, 1, 1, 16), (64, 2, 2, 4), (64, 2, 3, 2), (64, 2, 3, 4), (32, 1, 3, 8),
                 (128, 4, 1, 16), (128, 8, 1, 8)]
DECODE_SWEEP = [(128, 256), (64, 1024)]  # (K = V, N) of the launch sweep, H = 32
DECODE_ERROR_STEPS = 64
HOST_ROUNDS, HOST_CALLS = 7, 1000  # host time per eager decode call: rounds of back-to-back calls


def _graph_ms(call):
    """Median time of ``call`` replayed from a CUDA graph (as serving engines run decoding), or None
    when it cannot be captured."""
    import triton.testing as tt

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        return tt.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    except Exception as e:  # report, do not hide
        print(f"graph capture failed: {type(e).__name__}: {e}")
        return None


def _host_us(calls: dict, rounds=HOST_ROUNDS, n=HOST_CALLS) -> dict:
    """Host time per call in microseconds of each of ``calls`` (name -> call): rounds of n calls
    issued back to back (the GPU keeps up with one token of one sequence), the clock read before
    the round's final synchronisation; the calls take turns round by round, so that a host that
    slows down for a while slows them alike; the median round of each."""
    times = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(20):
            call()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            times[name].append((t1 - t0) / n * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def _decode_call(lib, fn, x, kw, pool, slots):
    """One decode step of ``lib``: fastkda in place on the pool's slots, fla-core from and to
    per-sequence float32 states."""
    if lib == "fastkda":
        return lambda: fn(*x, initial_state=pool, ssm_state_indices=slots, inplace_final_state=True, **kw)
    h0 = pool[:slots.shape[0]].clone()
    return lambda: fn(*x, initial_state=h0, output_final_state=True, **kw)


def _decode_inputs(N, H, HV, K=128, pool_dtype=torch.float32, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k = (rnd(N, 1, H, K).to(dt) for _ in range(2))
    v, g = (rnd(N, 1, HV, K).to(dt) for _ in range(2))
    beta = rnd(N, 1, HV).to(dt)
    kw = dict(A_log=torch.log(1 + 15 * torch.rand(HV, device=device, generator=gen)), dt_bias=0.1 * rnd(HV * K),
              use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    pool = (0.1 * rnd(2 * N, HV, K, K)).to(pool_dtype)
    slots = torch.randperm(2 * N, device=device, generator=gen)[:N]
    return (q, k, v, g, beta), kw, pool, slots


def decode_pool_error(pool_dtype, N=64, H=16, HV=16, K=128, steps=DECODE_ERROR_STEPS, device="cuda"):
    """Relative RMS error of the outputs of ``steps`` decode steps on a pool of ``pool_dtype``, and
    of the final states, against the float64 per-token reference run from the same start."""
    import fastkda
    from fastkda.testing import reference, rel_rms

    _, kw, pool, slots = _decode_inputs(N, H, HV, K, pool_dtype, device=device)
    start = pool[slots].double()
    outs, toks = [], []
    for t in range(steps):
        x, _, _, _ = _decode_inputs(N, H, HV, K, seed=1 + t, device=device)
        toks.append(x)
        with torch.inference_mode():
            o, _ = fastkda.fused_recurrent_kda(*x, initial_state=pool, ssm_state_indices=slots, inplace_final_state=True,
                                               **kw)
        outs.append(o)
    seq = [torch.cat([tk[i] for tk in toks], 1) for i in range(5)]  # [N, steps, ...]
    ref = dict(zip(("q", "k", "v", "g", "beta"), (t.double() for t in seq)))
    o_ref, s_ref = reference({**ref, **{n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()},
                              "initial_state": start, "output_final_state": True})
    return {"o": rel_rms(torch.cat(outs, 1), o_ref), "state": rel_rms(pool[slots], s_ref), "steps": steps}


def bench_decode(cases):
    """One token for each of N sequences: fastkda in place on pool slots (float32 and bfloat16
    pools), fla-core from and to per-sequence float32 states (the same bytes as fastkda's float32
    pool). Graph replays (as serving engines run decoding), eager calls, host time per call, the
    decode kernel's launch options, and the 16-bit pool's error."""
    import triton.testing as tt

    import fastkda
    from fastkda.backends.triton.plan import DecodeLaunch, tuned
    from fastkda.testing import rel_rms

    impls = _with_fla({"fastkda": fastkda.fused_recurrent_kda}, "fused_recurrent_kda")
    rows = []
    for N, H, HV, K in cases:
        row = {"N": N, "H": H, "HV": HV, "K": K}
        calls = {}
        for lib, fn in impls.items():
            for pool_dtype in (DECODE_POOLS if lib == "fastkda" else DECODE_POOLS[:1]):
                x, kw, pool, slots = _decode_inputs(N, H, HV, K, pool_dtype)
                call = _decode_call(lib, fn, x, kw, pool, slots)
                state_bytes = 2 * N * HV * K * K * pool.element_size()  # read + write every state
                with torch.inference_mode():
                    call()
                    ms = tt.do_bench(call, warmup=25, rep=200, return_mode="median")
                    ms_g = _graph_ms(call)
                key = lib if pool_dtype == torch.float32 else f"{lib} {str(pool_dtype)[6:]}"
                calls[key] = call
                row[key] = {"ms": ms, "graph_ms": ms_g, "graph_tbps": state_bytes / ms_g / 1e9 if ms_g else None,
                            "host_us": None}
                print(f"decode N={N:4d} H={H} HV={HV} K={K} {key:16s} eager {ms:.4f} ms  graph {ms_g or float('nan'):.4f} ms  "
                      f"{state_bytes / (ms_g or ms) / 1e9:.2f} TB/s", flush=True)
        if N == 1:  # the host's time per call, the libraries taking turns
            with torch.inference_mode():
                for key, host in _host_us(calls).items():
                    row[key]["host_us"] = host
                    print(f"decode N=1 H={H} HV={HV} K={K} {key:16s} host {host:.1f} us/call (median of rounds)",
                          flush=True)
        rows.append(row)
    sweep = []
    for (K, N), pool_dtype in itertools.product(DECODE_SWEEP, DECODE_POOLS):
        x, kw, pool, slots = _decode_inputs(N, 32, 32, K, pool_dtype)
        field = "decode_f32" if pool_dtype == torch.float32 else "decode_bf16_k128" if K > 64 else "decode_bf16"

        def decode(state):
            return fastkda.fused_recurrent_kda(*x, initial_state=state, ssm_state_indices=slots,
                                               inplace_final_state=True, **kw)

        with torch.inference_mode():
            base = pool.clone()  # timing below updates `pool` in place: every check starts from `pool0`
            pool0 = pool.clone()
            o_base, _ = decode(base)  # the default launch: every other one must give the same numbers
            # the same launch twice where K caps the value columns
            for dl in dict.fromkeys(DecodeLaunch(min(bv, K), *rest) for bv, *rest in DECODE_LAUNCH):
                with tuned(**{field: dl}):
                    state = pool0.clone()
                    o, _ = decode(state)
                    err = max(rel_rms(o, o_base), rel_rms(state[slots], base[slots]))
                    ms_g = _graph_ms(lambda: decode(pool))
                pool_name = str(pool_dtype)[6:]
                tbps = 2 * N * 32 * K * K * pool.element_size() / ms_g / 1e9 if ms_g else None
                sweep.append({"pool": pool_name, "K": K, "N": N, "BV": dl.bv, "warps": dl.warps, "stages": dl.stages,
                              "programs_per_sm": dl.programs_per_sm, "graph_ms": ms_g, "graph_tbps": tbps,
                              "err_vs_default": err})
                print(f"decode N={N} H=32 K={K} {pool_name} pool {dl}: graph {ms_g or float('nan'):.4f} ms  "
                      f"(output and states vs the default launch: {err:.1e})", flush=True)
    errors = {str(dt)[6:]: decode_pool_error(dt) for dt in DECODE_POOLS}
    print("decode pool error vs float64:", errors, flush=True)
    return {"rows": rows, "launch_sweep": sweep, "pool_error": errors,
            "host_method": {"rounds": HOST_ROUNDS, "calls": HOST_CALLS}}


def run(args):
    import triton

    # forced: a call the Triton backend cannot serve fails instead of timing another backend
    os.environ.setdefault("FASTKDA_BACKEND", "triton")

    res = {"env": environment("cuda"), "copy_tbps": copy_bandwidth(), "suites": {}}
    res["fla_version"] = None  # of the fla-core timed, if any
    if _fla_op("chunk_kda") is not None:
        import fla

        res["fla_version"] = getattr(fla, "__version__", "?")
    if _flashkda_forward() is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            res["flashkda_version"] = version("flash_kda")
        except PackageNotFoundError:  # importable, but not installed as a distribution (a source tree)
            res["flashkda_version"] = "?"
    res["triton"] = triton.__version__
    print(f"copy bandwidth {res['copy_tbps']:.2f} TB/s")
    pick = (lambda cases: [c for c in cases if any(w in c.name for w in args.cases)]) if args.cases else (lambda c: c)

    def save(key, rows):
        res["suites"][key] = rows
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    suites = {"stages": ("forward_stages", lambda: [r for c in (pick(FORWARD) if args.cases else FORWARD[:1])
                                                    for r in breakdown(c.name)]),
              "forward": ("forward", lambda: bench_forward(pick(FORWARD), not args.no_error,
                                                           lambda rows: save("forward", rows))),
              "backward": ("backward", lambda: bench_backward(pick(BACKWARD), lambda rows: save("backward", rows))),
              "compile": ("compile", lambda: bench_compile([c for c in COMPILE if not args.cases
                                                            or any(w in c for w in args.cases)])),
              "decode": ("decode", lambda: bench_decode(DECODE))}
    for name in args.suite.split(","):  # in the order asked; the JSON is rewritten after each suite
        if name.strip() not in suites:
            raise SystemExit(f"--suite: unknown suite {name.strip()!r}; choose from {', '.join(suites)}")
        key, fn = suites[name.strip()]
        save(key, fn())


# ---------------------------------------------------------------------------------------------
# markdown


def render(path):
    res = json.load(open(path))
    bw = res["copy_tbps"]
    head = (f"{res['env']}, fla-core {res.get('fla_version')}"
            + (f", FlashKDA {res['flashkda_version']}" if res.get("flashkda_version") else "")
            + f"; copy bandwidth measured in the same run: {bw:.2f} TB/s (read + write).")
    fwd = res["suites"].get("forward")
    if fwd and any("fastkda" in r for r in fwd):
        flash = any("flashkda" in r for r in fwd)  # FlashKDA's columns where it was timed
        wide = any("fastkda-chunk" in r for r in fwd)  # fastkda's chunk-wide path beside the plan's
        md = [head, "",
              "bf16, K=V=128, gate activation (safe: lower_bound=-5), l2norm and beta sigmoid in the kernel; inference mode. "
              + GATE_PARAMS,
              "Ratio = fla time / fastkda time (> 1: fastkda faster)"
              + (", likewise FlashKDA's (its kernel takes the safe-gate cases without grouped value heads)" if flash else "")
              + ". Floor = q, k, v, g, beta read once and o written once "
              "at the copy bandwidth. Error = relative RMS against the float64 reference (first 2048 tokens)."
              + (" The chunk-wide column: fastkda with its short path off (the same path as fastkda's column where the plan does not take the short path)." if wide else ""),
              "",
              "| case | fastkda ms" + (" | chunk-wide ms" if wide else "") + " | fla ms | ratio"
              + (" | FlashKDA ms | ratio" if flash else "")
              + " | fastkda GB/s (floor ms) | first call fastkda / fla (s) | peak +GiB fastkda / fla | error fastkda / fla"
              + (" / FlashKDA" if flash else "") + " |",
              "|---|---:|---:|---:" + ("|---:" if wide else "") + ("|---:|---:" if flash else "") + "|---:|---:|---:|---:|"]
        for r in fwd:
            a, b, c = r["fastkda"], r.get("fla"), r.get("flashkda")
            floor = a["gbps"] * a["ms"] / 1e3 / bw  # bytes / bandwidth, in ms
            fla_cols = f"{b['ms']:.3f} | {b['ms'] / a['ms']:.2f}x" if b else "- | -"
            flash_cols = (f" | {c['ms']:.3f} | {c['ms'] / a['ms']:.2f}x" if c else " | - | -") if flash else ""
            err = f"{a['err']:.1e} / " + (f"{b['err']:.1e}" if b else "-") + ((f" / {c['err']:.1e}" if c else " / -")
                                                                             if flash else "")
            wide_col = (f" | {r['fastkda-chunk']['ms']:.3f}" if "fastkda-chunk" in r else " | -") if wide else ""
            md.append(f"| {r['case']} | {a['ms']:.3f}{wide_col} | {fla_cols}{flash_cols} | {a['gbps']:.0f} ({floor:.3f}) "
                      f"| {a['first_s']:.1f} / " + (f"{b['first_s']:.1f}" if b else "-")
                      + f" | {a['peak_gib']:.2f} / " + (f"{b['peak_gib']:.2f}" if b else "-") + f" | {err} |")
        cold = res["suites"].get("compile")
        if cold:
            md += ["", "Cold compilation: the first call in a fresh process with an empty Triton cache (fla-core's "
                   "autotuning included; imports and inputs excluded).", "",
                   "| case | cold first call fastkda / fla (s) |", "|---|---:|"]
            md += [f"| {r['case']} | {r['fastkda']['cold_s']:.1f} / "
                   f"{r['fla']['cold_s']:.1f} |" if "fla" in r else f"| {r['case']} | {r['fastkda']['cold_s']:.1f} / - |"
                   for r in cold]
        write_section("gpu-forward", "\n".join(md))


def render_backward(res):
    rows = res["suites"].get("backward")
    if not rows:
        return
    md = [f"{res['env']}, fla-core {res.get('fla_version')}.", "",
          "One training step of the operator: bf16 inputs, gate (safe: lower_bound=-5; softplus), l2norm and beta "
          "sigmoid in the kernel, gradients of q, k, v, g, beta, A_log, dt_bias. Backward alone replays the graph "
          "of one forward. Ratio = fla time / fastkda time. Peak = memory above the inputs during one step. "
          + GATE_PARAMS, "",
          "| case | fwd+bwd fastkda / fla ms | ratio | bwd fastkda / fla ms | ratio | peak +GiB fastkda / fla | first call fastkda / fla (s) |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        a, b = r["fastkda"], r.get("fla")
        if b:
            md.append(f"| {r['case']} | {a['ms_fwd_bwd']:.2f} / {b['ms_fwd_bwd']:.2f} | {b['ms_fwd_bwd'] / a['ms_fwd_bwd']:.2f}x "
                      f"| {a['ms_bwd']:.2f} / {b['ms_bwd']:.2f} | {b['ms_bwd'] / a['ms_bwd']:.2f}x "
                      f"| {a['peak_gib']:.2f} / {b['peak_gib']:.2f} | {a['first_s']:.1f} / {b['first_s']:.1f} |")
        else:
            md.append(f"| {r['case']} | {a['ms_fwd_bwd']:.2f} / - | - | {a['ms_bwd']:.2f} / - | - | {a['peak_gib']:.2f} / - "
                      f"| {a['first_s']:.1f} / - |")
    write_section("gpu-backward", "\n".join(md))


def render_decode(res):
    suite = res["suites"].get("decode")
    if not suite:
        return
    if isinstance(suite, list):  # results written before the decode suite kept its sweep beside the rows
        suite = {"rows": suite}
    sweep, errors, rows = suite.get("launch_sweep", []), suite.get("pool_error"), suite["rows"]
    bw = res["copy_tbps"]
    md = [f"{res['env']}, fla-core {res.get('fla_version')}; copy bandwidth {bw:.2f} TB/s.", "",
          "One token for each of N sequences, K=V, bf16 inputs, gate, l2norm and beta sigmoid in the kernel. "
          "fastkda updates a pool in place through `ssm_state_indices` (float32 or bfloat16 states; float32 "
          "arithmetic either way); fla-core reads and writes per-sequence float32 states (the bytes of fastkda's "
          "float32 pool). \"graph\" replays the call from a CUDA graph, as serving engines do; \"eager\" calls it "
          "from Python (neither synchronises with the host). TB/s counts the states read and written, in the "
          "pool's dtype. Ratios are fla-core's time over fastkda's; \"bf16 vs float32 pool\" is fastkda's "
          "float32-pool time over its bfloat16-pool time.", "",
          "| N | H / HV | K = V | fastkda graph ms | TB/s (% of copy) | fla graph ms | graph ratio | fastkda eager ms | "
          "fla eager ms | bf16 pool graph ms | bf16 TB/s (% of copy) | bf16 vs float32 pool |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt=".4f"):
        return format(x, fmt) if x is not None else "-"

    def share(r):
        tb = r.get("graph_tbps")
        return f"{tb:.2f} ({100 * tb / bw:.0f}%)" if tb else "-"

    hosts = []
    for r in rows:
        a, b, h = r["fastkda"], r.get("fla") or {}, r.get("fastkda bfloat16") or {}
        ga, gb, gh = a.get("graph_ms"), b.get("graph_ms"), h.get("graph_ms")
        md.append(f"| {r['N']} | {r['H']} / {r['HV']} | {r.get('K', 128)} | {f(ga)} | {share(a)} | {f(gb)} | "
                  f"{f'{gb / ga:.2f}x' if ga and gb else '-'} | {f(a.get('ms'))} | {f(b.get('ms'))} | {f(gh)} | "
                  f"{share(h)} | {f'{ga / gh:.2f}x' if ga and gh else '-'} |")
        if a.get("host_us"):
            hosts.append(f"H={r['H']}: fastkda {a['host_us']:.1f} us (bf16 pool {f(h.get('host_us'), '.1f')} us), "
                         f"fla-core {f(b.get('host_us'), '.1f')} us")
    if hosts:
        how = suite.get("host_method")  # results of before the rounds: one loop per library
        how = (f"{how['rounds']} rounds of {how['calls']} calls issued back to back, the libraries taking turns "
               "round by round; the median round" if how else "calls issued back to back")
        md += ["", f"Host time per eager call at N = 1 ({how}): " + "; ".join(hosts) + "."]
    if errors:
        md += ["", f"Error of a pool's dtype: {next(iter(errors.values()))['steps']} decode steps of N=64 sequences, "
               "H=HV=16, against the float64 per-token reference from the same start (relative RMS): " + "; ".join(
                   f"{dt} pool: outputs {e['o']:.1e}, final states {e['state']:.1e}" for dt, e in errors.items()) + "."]
    def launch(c):
        ppsm = c.get("programs_per_sm")
        progs = "" if ppsm is None else (", one program per tile" if ppsm >= 10**6 else f", {ppsm} programs per SM")
        stages = f", {c['stages']} stages" if c.get("stages", 1) > 1 else ""
        tb = f" ({100 * c['graph_tbps'] / bw:.0f}%)" if c.get("graph_tbps") else ""
        return f"BV={c['BV']} {c['warps']} warps{stages}{progs}: {f(c['graph_ms'])} ms{tb}"

    groups = dict.fromkeys((c.get("pool", "float32"), c.get("K", 128), c.get("N", 256)) for c in sweep)
    for pool, K, N in groups:
        md += ["", f"Launch options of the decode kernel at N={N}, H=32, K=V={K}, {pool} pool (graph replays, % of "
               "copy bandwidth): " + "; ".join(launch(c) for c in sweep if (c.get("pool", "float32"), c.get("K", 128),
                                                                             c.get("N", 256)) == (pool, K, N)) + "."]
    write_section("gpu-decode", "\n".join(md))


def main():
    global LIBS
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="forward", help="comma list of: stages, forward, compile, backward, decode")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--render", default=None, help="write BENCHMARKS.md from a JSON result")
    p.add_argument("--no-error", action="store_true")
    p.add_argument("--cases", default=None, type=lambda x: x.split(","),
                   help="forward/backward cases whose name contains one of these comma-separated words")
    p.add_argument("--libs", default=",".join(LIBS), type=lambda x: tuple(n.strip() for n in x.split(",")),
                   help="comma list of the libraries timed: fastkda (always), fla (without it: no ratios), "
                        "flashkda (forward suite: FlashKDA's own kernel, where it is installed), fastkda-chunk "
                        "(forward suite: fastkda's chunk-wide path)")
    p.add_argument("--cold-one", nargs=2, metavar=("LIB", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.libs) - set(KNOWN_LIBS)
    if unknown or "fastkda" not in args.libs:
        raise SystemExit(f"--libs {','.join(args.libs)}: name fastkda, optionally with {', '.join(KNOWN_LIBS[1:])}")
    LIBS = args.libs
    if args.cold_one:
        os.environ.setdefault("FASTKDA_BACKEND", "triton")
        _cold_one(*args.cold_one)
    elif args.render:
        render(args.render)
        render_backward(json.load(open(args.render)))
        render_decode(json.load(open(args.render)))
    else:
        run(args)


if __name__ == "__main__":
    main()
