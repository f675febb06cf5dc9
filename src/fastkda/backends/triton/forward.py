"""The chunk forward on the host: stage 1 (gates, intra-chunk products, the inverse, w/u) and the
state scan, launched as the call's ``ChunkPlan`` says.

Stage 1 writes per chunk (docs/math.md section 2; exponents base 2):

    w   = X (beta k e^G)          [C, K]   u  = X (beta v)      [C, V]
    qg  = scale q e^G             [C, K]   kd = k e^(G_last-G)  [C, K]
    Aqk (j <= i, times scale)     [C, C]   gl = e^(G_last)      [K] (float32)

``stage1_intra`` launches gates, intra and inverse (what the training forward keeps for the
backward); ``stage1_wu`` the w/u kernel (which the backward recomputes, with the scan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import torch

from ...alloc import new_empty
from ...options import GateMode, KDAInputs, KDAOptions, KDAShape, graph_chunk_slots
from ...seqlens import seqlens_derived
from .chunk_gates import kda_fwd_gates_kernel
from .common import chunk_grid, chunk_tables, chunk_tables_static, gate_launch, launch
from .intra import kda_fwd_intra_chunk_kernel, kda_fwd_intra_kernel
from .plan import ChunkPlan, ScanPlan, Stage1Plan, cdiv
from .scan import fwd_scan
from .short import short_stage1, short_stage1_outputs
from .wy import kda_fwd_inverse_kernel, kda_fwd_wu_kernel


class Stage1(NamedTuple):
    """What stage 1 leaves for the scan and for the backward (float32 scratches unless said)."""

    w: torch.Tensor | None  # [B, T, HV, K] input dtype (None until stage1_wu)
    u: torch.Tensor | None  # [B, T, HV, V] input dtype (None: the scan forms u itself)
    qg: torch.Tensor | None  # [B, T, HV, K] input dtype
    kd: torch.Tensor | None  # [B, T, HV, K] input dtype
    Aqk: torch.Tensor  # [B, T, HV, C] input dtype
    gl: torch.Tensor  # chunk decays                                    [NT, HV, K]
    gc: torch.Tensor  # cumulative gates (block-local; from the chunk start on the whole-chunk path) [B, T, HV, K]
    ga: torch.Tensor | None  # activated gates (block path only)         [B, T, HV, K]
    ls: torch.Tensor  # Akk, lower blocks                               [NT, HV, C, C]
    xs: torch.Tensor  # X = (I + Diag(beta) Akk)^-1, lower blocks       [NT, HV, C, C] (plan's x_dtype)
    rs: torch.Tensor  # 1/|q|, 1/|k| of every row                       [NT, HV, 2, C]
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    NT_total: int
    gd: torch.Tensor | None = None  # exact sums: gc's rounding errors (float16; split passes: some chunks)
    gok: torch.Tensor | None = None  # exact sums: the form of each chunk's diagonal blocks  [NT, HV] int32
    xh: torch.Tensor | None = None  # X in bfloat16 for the w/u kernel (training)  [NT, HV, C, C]


def chunk_count(opts: KDAOptions, cu_seqlens, cu_host) -> int:
    """Chunk slots of a call's grids (the plan's ``chunks``), without building use_graph's tables."""
    if opts.graph:
        return graph_chunk_slots(opts.shape.T, opts.shape.N, opts.chunk_size)
    return chunk_tables_of(opts, cu_seqlens, cu_host)[2]


def scan_pairs(opts: KDAOptions, cu_host) -> int:
    """The (sequence, value head) pairs of a call as its scan sees them (the plan's ``pairs``): value
    heads times the tokens over the longest sequence's, which is sequences x value heads for a dense
    batch and fewer for a skewed varlen one (the longest sequence's chain outlasts the others).
    use_graph, whose lengths the host never sees: sequences x value heads."""
    s = opts.shape
    if opts.graph or cu_host is None:
        return s.N * s.HV
    tokens, longest = _tokens_longest(cu_host)
    return s.HV * tokens // longest if longest > 0 else 0


def longest_sequence(opts: KDAOptions, cu_host) -> int:
    """The tokens of a call's longest sequence (use_graph, whose lengths the host never sees: T)."""
    if opts.graph or cu_host is None:
        return opts.shape.T
    return _tokens_longest(cu_host)[1]


def _tokens_longest(cu_host) -> tuple[int, int]:
    def make():
        lens = (cu_host[1:] - cu_host[:-1]).tolist()
        return sum(lens), max(lens, default=0)

    return seqlens_derived(cu_host, ("tokens", "longest"), make)


def chunk_tables_of(opts: KDAOptions, cu_seqlens, cu_host, C: int | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(chunk_indices, chunk_offsets, total chunks) of a call's chunks of C tokens (default: its chunk
    size): the varlen tables (kept by the sequence lengths; with use_graph built on the device in
    fixed sizes), or None for a dense batch."""
    C = C or opts.chunk_size
    if opts.graph:  # cu_seqlens: common.graph_seqlens's boundaries
        return chunk_tables_static(cu_seqlens, opts.shape.N, opts.shape.T, C)
    if cu_seqlens is not None:
        return chunk_tables(cu_host, C, cu_seqlens.device)
    return None, None, opts.shape.B * cdiv(opts.shape.T, C)


def _where(opts: KDAOptions, s1: Stage1Plan, chunk_indices, cu_seqlens) -> dict:
    return dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=opts.shape.T, HV=opts.shape.HV,
                C=opts.chunk_size, IS_VARLEN=cu_seqlens is not None, HEADS_FIRST=s1.heads_first)


def stage1_intra(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs) -> Stage1:
    """Gates, intra-chunk products and the inverse: a ``Stage1`` without w, u, qg, kd."""
    s, C, s1 = opts.shape, opts.chunk_size, plan.stage1
    B, T, H, HV, K = s.B, s.T, s.H, s.HV, s.K
    if s1.whole and not opts.safe_gate and opts.gate == GateMode.PREGATED:
        raise RuntimeError("the whole-chunk path needs gates activated in the kernel (non-positive)")
    chunk_indices, chunk_offsets, NT = chunk_tables_of(opts, x.cu_seqlens, x.cu_seqlens_cpu)
    dev, dt = x.q.device, x.q.dtype
    f32 = dict(dtype=torch.float32, device=dev)
    p = Stage1(
        w=None, u=None, qg=None, kd=None, Aqk=new_empty(B, T, HV, C, dtype=dt, device=dev),
        gl=new_empty(NT, HV, K, **f32), gc=new_empty(B, T, HV, K, **f32),
        ga=None if s1.whole else new_empty(B, T, HV, K, **f32), ls=new_empty(NT, HV, C, C, **f32),
        xs=new_empty(NT, HV, C, C, dtype=s1.x_dtype, device=dev), rs=new_empty(NT, HV, 2, C, **f32),
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, NT_total=NT,
        gd=new_empty(B, T, HV, K, dtype=torch.float16, device=dev) if s1.exact_sums else None,
        gok=new_empty(NT, HV, dtype=torch.int32, device=dev) if s1.exact_sums else None,
        xh=new_empty(NT, HV, C, C, dtype=torch.bfloat16, device=dev) if s1.x_copy else None)
    if NT == 0:
        return p
    NC = C // 16
    where = _where(opts, s1, chunk_indices, x.cu_seqlens)
    launch(kda_fwd_gates_kernel, chunk_grid(NT * (1 if s1.whole else NC), HV, s1.heads_first),
           x.q, x.k, x.g, x.A_log, x.dt_bias, p.gc, p.ga, p.gd, p.gok, p.gl, p.rs, H=H, K=K, BK=s1.BK, BS=s1.gates_bs,
           L2NORM=opts.qk_l2norm, WHOLE=s1.whole, EXACT_SUMS=s1.exact_sums, SPLIT=s1.split, FAST=s1.softplus_form,
           LO_SPAN=s1.lo_span,
           **gate_launch(opts, x.A_log is not None, x.dt_bias is not None), **where, **s1.gates.kwargs())
    if s1.whole:
        for ps in s1.passes:
            launch(kda_fwd_intra_chunk_kernel, chunk_grid(NT * 2, HV, s1.heads_first),
                   x.q, x.k, p.gc, p.gd, p.gok, p.rs, p.Aqk, p.ls, scale=opts.scale, H=H, K=K, BK=s1.BK,
                   BS=ps.bs, PREC=s1.intra_prec, EXACT_SUMS=ps.exact, SELECT=ps.select, CLAMP=ps.clamp,
                   L2NORM=opts.qk_l2norm, **where, **ps.launch.kwargs())
    else:
        launch(kda_fwd_intra_kernel, chunk_grid(NT * NC, HV, s1.heads_first),
               x.q, x.k, p.gc, p.ga, p.rs, p.Aqk, p.ls, scale=opts.scale, H=H, K=K, BK=s1.BK, BS=s1.intra_bs,
               SAFE=opts.safe_gate, PREC=s1.intra_prec, **where, **s1.intra.kwargs())
    launch(kda_fwd_inverse_kernel, chunk_grid(NT, HV, s1.heads_first),
           x.beta, p.gc, p.ls, p.xs, p.xh, p.gl, K=K, BK=s1.BK, BS=s1.BS, STORE_DECAY=not s1.whole,
           SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale, X_COPY=s1.x_copy, **where, **s1.inverse.kwargs())
    return p


def stage1_wu(opts: KDAOptions, plan: ChunkPlan, scan: ScanPlan, p: Stage1, x: KDAInputs) -> Stage1:
    """The rest of stage 1: w, q e^G, k e^(G_last - G) and, unless the scan forms it, u."""
    s, s1 = opts.shape, plan.stage1
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    dev, dt = x.q.device, x.q.dtype
    w, qg, kd = (new_empty(B, T, HV, K, dtype=dt, device=dev) for _ in range(3))
    u = None if scan.form_u else new_empty(B, T, HV, V, dtype=dt, device=dev)
    if p.NT_total > 0:
        NSK, NSV = cdiv(K, s1.wu_bs), 0 if scan.form_u else cdiv(V, s1.wu_bs)
        launch(kda_fwd_wu_kernel, chunk_grid(p.NT_total * (NSK + NSV), HV, s1.heads_first),
               x.q, x.k, x.v, x.beta, p.gc, p.ga, p.gd, p.gok, p.rs, wu_x(p), w, u, qg, kd, scale=opts.scale, H=H,
               K=K, V=V, BS=s1.wu_bs, NSK=NSK, NSV=NSV, PREC=s1.wu_prec, WHOLE=s1.whole, EXACT_SUMS=s1.exact_sums,
               SPLIT=s1.split, SIGMOID=opts.beta_sigmoid, BETA_SCALE=opts.beta_scale,
               **_where(opts, s1, p.chunk_indices, x.cu_seqlens), **s1.wu.kwargs())
    return p._replace(w=w, u=u, qg=qg, kd=kd)


def wu_x(p: Stage1) -> torch.Tensor:
    """The X that the w/u products read (and the scan's, where it forms u): the bfloat16 copy if any."""
    return p.xs if p.xh is None else p.xh


def short_forward(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs, o_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final_state) of the short path: its stage 1 (short.py), then the scan over its chunks.
    ``o_dtype``: o's (default v's)."""
    if plan.short.parts > 1:
        return _short_forward_parts(opts, plan, x, o_dtype)
    p = short_stage1(opts, plan, x, chunk_tables_of(opts, x.cu_seqlens, x.cu_seqlens_cpu, plan.short.chunk))
    o, ht, _, _ = fwd_scan(opts, plan, plan.forward, p.w, p.u, p.xs, p.qg, p.kd, p.Aqk, p.gl, p.chunk_indices,
                           p.chunk_offsets, p.NT_total, x, o_dtype)
    return o, ht


def forward_stages(opts: KDAOptions, plan: ChunkPlan, scan: ScanPlan, x: KDAInputs, intra: Stage1 | None = None,
                   o_dtype: torch.dtype | None = None):
    """Stage 1 and the scan on contiguous inputs: (stage 1's output, o, final_state, h, v') as
    ``scan`` says (the plan's ``forward`` or ``recompute``). ``intra``: the output of
    ``stage1_intra`` kept from the forward, from which only stage1_wu and the scan run. ``o_dtype``:
    o's (default v's)."""
    if plan.short is not None:
        raise RuntimeError("forward_stages: the plan takes the short path (short_forward)")
    if intra is None:
        intra = stage1_intra(opts, plan, x)
    p = stage1_wu(opts, plan, scan, intra, x)
    o, ht, h, vn = fwd_scan(opts, plan, scan, p.w, p.u, wu_x(p), p.qg, p.kd, p.Aqk, p.gl, p.chunk_indices,
                            p.chunk_offsets, p.NT_total, x, o_dtype)
    return p, o, ht, h, vn


_SCAN_STREAMS: dict[int, torch.cuda.Stream] = {}


def _scan_stream(dev: torch.device) -> torch.cuda.Stream:
    """The stream of a device on which the parts' scans run: high priority, so that a scan's programs
    start before the queued programs of a later part's stage 1."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = _SCAN_STREAMS.get(index)
    if stream is None:
        stream = _SCAN_STREAMS[index] = torch.cuda.Stream(index, priority=-1)
    return stream


@functools.lru_cache(maxsize=64)
def _part_options(opts: KDAOptions, tokens: int, final_state: bool) -> KDAOptions:
    """The options of a part of ``tokens`` tokens of a one-sequence call (cached: every part of every
    call of a shape asks for the same few, and the launch caches keyed by options then hit at once)."""
    s = opts.shape
    return dataclasses.replace(opts, shape=KDAShape(1, tokens, s.H, s.HV, s.K, s.V, 1), output_final_state=final_state)


def _short_forward_parts(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs, o_dtype: torch.dtype | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The short path on one sequence cut into ``plan.short.parts`` along its tokens: each part's
    stage 1 on the caller's stream, each part's scan on ``_scan_stream`` once that stage 1 is done,
    from the final state of the part before (float32, exact), so that the next part's stage 1 runs
    beside it; the outputs are those of one scan over the whole sequence, bit for bit. Every tensor
    is allocated on the caller's stream (of the inputs' device), which waits for the scans before
    it returns, also when a part fails. Without CUDA: one stream, no waits."""
    s, sp = opts.shape, plan.short
    L, dev = sp.part_tokens, x.q.device
    if s.B != 1 or L % sp.chunk:  # (plan.short_parts): a part's token rows are then a dense view
        raise RuntimeError(f"parts need one sequence and whole chunks, got B={s.B}, part of {L} tokens")
    o = new_empty(1, s.T, s.HV, s.V, dtype=o_dtype or x.v.dtype, device=dev)
    states = [new_empty(1, s.HV, *opts.state_shape, dtype=torch.float32, device=dev)
              for _ in range(sp.parts if opts.output_final_state else sp.parts - 1)]
    # stage 1's outputs for the whole sequence, each part writing its tokens' and chunks' rows (alive
    # until the caller's stream has waited for the scans)
    w, u, xs, qg, kd, Aqk, gl = short_stage1_outputs(opts, plan, cdiv(s.T, sp.chunk), x.q.dtype, dev)
    with contextlib.ExitStack() as streams:
        side = None
        if dev.type == "cuda":
            streams.enter_context(torch.cuda.device(dev))
            main, side = torch.cuda.current_stream(), _scan_stream(dev)
            streams.callback(main.wait_stream, side)  # on leaving, failure too: nothing freed under a queued scan
        h0 = x.initial_state
        for i in range(sp.parts):
            t0, t1 = i * L, min((i + 1) * L, s.T)
            last = i == sp.parts - 1
            opts_p = _part_options(opts, t1 - t0, not last or opts.output_final_state)
            x_p = KDAInputs(*(t[:, t0:t1] for t in (x.q, x.k, x.v, x.g, x.beta)), x.A_log, x.dt_bias, h0)
            c0, c1 = t0 // sp.chunk, cdiv(t1, sp.chunk)  # (parts of whole chunks)
            tok, chk = slice(t0, t1), slice(c0, c1)  # rows of the [1, T, ...] and [NT, ...] outputs
            rows = (w[:, tok], None if u is None else u[:, tok], None if xs is None else xs[chk], qg[:, tok],
                    kd[:, tok], Aqk[:, tok], gl[chk])
            p = short_stage1(opts_p, plan, x_p, (None, None, c1 - c0), rows)
            ht = states[i] if i < len(states) else None
            with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
                if side is not None:
                    side.wait_stream(main)
                fwd_scan(opts_p, plan, plan.forward, p.w, p.u, p.xs, p.qg, p.kd, p.Aqk, p.gl, None, None, p.NT_total,
                         x_p, o_out=o[:, t0:t1], ht_out=ht)
            h0 = ht
    return o, states[-1] if opts.output_final_state else None
