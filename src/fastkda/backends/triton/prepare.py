"""Forward stage 1, token-parallel: everything a chunk needs that does not depend on the state.

One program per (chunk, value head). The chunk is NC = C/16 blocks of 16 tokens; features are
walked in slices of BS columns so that every live tile is [16, BS] (small register footprint).
Four phases: gates (activated once; their block-local cumulative sums go to the float32 scratch
``gc``), row blocks (the diagonal and off-diagonal Aqk / Akk blocks), the inverse
X = (I + Diag(beta) Akk)^-1 (float32), then w and u. l2norm, beta sigmoid and the gate
activation are fused in. Per chunk it writes (docs/math.md section 2):

    w   = X (beta k e^G)          [C, K]   u  = X (beta v)      [C, V]
    qg  = scale q e^G             [C, K]   kd = k e^(G_last-G)  [C, K]
    Aqk (j <= i, times scale)     [C, C]   gl = e^(G_last)      [K] (float32)

All exponents are base 2 and built as sums of the gates they span, never as a difference of two
cumulative sums (which loses precision for large gates): within block b, ``c_b`` is the
inclusive cumulative gate from the block start (scratch ``gc``), ``s_b`` the block total, and
the gates after a token are a reverse cumulative sum of the stored activated gates (``ga``).

Two forms of phases 2 and 4 (``PREPARE_WIDE``): the narrow one forms every 16x16 block pair and
every [16, BS] row block of w and u separately (small tiles, 2 warps); the wide one forms a row
block against all earlier columns in one [16, BS] x [BS, C] product (the columns scaled for that
row block) and w, u of the whole chunk as [C, C] x [C, BS] products (4 warps). Same results.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...testing import new_empty
from .common import activate_gate, chunk_location, chunk_tables, gate_code, pow2, row_of

PREPARE_WARPS = 2  # for K, V <= 128; 4 beyond
PREPARE_WIDE = False  # phases 2 and 4 as few wide products (see the kernel); not yet timed on a GPU
PREPARE_WIDE_WARPS = 4  # 2 spill registers in the wide variant at K = V = 128 (offline sm_90 compile)
SLICE = 32  # feature columns per tile


@triton.jit
def _tile(x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Rows t0..t0+15 of x [.., NH, D] at head i_head, columns o_d, as float32 (0 outside)."""
    o_t = t0 + o_i
    m = (o_t < T_seq)[:, None] & (o_d < D)[None, :]
    p = x + (bos + o_t).to(tl.int64)[:, None] * (NH * D) + i_head * D + o_d[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _put(x, b_x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Store a [16, BS] tile at rows t0.. of x [.., NH, D] (rows past the sequence end skipped)."""
    o_t = t0 + o_i
    m = (o_t < T_seq)[:, None] & (o_d < D)[None, :]
    tl.store(x + (bos + o_t).to(tl.int64)[:, None] * (NH * D) + i_head * D + o_d[None, :], b_x.to(x.dtype.element_ty), mask=m)


@triton.jit
def _c(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d):
    """Block-local cumulative gate of 16 tokens: padding rows of a partly filled block repeat its
    last token (their gate is 0); a block of padding only is 0."""
    o_t = tl.minimum(t0 + o_i, T_seq - 1)
    p = gc + (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :]
    b_c = tl.load(p, mask=(o_d < K)[None, :], other=0.0)
    return tl.where(t0 < T_seq, b_c, 0.0)


@triton.jit
def _x(ga, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d):
    """Sum of the gates after each of 16 tokens, up to the block end: a reverse cumulative sum of
    the next rows (never a difference of two sums, which loses precision for large gates)."""
    o_t = t0 + 1 + o_i
    m = ((o_i < 15) & (o_t < T_seq))[:, None] & (o_d < K)[None, :]
    b_g = tl.load(ga + (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :], mask=m, other=0.0)
    return tl.cumsum(b_g, 0, reverse=True)


@triton.jit
def _bsum(gc, bos, tb, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_d):
    """Sum of the gates of the block starting at token tb, columns o_d."""
    o_t = tl.minimum(tb + 15, T_seq - 1)
    return tl.load(gc + (bos + o_t) * (HV * K) + i_hv * K + o_d, mask=(o_d < K) & (tb < T_seq), other=0.0)


@triton.jit
def _bsums(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_d, LO, HI):
    """Sum of the gates of blocks LO..HI-1 of the chunk starting at t0 (a pure sum of block sums)."""
    b_s = tl.zeros_like(o_d.to(tl.float32))
    for b in range(LO, HI):
        b_s += _bsum(gc, bos, t0 + 16 * b, T_seq, i_hv, HV, K, o_d)
    return b_s


@triton.jit
def _gates(g, A_log, dt_bias, gc, ga, lower_bound, bos, t0, T_seq, i_hv, o_i, HV: tl.constexpr, K: tl.constexpr,
           BK: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Activate 16 tokens' gates (base 2, 0 on padding); store them (ga) and their block-local
    cumulative sum (gc)."""
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        m = ((t0 + o_i) < T_seq)[:, None] & (o_d < K)[None, :]
        b_g = _tile(g, bos, t0, T_seq, i_hv, HV, K, o_i, o_d)
        b_g = activate_gate(b_g, A_log, dt_bias, i_hv, o_d, o_d < K, lower_bound, GATE, HAS_A, HAS_BIAS, K)
        b_g = tl.where(m, b_g * 1.4426950408889634, 0.0)
        _put(ga, b_g, bos, t0, T_seq, i_hv, HV, K, o_i, o_d)
        _put(gc, tl.cumsum(b_g, 0), bos, t0, T_seq, i_hv, HV, K, o_i, o_d)


@triton.jit
def _rstd(x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, BK: tl.constexpr, BS: tl.constexpr,
          L2NORM: tl.constexpr):
    """Per-row 1 / sqrt(|x|^2 + 1e-6) of 16 rows (ones without l2norm)."""
    if not L2NORM:
        return tl.full([16], 1.0, tl.float32)
    b_ss = tl.zeros([16], tl.float32)
    for s in range(0, BK, BS):
        b_x = _tile(x, bos, t0, T_seq, i_head, NH, D, o_i, s + tl.arange(0, BS))
        b_ss += tl.sum(b_x * b_x, 1)
    return tl.rsqrt(b_ss + 1e-6)


@triton.jit
def _rs(rs, which: tl.constexpr, row, C: tl.constexpr, o_i):
    """Stored 1/|q| (which=0) or 1/|k| (which=1) of the 16 rows starting at chunk row ``row``."""
    return tl.load(rs + which * C + row + o_i)


@triton.jit
def _beta(beta, bos, t0, T_seq, i_hv, o_i, HV: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr):
    o_t = t0 + o_i
    m_t = o_t < T_seq
    b_b = tl.load(beta + (bos + o_t).to(tl.int64) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if SIGMOID:
        b_b = tl.sigmoid(b_b) * BETA_SCALE
    return tl.where(m_t, b_b, 0.0)


@triton.jit
def _diag(q, k, gc, ga, rs, qg, kd, bos, t0, T_seq, i_h, i_hv, scale, o_i, R, NC: tl.constexpr, C: tl.constexpr,
          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
          SAFE: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    """Block R of the chunk: stores q e^G and k e^(G_last - G); returns its diagonal Aqk (j <= i)
    and Akk (j < i) blocks, unscaled."""
    tr = t0 + 16 * R
    b_rq = _rs(rs, 0, 16 * R, C, o_i)
    b_rk = _rs(rs, 1, 16 * R, C, o_i)
    b_Aqk = tl.zeros([16, 16], tl.float32)
    b_Akk = tl.zeros([16, 16], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_q = _tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rq[:, None]
        b_k = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None]
        b_c = _c(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        b_before = _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, R)
        b_after = _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, R + 1, NC)
        _put(qg, b_q * tl.exp2(b_c + b_before[None, :]) * scale, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
        _put(kd, b_k * tl.exp2(_x(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d) + b_after[None, :]), bos, tr, T_seq, i_hv, HV,
             K, o_i, o_d)
        if SAFE:
            # anchor at the middle token: each factor spans <= 8 gates of >= -5, |exponent| <= 58
            b_cm = row_of(b_c, o_i, 8)
            b_up = tl.exp2(b_c - b_cm[None, :])
            b_col = tl.trans(b_k * tl.exp2(b_cm[None, :] - b_c))
            b_Aqk += tl.dot(b_q * b_up, b_col, input_precision=PREC)
            b_Akk += tl.dot(b_k * b_up, b_col, input_precision=PREC)
        else:
            # unbounded gates: every entry takes exp2(c_i - c_j) directly, one column j at a time
            b_g = tl.load(ga + (bos + tr + o_i).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :],
                          mask=((tr + o_i) < T_seq)[:, None] & (o_d < K)[None, :], other=0.0)
            for j in range(16):
                b_kj = row_of(b_k, o_i, j)
                # sum of the gates of tokens j+1..i, summed directly
                b_e = tl.exp2(tl.where(o_i[:, None] >= j, tl.cumsum(tl.where(o_i[:, None] > j, b_g, 0.0), 0), float("-inf")))
                b_Aqk += tl.where(o_i[None, :] == j, tl.sum(b_q * b_kj[None, :] * b_e, 1)[:, None], 0.0)
                b_Akk += tl.where(o_i[None, :] == j, tl.sum(b_k * b_kj[None, :] * b_e, 1)[:, None], 0.0)
    b_Aqk = tl.where(o_i[:, None] >= o_i[None, :], b_Aqk, 0.0)
    b_Akk = tl.where(o_i[:, None] > o_i[None, :], b_Akk, 0.0)
    return b_Aqk, b_Akk


@triton.jit
def _pair(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, R, J, C: tl.constexpr, H: tl.constexpr,
          HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, L2NORM: tl.constexpr,
          PREC: tl.constexpr):
    """Aqk and Akk of block R's rows against the earlier block J. Anchored at block R's start:
    rows scale by exp2(c_R) <= 1, columns by exp2(gates after token j up to that start) <= 1."""
    tr, tj = t0 + 16 * R, t0 + 16 * J
    b_rq = _rs(rs, 0, 16 * R, C, o_i)
    b_rk = _rs(rs, 1, 16 * R, C, o_i)
    b_rkj = _rs(rs, 1, 16 * J, C, o_i)
    b_Aqk = tl.zeros([16, 16], tl.float32)
    b_Akk = tl.zeros([16, 16], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_e = tl.exp2(_c(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d))
        b_q = _tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rq[:, None] * b_e
        b_k = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None] * b_e
        b_kj = _tile(k, bos, tj, T_seq, i_h, H, K, o_i, o_d) * b_rkj[:, None]
        b_between = _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, J + 1, R)
        b_col = tl.trans(b_kj * tl.exp2(_x(ga, bos, tj, T_seq, i_hv, HV, K, o_i, o_d) + b_between[None, :]))
        b_Aqk += tl.dot(b_q, b_col, input_precision=PREC)
        b_Akk += tl.dot(b_k, b_col, input_precision=PREC)
    return b_Aqk, b_Akk


@triton.jit
def _wu(x, out, gc, rs, xs, beta, bos, t0, T_seq, i_h, i_hv, o_i, R, IS_U: tl.constexpr, NX: tl.constexpr,
        D: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
        SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    """Row block R of w = X (beta k e^G) (x = k: NX = H, D = K) or of u = X (beta v) (IS_U)."""
    for s in range(0, BD, BS):
        o_d = s + tl.arange(0, BS)
        b_acc = tl.zeros([16, BS], tl.float32)
        for j in range(R + 1):
            tj = t0 + 16 * j
            b_b = _beta(beta, bos, tj, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)
            if IS_U:
                b_y = _tile(x, bos, tj, T_seq, i_hv, HV, D, o_i, o_d) * b_b[:, None]
            else:
                b_b *= _rs(rs, 1, 16 * j, C, o_i)
                b_G = _c(gc, bos, tj, T_seq, i_hv, HV, K, o_i, o_d) + _bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, j)[None, :]
                b_y = _tile(x, bos, tj, T_seq, i_h, NX, D, o_i, o_d) * b_b[:, None] * tl.exp2(b_G)
            b_acc += tl.dot(_blk(xs, 16 * R, 16 * j, C, o_i), b_y, input_precision=PREC)
        _put(out, b_acc, bos, t0 + 16 * R, T_seq, i_hv, HV, D, o_i, o_d)


@triton.jit
def _after_in_block(ga, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, o_c, o_d,
                    BS: tl.constexpr):
    """[C, BS]: for every token of the chunk, the sum of the gates after it up to its block's end (a
    reverse cumulative sum of the next rows within each 16-token block, as ``_x``)."""
    o_t = t0 + 1 + o_c
    m = ((o_c % 16 < 15) & (o_t < T_seq))[:, None] & (o_d < K)[None, :]
    b_g = tl.load(ga + (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :], mask=m, other=0.0)
    b_x = tl.cumsum(tl.reshape(b_g, [C // 16, 16, BS]), 1, reverse=True)
    return tl.reshape(b_x, [C, BS])


@triton.jit
def _blocks_between(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, NC: tl.constexpr, C: tl.constexpr,
                    BS: tl.constexpr, o_c, o_d, BETWEEN: tl.constexpr, hi):
    """[C, BS]: for row j, the gates of the blocks strictly between j's block and block hi (BETWEEN),
    or of the blocks before j's block: sums of block sums."""
    b_T = tl.zeros([C, BS], tl.float32)
    for b in range(NC):
        if BETWEEN:
            m_b = ((o_c // 16) < b) & (b < hi)
        else:
            m_b = b < (o_c // 16)
        b_T += tl.where(m_b[:, None], _bsum(gc, bos, t0 + 16 * b, T_seq, i_hv, HV, K, o_d)[None, :], 0.0)
    return b_T


@triton.jit
def _blk(x, row, col, C: tl.constexpr, o_i):
    """The [16, 16] block at rows row.., columns col.. of this program's [C, C] float32 scratch."""
    return tl.load(x + (row + o_i)[:, None] * C + col + o_i[None, :])


@triton.jit
def _put_blk(x, b_x, row, col, C: tl.constexpr, o_i):
    tl.store(x + (row + o_i)[:, None] * C + col + o_i[None, :], b_x)


@triton.jit
def _inv_unit_lower(b_L, o_i):
    """(I + L)^-1 for a strictly lower triangular 16x16 L: L^16 = 0, so with N = -L it is
    (I + N)(I + N^2)(I + N^4)(I + N^8); six small products instead of a serial substitution."""
    b_N = -b_L
    b_X = b_N + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for _ in tl.static_range(3):
        b_N = tl.dot(b_N, b_N, input_precision="ieee")
        b_X += tl.dot(b_X, b_N, input_precision="ieee")
    return b_X


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit(do_not_specialize=["T"])
def kda_fwd_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias,
    w, u, qg, kd, Aqk, gl, gc, ga, ls, xs, rs,
    cu_seqlens, chunk_indices, scale, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAFE: tl.constexpr, L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
    BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, T_seq = chunk_location(i_c, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    t0 = i_t * C  # first token of the chunk, within its sequence
    o_i = tl.arange(0, 16)
    o_c = tl.arange(0, C)
    NC: tl.constexpr = C // 16

    ls += (i_c * HV + i_hv) * C * C  # this program's [C, C] scratch blocks
    xs += (i_c * HV + i_hv) * C * C
    rs += (i_c * HV + i_hv) * 2 * C  # row norms of q, k

    # --- phase 1: gates ---------------------------------------------------------------------------
    for b in range(NC):
        _gates(g, A_log, dt_bias, gc, ga, lower_bound, bos, t0 + 16 * b, T_seq, i_hv, o_i, HV, K, BK, BS, GATE, HAS_A, HAS_BIAS)
        tl.store(rs + 16 * b + o_i, _rstd(q, bos, t0 + 16 * b, T_seq, i_h, H, K, o_i, BK, BS, L2NORM))
        tl.store(rs + C + 16 * b + o_i, _rstd(k, bos, t0 + 16 * b, T_seq, i_h, H, K, o_i, BK, BS, L2NORM))
    tl.debug_barrier()  # gc is read back below by other threads of this program

    # --- phase 2: Aqk stored (times scale), Akk to the scratch ls (the backward reads it too) ------
    for r in range(NC):
        tr = t0 + 16 * r
        b_Aqk, b_Akk = _diag(q, k, gc, ga, rs, qg, kd, bos, t0, T_seq, i_h, i_hv, scale, o_i, r, NC, C, H, HV, K, BK, BS, SAFE,
                             L2NORM, PREC)
        _put(Aqk + 16 * r, b_Aqk * scale, bos, tr, T_seq, i_hv, HV, C, o_i, o_i)
        _put_blk(ls, b_Akk, 16 * r, 16 * r, C, o_i)
        if WIDE:  # all earlier blocks at once: [16, BS] x [BS, C] products, columns scaled per row block
            b_Aqk = tl.zeros([16, C], tl.float32)
            b_Akk = tl.zeros([16, C], tl.float32)
            b_rq = _rs(rs, 0, 16 * r, C, o_i)
            b_rk = _rs(rs, 1, 16 * r, C, o_i)
            for s in range(0, BK, BS):
                o_d = s + tl.arange(0, BS)
                b_e = tl.exp2(_c(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d))
                b_q = _tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rq[:, None] * b_e
                b_k = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None] * b_e
                # column j < 16 r: gates after j to its block end, then the blocks up to block r
                b_x = _after_in_block(ga, bos, t0, T_seq, i_hv, HV, K, C, o_c, o_d, BS) \
                    + _blocks_between(gc, bos, t0, T_seq, i_hv, HV, K, NC, C, BS, o_c, o_d, True, r)
                b_col = _tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d) * tl.load(rs + C + o_c)[:, None]
                b_col = tl.trans(tl.where((o_c < 16 * r)[:, None], b_col * tl.exp2(b_x), 0.0))
                b_Aqk += tl.dot(b_q, b_col, input_precision=PREC)
                b_Akk += tl.dot(b_k, b_col, input_precision=PREC)
            m_w = ((tr + o_i) < T_seq)[:, None] & (o_c < 16 * r)[None, :]
            tl.store(Aqk + (bos + tr + o_i).to(tl.int64)[:, None] * (HV * C) + i_hv * C + o_c[None, :], (b_Aqk * scale).to(
                Aqk.dtype.element_ty), mask=m_w)
            tl.store(ls + (16 * r + o_i)[:, None] * C + o_c[None, :], b_Akk, mask=(o_c < 16 * r)[None, :])
        else:
            for j in range(r):
                b_Aqk, b_Akk = _pair(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, r, j, C, H, HV, K, BK, BS, L2NORM,
                                     PREC)
                _put(Aqk + 16 * j, b_Aqk * scale, bos, tr, T_seq, i_hv, HV, C, o_i, o_i)
                _put_blk(ls, b_Akk, 16 * r, 16 * j, C, o_i)
    tl.debug_barrier()

    # --- phase 3: X = (I + L)^-1 row block by row block, float32, to the scratch xs ----------------
    # L = Diag(beta) Akk;  X_rr = (I + L_rr)^-1;  X_rj = -X_rr sum_{j <= m < r} L_rm X_mj
    for r in range(NC):
        b_b = _beta(beta, bos, t0 + 16 * r, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
        b_Xrr = _inv_unit_lower(b_b * _blk(ls, 16 * r, 16 * r, C, o_i), o_i)
        _put_blk(xs, b_Xrr, 16 * r, 16 * r, C, o_i)
        for j in range(r):
            b_acc = tl.zeros([16, 16], tl.float32)
            for m in range(j, r):
                b_acc += _mm(b_b * _blk(ls, 16 * r, 16 * m, C, o_i), _blk(xs, 16 * m, 16 * j, C, o_i))
            _put_blk(xs, -_mm(b_Xrr, b_acc), 16 * r, 16 * j, C, o_i)
        tl.debug_barrier()

    # --- phase 4: w = X (beta k e^G), u = X (beta v) ---------------------------------------------
    if WIDE:  # the whole chunk at once: [C, C] x [C, BS] products
        b_X = tl.load(xs + o_c[:, None] * C + o_c[None, :], mask=(o_c[:, None] // 16) >= (o_c[None, :] // 16), other=0.0)
        b_bC = _beta(beta, bos, t0, T_seq, i_hv, o_c, HV, SIGMOID, BETA_SCALE)
        b_bk = b_bC * tl.load(rs + C + o_c)
        for s in range(0, BK, BS):
            o_d = s + tl.arange(0, BS)
            b_G = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) \
                + _blocks_between(gc, bos, t0, T_seq, i_hv, HV, K, NC, C, BS, o_c, o_d, False, 0)
            b_y = _tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d) * b_bk[:, None] * tl.exp2(b_G)
            _put(w, tl.dot(b_X, b_y, input_precision=PREC), bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
        for s in range(0, BV, BS):
            o_d = s + tl.arange(0, BS)
            b_y = _tile(v, bos, t0, T_seq, i_hv, HV, V, o_c, o_d) * b_bC[:, None]
            _put(u, tl.dot(b_X, b_y, input_precision=PREC), bos, t0, T_seq, i_hv, HV, V, o_c, o_d)
    else:
        for r in range(NC):
            _wu(k, w, gc, rs, xs, beta, bos, t0, T_seq, i_h, i_hv, o_i, r, False, H, K, HV, K, C, BK, BS, SIGMOID,
                BETA_SCALE, L2NORM, PREC)
            _wu(v, u, gc, rs, xs, beta, bos, t0, T_seq, i_h, i_hv, o_i, r, True, HV, V, HV, K, C, BV, BS, SIGMOID,
                BETA_SCALE, L2NORM, PREC)

    # --- chunk decay -------------------------------------------------------------------------------
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        tl.store(gl + (i_c * HV + i_hv) * K + o_d, tl.exp2(_bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, NC)), mask=o_d < K)


class Prepared(NamedTuple):
    """What stage 1 leaves for the scan and for the backward: the tensors of the module docstring,
    its float32 scratches and the chunk tables."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    Aqk: torch.Tensor
    gl: torch.Tensor
    gc: torch.Tensor  # block-local cumulative gates, base 2          [B, T, HV, K]
    ga: torch.Tensor  # activated gates, base 2                       [B, T, HV, K]
    ls: torch.Tensor  # Akk, lower blocks                              [NT, HV, C, C]
    xs: torch.Tensor  # X = (I + Diag(beta) Akk)^-1, lower blocks      [NT, HV, C, C]
    rs: torch.Tensor  # 1/|q|, 1/|k| of every row                      [NT, HV, 2, C]
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    NT_total: int


def fwd_prepare(opts, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_host) -> Prepared:
    """Launch stage 1."""
    s, C = opts.shape, opts.chunk_size
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets, NT_total = chunk_tables(cu_host, C, q.device)
    else:
        chunk_indices, chunk_offsets, NT_total = None, None, B * triton.cdiv(T, C)
    dev, dt = q.device, q.dtype
    w = new_empty(B, T, HV, K, dtype=dt, device=dev)
    u = new_empty(B, T, HV, V, dtype=dt, device=dev)
    qg = new_empty(B, T, HV, K, dtype=dt, device=dev)
    kd = new_empty(B, T, HV, K, dtype=dt, device=dev)
    Aqk = new_empty(B, T, HV, C, dtype=dt, device=dev)
    gl = new_empty(NT_total, HV, K, dtype=torch.float32, device=dev)
    gc = new_empty(B, T, HV, K, dtype=torch.float32, device=dev)  # block-local cumulative gates
    ga = new_empty(B, T, HV, K, dtype=torch.float32, device=dev)  # activated gates
    ls = new_empty(NT_total, HV, C, C, dtype=torch.float32, device=dev)  # Akk, lower blocks
    xs = new_empty(NT_total, HV, C, C, dtype=torch.float32, device=dev)  # (I + L)^-1, lower blocks
    rs = new_empty(NT_total, HV, 2, C, dtype=torch.float32, device=dev)  # 1/|q|, 1/|k| of every row
    PREC = "ieee" if dt == torch.float32 else "tf32"  # products are float32: tensor-core tf32 for 16-bit inputs
    if NT_total > 0:
        BK, BV = pow2(K), pow2(V)
        kda_fwd_prepare_kernel[(NT_total, HV)](
            q, k, v, g, beta, A_log, dt_bias, w, u, qg, kd, Aqk, gl, gc, ga, ls, xs, rs, cu_seqlens, chunk_indices,
            opts.scale, opts.lower_bound if opts.lower_bound is not None else 0.0, T,
            H=H, HV=HV, K=K, V=V, C=C, BK=BK, BV=BV, BS=min(SLICE, BK, BV), GATE=gate_code(opts.gate),
            HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, SAFE=opts.safe_gate, L2NORM=opts.qk_l2norm,
            SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale, IS_VARLEN=cu_seqlens is not None,
            PREC=PREC, WIDE=PREPARE_WIDE,
            num_warps=PREPARE_WIDE_WARPS if PREPARE_WIDE else PREPARE_WARPS if max(BK, BV) <= 128 else 4, num_stages=1,
        )
    return Prepared(w, u, qg, kd, Aqk, gl, gc, ga, ls, xs, rs, chunk_indices, chunk_offsets, NT_total)
