"""Context parallelism: one long (varlen) batch sharded along tokens over a process group.

Rank r holds tokens [r * T_local, (r + 1) * T_local) of the flattened global batch. It runs its
shard from a zero state; the true state entering the shard is recovered from one exchange:

- a segment's state map is affine, ``S_end = A S_in + B`` with ``A = prod_t (I - beta_t k_t k_t^T)
  Diag(exp(g_t))`` (K x K per value head). ``B`` is the segment's final state from zero, ``A`` the
  final state of the same segment run with ``v = 0`` from ``S_in = I``; that run's outputs are
  ``A_{1..t}^T scale q_t``, so the output correction for a true ``S_in`` is one product. The
  identity run travels as K extra value columns of the shard's own call when V + K <= 256 and the
  first segment is at least half the shard, else as a call of its own over the first segment.
- every rank contributes (A, B) of its last segment to one all-gather (autograd-aware, so the
  backward routes state gradients back across ranks the same way), then composes the maps of the
  ranks before it: ``S_in(r) = A_{r-1} S_in(r-1) + B_{r-1}``, reset to 0 where a sequence starts
  exactly at a shard boundary. No rank waits for another's computation.

Bytes per rank and layer, forward: it sends ``HV * K * (K + V) * 4`` and receives that from each of
the other ranks; the backward moves the same amount (docs/context_parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import platform
from ..dtypes import state_dtype

__all__ = ["CPContext"]



@dataclass
class CPContext:
    """Which tokens this rank holds, from a process group and the *global* ``cu_seqlens``.

    Args:
        group: a ``torch.distributed`` process group (None: the default group).
        cu_seqlens: ``[N+1]`` boundaries of the global flattened batch (any device; read once).
        rank, world_size: taken from ``group`` when not given.

    ``fused_max_columns``: up to this V + K, the identity run (the first segment's state transition)
    rides in the same call as K extra value columns; beyond it, a call of its own.

    The global length must divide evenly by the world size. ``chunk_kda(q_local, ...,
    cp_context=ctx)`` takes this rank's shard ``[1, T_local, ...]``.
    """

    group: object = None
    cu_seqlens: torch.Tensor | None = None
    rank: int | None = None
    world_size: int | None = None
    fused_max_columns: int = platform.TRITON_MAX_DIM
    bytes_sent: int = field(default=0, init=False)  # forward exchange volume of this rank, all calls
    bytes_received: int = field(default=0, init=False)

    def __post_init__(self):
        f = self.fused_max_columns
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"`fused_max_columns` must be an int >= 0, got {f!r}")
        if self.cu_seqlens is None:
            raise ValueError("`cu_seqlens` (the global sequence boundaries) is required for a CPContext")
        for name in ("rank", "world_size"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
                raise TypeError(f"`{name}` must be an int or None, got {type(val).__name__}: {val!r:.80}")
        if dist.is_available() and dist.is_initialized():  # given values must be the group's
            for name, val in (("rank", dist.get_rank(self.group)), ("world_size", dist.get_world_size(self.group))):
                if getattr(self, name) is None:
                    setattr(self, name, val)
                elif getattr(self, name) != val:
                    raise ValueError(f"`{name}`={getattr(self, name)} differs from the process group's {name} {val}")
        elif self.rank is None or self.world_size is None:
            raise ValueError("`rank` and `world_size` are needed when torch.distributed is not initialised, "
                             f"got rank={self.rank}, world_size={self.world_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank` must be in [0, world_size) with world_size >= 1, got rank={self.rank}, "
                             f"world_size={self.world_size}")
        cu_t = torch.as_tensor(self.cu_seqlens)
        if cu_t.ndim != 1 or cu_t.dtype.is_floating_point or cu_t.dtype.is_complex or cu_t.dtype == torch.bool:
            raise ValueError(f"`cu_seqlens` must be a 1-D integer tensor [N+1], got {cu_t.dtype} of shape {list(cu_t.shape)}")
        cu = [int(x) for x in cu_t.tolist()]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"`cu_seqlens` must start at 0 and be non-decreasing, got {cu[:8]}")
        T = cu[-1]
        if T % self.world_size:
            raise ValueError(f"the global length T={T} must be a multiple of the world size {self.world_size}")
        self.global_cu = cu
        self.T_local = T // self.world_size
        lo, hi = self.rank * self.T_local, (self.rank + 1) * self.T_local
        self.lo, self.hi = lo, hi
        inner = sorted({c - lo for c in cu if lo < c < hi})
        self.local_cu = [0, *inner, self.T_local]
        # does a sequence start exactly at the shard start of rank j (then nothing carries in)?
        self.fresh = [(j * self.T_local) in set(cu) for j in range(self.world_size)]

    @property
    def first_len(self) -> int:
        """Tokens of the first local segment (the one a carried-in state reaches)."""
        return self.local_cu[1]

    def local_cu_seqlens(self, device) -> torch.Tensor:
        return torch.tensor(self.local_cu, dtype=torch.int32, device=device)


class _AllGather(torch.autograd.Function):
    """all_gather over a process group, differentiable: the gradient of this rank's piece is the sum
    over the ranks of the gradients of that piece (a reduce-scatter on NCCL; an all-reduce of all
    the pieces' gradients elsewhere, gloo having no reduce-scatter). Ranks are the group's own, so
    that subgroups (e.g. the context-parallel groups of a larger mesh) work on every backend."""

    @staticmethod
    def forward(ctx, t, group, world):
        ctx.group = group
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack(grads).contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            mine = torch.empty_like(stacked[0])
            dist.reduce_scatter_tensor(mine, stacked, group=ctx.group)
            return mine, None, None
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None, None


def _all_gather(t: torch.Tensor, ctx: CPContext) -> list[torch.Tensor]:
    n = t.numel() * t.element_size()
    ctx.bytes_sent += n
    ctx.bytes_received += n * (ctx.world_size - 1)
    return list(_AllGather.apply(t.contiguous(), ctx.group, ctx.world_size))


def chunk_kda_cp(run, q, k, v, g, beta, kw: dict, ctx: CPContext):
    """Context-parallel chunk_kda. ``run(q, k, v, g, beta, **kw)`` is the single-device operator
    (called with ``cu_seqlens``, ``initial_state``, ``output_final_state`` set here)."""
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    dev = q.device
    cu, cu_cpu = ctx.local_cu_seqlens(dev), torch.tensor(ctx.local_cu)  # the host copy: nothing read back
    L0 = ctx.first_len
    carried_in = not ctx.fresh[ctx.rank]
    spans = len(ctx.local_cu) == 2  # one segment covers the whole shard
    A_first = Q_eff = None
    sdt = state_dtype(q.dtype)
    eye = torch.eye(K, device=dev, dtype=sdt)
    if carried_in and V + K <= ctx.fused_max_columns and 2 * L0 >= ctx.T_local:
        # the first segment from S_in = I with v = 0 (final state A, outputs A_{1..t}^T scale q_t) as
        # K extra value columns of the same call: state columns evolve independently, so stage 1
        # (gates, Akk, the inverse, w) is shared and only u, the scan and the output grow to V + K
        # columns, over the whole shard; worth it when the first segment is at least half of it
        h0 = torch.zeros(len(ctx.local_cu) - 1, HV, K, V + K, device=dev, dtype=sdt)
        h0[0, :, :, V:] = eye
        o_ext, finals_ext = run(q, k, torch.cat([v, v.new_zeros(*v.shape[:3], K)], -1), g, beta, cu_seqlens=cu,
                                cu_seqlens_cpu=cu_cpu, initial_state=h0, output_final_state=True, state_v_first=False,
                                **kw)
        o, finals = o_ext[..., :V], finals_ext[..., :V]
        Q_eff, A_first = o_ext[:, :L0, :, V:], finals_ext[:1, :, :, V:]
    else:
        o, finals = run(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, initial_state=None,
                        output_final_state=True, state_v_first=False, **kw)
        if carried_in:  # too wide for one call, or a short first segment: the identity run on its own
            sl = slice(0, L0)
            Q_eff, A_first = run(q[:, sl], k[:, sl], q.new_zeros(1, L0, HV, K, dtype=v.dtype), g[:, sl], beta[:, sl],
                                 cu_seqlens=None, initial_state=eye.expand(1, HV, K, K).contiguous(),
                                 output_final_state=True, state_v_first=False, **kw)
    # this rank's outgoing map S_out = A_out S_in + B_out; A_out = 0 unless one carried-in segment spans the shard
    A_out = A_first[0] if spans and carried_in else torch.zeros(HV, K, K, device=dev, dtype=sdt)
    B_out = finals[-1]
    # one collective for both maps: the backward then has a single, same-ordered exchange on every rank
    maps = _all_gather(torch.cat([A_out, B_out], -1), ctx)
    As = [m[..., :K] for m in maps]
    Bs = [m[..., K:] for m in maps]
    S_in = torch.zeros(HV, K, V, device=dev, dtype=sdt)
    for j in range(ctx.rank):
        S_in = As[j] @ S_in + Bs[j]
        if ctx.fresh[j + 1]:
            S_in = torch.zeros_like(S_in)
    if carried_in and L0 > 0:
        corr = torch.einsum("thk,hkv->thv", Q_eff[0].to(sdt), S_in)
        o = torch.cat([o[:, :L0] + corr[None].to(o.dtype), o[:, L0:]], 1)
    # every rank's output touches every gathered map (times 0), so that every rank takes part in
    # the backward collective even when its own state needs nothing from the others
    touch = sum(m.sum() for m in maps) * 0.0
    return o + touch.to(o.dtype)
