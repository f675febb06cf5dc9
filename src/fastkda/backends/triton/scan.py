"""Forward stage 2: the chunk-to-chunk state recurrence and the output, state in registers.

One program per (sequence, value head, block of BV value columns) walks the chunks of its
sequence in order. The float32 state [K, BV] never leaves registers; per chunk:

    v' = u - w S          o = qg S + Aqk v'          S <- Diag(gl) S + kd^T v'

with u = X (beta v) read from stage 1 or, where the programs crowd the SMs (U_IN_SCAN), formed
here from X, v and beta.

States at chunk starts (``h``) and v' are written only when asked (``return_intermediate_states``,
and the backward, which also skips ``o``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import platform
from ...testing import new_empty
from .common import (block_lower, cdiv, chunk_program, mma, out_alloc, pow2, scan_stages, scan_warps, seq_grid,
                     seq_program, sequence_location)
from .prepare import _beta, _prod, wu_operands

# launch configuration (module-level so that benchmarks can compare variants)
# o leaves the scan for a chunk-parallel kernel (kda_fwd_output_kernel) when the scan is long and
# narrow: at least SPLIT_MIN_CHUNKS chunks per sequence on average and at most SPLIT_MAX_PROGRAMS
# scan programs, fewer than half the SMs of an H200 (B1 T32768 H16: 32 programs, 3.22 -> 2.82 ms;
# B1 T8192 H64, 128 programs: 2.09 -> 2.17 ms, not split; other shapes not measured). None: never.
SPLIT_MIN_CHUNKS = 64
SPLIT_MAX_PROGRAMS = 64
OUT_BV = 64
# value columns per scan program: SCAN_BV, or SCAN_BV_NARROW when programs that wide would number
# at most half the SMs (each program is one chain of dependent products: narrower programs shorten
# each link and fill more SMs). H200, B1 T32768 H16 (32 programs at 64): scan 1.03 -> 0.64 ms at
# 32; B1 T8192 H64 (128 programs): 0.42 ms at 64, 0.60 at 32; between the two not measured
SCAN_BV = 64
SCAN_BV_NARROW = 32
SCAN_BV_WIDE_KEYS = 64  # keys wider than 128, whatever the program count (_scan_bv)
SCAN_WARPS = 4  # 8 for programs wider than 128 x 64 (keys beyond 128, or SCAN_BV_CROWDED)
# value columns per program where SCAN_BV-wide programs would outnumber the SMs (None: SCAN_BV):
# fewer, wider programs, each reading its chunk's w, qg, kd and Aqk once for more value columns.
# Off: 128 columns on 8 warps at 2 stages made the inference forward slower on an H200 (same run
# against the previous table's one-stage 64-column programs: B1 T8192 H96 2.696 -> 2.734 ms,
# varlen H96 2.601 -> 2.673, B2 T8192 H64 3.318 -> 3.441; BENCHMARKS.md)
SCAN_BV_CROWDED = None
# pipeline stages of the chunk loop for K <= 128 and 16-bit inputs (float32 inputs: at most 2; wider
# keys run unpipelined on 8 warps, for shared memory): B1 T8192 H64 on the H200, the two calls of
# one training step 0.787 -> 0.749 ms at 3 stages instead of 2 (BENCHMARKS.md)
SCAN_STAGES = 3
# and SCAN_STAGES_CROWDED stages where the programs outnumber the SMs: one stage's shared memory lets
# two programs share an SM, so one wave holds them all (H200, scan alone: B1 T8192 H96, 192
# programs, 0.798 -> 0.672 ms; H128, 256 programs, 0.814 -> 0.654; H64, 128 programs, keeps 3: 0.42
# against 0.48 at one stage; 2 stages: 0.875, 0.909, 0.454). _scan_bv never crowds 32-column programs
# (SCAN_BV_NARROW only where 64-column ones fill at most half the SMs): forced, 32 columns at one stage
# (B1 T8192 H96, 384 programs) faulted on the H200 (illegal memory access, Triton 3.6; cause not found)
SCAN_STAGES_CROWDED = 1
# the scan forms u = X (beta v) of each chunk itself, from X and v (the w/u kernel then writes w,
# qg and kd alone, and u never goes through memory): "crowded", where the scan's programs outnumber
# the SMs (two programs share an SM at one stage, and the extra loads and product, independent of
# the state, fill the other's waits); True everywhere, False nowhere. Never where u is kept for the
# backward (its recomputation). H200, inference forward, one run (bfloat16, U_IN_SCAN off -> on):
# B1 T8192 H96 2.653 -> 2.608 ms (w/u kernel 0.516 -> 0.397), varlen H96 ~2.60 -> 2.537, B2 T8192
# H64 3.268 -> 3.227, training step at H96 11.816 -> 11.800; but with one program per SM, B1
# T8192 H64: 1.745 -> 1.775 (scan 0.419 -> 0.522, w/u 0.338 -> 0.266), B1 T32768 H16 2.156 -> 2.615
U_IN_SCAN = "crowded"


def u_in_scan(opts, p, keep: bool, dtype: torch.dtype) -> bool:
    """Whether the scan forms u itself (U_IN_SCAN) for inputs of ``dtype`` and the X of stage 1's
    ``p`` (prepare.wu_operands): not where u is kept for the backward (``keep``), nor for 16-bit inputs
    with float32 X (float16 inputs; bfloat16 ones with X_BF16 or X_BF16_TRAIN off): that u product,
    tf32 from float32 X beside the scan's 16-bit products, faulted on the H200 for float16 inputs
    with the option forced on (illegal memory access, Triton 3.6, B2 T1600 H4 K=V=128); bfloat16
    inputs with bfloat16 X and float32 inputs ran right."""
    if keep or not U_IN_SCAN or (dtype != torch.float32 and wu_operands(p, dtype)[0].dtype == torch.float32):
        return False
    if U_IN_SCAN == "crowded":
        dev = p.xs.device
        return _programs(opts, _scan_bv(opts, dev)) > platform.sm_count(dev)
    return True


@triton.jit
def _state_ptrs(base, o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Pointers and mask of a [BK, BV] state tile stored [K, V] or, with V_FIRST, [V, K]."""
    m = (o_k < K)[:, None] & (o_v < V)[None, :]
    if V_FIRST:
        return base + o_v[None, :] * K + o_k[:, None], m
    return base + o_k[:, None] * V + o_v[None, :], m


@triton.jit
def chunk_operands(w, qg, kd, Aqk, gl, bos, i_hv, c_off, i_t, T_seq, o_k, HV: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
    """Chunk i_t's w, qg, kd [C, BK] and Aqk [C, C] (lower triangle) as product operands, gl [BK]."""
    o_c = tl.arange(0, C)
    o_t = i_t * C + o_c
    m_t = o_t < T_seq
    r_t = (bos + o_t).to(tl.int64)[:, None] * HV + i_hv
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_w = mma(tl.load(w + r_t * K + o_k[None, :], mask=m_tk, other=0.0), DT, EMU)  # w, qg, kd: [B, T, HV, K]
    b_qg = mma(tl.load(qg + r_t * K + o_k[None, :], mask=m_tk, other=0.0), DT, EMU)
    b_kd = mma(tl.load(kd + r_t * K + o_k[None, :], mask=m_tk, other=0.0), DT, EMU)
    m_A = m_t[:, None] & (o_c[:, None] >= o_c[None, :])
    b_A = mma(tl.load(Aqk + r_t * C + o_c[None, :], mask=m_A, other=0.0), DT, EMU)
    b_gl = tl.load(gl + ((c_off + i_t) * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)
    return b_w, b_qg, b_kd, b_A, b_gl


@triton.jit(do_not_specialize=["T"])
def kda_fwd_scan_kernel(
    w, u, xs, v, beta, qg, kd, Aqk, gl, h0, ht, h, o, vn, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr, STORE_O: tl.constexpr,
    STORE_VN: tl.constexpr, V_FIRST: tl.constexpr, H_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, U_IN: tl.constexpr, UPREC: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
):
    """U_IN (U_IN_SCAN): u = X (beta v) of each chunk from X (xs, [chunks, HV, C, C], block lower)
    and v, beta, at precision UPREC (prepare._prod's, as the w/u kernel's); otherwise u is read."""
    i_v, i_nh = seq_program(V, BV)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_seq, c_off = sequence_location(i_n, cu_seqlens, chunk_offsets, T, C, IS_VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h = _state_ptrs(h0 + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        b_S += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)

    p_uv = (bos * HV + i_hv) * V + o_v[None, :]
    for i_t in range(0, tl.cdiv(T_seq, C)):
        o_t = i_t * C + o_c
        m_t = o_t < T_seq
        r_t = o_t.to(tl.int64)[:, None]
        if STORE_H:
            p_h, m_h = _state_ptrs(h + ((c_off + i_t) * HV + i_hv) * K * V, o_k, o_v, K, V, H_V_FIRST)
            tl.store(p_h, b_S.to(h.dtype.element_ty), mask=m_h)
        b_w, b_qg, b_kd, b_A, b_gl = chunk_operands(w, qg, kd, Aqk, gl, bos, i_hv, c_off, i_t, T_seq, o_k, HV, K, C, DT, EMU)
        if U_IN:  # independent of the state: the loads and the product overlap the chain of S
            b_X = block_lower(xs + ((c_off + i_t) * HV + i_hv) * C * C, o_c, C)  # [C, C]
            b_y = tl.load(v + p_uv + r_t * (HV * V), mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            b_y *= _beta(beta, bos, i_t * C, T_seq, i_hv, o_c, HV, SIGMOID, BETA_SCALE)[:, None]
            b_u = tl.where(m_t[:, None], _prod(b_X, b_y, UPREC), 0.0)  # [C, BV]; rows past the sequence 0
        else:
            b_u = tl.load(u + p_uv + r_t * (HV * V), mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)

        b_Sd = mma(b_S, DT, EMU)
        b_vn = b_u - tl.dot(b_w, b_Sd, input_precision=PREC)  # v' = u - w S   [C, BV]
        b_vnd = mma(b_vn, DT, EMU)
        if STORE_VN:
            tl.store(vn + p_uv + r_t * (HV * V), b_vnd.to(vn.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        if STORE_O:
            b_o = tl.dot(b_qg, b_Sd, input_precision=PREC) + tl.dot(b_A, b_vnd, input_precision=PREC)
            tl.store(o + p_uv + r_t * (HV * V), b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_S = b_S * b_gl[:, None] + tl.dot(tl.trans(b_kd), b_vnd, input_precision=PREC)

    if STORE_HT:
        p_ht, m_h = _state_ptrs(ht + i_nh * K * V, o_k, o_v, K, V, V_FIRST)
        tl.store(p_ht, b_S, mask=m_h)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_output_kernel(
    qg, Aqk, h, vn, o, cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):
    """o = qg S + Aqk v' of one chunk and BV value columns, chunk-parallel, from the state entering
    the chunk (h [chunks, HV, K, V], written by the scan) and v'."""
    i_v, i_hv, i_p, bos, T_seq, t0 = chunk_program(cu_seqlens, chunk_indices, T, HV, C, IS_VARLEN, NV, False)
    if t0 >= T_seq:  # a slot past the real chunks (use_graph's fixed-size tables)
        return
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = (t0 + o_c) < T_seq
    r_t = (bos + t0 + o_c).to(tl.int64)[:, None] * HV + i_hv
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_qg = mma(tl.load(qg + r_t * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0), DT, EMU)
    b_A = mma(tl.load(Aqk + r_t * C + o_c[None, :], mask=m_t[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0),
              DT, EMU)
    b_h = mma(tl.load(h + i_p * K * V + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & (o_v < V)[None, :],
                      other=0.0), DT, EMU)
    b_vn = mma(tl.load(vn + r_t * V + o_v[None, :], mask=m_tv, other=0.0), DT, EMU)
    b_o = tl.dot(b_qg, b_h, input_precision=PREC) + tl.dot(b_A, b_vn, input_precision=PREC)
    tl.store(o + r_t * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def _programs(opts, BV: int) -> int:
    """Scan programs of a launch BV value columns wide: value-column blocks x sequences x value heads."""
    s = opts.shape
    return cdiv(s.V, BV) * s.N * s.HV


def _scan_bv(opts, dev: torch.device) -> int:
    """Value columns per scan program (SCAN_BV_NARROW while SCAN_BV would leave half the SMs idle).
    Keys wider than 128 take SCAN_BV_WIDE_KEYS: at K = 256 with 16-bit inputs (8 warps, one stage), 32
    columns per program over more than one program per head gave wrong states on an H200 (Triton
    3.6; 16 and 64 columns right, float32 right at all three)."""
    s = opts.shape
    if s.K > 128:
        bv = SCAN_BV_WIDE_KEYS
    elif _programs(opts, SCAN_BV) <= platform.sm_count(dev) // 2:
        bv = SCAN_BV_NARROW
    elif SCAN_BV_CROWDED and _programs(opts, SCAN_BV) > platform.sm_count(dev):
        bv = SCAN_BV_CROWDED
    else:
        bv = SCAN_BV
    return min(pow2(s.V), bv)


def _scan_stages(opts, BV: int, BK: int, x: torch.Tensor, dev: torch.device) -> int:
    """Pipeline stages of the forward scan's chunk loop (SCAN_STAGES_CROWDED beyond one program per SM)."""
    crowded = _programs(opts, BV) > platform.sm_count(dev)
    return scan_stages(SCAN_STAGES_CROWDED if crowded else SCAN_STAGES, BK, BV, x)


def _split(opts, NT_total: int) -> bool:
    """Whether o leaves the scan: long sequences (chunks per sequence, on average), where the
    scan's chunk-after-chunk loop dominates, and few programs (counted SCAN_BV columns wide)."""
    s = opts.shape
    if SPLIT_MIN_CHUNKS is None or opts.return_intermediate_states or s.N == 0:
        return False
    return NT_total >= SPLIT_MIN_CHUNKS * s.N and _programs(opts, SCAN_BV) <= SPLIT_MAX_PROGRAMS


def fwd_scan(opts, p, h0, cu_seqlens, v_dtype, DT, PREC, EMU, outputs=True, keep=False, v=None, beta=None):
    """Launch stage 2 on the output ``p`` of stage 1. Returns (o, final_state, h, v'), each None
    unless asked for: ``outputs`` gives o and the final state (if the options ask for it);
    ``keep`` gives what the backward needs, h in [K, V] order and v' (both in the input dtype);
    otherwise h only with ``return_intermediate_states`` (float32, in the state layout). Where
    stage 1 left u out (``p.u`` None, u_in_scan), the scan forms it from ``v`` and ``beta``."""
    s, C = opts.shape, opts.chunk_size
    B, T, HV, K, V, N = s.B, s.T, s.HV, s.K, s.V, s.N
    dev = p.w.device
    u_in = p.u is None
    if u_in and (v is None or beta is None):
        raise ValueError("fwd_scan: stage 1 left u out (p.u is None), so v and beta must be given")
    xs, uprec = wu_operands(p, p.w.dtype) if u_in else (None, PREC)
    o = out_alloc(opts)(B, T, HV, V, dtype=v_dtype, device=dev) if outputs else None
    ht = None
    if outputs and opts.output_final_state:
        ht = new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev)
    h = vn = None
    if keep:  # in the input dtype: the products that read them take that precision anyway
        h = new_empty(p.NT_total, HV, K, V, dtype=p.w.dtype, device=dev)
        vn = new_empty(B, T, HV, V, dtype=p.w.dtype, device=dev)
    elif opts.return_intermediate_states:
        lead = (1, p.NT_total) if cu_seqlens is not None else (B, cdiv(T, C))
        h = out_alloc(opts)(*lead, HV, *opts.state_shape, dtype=torch.float32, device=dev)  # use_graph: zero past the chunks
    BK = pow2(K)
    BV = _scan_bv(opts, dev)
    split = outputs and not keep and _split(opts, p.NT_total)
    o_scan = o
    if split:  # the scan writes h and v' (input dtype), the output kernel o
        h = new_empty(p.NT_total, HV, K, V, dtype=p.w.dtype, device=dev)
        vn = new_empty(B, T, HV, V, dtype=p.w.dtype, device=dev)
        o_scan = None
    if N * HV > 0:
        kda_fwd_scan_kernel[seq_grid(V, BV, N * HV)](
            p.w, p.u, xs, v if u_in else None, beta if u_in else None, p.qg, p.kd, p.Aqk, p.gl, h0, ht, h, o_scan,
            vn, cu_seqlens, p.chunk_offsets, T,
            HV=HV, K=K, V=V, C=C, BK=BK, BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None,
            STORE_H=h is not None, STORE_O=o_scan is not None, STORE_VN=vn is not None, V_FIRST=opts.state_v_first,
            H_V_FIRST=opts.state_v_first and not (keep or split), IS_VARLEN=cu_seqlens is not None, DT=DT, PREC=PREC,
            EMU=EMU, U_IN=u_in, UPREC=uprec, SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale,
            num_warps=scan_warps(SCAN_WARPS, BK, BV), num_stages=_scan_stages(opts, BV, BK, p.w, dev),
        )
    if split and p.NT_total > 0:
        BVO = min(pow2(V), OUT_BV)
        kda_fwd_output_kernel[(p.NT_total * cdiv(V, BVO), HV)](
            p.qg, p.Aqk, h, vn, o, cu_seqlens, p.chunk_indices, T, HV=HV, K=K, V=V, C=C, BK=BK, BV=BVO,
            NV=cdiv(V, BVO), IS_VARLEN=cu_seqlens is not None, DT=DT, PREC=PREC, EMU=EMU, num_warps=4)
        h = vn = None
    return o, ht, h, vn
