"""Forward stage 1, token-parallel: everything a chunk needs that does not depend on the state.

Four launches, each over every (chunk, value head) and, where the work splits further, over the
chunk's 16-token blocks, its two matrices or its feature slices. Two paths:

The block path (any gate; what the backward reads, except for bfloat16 inputs with gates the
kernel activates or bounds):

    gates    (chunk, block, head)   gate activation, its block-local cumulative sums (``gc``),
                                    the activated gates (``ga``) and the row norms of q and k (``rs``)
    intra    (chunk, block, head)   row block r of Aqk and Akk (diagonal block and the blocks
                                    against earlier ones)
    inverse  (chunk, head)          X = (I + Diag(beta) Akk)^-1 (float32; bfloat16 for bfloat16
                                    inputs in inference, X_BF16, and a bfloat16 copy beside the
                                    float32 X in training, X_BF16_TRAIN) and the chunk decay
    wu       (chunk, slice, head)   one feature slice of w or u; the w slices also write q e^G and
                                    k e^(G_last - G). Where the scan forms u itself
                                    (scan.U_IN_SCAN), the w slices alone

The whole-chunk path (bounded gates, ``safe_gate``, and gates activated in the kernel, unbounded,
with the cumulative sums kept exactly and a per-chunk form of the diagonal blocks: inference, and
training with bfloat16 inputs; ``whole_forward``, ``bwd_chunk.whole_backward``, docs/math.md
section 3):

    gates    (chunk, head)          gate activation, cumulative sums from the chunk start (``gc``;
                                    unbounded gates: the form of the diagonal blocks ``gok`` and
                                    the sums' rounding errors ``gd``, for 16-bit inputs only in
                                    the chunks that need them), the chunk decay (``gl``)
    intra    (chunk, matrix, head)  Aqk or Akk of the whole chunk, [C, C] products level by level,
                                    and the row norms (``rs``) from the q and k it reads
    inverse  (chunk, head)          X, as above
    wu       (chunk, slice, head)   as above

``fwd_intra`` launches the first three, ``fwd_wu`` the last: the training forward keeps the
former's output for the backward, which recomputes only the latter (and the state scan).

Tiles are [16, BS] (features in slices of BS columns) in the block path, [C, BS] in the
whole-chunk kernels and the w/u kernel. l2norm, beta sigmoid and the gate activation are fused
in. Per chunk it writes (docs/math.md section 2):

    w   = X (beta k e^G)          [C, K]   u  = X (beta v)      [C, V]
    qg  = scale q e^G             [C, K]   kd = k e^(G_last-G)  [C, K]
    Aqk (j <= i, times scale)     [C, C]   gl = e^(G_last)      [K] (float32)

All exponents are base 2. In the block path they are built as sums of the gates they span, never
as a difference of two cumulative sums (which loses precision for large gates): within block b,
``c_b`` is the inclusive cumulative gate from the block start (scratch ``gc``), ``s_b`` the block
total, and the gates after a token are a reverse cumulative sum of the stored activated gates
(``ga``). The whole-chunk path takes differences of cumulative sums from the chunk start: bounded
gates keep those sums below 462 in magnitude, so a difference carries an error of about 1e-4 at
most (a few float32 roundings of the sums), below the products' own precision; for unbounded
gates each sum is kept as float32 plus its rounding error (``gd``, float16), and a difference of
two such pairs is off by its own rounding plus about |G| 2^-34 (docs/math.md section 3).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...options import GateMode
from ...testing import new_empty
from .common import (activate_gate, block_lower, cdiv, chunk_grid, chunk_program, chunk_tables, chunk_tables_static,
                     dot_config, gate_launch, launch_options, mma, pow2, row_of, softplus_form)

# (warps, register cap or None) of each launch for K, V <= 128 (tools/sweep_launch.py, which times
# training steps; "wu_x16", an inference launch, from forward timings: X_BF16 below); beyond,
# at least 4 warps. "chunk" is the whole-chunk intra kernel (4 warps, 64-column steps: 0.74 ms at
# B1 T8192 H64 on the H200 with tf32 products, before BF16_PRODUCTS and the row norms; 8 warps or
# 16-, 32-column steps were slower; so was folding the gates kernel's work into it, 1.57 ms against
# 0.82 + 0.25, or the inverse's, 1.14 against 0.82 + 0.18, timed on a variant of the level factors
# that took 0.82 ms itself: BENCHMARKS.md)
# "gates_whole": the gates kernel on the whole-chunk path, 2 warps (B1 T8192 H64 softplus on the H200:
# 0.469 -> 0.382 ms against 4, 0.489 at 1; bounded gates, with 16 columns per step, 0.207 -> 0.199 ms
# against 4 warps and 32 columns, 0.200 at 1 warp, 0.378 at 8 columns on 1 warp, 0.225 at 32 on 2).
# "intra" capped at 128 registers: B1 T8192 H64 on the H200, one training step (softplus intra
# 2.83 -> 2.57 ms per call; 2.29 ms since the diagonal blocks' levels, against 4.13 ms at 4 warps
# without the cap). "inverse" on 2 warps: its blocks of L and X held in registers take 254
# registers and no spills there (1 warp: 255 and a 376-byte spill stack; offline sm_90 compile)
WHOLE_ANY = True  # gates activated in the kernel, unbounded, take the whole-chunk path (whole_forward)
LAUNCH = {"gates": (4, None), "gates_whole": (2, None), "intra": (2, 128), "chunk": (4, None), "inverse": (2, None),
          "wu": (8, None), "wu_x16": (4, None)}
SLICE = 32  # feature columns per tile
# unbounded gates on the whole-chunk path: the middle anchor of a chunk's diagonal 16-token blocks
# while every factor it makes stays below 2^DIAG_SPAN (float32 overflows at 2^128; the operands
# times the factors keep a margin of 2^32); otherwise the half-segment levels (any gate)
DIAG_SPAN = tl.constexpr(96.0)
# and below this |G| (base 2) in a chunk a float32 difference of two sums is off by 6e-5 at most, as
# with bounded gates (|G| <= 462): such a chunk with the middle anchor (gok == 1) needs neither the
# rounding errors nor the levels. With ANY_SPLIT (16-bit inputs) the whole-chunk intra and
# gate-gradient kernels launch twice, once for those chunks compiled as for bounded gates (fewer
# registers) and once for the others; off: one launch for every chunk (B1 T8192 H64 softplus bf16
# on an H200: training step 10.25 against 10.75 ms, forward 2.59 against 3.04 ms)
LO_SPAN = tl.constexpr(512.0)
ANY_SPLIT = True
CHUNK_SLICE = 64  # feature columns per step of the whole-chunk intra kernel
WU_SLICE = 32  # feature columns per w/u program (its own knob for tools/sweep_launch.py --set)
# feature columns per step of the gates kernel: GATES_SLICE for the block path, GATES_SLICE_WHOLE for
# the whole-chunk path (at K = 128, bfloat16, 4 warps: bounded gates 76 registers at 32 columns, 64
# at 16; unbounded 151 and 90. On an H200, B1 T8192 H64, when the kernel also summed the row norms of
# q and k: bounded 0.254 ms at 32, 0.301 at 16; unbounded 0.713 at 32, 0.630 at 16. Since, bounded
# gates on 2 warps ("gates_whole"): 0.199 ms at 16, 0.225 at 32; 64 columns on 4 warps 0.232, on
# 8 0.343). Both at most the launch's BS (SLICE and V's width): larger values change nothing
GATES_SLICE = 32
GATES_SLICE_WHOLE = 16
# bfloat16 inputs: the whole-chunk intra kernel's level products from operands rounded to bfloat16
# instead of tf32. B1 T8192 H64 on an H200: intra 0.739 -> 0.606 ms (softplus 0.783 -> 0.654), forward
# 2.048 -> 1.916 ms, forward error against float64 3.11e-3 -> 3.69e-3 (fla-core 0.6.0: 4.10e-3).
# With the row norms summed here too (the gates kernel reading g only: 0.254 -> 0.207 ms) the
# kernel takes 0.676 ms (tf32: 0.747): forward 1.941 ms, softplus 2.342 (BENCHMARKS.md).
# (The same for the w/u kernel with X in float32, rounded in registers, 32 columns on 8 warps, was
# slower: 0.45 -> 0.58 ms; X stored in bfloat16 is X_BF16 below.) float16 inputs keep tf32
# products, float32 inputs full-precision ones.
BF16_PRODUCTS = True
# bfloat16 inputs in inference: the inverse X leaves the inverse kernel as bfloat16 (the backward
# keeps float32) and the w/u kernel multiplies bfloat16 operands (_prod, "bf16"), WU_SLICE_X16 columns per
# program on LAUNCH["wu_x16"]. B1 T8192 H64 on an H200: w/u 0.454 -> 0.337 ms (32 columns on 8
# warps: 0.401; 64 on 8: 0.388), inverse 0.181 -> 0.199 ms, forward 1.931 -> 1.838 ms, error
# against float64 3.69e-3 -> 3.99e-3 (fla-core 0.6.0, which keeps its inverse in bfloat16: 4.10e-3)
X_BF16 = True
WU_SLICE_X16 = 64
# training with bfloat16 inputs: the inverse kernel also stores X as bfloat16 (xh) for the w/u kernel
# (forward and the backward's recomputation), so that training runs the w/u products of inference
# (X_BF16); the backward's own products keep float32 X
X_BF16_TRAIN = True
# launch order of the stage-1 kernels: value heads first (common.chunk_grid), so that the
# programs in flight at a time cover every head of a span of chunks (a contiguous stretch of the
# [B, T, HV, K] tensors) instead of every chunk of a few heads. H200, bfloat16, one process,
# interleaved (off -> on): forward B1 T8192 H96 2.603 -> 2.551 ms, varlen H96 2.534 -> 2.465, B2
# T8192 H64 3.220 -> 3.162, B1 T8192 H64 1.741 -> 1.729, B1 T32768 H16 2.154 -> 2.126, softplus
# 1.880 -> 1.882; training step B1 T8192 H64 7.858 -> 7.817, H96 11.765 -> 11.666 (BENCHMARKS.md)
HEADS_FIRST = True


@triton.jit
def _tile(x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Rows t0 + o_i of x [.., NH, D] at head i_head, columns o_d, as float32 (0 outside)."""
    o_t = t0 + o_i
    m = (o_t < T_seq)[:, None] & (o_d < D)[None, :]
    p = x + (bos + o_t).to(tl.int64)[:, None] * (NH * D) + i_head * D + o_d[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _put(x, b_x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Store a tile at rows t0 + o_i of x [.., NH, D] (rows past the sequence end skipped)."""
    o_t = t0 + o_i
    m = (o_t < T_seq)[:, None] & (o_d < D)[None, :]
    tl.store(x + (bos + o_t).to(tl.int64)[:, None] * (NH * D) + i_head * D + o_d[None, :], b_x.to(x.dtype.element_ty), mask=m)


@triton.jit
def _c(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d):
    """Cumulative gates stored in gc at rows t0 + o_i (block-local in the block path, from the chunk
    start in the whole-chunk path): a padding row repeats the last token's (its gate is 0); all 0
    when t0 is past the end (a block of padding only)."""
    o_t = tl.minimum(t0 + o_i, T_seq - 1)
    p = gc + (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :]
    b_c = tl.load(p, mask=(o_d < K)[None, :], other=0.0)
    return tl.where(t0 < T_seq, b_c, 0.0)


@triton.jit
def _c_last(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, o_d):
    """The cumulative gates from the chunk start (whole-chunk path) at the chunk's last token  [BS]."""
    o_last = (bos + tl.minimum(t0 + C - 1, T_seq - 1)) * (HV * K) + i_hv * K
    return tl.load(gc + o_last + o_d, mask=o_d < K, other=0.0)


@triton.jit
def _x(ga, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d):
    """Sum of the gates after each token of rows t0 + o_i, up to the end of its 16-token block: a
    reverse cumulative sum of the next rows within each block (never a difference of two sums,
    which loses precision for large gates)   [rows, BS]."""
    R: tl.constexpr = o_i.shape[0]
    BS: tl.constexpr = o_d.shape[0]
    o_t = t0 + 1 + o_i
    m = ((o_i % 16 < 15) & (o_t < T_seq))[:, None] & (o_d < K)[None, :]
    b_g = tl.load(ga + (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :], mask=m, other=0.0)
    if R == 16:
        return tl.cumsum(b_g, 0, reverse=True)
    return tl.reshape(tl.cumsum(tl.reshape(b_g, [R // 16, 16, BS]), 1, reverse=True), [R, BS])


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
def _activated(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_r, o_d,
               GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr):
    """The activated gates (base 2, 0 on padding) of rows t0 + o_r, columns o_d: [rows, BS] float32."""
    m = ((t0 + o_r) < T_seq)[:, None] & (o_d < K)[None, :]
    b_g = _tile(g, bos, t0, T_seq, i_hv, HV, K, o_r, o_d)
    b_g = activate_gate(b_g, A_log, dt_bias, i_hv, o_d, o_d < K, lower_bound, GATE, HAS_A, HAS_BIAS, K, FAST)
    return tl.where(m, b_g * 1.4426950408889634, 0.0)


@triton.jit
def _gates(g, A_log, dt_bias, gc, ga, lower_bound, bos, t0, T_seq, i_hv, o_i, HV: tl.constexpr, K: tl.constexpr,
           BK: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Activate 16 tokens' gates (base 2, 0 on padding); store them (ga) and their block-local
    cumulative sum (gc)."""
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_g = _activated(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV, K, o_i, o_d, GATE, HAS_A, HAS_BIAS, 0)
        _put(ga, b_g, bos, t0, T_seq, i_hv, HV, K, o_i, o_d)
        _put(gc, tl.cumsum(b_g, 0), bos, t0, T_seq, i_hv, HV, K, o_i, o_d)


@triton.jit
def _rstd(x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, BK: tl.constexpr, BS: tl.constexpr,
          L2NORM: tl.constexpr):
    """Per-row 1 / sqrt(|x|^2 + 1e-6) of the rows t0 + o_i (ones without l2norm)."""
    b_ss = tl.zeros([o_i.shape[0]], tl.float32)
    if L2NORM:
        for s in range(0, BK, BS):
            b_x = _tile(x, bos, t0, T_seq, i_head, NH, D, o_i, s + tl.arange(0, BS))
            b_ss += tl.sum(b_x * b_x, 1)
    return _rnorm(b_ss, L2NORM)


@triton.jit
def _rnorm(b_ss, L2NORM: tl.constexpr):
    """1 / sqrt(b_ss + 1e-6) for squared row norms b_ss (ones without l2norm)."""
    if L2NORM:
        b_r = tl.rsqrt(b_ss + 1e-6)
    else:
        b_r = tl.full(b_ss.shape, 1.0, tl.float32)
    return b_r


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
def half_pairs(i, j, S: tl.constexpr):
    """Mask of the pairs (i, j) with i in the second half and j in the first half of the same
    S-token segment."""
    return ((i // S) == (j // S)) & (i % S >= S // 2) & (j % S < S // 2)


@triton.jit
def split_level(b_g, b_gn, o_i, H: tl.constexpr):
    """Level H of a 16-token block's pairs for any gate (docs/math.md section 3): rows in the second
    half of a 2H-token segment against columns in its first half, anchored at the first half's last
    token a. Returns (the level's mask [16, 16], row factors e^(gates a+1..i), column factors
    e^(gates j+1..a), [16, BS]); b_g holds the block's activated gates, b_gn the next token's.
    Every exponent is a segment-local sum of the gates it spans, never a difference of two sums,
    and is <= 0 on every row (the rows and columns outside the level are discarded)."""
    BS: tl.constexpr = b_g.shape[1]
    m = half_pairs(o_i[:, None], o_i[None, :], 2 * H)
    if H == 1:  # row 2m+1 against column 2m: e^(g_i) and 1
        return m, tl.exp2(b_g), tl.full([16, BS], 1.0, tl.float32)
    b_f = tl.reshape(tl.cumsum(tl.reshape(b_g, [16 // H, H, BS]), 1), [16, BS])  # gates from the segment start
    b_n = tl.where((o_i % H < H - 1)[:, None], b_gn, 0.0)  # the gates after each token, within its H-segment
    b_b = tl.reshape(tl.cumsum(tl.reshape(b_n, [16 // H, H, BS]), 1, reverse=True), [16, BS])
    return m, tl.exp2(b_f), tl.exp2(b_b)


@triton.jit
def _diag(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, R, C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
          K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr):
    """Block R of the chunk: its diagonal Aqk (j <= i) and Akk (j < i) blocks, unscaled."""
    tr = t0 + 16 * R
    b_rq = _rs(rs, 0, 16 * R, C, o_i)
    b_rk = _rs(rs, 1, 16 * R, C, o_i)
    b_Aqk = tl.zeros([16, 16], tl.float32)
    b_Akk = tl.zeros([16, 16], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_q = _tile(q, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rq[:, None]
        b_k = _tile(k, bos, tr, T_seq, i_h, H, K, o_i, o_d) * b_rk[:, None]
        if SAFE:
            b_c = _c(gc, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            # anchor at the middle token: each factor spans <= 8 gates of >= -5, |exponent| <= 58
            b_cm = row_of(b_c, o_i, 8)
            b_up = tl.exp2(b_c - b_cm[None, :])
            b_col = tl.trans(b_k * tl.exp2(b_cm[None, :] - b_c))
            b_Aqk += tl.dot(b_q * b_up, b_col, input_precision=PREC)
            b_Akk += tl.dot(b_k * b_up, b_col, input_precision=PREC)
        else:
            # unbounded gates: four levels of pairs, each anchored where both factors are <= 1
            b_g = _tile(ga, bos, tr, T_seq, i_hv, HV, K, o_i, o_d)
            b_gn = _tile(ga, bos, tr + 1, T_seq, i_hv, HV, K, o_i, o_d)  # the next token's gates
            for lvl in tl.static_range(4):
                m, b_r, b_f = split_level(b_g, b_gn, o_i, 8 >> lvl)
                b_col = tl.trans(b_k * b_f)
                b_Aqk += tl.where(m, tl.dot(b_q * b_r, b_col, input_precision=PREC), 0.0)
                b_Akk += tl.where(m, tl.dot(b_k * b_r, b_col, input_precision=PREC), 0.0)
            b_Aqk += tl.where(o_i[:, None] == o_i[None, :], tl.sum(b_q * b_k, 1)[:, None], 0.0)  # factor 1
    b_Aqk = tl.where(o_i[:, None] >= o_i[None, :], b_Aqk, 0.0)
    b_Akk = tl.where(o_i[:, None] > o_i[None, :], b_Akk, 0.0)
    return b_Aqk, b_Akk


@triton.jit
def _pair(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, R, J, C: tl.constexpr, H: tl.constexpr,
          HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
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
def block_pairs(i, j, strict):
    """Mask of the pairs (i, j) of the diagonal 16-token blocks with j <= i - strict (the middle
    anchor's level: _middle, _chained); block_pairs(j, i, ..) is its transpose."""
    return ((i // 16) == (j // 16)) & (j <= i - strict)


@triton.jit
def _c_lo(gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d, ANY: tl.constexpr):
    """With ANY, the rounding errors of the stored cumulative gates (gd, float16) at rows t0 + o_i, as
    ``_c``: the exact sums are gc + gd. Without it, zeros."""
    if ANY:
        return _c(gd, bos, t0, T_seq, i_hv, HV, K, o_i, o_d).to(tl.float32)
    return tl.zeros([o_i.shape[0], o_d.shape[0]], tl.float32)


@triton.jit
def _anchored(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_c, o_d, S: tl.constexpr,
              ANY: tl.constexpr):
    """Level S of a chunk's pairs for any gate (docs/math.md section 3): (mask [C, C] of its pairs,
    row factors e^(G - G_a), column factors e^(G_a - G) [C, BS]): every S-row segment's second half
    against its first, anchored at the first half's last token a. Exponents <= 0 on the pairs kept,
    clamped at 0 elsewhere (finite, discarded). With ANY (unbounded gates) b_L and gd hold the
    rounding errors of the float32 sums b_G and gc, and each exponent is (G_hi - G_a,hi) + (G_lo -
    G_a,lo): off by the difference's own rounding plus about |G| 2^-34 (float16 errors), not |G|
    2^-24. No such level holds the diagonal."""
    o_a = (o_c // S) * S + S // 2 - 1
    b_e = b_G - _c(gc, bos, t0, T_seq, i_hv, HV, K, o_a, o_d)  # G - G_a   [C, BS]
    if ANY:
        b_e += b_L - _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_a, o_d, ANY)
    # (one exp2(-|e|) and two selects instead: whole-chunk intra 0.74 -> 0.82 ms, B1 T8192 H64)
    b_r = tl.exp2(tl.minimum(b_e, 0.0))
    b_c = tl.exp2(tl.minimum(-b_e, 0.0))
    return half_pairs(o_c[:, None], o_c[None, :], S), b_r, b_c


@triton.jit
def _middle(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_c, o_d, ANY: tl.constexpr):
    """The middle anchor's factors e^(G - G_m) and e^(G_m - G) [C, BS], m the middle token (8) of each
    row's 16-token block: up to 8 gates (|exponent| <= 58 for bounded gates; for others at most the
    span that chunk_form's gok bit 0 admits, DIAG_SPAN). ANY: exact sums, as _anchored's. The
    anchors' gates load as [C // 16, BS] and spread over their blocks (_per_block), not gathered
    per row: B1 T8192 H64 on an H200, intra 0.619 -> 0.603 ms (H96 0.925 -> 0.905)."""
    C: tl.constexpr = o_c.shape[0]
    o_m = 16 * tl.arange(0, C // 16) + 8
    b_e = b_G - _per_block(_c(gc, bos, t0, T_seq, i_hv, HV, K, o_m, o_d), C)
    if ANY:
        b_e += b_L - _per_block(_c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_m, o_d, ANY), C)
    return tl.exp2(b_e), tl.exp2(-b_e)


@triton.jit
def _per_block(b_t, C: tl.constexpr):
    """[C // 16, BS] -> [C, BS]: row b of b_t repeated over the rows of 16-token block b."""
    BS: tl.constexpr = b_t.shape[1]
    return tl.reshape(tl.broadcast_to(b_t[:, None, :], [C // 16, 16, BS]), [C, BS])


@triton.jit
def _chained(b_r16, b_c16, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_c, o_d, strict,
             S: tl.constexpr, ANY: tl.constexpr):
    """Level S of a chunk whose diagonal blocks take the middle anchor, as _anchored's (mask, row
    factors, column factors), from the middle anchor's factors b_r16 = e^(G - G_m), b_c16 = e^(G_m -
    G) [C, BS] (m: the middle token of each row's 16-token block) times one factor per block,
    e^-|G_m - G_a| (a: the level's anchor; G_m <= G_a on the rows the level keeps, G_m >= G_a on
    its columns): two exponentials per entry for all levels instead of two per level (docs/math.md
    section 3). S = 16: the middle anchor's own level."""
    if S == 16:
        return block_pairs(o_c[:, None], o_c[None, :], strict), b_r16, b_c16
    C: tl.constexpr = o_c.shape[0]
    o_b = 16 * tl.arange(0, C // 16)  # the blocks' first rows
    o_m = o_b + 8
    o_a = (o_b // S) * S + S // 2 - 1
    b_e = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_m, o_d) - _c(gc, bos, t0, T_seq, i_hv, HV, K, o_a, o_d)  # [C // 16, BS]
    if ANY:
        b_e += _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_m, o_d, ANY) - _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_a, o_d, ANY)
    b_t = _per_block(tl.exp2(-tl.abs(b_e)), C)
    return half_pairs(o_c[:, None], o_c[None, :], S), b_r16 * b_t, b_c16 * b_t


@triton.jit
def _level(b_A, b_x, b_k, m, b_r, b_c, PREC: tl.constexpr):
    """Add a level (mask m [C, C], row and column factors b_r, b_c [C, BS]) of a chunk's Aqk (b_x =
    q) or Akk (b_x = k) for one feature slice: a [C, C] product whose entries outside the level are
    discarded."""
    return b_A + tl.where(m, _prod(b_x * b_r, tl.trans(b_k * b_c), PREC), 0.0)


@triton.jit
def chunk_form(gok, i_p, SEL: tl.constexpr, ANY: tl.constexpr):
    """(skip, mid) of chunk slot i_p from its gok word, read once: whether this launch of a split
    pair (ANY_SPLIT) leaves the chunk to the other (SEL 1 takes the chunks with gok == 1, middle
    anchor and small sums; SEL 2 the others; SEL 0 every chunk), and whether its diagonal blocks
    take the middle anchor (always for bounded gates, ANY off; else gok's bit 0)."""
    skip = False
    mid = True
    if SEL != 0 or ANY:  # one return: the compiler visits code after a constexpr-if's return (gok None)
        f = tl.load(gok + i_p)
        if SEL == 1:
            skip = f != 1
        if SEL == 2:
            skip = f == 1
        if ANY:
            mid = (f & 1) != 0
    return skip, mid


@triton.jit(do_not_specialize=["T"])
def kda_fwd_intra_chunk_kernel(
    q, k, gc, gd, gok, rs, Aqk, ls, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    IS_VARLEN: tl.constexpr, HF: tl.constexpr, PREC: tl.constexpr, ANY: tl.constexpr, SEL: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """Two programs per chunk: Aqk (times scale; part 0) or Akk (to the scratch ls; part 1) of the
    whole chunk as [C, C] products level by level, from the cumulative gates of the whole chunk
    (gc, from the gates kernel in WHOLE mode). For gates of at least -5 (-7.22 in base 2)
    |G| <= 462, so the difference of two such sums carries an error of about 1e-4 at most. With ANY
    (unbounded gates) the sums are exact (gc + gd), and the diagonal blocks of a chunk where the
    middle anchor would make a factor above 2^DIAG_SPAN (gok = 0) take four levels of half-segment
    pairs (16, 8, 4, 2 tokens) and the diagonal instead. SEL (ANY_SPLIT): 1, only the chunks with
    gok == 1; 2, only the others; 0, every chunk. (One program for both matrices held 255
    registers, 2 blocks per SM.) The row norms of q and k come from the tiles read here (part 0
    stores them to rs for the w/u kernel and the backward; the gates kernel then reads neither)."""
    i_m, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 2, HF)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, C)
    rs += i_p * 2 * C
    skip, mid = chunk_form(gok, i_p, SEL, ANY)  # mid: the middle anchor keeps this chunk's factors finite
    if skip:
        return
    b_A = tl.zeros([C, C], tl.float32)
    b_sq = tl.zeros([C], tl.float32)  # squared row norms of q (part 0) and k
    b_sk = tl.zeros([C], tl.float32)
    for s in range(0, BK, BS):
        o_d = s + tl.arange(0, BS)
        b_G = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)  # [C, BS]
        b_L = _c_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, ANY)
        b_k = _tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d)
        b_sk += tl.sum(b_k * b_k, 1)
        if i_m == 0:
            b_x = _tile(q, bos, t0, T_seq, i_h, H, K, o_c, o_d)
            b_sq += tl.sum(b_x * b_x, 1)
        else:
            b_x = b_k
        if mid:  # levels C/2 .. 16 from the middle anchor's factors
            b_r16, b_c16 = _middle(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, ANY)
            for lvl in tl.static_range(C // 32 + 1):
                m, b_r, b_c = _chained(b_r16, b_c16, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, i_m, C >> lvl, ANY)
                b_A = _level(b_A, b_x, b_k, m, b_r, b_c, PREC)
        else:  # every exponent <= 0: any gate
            for lvl in tl.static_range(C // 32 + 4):
                m, b_r, b_c = _anchored(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, C >> lvl, ANY)
                b_A = _level(b_A, b_x, b_k, m, b_r, b_c, PREC)
            if i_m == 0:  # Aqk's diagonal: factor e^0 = 1
                b_A += tl.where(o_c[:, None] == o_c[None, :], tl.sum(b_x * b_k, 1)[:, None], 0.0)
    b_rq = _rnorm(b_sq, L2NORM)  # [C]
    b_rk = _rnorm(b_sk, L2NORM)
    if i_m == 0:
        tl.store(rs + o_c, b_rq)
        tl.store(rs + C + o_c, b_rk)
        _put(Aqk, b_A * (b_rq * scale)[:, None] * b_rk[None, :], bos, t0, T_seq, i_hv, HV, C, o_c, o_c)
    else:
        tl.store(ls + i_p * C * C + o_c[:, None] * C + o_c[None, :], b_A * b_rk[:, None] * b_rk[None, :],
                 mask=(o_c[:, None] // 16) >= (o_c[None, :] // 16))


@triton.jit
def _blk(x, row, col, C: tl.constexpr, o_i):
    """The [16, 16] block at rows row.., columns col.. of this program's [C, C] scratch, as float32."""
    return tl.load(x + (row + o_i)[:, None] * C + col + o_i[None, :]).to(tl.float32)


@triton.jit
def _put_blk(x, b_x, row, col, C: tl.constexpr, o_i):
    tl.store(x + (row + o_i)[:, None] * C + col + o_i[None, :], b_x.to(x.dtype.element_ty))


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


@triton.jit
def _prod(a, b, PREC: tl.constexpr):
    """a @ b in float32 from float32 operands: at input precision PREC, or ("bf16") rounded to
    bfloat16 (operands already bfloat16, like the w/u kernel's X under X_BF16, stay as they are);
    "bf16_emulated" for the interpreter, whose bfloat16 products are wrong (common.mma): operands
    cut to bfloat16 (its conversion truncates; the GPU rounds to nearest), float32 products."""
    if PREC == "bf16":  # one return: the compiler visits code after a constexpr-if's return
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_emulated":
        c = tl.dot(mma(a, tl.bfloat16, True), mma(b, tl.bfloat16, True), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def _exact_cumsum(b_g):
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
    HF: tl.constexpr,
    WHOLE: tl.constexpr, ANY: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr,
):
    """Block b of a chunk: activated gates (ga), block-local cumulative sums (gc), 1/|q| and 1/|k|
    of its rows (rs). With WHOLE, the whole chunk in one program: gc holds the cumulative sums from
    the chunk start (no ga), the chunk decay gl is stored too and rs is left to the intra kernel
    (kda_fwd_intra_chunk_kernel), which reads q and k anyway. With ANY (WHOLE for unbounded
    gates) the sums are kept as float32 (gc) plus their rounding errors (gd, float16; _exact_cumsum),
    and gok says (bit 0) whether the middle anchor of the chunk's 16-token blocks keeps every
    exponent within DIAG_SPAN (base 2) and (bit 1) whether its sums reach beyond LO_SPAN. With SPLIT
    (16-bit inputs, split_launches) the sums are plain float32 ones, except in the chunks that need
    exact ones (gok != 1), which a second pass sums again exactly: gd is stored for those chunks
    alone, and read there alone. FAST: the softplus form (common.softplus)."""
    NSUB: tl.constexpr = 1 if WHOLE else C // 16
    b, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NSUB, HF)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    rs += i_p * 2 * C
    if WHOLE:
        o_c = tl.arange(0, C)
        for s in range(0, BK, BS):
            o_d = s + tl.arange(0, BS)
            b_g = _activated(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, GATE, HAS_A,
                             HAS_BIAS, FAST)
            if ANY and not SPLIT:
                b_G, b_E = _exact_cumsum(b_g)
                _put(gd, b_E, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
            else:
                b_G = tl.cumsum(b_g, 0)
            _put(gc, b_G, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
            tl.store(gl + i_p * K + o_d, tl.exp2(tl.sum(b_g, 0)), mask=o_d < K)
        if ANY:
            # the middle anchor's largest exponents, G_0 - G_8 (rows) and G_8 - G_15 (columns) of
            # every block, and the lowest sum, G at the chunk's last token (G is non-increasing), from
            # the rows just stored (reloaded: no reductions across the tile's threads but the last)
            tl.debug_barrier()  # the rows were stored by other threads (one stage: launch_options)
            o_b = 16 * tl.arange(0, C // 16)  # the blocks' first rows
            b_half = tl.zeros([C // 16, BS], tl.float32)
            b_last = tl.zeros([BS], tl.float32)
            for s in range(0, BK, BS):
                o_d = s + tl.arange(0, BS)
                b_g8 = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_b + 8, o_d)  # [C // 16, BS]
                b_half = tl.maximum(b_half, tl.maximum(_c(gc, bos, t0, T_seq, i_hv, HV, K, o_b, o_d) - b_g8,
                                                       b_g8 - _c(gc, bos, t0, T_seq, i_hv, HV, K, o_b + 15, o_d)))
                b_last = tl.minimum(b_last, _c_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d))
            # bit 0: the middle anchor; bit 1: sums beyond LO_SPAN, whose rounding errors count
            f = (tl.max(b_half) <= DIAG_SPAN).to(tl.int32) + 2 * (tl.min(b_last) < -LO_SPAN).to(tl.int32)
            tl.store(gok + i_p, f)
            if SPLIT:
                if f != 1:  # exact sums over the plain ones (which set f well within its bounds' margins)
                    for s in range(0, BK, BS):
                        o_d = s + tl.arange(0, BS)
                        b_G, b_E = _exact_cumsum(_activated(g, A_log, dt_bias, lower_bound, bos, t0, T_seq, i_hv, HV,
                                                            K, o_c, o_d, GATE, HAS_A, HAS_BIAS, FAST))
                        _put(gc, b_G, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
                        _put(gd, b_E, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
    else:
        tb = t0 + 16 * b
        o_i = tl.arange(0, 16)
        if tb < T_seq:
            _gates(g, A_log, dt_bias, gc, ga, lower_bound, bos, tb, T_seq, i_hv, o_i, HV, K, BK, BS, GATE, HAS_A,
                   HAS_BIAS)
        tl.store(rs + 16 * b + o_i, _rstd(q, bos, tb, T_seq, i_h, H, K, o_i, BK, BS, L2NORM))
        tl.store(rs + C + 16 * b + o_i, _rstd(k, bos, tb, T_seq, i_h, H, K, o_i, BK, BS, L2NORM))


@triton.jit(do_not_specialize=["T"])
def kda_fwd_intra_kernel(
    q, k, gc, ga, rs, Aqk, ls, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    SAFE: tl.constexpr, IS_VARLEN: tl.constexpr, HF: tl.constexpr, PREC: tl.constexpr,
):
    """Row block r of a chunk: Aqk (stored times scale) and Akk (to the scratch ls, which the
    backward reads too) against blocks j <= r."""
    r, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, C // 16, HF)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    tr = t0 + 16 * r
    o_i = tl.arange(0, 16)
    ls += i_p * C * C
    rs += i_p * 2 * C
    b_Aqk, b_Akk = _diag(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, r, C, H, HV, K, BK, BS, SAFE, PREC)
    _put(Aqk + 16 * r, b_Aqk * scale, bos, tr, T_seq, i_hv, HV, C, o_i, o_i)
    _put_blk(ls, b_Akk, 16 * r, 16 * r, C, o_i)
    for j in range(r):
        b_Aqk, b_Akk = _pair(q, k, gc, ga, rs, bos, t0, T_seq, i_h, i_hv, o_i, r, j, C, H, HV, K, BK, BS, PREC)
        _put(Aqk + 16 * j, b_Aqk * scale, bos, tr, T_seq, i_hv, HV, C, o_i, o_i)
        _put_blk(ls, b_Akk, 16 * r, 16 * j, C, o_i)


@triton.jit
def _put_x(xs, xh, b_x, r, j, C: tl.constexpr, o_i, XH: tl.constexpr):
    """Store block (r, j) of X to xs and, with XH, its bfloat16 copy to xh."""
    _put_blk(xs, b_x, 16 * r, 16 * j, C, o_i)
    if XH:
        _put_blk(xh, b_x, 16 * r, 16 * j, C, o_i)


@triton.jit
def _l_blk(ls, b_b, r, j, C: tl.constexpr, o_i):
    """Block (r, j) of L = Diag(beta) Akk (b_b: beta of row block r, [16, 1])   [16, 16] float32."""
    return b_b * _blk(ls, 16 * r, 16 * j, C, o_i)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_inverse_kernel(
    beta, gc, ls, xs, xh, gl, cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr, HF: tl.constexpr, GL: tl.constexpr,
    XH: tl.constexpr,
):
    """X = (I + L)^-1 with L = Diag(beta) Akk, block by block (float32 products):
    X_rr = (I + L_rr)^-1,  X_rj = -X_rr sum_{j <= m < r} L_rm X_mj  (C = 32 or 64: 2 or 4 row
    blocks). Every block of L is loaded up front and every block of X stays in registers until it
    is stored: no product waits for a block read back from memory.
    X goes to the scratch xs (float32, or bfloat16 under X_BF16) and, with XH, a bfloat16 copy to
    xh (training: the w/u kernel reads the copy, the backward xs). Then, with GL, the chunk decay
    gl from the block sums (the whole-chunk path's gates kernel stores it itself)."""
    _, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 1, HF)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_i = tl.arange(0, 16)
    NC: tl.constexpr = C // 16
    ls += i_p * C * C
    xs += i_p * C * C
    if XH:
        xh += i_p * C * C
    # independent loads first, then the products; every b_L.., b_X.. is a [16, 16] float32 block
    b_b0 = _beta(beta, bos, t0, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
    b_b1 = _beta(beta, bos, t0 + 16, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
    b_L10 = _l_blk(ls, b_b1, 1, 0, C, o_i)
    b_X00 = _inv_unit_lower(_l_blk(ls, b_b0, 0, 0, C, o_i), o_i)
    b_X11 = _inv_unit_lower(_l_blk(ls, b_b1, 1, 1, C, o_i), o_i)
    b_X10 = -_mm(b_X11, _mm(b_L10, b_X00))
    _put_x(xs, xh, b_X00, 0, 0, C, o_i, XH)
    _put_x(xs, xh, b_X11, 1, 1, C, o_i, XH)
    _put_x(xs, xh, b_X10, 1, 0, C, o_i, XH)
    if NC == 4:
        b_b2 = _beta(beta, bos, t0 + 32, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
        b_b3 = _beta(beta, bos, t0 + 48, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)[:, None]
        b_L20 = _l_blk(ls, b_b2, 2, 0, C, o_i)
        b_L21 = _l_blk(ls, b_b2, 2, 1, C, o_i)
        b_L30 = _l_blk(ls, b_b3, 3, 0, C, o_i)
        b_L31 = _l_blk(ls, b_b3, 3, 1, C, o_i)
        b_L32 = _l_blk(ls, b_b3, 3, 2, C, o_i)
        b_X22 = _inv_unit_lower(_l_blk(ls, b_b2, 2, 2, C, o_i), o_i)
        b_X33 = _inv_unit_lower(_l_blk(ls, b_b3, 3, 3, C, o_i), o_i)
        b_X21 = -_mm(b_X22, _mm(b_L21, b_X11))
        b_X20 = -_mm(b_X22, _mm(b_L20, b_X00) + _mm(b_L21, b_X10))
        b_X32 = -_mm(b_X33, _mm(b_L32, b_X22))
        b_X31 = -_mm(b_X33, _mm(b_L31, b_X11) + _mm(b_L32, b_X21))
        b_X30 = -_mm(b_X33, _mm(b_L30, b_X00) + _mm(b_L31, b_X10) + _mm(b_L32, b_X20))
        _put_x(xs, xh, b_X22, 2, 2, C, o_i, XH)
        _put_x(xs, xh, b_X33, 3, 3, C, o_i, XH)
        _put_x(xs, xh, b_X21, 2, 1, C, o_i, XH)
        _put_x(xs, xh, b_X20, 2, 0, C, o_i, XH)
        _put_x(xs, xh, b_X32, 3, 2, C, o_i, XH)
        _put_x(xs, xh, b_X31, 3, 1, C, o_i, XH)
        _put_x(xs, xh, b_X30, 3, 0, C, o_i, XH)
    if GL:
        for s in range(0, BK, BS):
            o_d = s + tl.arange(0, BS)
            tl.store(gl + i_p * K + o_d, tl.exp2(_bsums(gc, bos, t0, T_seq, i_hv, HV, K, o_d, 0, NC)), mask=o_d < K)


@triton.jit
def _lo_rows(gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d, m_x):
    """The rounding errors gd (float16) at rows t0 + o_i as _c_lo, where the scalar m_x holds (the
    chunk has them), else zeros (masked loads)."""
    o_t = tl.minimum(t0 + o_i, T_seq - 1)
    p = gd + (bos + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_d[None, :]
    return tl.load(p, mask=(o_d < K)[None, :] & m_x, other=0.0).to(tl.float32)


@triton.jit
def _blocks_around(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, NC: tl.constexpr, o_c, o_d):
    """([C, BS], [C, BS]): for every row of the chunk, the gates of the blocks before its own and of
    those after it, sums of block sums (each block sum loaded once)."""
    b_before = tl.zeros([o_c.shape[0], o_d.shape[0]], tl.float32)
    b_after = tl.zeros([o_c.shape[0], o_d.shape[0]], tl.float32)
    for b in range(NC):
        b_s = _bsum(gc, bos, t0 + 16 * b, T_seq, i_hv, HV, K, o_d)[None, :]
        b_before += tl.where((b < o_c // 16)[:, None], b_s, 0.0)
        b_after += tl.where((b > o_c // 16)[:, None], b_s, 0.0)
    return b_before, b_after


@triton.jit(do_not_specialize=["T"])
def kda_fwd_wu_kernel(
    q, k, v, beta, gc, ga, gd, gok, rs, xs, w, u, qg, kd, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BS: tl.constexpr,
    NSK: tl.constexpr, NSV: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HF: tl.constexpr,
    PREC: tl.constexpr, WHOLE: tl.constexpr, ANY: tl.constexpr, SPLIT: tl.constexpr,
):
    """Feature slice i_s of the chunk's w (the first NSK slices) or u (the rest, NSV), the whole
    chunk as one [C, C] x [C, BS] product (0.50 ms at B1 T8192 H64 on the H200, 8 warps; row block
    by row block, [16, 16] x [16, BS] products, took 0.71 ms). The w slices also store their slice
    of q e^G and k e^(G_last - G). With WHOLE (the whole-chunk path) gc holds cumulative gates from
    the chunk start; otherwise block-local ones, and the exponents are sums of block sums and of the
    activated gates ga (never differences of long sums). PREC as _prod's ("bf16" with X stored as
    bfloat16, X_BF16)."""
    i_s, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NSK + NSV, HF)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    NC: tl.constexpr = C // 16
    rs += i_p * 2 * C
    xs += i_p * C * C
    o_c = tl.arange(0, C)
    b_X = block_lower(xs, o_c, C)  # X is block lower triangular
    b_b = _beta(beta, bos, t0, T_seq, i_hv, o_c, HV, SIGMOID, BETA_SCALE)  # [C]
    if i_s < NSK:  # w = X (beta k e^G)
        o_d = i_s * BS + tl.arange(0, BS)
        b_k = _tile(k, bos, t0, T_seq, i_h, H, K, o_c, o_d) * tl.load(rs + C + o_c)[:, None]
        b_q = _tile(q, bos, t0, T_seq, i_h, H, K, o_c, o_d) * tl.load(rs + o_c)[:, None]
        if WHOLE:  # gc holds the cumulative gates from the chunk start
            b_G = _c(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
            b_e = tl.exp2(b_G)
            b_last = _c_last(gc, bos, t0, T_seq, i_hv, HV, K, C, o_d)  # G at the chunk end   [BS]
            b_dG = b_last[None, :] - b_G
            if ANY:  # plus the difference of the rounding errors (docs/math.md section 3)
                m_x = tl.full([], 1, tl.int1)
                if SPLIT:  # stored for the chunks with gok != 1 alone; masked loads (a branch: 0.41 -> 0.45 ms)
                    m_x = tl.load(gok + i_p) != 1
                b_dG += _lo_rows(gd, bos, t0, T_seq, i_hv, HV, K, tl.full([1], C - 1, tl.int32), o_d, m_x) - _lo_rows(
                    gd, bos, t0, T_seq, i_hv, HV, K, o_c, o_d, m_x)
            b_d = tl.exp2(b_dG)
        else:  # G: own block's cumulative gates + earlier blocks'; G_last - G: the rest of the block + later blocks'
            b_before, b_after = _blocks_around(gc, bos, t0, T_seq, i_hv, HV, K, NC, o_c, o_d)
            b_e = tl.exp2(_c(gc, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) + b_before)
            b_d = tl.exp2(_x(ga, bos, t0, T_seq, i_hv, HV, K, o_c, o_d) + b_after)
        _put(qg, b_q * b_e * scale, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
        _put(kd, b_k * b_d, bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
        _put(w, _prod(b_X, b_k * b_b[:, None] * b_e, PREC), bos, t0, T_seq, i_hv, HV, K, o_c, o_d)
    else:  # u = X (beta v); NSV = 0: the scan forms u itself (scan.U_IN_SCAN), u is None
        if NSV > 0:
            o_d = (i_s - NSK) * BS + tl.arange(0, BS)
            b_y = _tile(v, bos, t0, T_seq, i_hv, HV, V, o_c, o_d) * b_b[:, None]
            _put(u, _prod(b_X, b_y, PREC), bos, t0, T_seq, i_hv, HV, V, o_c, o_d)


class Prepared(NamedTuple):
    """What stage 1 leaves for the scan and for the backward: the tensors of the module docstring,
    its scratches (float32; xs bfloat16 in inference under X_BF16) and the chunk tables."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    Aqk: torch.Tensor
    gl: torch.Tensor
    gc: torch.Tensor  # cumulative gates, base 2 (block-local; from the chunk start in the whole-chunk path)
    ga: torch.Tensor | None  # activated gates, base 2 (None in the whole-chunk path)   [B, T, HV, K]
    ls: torch.Tensor  # Akk, lower blocks                              [NT, HV, C, C]
    xs: torch.Tensor  # X = (I + Diag(beta) Akk)^-1, lower blocks      [NT, HV, C, C] (float32; X_BF16)
    rs: torch.Tensor  # 1/|q|, 1/|k| of every row                      [NT, HV, 2, C]
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    NT_total: int
    gd: torch.Tensor | None = None  # unbounded gates, whole chunks: gc's rounding errors (float16) [B, T, HV, K]
    # (with split launches, 16-bit inputs, written only in the chunks whose gok != 1)
    gok: torch.Tensor | None = None  # and whether a chunk's diagonal blocks take the middle anchor [NT, HV]
    xh: torch.Tensor | None = None  # training, X_BF16_TRAIN: X in bfloat16 for the w/u kernel   [NT, HV, C, C]


def chunk_tables_of(opts, cu_seqlens, cu_host) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(chunk_indices, chunk_offsets, total chunks) of a call: the varlen tables (cached by the
    sequence lengths; with use_graph built on the device in fixed sizes), or None for a dense batch."""
    if opts.graph:  # cu_seqlens: common.graph_seqlens's boundaries
        return chunk_tables_static(cu_seqlens, opts.shape.N, opts.shape.T, opts.chunk_size)
    if cu_seqlens is not None:
        return chunk_tables(cu_host, opts.chunk_size, cu_seqlens.device)
    return None, None, opts.shape.B * cdiv(opts.shape.T, opts.chunk_size)


def _bf16_prec(dtype: torch.dtype) -> str:
    """_prod's precision for bfloat16 operands: "bf16", or its emulation under the interpreter."""
    return "bf16_emulated" if dot_config(dtype)[2] else "bf16"


def _chunk_prec(prec: str, dtype: torch.dtype) -> str:
    """The whole-chunk intra kernel's product precision (BF16_PRODUCTS) for inputs of ``dtype``."""
    if not (BF16_PRODUCTS and dtype == torch.bfloat16):
        return prec
    return _bf16_prec(dtype)


def split_launches(any_gate: bool, dtype: torch.dtype) -> tuple:
    """(ANY, SEL) of each launch of a whole-chunk intra or gate-gradient kernel: one launch, or with
    ANY_SPLIT for unbounded gates and 16-bit inputs a pair (float32 inputs keep the exact sums
    everywhere, their budget being below the 6e-5 of LO_SPAN)."""
    if any_gate and ANY_SPLIT and dtype != torch.float32:
        return ((False, 1), (True, 2))
    return ((any_gate, 0),)


def whole_gates(opts) -> bool:
    """Whether the whole-chunk path serves these gates: bounded ones (``safe_gate``) or, with
    WHOLE_ANY, any gate the kernels activate (non-positive by construction)."""
    return opts.safe_gate or (WHOLE_ANY and opts.gate != GateMode.PREGATED)


def whole_forward(opts, train: bool, whole_bwd: bool) -> bool:
    """Whether stage 1 takes the whole-chunk path: for the gates it serves (whole_gates), in
    inference, and in training when the backward takes it too (``whole_bwd``:
    bwd_chunk.whole_backward)."""
    return whole_gates(opts) and (not train or whole_bwd)


def fwd_prepare(opts, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_host, whole=False, train=False) -> Prepared:
    """Launch stage 1. ``whole`` (whole_forward) takes the whole-chunk path: ``gc`` then holds
    cumulative gates from the chunk start and ``ga`` is None (the backward's kernels follow);
    ``train`` as for ``fwd_intra``."""
    p = fwd_intra(opts, q, k, g, beta, A_log, dt_bias, cu_seqlens, cu_host, whole, train)
    return fwd_wu(opts, p, q, k, v, beta, cu_seqlens)


def _where(opts, p: Prepared, cu_seqlens) -> dict:
    return dict(cu_seqlens=cu_seqlens, chunk_indices=p.chunk_indices, T=opts.shape.T, HV=opts.shape.HV,
                C=opts.chunk_size, IS_VARLEN=cu_seqlens is not None, HF=HEADS_FIRST)


def _grid(parts: int, HV: int) -> tuple[int, ...]:
    """The grid of a stage-1 kernel, in the order HEADS_FIRST says (common.chunk_grid)."""
    return chunk_grid(parts, HV, HEADS_FIRST)


def fwd_intra(opts, q, k, g, beta, A_log, dt_bias, cu_seqlens, cu_host, whole, train) -> Prepared:
    """Stage 1 up to the inverse (gates, intra, inverse): a ``Prepared`` without w, u, qg, kd
    (None), which ``fwd_wu`` adds. What the training forward keeps for the backward (the part of
    stage 1 that is not cheap to recompute). For bfloat16 inputs X is bfloat16 in inference
    (X_BF16); with ``train`` float32 for the backward, plus a bfloat16 copy (``xh``) for the w/u
    kernel (X_BF16_TRAIN)."""
    s, C = opts.shape, opts.chunk_size
    B, T, H, HV, K = s.B, s.T, s.H, s.HV, s.K
    if whole and not opts.safe_gate and opts.gate == GateMode.PREGATED:
        raise ValueError("the whole-chunk path needs gates activated in the kernel (non-positive)")
    any_gate = whole and not opts.safe_gate  # unbounded gates on the whole-chunk path: exact sums
    chunk_indices, chunk_offsets, NT_total = chunk_tables_of(opts, cu_seqlens, cu_host)
    dev, dt = q.device, q.dtype
    Aqk = new_empty(B, T, HV, C, dtype=dt, device=dev)
    gl = new_empty(NT_total, HV, K, dtype=torch.float32, device=dev)
    gc = new_empty(B, T, HV, K, dtype=torch.float32, device=dev)  # cumulative gates (block-local unless whole)
    ga = None if whole else new_empty(B, T, HV, K, dtype=torch.float32, device=dev)  # activated gates
    ls = new_empty(NT_total, HV, C, C, dtype=torch.float32, device=dev)  # Akk, lower blocks
    x16 = X_BF16 and dt == torch.bfloat16
    xs = new_empty(NT_total, HV, C, C, dtype=torch.bfloat16 if x16 and not train else torch.float32, device=dev)
    xh = new_empty(NT_total, HV, C, C, dtype=torch.bfloat16, device=dev) if x16 and train and X_BF16_TRAIN else None
    rs = new_empty(NT_total, HV, 2, C, dtype=torch.float32, device=dev)  # 1/|q|, 1/|k| of every row
    gd = new_empty(B, T, HV, K, dtype=torch.float16, device=dev) if any_gate else None  # gc's rounding errors
    gok = new_empty(NT_total, HV, dtype=torch.int32, device=dev) if any_gate else None
    p = Prepared(None, None, None, None, Aqk, gl, gc, ga, ls, xs, rs, chunk_indices, chunk_offsets, NT_total, gd, gok,
                 xh)
    PREC = dot_config(dt)[1]  # products are float32: tensor-core tf32 for 16-bit inputs
    if NT_total > 0:
        BK = pow2(K)
        BS = min(SLICE, BK, pow2(s.V))
        NC = C // 16
        where = _where(opts, p, cu_seqlens)
        gate = gate_launch(opts, A_log, dt_bias)
        # gates, intra and inverse do not see V: their warps follow K alone (V = 2K under context
        # parallelism's fused identity run runs the binaries tuned and tested for V = K); the
        # slice width also stays within V's (16 columns for V <= 16)
        kda_fwd_gates_kernel[_grid(NT_total * (1 if whole else NC), HV)](  # whole: one program per chunk
            q, k, g, A_log, dt_bias, gc, ga, gd, gok, gl, rs, H=H, K=K, BK=BK,
            BS=min(GATES_SLICE_WHOLE if whole else GATES_SLICE, BS), L2NORM=opts.qk_l2norm, WHOLE=whole,
            ANY=any_gate, SPLIT=len(split_launches(any_gate, dt)) > 1, FAST=softplus_form(dt), **gate, **where,
            **launch_options(LAUNCH, "gates_whole" if whole else "gates", BK, BK))
        if whole:
            for any_sel, sel in split_launches(any_gate, dt):
                kda_fwd_intra_chunk_kernel[_grid(NT_total * 2, HV)](
                    q, k, gc, gd, gok, rs, Aqk, ls, scale=opts.scale, H=H, K=K, BK=BK, BS=min(CHUNK_SLICE, BK),
                    PREC=_chunk_prec(PREC, dt), ANY=any_sel, SEL=sel, L2NORM=opts.qk_l2norm, **where,
                    **launch_options(LAUNCH, "chunk", BK, BK))
        else:
            kda_fwd_intra_kernel[_grid(NT_total * NC, HV)](
                q, k, gc, ga, rs, Aqk, ls, scale=opts.scale, H=H, K=K, BK=BK, BS=BS, SAFE=opts.safe_gate, PREC=PREC,
                **where, **launch_options(LAUNCH, "intra", BK, BK))
        kda_fwd_inverse_kernel[_grid(NT_total, HV)](
            beta, gc, ls, xs, xh, gl, K=K, BK=BK, BS=BS, GL=not whole, SIGMOID=opts.beta_sigmoid,
            BETA_SCALE=opts.beta_scale, XH=xh is not None, **where, **launch_options(LAUNCH, "inverse", BK, BK))
    return p


def wu_operands(p: Prepared, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """(X, precision) of the products w = X (beta k e^G) and u = X (beta v) for inputs of ``dtype``:
    the bfloat16 X where there is one (X_BF16, X_BF16_TRAIN) with bfloat16 products, else the
    float32 X at the inputs' precision (the w/u kernel's, and the scan's when it forms u itself)."""
    xs = p.xs if p.xh is None else p.xh
    if xs.dtype != torch.float32:
        return xs, _bf16_prec(dtype)
    return xs, dot_config(dtype)[1]


def fwd_wu(opts, p: Prepared, q, k, v, beta, cu_seqlens, with_u: bool = True) -> Prepared:
    """The rest of stage 1 on the output of ``fwd_intra``: w, u, q e^G and k e^(G_last - G). Without
    ``with_u`` u is left to the scan (u None: scan.U_IN_SCAN)."""
    s = opts.shape
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    dev, dt = q.device, q.dtype
    w, qg, kd = (new_empty(B, T, HV, K, dtype=dt, device=dev) for _ in range(3))
    u = new_empty(B, T, HV, V, dtype=dt, device=dev) if with_u else None
    if p.NT_total > 0:
        BK, BV = pow2(K), pow2(V)
        xs, prec = wu_operands(p, dt)
        low = xs.dtype != torch.float32
        BS = min(WU_SLICE_X16 if low else WU_SLICE, BK, BV)
        NSK, NSV = cdiv(K, BS), cdiv(V, BS) if with_u else 0
        kda_fwd_wu_kernel[_grid(p.NT_total * (NSK + NSV), HV)](
            q, k, v, beta, p.gc, p.ga, p.gd, p.gok, p.rs, xs, w, u, qg, kd, scale=opts.scale, H=H, K=K, V=V, BS=BS,
            NSK=NSK, NSV=NSV, PREC=prec, WHOLE=p.ga is None,
            ANY=p.gd is not None, SPLIT=len(split_launches(p.gd is not None, dt)) > 1,
            SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale,
            **_where(opts, p, cu_seqlens), **launch_options(LAUNCH, "wu_x16" if low else "wu", BK, BV))
    return p._replace(w=w, u=u, qg=qg, kd=kd)
