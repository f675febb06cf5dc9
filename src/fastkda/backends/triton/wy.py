"""Forward stage 1, the WY form: X = (I + Diag(beta) Akk)^-1 per chunk, then w and u.

    w  = X (beta k e^G)    [C, K]      u  = X (beta v)    [C, V]
    qg = scale q e^G       [C, K]      kd = k e^(G_last - G)    [C, K]

The inverse kernel also stores the chunk decay gl = e^(G_last) on the block path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_program
from .tiles import (block_lower, block_sums, blocks_around, cum_gates, cum_gates_last, gates_after, inv_unit_lower,
                    load_beta, load_block, load_tile, prod, store_block, store_tile, tile_ptr)


@triton.jit
def _store_x(xs, xh, b_x, r, j, C: tl.constexpr, o_i, X_COPY: tl.constexpr):
    """Store block (r, j) of X to xs and, with X_COPY, its bfloat16 copy to xh."""
    store_block(xs, b_x, 16 * r, 16 * j, C, o_i)
    if X_COPY:
        store_block(xh, b_x, 16 * r, 16 * j, C, o_i)


@triton.jit
def _l_block(ls, b_b, r, j, C: tl.constexpr, o_i):
    """Block (r, j) of L = Diag(beta) Akk (b_b: beta of row block r, [16, 1])   [16, 16] float32."""
    return b_b * load_block(ls, 16 * r, 16 * j, C, o_i)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_inverse_kernel(
    beta, gc, ls, xs, xh, gl, cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr, HEADS_FIRST: tl.constexpr,
    STORE_DECAY: tl.constexpr,
    X_COPY: tl.constexpr,
):
    """X = (I + L)^-1 with L = Diag(beta) Akk, block by block (float32 products):
    X_rr = (I + L_rr)^-1,  X_rj = -X_rr sum_{j <= m < r} L_rm X_mj  (C = 32 or 64: 2 or 4 row
    blocks). Every block of L is loaded up front and every block of X stays in registers until it
    is stored: no product waits for a block read back from memory.
    X goes to the scratch xs (float32, or bfloat16 where the plan says: Stage1Plan.x_dtype) and,
    with X_COPY, a bfloat16 copy to
    xh (training: the w/u kernel reads the copy, the backward xs). Then, with STORE_DECAY, the chunk decay
    gl from the block sums (the whole-chunk path's gates kernel stores it itself)."""
    _, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 1, HEADS_FIRST)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_i = tl.arange(0, 16)
    NC: tl.constexpr = C // 16
    ls += i_p * C * C
    xs += i_p * C * C
    if X_COPY:
        xh += i_p * C * C
    # independent loads first, then the products; every b_L.., b_X.. is a [16, 16] float32 block
    b_b0 = load_beta(beta, bos, t0, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
    b_b1 = load_beta(beta, bos, t0 + 16, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
    b_L10 = _l_block(ls, b_b1, 1, 0, C, o_i)
    b_X00 = inv_unit_lower(_l_block(ls, b_b0, 0, 0, C, o_i), o_i, "ieee")
    b_X11 = inv_unit_lower(_l_block(ls, b_b1, 1, 1, C, o_i), o_i, "ieee")
    b_X10 = -prod(b_X11, prod(b_L10, b_X00, "ieee"), "ieee")
    _store_x(xs, xh, b_X00, 0, 0, C, o_i, X_COPY)
    _store_x(xs, xh, b_X11, 1, 1, C, o_i, X_COPY)
    _store_x(xs, xh, b_X10, 1, 0, C, o_i, X_COPY)
    if NC == 4:
        b_b2 = load_beta(beta, bos, t0 + 32, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
        b_b3 = load_beta(beta, bos, t0 + 48, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
        b_L20 = _l_block(ls, b_b2, 2, 0, C, o_i)
        b_L21 = _l_block(ls, b_b2, 2, 1, C, o_i)
        b_L30 = _l_block(ls, b_b3, 3, 0, C, o_i)
        b_L31 = _l_block(ls, b_b3, 3, 1, C, o_i)
        b_L32 = _l_block(ls, b_b3, 3, 2, C, o_i)
        b_X22 = inv_unit_lower(_l_block(ls, b_b2, 2, 2, C, o_i), o_i, "ieee")
        b_X33 = inv_unit_lower(_l_block(ls, b_b3, 3, 3, C, o_i), o_i, "ieee")
        b_X21 = -prod(b_X22, prod(b_L21, b_X11, "ieee"), "ieee")
        b_X20 = -prod(b_X22, prod(b_L20, b_X00, "ieee") + prod(b_L21, b_X10, "ieee"), "ieee")
        b_X32 = -prod(b_X33, prod(b_L32, b_X22, "ieee"), "ieee")
        b_X31 = -prod(b_X33, prod(b_L31, b_X11, "ieee") + prod(b_L32, b_X21, "ieee"), "ieee")
        b_X30 = -prod(b_X33, prod(b_L30, b_X00, "ieee") + prod(b_L31, b_X10, "ieee") + prod(b_L32, b_X20, "ieee"),
                      "ieee")
        _store_x(xs, xh, b_X22, 2, 2, C, o_i, X_COPY)
        _store_x(xs, xh, b_X33, 3, 3, C, o_i, X_COPY)
        _store_x(xs, xh, b_X21, 2, 1, C, o_i, X_COPY)
        _store_x(xs, xh, b_X20, 2, 0, C, o_i, X_COPY)
        _store_x(xs, xh, b_X32, 3, 2, C, o_i, X_COPY)
        _store_x(xs, xh, b_X31, 3, 1, C, o_i, X_COPY)
        _store_x(xs, xh, b_X30, 3, 0, C, o_i, X_COPY)
    if STORE_DECAY:
        for s in range(0, BK, BS):
            o_d = s + tl.arange(0, BS)
            tl.store(gl + i_p * K + o_d, tl.exp2(block_sums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, NC)), mask=o_d < K)


@triton.jit
def _cum_gates_lo_where(gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d, m_x):
    """The rounding errors gd (float16) at rows t0 + o_i as tiles.cum_gates_lo, where the scalar m_x holds (the
    chunk has them), else zeros (masked loads)."""
    o_t = tl.minimum(o_i, T_seq - 1 - t0)  # rows from t0
    b_x = tl.load(tile_ptr(gd, bos + t0, i_hv, HV, K, o_t, o_d), mask=(o_d < K)[None, :] & m_x, other=0.0)
    return b_x.to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_wu_kernel(
    q, k, v, beta, gc, ga, gd, gok, rs, xs, w, u, qg, kd, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BS: tl.constexpr,
    NSK: tl.constexpr, NSV: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PREC: tl.constexpr, WHOLE: tl.constexpr, EXACT_SUMS: tl.constexpr, SPLIT: tl.constexpr,
):
    """Feature slice i_s of the chunk's w (the first NSK slices) or u (the rest, NSV), the whole
    chunk as one [C, C] x [C, BS] product (one large product rather than
    [16, 16] x [16, BS] ones, row block by row block). The w slices also store their slice
    of q e^G and k e^(G_last - G). With WHOLE (the whole-chunk path) gc holds cumulative gates from
    the chunk start; otherwise block-local ones, and the exponents are sums of block sums and of the
    activated gates ga (never differences of long sums). PREC as prod's ("bf16" with X stored as
    bfloat16)."""
    i_s, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NSK + NSV,
                                                   HEADS_FIRST)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    NC: tl.constexpr = C // 16
    rs += i_p * 2 * C
    xs += i_p * C * C
    o_c = tl.arange(0, C)
    b_X = block_lower(xs, o_c, C)  # X is block lower triangular
    b_b = load_beta(beta, bos, t0, T_seq, i_hv, o_c, HV, SIGMOID, BETA_SCALE)  # [C]
    if i_s < NSK:  # w = X (beta k e^G)
        o_d = i_s * BS + tl.arange(0, BS)
        b_k = load_tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d) * tl.load(rs + C + o_c)[:, None]
        b_q = load_tile(q, bos, t0, T_seq, i_h, H, K, o_c, o_d) * tl.load(rs + o_c)[:, None]
        if WHOLE:  # gc holds the cumulative gates from the chunk start
            b_G = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
            b_e = tl.exp2(b_G)
            b_last = cum_gates_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d)  # G at the chunk end   [BS]
            b_dG = b_last[None, :] - b_G
            if EXACT_SUMS:  # plus the difference of the rounding errors (docs/math.md section 3)
                m_x = tl.full([], 1, tl.int1)
                if SPLIT:  # stored for the chunks with gok's bit 1 alone; masked loads, no branch
                    m_x = (tl.load(gok + i_p) & 2) != 0
                o_last = tl.full([1], C - 1, tl.int32)
                b_dG += _cum_gates_lo_where(gd, bos, t0, T_seq, i_hv, HV, K, o_last, o_d, m_x) \
                    - _cum_gates_lo_where(gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, m_x)
            b_d = tl.exp2(b_dG)
        else:  # G: own block's cumulative gates + earlier blocks'; G_last - G: the rest of the block + later blocks'
            b_before, b_after = blocks_around(gc, bos, t0, T_seq, i_hv, HV, K, NC, o_c, o_d)
            b_e = tl.exp2(cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) + b_before)
            b_d = tl.exp2(gates_after(ga, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) + b_after)
        store_tile(qg, b_q * b_e * scale, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
        store_tile(kd, b_k * b_d, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
        store_tile(w, prod(b_X, b_k * b_b[:, None] * b_e, PREC), bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
    else:  # u = X (beta v); NSV = 0: the scan forms u itself (ScanPlan.form_u), u is None
        if NSV > 0:
            o_d = (i_s - NSK) * BS + tl.arange(0, BS)
            b_y = load_tile(v, bos, t0, T_seq, i_hv, HV, V, o_c, o_d) * b_b[:, None]
            store_tile(u, prod(b_X, b_y, PREC), bos, t0, T_seq, i_hv, HV, V, o_c, o_d)
