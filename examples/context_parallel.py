"""Context-parallel chunk_kda: one long varlen batch sharded over the ranks of a process group.

    torchrun --nproc_per_node 2 examples/context_parallel.py            # CPU, gloo
    torchrun --nproc_per_node 8 examples/context_parallel.py --cuda     # GPUs, NCCL

Every rank builds the same global batch (a real job would load only its shard), runs its shard
with a CPContext, and rank 0 compares the gathered output and every gradient (q, k, v, g, beta,
A_log, dt_bias) with one process's run.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from fastkda import chunk_kda
from fastkda.distributed import CPContext


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--seqlens", default="700,1300,48")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank % torch.cuda.device_count()}" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(device)

    lens = [int(x) for x in args.seqlens.split(",")]
    T, H, K, V = sum(lens), 4, 64, 64
    assert T % world == 0, f"the total length {T} must divide by the world size {world}"
    gen = torch.Generator().manual_seed(0)  # the same global batch on every rank
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    g, beta = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, generator=gen)
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0)

    ctx = CPContext(cu_seqlens=cu_seqlens)
    shard = [t[:, ctx.lo:ctx.hi].to(device).requires_grad_() for t in (q, k, v, g, beta)]
    params = [t.to(device).clone().requires_grad_() for t in (A_log, dt_bias)]
    o, _ = chunk_kda(*shard, A_log=params[0], dt_bias=params[1], cp_context=ctx, **kw)
    o.float().square().sum().backward()

    outs = [torch.empty_like(o) for _ in range(world)]
    dist.all_gather(outs, o.detach())
    grads = []
    for t in shard:  # the shards' gradients, gathered in sequence order
        parts = [torch.empty_like(t.grad) for _ in range(world)]
        dist.all_gather(parts, t.grad)
        grads.append(torch.cat(parts, 1))
    for t in params:  # shared parameters: the ranks' gradients add up
        dist.all_reduce(t.grad)
        grads.append(t.grad)
    if rank == 0:
        full = [t.to(device).clone().requires_grad_() for t in (q, k, v, g, beta, A_log, dt_bias)]
        o1, _ = chunk_kda(*full[:5], A_log=full[5], dt_bias=full[6], cu_seqlens=cu_seqlens.to(device), **kw)
        o1.float().square().sum().backward()
        errs = {"o": ((torch.cat(outs, 1) - o1).norm() / o1.norm()).item()}
        for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), grads, full):
            errs[name] = ((got - ref.grad).norm() / ref.grad.norm()).item()
        print(f"world {world}: relative errors against one process: "
              + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + f"; exchanged per rank and forward: {ctx.bytes_sent} B sent, {ctx.bytes_received} B received")
        assert max(errs.values()) < 1e-4, errs
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # gloo's background threads occasionally abort the interpreter's teardown ("terminate called
    # without an active exception") after all the work is done: leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
