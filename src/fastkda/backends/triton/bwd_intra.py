"""Backward stage 2, phase C: dq, dk and dg through the gated intra-chunk products.

From dAqk, dAkk (phases A, B), qg, kd, kg and the chunk decay: dq, dk and dG, then dg as the
reverse cumulative sum of dG through the gate activation (dA_log, ddt_bias as per-program partial
sums, deterministic). Two forms:
  block path (kda_bwd_gate_kernel): per chunk and feature slice, block by block, any gate and dtype;
  whole-chunk path (kda_bwd_gate_block_kernel, then kda_bwd_dg_kernel): every pair from row and
  column sums, one program per 16-token block and slice, then dg across the blocks per slice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_program, gate_backward
from .tiles import (anchored_level, block_pairs, block_sums, chunk_form, clamped_anchor, cum_gates, cum_gates_last,
                    cum_gates_lo, exclusive_cumsum, gates_after, half_pairs, load_block, load_tile, per_block, prod,
                    row_of, split_level, store_tile)


@triton.jit
def _col_of(x, o_c, c):
    """Column c of a [R, C] tile, as an [R] vector."""
    return tl.sum(tl.where(o_c[None, :] == c, x, 0.0), 1)


@triton.jit
def _dg_out(g, A_log, dt_bias, dg, b_dgr, lower_bound, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_r,
            o_d, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store dg of rows t0 + o_r (b_dgr: the gradient of the activated gates) through the gate
    activation; return the column sums of those rows' dA_log and dt_bias terms ([BS] each)."""
    m_d = o_d < K
    m = ((t0 + o_r) < T_seq)[:, None] & m_d[None, :]
    b_sA = tl.zeros_like(o_d.to(tl.float32))
    b_sb = tl.zeros_like(o_d.to(tl.float32))
    if GATE != 0:
        b_x = load_tile(g, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
        if HAS_BIAS:
            b_x += tl.load(dt_bias + i_hv * K + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        b_dgr, b_dAt = gate_backward(b_x, b_dgr, A_log, i_hv, lower_bound, GATE, HAS_A)
        b_dgr = tl.where(m, b_dgr, 0.0)
        b_sA = tl.sum(tl.where(m, b_dAt, 0.0), 0)
        b_sb = tl.sum(b_dgr, 0)
    store_tile(dg, b_dgr, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    return b_sA, b_sb


@triton.jit
def _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, row, o_d, EXACT_SUMS: tl.constexpr):
    """(G, its rounding error; 0 without EXACT_SUMS) at chunk row ``row``, each [1, BS]."""
    o_n = row + tl.zeros([1], tl.int32)
    return (cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_n, o_d),
            cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_n, o_d, EXACT_SUMS))


@triton.jit
def _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, m, m_t, b_q, b_k, b_r, b_c, PREC: tl.constexpr):
    """Add one anchor's pairs (mask m, its transpose m_t [16, 16]) of a diagonal block to dq, dkr
    (rows of dAqk, dAkk) and dkc (their columns), row factors b_r, column factors b_c [16, BS]. b_dAd
    and b_dKd hold the block's gradients below the diagonal and their transposes above it."""
    b_kc = b_k * b_c
    b_dq += b_r * prod(tl.where(m, b_dAd, 0.0), b_kc, PREC)
    b_dkr += b_r * prod(tl.where(m, b_dKd, 0.0), b_kc, PREC)
    b_dkc += b_c * (prod(tl.where(m_t, b_dAd, 0.0), b_q * b_r, PREC) + prod(tl.where(m_t, b_dKd, 0.0), b_k * b_r, PREC))
    return b_dq, b_dkr, b_dkc


@triton.jit(do_not_specialize=["T"])
def kda_bwd_gate_block_kernel(
    q, k, gc, gd, gok, rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_tot, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BS: tl.constexpr, NSK: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT_SUMS: tl.constexpr, SELECT: tl.constexpr, CLAMP: tl.constexpr,
):
    """Phase C after the whole-chunk stage 1 (gc from the chunk start), part 1: 16-token block i_b and
    feature slice i_s of a chunk (NC * NSK programs per chunk). The block's pairs with earlier columns take
    the anchor at its first token n (e^(G_i - G_n) e^(G_n - G_j), both <= 1 for any gate), its columns'
    pairs with later rows the anchor at its last token, the diagonal block the middle anchor (bounded gates;
    unbounded ones where gok's bit 0 allows) or else the four half-segment levels, or with CLAMP > 0 the
    16-token level and the middle anchors of its 8-token halves on gates clamped at -CLAMP, as the forward's
    intra kernel (docs/math.md sections 3 and 5). dq and dk of this value head (before l2norm) replace dqg
    and dkd; dg's in-block part, the reverse cumulative sum of dG plus the exclusive prefix of the kd terms,
    replaces dkg in s_dw, and both block totals go to s_tot [slots, NC, 2, K] for kda_bwd_dg_kernel.
    EXACT_SUMS: exact sums gc + gd; SELECT as intra.kda_fwd_intra_chunk_kernel's."""
    NC: tl.constexpr = C // 16
    i_sub, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NC * NSK, False)
    i_b = i_sub // NSK
    i_s = i_sub % NSK
    if t0 + 16 * i_b >= T_seq:  # a block past the sequence end (or a slot past the real chunks)
        return
    skip, mid = chunk_form(gok, i_p, SELECT, EXACT_SUMS)
    if skip:
        return
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, 16)
    o_r = 16 * i_b + o_i  # the block's rows in the chunk
    o_d = i_s * BS + tl.arange(0, BS)
    m_d = o_d < K
    rs += i_p * 2 * C
    s_dA += i_p * C * C
    s_dL += i_p * C * C
    # (the order keeps few tiles live at a time: the accumulators of each loop, then the block's own)
    # columns of this block against the rows of later blocks, anchored at the block's last token;
    # each block above the diagonal holds the transpose of its mirror image below
    b_dkc = tl.zeros([16, BS], tl.float32)
    nb = tl.minimum(NC, (T_seq - t0 + 15) // 16)  # blocks holding tokens
    if i_b < nb - 1:
        b_gn, b_ln = _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV, K, 16 * i_b + 15, o_d, EXACT_SUMS)
        for i in range(i_b + 1, nb):
            o_t = 16 * i + o_i
            b_e = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_t, o_d) - b_gn  # G_i - G_n <= 0
            if EXACT_SUMS:
                b_e += cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_t, o_d, EXACT_SUMS) - b_ln
            b_f = tl.exp2(b_e)
            b_qi = load_tile(q, bos, t0, T_seq, i_h, H, K, o_t, o_d) * tl.load(rs + o_t)[:, None] * b_f
            b_ki = load_tile(k, bos, t0, T_seq, i_h, H, K, o_t, o_d) * tl.load(rs + C + o_t)[:, None] * b_f
            b_dkc += prod(load_block(s_dA, 16 * i_b, 16 * i, C, o_i), b_qi, PREC)
            b_dkc += prod(load_block(s_dL, 16 * i_b, 16 * i, C, o_i), b_ki, PREC)
        b_e = b_gn - cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)  # G_n - G_j <= 0
        if EXACT_SUMS:
            b_e += b_ln - cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, EXACT_SUMS)
        b_dkc *= tl.exp2(b_e)
    # rows of this block against the columns of earlier blocks, anchored at the block's first token
    b_dq = tl.zeros([16, BS], tl.float32)
    b_dkr = tl.zeros([16, BS], tl.float32)
    if i_b > 0:
        b_gn, b_ln = _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV, K, 16 * i_b, o_d, EXACT_SUMS)
        for j in range(i_b):
            o_j = 16 * j + o_i
            b_e = b_gn - cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_j, o_d)  # G_n - G_j <= 0
            if EXACT_SUMS:
                b_e += b_ln - cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_j, o_d, EXACT_SUMS)
            b_kj = load_tile(k, bos, t0, T_seq, i_h, H, K, o_j, o_d) * tl.load(rs + C + o_j)[:, None] * tl.exp2(b_e)
            b_dq += prod(load_block(s_dA, 16 * i_b, 16 * j, C, o_i), b_kj, PREC)
            b_dkr += prod(load_block(s_dL, 16 * i_b, 16 * j, C, o_i), b_kj, PREC)
        b_e = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) - b_gn  # G_i - G_n <= 0
        if EXACT_SUMS:
            b_e += cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, EXACT_SUMS) - b_ln
        b_f = tl.exp2(b_e)
        b_dq *= b_f
        b_dkr *= b_f
    # the diagonal block: dAqk's diagonal (factor 1) reaches dq and dk only, never dG
    b_G = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)  # [16, BS]
    b_L = cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, EXACT_SUMS)
    b_q = load_tile(q, bos, t0, T_seq, i_h, H, K, o_r, o_d) * tl.load(rs + o_r)[:, None]
    b_k = load_tile(k, bos, t0, T_seq, i_h, H, K, o_r, o_d) * tl.load(rs + C + o_r)[:, None]
    b_dAd = load_block(s_dA, 16 * i_b, 16 * i_b, C, o_i)
    b_dKd = load_block(s_dL, 16 * i_b, 16 * i_b, C, o_i)
    if mid:
        b_gm, b_lm = _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV, K, 16 * i_b + 8, o_d, EXACT_SUMS)
        b_e = b_G - b_gm + (b_L - b_lm)
        b_dq, b_dkr, b_dkc = _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, o_i[:, None] > o_i[None, :],
                                         o_i[:, None] < o_i[None, :], b_q, b_k, tl.exp2(b_e), tl.exp2(-b_e), PREC)
    else:  # unbounded gates: the 16-token level anchored where both factors are <= 1, then the levels of
        # 8, 4 and 2 tokens alike, or with CLAMP > 0 the 8-token halves' middle anchors on clamped gates
        for lvl in tl.static_range(1 if CLAMP > 0.0 else 4):
            m, b_r, b_c = anchored_level(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, 16 >> lvl, EXACT_SUMS)
            m_t = half_pairs(o_r[None, :], o_r[:, None], 16 >> lvl)
            b_dq, b_dkr, b_dkc = _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, m, m_t, b_q, b_k, b_r, b_c, PREC)
        if CLAMP > 0.0:
            b_e = clamped_anchor(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, 8, CLAMP, EXACT_SUMS)
            m, m_t = block_pairs(o_i[:, None], o_i[None, :], 1, 8), block_pairs(o_i[None, :], o_i[:, None], 1, 8)
            b_dq, b_dkr, b_dkc = _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, m, m_t, b_q, b_k, tl.exp2(b_e),
                                             tl.exp2(-b_e), PREC)
    b_dAii = tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_dAd, 0.0), 1)[:, None]  # [16, 1]
    # qg = scale q e^G, kd = k e^(G_last - G), kg = k e^G; dq leaves first, its part of dG kept
    b_eG = tl.exp2(b_G)
    b_dq += load_tile(s_dqg, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) * (scale * b_eG)
    store_tile(s_dqg, b_dq + b_dAii * b_k, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    b_dG = b_q * b_dq
    b_dkr += load_tile(s_dw, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) * b_eG  # dkg joins the rows' terms
    b_dlast = cum_gates_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d)[None, :] - b_G  # G_last - G
    if EXACT_SUMS:
        b_dlast += cum_gates_last(gd, bos, t0, T_seq, i_hv, HV, K, C, o_d).to(tl.float32)[None, :] - b_L
    b_dkd = load_tile(s_dkd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) * tl.exp2(b_dlast)
    store_tile(s_dkd, b_dkr + b_dkc + b_dAii * b_q + b_dkd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    # dg_t = sum_{i >= t} dG_i + sum_{i < t} kd_i dkd_i + gl dgam over the chunk: here the block's
    # own part of the first two sums and its totals (padding rows add zero: q = k = 0 there)
    b_dG += b_k * (b_dkr - b_dkc)
    b_y = b_k * b_dkd
    store_tile(s_dw, tl.cumsum(b_dG, 0, reverse=True) + exclusive_cumsum(b_y, 0), bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    s_tot += (i_p * NC + i_b) * 2 * K
    tl.store(s_tot + o_d, tl.sum(b_dG, 0), mask=m_d)
    tl.store(s_tot + K + o_d, tl.sum(b_y, 0), mask=m_d)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_dg_kernel(
    g, A_log, dt_bias, gc, s_dw, s_tot, s_dgam, dg, dA_part, dbias_part, cu_seqlens, chunk_indices, lower_bound, T,
    HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BS: tl.constexpr, NSK: tl.constexpr, GATE: tl.constexpr,
    HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Phase C, part 2 (after kda_bwd_gate_block_kernel), one feature slice of a chunk: dg_t = the
    block's part (s_dw) + the dG totals of the later blocks + the kd totals of the earlier ones +
    gl dgam, through the gate activation, and the partial sums of dA_log and dt_bias."""
    NC: tl.constexpr = C // 16
    i_s, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NSK, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_c = tl.arange(0, C)
    o_b = tl.arange(0, NC)
    o_d = i_s * BS + tl.arange(0, BS)
    m_d = o_d < K
    m_b = (t0 + 16 * o_b < T_seq)[:, None] & m_d[None, :]  # blocks holding tokens (the others wrote nothing)
    p_t = s_tot + (i_p * NC + o_b)[:, None] * (2 * K) + o_d[None, :]
    b_R = tl.load(p_t, mask=m_b, other=0.0)  # [NC, BS]: sum of dG over each block
    b_Y = tl.load(p_t + K, mask=m_b, other=0.0)  # and of the kd terms
    m_after = o_b[None, :, None] > o_b[:, None, None]  # [NC, NC, 1]: block b' after block b
    b_after = tl.sum(tl.where(m_after, b_R[None, :, :], 0.0), 1)  # sum over b' > b   [NC, BS]
    b_before = tl.sum(tl.where(o_b[None, :, None] < o_b[:, None, None], b_Y[None, :, :], 0.0), 1)
    b_gam = tl.exp2(cum_gates_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d)) * tl.load(s_dgam + i_p * K + o_d, mask=m_d,
                                                                                   other=0.0)
    b_dgr = load_tile(s_dw, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) + per_block(b_after + b_before, C) + b_gam[None, :]
    b_sA, b_sb = _dg_out(g, A_log, dt_bias, dg, b_dgr, lower_bound, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, GATE, HAS_A,
                         HAS_BIAS)
    if HAS_BIAS:
        tl.store(dbias_part + i_p * K + o_d, b_sb, mask=m_d)
    if HAS_A:
        tl.store(dA_part + i_p * NSK + i_s, tl.sum(b_sA, 0))


@triton.jit
def _diag_products(b_dq, b_dkr, b_dkc, b_dA, b_dK, b_q, b_k, b_r, b_f, PREC: tl.constexpr):
    """Add the pair terms of a diagonal block's gradients dAqk (b_dA) and dAkk (b_dK), kept on the
    pairs of one anchor whose row factors are b_r and column factors b_f, to dq (rows of dAqk), dk
    through the rows of dAkk (dkr) and dk through the columns of both (dkc)."""
    b_kf = b_k * b_f
    b_dq += b_r * prod(b_dA, b_kf, PREC)
    b_dkr += b_r * prod(b_dK, b_kf, PREC)
    b_dkc += b_f * (prod(tl.trans(b_dA), b_q * b_r, PREC) + prod(tl.trans(b_dK), b_k * b_r, PREC))
    return b_dq, b_dkr, b_dkc


@triton.jit(do_not_specialize=["T"])
def kda_bwd_gate_kernel(
    q, k, g, A_log, dt_bias, gc, ga, rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_dgam, s_yb, s_B,
    dg, dA_part, dbias_part, cu_seqlens, chunk_indices, scale, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BS: tl.constexpr, NSK: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr, EXACT: tl.constexpr, DIAG_PREC: tl.constexpr,
):
    """Phase C, one feature slice i_s of a chunk (NSK of them): the gated products and the gate
    gradient; dq and dk of this value head (before l2norm) replace dqg and dkd."""
    i_s, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NSK, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, 16)
    NC: tl.constexpr = C // 16
    rs += i_p * 2 * C
    s_dA += i_p * C * C
    s_dL += i_p * C * C
    s_dgam += i_p * K
    s_yb += i_p * NC * K
    s_B += i_p * NC * NC * K
    b_dA_sum = tl.zeros([BS], tl.float32)
    o_s = i_s * BS
    o_d = o_s + tl.arange(0, BS)
    m_d = o_d < K
    # The chunk decay e^G_last (in gl and every kd = k e^(G_last - G_i)) reaches every token:
    # with y_i = kd_i * dkd_i, dg_t = sum_{i >= t} dG'_i + sum_{i < t} y_i + gl * dgam, where dG'
    # leaves the kd terms out. Summing y as a prefix (never as total minus suffix) keeps a
    # large y_i from cancelling against itself. Block sums of y go to the scratch s_yb.
    for r in range(NC):
        tr = t0 + 16 * r
        b_k = load_tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * r + o_i)[:, None]
        b_eD = tl.exp2(gates_after(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
                       + block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, r + 1, NC)[None, :])
        b_y = b_k * (load_tile(s_dkd, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * b_eD)
        tl.store(s_yb + r * K + o_d, tl.sum(b_y, 0), mask=m_d)
    tl.debug_barrier()
    b_carry = tl.exp2(block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, NC)) \
        * tl.load(s_dgam + o_d, mask=m_d, other=0.0)
    b_dbias = tl.zeros([BS], tl.float32)
    for rr in range(NC):
        r = NC - 1 - rr  # last block first: dg is a reverse cumulative sum
        tr = t0 + 16 * r
        b_q = load_tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + 16 * r + o_i)[:, None]
        b_k = load_tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * r + o_i)[:, None]
        b_c = cum_gates(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        b_xr = gates_after(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)  # gates after each token, to the block end
        # A pair i > j of Aqk or Akk adds a term x to dG_i and -x to dG_j; in dg_t, the sum of dG over
        # i >= t, only pairs with i >= t > j are left. They are summed as such (docs/math.md
        # section 5), so that pairs which cancel exactly never leave rounding noise in dg.
        b_dgx = tl.zeros([16, BS], tl.float32)  # the surviving pair terms of this block's tokens
        # diagonal block; the diagonal of Aqk (factor e^0 = 1) reaches dq and dk only
        b_dAd = load_block(s_dA, 16 * r, 16 * r, C, o_i)
        b_dAii = tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_dAd, 0.0), 1)  # [16]
        b_dAd = tl.where(o_i[:, None] > o_i[None, :], b_dAd, 0.0)
        b_dKd = load_block(s_dL, 16 * r, 16 * r, C, o_i)
        b_dq = b_dAii[:, None] * b_k  # through Aqk (rows)
        b_dkr = tl.zeros([16, BS], tl.float32)  # through Akk (rows)
        b_dkc = b_dAii[:, None] * b_q  # through Aqk and Akk (columns)
        if SAFE:  # anchored at the middle token, as in the forward
            b_cm = row_of(b_c, o_i, 8)
            b_up = tl.exp2(b_c - b_cm[None, :])
            b_dn = tl.exp2(b_cm[None, :] - b_c)
            b_dq, b_dkr, b_dkc = _diag_products(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, b_q, b_k, b_up, b_dn, DIAG_PREC)
        else:  # any gate: the forward's four levels, each anchored where both factors are <= 1
            b_g = load_tile(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            b_gn = load_tile(ga, bos, tr + 1, T_seq, i_hv, HV, K, o_i, o_d)  # the next token's gates
            for lvl in tl.static_range(4):
                m, b_r, b_f = split_level(b_g, b_gn, o_i, 8 >> lvl)
                b_dq, b_dkr, b_dkc = _diag_products(b_dq, b_dkr, b_dkc, tl.where(m, b_dAd, 0.0),
                                                    tl.where(m, b_dKd, 0.0), b_q, b_k, b_r, b_f, DIAG_PREC)
        if EXACT:
            for j in range(15):  # column j: the pair terms of rows i > j, token-parallel
                if SAFE:
                    b_e = tl.where(o_i[:, None] > j, b_up * row_of(b_dn, o_i, j)[None, :], 0.0)
                else:  # unbounded gates: every factor from the gates it spans
                    b_e = tl.exp2(tl.where(o_i[:, None] > j, tl.cumsum(tl.where(o_i[:, None] > j, b_g, 0.0), 0),
                                           float("-inf")))  # [16, BS]: e^(G_i - G_j), rows i > j
                b_kj = row_of(b_k, o_i, j)
                b_T = (_col_of(b_dAd, o_i, j)[:, None] * b_q + _col_of(b_dKd, o_i, j)[:, None] * b_k) \
                    * b_kj[None, :] * b_e
                b_dgx += tl.where(o_i[:, None] > j, tl.cumsum(b_T, 0, reverse=True), 0.0)
        if not EXACT:
            # the same sum as row sums minus column sums of the block's pair terms, reverse-summed
            # (pairs with both tokens >= t cancel): for 16-bit inputs, whose error budget hides
            # the rounding those cancelling pairs leave behind
            b_dgx += tl.cumsum(b_q * b_dq + b_k * (b_dkr - b_dkc), 0, reverse=True)
        # against earlier blocks J: rows anchored at the block start (factors <= 1); the per-pair
        # sums B_rJ go to the scratch s_B for the earlier blocks' turn
        b_eR = tl.exp2(b_c)
        b_row = tl.zeros([16, BS], tl.float32)
        for j in range(r):
            b_colf = tl.exp2(gates_after(ga, bos, t0 + 16 * j, T_seq, i_hv, HV, K, o_i, o_d)
                             + block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, j + 1, r)[None, :])
            b_kj = load_tile(k, bos, t0 + 16 * j, T_seq, i_h, H, K, o_i, o_d) \
                * tl.load(rs + C + 16 * j + o_i)[:, None] * b_colf
            b_pq = b_eR * prod(load_block(s_dA, 16 * r, 16 * j, C, o_i), b_kj, PREC)
            b_pk = b_eR * prod(load_block(s_dL, 16 * r, 16 * j, C, o_i), b_kj, PREC)
            b_dq += b_pq
            b_dkr += b_pk
            b_pr = b_q * b_pq + b_k * b_pk
            b_row += b_pr
            tl.store(s_B + (r * NC + j) * K + o_d, tl.sum(b_pr, 0), mask=m_d)
        b_dgx += tl.cumsum(b_row, 0, reverse=True)  # i in this block, i >= t; j earlier
        # as the columns of later blocks I
        b_col = tl.zeros([16, BS], tl.float32)
        for i in range(r + 1, NC):
            ti = t0 + 16 * i
            b_colf = tl.exp2(b_xr + block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, r + 1, i)[None, :])
            b_eI = tl.exp2(cum_gates(gc, bos, ti, T_seq, i_hv, HV, K, o_i, o_d))
            b_qi = load_tile(q, bos, ti, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + 16 * i + o_i)[:, None] * b_eI
            b_ki = load_tile(k, bos, ti, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * i + o_i)[:, None] * b_eI
            b_col += b_colf * (prod(tl.trans(load_block(s_dA, 16 * i, 16 * r, C, o_i)), b_qi, PREC)
                               + prod(tl.trans(load_block(s_dL, 16 * i, 16 * r, C, o_i)), b_ki, PREC))
        b_dkc += b_col
        b_strict = tl.where(o_i[:, None] > o_i[None, :], 1.0, 0.0)  # exclusive prefix sums as a product
        b_dgx += prod(b_strict, b_k * b_col, "ieee")  # i later, j in this block, j < t
        for i in range(r + 1, NC):  # i later, j earlier: the stored per-pair sums
            for j in range(r):
                b_dgx += tl.load(s_B + (i * NC + j) * K + o_d, mask=m_d, other=0.0)[None, :]
        # qg = scale q e^G, kd = k e^(G_last - G), kg = k e^G
        b_eG = tl.exp2(b_c + block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, r)[None, :])
        b_eD = tl.exp2(b_xr + block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, r + 1, NC)[None, :])
        b_dqg = load_tile(s_dqg, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * (scale * b_eG)
        b_dkd = load_tile(s_dkd, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * b_eD
        b_dkg = load_tile(s_dw, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * b_eG
        # dq and dk of this value head (before l2norm) replace dqg and dkd, read for the last time
        store_tile(s_dqg, b_dq + b_dqg, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        store_tile(s_dkd, b_dkr + b_dkc + b_dkd + b_dkg, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        b_dG = b_q * b_dqg + b_k * b_dkg  # the single-token terms of dG_i (natural log)
        b_pre = tl.zeros([BS], tl.float32)  # y summed over the earlier blocks
        for j in range(r):
            b_pre += tl.load(s_yb + j * K + o_d, mask=m_d, other=0.0)
        b_dgr = tl.cumsum(b_dG, 0, reverse=True) + b_carry[None, :] + b_pre[None, :] + b_dgx \
            + prod(b_strict, b_k * b_dkd, "ieee")  # exclusive prefix of y
        b_carry += tl.sum(b_dG, 0)
        tl.debug_barrier()  # s_B of this block is read by the earlier blocks
        b_sA, b_sb = _dg_out(g, A_log, dt_bias, dg, b_dgr, lower_bound, bos, tr, T_seq, i_hv, HV, K, o_i, o_d,
                             GATE, HAS_A, HAS_BIAS)
        b_dA_sum += b_sA
        b_dbias += b_sb
    if HAS_BIAS:
        tl.store(dbias_part + i_p * K + o_d, b_dbias, mask=m_d)
    if HAS_A:
        tl.store(dA_part + i_p * NSK + i_s, tl.sum(b_dA_sum, 0))
