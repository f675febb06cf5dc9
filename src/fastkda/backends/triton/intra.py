"""Forward stage 1, intra-chunk products: Aqk (j <= i, times scale) and Akk (j < i) of each chunk.

Block path (kda_fwd_intra_kernel): one program per 16-token row block, its diagonal block from
levels of pairs anchored inside it and its blocks against earlier ones anchored at its start.
Whole-chunk path (kda_fwd_intra_chunk_kernel): one program per chunk and matrix, [C, C] products
level by level from the cumulative gates of the whole chunk; it also stores the row norms.
Every exponent is <= 0 on the pairs kept (docs/math.md section 3).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_program
from .tiles import (anchored_level, block_pairs, block_sums, chunk_form, clamped_anchor, cum_gates,
                    cum_gates_lo, gates_after, half_pairs, level_products, load_tile, per_block, prod, rnorm, row_of,
                    store_block, store_tile)


@triton.jit
def _row_norms(rs, which: tl.constexpr, row, C: tl.constexpr, o_i):
    """Stored 1/|q| (which=0) or 1/|k| (which=1) of the 16 rows starting at chunk row ``row``."""
    return tl.load(rs + which * C + row + o_i)


@triton.jit
def _diag_blocks(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, R, C: tl.constexpr, H: tl.constexpr,
                 HV: tl.constexpr,
          K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr):
    """Block R of the chunk: its diagonal Aqk (j <= i) and Akk (j < i) blocks, unscaled."""
    tr = t0 + 16 * R
    b_rq = _row_norms(rs, 0, 16 * R, C, o_i)
    b_rk = _row_norms(rs, 1, 16 * R, C, o_i)
    b_Aqk = tl.zeros([16, 16], tl.float32)
    b_Akk = tl.zeros([16, 16], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_q = load_tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rq[:, None]
        b_k = load_tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None]
        if SAFE:
            b_c = cum_gates(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            # anchor at the middle token: each factor spans <= 8 gates of >= -5, |exponent| <= 58
            b_cm = row_of(b_c, o_i, 8)
            b_up = tl.exp2(b_c - b_cm[None, :])
            b_col = tl.trans(b_k * tl.exp2(b_cm[None, :] - b_c))
            b_Aqk += prod(b_q * b_up, b_col, PREC)
            b_Akk += prod(b_k * b_up, b_col, PREC)
        else:
            # unbounded gates: four levels of pairs, each anchored where both factors are <= 1
            b_g = load_tile(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            b_gn = load_tile(ga, bos, tr + 1, T_seq, i_hv, HV, K, o_i, o_d)  # the next token's gates
            b_lq, b_lk = level_products(b_q, b_k, b_g, b_gn, o_i, PREC)
            b_Aqk += b_lq
            b_Akk += b_lk
    b_Aqk = tl.where(o_i[:, None] >= o_i[None, :], b_Aqk, 0.0)
    b_Akk = tl.where(o_i[:, None] > o_i[None, :], b_Akk, 0.0)
    return b_Aqk, b_Akk


@triton.jit
def _block_pair(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, R, J, C: tl.constexpr, H: tl.constexpr,
          HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """Aqk and Akk of block R's rows against the earlier block J. Anchored at block R's start:
    rows scale by exp2(c_R) <= 1, columns by exp2(gates after token j up to that start) <= 1."""
    tr, tj = t0 + 16 * R, t0 + 16 * J
    b_rq = _row_norms(rs, 0, 16 * R, C, o_i)
    b_rk = _row_norms(rs, 1, 16 * R, C, o_i)
    b_rkj = _row_norms(rs, 1, 16 * J, C, o_i)
    b_Aqk = tl.zeros([16, 16], tl.float32)
    b_Akk = tl.zeros([16, 16], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_e = tl.exp2(cum_gates(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d))
        b_q = load_tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rq[:, None] * b_e
        b_k = load_tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None] * b_e
        b_kj = load_tile(k, bos, tj, T_seq, i_h, H, K, o_i, o_d) * b_rkj[:, None]
        b_between = block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, J + 1, R)
        b_col = tl.trans(b_kj * tl.exp2(gates_after(ga, bos, tj, T_seq, i_hv, HV, K, o_i, o_d) + b_between[None, :]))
        b_Aqk += prod(b_q, b_col, PREC)
        b_Akk += prod(b_k, b_col, PREC)
    return b_Aqk, b_Akk


@triton.jit
def _middle_anchor(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_c, o_d,
                   EXACT_SUMS: tl.constexpr):
    """The middle anchor's factors e^(G - G_m) and e^(G_m - G) [C, BS], m the middle token (8) of each
    row's 16-token block: up to 8 gates (|exponent| <= 58 for bounded gates; for others at most the
    span that chunk_form's gok bit 0 admits, chunk_gates.DIAG_SPAN). EXACT_SUMS: exact sums, as
    tiles.anchored_level's. The anchors' gates load as [C // 16, BS] and spread over their blocks
    (per_block), not gathered per row (fewer loads)."""
    C: tl.constexpr = o_c.shape[0]
    o_m = 16 * tl.arange(0, C // 16) + 8
    b_e = b_G - per_block(cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_m, o_d), C)
    if EXACT_SUMS:
        b_e += b_L - per_block(cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_m, o_d, EXACT_SUMS), C)
    return tl.exp2(b_e), tl.exp2(-b_e)


@triton.jit
def _chained_level(b_r16, b_c16, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_c, o_d, strict,
             S: tl.constexpr, EXACT_SUMS: tl.constexpr):
    """Level S of a chunk whose diagonal blocks take the middle anchor, as tiles.anchored_level's (mask, row
    factors, column factors), from the middle anchor's factors b_r16 = e^(G - G_m), b_c16 = e^(G_m -
    G) [C, BS] (m: the middle token of each row's 16-token block) times one factor per block,
    e^-|G_m - G_a| (a: the level's anchor; G_m <= G_a on the rows the level keeps, G_m >= G_a on
    its columns): two exponentials per entry for all levels instead of two per level (docs/math.md
    section 3). S = 16: the middle anchor's own level."""
    if S == 16:
        return block_pairs(o_c[:, None], o_c[None, :], strict, 16), b_r16, b_c16
    C: tl.constexpr = o_c.shape[0]
    o_b = 16 * tl.arange(0, C // 16)  # the blocks' first rows
    o_m = o_b + 8
    o_a = (o_b // S) * S + S // 2 - 1
    # [C // 16, BS]
    b_e = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_m, o_d) - cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_a, o_d)
    if EXACT_SUMS:
        b_e += cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_m, o_d, EXACT_SUMS) \
            - cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_a, o_d, EXACT_SUMS)
    b_t = per_block(tl.exp2(-tl.abs(b_e)), C)
    return half_pairs(o_c[:, None], o_c[None, :], S), b_r16 * b_t, b_c16 * b_t


@triton.jit
def _add_level(b_A, b_x, b_k, m, b_r, b_c, PREC: tl.constexpr):
    """Add a level (mask m [C, C], row and column factors b_r, b_c [C, BS]) of a chunk's Aqk (b_x =
    q) or Akk (b_x = k) for one feature slice: a [C, C] product whose entries outside the level are
    discarded."""
    return b_A + tl.where(m, prod(b_x * b_r, tl.trans(b_k * b_c), PREC), 0.0)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_intra_kernel(
    q, k, gc, ga, rs, Aqk, ls, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    SAFE: tl.constexpr, IS_VARLEN: tl.constexpr, HEADS_FIRST: tl.constexpr, PREC: tl.constexpr,
):
    """Row block r of a chunk: Aqk (stored times scale) and Akk (to the scratch ls, which the
    backward reads too) against blocks j <= r."""
    r, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, C // 16, HEADS_FIRST)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    tr = t0 + 16 * r
    o_i = tl.arange(0, 16)
    ls += i_p * C * C
    rs += i_p * 2 * C
    b_Aqk, b_Akk = _diag_blocks(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, r, C, H, HV, K, BK, BS, SAFE, PREC)
    store_tile(Aqk + 16 * r, b_Aqk * scale, bos, tr, T_seq, i_hv, HV, C, o_i, o_i)
    store_block(ls, b_Akk, 16 * r, 16 * r, C, o_i)
    for j in range(r):
        b_Aqk, b_Akk = _block_pair(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, r, j, C, H, HV, K, BK, BS, PREC)
        store_tile(Aqk + 16 * j, b_Aqk * scale, bos, tr, T_seq, i_hv, HV, C, o_i, o_i)
        store_block(ls, b_Akk, 16 * r, 16 * j, C, o_i)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_intra_chunk_kernel(
    q, k, gc, gd, gok, rs, Aqk, ls, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    IS_VARLEN: tl.constexpr, HEADS_FIRST: tl.constexpr, PREC: tl.constexpr, EXACT_SUMS: tl.constexpr,
    SELECT: tl.constexpr, CLAMP: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """Two programs per chunk: Aqk (times scale; part 0) or Akk (to the scratch ls; part 1) of the whole
    chunk as [C, C] products level by level, from the cumulative gates of the whole chunk (gc, from the
    gates kernel in WHOLE mode). For gates of at least -5 (-7.22 in base 2) |G| <= 462, so the difference of
    two such sums carries an error of about 1e-4 at most. With EXACT_SUMS (unbounded gates) the sums are
    exact (gc + gd). The diagonal blocks of a chunk where the middle anchor would make a factor above
    2^chunk_gates.DIAG_SPAN (gok's bit 0 clear) take four levels of half-segment pairs (16, 8, 4, 2 tokens)
    and the diagonal instead, or with CLAMP > 0 the 16-token level and the middle anchors of the 8-token
    halves on gates clamped at -CLAMP (base 2; tiles.clamped_anchor). SELECT (the plan's split passes): the
    chunks tiles.chunk_form takes (1: gok == 1; 2: gok == 0; 3: exact sums; 0: all). The row norms of q
    and k come from the tiles read here (part 0 stores them to rs for the w/u kernel and the backward;
    the gates kernel then reads neither)."""
    i_m, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 2, HEADS_FIRST)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, C)
    rs += i_p * 2 * C
    skip, mid = chunk_form(gok, i_p, SELECT, EXACT_SUMS)  # mid: the middle anchor keeps this chunk's factors finite
    if skip:
        return
    b_A = tl.zeros([C, C], tl.float32)
    b_sq = tl.zeros([C], tl.float32)  # squared row norms of q (part 0) and k
    b_sk = tl.zeros([C], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_G = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)  # [C, BS]
        b_L = cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, EXACT_SUMS)
        b_k = load_tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d)
        b_sk += tl.sum(b_k * b_k, 1)
        if i_m == 0:
            b_x = load_tile(q, bos, t0, T_seq, i_h, H, K, o_c, o_d)
            b_sq += tl.sum(b_x * b_x, 1)
        else:
            b_x = b_k
        if mid:  # levels C/2 .. 16 from the middle anchor's factors
            b_r16, b_c16 = _middle_anchor(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, EXACT_SUMS)
            for lvl in tl.static_range(C // 32 + 1):
                m, b_r, b_c = _chained_level(b_r16, b_c16, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, i_m,
                                             C >> lvl, EXACT_SUMS)
                b_A = _add_level(b_A, b_x, b_k, m, b_r, b_c, PREC)
        else:  # levels C .. 16 (exponents <= 0: any gate), then the half-segment levels of 8, 4 and 2 tokens,
            # or with CLAMP > 0 the middle anchors of the 8-token halves on clamped gates (factors <= 2^96)
            for lvl in tl.static_range(C // 32 + (1 if CLAMP > 0.0 else 4)):
                m, b_r, b_c = anchored_level(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, C >> lvl,
                                             EXACT_SUMS)
                b_A = _add_level(b_A, b_x, b_k, m, b_r, b_c, PREC)
            if CLAMP > 0.0:
                b_e = clamped_anchor(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, 8, CLAMP, EXACT_SUMS)
                b_A = _add_level(b_A, b_x, b_k, block_pairs(o_c[:, None], o_c[None, :], 1, 8), tl.exp2(b_e),
                                 tl.exp2(-b_e), PREC)
            if i_m == 0:  # Aqk's diagonal: factor e^0 = 1
                b_A += tl.where(o_c[:, None] == o_c[None, :], tl.sum(b_x * b_k, 1)[:, None], 0.0)
    b_rq = rnorm(b_sq, L2NORM)  # [C]
    b_rk = rnorm(b_sk, L2NORM)
    if i_m == 0:
        tl.store(rs + o_c, b_rq)
        tl.store(rs + C + o_c, b_rk)
        store_tile(Aqk, b_A * (b_rq * scale)[:, None] * b_rk[None, :], bos, t0, T_seq, i_hv, HV, C, o_c, o_c)
    else:
        tl.store(ls + i_p * C * C + o_c[:, None] * C + o_c[None, :], b_A * b_rk[:, None] * b_rk[None, :],
                 mask=(o_c[:, None] // 16) >= (o_c[None, :] // 16))
