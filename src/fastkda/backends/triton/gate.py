"""Gate kernels: the activation with its backward (``fused_kda_gate``) and the activation fused
with the within-chunk cumulative sum (``kda_gate_chunk_cumsum``, varlen aware)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...alloc import new_empty
from .common import activate_gate, chunk_location, chunk_tables, contiguous, gate_backward, gate_launch, launch
from .plan import GatePlan, cdiv, pow2


@triton.jit
def kda_gate_fwd_kernel(g, A_log, dt_bias, y, lower_bound, R, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                        BR: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = gate(g) for rows i_r*BR.. of g [R, HV, K], head i_hv."""
    i_r, i_hv = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < R)[:, None] & (o_k < K)[None, :]
    o_p = o_r.to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_g = tl.load(g + o_p, mask=m, other=0.0).to(tl.float32)
    b_y = activate_gate(b_g, A_log, dt_bias, i_hv, o_k, o_k < K, lower_bound, GATE, HAS_A, HAS_BIAS, K, 0)
    tl.store(y + o_p, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def kda_gate_bwd_kernel(g, A_log, dt_bias, dy, dg, dA_part, dbias_part, lower_bound, R, HV: tl.constexpr,
                        K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                        HAS_BIAS: tl.constexpr):
    """dg, and per-program partial sums of dA_log [R/BR, HV] and ddt_bias [R/BR, HV, K]."""
    i_r, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1)  # (R/BR) * HV * K may pass 2^31
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = (o_r < R)[:, None] & m_k[None, :]
    o_p = o_r.to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_x = tl.load(g + o_p, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + o_p, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    b_dx, b_dA = gate_backward(b_x, b_dy, A_log, i_hv, lower_bound, GATE, HAS_A)
    b_dx = tl.where(m, b_dx, 0.0)
    tl.store(dg + o_p, b_dx.to(dg.dtype.element_ty), mask=m)
    if HAS_A:
        tl.store(dA_part + i_r * HV + i_hv, tl.sum(tl.sum(tl.where(m, b_dA, 0.0), 1), 0))
    if HAS_BIAS:
        tl.store(dbias_part + (i_r * HV + i_hv) * K + o_k, tl.sum(b_dx, 0), mask=m_k)


@triton.jit(do_not_specialize=["T"])
def kda_gate_cumsum_kernel(g, A_log, dt_bias, y, cu_seqlens, chunk_indices, lower_bound, scale, T,
                           HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr,
                           HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """y = scale * (within-chunk cumulative sum of gate(g)) for one chunk and head."""
    i_c, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1)
    _, i_t, bos, T_seq = chunk_location(i_c, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    o_t = i_t * C + tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m = (o_t < T_seq)[:, None] & (o_k < K)[None, :]
    o_p = (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_g = tl.load(g + o_p, mask=m, other=0.0).to(tl.float32)
    b_y = activate_gate(b_g, A_log, dt_bias, i_hv, o_k, o_k < K, lower_bound, GATE, HAS_A, HAS_BIAS, K, 0)
    b_y = tl.cumsum(tl.where(m, b_y, 0.0), 0) * scale
    tl.store(y + o_p, b_y.to(y.dtype.element_ty), mask=m)


class _GateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, A_log, dt_bias, opts, plan: GatePlan):
        HV, K = g.shape[-2:]
        g2 = g.contiguous().view(-1, HV, K)
        R = g2.shape[0]
        y = new_empty(*g.shape, dtype=opts.output_dtype, device=g.device)
        if R:
            launch(kda_gate_fwd_kernel, (cdiv(R, plan.rows), HV),
                g2, A_log, dt_bias, y, R=R, HV=HV, K=K, BK=plan.BK, BR=plan.rows,
                **gate_launch(opts, A_log is not None, dt_bias is not None))
        ctx.plan = plan
        ctx.save_for_backward(g2, A_log, dt_bias)
        ctx.opts, ctx.shape, ctx.dtype = opts, g.shape, g.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        g2, A_log, dt_bias = ctx.saved_tensors
        opts = ctx.opts
        R, HV, K = g2.shape
        plan = ctx.plan
        nr = cdiv(R, plan.rows)
        dg = new_empty(R, HV, K, dtype=ctx.dtype, device=g2.device)
        dA_part = new_empty(nr, HV, dtype=torch.float32, device=g2.device) if A_log is not None else None
        db_part = new_empty(nr, HV, K, dtype=torch.float32, device=g2.device) if dt_bias is not None else None
        if R:
            launch(kda_gate_bwd_kernel, (nr, HV),
                g2, A_log, dt_bias, dy.contiguous().view(R, HV, K), dg, dA_part, db_part, R=R, HV=HV, K=K,
                BK=plan.BK, BR=plan.rows, **gate_launch(opts, A_log is not None, dt_bias is not None))
        dA = dA_part.sum(0).view_as(A_log).to(A_log.dtype) if A_log is not None else None
        db = db_part.sum(0).view_as(dt_bias).to(dt_bias.dtype) if dt_bias is not None else None
        return dg.view(ctx.shape), dA, db, None, None


def gate_forward(opts, plan: GatePlan, g, A_log, dt_bias):
    return _GateFunction.apply(g, contiguous(A_log), contiguous(dt_bias), opts, plan)  # the kernels index them densely


def gate_chunk_cumsum(opts, g, A_log, dt_bias, cu_seqlens, cu_host):
    """``cu_host``: the options' checked host copy of ``cu_seqlens``."""
    B, T, HV, K = g.shape
    C = opts.chunk_size
    g, A_log, dt_bias, cu_seqlens = (contiguous(t) for t in (g, A_log, dt_bias, cu_seqlens))
    y = new_empty(B, T, HV, K, dtype=opts.output_dtype, device=g.device)
    if cu_seqlens is not None:
        chunk_indices, _, NT_total = chunk_tables(cu_host, C, g.device)
    else:
        chunk_indices, NT_total = None, B * cdiv(T, C)
    if NT_total:
        launch(kda_gate_cumsum_kernel, (NT_total, HV),
            g, A_log, dt_bias, y, cu_seqlens, chunk_indices, scale=opts.scale if opts.scale is not None else 1.0, T=T,
            HV=HV, K=K, BK=pow2(K, 1), C=C, IS_VARLEN=cu_seqlens is not None,
            **gate_launch(opts, A_log is not None, dt_bias is not None))
    return y
