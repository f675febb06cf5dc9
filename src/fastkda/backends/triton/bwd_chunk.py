"""Backward stage 2, chunk-parallel: every input gradient of one chunk from the state S entering it,
the state gradient dH at its end (stage 1 of the backward) and the forward's stage-1 tensors.

Launches over every chunk and value head, each program of phase A and C also one part of its
chunk (grids (chunks x parts, heads), common.chunk_program): phase A as state products per block
of feature columns plus one program for the products within the chunk, phase B per chunk, phase C
per feature slice (or per 16-token block and slice, then per slice). With v' = u - w S and dv' from stage 1
(docs/math.md section 5 derives every line):

    phase A (contractions over V):  dqg = do S^T     dkd = v' dH^T     dw = -dv' S^T
                                    dAqk = do v'^T   a = X^T dv'       dv = beta a
                                    dL = -a u^T      dgam = rowsum(S * dH)
    phase B (contractions over K):  b = X^T dw       dkg = beta b      dL -= b w^T
                                    dbeta = rowsum(v a) + rowsum(kg b) + rowsum(dL * Akk)
                                    dAkk = Diag(beta) dL (strictly lower)
    phase C (gated products):       dq, dk and dG from Aqk, Akk, qg, kd, kg and the chunk decay;
                                    dg = reverse cumulative sum of dG, through the gate activation

Phase C takes one of two forms: per chunk and feature slice, block by block, its pairs summed as
what survives in each dg (kda_bwd_gate_kernel, any gate, any dtype); or, after the whole-chunk
stage 1 (bfloat16 inputs, gates activated in the kernel or bounded), every pair from row and
column sums, one program per 16-token block and slice (kda_bwd_gate_block_kernel: dq, dk and each
block's part of dg) and then one per slice (kda_bwd_dg_kernel: dg across the blocks).

dq and dk leave per value head (float32, before l2norm, in the buffers of dqg and dkd); ``bwd_qk``
sums the heads of a group and applies the l2norm backward. Everything else leaves final. dA_log and dt_bias leave per-program
partial sums (deterministic; summed by the caller).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...testing import new_empty
from .common import (block_lower, cdiv, chunk_program, dot_config, exclusive_cumsum, gate_backward, gate_launch,
                     launch_options, out_alloc, pow2, row_of)
from .scan import _state_ptrs
from . import prepare
from .prepare import (SLICE, _anchored, _beta, _blk, _bsums, _c, _c_last, _c_lo, _per_block, _put, _tile, _x,
                      chunk_form, half_pairs, split_launches, split_level)

# (warps, register cap or None) of each launch for K, V <= 128 (common.launch_options)
# "v", "k", "gate_block", "dg" and the slices below: B1 T8192 H64 safe gate, one training step on the
# H200 (BENCHMARKS.md: v 2.66 -> 1.56 ms at 4 warps instead of 8; k 0.94 -> 0.87 ms without the cap,
# 1.00 ms since it also stores dAkk transposed, 0.95 ms capped at 168 registers (H96 1.51 -> 1.41 ms;
# 192: 1.48; 4 warps: 1.06 at H64); gate_block 1.79 ms at 1 warp and 32 columns, 2.18 at 2 warps
# capped at 168 registers; before its stages were reordered (1.89 at 1 warp): 2.82 | 2.64 at 2 | 4
# warps, 2.44 at 4 capped at 96, 3.36 at 16 columns on 2 warps, 3.03 at 64 on 4; dg 0.29 ms at 64
# columns on 4 warps, 0.33 at 32 (0.35 on 8), 0.45 at 128 on 8); "gate": B1 T8192 H64 softplus,
# 9.59 ms against 9.89 ms at 4 warps
LAUNCH = {"v": (4, None), "k": (2, 168), "gate": (2, 128), "gate_block": (1, None), "dg": (4, None)}
GATE_BLOCK_SLICE = 32  # feature columns per program of kda_bwd_gate_block_kernel
DG_SLICE = 64  # feature columns per program of kda_bwd_dg_kernel
V_STATE_SLICE = 32  # key columns per state-product program of kda_bwd_v_kernel (1.61 ms at 64)
# Within-block pair terms of dg: summed exactly (i >= t > j, one column at a time) or as row sums
# minus column sums of the block's products, whose rounding leaves a residue of the cancelling
# pairs (float32 products: up to 2e-4 of dg at extreme gates on the CPU tier, within the 16-bit
# budget, not float32's); None: exactly for float32 inputs only. Without the exact sum the
# diagonal blocks' products run as tf32x3 (float32 accuracy), since one tf32 rounding of a pair
# term would leave a thousandfold larger residue than float32's (the whole-chunk kernel accepts
# tf32's for bfloat16, measured within its budget: PAIR_PREC below). With the exact sum, dq and dk
# of the diagonal blocks take the input dtype's products (tf32 for 16-bit inputs), as elsewhere.
EXACT_PAIRS = None
# Bounded gates (safe_gate) with bfloat16 inputs take the whole-chunk path end to end: stage 1
# (also in the training forward, whose output the backward reads) and kda_bwd_gate_block_kernel,
# which sums every pair of a chunk from row and column sums; so do gates activated in the kernel
# (softplus, a lower-bound gate without safe_gate) with prepare.WHOLE_ANY. True/False force it on or
# off for those gates of any dtype; None: bfloat16 only (EXACT_PAIRS=True keeps the block path).
WHOLE_BACKWARD = None
# Products of that kernel per input dtype. A pair term enters dg twice, through its row and its
# column, rounded apart; the residue of their cancellation is of the products' precision. Bounded
# gates (safe_gate) take tf32 for bfloat16; unbounded ones tf32x3, since dA_log = sum(y dgate) weighs
# that residue by the activated gate y, which is unbounded (docs/math.md section 5). float16's budget
# needs tf32x3 for every gate.
PAIR_PREC = {torch.bfloat16: "tf32", torch.float16: "tf32x3", torch.float32: "ieee"}
PAIR_PREC_UNBOUNDED = {torch.bfloat16: "tf32x3", torch.float16: "tf32x3", torch.float32: "ieee"}


def pair_precision(opts, dtype: torch.dtype) -> str:
    """The input precision of kda_bwd_gate_block_kernel's pair products (see PAIR_PREC)."""
    return (PAIR_PREC if opts.safe_gate else PAIR_PREC_UNBOUNDED)[dtype]


def whole_backward(opts, dtype: torch.dtype) -> bool:
    """Whether the backward of these options takes the whole-chunk path (see WHOLE_BACKWARD), for the
    gates that path serves (prepare.whole_gates)."""
    if not prepare.whole_gates(opts):
        return False
    if WHOLE_BACKWARD is not None:
        return WHOLE_BACKWARD
    return dtype == torch.bfloat16 and not EXACT_PAIRS


@triton.jit
def _col_of(x, o_c, c):
    """Column c of a [R, C] tile, as an [R] vector."""
    return tl.sum(tl.where(o_c[None, :] == c, x, 0.0), 1)


@triton.jit
def _xcol(xs, r, C: tl.constexpr, o_c, o_i):
    """Column block r of X [C, 16]: rows above the block are zero (and were never written)."""
    return tl.load(xs + o_c[:, None] * C + 16 * r + o_i[None, :], mask=(o_c >= 16 * r)[:, None], other=0.0)


@triton.jit
def _state(x, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """[BK, BS] tile of a [K, V] state, as float32."""
    p, m = _state_ptrs(x, o_k, o_v, K, V, False)
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit(do_not_specialize=["T"])
def kda_bwd_v_kernel(
    v, beta, u, vn, h, dhs, do, dvn, xs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_db, s_dgam, dv,
    cu_seqlens, chunk_indices, scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BKS: tl.constexpr, NKS: tl.constexpr,
    BV: tl.constexpr, BS: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr, MIRROR: tl.constexpr,
):
    """Phase A, the contractions over V, as [C, BS] x [BS, .] products of the whole chunk. Parts
    0..NKS-1 of a chunk: the state products for BKS feature columns each (dqg, dkd, dw and the
    chunk-decay gradient dgam); part NKS: the products within the chunk (dAqk, a, dv, dL, beta's
    first terms). MIRROR: dAqk's upper triangle holds its transpose (else zeros)."""
    i_part, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NKS + 1, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_c = tl.arange(0, C)
    if i_part < NKS:
        o_k = i_part * BKS + tl.arange(0, BKS)
        h += i_p * K * V
        dhs += i_p * K * V
        b_dqg = tl.zeros([C, BKS], tl.float32)
        b_dkd = tl.zeros([C, BKS], tl.float32)
        b_dw = tl.zeros([C, BKS], tl.float32)
        b_dgam = tl.zeros([BKS], tl.float32)  # gradient of the chunk decay gl
        for s in range(0, BV, BS):
            o_v = s + tl.arange(0, BS)
            b_S = _state(h, o_k, o_v, K, V)  # [BKS, BS]
            b_dH = _state(dhs, o_k, o_v, K, V)
            b_dqg += _mm(_tile(do, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_S), PREC)
            b_dkd += _mm(_tile(vn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_dH), PREC)
            b_dw -= _mm(_tile(dvn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_S), PREC)
            b_dgam += tl.sum(b_S * b_dH, 1)
        _put(s_dqg, b_dqg, bos, t0, T_seq, i_hv, HV, K, o_c, o_k)
        _put(s_dkd, b_dkd, bos, t0, T_seq, i_hv, HV, K, o_c, o_k)
        _put(s_dw, b_dw, bos, t0, T_seq, i_hv, HV, K, o_c, o_k)
        tl.store(s_dgam + i_p * K + o_k, b_dgam, mask=o_k < K)
    else:
        b_X = block_lower(xs + i_p * C * C, o_c, C)  # X is block lower triangular
        b_b = _beta(beta, bos, t0, T_seq, i_hv, o_c, HV, SIGMOID, BETA_SCALE)  # [C]
        b_dA = tl.zeros([C, C], tl.float32)
        b_dL = tl.zeros([C, C], tl.float32)
        b_db = tl.zeros([C], tl.float32)
        for s in range(0, BV, BS):
            o_v = s + tl.arange(0, BS)
            b_vn = _tile(vn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v)  # [C, BS]
            b_dA += _mm(_tile(do, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), tl.trans(b_vn), PREC)
            b_a = _mm(tl.trans(b_X), _tile(dvn, bos, t0, T_seq, i_hv, HV, V, o_c, o_v), PREC)  # a = X^T dv'
            _put(dv, b_b[:, None] * b_a, bos, t0, T_seq, i_hv, HV, V, o_c, o_v)
            b_db += tl.sum(_tile(v, bos, t0, T_seq, i_hv, HV, V, o_c, o_v) * b_a, 1)
            b_dL -= _mm(b_a, tl.trans(_tile(u, bos, t0, T_seq, i_hv, HV, V, o_c, o_v)), PREC)
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
    """Phase B: the contractions over K, row block by row block (dw is overwritten with dkg). With
    WHOLE, gc holds cumulative gates from the chunk start (the whole-chunk stage 1), and dAkk leaves
    with its transpose in its upper triangle (for kda_bwd_gate_block_kernel)."""
    _, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 1, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, 16)
    o_c = tl.arange(0, C)
    NC: tl.constexpr = C // 16
    ls += i_p * C * C
    xs += i_p * C * C
    rs += i_p * 2 * C
    s_dL += i_p * C * C
    s_db += i_p * C
    for r in range(NC):
        tr = t0 + 16 * r
        b_b = _beta(beta, bos, tr, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)
        b_rk = tl.load(rs + C + 16 * r + o_i)
        b_Xc = _xcol(xs, r, C, o_c, o_i)
        b_dL = tl.load(s_dL + (16 * r + o_i)[:, None] * C + o_c[None, :])  # [16, C]
        b_db = tl.load(s_db + 16 * r + o_i)
        for s in range(0, BK, BS):
            o_d = s + tl.arange(0, BS)
            # rows of earlier blocks already hold dkg: X is zero there, so they are not read
            b_dwC = tl.load(s_dw + (bos + t0 + o_c).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :],
                            mask=((o_c >= 16 * r) & (t0 + o_c < T_seq))[:, None] & (o_d < K)[None, :], other=0.0)
            b_bw = _mm(tl.trans(b_Xc), b_dwC, PREC)  # [16, BS]
            b_G = _c(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            if not WHOLE:  # block-local sums: add the blocks before
                b_G += _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, r)[None, :]
            b_kg = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None] * tl.exp2(b_G)
            b_db += tl.sum(b_kg * b_bw, 1)
            b_dL -= _mm(b_bw, tl.trans(_tile(w, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)), PREC)
            tl.debug_barrier()  # every thread has read rows r.. of dw before they become dkg
            _put(s_dw, b_b[:, None] * b_bw, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        m_low = (16 * r + o_i)[:, None] > o_c[None, :]
        b_dL = tl.where(m_low, b_dL, 0.0)
        b_Akk = tl.load(ls + (16 * r + o_i)[:, None] * C + o_c[None, :], mask=m_low, other=0.0)
        b_db += tl.sum(b_dL * b_Akk, 1)
        b_dL = b_b[:, None] * b_dL  # dAkk
        if WHOLE:  # this block's rows up to the diagonal, and transposed above it (in rows read before)
            o_r = 16 * r + o_i
            tl.store(s_dL + o_r[:, None] * C + o_c[None, :], b_dL, mask=o_r[:, None] >= o_c[None, :])
            tl.store(s_dL + o_c[None, :] * C + o_r[:, None], b_dL, mask=m_low)
        else:
            tl.store(s_dL + (16 * r + o_i)[:, None] * C + o_c[None, :], b_dL)
        # beta: through the sigmoid of the logits when it runs in the kernel
        o_t = tr + o_i
        m_t = o_t < T_seq
        p_b = beta + (bos + o_t).to(tl.int64) * HV + i_hv
        if SIGMOID:
            b_x = tl.load(p_b, mask=m_t, other=0.0).to(tl.float32)
            b_db = b_db * BETA_SCALE * tl.sigmoid(b_x) * tl.sigmoid(-b_x)
        tl.store(dbeta + (bos + o_t).to(tl.int64) * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=m_t)


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
        b_x = _tile(g, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
        if HAS_BIAS:
            b_x += tl.load(dt_bias + i_hv * K + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        b_dgr, b_dAt = gate_backward(b_x, b_dgr, A_log, i_hv, lower_bound, GATE, HAS_A)
        b_dgr = tl.where(m, b_dgr, 0.0)
        b_sA = tl.sum(tl.where(m, b_dAt, 0.0), 0)
        b_sb = tl.sum(b_dgr, 0)
    _put(dg, b_dgr, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    return b_sA, b_sb


@triton.jit
def _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, row, o_d, ANY: tl.constexpr):
    """(G, its rounding error; 0 without ANY) at chunk row ``row``, each [1, BS]."""
    o_n = row + tl.zeros([1], tl.int32)
    return (_c(gc, bos, t0, T_seq, i_hv, HV, K, o_n, o_d), _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_n, o_d, ANY))


@triton.jit
def _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, m, m_t, b_q, b_k, b_r, b_c, PREC: tl.constexpr):
    """Add one anchor's pairs (mask m, its transpose m_t [16, 16]) of a diagonal block to dq, dkr
    (rows of dAqk, dAkk) and dkc (their columns), row factors b_r, column factors b_c [16, BS]. b_dAd
    and b_dKd hold the block's gradients below the diagonal and their transposes above it."""
    b_kc = b_k * b_c
    b_dq += b_r * _mm(tl.where(m, b_dAd, 0.0), b_kc, PREC)
    b_dkr += b_r * _mm(tl.where(m, b_dKd, 0.0), b_kc, PREC)
    b_dkc += b_c * (_mm(tl.where(m_t, b_dAd, 0.0), b_q * b_r, PREC) + _mm(tl.where(m_t, b_dKd, 0.0), b_k * b_r, PREC))
    return b_dq, b_dkr, b_dkc


@triton.jit(do_not_specialize=["T"])
def kda_bwd_gate_block_kernel(
    q, k, gc, gd, gok, rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_tot, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BS: tl.constexpr, NSK: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, ANY: tl.constexpr, SEL: tl.constexpr,
):
    """Phase C after the whole-chunk stage 1 (gc from the chunk start), part 1: 16-token block r and
    feature slice i_s of a chunk (NC * NSK programs per chunk). The block's pairs with earlier
    columns take the anchor at its first token n (e^(G_i - G_n) e^(G_n - G_j), both <= 1 for any
    gate), its columns' pairs with later rows the anchor at its last token, the diagonal block the
    middle anchor (bounded gates; unbounded ones where gok's bit 0 allows) or the four half-segment
    levels (docs/math.md sections 3 and 5). dq and dk of this value head (before l2norm) replace dqg
    and dkd; dg's in-block part, the reverse cumulative sum of dG plus the exclusive prefix of the
    kd terms, replaces dkg in s_dw, and both block totals go to s_tot [slots, NC, 2, K] for
    kda_bwd_dg_kernel. ANY: exact sums gc + gd; SEL as prepare.kda_fwd_intra_chunk_kernel's."""
    NC: tl.constexpr = C // 16
    i_sub, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NC * NSK, False)
    r = i_sub // NSK
    i_s = i_sub % NSK
    if t0 + 16 * r >= T_seq:  # a block past the sequence end (or a slot past the real chunks)
        return
    skip, mid = chunk_form(gok, i_p, SEL, ANY)
    if skip:
        return
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, 16)
    o_r = 16 * r + o_i  # the block's rows in the chunk
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
    if r < nb - 1:
        b_gn, b_ln = _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV, K, 16 * r + 15, o_d, ANY)
        for i in range(r + 1, nb):
            o_t = 16 * i + o_i
            b_e = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_t, o_d) - b_gn  # G_i - G_n <= 0
            if ANY:
                b_e += _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_t, o_d, ANY) - b_ln
            b_f = tl.exp2(b_e)
            b_qi = _tile(q, bos, t0, T_seq, i_h, H, K, o_t, o_d) * tl.load(rs + o_t)[:, None] * b_f
            b_ki = _tile(k, bos, t0, T_seq, i_h, H, K, o_t, o_d) * tl.load(rs + C + o_t)[:, None] * b_f
            b_dkc += _mm(_blk(s_dA, 16 * r, 16 * i, C, o_i), b_qi, PREC)
            b_dkc += _mm(_blk(s_dL, 16 * r, 16 * i, C, o_i), b_ki, PREC)
        b_e = b_gn - _c(gc, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)  # G_n - G_j <= 0
        if ANY:
            b_e += b_ln - _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, ANY)
        b_dkc *= tl.exp2(b_e)
    # rows of this block against the columns of earlier blocks, anchored at the block's first token
    b_dq = tl.zeros([16, BS], tl.float32)
    b_dkr = tl.zeros([16, BS], tl.float32)
    if r > 0:
        b_gn, b_ln = _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV, K, 16 * r, o_d, ANY)
        for j in range(r):
            o_j = 16 * j + o_i
            b_e = b_gn - _c(gc, bos, t0, T_seq, i_hv, HV, K, o_j, o_d)  # G_n - G_j <= 0
            if ANY:
                b_e += b_ln - _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_j, o_d, ANY)
            b_kj = _tile(k, bos, t0, T_seq, i_h, H, K, o_j, o_d) * tl.load(rs + C + o_j)[:, None] * tl.exp2(b_e)
            b_dq += _mm(_blk(s_dA, 16 * r, 16 * j, C, o_i), b_kj, PREC)
            b_dkr += _mm(_blk(s_dL, 16 * r, 16 * j, C, o_i), b_kj, PREC)
        b_e = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) - b_gn  # G_i - G_n <= 0
        if ANY:
            b_e += _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, ANY) - b_ln
        b_f = tl.exp2(b_e)
        b_dq *= b_f
        b_dkr *= b_f
    # the diagonal block: dAqk's diagonal (factor 1) reaches dq and dk only, never dG
    b_G = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)  # [16, BS]
    b_L = _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, ANY)
    b_q = _tile(q, bos, t0, T_seq, i_h, H, K, o_r, o_d) * tl.load(rs + o_r)[:, None]
    b_k = _tile(k, bos, t0, T_seq, i_h, H, K, o_r, o_d) * tl.load(rs + C + o_r)[:, None]
    b_dAd = _blk(s_dA, 16 * r, 16 * r, C, o_i)
    b_dKd = _blk(s_dL, 16 * r, 16 * r, C, o_i)
    if mid:
        b_gm, b_lm = _row_gates(gc, gd, bos, t0, T_seq, i_hv, HV, K, 16 * r + 8, o_d, ANY)
        b_e = b_G - b_gm + (b_L - b_lm)
        b_dq, b_dkr, b_dkc = _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, o_i[:, None] > o_i[None, :],
                                         o_i[:, None] < o_i[None, :], b_q, b_k, tl.exp2(b_e), tl.exp2(-b_e), PREC)
    else:  # unbounded gates: each half-segment level anchored where both factors are <= 1
        for lvl in tl.static_range(4):
            m, b_r, b_c = _anchored(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d, 16 >> lvl, ANY)
            m_t = half_pairs(o_r[None, :], o_r[:, None], 16 >> lvl)
            b_dq, b_dkr, b_dkc = _diag_terms(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, m, m_t, b_q, b_k, b_r, b_c, PREC)
    b_dAii = tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_dAd, 0.0), 1)[:, None]  # [16, 1]
    # qg = scale q e^G, kd = k e^(G_last - G), kg = k e^G; dq leaves first, its part of dG kept
    b_eG = tl.exp2(b_G)
    b_dq += _tile(s_dqg, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) * (scale * b_eG)
    _put(s_dqg, b_dq + b_dAii * b_k, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    b_dG = b_q * b_dq
    b_dkr += _tile(s_dw, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) * b_eG  # dkg joins the rows' terms
    b_dlast = _c_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d)[None, :] - b_G  # G_last - G
    if ANY:
        b_dlast += _c_last(gd, bos, t0, T_seq, i_hv, HV, K, C, o_d).to(tl.float32)[None, :] - b_L
    b_dkd = _tile(s_dkd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d) * tl.exp2(b_dlast)
    _put(s_dkd, b_dkr + b_dkc + b_dAii * b_q + b_dkd, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    # dg_t = sum_{i >= t} dG_i + sum_{i < t} kd_i dkd_i + gl dgam over the chunk: here the block's
    # own part of the first two sums and its totals (padding rows add zero: q = k = 0 there)
    b_dG += b_k * (b_dkr - b_dkc)
    b_y = b_k * b_dkd
    _put(s_dw, tl.cumsum(b_dG, 0, reverse=True) + exclusive_cumsum(b_y, 0), bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    s_tot += (i_p * NC + r) * 2 * K
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
    b_gam = tl.exp2(_c_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d)) * tl.load(s_dgam + i_p * K + o_d, mask=m_d,
                                                                                   other=0.0)
    b_dgr = _tile(s_dw, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) + _per_block(b_after + b_before, C) + b_gam[None, :]
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
    b_dq += b_r * _mm(b_dA, b_kf, PREC)
    b_dkr += b_r * _mm(b_dK, b_kf, PREC)
    b_dkc += b_f * (_mm(tl.trans(b_dA), b_q * b_r, PREC) + _mm(tl.trans(b_dK), b_k * b_r, PREC))
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
    s = i_s * BS
    o_d = s + tl.arange(0, BS)
    m_d = o_d < K
    # The chunk decay e^G_last (in gl and every kd = k e^(G_last - G_i)) reaches every token:
    # with y_i = kd_i * dkd_i, dg_t = sum_{i >= t} dG'_i + sum_{i < t} y_i + gl * dgam, where dG'
    # leaves the kd terms out. Summing y as a prefix (never as total minus suffix) keeps a
    # large y_i from cancelling against itself. Block sums of y go to the scratch s_yb.
    for r in range(NC):
        tr = t0 + 16 * r
        b_k = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * r + o_i)[:, None]
        b_eD = tl.exp2(_x(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
                       + _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, r + 1, NC)[None, :])
        b_y = b_k * (_tile(s_dkd, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * b_eD)
        tl.store(s_yb + r * K + o_d, tl.sum(b_y, 0), mask=m_d)
    tl.debug_barrier()
    b_carry = tl.exp2(_bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, NC)) * tl.load(s_dgam + o_d, mask=m_d, other=0.0)
    b_dbias = tl.zeros([BS], tl.float32)
    for rr in range(NC):
        r = NC - 1 - rr  # last block first: dg is a reverse cumulative sum
        tr = t0 + 16 * r
        b_q = _tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + 16 * r + o_i)[:, None]
        b_k = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * r + o_i)[:, None]
        b_c = _c(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        b_xr = _x(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)  # gates after each token, to the block end
        # A pair i > j of Aqk or Akk adds a term x to dG_i and -x to dG_j; in dg_t, the sum of dG over
        # i >= t, only pairs with i >= t > j are left. They are summed as such (docs/math.md
        # section 5), so that pairs which cancel exactly never leave rounding noise in dg.
        b_dgx = tl.zeros([16, BS], tl.float32)  # the surviving pair terms of this block's tokens
        # diagonal block; the diagonal of Aqk (factor e^0 = 1) reaches dq and dk only
        b_dAd = _blk(s_dA, 16 * r, 16 * r, C, o_i)
        b_dAii = tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_dAd, 0.0), 1)  # [16]
        b_dAd = tl.where(o_i[:, None] > o_i[None, :], b_dAd, 0.0)
        b_dKd = _blk(s_dL, 16 * r, 16 * r, C, o_i)
        b_dq = b_dAii[:, None] * b_k  # through Aqk (rows)
        b_dkr = tl.zeros([16, BS], tl.float32)  # through Akk (rows)
        b_dkc = b_dAii[:, None] * b_q  # through Aqk and Akk (columns)
        if SAFE:  # anchored at the middle token, as in the forward
            b_cm = row_of(b_c, o_i, 8)
            b_up = tl.exp2(b_c - b_cm[None, :])
            b_dn = tl.exp2(b_cm[None, :] - b_c)
            b_dq, b_dkr, b_dkc = _diag_products(b_dq, b_dkr, b_dkc, b_dAd, b_dKd, b_q, b_k, b_up, b_dn, DIAG_PREC)
        else:  # any gate: the forward's four levels, each anchored where both factors are <= 1
            b_g = _tile(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            b_gn = _tile(ga, bos, tr + 1, T_seq, i_hv, HV, K, o_i, o_d)  # the next token's gates
            for lvl in tl.static_range(4):
                m, b_r, b_f = split_level(b_g, b_gn, o_i, 8 >> lvl)
                b_dq, b_dkr, b_dkc = _diag_products(b_dq, b_dkr, b_dkc, tl.where(m, b_dAd, 0.0), tl.where(m, b_dKd, 0.0),
                                                    b_q, b_k, b_r, b_f, DIAG_PREC)
        if EXACT:
            for j in range(15):  # column j: the pair terms of rows i > j, token-parallel
                if SAFE:
                    b_e = tl.where(o_i[:, None] > j, b_up * row_of(b_dn, o_i, j)[None, :], 0.0)
                else:  # unbounded gates: every factor from the gates it spans
                    b_e = tl.exp2(tl.where(o_i[:, None] > j, tl.cumsum(tl.where(o_i[:, None] > j, b_g, 0.0), 0),
                                           float("-inf")))  # [16, BS]: e^(G_i - G_j), rows i > j
                b_kj = row_of(b_k, o_i, j)
                b_T = (_col_of(b_dAd, o_i, j)[:, None] * b_q + _col_of(b_dKd, o_i, j)[:, None] * b_k) * b_kj[None, :] * b_e
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
            b_colf = tl.exp2(_x(ga, bos, t0 + 16 * j, T_seq, i_hv, HV, K, o_i, o_d)
                             + _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, j + 1, r)[None, :])
            b_kj = _tile(k, bos, t0 + 16 * j, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * j + o_i)[:, None] * b_colf
            b_pq = b_eR * _mm(_blk(s_dA, 16 * r, 16 * j, C, o_i), b_kj, PREC)
            b_pk = b_eR * _mm(_blk(s_dL, 16 * r, 16 * j, C, o_i), b_kj, PREC)
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
            b_colf = tl.exp2(b_xr + _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, r + 1, i)[None, :])
            b_eI = tl.exp2(_c(gc, bos, ti, T_seq, i_hv, HV, K, o_i, o_d))
            b_qi = _tile(q, bos, ti, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + 16 * i + o_i)[:, None] * b_eI
            b_ki = _tile(k, bos, ti, T_seq, i_h, H, K, o_i, o_d) * tl.load(rs + C + 16 * i + o_i)[:, None] * b_eI
            b_col += b_colf * (_mm(tl.trans(_blk(s_dA, 16 * i, 16 * r, C, o_i)), b_qi, PREC)
                               + _mm(tl.trans(_blk(s_dL, 16 * i, 16 * r, C, o_i)), b_ki, PREC))
        b_dkc += b_col
        b_strict = tl.where(o_i[:, None] > o_i[None, :], 1.0, 0.0)  # exclusive prefix sums as a product
        b_dgx += _mm(b_strict, b_k * b_col, "ieee")  # i later, j in this block, j < t
        for i in range(r + 1, NC):  # i later, j earlier: the stored per-pair sums
            for j in range(r):
                b_dgx += tl.load(s_B + (i * NC + j) * K + o_d, mask=m_d, other=0.0)[None, :]
        # qg = scale q e^G, kd = k e^(G_last - G), kg = k e^G
        b_eG = tl.exp2(b_c + _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, r)[None, :])
        b_eD = tl.exp2(b_xr + _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, r + 1, NC)[None, :])
        b_dqg = _tile(s_dqg, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * (scale * b_eG)
        b_dkd = _tile(s_dkd, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * b_eD
        b_dkg = _tile(s_dw, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) * b_eG
        # dq and dk of this value head (before l2norm) replace dqg and dkd, read for the last time
        _put(s_dqg, b_dq + b_dqg, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        _put(s_dkd, b_dkr + b_dkc + b_dkd + b_dkg, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        b_dG = b_q * b_dqg + b_k * b_dkg  # the single-token terms of dG_i (natural log)
        b_pre = tl.zeros([BS], tl.float32)  # y summed over the earlier blocks
        for j in range(r):
            b_pre += tl.load(s_yb + j * K + o_d, mask=m_d, other=0.0)
        b_dgr = tl.cumsum(b_dG, 0, reverse=True) + b_carry[None, :] + b_pre[None, :] + b_dgx \
            + _mm(b_strict, b_k * b_dkd, "ieee")  # exclusive prefix of y
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



@triton.jit
def kda_bwd_qk_kernel(x, dxh, dx, rows, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      BR: tl.constexpr, L2NORM: tl.constexpr):
    """dx [rows, H, K] = the l2norm backward of the sum of dxh [rows, H * G, K] over the G value heads
    of each group: with y = x / |x|, dx = (dy - y (y . dy)) / |x|."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    b_dy = tl.zeros([BR, BK], tl.float32)
    for j in range(G):
        b_dy += tl.load(dxh + o_r[:, None] * (H * G * K) + (i_h * G + j) * K + o_k[None, :], mask=m, other=0.0)
    p = o_r[:, None] * (H * K) + i_h * K + o_k[None, :]
    if L2NORM:
        b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)
        b_y = b_x * b_r[:, None]
        b_dy = (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None]) * b_r[:, None]
    tl.store(dx + p, b_dy.to(dx.dtype.element_ty), mask=m)


def bwd_qk(x, dxh, L2NORM: bool):
    B, T, H, K = x.shape
    HV = dxh.shape[2]
    dx = new_empty(B, T, H, K, dtype=x.dtype, device=x.device)
    rows, BR = B * T, 16
    if rows:
        kda_bwd_qk_kernel[(cdiv(rows, BR), H)](x, dxh, dx, rows, H=H, G=HV // H, K=K, BK=pow2(K, 1), BR=BR,
                                                     L2NORM=L2NORM)
    return dx


def bwd_chunk(opts, x, p, vn, h, dhs, do, dvn, cu_seqlens):
    """Launch backward stage 2. ``x``: the KDAInputs (contiguous); ``p``: the forward's stage-1
    output. Returns (dq, dk per value head before l2norm [B, T, HV, K] float32, for ``bwd_qk``;
    dv, dg, dbeta, dA_log, ddt_bias)."""
    s, C = opts.shape, opts.chunk_size
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    dev, NT = x.q.device, p.NT_total
    f32 = dict(dtype=torch.float32, device=dev)
    alloc = out_alloc(opts)  # use_graph: rows past the last sequence, never written, are zero
    s_dqg, s_dkd = (alloc(B, T, HV, K, **f32) for _ in range(2))
    s_dw = new_empty(B, T, HV, K, **f32)
    s_dA, s_dL = (new_empty(NT, HV, C, C, **f32) for _ in range(2))
    s_db = new_empty(NT, HV, C, **f32)
    s_dgam = new_empty(NT, HV, K, **f32)
    dv = alloc(B, T, HV, V, dtype=x.v.dtype, device=dev)
    dg = alloc(B, T, HV, K, dtype=x.g.dtype, device=dev)
    dbeta = alloc(*x.beta.shape, dtype=x.beta.dtype, device=dev)
    # per-slot partial sums: with use_graph the slots past the real chunks are skipped and must add zero
    dbias_part = alloc(NT, HV, K, **f32) if x.dt_bias is not None else None
    PREC = dot_config(x.q.dtype)[1]
    if NT > 0:
        BK, BV = pow2(K), pow2(V)
        BS = min(SLICE, BK, BV)
        NSK = cdiv(K, BS)
        where = dict(cu_seqlens=cu_seqlens, chunk_indices=p.chunk_indices, T=T, HV=HV, C=C,
                     IS_VARLEN=cu_seqlens is not None, PREC=PREC)
        beta_kw = dict(SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale)
        BKS = min(V_STATE_SLICE, BK)
        NKS = cdiv(K, BKS)
        whole = p.ga is None  # stage 1 took the whole-chunk path: gc from the chunk start
        kda_bwd_v_kernel[(NT * (NKS + 1), HV)](
            x.v, x.beta, p.u, vn, h, dhs, do, dvn, p.xs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_db, s_dgam, dv,
            scale=opts.scale, K=K, V=V, BKS=BKS, NKS=NKS, BV=BV, BS=BS, MIRROR=whole, **beta_kw, **where,
            **launch_options(LAUNCH, "v", BK, BV))
        kda_bwd_k_kernel[(NT, HV)](
            x.k, x.beta, p.w, p.gc, p.ls, p.xs, p.rs, s_dw, s_dL, s_db, dbeta,
            H=H, K=K, BK=BK, BS=BS, WHOLE=whole, **beta_kw, **where, **launch_options(LAUNCH, "k", BK, BV))
        gate = gate_launch(opts, x.A_log, x.dt_bias)
        if whole:
            BSB = min(GATE_BLOCK_SLICE, BK)
            NSB = cdiv(K, BSB)
            s_tot = new_empty(NT, HV, C // 16, 2, K, **f32)  # per block: sums of dG and of the kd terms
            for any_sel, sel in split_launches(p.gd is not None, x.q.dtype):
                kda_bwd_gate_block_kernel[(NT * (C // 16) * NSB, HV)](
                    x.q, x.k, p.gc, p.gd, p.gok, p.rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_tot, scale=opts.scale, H=H,
                    K=K, BS=BSB, NSK=NSB, ANY=any_sel, SEL=sel, **{**where, "PREC": pair_precision(opts, x.q.dtype)},
                    **launch_options(LAUNCH, "gate_block", BK, BV))
            BSG = min(DG_SLICE, BK)
            NSG = cdiv(K, BSG)
            dA_part = alloc(NT, HV, NSG, **f32) if x.A_log is not None else None
            kda_bwd_dg_kernel[(NT * NSG, HV)](
                x.g, x.A_log, x.dt_bias, p.gc, s_dw, s_tot, s_dgam, dg, dA_part, dbias_part, K=K, BS=BSG, NSK=NSG,
                **gate, **{n: where[n] for n in ("cu_seqlens", "chunk_indices", "T", "HV", "C", "IS_VARLEN")},
                **launch_options(LAUNCH, "dg", BK, BV))
        else:
            dA_part = alloc(NT, HV, NSK, **f32) if x.A_log is not None else None
            exact = EXACT_PAIRS if EXACT_PAIRS is not None else x.q.dtype == torch.float32
            s_yb = new_empty(NT, HV, C // 16, K, **f32)  # block sums of the kd terms
            s_B = new_empty(NT, HV, C // 16, C // 16, K, **f32)  # pair sums per block pair
            kda_bwd_gate_kernel[(NT * NSK, HV)](
                x.q, x.k, x.g, x.A_log, x.dt_bias, p.gc, p.ga, p.rs, s_dqg, s_dkd, s_dw, s_dA, s_dL, s_dgam, s_yb,
                s_B, dg, dA_part, dbias_part, scale=opts.scale, H=H, K=K, BS=BS, NSK=NSK, SAFE=opts.safe_gate,
                EXACT=exact, DIAG_PREC=PREC if exact else "tf32x3", **gate, **where,
                **launch_options(LAUNCH, "gate", BK, BV))
    elif x.dt_bias is not None or x.A_log is not None:  # no tokens: zero parameter gradients
        dA_part = torch.zeros(1, HV, 1, **f32) if x.A_log is not None else None
        dbias_part = torch.zeros(1, HV, K, **f32) if x.dt_bias is not None else None
    # in the parameters' own shapes ([HV] or with unit dimensions; [HV*K] or [HV, K])
    dA_log = dA_part.sum(0).sum(-1).view(x.A_log.shape).to(x.A_log.dtype) if x.A_log is not None else None
    ddt_bias = dbias_part.sum(0).view(x.dt_bias.shape).to(x.dt_bias.dtype) if x.dt_bias is not None else None
    return s_dqg, s_dkd, dv, dg, dbeta, dA_log, ddt_bias

