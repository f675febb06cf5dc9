"""Forward stage 1 on short chunks, in one kernel: chunks of C = 16 tokens, or of C = 32 made of two
16-token blocks, each program one chunk of one value head (the plan's short path, inference;
docs/kernels.md). From q, k, v, g, beta it writes what the state scan (scan.py, run with that C) reads:

    w   = X (beta k e^G)   [C, K]      u  = X (beta v) [C, V], or X itself [C, C] (float32)
    qg  = scale q e^G      [C, K]      kd = k e^(G_last - G)  [C, K]
    Aqk (j <= i, times scale) [C, C]   gl = e^(G_last)        [K] (float32)

with G the cumulative gates from the chunk start (base 2) and X = (I + Diag(beta) Akk)^-1. Each
16-token block is worked out on its own; a pair is then merged with block products whose decay
factors are at most 1 (docs/math.md section 3). Unbounded gates take the middle anchor of a block
where its factors stay within 2^SPAN, else the halves' anchors on gates clamped at -CLAMP (any gate:
a factor the clamp changes is below 2^-CLAMP, exact or not). The anchors' exponents are differences
of one cumulative sum that leaves out the gates of tokens 0 (in no factor) and 8 (added apart where it
belongs, to exponents of its own sign). bfloat16 inputs take the middle anchor on gates clamped at
-ANCHOR_CLAMP in every block instead: docs/math.md section 3.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...alloc import new_empty
from ...options import KDAInputs, KDAOptions
from .common import CompiledLaunch, activate_gate, chunk_grid, chunk_program, gate_launch
from .plan import ChunkPlan, ShortPlan
from .tiles import inv_unit_lower, load_beta, load_tile, prod, rnorm, row_of, store_tile

# unbounded gates: the middle anchor while every factor stays within 2^SPAN (float32 overflows at
# 2^128: the operands keep a margin of 2^32), else the halves' anchors on gates clamped at -CLAMP
# (base 2), whose factors stay within 2^(4 CLAMP) = 2^SPAN
SPAN = tl.constexpr(96.0)
CLAMP = tl.constexpr(24.0)


@triton.jit
def _next_rows(b_x, o_i):
    """Row i + 1 of a [16, BS] float32 tile at row i, 0 at row 15: a product with the shift matrix
    (one nonzero term per entry, exact)."""
    b_s = tl.where(o_i[None, :] == o_i[:, None] + 1, 1.0, 0.0)
    return tl.dot(b_s, b_x, input_precision="ieee")


@triton.jit
def _middle_anchor(b_q, b_k, b_r, b_ri, PREC: tl.constexpr):
    """(Aqk, Akk) [16, 16] unmasked, unscaled, from the row factors b_r = e^(G_i - G_8) and the column
    factors b_ri = e^(G_8 - G_j) [16, BK]."""
    b_c = tl.trans(b_k * b_ri)
    return prod(b_q * b_r, b_c, PREC), prod(b_k * b_r, b_c, PREC)


@triton.jit
def _halves(b_q, b_k, b_n, b_x, b_g8, o_i, PREC: tl.constexpr):
    """(Aqk, Akk) [16, 16] unmasked, unscaled, of a chunk anchored per half: pairs within a half from
    b_n = G - G_4 (rows 0-7) or G - G_12 (rows 8-15), pairs of a second-half row and a first-half
    column from e^(G_i - G_7) = e^(g_8 + b_x) and e^(G_7 - G_j) = e^(-b_x), b_x = J - J_7 (the
    exponents clamped at 0 off those pairs: finite, discarded)."""
    m_half = (o_i[:, None] // 8) == (o_i[None, :] // 8)
    b_Aw, b_Kw = _middle_anchor(b_q, b_k, tl.exp2(b_n), tl.exp2(-b_n), PREC)
    b_Ax, b_Kx = _middle_anchor(b_q, b_k, tl.exp2(tl.minimum(b_x + b_g8[None, :], 0.0)), tl.exp2(tl.minimum(-b_x, 0.0)),
                                PREC)
    return tl.where(m_half, b_Aw, b_Ax), tl.where(m_half, b_Kw, b_Kx)


@triton.jit
def _short_block(q, k, g, beta, A_log, dt_bias, bos, t0, T_seq, i_h, i_hv, scale, lower_bound, o_i, o_k, m_k,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                 HAS_BIAS: tl.constexpr, FAST: tl.constexpr, L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
                 BETA_SCALE: tl.constexpr, BOUNDED: tl.constexpr, ANCHOR_CLAMP: tl.constexpr, PREC: tl.constexpr,
                 INV_PREC: tl.constexpr):
    """One 16-token block at t0 (rows past T_seq: zero keys and gates): (Aqk scaled, lower with the
    diagonal [16, 16]; X [16, 16]; qg = scale q e^G, kd = k e^(G_15 - G), beta k e^G [16, BK];
    G_15 [BK]; beta [16]), G from the block start (kernel docstring)."""
    m_t = (t0 + o_i) < T_seq
    # activated gates, base 2, 0 on padding rows and columns   [16, BK]
    b_g = activate_gate(load_tile(g, bos, t0, T_seq, i_hv, HV, K, o_i, o_k), A_log, dt_bias, i_hv, o_k, m_k,
                        lower_bound, GATE, HAS_A, HAS_BIAS, K, FAST)
    b_g = tl.where(m_t[:, None] & m_k[None, :], b_g * 1.4426950408889634, 0.0)
    b_q = load_tile(q, bos, t0, T_seq, i_h, H, K, o_i, o_k)
    b_k = load_tile(k, bos, t0, T_seq, i_h, H, K, o_i, o_k)
    b_q *= rnorm(tl.sum(b_q * b_q, 1), L2NORM)[:, None]
    b_k *= rnorm(tl.sum(b_k * b_k, 1), L2NORM)[:, None]
    b_b = load_beta(beta, bos, t0, T_seq, i_hv, o_i, HV, SIGMOID, BETA_SCALE)  # [16]

    if BOUNDED:
        # |G| <= 16 * 7.22 (base 2): a difference of two float32 sums is off by about 1e-5 at most.
        # The anchor's factors lie within 2^58, e^(G_8) and e^(G_15 - G_8) at least 2^-65, and every
        # product at least 2^-116 (normal float32): e^G and e^(G_15 - G) are such products
        b_G = tl.cumsum(b_g, 0)  # G   [16, BK]
        b_G8 = row_of(b_G, o_i, 8)
        b_G15 = row_of(b_G, o_i, 15)
        b_r = tl.exp2(b_G - b_G8[None, :])
        b_ri = tl.exp2(b_G8[None, :] - b_G)
        b_Aqk, b_Akk = _middle_anchor(b_q, b_k, b_r, b_ri, PREC)
        b_e = b_r * tl.exp2(b_G8)[None, :]
        b_ed = b_ri * tl.exp2(b_G15 - b_G8)[None, :]  # e^(G_15 - G)
    elif ANCHOR_CLAMP > 0.0:
        # gates below -150 (base 2; -inf too) as -150: a factor spanning one is 0 in float32 either
        # way; NaN stays NaN. Where e^G or e^(G_15 - G) is not 0 the sums it comes from stay within
        # 300, their float32 rounding (about 1e-4 at most) below the bfloat16 outputs' own
        b_g = tl.where(b_g < -150.0, -150.0, b_g)
        # the middle anchor on gates clamped at -ANCHOR_CLAMP (<= SPAN / 8), whatever the gates: a pair
        # whose span holds a clamped gate has both its factor and the exact one below 2^-ANCHOR_CLAMP
        # (each term q_d k_d e^(G_i - G_j) off by at most 2^-ANCHOR_CLAMP |q_d k_d|)
        b_m = tl.cumsum(tl.maximum(b_g, -ANCHOR_CLAMP), 0)
        b_m -= row_of(b_m, o_i, 8)[None, :]
        b_Aqk, b_Akk = _middle_anchor(b_q, b_k, tl.exp2(b_m), tl.exp2(-b_m), PREC)
        b_G = tl.cumsum(b_g, 0)
        b_G15 = row_of(b_G, o_i, 15)
        b_e = tl.exp2(b_G)
        b_ed = tl.exp2(tl.cumsum(b_g, 0, reverse=True) - b_g)  # e^(G_15 - G)
    else:
        # gates below -2^14 (-inf too) as -2^14: every factor spanning one is 0 either way, and the
        # row shift, a product, meets no infinity (0 * inf); NaN stays NaN
        b_g = tl.where(b_g < -16384.0, -16384.0, b_g)
        # J: the gates 1..i but token 8's, summed. g_0 enters no factor (e^G's and e^(G_15)'s exponents
        # only), g_8 only exponents whose other terms share its sign: added, never cancelled
        b_g0 = row_of(b_g, o_i, 0)
        b_g8 = row_of(b_g, o_i, 8)
        b_J = tl.cumsum(tl.where(((o_i == 0) | (o_i == 8))[:, None], 0.0, b_g), 0)
        b_J15 = row_of(b_J, o_i, 15)
        m_lo = (o_i < 8)[:, None]
        b_g8lo = tl.where(m_lo, b_g8[None, :], 0.0)  # g_8 on the first half's rows
        b_g8hi = tl.where(m_lo, 0.0, b_g8[None, :])  # and on the second half's
        b_m = b_J - row_of(b_J, o_i, 8)[None, :] - b_g8lo  # G - G_8; a gate beyond SPAN shows on some row
        if tl.max(tl.abs(b_m)) <= SPAN:
            # |J| <= 2 SPAN: its differences are off by about 2e-5 at most
            b_Aqk, b_Akk = _middle_anchor(b_q, b_k, tl.exp2(b_m), tl.exp2(-b_m), PREC)
            b_ed = tl.exp2(b_J15[None, :] - b_J + b_g8lo)  # e^(G_15 - G)
        else:
            # each half anchored at its middle token, the second half's rows against the first half's
            # columns at token 7 (factors <= 1), on gates clamped at -CLAMP: a pair whose span holds a
            # clamped gate has both its factor and the exact one below 2^-CLAMP (an error of at most
            # 2^-CLAMP |q_d k_d|)
            b_gc = tl.maximum(b_g, -CLAMP)
            # clamped gates summed within each half: 1..i (i < 8), 9..i (i >= 8); at most 7 CLAMP
            b_Jc = tl.cumsum(tl.where(((o_i == 0) | (o_i == 8))[:, None], 0.0, b_gc), 0)
            b_Jc = tl.where(m_lo, b_Jc, tl.cumsum(tl.where(o_i[:, None] > 8, b_gc, 0.0), 0))
            b_n = b_Jc - tl.where(m_lo, row_of(b_Jc, o_i, 4)[None, :], row_of(b_Jc, o_i, 12)[None, :])  # G - G_4, G - G_12
            # rows >= 8: G - G_7 - g_8; columns < 8: G - G_7
            b_x = tl.where(m_lo, b_Jc - row_of(b_Jc, o_i, 7)[None, :], b_Jc)
            b_Aqk, b_Akk = _halves(b_q, b_k, b_n, b_x, row_of(b_gc, o_i, 8), o_i, PREC)
            b_gn = _next_rows(b_g, o_i)  # the next token's gates (0 on row 15)
            b_ed = tl.exp2(tl.cumsum(b_gn, 0, reverse=True))  # G_15 - G: the sum of the gates after each token
        b_e = tl.exp2(b_J + b_g0[None, :] + b_g8hi)
        b_G15 = b_J15 + b_g0 + b_g8
    if not BOUNDED:
        # Aqk's diagonal (factor 1) from float32 operands: where decays are strong it is the larger part
        # of Aqk, which the products' rounded operands would make as coarse as they are
        b_Aqk = tl.where(o_i[:, None] == o_i[None, :], tl.sum(b_q * b_k, 1)[:, None], b_Aqk)
    b_Aqk = tl.where(o_i[:, None] >= o_i[None, :], b_Aqk * scale, 0.0)
    b_X = inv_unit_lower(tl.where(o_i[:, None] > o_i[None, :], b_Akk * b_b[:, None], 0.0), o_i, INV_PREC)
    return b_Aqk, b_X, b_q * b_e * scale, b_k * b_ed, b_k * b_b[:, None] * b_e, b_G15, b_b


@triton.jit(do_not_specialize=["T"])
def kda_fwd_short_kernel(
    q, k, v, g, beta, A_log, dt_bias, w, u, xs, qg, kd, Aqk, gl, cu_seqlens, chunk_indices, scale, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
    L2NORM: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, BOUNDED: tl.constexpr, ANCHOR_CLAMP: tl.constexpr, PREC: tl.constexpr,
    INV_PREC: tl.constexpr, FORM_U: tl.constexpr,
):
    """One chunk of C = 16 tokens, or of C = 32 as two 16-token blocks merged, of one value head.
    Per block: Aqk and Akk from the middle anchor (token 8: factors e^(G_i - G_8) on rows,
    e^(G_8 - G_j) on columns), their exponents differences of cumulative gates: BOUNDED (gates >= -5
    nats) keeps every factor within 2^58. Unbounded gates: a block whose factors would pass 2^SPAN
    takes its halves' anchors (tokens 4 and 12, the second half's rows against the first half's
    columns at token 7 with factors <= 1) on gates clamped at -CLAMP, and e^(G_15 - G) from sums of
    the unclamped gates after each token. Unbounded gates below -2^14 (base 2; -inf too) count as
    -2^14, which changes no factor; a NaN gate reaches its feature's chunk decay, hence the state.
    ANCHOR_CLAMP > 0 (unbounded gates, bfloat16 inputs): every block takes the middle anchor on gates
    clamped at -ANCHOR_CLAMP. PREC: the Aqk, Akk, w and u products and the merge's; INV_PREC: the
    inverse's. FORM_U: X goes to xs (the scan forms u = X (beta v)), u is not written."""
    _, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, 1, HEADS_FIRST)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    i_h = i_hv // (HV // H)
    o_i = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    # the block before (none: kd 0, decay 1): with M = w kd_prev^T a block's rows take
    # w e^(G_prev) - M w_prev, u - M u_prev (X: -M X_prev left of X), qg e^(G_prev) and Aqk
    # [qg kd_prev^T, Aqk]; the block before's kd then takes this block's decay (docs/math.md 3)
    b_kdp = tl.zeros([16, BK], dtype=tl.float32)
    b_gp = tl.full([BK], 1.0, dtype=tl.float32)  # e^G of the chunk's blocks so far
    tl.static_assert(C == 16 or C == 32)
    # a loop, not unrolled (one block's tiles live at a time), never pipelined: a block reads back
    # what the block before stored
    for i_b in tl.range(0, C // 16, num_stages=1):
        t = t0 + 16 * i_b
        b_A, b_X, b_qg, b_kd, b_wk, b_G15, b_b = _short_block(
            q, k, g, beta, A_log, dt_bias, bos, t, T_seq, i_h, i_hv, scale, lower_bound, o_i, o_k, m_k, H, HV, K,
            GATE, HAS_A, HAS_BIAS, FAST, L2NORM, SIGMOID, BETA_SCALE, BOUNDED, ANCHOR_CLAMP, PREC, INV_PREC)
        b_gb = tl.exp2(b_G15)
        b_w = prod(b_X, b_wk, PREC)
        store_tile(Aqk, b_A, bos, t, T_seq, i_hv, HV, C, o_i, 16 * i_b + o_i)
        if C > 16:
            # the block before's w, X (or u) read back as stored (the products round them so anyway);
            # none before the first block (every row masked, the pointers kept in the chunk)
            t_p = tl.maximum(t - 16, t0)
            T_p = tl.where(i_b > 0, T_seq, 0)
            tl.debug_barrier()
            b_kdt = tl.trans(b_kdp)
            b_M = prod(b_w, b_kdt, PREC)  # [16, 16]
            store_tile(Aqk, prod(b_qg, b_kdt, PREC), bos, t, T_seq, i_hv, HV, C, o_i, 16 * (1 - i_b) + o_i)
            store_tile(kd, b_kdp * b_gb[None, :], bos, t_p, T_p, i_hv, HV, K, o_i, o_k)
            b_w = b_w * b_gp[None, :] - prod(b_M, load_tile(w, bos, t_p, T_p, i_hv, HV, K, o_i, o_k), PREC)
            b_qg *= b_gp[None, :]
        store_tile(qg, b_qg, bos, t, T_seq, i_hv, HV, K, o_i, o_k)
        store_tile(w, b_w, bos, t, T_seq, i_hv, HV, K, o_i, o_k)
        if FORM_U:
            p_x = xs + i_p * (C * C) + o_i[:, None] * C + o_i[None, :]
            tl.store(p_x + 16 * i_b * (C + 1), b_X)
            if C > 16:
                i_p16 = 16 * tl.maximum(i_b - 1, 0)
                m_p = (i_b > 0) & (o_i < 16)[:, None]
                b_Xp = tl.load(p_x + i_p16 * (C + 1), mask=m_p, other=0.0)
                tl.store(p_x + 16 * i_b * C + i_p16, -prod(b_M, b_Xp, PREC), mask=m_p)
        else:
            b_u = prod(b_X, load_tile(v, bos, t, T_seq, i_hv, HV, V, o_i, o_v) * b_b[:, None], PREC)
            if C > 16:
                b_u -= prod(b_M, load_tile(u, bos, t_p, T_p, i_hv, HV, V, o_i, o_v), PREC)
            store_tile(u, b_u, bos, t, T_seq, i_hv, HV, V, o_i, o_v)
        b_kdp = b_kd
        b_gp *= b_gb
    store_tile(kd, b_kdp, bos, t0 + C - 16, T_seq, i_hv, HV, K, o_i, o_k)
    tl.store(gl + i_p * K + o_k, b_gp, mask=m_k)


class ShortStage1(NamedTuple):
    """What the short path's stage 1 leaves for the scan (chunks of C = ShortPlan.chunk tokens)."""

    w: torch.Tensor  # [B, T, HV, K] input dtype
    u: torch.Tensor | None  # [B, T, HV, V] input dtype (None: the scan forms u from xs)
    xs: torch.Tensor | None  # X of every chunk [NT, HV, C, C] float32 (the scan forms u)
    qg: torch.Tensor  # [B, T, HV, K]
    kd: torch.Tensor  # [B, T, HV, K]
    Aqk: torch.Tensor  # [B, T, HV, C]
    gl: torch.Tensor  # chunk decays [NT, HV, K] float32
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    NT_total: int


def short_stage1_outputs(opts: KDAOptions, plan: ChunkPlan, NT: int, dtype: torch.dtype, device) -> tuple:
    """New tensors for stage 1's outputs (w, u, xs, qg, kd, Aqk, gl) of a call of ``NT`` chunks;
    u None where the scan forms it, xs None where it does not."""
    s, sp = opts.shape, plan.short
    B, T, HV, K, V, C = s.B, s.T, s.HV, s.K, s.V, sp.chunk
    w, qg, kd = (new_empty(B, T, HV, K, dtype=dtype, device=device) for _ in range(3))
    u = None if sp.form_u else new_empty(B, T, HV, V, dtype=dtype, device=device)
    xs = new_empty(NT, HV, C, C, dtype=torch.float32, device=device) if sp.form_u else None
    Aqk = new_empty(B, T, HV, C, dtype=dtype, device=device)
    gl = new_empty(NT, HV, K, dtype=torch.float32, device=device)
    return w, u, xs, qg, kd, Aqk, gl


def short_stage1(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs,
                 tables: tuple[torch.Tensor | None, torch.Tensor | None, int], outputs: tuple | None = None
                 ) -> ShortStage1:
    """Stage 1 of the short path; ``tables``: (chunk_indices, chunk_offsets, chunks) of its chunks;
    ``outputs``: contiguous tensors to write, as short_stage1_outputs makes them (default: new)."""
    sp = plan.short
    chunk_indices, chunk_offsets, NT = tables
    w, u, xs, qg, kd, Aqk, gl = outputs or short_stage1_outputs(opts, plan, NT, x.q.dtype, x.q.device)
    if NT > 0:
        run = short_launch(opts, sp, x.A_log is not None, x.dt_bias is not None, x.cu_seqlens is not None)
        run(chunk_grid(NT, opts.shape.HV, sp.heads_first), x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, w, u, xs,
            qg, kd, Aqk, gl, x.cu_seqlens, chunk_indices)
    return ShortStage1(w, u, xs, qg, kd, Aqk, gl, chunk_indices, chunk_offsets, NT)


@functools.lru_cache(maxsize=256)
def short_launch(opts: KDAOptions, sp: ShortPlan, has_a: bool, has_bias: bool, varlen: bool) -> CompiledLaunch:
    """The stage-1 kernel's launches of a call with these options and plan (the gate parameters and
    cu_seqlens given or not); cached: the parts of a call and repeated calls share them."""
    s = opts.shape
    return CompiledLaunch(kda_fwd_short_kernel, dict(
        scale=opts.scale, **gate_launch(opts, has_a, has_bias), T=s.T, H=s.H, HV=s.HV, K=s.K, V=s.V,
        BK=sp.BK, BV=sp.BV, C=sp.chunk, FAST=sp.softplus_form, L2NORM=opts.qk_l2norm, SIGMOID=opts.beta_sigmoid,
        BETA_SCALE=opts.beta_scale, IS_VARLEN=varlen, HEADS_FIRST=sp.heads_first, BOUNDED=sp.bounded,
        ANCHOR_CLAMP=sp.anchor_clamp or 0.0, PREC=sp.prec, INV_PREC=sp.inv_prec, FORM_U=sp.form_u,
        **sp.launch.kwargs()))
