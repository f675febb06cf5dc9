"""Forward stage 2: the chunk-to-chunk state recurrence and the output, state in registers.

One program per (sequence, value head, block of BV value columns) walks the chunks of its
sequence in order. The float32 state [K, BV] never leaves registers; per chunk:

    v' = u - w S          o = qg S + Aqk v'          S <- Diag(gl) S + kd^T v'

States at chunk starts are written only when asked (``return_intermediate_states``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...testing import new_empty
from .common import mma, pow2

# launch configuration (module-level so that benchmarks can compare variants)
SCAN_BV = 64
SCAN_WARPS = 4
SCAN_STAGES = 2  # for K <= 128; wider keys run unpipelined on 8 warps (shared memory)


@triton.jit
def _state_ptrs(base, o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Pointers and mask of a [BK, BV] state tile stored [K, V] or, with V_FIRST, [V, K]."""
    m = (o_k < K)[:, None] & (o_v < V)[None, :]
    if V_FIRST:
        return base + o_v[None, :] * K + o_k[:, None], m
    return base + o_k[:, None] * V + o_v[None, :], m


@triton.jit(do_not_specialize=["T"])
def kda_fwd_scan_kernel(
    w, u, qg, kd, Aqk, gl, h0, ht, h, o, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr, V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        c_off = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        T_seq = T
        c_off = i_n * tl.cdiv(T, C)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_tri = o_c[:, None] >= o_c[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h = _state_ptrs(h0 + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        b_S += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)

    p_wk = (bos * HV + i_hv) * K + o_k[None, :]  # w, qg, kd share the layout [B, T, HV, K]
    p_uv = (bos * HV + i_hv) * V + o_v[None, :]
    p_a = (bos * HV + i_hv) * C + o_c[None, :]
    for i_t in range(0, tl.cdiv(T_seq, C)):
        o_t = i_t * C + o_c
        m_t = o_t < T_seq
        r_t = o_t.to(tl.int64)[:, None]
        if STORE_H:
            p_h, m_h = _state_ptrs(h + ((c_off + i_t) * HV + i_hv) * K * V, o_k, o_v, K, V, V_FIRST)
            tl.store(p_h, b_S, mask=m_h)
        m_tk = m_t[:, None] & m_k[None, :]
        b_w = mma(tl.load(w + p_wk + r_t * (HV * K), mask=m_tk, other=0.0), DT, EMU)
        b_qg = mma(tl.load(qg + p_wk + r_t * (HV * K), mask=m_tk, other=0.0), DT, EMU)
        b_kd = mma(tl.load(kd + p_wk + r_t * (HV * K), mask=m_tk, other=0.0), DT, EMU)
        b_u = tl.load(u + p_uv + r_t * (HV * V), mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_A = mma(tl.load(Aqk + p_a + r_t * (HV * C), mask=m_t[:, None] & m_tri, other=0.0), DT, EMU)
        b_gl = tl.load(gl + ((c_off + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)

        b_Sd = mma(b_S, DT, EMU)
        b_vn = b_u - tl.dot(b_w, b_Sd, input_precision=PREC)  # v' = u - w S   [C, BV]
        b_vnd = mma(b_vn, DT, EMU)
        b_o = tl.dot(b_qg, b_Sd, input_precision=PREC) + tl.dot(b_A, b_vnd, input_precision=PREC)
        tl.store(o + p_uv + r_t * (HV * V), b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_S = b_S * b_gl[:, None] + tl.dot(tl.trans(b_kd), b_vnd, input_precision=PREC)

    if STORE_HT:
        p_ht, m_h = _state_ptrs(ht + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        tl.store(p_ht, b_S, mask=m_h)


def fwd_scan(opts, w, u, qg, kd, Aqk, gl, h0, cu_seqlens, chunk_offsets, NT_total, v_dtype, DT, PREC, EMU):
    """Launch stage 2. Returns (o, final_state or None, h or None)."""
    s, C = opts.shape, opts.chunk_size
    B, T, HV, K, V, N = s.B, s.T, s.HV, s.K, s.V, s.N
    dev = w.device
    o = new_empty(B, T, HV, V, dtype=v_dtype, device=dev)
    ht = new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev) if opts.output_final_state else None
    h = None
    if opts.return_intermediate_states:
        lead = (1, NT_total) if cu_seqlens is not None else (B, triton.cdiv(T, C))
        h = new_empty(*lead, HV, *opts.state_shape, dtype=torch.float32, device=dev)
    BK = pow2(K)
    BV = min(pow2(V), SCAN_BV)
    if N * HV > 0:
        kda_fwd_scan_kernel[(triton.cdiv(V, BV), N * HV)](
            w, u, qg, kd, Aqk, gl, h0, ht, h, o, cu_seqlens, chunk_offsets, T,
            HV=HV, K=K, V=V, C=C, BK=BK, BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None,
            STORE_H=h is not None, V_FIRST=opts.state_v_first, IS_VARLEN=cu_seqlens is not None, DT=DT, PREC=PREC, EMU=EMU,
            num_warps=SCAN_WARPS if BK <= 128 else 8, num_stages=SCAN_STAGES if BK <= 128 else 1,
        )
    return o, ht, h
