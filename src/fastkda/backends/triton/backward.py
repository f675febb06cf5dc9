"""The chunk backward on the host: the backward state scan, then the chunk-parallel gradients
(phases A and B: bwd_wy; phase C: bwd_intra), then the l2-norm backward, as the plan says.

Peak memory per token and value head (K = V = 128, C = 64, bf16 inputs, bytes), at phase A's
last launch: stage 1's w, u (512), gc (512; the block path also ga, 512), Akk, X (512), Aqk and
X's bfloat16 copy (256); the scan's v' (256); dv' (512); the chunk kernels' dqg, dkd, dw (1536),
dAqk, dAkk (512) and dv (256): 4864 B on the whole-chunk path, 5376 B on the block path. Phase A
runs in three launches so that dH (1024) is freed before dqg and dw are allocated and h (512)
before dAqk, dAkk and dv. qg and kd are freed before the chunk kernels (Aqk too when the backward
recomputed it); dq and dk (before l2norm) reuse the buffers of dqg and dkd.
"""

from __future__ import annotations

import torch

from ...alloc import new_empty
from ...options import KDAInputs, KDAOptions
from .bwd_intra import kda_bwd_dg_kernel, kda_bwd_gate_block_kernel, kda_bwd_gate_kernel
from .bwd_l2norm import bwd_qk
from .bwd_scan import bwd_scan
from .bwd_wy import kda_bwd_k_kernel, kda_bwd_state_kernel, kda_bwd_v_kernel
from .common import contiguous, gate_launch, launch, out_alloc
from .plan import ChunkPlan, cdiv, pow2


def chunk_gradients(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs, work: list, do):
    """Backward stage 2 (phases A, B, C) from ``work`` = [stage 1's output, v', h, dhs, dv'], which
    is emptied: what only phase A reads (v', h, dhs, dv', u) is freed as its launches finish with
    it, w after phase B, and dg is allocated after both, so that the phases' peaks do not add up.
    Returns (dq, dk per value head before l2norm [B, T, HV, K] float32, for ``bwd_qk``; dv, dg,
    dbeta, dA_log, ddt_bias)."""
    p, vn, h, dhs, dvn = work
    work.clear()
    s, C, b = opts.shape, opts.chunk_size, plan.backward
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    dev, NT, cu_seqlens = x.q.device, p.NT_total, x.cu_seqlens
    f32 = dict(dtype=torch.float32, device=dev)
    alloc = out_alloc(opts)  # use_graph: rows past the last sequence, never written, are zero
    s_dgam = new_empty(NT, HV, K, **f32)
    dbeta = alloc(*x.beta.shape, dtype=x.beta.dtype, device=dev)
    # per-slot partial sums: with use_graph the slots past the real chunks are skipped and must add zero
    dbias_part = alloc(NT, HV, K, **f32) if x.dt_bias is not None else None
    dA_part = None
    if NT > 0:
        BK, BV = pow2(K), pow2(V)
        where = dict(cu_seqlens=cu_seqlens, chunk_indices=p.chunk_indices, T=T, HV=HV, C=C,
                     IS_VARLEN=cu_seqlens is not None)
        beta_kw = dict(SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale)
        NKS = cdiv(K, b.state_bs)
        state_kw = dict(K=K, V=V, BKS=b.state_bs, NKS=NKS, BV=BV, BS=b.BS, **where, PREC=plan.dot.prec,
                        DV_PREC=b.dv_prec, **b.state.kwargs())
        # phase A: dH freed before dqg and dw are allocated, h before dAqk, dAkk and dv
        s_dkd = alloc(B, T, HV, K, **f32)
        launch(kda_bwd_state_kernel, (NT * NKS, HV), h, dhs, vn, None, None, None, s_dkd, None, s_dgam,
               FROM_DH=True, **state_kw)
        del dhs
        s_dqg = alloc(B, T, HV, K, **f32)
        s_dw = new_empty(B, T, HV, K, **f32)
        launch(kda_bwd_state_kernel, (NT * NKS, HV), h, None, None, do, dvn, s_dqg, None, s_dw, None,
               FROM_DH=False, **state_kw)
        del h
        s_dA, s_dL = (new_empty(NT, HV, C, C, **f32) for _ in range(2))
        s_db = new_empty(NT, HV, C, **f32)
        dv = alloc(B, T, HV, V, dtype=x.v.dtype, device=dev)
        launch(kda_bwd_v_kernel, (NT, HV), x.v, x.beta, p.u, vn, do, dvn, p.xs, s_dA, s_dL, s_db, dv,
               scale=opts.scale, V=V, BV=BV, BS=b.BS, MIRROR=b.whole, **beta_kw, **where, PREC=plan.dot.prec,
               DV_PREC=b.dv_prec, **b.v.kwargs())
        del vn, dvn
        p = p._replace(u=None)
        launch(kda_bwd_k_kernel, (NT, HV),
               x.k, x.beta, p.w, p.gc, p.ls, p.xs, p.rs, s_dw, s_dL, s_db, dbeta,
               H=H, K=K, BK=BK, BS=b.BS, WHOLE=b.whole, **beta_kw, **where, PREC=plan.dot.prec, **b.k.kwargs())
        p = p._replace(w=None)
        gate = gate_launch(opts, x.A_log is not None, x.dt_bias is not None)
        dg = alloc(B, T, HV, K, dtype=x.g.dtype, device=dev)  # after phase A, the step's peak
        if b.whole:
            NSB = cdiv(K, b.gate_block_bs)
            s_tot = new_empty(NT, HV, C // 16, 2, K, **f32)  # per block: sums of dG and of the kd terms
            for ps in plan.stage1.passes:
                launch(kda_bwd_gate_block_kernel, (NT * (C // 16) * NSB, HV),
                       x.q, x.k, p.gc, p.gd, p.gok, p.rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_tot, scale=opts.scale,
                       H=H, K=K, BS=b.gate_block_bs, NSK=NSB, EXACT_SUMS=ps.exact, SELECT=ps.select, CLAMP=ps.clamp,
                       **where, PREC=b.pair_prec, **ps.gate_block.kwargs())
            NSG = cdiv(K, b.dg_bs)
            dA_part = alloc(NT, HV, NSG, **f32) if x.A_log is not None else None
            launch(kda_bwd_dg_kernel, (NT * NSG, HV),
                   x.g, x.A_log, x.dt_bias, p.gc, s_dw, s_tot, s_dgam, dg, dA_part, dbias_part, K=K, BS=b.dg_bs,
                   NSK=NSG, **gate, **where, **b.dg.kwargs())
        else:
            NSK = cdiv(K, b.BS)
            dA_part = alloc(NT, HV, NSK, **f32) if x.A_log is not None else None
            s_yb = new_empty(NT, HV, C // 16, K, **f32)  # block sums of the kd terms
            s_B = new_empty(NT, HV, C // 16, C // 16, K, **f32)  # pair sums per block pair
            launch(kda_bwd_gate_kernel, (NT * NSK, HV),
                   x.q, x.k, x.g, x.A_log, x.dt_bias, p.gc, p.ga, p.rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_dgam, s_yb,
                   s_B, dg, dA_part, dbias_part, scale=opts.scale, H=H, K=K, BS=b.BS, NSK=NSK, SAFE=opts.safe_gate,
                   EXACT=b.exact_pairs, DIAG_PREC=b.diag_prec, **gate, **where, PREC=plan.dot.prec,
                   **b.gate.kwargs())
    else:  # no tokens: zero gradients
        s_dqg, s_dkd = (alloc(B, T, HV, K, **f32) for _ in range(2))
        dv = alloc(B, T, HV, V, dtype=x.v.dtype, device=dev)
        dg = alloc(B, T, HV, K, dtype=x.g.dtype, device=dev)
        dA_part = torch.zeros(1, HV, 1, **f32) if x.A_log is not None else None
        dbias_part = torch.zeros(1, HV, K, **f32) if x.dt_bias is not None else None
    # in the parameters' own shapes ([HV] or with unit dimensions; [HV*K] or [HV, K])
    dA_log = dA_part.sum(0).sum(-1).view(x.A_log.shape).to(x.A_log.dtype) if x.A_log is not None else None
    ddt_bias = dbias_part.sum(0).view(x.dt_bias.shape).to(x.dt_bias.dtype) if x.dt_bias is not None else None
    return s_dqg, s_dkd, dv, dg, dbeta, dA_log, ddt_bias


def gradients(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs, stage: list, do, dht, need_dh0: bool):
    """Backward stages 1 and 2 from ``stage`` = [stage 1's output, the scan's h, v'] (contiguous
    inputs ``x``): (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0). ``stage`` is emptied, so that what
    only it holds is freed early: qg, kd (and Aqk, unless the autograd context keeps it) before the
    largest stage, the rest before the q/k reduction."""
    p, h, vn = stage
    stage.clear()
    q, k, h0, cu_seqlens = x.q, x.k, x.initial_state, x.cu_seqlens
    do = contiguous(do)
    dht = contiguous(dht) if opts.output_final_state and dht is not None else None
    dhs, dvn, dh0 = bwd_scan(opts, plan, p.qg, p.w, p.kd, p.Aqk, p.gl, do, dht, cu_seqlens, p.chunk_offsets,
                             p.NT_total, need_dh0)
    work = [p._replace(qg=None, kd=None, Aqk=None), vn, h, dhs, dvn]  # qg, kd, Aqk: read by the scans only
    del p, h, vn, dhs, dvn
    dqh, dkh, dv, dg, dbeta, dA_log, ddt_bias = chunk_gradients(opts, plan, x, work, do)
    b = plan.backward
    dq = bwd_qk(q, dqh, opts.qk_l2norm, b.qk_rows, b.qk)
    dk = bwd_qk(k, dkh, opts.qk_l2norm, b.qk_rows, b.qk)
    if opts.graph:  # the l2norm backward reads every row of q, k: the rows after the last sequence
        # get 0 * (their input), which is NaN for a NaN input; they are zero
        tail = (torch.arange(opts.shape.T, device=q.device) >= cu_seqlens[opts.shape.N])[None, :, None, None]
        dq.masked_fill_(tail, 0.0)
        dk.masked_fill_(tail, 0.0)
    if dh0 is not None:
        dh0 = dh0.to(h0.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
