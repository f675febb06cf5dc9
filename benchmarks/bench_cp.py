"""Context-parallel scaling: one long sequence sharded over the GPUs of one host (NCCL).

    torchrun --nproc_per_node 1 benchmarks/bench_cp.py --json cp1.json   # one GPU, no CP
    torchrun --nproc_per_node 2 benchmarks/bench_cp.py --json cp2.json   # two GPUs
    python benchmarks/bench_cp.py --render cp1.json cp2.json             # the BENCHMARKS.md table

Every rank draws its own shard (bf16, K = V = 128, safe gate with lower_bound -5, l2norm and beta
sigmoid in the kernel) and times the forward and the forward+backward of ``chunk_kda`` with a
``CPContext``; with one rank, the plain single-GPU call. The ranks run the same number of
iterations (the collectives need it); a time is the median over iterations of the slowest rank.
A case that does not fit on any rank reports the out-of-memory error instead of a time; a rank
that runs out alone leaves the others waiting in a collective until NCCL's 120 s timeout or the
launcher's time limit ends the run, and the JSON (written before and after every measurement) then says which mode did not finish.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _report import environment, write_section  # noqa: E402


def _shard(T_local, H, K, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = {n: torch.randn(1, T_local, H, K, device=device, generator=gen, dtype=torch.bfloat16) for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, T_local, H, device=device, generator=gen, dtype=torch.bfloat16)
    for t in x.values():
        t.requires_grad_(True)
    params = dict(A_log=torch.empty(H, device=device).uniform_(0, 2.7).log().requires_grad_(True),
                  dt_bias=(torch.randn(H * K, device=device) * 0.5).requires_grad_(True))
    return x, params


def _time(fn, iters, world):
    """Median over ``iters`` of the slowest rank's time of ``fn`` (ms), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


KW = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
          safe_gate=True, lower_bound=-5.0)


def _measure(mode, T, H, K, iters, rank, world):
    """{"ms", "peak_gib"} of one mode, plus the exchanged bytes under CP; the inputs die on return."""
    from fastkda import chunk_kda
    from fastkda.distributed import CPContext

    torch.cuda.empty_cache()
    x, params = _shard(T // world, H, K, "cuda", seed=1000 * rank + 7)
    ctx = CPContext(cu_seqlens=torch.tensor([0, T])) if world > 1 else None
    extra = dict(cp_context=ctx) if ctx is not None else {}
    do = torch.randn_like(x["v"])

    def fwd():
        with torch.no_grad():
            chunk_kda(**x, **params, **KW, **extra)

    def step():
        o, _ = chunk_kda(**x, **params, **KW, **extra)
        o.backward(do)
        for t in (*x.values(), *params.values()):
            t.grad = None

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = {"ms": _time(fwd if mode == "forward" else step, iters, world),
           "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
    if ctx is not None:  # the exchange of one forward (the context counts over all calls)
        ctx.bytes_sent = ctx.bytes_received = 0
        fwd()
        got["bytes_sent"], got["bytes_received"] = ctx.bytes_sent, ctx.bytes_received
    return got


def run_case(T, H, K, iters, rank, world, row, save):
    """Fills ``row`` mode by mode, calling ``save()`` before and after each: a run killed while
    ranks wait on one that ran out of memory keeps the modes measured before and says which
    one did not finish."""
    row.update({"T": T, "H": H, "K": K, "world": world})
    for mode in ("forward", "forward+backward"):
        row[mode] = {"error": "did not finish (a rank out of memory leaves the others waiting in a collective)"}
        save()
        try:
            got = _measure(mode, T, H, K, iters, rank, world)
            for key in ("bytes_sent", "bytes_received"):
                if key in got:
                    row[key] = got.pop(key)
        except torch.OutOfMemoryError as e:
            got = {"error": "out of memory: " + str(e).split("\n")[0][:160]}
            print(f"rank {rank}: T={T} {mode}: {got['error']}", flush=True)  # before a collective that may hang
        fail = torch.tensor([1.0 if "error" in got else 0.0], device="cuda")
        if world > 1:  # one rank out of memory: every rank says so
            dist.all_reduce(fail, op=dist.ReduceOp.MAX)
        if float(fail) and "error" not in got:
            got = {"error": "out of memory on another rank"}
        row[mode] = got
        save()
        if rank == 0:
            print(f"T={T:8d} H={H} world={world} {mode:17s} " +
                  (f"{got['ms']:9.2f} ms  peak +{got['peak_gib']:.1f} GiB" if "ms" in got else got["error"]), flush=True)


def render(paths):
    rows, env = [], ""
    for p in paths:
        with open(p) as f:
            res = json.load(f)
        env = res["env"]
        rows += res["rows"]
    one = {(r["T"], r["H"]): r for r in rows if r["world"] == 1}
    lines = [f"{env}; NCCL, one process per GPU; bf16, K = V = 128, safe gate. "
             "Speed-up: the one-GPU time over this world size's time.", "",
             "| tokens | H | GPUs | forward ms | speed-up | fwd+bwd ms | speed-up | peak fwd+bwd | sent / received per rank and forward |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["T"], r["H"], r["world"])):
        cells = []
        for mode in ("forward", "forward+backward"):
            got, base = r.get(mode, {}), one.get((r["T"], r["H"]), {}).get(mode, {})
            if "ms" in got:
                cells += [f"{got['ms']:.2f}", f"{base['ms'] / got['ms']:.2f}x" if "ms" in base else "-"]
            else:
                cells += [got.get("error", "-").split(":")[0].split(" (")[0], "-"]
        peak = r.get("forward+backward", {}).get("peak_gib")
        sent = f"{r['bytes_sent'] / 2**20:.0f} MiB / {r['bytes_received'] / 2**20:.0f} MiB" if "bytes_sent" in r else "-"
        lines.append(f"| {r['T']:,} | {r['H']} | {r['world']} | {' | '.join(cells[:2])} | {' | '.join(cells[2:])} | "
                     f"{f'+{peak:.1f} GiB' if peak is not None else '-'} | {sent} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="262144,1048576", help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default="cp.json")
    p.add_argument("--render", nargs="+", metavar="JSON", help="write the BENCHMARKS.md section from these files")
    args = p.parse_args()
    if args.render:
        write_section("gpu-cp", render(args.render))
        return
    os.environ.setdefault("FASTKDA_BACKEND", "triton")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))  # a lost rank fails, not hangs
    rows, env = [], environment("cuda")

    def save():
        if rank == 0:
            with open(args.json, "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)

    for T in args.tokens.split(","):
        rows.append({})
        run_case(int(T), args.heads, args.dim, args.iters, rank, world, rows[-1], save)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # leave without the interpreter's teardown, which collective backends'
    os._exit(0)  # background threads occasionally abort after all the work is done
