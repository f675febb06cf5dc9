"""Backward stage 1: the state gradient, walked from the last chunk to the first.

One program per (sequence, value head, block of BV value columns). With dH the gradient of the
state at the end of the current chunk (float32, in registers), per chunk, last to first:

    dv' = Aqk^T do + kd dH                     (stored: it is du of the WY form)
    dH  <- Diag(gl) dH + qg^T do - w^T dv'     (the gradient of the state entering the chunk)

dH at the end of every chunk is stored (``dhs``, [K, V] order, float32) for the chunk-parallel
stage; what is left after the first chunk is the gradient of the initial state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...alloc import new_empty
from ...options import KDAOptions
from .common import launch, seq_grid, seq_program, sequence_location
from .plan import ChunkPlan, pow2
from .tiles import as_operand, chunk_decay, chunk_operands, prod, state_ptrs


@triton.jit(do_not_specialize=["T"])
def kda_bwd_scan_kernel(
    qg, w, kd, Aqk, gl, do, dht, dhs, dh0, dvn, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, DH_SPLIT: tl.constexpr,
):
    i_v, i_nh = seq_program(V, BV)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_seq, c_off = sequence_location(i_n, cu_seqlens, chunk_offsets, T, C, IS_VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_dH = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if USE_DHT:
        p_dht, m_h = state_ptrs(dht + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        b_dH += tl.load(p_dht, mask=m_h, other=0.0).to(tl.float32)

    o_uv = (bos * HV + i_hv) * V + o_v[None, :]
    NT = tl.cdiv(T_seq, C)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        o_t = i_t * C + o_c
        r_t = o_t.to(tl.int64)[:, None]
        p_dh, m_h = state_ptrs(dhs + ((c_off + i_t) * HV + i_hv) * K * V, o_k, o_v, K, V, False)
        tl.store(p_dh, b_dH, mask=m_h)
        b_w, b_qg, b_kd, b_A = chunk_operands(w, qg, kd, Aqk, bos, i_hv, i_t, T_seq, o_k, HV, K, C, DT, EMU, False)
        b_gl = chunk_decay(gl, c_off, i_t, T_seq, i_hv, o_k, HV, K, C)
        m_tv = (o_t < T_seq)[:, None] & m_v[None, :]
        b_do = as_operand(tl.load(do + o_uv + r_t * (HV * V), mask=m_tv, other=0.0), DT, EMU)  # [C, BV]

        b_dHd = as_operand(b_dH, DT, EMU)
        b_dvn = prod(tl.trans(b_A), b_do, PREC) + prod(b_kd, b_dHd, PREC)
        if DH_SPLIT != 0:  # dH's rounding residue as a second operand, scaled past DT's subnormals
            b_dHr = as_operand((b_dH - b_dHd.to(tl.float32)) * DH_SPLIT, DT, EMU)
            b_dvn += prod(b_kd, b_dHr, PREC) * (1.0 / DH_SPLIT)
        tl.store(dvn + o_uv + r_t * (HV * V), b_dvn, mask=m_tv)
        b_dH = b_dH * b_gl[:, None] + prod(tl.trans(b_qg), b_do, PREC) \
            - prod(tl.trans(b_w), as_operand(b_dvn, DT, EMU), PREC)

    if STORE_DH0:
        p_dh0, m_h = state_ptrs(dh0 + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        tl.store(p_dh0, b_dH, mask=m_h)


def bwd_scan(opts: KDAOptions, plan: ChunkPlan, qg, w, kd, Aqk, gl, do, dht, cu_seqlens, chunk_offsets, NT_total: int,
             want_dh0: bool):
    """Launch backward stage 1. Returns (dhs [NT_total, HV, K, V], dv' [B, T, HV, V], dh0 or None), all
    float32 (in 16 bits, dhs alone would add half of the bf16 error budget to dk and dA_log)."""
    s, C, b, dot = opts.shape, opts.chunk_size, plan.backward, plan.dot
    B, T, HV, K, V, N = s.B, s.T, s.HV, s.K, s.V, s.N
    dev = qg.device
    dhs = new_empty(NT_total, HV, K, V, dtype=torch.float32, device=dev)
    dvn = new_empty(B, T, HV, V, dtype=torch.float32, device=dev)
    dh0 = new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev) if want_dh0 else None
    if N * HV > 0:
        launch(kda_bwd_scan_kernel, seq_grid(V, b.scan_bv, N * HV),
               qg, w, kd, Aqk, gl, do, dht, dhs, dh0, dvn, cu_seqlens, chunk_offsets, T,
               HV=HV, K=K, V=V, C=C, BK=pow2(K), BV=b.scan_bv, USE_DHT=dht is not None, STORE_DH0=want_dh0,
               V_FIRST=opts.state_v_first, IS_VARLEN=cu_seqlens is not None, DT=dot.dtype, PREC=dot.prec,
               EMU=dot.emulate, DH_SPLIT=b.scan_dh_split, **b.scan.kwargs())
    return dhs, dvn, dh0
