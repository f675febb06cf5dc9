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

from ...testing import new_empty
from ... import platform
from .common import cdiv, mma, pow2, scan_stages, scan_warps, seq_grid, seq_program, sequence_location
from .scan import _state_ptrs, chunk_operands

BWD_SCAN_BV = 64
BWD_SCAN_WARPS = 8  # 4 spill registers at K = V = 128
# (32 value columns on 4 warps faults on the H200 with Triton 3.6, though exact under the
# interpreter: BENCHMARKS.md. Not launched: 32 columns only for K > 128, on these 8 warps.)
# software-pipelined chunk loop for K <= 128 (the next chunks' operands load during this one's
# products; float32 inputs at most 2 stages): B1 T8192 H64 on the H200 0.718 -> 0.637 -> 0.612 ms
# per call at 1, 2, 3 stages (BENCHMARKS.md)
BWD_SCAN_STAGES = 3
# value columns per program where BWD_SCAN_BV-wide programs would outnumber the SMs (None: keep
# BWD_SCAN_BV), as scan.SCAN_BV_CROWDED
BWD_SCAN_BV_CROWDED = 128


@triton.jit(do_not_specialize=["T"])
def kda_bwd_scan_kernel(
    qg, w, kd, Aqk, gl, do, dht, dhs, dh0, dvn, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
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
        p_dht, m_h = _state_ptrs(dht + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        b_dH += tl.load(p_dht, mask=m_h, other=0.0).to(tl.float32)

    p_uv = (bos * HV + i_hv) * V + o_v[None, :]
    NT = tl.cdiv(T_seq, C)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        o_t = i_t * C + o_c
        r_t = o_t.to(tl.int64)[:, None]
        p_dh, m_h = _state_ptrs(dhs + ((c_off + i_t) * HV + i_hv) * K * V, o_k, o_v, K, V, False)
        tl.store(p_dh, b_dH, mask=m_h)
        b_w, b_qg, b_kd, b_A, b_gl = chunk_operands(w, qg, kd, Aqk, gl, bos, i_hv, c_off, i_t, T_seq, o_k, HV, K, C, DT, EMU)
        m_tv = (o_t < T_seq)[:, None] & m_v[None, :]
        b_do = mma(tl.load(do + p_uv + r_t * (HV * V), mask=m_tv, other=0.0), DT, EMU)  # [C, BV]

        b_dHd = mma(b_dH, DT, EMU)
        b_dvn = tl.dot(tl.trans(b_A), b_do, input_precision=PREC) + tl.dot(b_kd, b_dHd, input_precision=PREC)
        tl.store(dvn + p_uv + r_t * (HV * V), b_dvn, mask=m_tv)
        b_dH = b_dH * b_gl[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC) \
            - tl.dot(tl.trans(b_w), mma(b_dvn, DT, EMU), input_precision=PREC)

    if STORE_DH0:
        p_dh0, m_h = _state_ptrs(dh0 + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        tl.store(p_dh0, b_dH, mask=m_h)


def bwd_scan(opts, qg, w, kd, Aqk, gl, do, dht, cu_seqlens, chunk_offsets, NT_total, want_dh0, DT, PREC, EMU):
    """Launch backward stage 1. Returns (dhs [NT_total, HV, K, V], dv' [B, T, HV, V], dh0 or None), all
    float32 (in 16 bits, dhs alone would add half of the bf16 error budget to dk and dA_log)."""
    s, C = opts.shape, opts.chunk_size
    B, T, HV, K, V, N = s.B, s.T, s.HV, s.K, s.V, s.N
    dev = qg.device
    dhs = new_empty(NT_total, HV, K, V, dtype=torch.float32, device=dev)
    dvn = new_empty(B, T, HV, V, dtype=torch.float32, device=dev)
    dh0 = new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev) if want_dh0 else None
    BK = pow2(K)
    BV = min(pow2(V), BWD_SCAN_BV if BK <= 128 else 32)  # wider keys: fewer registers per program
    if BK <= 128 and BWD_SCAN_BV_CROWDED and cdiv(V, BV) * N * HV > platform.sm_count(dev):
        BV = min(pow2(V), BWD_SCAN_BV_CROWDED)
    if N * HV > 0:
        kda_bwd_scan_kernel[seq_grid(V, BV, N * HV)](
            qg, w, kd, Aqk, gl, do, dht, dhs, dh0, dvn, cu_seqlens, chunk_offsets, T,
            HV=HV, K=K, V=V, C=C, BK=BK, BV=BV, USE_DHT=dht is not None, STORE_DH0=want_dh0,
            V_FIRST=opts.state_v_first, IS_VARLEN=cu_seqlens is not None, DT=DT, PREC=PREC, EMU=EMU,
            num_warps=scan_warps(BWD_SCAN_WARPS, BK, BV), num_stages=scan_stages(BWD_SCAN_STAGES, BK, BV, w),
        )
    return dhs, dvn, dh0
