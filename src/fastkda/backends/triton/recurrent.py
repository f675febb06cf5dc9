"""Decoding: token-by-token KDA on state pools, without host synchronisation.

A pool call checks its indices (slots in [-1, num_slots), accepted-token counts in
[1, 1 + num_draft], tokens per sequence <= 1 + num_draft, and with an in-place write no slot
touched by two sequences), and a call with cu_seqlens on the device their values (from 0,
non-decreasing, to T), before it writes anything. A small call (the plan's
``decode_inline_check`` index entries or fewer) is one launch: every decode program makes the
call's error code itself (``call_error``) and writes nothing when it is set. A larger one launches
``kda_check_indices_kernel`` first, which leaves the code in a scratch of the call that the decode
programs read. Either way a call with one bad index changes nothing, and whatever the code says,
the decode kernel forms a pool pointer only for a slot in [0, num_slots) and a draft column below
1 + num_draft: it never reads or writes outside the pool.

A call that does not raise (the default, and every graph replay) also records its error in the
device's sticky code: set by compare-and-swap (the first error stays), cleared only by
``decode_error()`` (an atomic exchange). ``raise_on_bad_index=True`` reads the call's own code back
(one synchronisation) and raises.

The decode kernel's programs loop over the call's tiles, one (value block of BV columns, sequence,
value head) each, at most the plan's programs per SM (between a program that ends and one that
starts, their SM's slot idles: short tiles lose a large share of the time to that).
A tile's float32 state [BK, BV] lives in registers for all tokens of its sequence, its load issued
before anything else (the kernel is bound by the latency of that load). Pools are indexed through
their strides, so a view of a wider cache is read and written where it lies. A check kernel, when
there is one, lets the decode kernel launch while it runs (programmatic dependent launch on sm_90
and later); the decode programs wait for it before they read its code.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (platform.dependent_launch says whether a device takes it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without it: the kernels never reach these calls (PDL stays False)
    gdc_launch_dependents = gdc_wait = None

from ... import platform
from ...alloc import new_empty
from .common import CompiledLaunch, activate_gate, contiguous_inputs, gate_launch, seq_grid
from .plan import DecodeChoice, DecodePlan, current_tuning, decode_plan, device_facts, pow2

# error codes: 0 ok; otherwise kind + ERR_BASE * (sequence index)
ERR_SLOT, ERR_ACCEPTED, ERR_TOKENS, ERR_SHARED, ERR_SEQLENS = 1, 2, 3, 4, 5
ERR_BASE = 8
# the same codes as kernel constants (a kernel reads only globals that are tl.constexpr)
_ERR_SLOT, _ERR_ACCEPTED, _ERR_TOKENS = tl.constexpr(ERR_SLOT), tl.constexpr(ERR_ACCEPTED), tl.constexpr(ERR_TOKENS)
_ERR_SHARED, _ERR_SEQLENS, _ERR_BASE = tl.constexpr(ERR_SHARED), tl.constexpr(ERR_SEQLENS), tl.constexpr(ERR_BASE)
_NONE = tl.constexpr(2**31 - 1)  # no error yet: above every code, for a running minimum


@triton.jit
def pool_rows(idx, acc, cu_seqlens, n0, N, T, num_slots, stride_idx, COLS, BC: tl.constexpr, BN: tl.constexpr,
              SPEC: tl.constexpr, IS_VARLEN: tl.constexpr, POOL: tl.constexpr):
    """Sequences n0 .. n0 + BN of a call: (o_n, m_n, their token counts, b_idx [BN, BC] the slots
    of their index rows, m_touch [BN, BC] the entries whose slot the decode kernel reads or writes:
    in the pool, of a live sequence, its start column or a column of one of its tokens). Without
    a pool (POOL False) no entry touches a slot."""
    o_c = tl.arange(0, BC)
    o_n = n0 + tl.arange(0, BN)
    m_n = o_n < N
    if IS_VARLEN:
        b_len = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0) - tl.load(cu_seqlens + o_n, mask=m_n, other=0)
    else:
        b_len = tl.zeros([BN], tl.int32) + T
    m_e = m_n[:, None] & (o_c < COLS)[None, :]
    if POOL:
        b_idx = tl.load(idx + o_n.to(tl.int64)[:, None] * stride_idx + o_c[None, :], mask=m_e, other=-1).to(tl.int64)
    else:
        b_idx = tl.full([BN, BC], -1, tl.int64)
    m_touch = m_e & (b_idx >= 0) & (b_idx < num_slots)
    if SPEC:
        i_a = tl.minimum(tl.maximum(tl.load(acc + o_n, mask=m_n, other=1).to(tl.int64), 1), COLS) - 1
        b_start = tl.sum(tl.where(o_c[None, :] == i_a[:, None], b_idx, 0), 1)
        m_live = (b_start >= 0) & (b_start < num_slots)
        m_touch = m_touch & m_live[:, None] & ((o_c[None, :] == i_a[:, None]) | (o_c[None, :] < b_len[:, None]))
    return o_n, m_n, b_len, b_idx, m_touch


@triton.jit
def rows_first_error(acc, cu_seqlens, o_n, m_n, b_len, b_idx, N, T, num_slots, COLS, SPEC: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    """[BN] per sequence of a pool_rows block: its error code (kind + ERR_BASE * sequence) for a
    slot outside [-1, num_slots), an accepted-token count outside [1, COLS], more tokens than
    COLS, or boundaries cu_seqlens[n], cu_seqlens[n + 1] out of order or outside [0, T] (or, for the
    first and the last sequence, not 0 and T); _NONE for a sequence without one."""
    m_bad = (b_idx < -1) | (b_idx >= num_slots)  # the entries outside the rows hold -1
    b_kind = tl.where(tl.sum(m_bad.to(tl.int32), 1) > 0, _ERR_SLOT, 0)
    if SPEC:
        b_a = tl.load(acc + o_n, mask=m_n, other=1).to(tl.int64)
        b_kind = tl.where((b_a < 1) | (b_a > COLS), _ERR_ACCEPTED, b_kind)
        b_kind = tl.where(b_len > COLS, _ERR_TOKENS, b_kind)
    if IS_VARLEN:  # last: the token counts above mean nothing with these boundaries
        b_lo = tl.load(cu_seqlens + o_n, mask=m_n, other=0).to(tl.int64)
        b_hi = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0).to(tl.int64)
        # boundaries outside [0, T] too: with them the token counts above would name the wrong rule
        m_cu = (b_hi < b_lo) | (b_lo < 0) | (b_hi > T)
        m_cu |= ((o_n == 0) & (b_lo != 0)) | ((o_n == N - 1) & (b_hi != T))
        b_kind = tl.where(m_cu, _ERR_SEQLENS, b_kind)
    return tl.where(m_n & (b_kind != 0), b_kind + _ERR_BASE * o_n, _NONE)


@triton.jit
def kda_check_indices_kernel(idx, acc, cu_seqlens, scratch, sticky, N, T, num_slots, stride_idx, COLS,
                             BC: tl.constexpr, BN: tl.constexpr, SPEC: tl.constexpr, IS_VARLEN: tl.constexpr,
                             POOL: tl.constexpr, KEEP: tl.constexpr, UNIQUE: tl.constexpr, PDL: tl.constexpr):
    """scratch[0] <- 0, or the error of the first sequence that has one (kind + ERR_BASE *
    sequence), BN sequences at a time. UNIQUE (an in-place call): every slot the call touches
    belongs to one sequence; scratch[1 + slot] (zeroed here first) takes the largest sequence + 1
    touching it, and every other sequence touching it has ERR_SHARED. KEEP (a call that will not
    raise): the code also goes to sticky[0] unless that holds one already. One program. PDL: the
    decode kernel may start at once (it waits for this one before it reads scratch)."""
    if PDL:
        gdc_launch_dependents()
    b_first = tl.full([BN], _NONE, tl.int32)
    if UNIQUE:  # the owner table, all accesses atomic (at L2)
        for s0 in range(0, num_slots, BN * BC):
            o_s = s0 + tl.arange(0, BN * BC)
            tl.atomic_xchg(scratch + 1 + o_s, tl.zeros([BN * BC], tl.int32), mask=o_s < num_slots)
        tl.debug_barrier()
    for n0 in range(0, N, BN):
        o_n, m_n, b_len, b_idx, m_touch = pool_rows(idx, acc, cu_seqlens, n0, N, T, num_slots, stride_idx, COLS,
                                                    BC, BN, SPEC, IS_VARLEN, POOL)
        b_first = tl.minimum(b_first, rows_first_error(acc, cu_seqlens, o_n, m_n, b_len, b_idx, N, T, num_slots, COLS,
                                                       SPEC, IS_VARLEN))
        if UNIQUE:
            b_who = tl.zeros([BN, BC], tl.int32) + (o_n + 1)[:, None]
            tl.atomic_max(scratch + 1 + tl.where(m_touch, b_idx, 0), b_who, mask=m_touch)
    if UNIQUE:
        tl.debug_barrier()  # every claim is in before any is read back
        for n0 in range(0, N, BN):
            o_n, m_n, b_len, b_idx, m_touch = pool_rows(idx, acc, cu_seqlens, n0, N, T, num_slots, stride_idx,
                                                        COLS, BC, BN, SPEC, IS_VARLEN, POOL)
            # an atomic read: the claims of every thread of the program, not a cached line
            b_owner = tl.atomic_max(scratch + 1 + tl.where(m_touch, b_idx, 0), tl.zeros([BN, BC], tl.int32),
                                    mask=m_touch)
            m_shared = tl.sum((m_touch & (b_owner != (o_n + 1)[:, None])).to(tl.int32), 1) > 0
            b_first = tl.minimum(b_first, tl.where(m_n & m_shared, _ERR_SHARED + _ERR_BASE * o_n, _NONE))
    b_code = tl.min(b_first, 0)
    b_code = tl.where(b_code == _NONE, 0, b_code)
    tl.store(scratch + tl.arange(0, 1), b_code + tl.zeros([1], tl.int32))
    if KEEP:
        tl.atomic_cas(sticky, 0, b_code)


@triton.jit
def call_error(idx, acc, cu_seqlens, N, T, num_slots, stride_idx, COLS, BC: tl.constexpr, BN: tl.constexpr,
               SPEC: tl.constexpr, IS_VARLEN: tl.constexpr, POOL: tl.constexpr, UNIQUE: tl.constexpr):
    """The code kda_check_indices_kernel gives a call of at most BN sequences, made by one program
    from registers (no scratch, no atomics): the decode kernel's own check on small calls. A
    shared slot is found by comparing every touched entry with every other ([BN * BC]^2)."""
    o_n, m_n, b_len, b_idx, m_touch = pool_rows(idx, acc, cu_seqlens, 0, N, T, num_slots, stride_idx, COLS, BC, BN,
                                                SPEC, IS_VARLEN, POOL)
    b_first = rows_first_error(acc, cu_seqlens, o_n, m_n, b_len, b_idx, N, T, num_slots, COLS, SPEC, IS_VARLEN)
    if UNIQUE:
        E: tl.constexpr = BN * BC
        b_s = tl.reshape(tl.where(m_touch, b_idx, -1), [E])  # -1: an entry that touches nothing
        b_r = tl.reshape(tl.zeros([BN, BC], tl.int32) + o_n[:, None], [E])
        # entry i shares its slot with an entry of a later sequence
        m_pair = (b_s[:, None] == b_s[None, :]) & (b_s[:, None] >= 0) & (b_r[:, None] < b_r[None, :])
        m_shared = tl.max(tl.reshape(tl.max(m_pair.to(tl.int32), 1), [BN, BC]), 1) > 0
        b_first = tl.minimum(b_first, tl.where(m_n & m_shared, _ERR_SHARED + _ERR_BASE * o_n, _NONE))
    b_code = tl.min(b_first, 0)
    return tl.where(b_code == _NONE, 0, b_code)


@triton.jit
def call_check(idx, acc, cu_seqlens, scratch, N, T, num_slots, stride_idx, COLS, BC: tl.constexpr, BN: tl.constexpr,
               SPEC: tl.constexpr, IS_VARLEN: tl.constexpr, POOL: tl.constexpr, UNIQUE: tl.constexpr,
               CHECK: tl.constexpr, PDL: tl.constexpr):
    """(whether the call may write, its error code or 0) for a decode program. CHECK 0: no check;
    1: the code kda_check_indices_kernel left in scratch[0] (with PDL, waiting for that kernel
    first; the code itself stays there); 2: call_error, made here."""
    call_ok = True
    code = 0
    if CHECK == 1:
        if PDL:
            gdc_wait()
        call_ok = tl.load(scratch) == 0
    elif CHECK == 2:
        code = call_error(idx, acc, cu_seqlens, N, T, num_slots, stride_idx, COLS, BC, BN, SPEC, IS_VARLEN, POOL,
                          UNIQUE)
        call_ok = code == 0
    return call_ok, code


@triton.jit
def kda_take_error_kernel(sticky, out):
    """out[0] <- sticky[0], which becomes 0 in the same atomic step."""
    tl.store(out, tl.atomic_xchg(sticky, 0))


@triton.jit
def token_step(q, k, v, g, beta, A_log, dt_bias, b_S, r, m_r, i_h, i_hv, o_k, o_v, m_k, m_v, scale, lower_bound,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr,
               HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
               BETA_SCALE: tl.constexpr):
    """(the state after token r, the output [BV] of token r) from the float32 state tile [BK, BV]
    before it; m_r False: no token r (nothing is read; the caller keeps the state)."""
    b_q = tl.load(q + (r * H + i_h) * K + o_k, mask=m_k & m_r, other=0.0).to(tl.float32)
    b_k = tl.load(k + (r * H + i_h) * K + o_k, mask=m_k & m_r, other=0.0).to(tl.float32)
    b_v = tl.load(v + (r * HV + i_hv) * V + o_v, mask=m_v & m_r, other=0.0).to(tl.float32)
    b_g = tl.load(g + (r * HV + i_hv) * K + o_k, mask=m_k & m_r, other=0.0).to(tl.float32)
    b_b = tl.load(beta + r * HV + i_hv, mask=m_r, other=0.0).to(tl.float32)
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    if SIGMOID:
        b_b = tl.sigmoid(b_b) * BETA_SCALE
    b_g = activate_gate(b_g[None, :], A_log, dt_bias, i_hv, o_k, m_k, lower_bound, GATE, HAS_A, HAS_BIAS, K, 0)
    b_g = tl.sum(b_g, 0)  # back to [BK]
    # without token r: decay 1, k = 0 and u = 0, so the state comes back as it was (no tl.where on
    # the tile, which would keep two tiles live; NaNs may come back with another payload)
    b_S = b_S * tl.exp(tl.where(m_k & m_r, b_g, 0.0))[:, None]
    b_u = b_b * (b_v - tl.sum(b_S * b_k[:, None], 0))  # the delta: beta (v - S^T k)
    b_u = tl.where(m_r, b_u, 0.0)  # S^T k is NaN without a token where S holds an infinity
    b_S += b_k[:, None] * b_u[None, :]
    return b_S, tl.sum(b_S * (b_q * scale)[:, None], 0)


@triton.jit
def spec_store(h0, idx, b_S, i_n, t, m_write, num_slots, stride_idx, COLS, stride_hs, stride_hh, i_hv, o_h, m_h):
    """Speculative decoding in place: the state after token t goes to column t of the sequence's
    index row; none past the row's end or outside the pool."""
    slot_t = tl.load(idx + i_n * stride_idx + t, mask=m_write & (t < COLS), other=-1).to(tl.int64)
    if (slot_t >= 0) & (slot_t < num_slots):
        tl.store(h0 + slot_t * stride_hs + i_hv * stride_hh + o_h, b_S.to(h0.dtype.element_ty), mask=m_h)


@triton.jit
def decode_tile(
    i_tile, q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, idx, acc, scratch, call_ok,
    scale, lower_bound, N, T, num_slots, stride_idx, COLS, stride_hs, stride_hh, stride_hk, stride_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
    BETA_SCALE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, POOL: tl.constexpr, SPEC: tl.constexpr,
    INPLACE: tl.constexpr, V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, H_TILE: tl.constexpr,
    CHECK: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr, ONE_TOKEN: tl.constexpr,
    CHECK_HERE: tl.constexpr,
):
    """Tile i_tile (value block, sequence, value head) of a decode call: every token of the sequence on
    its [BK, BV] state, the outputs and the states written where the call says. call_ok: the
    call's check passed; CHECK_HERE: the tile reads or makes the call's check itself (then the
    call's code is returned, else 0)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = tl.cast(i_tile % NV, tl.int32), i_tile // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    # the state tile [BK, BV] in ht ([N, HV, K, V] or [.., V, K]) and in the caller's state tensor:
    # H_TILE 0 lays out its slots' [K, V] (or [V, K]) like ht, 1 any strides, 2 strides whose
    # offsets within a slot need 64 bits
    if V_FIRST:
        o_ht = o_v[None, :] * K + o_k[:, None]
    else:
        o_ht = o_k[:, None] * V + o_v[None, :]
    if H_TILE == 0:
        o_h = o_ht
    elif H_TILE == 1:
        o_h = o_k[:, None] * stride_hk + o_v[None, :] * stride_hv
    else:
        o_h = o_k.to(tl.int64)[:, None] * stride_hk + o_v.to(tl.int64)[None, :] * stride_hv

    # the state load goes first (its latency is the kernel's): a slot in [0, num_slots) is read
    # whatever the call's check says, which decides only what is written
    slot0 = i_n
    m_slot = slot0 >= 0
    if POOL:
        if SPEC:
            a = tl.minimum(tl.maximum(tl.load(acc + i_n).to(tl.int64), 1), COLS)  # in the row even when bad
            slot0 = tl.load(idx + i_n * stride_idx + a - 1).to(tl.int64)
        else:
            slot0 = tl.load(idx + i_n * stride_idx).to(tl.int64)
        m_slot = (slot0 >= 0) & (slot0 < num_slots)  # -1 (padding) and any other slot: no access
        slot0 = tl.where(m_slot, slot0, 0)  # no address outside the pool is formed
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + slot0 * stride_hs + i_hv * stride_hh + o_h, mask=m_h & m_slot, other=0.0).to(tl.float32)

    if IS_VARLEN:  # the boundaries are kept inside [0, T] whatever cu_seqlens holds
        bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n).to(tl.int64), 0), T)
        T_seq = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), bos), T) - bos
    else:
        bos = i_n * T
        T_seq = T
    p_o = o + (bos * HV + i_hv) * V + o_v
    # token 0 outside the loop: its loads then overlap the state's (a loop would wait for b_S first)
    m_t = T_seq > 0
    b_S, b_o = token_step(q, k, v, g, beta, A_log, dt_bias, b_S, bos, m_t, i_h, i_hv, o_k, o_v, m_k, m_v,
                          scale, lower_bound, H, HV, K, V, GATE, HAS_A, HAS_BIAS, L2NORM, SIGMOID, BETA_SCALE)
    live = m_slot & call_ok
    code = 0
    if CHECK_HERE:  # after the tile's loads, whose latency the check then shares
        call_ok, code = call_check(idx, acc, cu_seqlens, scratch, N, T, num_slots, stride_idx, COLS, BC, BN, SPEC,
                                   IS_VARLEN, POOL, INPLACE and POOL, CHECK, PDL)
        live = live & call_ok
    tl.store(p_o, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=m_v & m_t)
    if SPEC and INPLACE:
        spec_store(h0, idx, b_S, i_n, 0, m_t & live, num_slots, stride_idx, COLS, stride_hs, stride_hh, i_hv, o_h, m_h)
    if not ONE_TOKEN:
        p_t = p_o  # stepped as a pointer: t * HV * V in 32 bits would wrap past 2^31 elements
        for t in range(1, T_seq):
            p_t += HV * V
            b_S, b_o = token_step(q, k, v, g, beta, A_log, dt_bias, b_S, bos + t, True, i_h, i_hv, o_k, o_v, m_k,
                                  m_v, scale, lower_bound, H, HV, K, V, GATE, HAS_A, HAS_BIAS, L2NORM, SIGMOID,
                                  BETA_SCALE)
            tl.store(p_t, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
            if SPEC and INPLACE:
                spec_store(h0, idx, b_S, i_n, t, live, num_slots, stride_idx, COLS, stride_hs, stride_hh, i_hv, o_h,
                           m_h)

    if IS_VARLEN and CHECK != 0:
        if not call_ok:  # rows before the first sequence and after the last get their zeros here
            i_lo = tl.where(i_n == 0, 0, bos)
            i_hi = tl.where(i_n == N - 1, T, bos)
            for r in range(i_lo, bos):
                tl.store(o + (r * HV + i_hv) * V + o_v, tl.zeros([BV], o.dtype.element_ty), mask=m_v)
            for r in range(bos + T_seq, i_hi):
                tl.store(o + (r * HV + i_hv) * V + o_v, tl.zeros([BV], o.dtype.element_ty), mask=m_v)
    if INPLACE and not SPEC:
        if live & m_t:  # an empty sequence writes no slot (on the GPU, arithmetic on a NaN drops its payload)
            tl.store(h0 + slot0 * stride_hs + i_hv * stride_hh + o_h, b_S.to(h0.dtype.element_ty), mask=m_h)
    if STORE_HT:
        tl.store(ht + i_nh * K * V + o_ht, tl.where(live, b_S, 0.0), mask=m_h)
    return code


@triton.jit(do_not_specialize=["N", "T", "num_slots", "n_tiles", "NPROG"])
def kda_recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, idx, acc, scratch, sticky,
    scale, lower_bound, N, T, num_slots, stride_idx, COLS, stride_hs, stride_hh, stride_hk, stride_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
    BETA_SCALE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, POOL: tl.constexpr, SPEC: tl.constexpr,
    INPLACE: tl.constexpr, V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, H_TILE: tl.constexpr,
    CHECK: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr, KEEP: tl.constexpr, PDL: tl.constexpr,
    ONE_TOKEN: tl.constexpr, ONE_TILE: tl.constexpr, n_tiles, NPROG, STAGES: tl.constexpr,
):
    """CHECK (pool calls): 0 none, 1 the code kda_check_indices_kernel left in scratch[0], 2 this
    program's own call_error over the call's N <= BN sequences (BN fixed by the columns, so that
    the batch size compiles nothing new); program 0 then records it (sticky[0] with KEEP, else
    scratch[0] for the host). PDL (with CHECK 1): launched while the check kernel runs, which it
    waits for before it reads scratch. ONE_TILE: a program per (value block, sequence, value head)
    tile, which checks after its loads; else the NPROG programs loop over the n_tiles tiles,
    checking first. ONE_TOKEN: one token per sequence (no token loop)."""
    if ONE_TILE:
        code = decode_tile(
            tl.program_id(0).to(tl.int64), q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, idx, acc, scratch,
            True, scale, lower_bound, N, T, num_slots, stride_idx, COLS, stride_hs, stride_hh, stride_hk, stride_hv,
            H, HV, K, V, BK, BV, GATE, HAS_A, HAS_BIAS, L2NORM, SIGMOID, BETA_SCALE, USE_H0, STORE_HT, POOL, SPEC,
            INPLACE, V_FIRST, IS_VARLEN, H_TILE, CHECK, BC, BN, PDL, ONE_TOKEN, True)
    else:
        call_ok, code = call_check(idx, acc, cu_seqlens, scratch, N, T, num_slots, stride_idx, COLS, BC, BN, SPEC,
                                   IS_VARLEN, POOL, INPLACE and POOL, CHECK, PDL)
        for i_tile in tl.range(tl.program_id(0).to(tl.int64), n_tiles, NPROG, num_stages=STAGES):
            decode_tile(
                i_tile, q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, idx, acc, scratch, call_ok, scale,
                lower_bound, N, T, num_slots, stride_idx, COLS, stride_hs, stride_hh, stride_hk, stride_hv, H, HV, K,
                V, BK, BV, GATE, HAS_A, HAS_BIAS, L2NORM, SIGMOID, BETA_SCALE, USE_H0, STORE_HT, POOL, SPEC, INPLACE,
                V_FIRST, IS_VARLEN, H_TILE, CHECK, BC, BN, PDL, ONE_TOKEN, False)
    if CHECK == 2:  # program 0 records the call's code
        if tl.program_id(0) == 0:
            if KEEP:
                if code != 0:
                    tl.atomic_cas(sticky, 0, code)
            else:
                tl.store(scratch + tl.arange(0, 1), code + tl.zeros([1], tl.int32))


_STICKY: dict = {}
_STICKY_LOCK = threading.Lock()


def sticky_error(device) -> torch.Tensor:
    """The int32 sticky error code of ``device`` (one per device, static so that graphs capture
    it): the first error of the calls that did not raise, until decode_error() takes it."""
    key = str(device)
    with _STICKY_LOCK:
        buf = _STICKY.get(key)
        if buf is None:
            if platform.capturing(device):  # an allocation here would belong to the graph
                raise RuntimeError(
                    f"the first fused_recurrent_kda call with `ssm_state_indices` or `cu_seqlens` on {device} is being "
                    "captured into a CUDA graph; make one eager call first (it also compiles the kernels)")
            buf = _STICKY[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf


def _touched(n: int, idx, acc, lens) -> set[int]:
    """The slots sequence n reads or writes (host side, error path only)."""
    row = idx[n].reshape(-1).tolist()
    if acc is None:
        return {row[0]} if row[0] >= 0 else set()
    a = min(max(int(acc[n]), 1), len(row)) - 1
    if row[a] < 0:
        return set()
    return {s for c, s in enumerate(row) if s >= 0 and (c == a or c < lens[n])}


def describe_error(code: int, num_slots: int | None = None, cols: int | None = None, idx=None, acc=None,
                   lens=None, bounds: list | None = None, T: int | None = None) -> str:
    """The message of an error code (the pool size and columns, when known, name the bounds; the
    index tensors, token counts and cu_seqlens values, when given, the values: read back on the
    error path only)."""
    kind, n = code % ERR_BASE, code // ERR_BASE
    if kind == ERR_SEQLENS:
        end = f"T={T}" if T is not None else "the total length T"
        got = f" (cu_seqlens[{n}]={bounds[n]}, cu_seqlens[{n + 1}]={bounds[n + 1]})" if bounds is not None else ""
        return f"`cu_seqlens` must start at 0, be non-decreasing and end at {end}: not so at sequence {n}{got}"
    if kind == ERR_SLOT:
        pool = f"[0, {num_slots})" if num_slots is not None else "the pool"
        got = f": {idx[n].tolist()}" if idx is not None else ""
        return f"`ssm_state_indices` of sequence {n} holds a slot outside {pool} other than -1 (padding){got}"
    cols_ = cols if cols is not None else "1 + num_draft"
    if kind == ERR_ACCEPTED:
        got = f", got {int(acc[n])}" if acc is not None else ""
        return f"`num_accepted_tokens[{n}]` must be in [1, {cols_}]{got}"
    if kind == ERR_TOKENS:
        return f"sequence {n} has more tokens than the {cols_} slots per sequence of `ssm_state_indices`"
    rule = "with inplace_final_state=True a slot may belong to one sequence of a call only"
    if idx is not None and lens is not None:
        mine = _touched(n, idx, acc, lens)
        for m in range(n + 1, idx.shape[0]):
            common = mine & _touched(m, idx, acc, lens)
            if common:
                return (f"`ssm_state_indices`: sequence {n} shares pool slot {min(common)} with sequence {m} "
                        f"({idx[n].tolist()} and {idx[m].tolist()}); {rule}")
    return f"`ssm_state_indices`: sequence {n} shares a pool slot with a later sequence of its call; {rule}"


def _state_strides(shape, stride, v_first: bool) -> tuple[dict, int]:
    """The kernel's stride arguments of a state tensor of this shape and stride (slot, head, key
    row, value column; None: no state tensor) and its H_TILE: 0 when every slot's [K, V] (or
    [V, K]) is laid out densely, 1 other strides, 2 other strides whose offsets within a slot
    need 64 bits."""
    if shape is None:
        return dict(stride_hs=0, stride_hh=0, stride_hk=0, stride_hv=0), 0
    s_s, s_h, s_a, s_b = stride
    s_k, s_v = (s_b, s_a) if v_first else (s_a, s_b)
    n_a, n_b = shape[2:]
    strides = dict(stride_hs=s_s, stride_hh=s_h, stride_hk=s_k, stride_hv=s_v)
    if (n_b == 1 or s_b == 1) and (n_a == 1 or s_a == n_b):
        return strides, 0
    span = sum((n - 1) * st for n, st in zip(shape[1:], stride[1:]) if n > 0)
    return strides, 1 if span < 2**31 else 2


class DecodeCall(NamedTuple):
    """The host side of a decode call's launches, fixed by its options and layouts."""

    plan: DecodePlan
    choice: DecodeChoice
    cols: int  # slots per sequence of the index rows
    num_slots: int
    n_tiles: int  # 0: no (sequence, value head) pair, no decode launch
    # each kernel's launches, its arguments after its tensors and its launch options fixed
    # (shared by every call of the layout)
    run_check: CompiledLaunch
    run_decode: CompiledLaunch | None
    raises: bool  # the call reads its check back and raises


@functools.lru_cache(maxsize=256)
def decode_call(opts, h0_layout: tuple | None, idx_layout: tuple | None, varlen: bool, has_a: bool, has_bias: bool,
                raises: bool, dev: torch.device, dependent_launch: bool, tuning) -> DecodeCall:
    """The launches of a decode call: ``h0_layout`` (shape, stride, element size) of the state
    tensor, ``idx_layout`` (shape, stride) of ssm_state_indices; ``raises``: the call reads its
    check back; ``dependent_launch``: the device takes programmatic dependent launches. Cached: a
    decode loop repeats one layout."""
    s = opts.shape
    T, H, HV, K, V, N = s.T, s.H, s.HV, s.K, s.V, s.N
    h0_shape, h0_stride, h0_bytes = h0_layout if h0_layout is not None else (None, None, 4)
    plan = decode_plan(K, V, h0_bytes, tuning, device_facts(dev, tuning).sm_count, dependent_launch)
    cols = idx_layout[0][1] if idx_layout is not None and len(idx_layout[0]) == 2 else 1
    stride_idx = idx_layout[1][0] if idx_layout is not None else 0
    num_slots = h0_shape[0] if h0_shape is not None else 0
    bc = pow2(cols, 1)
    n_tiles = seq_grid(V, plan.BV, N * HV)[0]
    one_token = not varlen and T == 1
    c = plan.choose(opts.pool or varlen, N * bc, bc, one_token, n_tiles)
    scalars = dict(N=N, T=T, num_slots=num_slots, stride_idx=stride_idx, COLS=cols)
    check_kwargs = dict(**scalars, BC=bc, BN=plan.check_rows, SPEC=opts.spec_decode, IS_VARLEN=varlen, POOL=opts.pool,
                        KEEP=not raises, UNIQUE=opts.inplace_final_state and opts.pool, PDL=c.dependent,
                        **plan.check_launch.kwargs())
    check = CompiledLaunch(kda_check_indices_kernel, check_kwargs)
    if n_tiles == 0:
        return DecodeCall(plan, c, cols, num_slots, 0, check, None, raises)
    strides, h_tile = _state_strides(h0_shape, h0_stride, opts.state_v_first)
    decode_kwargs = dict(
        scale=opts.scale, **scalars, **strides, H=H, HV=HV, K=K, V=V, BK=plan.BK, BV=plan.BV,
        **gate_launch(opts, has_a, has_bias),
        L2NORM=opts.qk_l2norm, SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale, USE_H0=h0_layout is not None,
        STORE_HT=opts.output_final_state and not opts.inplace_final_state, POOL=opts.pool, SPEC=opts.spec_decode,
        INPLACE=opts.inplace_final_state, V_FIRST=opts.state_v_first, IS_VARLEN=varlen, H_TILE=h_tile,
        CHECK=c.check, BC=bc, BN=c.check_rows, KEEP=not raises, PDL=c.dependent, ONE_TOKEN=one_token,
        ONE_TILE=c.one_tile, n_tiles=n_tiles, NPROG=c.grid[0], STAGES=c.stages, launch_pdl=c.dependent,
        **plan.launch.kwargs())
    return DecodeCall(plan, c, cols, num_slots, n_tiles, check, CompiledLaunch(kda_recurrent_kernel, decode_kwargs),
                      raises)


def decode_call_of(opts, x, dev: torch.device) -> DecodeCall:
    """decode_call for the inputs ``x`` on ``dev`` (resolved), under the tuning in force. A call
    that checks on the device (a pool, or cu_seqlens) reads its check back with
    raise_on_bad_index, except while a CUDA graph is being captured."""
    h0, idx = x.initial_state, x.ssm_state_indices
    raises = ((opts.pool or x.cu_seqlens is not None) and opts.raise_on_bad_index
              and not platform.capturing(x.q.device))
    return decode_call(opts, None if h0 is None else (h0.shape, h0.stride(), h0.element_size()),
                       None if idx is None else (idx.shape, idx.stride()), x.cu_seqlens is not None,
                       x.A_log is not None, x.dt_bias is not None, raises, dev, platform.dependent_launch(dev),
                       current_tuning())


def recurrent_forward(opts, x):
    s = opts.shape
    x = contiguous_inputs(x, keep=("initial_state",))  # the state is the caller's tensor, indexed by its strides
    h0, idx, acc, cu = x.initial_state, x.ssm_state_indices, x.num_accepted_tokens, x.cu_seqlens
    dev = x.q.device
    rdev = platform.resolve_device(dev)
    c = decode_call_of(opts, x, rdev)
    check, raises = c.choice.check, c.raises
    o = new_empty(s.B, s.T, s.HV, s.V, dtype=x.v.dtype, device=dev)
    ht = new_empty(s.N, s.HV, *opts.state_shape, dtype=torch.float32, device=dev) if (
        opts.output_final_state and not opts.inplace_final_state) else None
    scratch = sticky = None
    if check:  # the record exists after a layout's first eager call, raising or not (graphs capture it)
        sticky = sticky_error(rdev)
        sticky = None if raises else sticky
    if check == 2:  # the decode programs check the call themselves
        scratch = torch.empty(1, dtype=torch.int32, device=dev) if raises and c.n_tiles > 0 else None
    elif check == 1:  # this call's error code, then (in place) the owner of every slot
        owners = c.num_slots if opts.inplace_final_state and opts.pool else 0
        scratch = torch.empty(1 + owners, dtype=torch.int32, device=dev)
        c.run_check((1,), idx, acc, cu, scratch, sticky if not raises else scratch)
    if c.n_tiles > 0:
        c.run_decode(c.choice.grid, x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, o, h0, ht, cu, idx, acc, scratch,
                 sticky)
    if raises and scratch is not None:
        code = int(scratch[0].item())
        if code:
            lens = None
            if code % ERR_BASE == ERR_SHARED:
                lens = (cu.diff().tolist() if cu is not None else [s.T] * s.N)
            bounds = cu.tolist() if code % ERR_BASE == ERR_SEQLENS else None
            raise ValueError(describe_error(code, c.num_slots, c.cols, idx, acc, lens, bounds, s.T)
                             + "; nothing was written")
    if opts.inplace_final_state:
        return o, x.initial_state
    return o, ht


def take_error_code(device) -> int:
    """The sticky error code of ``device`` (0: none), cleared in the same atomic step; reading it
    synchronises."""
    buf = _STICKY.get(str(device))
    if buf is None:  # no call on this device has kept an error
        return 0
    out = torch.empty(1, dtype=torch.int32, device=device)
    kda_take_error_kernel[(1,)](buf, out)
    return int(out.item())
