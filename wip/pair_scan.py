"""Prototype: the 16-token scan stepping two chunks at a time (a, b), cross terms from kd_a."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastkda.alloc import new_empty
from fastkda.backends.triton.common import launch, out_alloc, seq_grid, seq_program, sequence_location
from fastkda.backends.triton.plan import pow2
from fastkda.backends.triton.tiles import (activate_beta, as_operand, chunk_decay, chunk_operands, load_beta_raw,
                                          prod, state_ptrs)


@triton.jit
def _u_of(u, xs, v, b_raw, p_uv, c_off, i_t, NT, T_seq, i_hv, o_c, m_v, HV: tl.constexpr, V: tl.constexpr,
          C: tl.constexpr, U_IN: tl.constexpr, U_PREC: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr):
    o_t = i_t * C + o_c
    m_t = o_t < T_seq
    r_t = o_t.to(tl.int64)[:, None]
    if U_IN:
        m_X = ((o_c[:, None] // 16) >= (o_c[None, :] // 16)) & (i_t < NT)
        b_X = tl.load(xs + ((c_off + i_t) * HV + i_hv) * C * C + o_c[:, None] * C + o_c[None, :], mask=m_X, other=0.0)
        b_y = tl.load(v + p_uv + r_t * (HV * V), mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_y *= activate_beta(b_raw, i_t * C, T_seq, o_c, SIGMOID, BETA_SCALE)[:, None]
        b_u = tl.where(m_t[:, None], prod(b_X, b_y, U_PREC), 0.0)
    else:
        b_u = tl.load(u + p_uv + r_t * (HV * V), mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    return b_u


@triton.jit(do_not_specialize=["T"])
def kda_fwd_scan_kernel(
    w, u, xs, v, beta, qg, kd, Aqk, gl, h0, ht, o, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, U_IN: tl.constexpr, U_PREC: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, A_FULL: tl.constexpr,
):
    i_v, i_nh = seq_program(V, BV)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_seq, c_off = sequence_location(i_n, cu_seqlens, chunk_offsets, T, C, IS_VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_k = o_k < K

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h = state_ptrs(h0 + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        b_S += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)

    p_uv = (bos * HV + i_hv) * V + o_v[None, :]
    NT = tl.cdiv(T_seq, C)
    # the decays and beta of the next pair are loaded a pair ahead (outside the operands' pipeline)
    b_gla_n = chunk_decay(gl, c_off, 0, T_seq, i_hv, o_k, HV, K, C)
    b_glb_n = chunk_decay(gl, c_off, 1, T_seq, i_hv, o_k, HV, K, C)
    b_ba_n = load_beta_raw(beta, bos, 0, T_seq, i_hv, o_c, HV) if U_IN else 0.0
    b_bb_n = load_beta_raw(beta, bos, C, T_seq, i_hv, o_c, HV) if U_IN else 0.0
    for i_p in range(0, tl.cdiv(NT, 2)):
        i_a = 2 * i_p
        i_b = i_a + 1
        b_gla, b_glb, b_ba, b_bb = b_gla_n, b_glb_n, b_ba_n, b_bb_n
        b_gla_n = chunk_decay(gl, c_off, i_a + 2, T_seq, i_hv, o_k, HV, K, C)
        b_glb_n = chunk_decay(gl, c_off, i_b + 2, T_seq, i_hv, o_k, HV, K, C)
        if U_IN:
            b_ba_n = load_beta_raw(beta, bos, (i_a + 2) * C, T_seq, i_hv, o_c, HV)
            b_bb_n = load_beta_raw(beta, bos, (i_b + 2) * C, T_seq, i_hv, o_c, HV)
        # chunk b may lie past the sequence: its rows are 0 and its decay 1 (a single last chunk)
        b_wa, b_qa, b_ka, b_Aa, _ = chunk_operands(w, qg, kd, Aqk, gl, bos, i_hv, c_off, i_a, T_seq, o_k, HV, K, C,
                                                   DT, EMU, A_FULL)
        b_wb, b_qb, b_kb, b_Ab, _ = chunk_operands(w, qg, kd, Aqk, gl, bos, i_hv, c_off, i_b, T_seq, o_k, HV, K, C,
                                                   DT, EMU, A_FULL)
        b_ua = _u_of(u, xs, v, b_ba, p_uv, c_off, i_a, NT, T_seq, i_hv, o_c, m_v, HV, V, C, U_IN, U_PREC, SIGMOID,
                     BETA_SCALE)
        b_ub = _u_of(u, xs, v, b_bb, p_uv, c_off, i_b, NT, T_seq, i_hv, o_c, m_v, HV, V, C, U_IN, U_PREC, SIGMOID,
                     BETA_SCALE)
        # independent of the state: the cross terms of chunk b with chunk a's keys
        b_M1 = as_operand(prod(b_wb, tl.trans(b_ka), PREC), DT, EMU)  # w_b kd_a^T   [C, C]
        b_M2 = as_operand(prod(b_qb, tl.trans(b_ka), PREC), DT, EMU)  # qg_b kd_a^T
        b_Sa = b_S * b_gla[:, None]  # Diag(gl_a) S
        b_Sd = as_operand(b_S, DT, EMU)
        b_Sad = as_operand(b_Sa, DT, EMU)
        b_va = b_ua - prod(b_wa, b_Sd, PREC)
        b_vad = as_operand(b_va, DT, EMU)
        b_vb = b_ub - prod(b_wb, b_Sad, PREC) - prod(b_M1, b_vad, PREC)
        b_vbd = as_operand(b_vb, DT, EMU)
        b_oa = prod(b_qa, b_Sd, PREC) + prod(b_Aa, b_vad, PREC)
        b_ob = prod(b_qb, b_Sad, PREC) + prod(b_M2, b_vad, PREC) + prod(b_Ab, b_vbd, PREC)
        o_ta = i_a * C + o_c
        o_tb = o_ta + C
        tl.store(o + p_uv + o_ta.to(tl.int64)[:, None] * (HV * V), b_oa.to(o.dtype.element_ty),
                 mask=(o_ta < T_seq)[:, None] & m_v[None, :])
        tl.store(o + p_uv + o_tb.to(tl.int64)[:, None] * (HV * V), b_ob.to(o.dtype.element_ty),
                 mask=(o_tb < T_seq)[:, None] & m_v[None, :])
        b_S = (b_Sa + prod(tl.trans(b_ka), b_vad, PREC)) * b_glb[:, None] + prod(tl.trans(b_kb), b_vbd, PREC)

    if STORE_HT:
        p_ht, m_h = state_ptrs(ht + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        tl.store(p_ht, b_S, mask=m_h)


def fwd_scan_pairs(opts, plan, scan, w, u, xs, qg, kd, Aqk, gl, chunk_indices, chunk_offsets, NT_total, x):
    s, C = opts.shape, scan.chunk
    B, T, HV, K, V, N = s.B, s.T, s.HV, s.K, s.V, s.N
    dev = w.device
    o = out_alloc(opts)(B, T, HV, V, dtype=x.v.dtype, device=dev)
    ht = new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev) if opts.output_final_state else None
    dot = plan.dot
    if N * HV > 0:
        launch(kda_fwd_scan_kernel, seq_grid(V, scan.BV, N * HV),
               w, u, xs if scan.form_u else None, x.v if scan.form_u else None, x.beta if scan.form_u else None, qg,
               kd, Aqk, gl, x.initial_state, ht, o, x.cu_seqlens, chunk_offsets, T,
               HV=HV, K=K, V=V, C=C, BK=pow2(K), BV=scan.BV, USE_H0=x.initial_state is not None, STORE_HT=ht is not None,
               V_FIRST=opts.state_v_first, IS_VARLEN=x.cu_seqlens is not None, DT=dot.dtype, PREC=dot.prec,
               EMU=dot.emulate, U_IN=scan.form_u, U_PREC=scan.u_prec, SIGMOID=opts.beta_sigmoid,
               BETA_SCALE=opts.beta_scale, A_FULL=scan.a_full, **scan.launch.kwargs())
    return o, ht, None, None
