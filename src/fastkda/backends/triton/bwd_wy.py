"""Backward stage 2, phases A and B: the gradients through the state products and the WY form.

Per chunk and value head, with v' = u - w S and dv' from the backward scan (docs/math.md section 5):

    phase A (contractions over V), in three launches so that dH and S are freed early:
        kda_bwd_state_kernel, FROM_DH:  dkd = v' dH^T     dgam = rowsum(S * dH)
        kda_bwd_state_kernel:           dqg = do S^T      dw = -dv' S^T
        kda_bwd_v_kernel:               dAqk = do v'^T    a = X^T dv'    dv = beta a    dL = -a u^T
    phase B (kda_bwd_k_kernel, contractions over K):
        b = X^T dw       dkg = beta b      dL -= b w^T
        dbeta = rowsum(v a) + rowsum(kg b) + rowsum(dL * Akk)      dAkk = Diag(beta) dL (strictly lower)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_program
from .tiles import (activate_beta, block_lower, blocks_around, cum_gates, load_beta, load_beta_raw, load_tile, prod,
                    state_ptrs, store_tile)


@triton.jit
def _state(x, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """[BK, BS] tile of a [K, V] state, as float32."""
    p, m = state_ptrs(x, o_k, o_v, K, V, False)
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_state_kernel(
    h, dhs, vn, do, dvn, s_dqg, s_dkd, s_dw, s_dgam,
    cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BKS: tl.constexpr, NKS: tl.constexpr,
    BV: tl.constexpr, BS: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, DV_PREC: tl.constexpr,
    FROM_DH: tl.constexpr,
):
    """Phase A's state products as [C, BS] x [BS, BKS] products, one program per chunk, value head
    and BKS feature columns (NKS of them): FROM_DH, dkd and the chunk-decay gradient dgam from the
    state gradient dH (dhs); else dqg and dw from the state S (h). The pointers only the other
    form uses are None. DV_PREC: the products of dv' (float32), which the chunk's dbeta can take many-fold."""
    i_part, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NKS, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_c = tl.arange(0, C)
    o_k = i_part * BKS + tl.arange(0, BKS)
    h += i_p * K * V
    b_a = tl.zeros([C, BKS], tl.float32)  # dkd, or dqg
    b_b = tl.zeros([C, BKS], tl.float32)  # dw
    b_dgam = tl.zeros([BKS], tl.float32)  # gradient of the chunk decay gl
    for s in range(0, BV, BS):
        o_v = s + tl.arange(0, BS)
        b_S = _state(h, o_k, o_v, K, V)  # [BKS, BS]
        if FROM_DH:
            b_dH = _state(dhs + i_p * K * V, o_k, o_v, K, V)
            b_a += prod(load_tile(vn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_dH), PREC)
            b_dgam += tl.sum(b_S * b_dH, 1)
        else:
            b_a += prod(load_tile(do, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_S), PREC)
            b_b -= prod(load_tile(dvn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_S), DV_PREC)
    if FROM_DH:
        store_tile(s_dkd, b_a, bos, t0, T_seq, i_hv, HV, K, o_c, o_k)
        tl.store(s_dgam + i_p * K + o_k, b_dgam, mask=o_k < K)
    else:
        store_tile(s_dqg, b_a, bos, t0, T_seq, i_hv, HV, K, o_c, o_k)
        store_tile(s_dw, b_b, bos, t0, T_seq, i_hv, HV, K, o_c, o_k)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_v_kernel(
    v, beta, u, vn, do, dvn, xs, s_dA, s_dL, s_db, dv,
    cu_seqlens, chunk_indices, scale, T,
    HV: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    DV_PREC: tl.constexpr, MIRROR: tl.constexpr,
):
    """Phase A's products within the chunk (dAqk, a, dv, dL, beta's first terms) as [C, BS] x
    [BS, C] products, one program per chunk and value head. MIRROR: dAqk's upper triangle holds
    its transpose (else zeros). DV_PREC: a = X^T dv', as kda_bwd_state_kernel's dw (one rounding of dv')."""
    _, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 1, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_c = tl.arange(0, C)
    b_X = block_lower(xs + i_p * C * C, o_c, C)  # X is block lower triangular
    b_b = load_beta(beta, bos, t0, T_seq, i_hv, o_c, HV, SIGMOID, BETA_SCALE)  # [C]
    b_dA = tl.zeros([C, C], tl.float32)
    b_dL = tl.zeros([C, C], tl.float32)
    b_db = tl.zeros([C], tl.float32)
    for s in range(0, BV, BS):
        o_v = s + tl.arange(0, BS)
        b_vn = load_tile(vn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v)  # [C, BS]
        b_dA += prod(load_tile(do, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_vn), PREC)
        b_a = prod(tl.trans(b_X), load_tile(dvn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), DV_PREC)  # a = X^T dv'
        store_tile(dv, b_b[:, None] * b_a, bos, t0, T_seq, i_hv, HV, V, o_c, o_v)
        b_db += tl.sum(load_tile(v, bos, t0, T_seq, i_hv, HV, V, o_c, o_v) * b_a, 1)
        b_dL -= prod(b_a, tl.trans(load_tile(u, bos, t0, T_seq, i_hv, HV, V, o_c, o_v)), PREC)
    o_cc = i_p * C * C + o_c[:, None] * C + o_c[None, :]
    # Aqk is stored times scale: its gradient goes to q and k times scale
    b_dA *= scale
    b_up = tl.zeros([C, C], tl.float32)
    if MIRROR:
        b_up = tl.trans(b_dA)
    tl.store(s_dA + o_cc, tl.where(o_c[:, None] >= o_c[None, :], b_dA, b_up))
    tl.store(s_dL + o_cc, b_dL)
    tl.store(s_db + i_p * C + o_c, b_db)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_k_kernel(
    k, beta, w, gc, ls, xs, rs, s_dw, s_dL, s_db, dbeta,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, WHOLE: tl.constexpr,
):
    """Phase B: the contractions over K of a whole chunk, feature slice by feature slice (each input
    read once; dw is overwritten with dkg). With WHOLE, gc holds cumulative gates from the chunk
    start (the whole-chunk stage 1), and dAkk leaves with its transpose in its upper triangle (for
    kda_bwd_gate_block_kernel); else block-local sums, to which the blocks before are added."""
    _, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 1, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, C)
    o_cc = o_c[:, None] * C + o_c[None, :]
    ls += i_p * C * C
    rs += i_p * 2 * C
    s_dL += i_p * C * C
    b_X = block_lower(xs + i_p * C * C, o_c, C)  # X is block lower triangular
    b_braw = load_beta_raw(beta, bos, t0, T_seq, i_hv, o_c, HV)  # [C], as stored
    b_b = activate_beta(b_braw, t0, T_seq, o_c, SIGMOID, BETA_SCALE)
    b_rk = tl.load(rs + C + o_c)
    b_dL = tl.load(s_dL + o_cc)  # phase A's -a u^T (its upper triangle unused)
    b_db = tl.load(s_db + i_p * C + o_c)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_bw = prod(tl.trans(b_X), load_tile(s_dw, bos, t0, T_seq, i_hv, HV, K, o_c, o_d), PREC)  # [C, BS]
        b_G = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
        if not WHOLE:  # block-local sums: add the blocks before each row's
            b_G += blocks_around(gc, bos, t0, T_seq, i_hv, HV, K, C // 16, o_c, o_d)[0]
        b_kg = load_tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d) * b_rk[:, None] * tl.exp2(b_G)
        b_db += tl.sum(b_kg * b_bw, 1)
        b_dL -= prod(b_bw, tl.trans(load_tile(w, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)), PREC)
        tl.debug_barrier()  # every thread has read the slice of dw before it becomes dkg
        store_tile(s_dw, b_b[:, None] * b_bw, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
    m_low = o_c[:, None] > o_c[None, :]
    b_dL = tl.where(m_low, b_dL, 0.0)
    b_db += tl.sum(b_dL * tl.load(ls + o_cc, mask=m_low, other=0.0), 1)
    b_dL = b_b[:, None] * b_dL  # dAkk, strictly lower
    if WHOLE:  # and its transpose above the diagonal
        b_dL += tl.trans(b_dL)
    tl.store(s_dL + o_cc, b_dL)
    # beta: through the sigmoid of the logits when it runs in the kernel
    if SIGMOID:
        b_x = b_braw.to(tl.float32)
        b_db = b_db * BETA_SCALE * tl.sigmoid(b_x) * tl.sigmoid(-b_x)
    o_t = t0 + o_c
    tl.store(dbeta + (bos + o_t).to(tl.int64) * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=o_t < T_seq)
