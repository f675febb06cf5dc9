"""Forward stage 2: the chunk-to-chunk state recurrence and the output, state in registers.

One program per (sequence, value head, block of BV value columns) walks the chunks of its
sequence in order. The float32 state never leaves registers; per chunk:

    v' = u - w S          o = qg S + Aqk v'          S <- Diag(gl) S + kd^T v'

With STATE_T (``ScanPlan.state_t``) the program holds every [rows, BV] tile transposed: S^T
[BV, K], v'^T, u^T and o^T [BV, C], each product a @ x formed as x^T a^T (``lmul``), so that the
state is the register-held left operand of its products and the accumulator of its own update;
held [K, BV], it is their right operand, staged through shared memory at every step.

with u = X (beta v) read from stage 1 or, where the plan says (``ScanPlan.form_u``), formed here
from X, v and beta. States at chunk starts (``h``) and v' are written only when asked
(``return_intermediate_states``, the backward, or where o leaves the scan for the output kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...alloc import new_empty
from ...options import KDAInputs, KDAOptions
from .common import CompiledLaunch, launch, out_alloc, seq_grid, seq_program, sequence_location
from .output import kda_fwd_output_kernel
from .plan import ChunkPlan, ScanPlan, cdiv, pow2
from .tiles import (activate_beta, as_operand, block_lower, chunk_decay, chunk_operands, load_beta_raw, prod,
                    state_tile_ptrs)


@triton.jit
def lmul(a, x, STATE_T: tl.constexpr, PREC: tl.constexpr):
    """a @ x for a tile x held as it is or, with STATE_T, transposed (x^T in, (a @ x)^T out)."""
    if STATE_T:
        c = prod(x, tl.trans(a), PREC)
    else:
        c = prod(a, x, PREC)
    return c


@triton.jit
def as_rows(x, STATE_T: tl.constexpr):
    """x [R] along the rows of a tile held as it is ([R, 1]) or, with STATE_T, transposed ([1, R])."""
    if STATE_T:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def as_cols(x, STATE_T: tl.constexpr):
    """x [C] along the columns of a tile held as it is ([1, C]) or, with STATE_T, transposed ([C, 1])."""
    if STATE_T:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit(do_not_specialize=["T"])
def kda_fwd_scan_kernel(
    w, u, xs, v, beta, qg, kd, Aqk, gl, h0, ht, h, o, vn, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr, STORE_O: tl.constexpr,
    STORE_VN: tl.constexpr, V_FIRST: tl.constexpr, H_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, U_IN: tl.constexpr, U_PREC: tl.constexpr,
    SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, A_FULL: tl.constexpr, STATE_T: tl.constexpr,
):
    """U_IN (ScanPlan.form_u): u = X (beta v) of each chunk from X (xs, [chunks, HV, C, C], block
    lower) and v, beta, at precision U_PREC (tiles.prod's, as the w/u kernel's); otherwise u is read.
    STATE_T: the tiles held transposed (module docstring)."""
    i_v, i_nh = seq_program(V, BV)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_seq, c_off = sequence_location(i_n, cu_seqlens, chunk_offsets, T, C, IS_VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    i_k, i_kv = as_rows(o_k, STATE_T), as_cols(o_v, STATE_T)  # state tiles

    b_S = tl.zeros([BV, BK] if STATE_T else [BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h = state_tile_ptrs(h0 + i_nh * K * V, i_k, i_kv, K, V, V_FIRST)
        b_S += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)

    p_uv = (bos * HV + i_hv) * V + i_kv  # [C, BV] tiles of u, v, o, v' (transposed: [BV, C])
    # the chunk decay and beta (loads the pipeline of the product operands does not take) are read a
    # chunk ahead: waiting for them would stall every step for a global load's latency
    b_gln = chunk_decay(gl, c_off, 0, T_seq, i_hv, o_k, HV, K, C)
    if U_IN:
        b_bn = load_beta_raw(beta, bos, 0, T_seq, i_hv, o_c, HV)
    for i_t in range(0, tl.cdiv(T_seq, C)):
        o_t = i_t * C + o_c
        m_t = o_t < T_seq
        r_t = as_rows(o_t.to(tl.int64), STATE_T)
        m_t2 = as_rows(m_t, STATE_T)
        m_uv = m_t2 & as_cols(m_v, STATE_T)
        if STORE_H:
            p_h, m_h = state_tile_ptrs(h + ((c_off + i_t) * HV + i_hv) * K * V, i_k, i_kv, K, V, H_V_FIRST)
            tl.store(p_h, b_S.to(h.dtype.element_ty), mask=m_h)
        b_w, b_qg, b_kd, b_A = chunk_operands(w, qg, kd, Aqk, bos, i_hv, i_t, T_seq, o_k, HV, K, C, DT, EMU, A_FULL)
        b_gl = b_gln
        b_gln = chunk_decay(gl, c_off, i_t + 1, T_seq, i_hv, o_k, HV, K, C)
        if U_IN:  # independent of the state: the loads and the product overlap the chain of S
            b_X = block_lower(xs + ((c_off + i_t) * HV + i_hv) * C * C, o_c, C)  # [C, C]
            b_y = tl.load(v + p_uv + r_t * (HV * V), mask=m_uv, other=0.0).to(tl.float32)
            b_y *= as_rows(activate_beta(b_bn, i_t * C, T_seq, o_c, SIGMOID, BETA_SCALE), STATE_T)
            b_bn = load_beta_raw(beta, bos, (i_t + 1) * C, T_seq, i_hv, o_c, HV)
            b_u = tl.where(m_t2, lmul(b_X, b_y, STATE_T, U_PREC), 0.0)  # rows past the sequence 0
        else:
            b_u = tl.load(u + p_uv + r_t * (HV * V), mask=m_uv, other=0.0).to(tl.float32)

        b_Sd = as_operand(b_S, DT, EMU)
        b_vn = b_u - lmul(b_w, b_Sd, STATE_T, PREC)  # v' = u - w S
        b_vnd = as_operand(b_vn, DT, EMU)
        if STORE_VN:
            tl.store(vn + p_uv + r_t * (HV * V), b_vnd.to(vn.dtype.element_ty), mask=m_uv)
        if STORE_O:
            b_o = lmul(b_qg, b_Sd, STATE_T, PREC) + lmul(b_A, b_vnd, STATE_T, PREC)
            tl.store(o + p_uv + r_t * (HV * V), b_o.to(o.dtype.element_ty), mask=m_uv)
        b_S = b_S * as_rows(b_gl, STATE_T) + lmul(tl.trans(b_kd), b_vnd, STATE_T, PREC)

    if STORE_HT:
        p_ht, m_h = state_tile_ptrs(ht + i_nh * K * V, i_k, i_kv, K, V, V_FIRST)
        tl.store(p_ht, b_S, mask=m_h)


@functools.lru_cache(maxsize=256)
def scan_launch(opts: KDAOptions, scan: ScanPlan, dot, given: tuple[bool, ...]) -> CompiledLaunch:
    """The scan kernel's launches of a call with these options, scan plan and products (``dot``);
    ``given``: whether the initial state, final state, h, o, v' and cu_seqlens are passed. Cached:
    the parts of a call and repeated calls share them."""
    s = opts.shape
    h0, ht, h, o, vn, varlen = given
    return CompiledLaunch(kda_fwd_scan_kernel, dict(
        T=s.T, HV=s.HV, K=s.K, V=s.V, C=scan.chunk, BK=pow2(s.K), BV=scan.BV, USE_H0=h0, STORE_HT=ht, STORE_H=h,
        STORE_O=o, STORE_VN=vn, V_FIRST=opts.state_v_first, H_V_FIRST=scan.h_state_layout, IS_VARLEN=varlen,
        DT=dot.dtype, PREC=dot.prec, EMU=dot.emulate, U_IN=scan.form_u, U_PREC=scan.u_prec, SIGMOID=opts.beta_sigmoid,
        BETA_SCALE=opts.beta_scale, A_FULL=scan.a_full, STATE_T=scan.state_t, **scan.launch.kwargs()))


def fwd_scan(opts: KDAOptions, plan: ChunkPlan, scan: ScanPlan, w, u, xs, qg, kd, Aqk, gl, chunk_indices,
             chunk_offsets, NT_total: int, x: KDAInputs, o_dtype: torch.dtype | None = None, o_out=None, ht_out=None):
    """Launch stage 2 on stage 1's tensors. Returns (o, final_state, h, v'), each None unless asked
    for: ``scan.outputs`` gives o and the final state (if the options ask for it); ``scan.keep``
    gives what the backward needs, h in [K, V] order and v' (both in the input dtype); otherwise h
    only with ``return_intermediate_states`` (float32, in the state layout). With ``scan.form_u``
    (u None) the scan forms u from ``xs``, v and beta. ``o_dtype``: o's (default v's). ``o_out``,
    ``ht_out``: written instead of new tensors (o's and the final state's shapes, contiguous)."""
    s, C = opts.shape, scan.chunk
    B, T, HV, K, V, N = s.B, s.T, s.HV, s.K, s.V, s.N
    dev, dt = w.device, w.dtype
    if scan.form_u != (u is None):
        raise RuntimeError("fwd_scan: u must be None exactly where the scan forms it")
    if Aqk.shape[-1] != scan.chunk:
        raise RuntimeError(f"fwd_scan: stage 1 made chunks of {Aqk.shape[-1]} tokens, the scan steps {scan.chunk}")
    o = ht = None
    if scan.outputs:
        o = o_out if o_out is not None else out_alloc(opts)(B, T, HV, V, dtype=o_dtype or x.v.dtype, device=dev)
    if scan.outputs and opts.output_final_state:
        ht = ht_out if ht_out is not None else new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev)
    h = vn = None
    if scan.keep or scan.split_output:  # in the input dtype: the products that read them take it anyway
        h = new_empty(NT_total, HV, K, V, dtype=dt, device=dev)
        vn = new_empty(B, T, HV, V, dtype=dt, device=dev)
    elif opts.return_intermediate_states:
        lead = (1, NT_total) if x.cu_seqlens is not None else (B, cdiv(T, C))
        # use_graph: zero past the chunks
        h = out_alloc(opts)(*lead, HV, *opts.state_shape, dtype=torch.float32, device=dev)
    o_scan = None if scan.split_output else o
    BK, dot = pow2(K), plan.dot
    if N * HV > 0:
        given = tuple(t is not None for t in (x.initial_state, ht, h, o_scan, vn, x.cu_seqlens))
        scan_launch(opts, scan, dot, given)(
            seq_grid(V, scan.BV, N * HV), w, u, xs if scan.form_u else None, x.v if scan.form_u else None,
            x.beta if scan.form_u else None, qg, kd, Aqk, gl, x.initial_state, ht, h, o_scan, vn, x.cu_seqlens,
            chunk_offsets)
    if scan.split_output:
        if NT_total > 0:
            NV = cdiv(V, scan.output_bv)
            launch(kda_fwd_output_kernel, (NT_total * NV, HV),
                   qg, Aqk, h, vn, o, x.cu_seqlens, chunk_indices, T, HV=HV, K=K, V=V, C=C, BK=BK, BV=scan.output_bv,
                   NV=NV, IS_VARLEN=x.cu_seqlens is not None, DT=dot.dtype, PREC=dot.prec, EMU=dot.emulate,
                   **scan.output.kwargs())
        h = vn = None
    return o, ht, h, vn
