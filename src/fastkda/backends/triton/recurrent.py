"""Decoding: token-by-token KDA on state pools, without host synchronisation.

Two launches. ``kda_check_indices_kernel`` validates every pool index (slots in [-1, num_slots),
accepted-token counts in [1, 1 + num_draft], tokens per sequence <= 1 + num_draft) and writes an
error code; ``kda_recurrent_kernel`` reads that code with the slot of its sequence and, if it is
set, treats every sequence as padding (reads and writes no slot), so a call with one bad index
changes nothing at all. The wrapper raises on the code when the stream is
not being captured into a CUDA graph (unless ``raise_on_bad_index=False``: then no call
synchronises); ``fastkda.decode_error()`` reads the first error of the calls that did not raise
(graph replays, or calls with ``raise_on_bad_index=False``).

One program per (value block of BV columns, sequence, value head); the float32 state tile
[BK, BV] lives in registers for all tokens of the sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import platform
from ...testing import new_empty
from .common import activate_gate, cdiv, contiguous, contiguous_inputs, gate_launch, pow2, seq_grid, seq_program

# value columns and warps per program: many one-warp programs keep the most state loads in
# flight (H200, N=256 H=32 K=V=128, CUDA graph: BV=16/1 warp 0.356 ms, 32/1 0.373, 32/4 0.404)
REC_BV = 16  # for K <= 128
REC_WARPS = 1
REC_WIDE = (32, 4)  # (BV, warps) for K > 128: BV=16 at 1 warp spills 1.3 KB there (sm_90), this does not
CHECK_BN = 256  # sequences per step of the index check

# error codes: 0 ok; otherwise kind + 4 * (sequence index)
ERR_SLOT, ERR_ACCEPTED, ERR_TOKENS = 1, 2, 3
# the same codes as kernel constants (a kernel reads only globals that are tl.constexpr)
_ERR_SLOT, _ERR_ACCEPTED, _ERR_TOKENS = tl.constexpr(ERR_SLOT), tl.constexpr(ERR_ACCEPTED), tl.constexpr(ERR_TOKENS)


@triton.jit
def kda_check_indices_kernel(idx, acc, cu_seqlens, err, N, T, num_slots, stride_idx, COLS: tl.constexpr,
                             BC: tl.constexpr, BN: tl.constexpr, SPEC: tl.constexpr, IS_VARLEN: tl.constexpr,
                             KEEP: tl.constexpr):
    """err[0] <- 0, or the error of the first sequence that has one: kind + 4 * sequence. BN
    sequences at a time. With KEEP (a call that will not raise) the error also goes to err[1],
    the first error of the calls that did not raise, unless that holds one already (decode_error()
    clears it)."""
    NONE: tl.constexpr = 2**31 - 1
    o_c = tl.arange(0, BC)
    b_first = tl.full([BN], NONE, tl.int32)
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        if IS_VARLEN:
            L = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0) - tl.load(cu_seqlens + o_n, mask=m_n, other=0)
        else:
            L = T
        b_idx = tl.load(idx + o_n.to(tl.int64)[:, None] * stride_idx + o_c[None, :],
                        mask=m_n[:, None] & (o_c < COLS)[None, :], other=0).to(tl.int64)
        bad_slot = tl.sum(((b_idx < -1) | (b_idx >= num_slots)).to(tl.int32), 1) > 0
        this = tl.where(bad_slot, _ERR_SLOT, 0)
        if SPEC:
            a = tl.load(acc + o_n, mask=m_n, other=1).to(tl.int64)
            this = tl.where((a < 1) | (a > COLS), _ERR_ACCEPTED, this)
            this = tl.where(L > COLS, _ERR_TOKENS, this)
        b_first = tl.minimum(b_first, tl.where(m_n & (this != 0), this + 4 * o_n, NONE))
    b_code = tl.min(b_first, 0)
    b_code = tl.where(b_code == NONE, 0, b_code)
    tl.store(err + tl.arange(0, 1), b_code + tl.zeros([1], tl.int32))
    if KEEP:
        b_kept = tl.load(err + 1 + tl.arange(0, 1))
        tl.store(err + 1 + tl.arange(0, 1), tl.where(b_kept == 0, b_code, b_kept))


@triton.jit(do_not_specialize=["T", "num_slots"])
def kda_recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, idx, acc, err,
    scale, lower_bound, T, num_slots, stride_idx, COLS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
    BETA_SCALE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, POOL: tl.constexpr, SPEC: tl.constexpr,
    INPLACE: tl.constexpr, V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = seq_program(V, BV)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
        T_seq = T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    if V_FIRST:  # [V, K] layout in memory, [BK, BV] tile in registers
        o_h = o_v[None, :] * K + o_k[:, None]
    else:
        o_h = o_k[:, None] * V + o_v[None, :]

    slot0 = i_n
    if POOL:
        # the error code and the slot are read together; with a bad index anywhere (code != 0) the
        # sequence counts as padding: nothing is read from or written to the pool
        ok = tl.load(err) == 0
        if SPEC:
            a = tl.minimum(tl.maximum(tl.load(acc + i_n).to(tl.int64), 1), COLS)  # in the row even when bad
            slot0 = tl.load(idx + i_n * stride_idx + a - 1).to(tl.int64)
        else:
            slot0 = tl.load(idx + i_n * stride_idx).to(tl.int64)
        live = ok & (slot0 >= 0)  # -1: a padding sequence
    else:
        live = slot0 >= 0
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + (slot0 * HV + i_hv) * K * V + o_h, mask=m_h & live, other=0.0).to(tl.float32)

    p_o = o + (bos * HV + i_hv) * V + o_v
    for t in range(0, T_seq):
        r = bos + t
        b_q = tl.load(q + (r * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (r * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (r * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + (r * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(beta + r * HV + i_hv).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        if SIGMOID:
            b_b = tl.sigmoid(b_b) * BETA_SCALE
        b_g = activate_gate(b_g[None, :], A_log, dt_bias, i_hv, o_k, m_k, lower_bound, GATE, HAS_A, HAS_BIAS, K, 0)
        b_g = tl.sum(b_g, 0)  # back to [BK]
        b_S = b_S * tl.exp(tl.where(m_k, b_g, 0.0))[:, None]
        b_u = b_b * (b_v - tl.sum(b_S * b_k[:, None], 0))  # the delta: beta (v - S^T k)
        b_S += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_S * (b_q * scale)[:, None], 0)
        tl.store(p_o + t * HV * V, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
        if SPEC:
            if INPLACE:
                slot_t = tl.load(idx + i_n * stride_idx + t, mask=live, other=-1).to(tl.int64)
                if live & (slot_t >= 0):
                    tl.store(h0 + (slot_t * HV + i_hv) * K * V + o_h, b_S.to(h0.dtype.element_ty), mask=m_h)

    if INPLACE and not SPEC:
        if live:
            tl.store(h0 + (slot0 * HV + i_hv) * K * V + o_h, b_S.to(h0.dtype.element_ty), mask=m_h)
    if STORE_HT:
        tl.store(ht + i_nh * K * V + o_h, tl.where(live, b_S, 0.0), mask=m_h)


_ERR_BUFFERS: dict = {}


def error_buffer(device) -> torch.Tensor:
    """The per-device int32 error codes (static, so graphs can capture them): [0] of the last pool
    decode call, [1] the first of the calls that did not raise, until decode_error() reads it.
    "cuda" means the current CUDA device."""
    device = platform.resolve_device(device)
    key = str(device)
    if key not in _ERR_BUFFERS:
        _ERR_BUFFERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return _ERR_BUFFERS[key]


def describe_error(code: int, num_slots: int | None = None, cols: int | None = None, idx=None, acc=None) -> str:
    """The message of an error code (the pool size and columns, when known, name the bounds; the
    index tensors, when given, the values: read back from the device, on the error path only)."""
    kind, n = code % 4, code // 4
    if kind == ERR_SLOT:
        pool = f"[0, {num_slots})" if num_slots is not None else "the pool"
        got = f": {idx[n].tolist()}" if idx is not None else ""
        return f"`ssm_state_indices` of sequence {n} holds a slot outside {pool} other than -1 (padding){got}"
    cols_ = cols if cols is not None else "1 + num_draft"
    if kind == ERR_ACCEPTED:
        got = f", got {int(acc[n])}" if acc is not None else ""
        return f"`num_accepted_tokens[{n}]` must be in [1, {cols_}]{got}"
    return f"sequence {n} has more tokens than the {cols_} slots per sequence of `ssm_state_indices`"


def recurrent_forward(opts, x):
    s = opts.shape
    B, T, H, HV, K, V, N = s.B, s.T, s.H, s.HV, s.K, s.V, s.N
    x = contiguous_inputs(x, keep=("initial_state",))  # the pool stays the caller's tensor (see below)
    q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
    dev = q.device
    # a strided pool (e.g. one layer's view of a wider cache) runs on a contiguous copy, copied back
    # into it at the end when written in place (a copy of the whole pool each way: keep pools
    # contiguous where speed matters)
    h0 = contiguous(x.initial_state)
    o = new_empty(B, T, HV, V, dtype=v.dtype, device=dev)
    ht = new_empty(N, HV, *opts.state_shape, dtype=torch.float32, device=dev) if (
        opts.output_final_state and not opts.inplace_final_state) else None
    idx, acc = x.ssm_state_indices, x.num_accepted_tokens
    err = error_buffer(dev)
    cols = idx.shape[1] if (idx is not None and idx.ndim == 2) else 1
    num_slots = h0.shape[0] if h0 is not None else 0
    raises = opts.pool and opts.raise_on_bad_index and not platform.capturing(dev)  # reads the check back
    if opts.pool:
        kda_check_indices_kernel[(1,)](
            idx, acc, x.cu_seqlens, err, N, T, num_slots, idx.stride(0), COLS=cols, BC=pow2(cols, 1), BN=CHECK_BN,
            SPEC=opts.spec_decode, IS_VARLEN=x.cu_seqlens is not None, KEEP=not raises,
        )
    BK = pow2(K)
    BV, warps = (REC_BV, REC_WARPS) if BK <= 128 else REC_WIDE
    BV = min(pow2(V), BV)
    if N * HV > 0:
        kda_recurrent_kernel[seq_grid(V, BV, N * HV)](
            q, k, v, g, beta, x.A_log, x.dt_bias, o, h0, ht, x.cu_seqlens, idx, acc, err,
            scale=opts.scale, T=T, num_slots=num_slots, stride_idx=idx.stride(0) if idx is not None else 0, COLS=cols,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **gate_launch(opts, x.A_log, x.dt_bias), L2NORM=opts.qk_l2norm,
            SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale, USE_H0=h0 is not None, STORE_HT=ht is not None,
            POOL=opts.pool, SPEC=opts.spec_decode, INPLACE=opts.inplace_final_state, V_FIRST=opts.state_v_first,
            IS_VARLEN=x.cu_seqlens is not None, num_warps=warps,
        )
    if raises:
        code = int(err[0].item())
        if code:
            raise ValueError(describe_error(code, num_slots, cols, idx, acc) + "; nothing was written")
    if opts.inplace_final_state:
        if h0 is not x.initial_state:  # ran on a contiguous copy of a strided pool: copy it back
            x.initial_state.copy_(h0)
        return o, x.initial_state
    return o, ht


def take_error_code(device) -> int:
    """The first error code on ``device`` of the calls that did not raise since the last read
    (0: none), which it clears; reading it synchronises."""
    err = error_buffer(device)
    code = int(err[1].item())
    if code:
        err[1] = 0
    return code

