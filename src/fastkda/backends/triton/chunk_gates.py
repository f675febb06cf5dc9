"""Forward stage 1, gates: activation, cumulative sums and row norms, per chunk.

Block path: one program per 16-token block, storing the activated gates (``ga``), their block-local
cumulative sums (``gc``) and 1/|q|, 1/|k| of its rows (``rs``). Whole-chunk path: one program per
chunk, storing the cumulative sums from the chunk start (``gc``) and the chunk decay (``gl``); for
unbounded gates the sums are float32 plus their rounding errors (``gd``, float16) and a word per
chunk (``gok``) says which form its diagonal blocks take (docs/math.md section 3).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import activate_gate, chunk_program
from .tiles import cum_gates, cum_gates_last, load_tile, rnorm, store_tile

# unbounded gates: the middle anchor of a chunk's diagonal blocks while every factor stays below
# 2^DIAG_SPAN (float32 overflows at 2^128; the operands keep a margin of 2^32); otherwise the
# half-segment levels. Sums within the plan's LO_SPAN need no rounding errors (docs/math.md section 3)
DIAG_SPAN = tl.constexpr(96.0)


@triton.jit
def _activated_gates(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_r, o_d,
               GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    """The activated gates (base 2, 0 on padding) of rows t0 + o_r, columns o_d: [rows, BS] float32."""
    m = ((t0 + o_r) < T_seq)[:, None] & (o_d < K)[None, :]
    b_g = load_tile(g, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    b_g = activate_gate(b_g, A_log, dt_bias, i_hv, o_d, o_d < K, lower_bound, GATE, HAS_A, HAS_BIAS, K, FAST)
    return tl.where(m, b_g * 1.4426950408889634, 0.0)


@triton.jit
def _block_gates(g, A_log, dt_bias, gc, ga, lower_bound, bos, t0, T_seq, i_hv, o_i, HV: tl.constexpr, K: tl.constexpr,
           BK: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Activate 16 tokens' gates (base 2, 0 on padding); store them (ga) and their block-local
    cumulative sum (gc)."""
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_g = _activated_gates(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV, K, o_i, o_d, GATE, HAS_A,
                               HAS_BIAS, 0)
        store_tile(ga, b_g, bos, t0, T_seq, i_hv, HV, K, o_i, o_d)
        store_tile(gc, tl.cumsum(b_g, 0), bos, t0, T_seq, i_hv, HV, K, o_i, o_d)


@triton.jit
def _row_rstd(x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, BK: tl.constexpr, BS: tl.constexpr,
          L2NORM: tl.constexpr):
    """Per-row 1 / sqrt(|x|^2 + 1e-6) of the rows t0 + o_i (ones without l2norm)."""
    b_ss = tl.zeros([o_i.shape[0]], tl.float32)
    if L2NORM:
        for s in range(0, BK, BS):
            b_x = load_tile(x, bos, t0, T_seq, i_head, NH, D, o_i, s + tl.arange(0, BS))
            b_ss += tl.sum(b_x * b_x, 1)
    return rnorm(b_ss, L2NORM)


@triton.jit
def exact_cumsum(b_g):
    """Cumulative sums down axis 0 of b_g [C, BS] (float32) as float32 sums and their rounding
    errors, without float64: every value is cut at a grid u (a power of two per column, 2^21 u at
    least the column's sum of magnitudes) into a multiple of u, whose sums are then exact, and a
    remainder below u/2, summed apart; the two sums meet in an error-free addition (TwoSum)."""
    b_s = tl.sum(tl.abs(b_g), 0)  # [BS] a bound on every partial sum
    i_e = (b_s.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: floor(log2 s) + 127
    i_u = tl.minimum(tl.maximum(i_e + 1 - 21, 1), 230)  # u = 2^(floor(log2 s) + 1 - 21), a normal number
    b_m = ((i_u + 23) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^23 * u: its ulp is u
    b_hi = (b_g + b_m[None, :]) - b_m[None, :]  # b_g rounded to a multiple of u (|b_g| < 2^22 u)
    b_H = tl.cumsum(b_hi, 0)  # exact: multiples of u below 2^22 u in magnitude
    b_L = tl.cumsum(b_g - b_hi, 0)  # the remainders (exact differences), |b_L| <= 32 u
    b_G = b_H + b_L
    b_z = b_G - b_H
    return b_G, (b_H - (b_G - b_z)) + (b_L - b_z)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_gates_kernel(
    q, k, g, A_log, dt_bias, gc, ga, gd, gok, gl, rs, cu_seqlens, chunk_indices, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    WHOLE: tl.constexpr, EXACT_SUMS: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr, LO_SPAN: tl.constexpr,
):
    """Block i_b of a chunk: activated gates (ga), block-local cumulative sums (gc), 1/|q| and 1/|k|
    of its rows (rs). With WHOLE, the whole chunk in one program: gc holds the cumulative sums from
    the chunk start (no ga), the chunk decay gl is stored too and rs is left to the intra kernel
    (kda_fwd_intra_chunk_kernel), which reads q and k anyway. With EXACT_SUMS (WHOLE for unbounded
    gates) the sums are kept as float32 (gc) plus their rounding errors (gd, float16; exact_cumsum),
    and gok says (bit 0) whether the middle anchor of the chunk's 16-token blocks keeps every
    exponent within DIAG_SPAN (base 2) and (bit 1) whether its sums reach beyond LO_SPAN (base 2; the
    plan's, per input dtype). With SPLIT (the plan's split passes) the sums are plain float32 ones,
    except in the chunks that need exact ones (bit 1), which a second pass sums again exactly: gd is
    stored for those chunks alone, and read there alone. FAST: the softplus form (common.softplus)."""
    NSUB: tl.constexpr = 1 if WHOLE else C // 16
    i_b, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NSUB, HEADS_FIRST)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    rs += i_p * 2 * C
    if WHOLE:
        o_c = tl.arange(0, C)
        for s in range(0, BK, BS):
            o_d = s + tl.arange(0, BS)
            b_g = _activated_gates(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, GATE, HAS_A,
                             HAS_BIAS, FAST)
            if EXACT_SUMS and not SPLIT:
                b_G, b_E = exact_cumsum(b_g)
                store_tile(gd, b_E, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
            else:
                b_G = tl.cumsum(b_g, 0)
            store_tile(gc, b_G, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
            tl.store(gl + i_p * K + o_d, tl.exp2(tl.sum(b_g, 0)), mask=o_d < K)
        if EXACT_SUMS:
            # the middle anchor's largest exponents, G_0 - G_8 (rows) and G_8 - G_15 (columns) of
            # every block, and the lowest sum, G at the chunk's last token (G is non-increasing), from
            # the rows just stored (reloaded: no reductions across the tile's threads but the last)
            tl.debug_barrier()  # the rows were stored by other threads (one stage: the plan's launch)
            o_b = 16 * tl.arange(0, C // 16)  # the blocks' first rows
            b_half = tl.zeros([C // 16, BS], tl.float32)
            b_last = tl.zeros([BS], tl.float32)
            for s in range(0, BK, BS):
                o_d = s + tl.arange(0, BS)
                b_g8 = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_b + 8, o_d)  # [C // 16, BS]
                b_up = cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_b, o_d) - b_g8
                b_dn = b_g8 - cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_b + 15, o_d)
                b_half = tl.maximum(b_half, tl.maximum(b_up, b_dn))
                b_last = tl.minimum(b_last, cum_gates_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d))
            # bit 0: the middle anchor; bit 1: sums beyond LO_SPAN, whose rounding errors count
            f = (tl.max(b_half) <= DIAG_SPAN).to(tl.int32) + 2 * (tl.min(b_last) < -LO_SPAN).to(tl.int32)
            tl.store(gok + i_p, f)
            if SPLIT:
                if (f & 2) != 0:  # exact sums over the plain ones (which set f well within its bounds' margins)
                    for s in range(0, BK, BS):
                        o_d = s + tl.arange(0, BS)
                        b_g = _activated_gates(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV, K, o_c, o_d,
                                               GATE, HAS_A, HAS_BIAS, FAST)
                        b_G, b_E = exact_cumsum(b_g)
                        store_tile(gc, b_G, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
                        store_tile(gd, b_E, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
    else:
        tb = t0 + 16 * i_b
        o_i = tl.arange(0, 16)
        if tb < T_seq:
            _block_gates(g, A_log, dt_bias, gc, ga, lower_bound, bos, tb, T_seq, i_hv, o_i, HV, K, BK, BS, GATE, HAS_A,
                   HAS_BIAS)
        tl.store(rs + 16 * i_b + o_i, _row_rstd(q, bos, tb, T_seq, i_h, H, K, o_i, BK, BS, L2NORM))
        tl.store(rs + C + 16 * i_b + o_i, _row_rstd(k, bos, tb, T_seq, i_h, H, K, o_i, BK, BS, L2NORM))
