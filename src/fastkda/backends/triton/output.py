"""Forward output, chunk-parallel: o = qg S + Aqk v' from the states the scan stored (used where
the scan is long and its programs few, so that o leaves the scan's serial loop); and the outputs of
segmented calls, o = o_ext[:, :V] + o_ext[:, V:] S_in (function.segmented_forward)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_location, chunk_program
from .tiles import as_operand, prod


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
    b_qg = as_operand(tl.load(qg + r_t * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0), DT, EMU)
    m_A = m_t[:, None] & (o_c[:, None] >= o_c[None, :])
    b_A = as_operand(tl.load(Aqk + r_t * C + o_c[None, :], mask=m_A, other=0.0), DT, EMU)
    m_h = (o_k < K)[:, None] & (o_v < V)[None, :]
    b_h = as_operand(tl.load(h + i_p * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0), DT, EMU)
    b_vn = as_operand(tl.load(vn + r_t * V + o_v[None, :], mask=m_tv, other=0.0), DT, EMU)
    b_o = prod(b_qg, b_h, PREC) + prod(b_A, b_vn, PREC)
    tl.store(o + r_t * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["T"])
def kda_fwd_segment_output_kernel(
    o_ext, s_in, o, cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, SEGMENTS: tl.constexpr, PREC: tl.constexpr,
):
    """o = o_ext[:, :V] + o_ext[:, V:] S_in for C tokens of one segment and BV value columns,
    rounded once to o's dtype: o_ext [T, HV, V + K] float32 holds the segments' outputs from their
    own initial states (first V columns) and those of their state maps from the identity, A^T scale
    q (K more); s_in [segments, HV, K, V] float32 each segment's true initial state beyond its own,
    0 for the first of each sequence's SEGMENTS (whose product is skipped)."""
    i_x, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_c, i_v = i_x // NV, i_x % NV
    i_s, i_t, bos, T_seq = chunk_location(i_c, cu_seqlens, chunk_indices, T, C, True)
    t0 = i_t * C
    if t0 >= T_seq:
        return
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = (t0 + o_c) < T_seq
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    r_t = (bos + t0 + o_c).to(tl.int64)[:, None] * HV + i_hv
    b_o = tl.load(o_ext + r_t * (V + K) + o_v[None, :], mask=m_tv, other=0.0)
    if i_s % SEGMENTS != 0:
        b_x = tl.load(o_ext + r_t * (V + K) + V + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
        m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
        b_s = tl.load(s_in + (i_s * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :], mask=m_s, other=0.0)
        b_o += prod(b_x, b_s, PREC)
    tl.store(o + r_t * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
