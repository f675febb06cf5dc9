"""The Triton chunk_kda's entry points: inference forward, the autograd Function, and the
gradients without autograd (the compiled backward). Each call makes its plan once
(``plan.chunk_plan``); the backward runs the plan its forward made.

By default the forward keeps the part of stage 1 that is costly to recompute (gates, the intra-
chunk matrices Aqk and Akk, the inverse X: ``forward.stage1_intra``) and the backward recomputes
the cheap rest (w, u, q e^G, k e^(G_last - G): ``forward.stage1_wu``) and the state scan.

Held from the forward to the backward beyond the inputs, per token and value head, K = V = 128,
C = 64, bf16 inputs (bytes): gc (512), Akk and X (512), X's bfloat16 copy for the w/u kernel
(128), Aqk (128), the row norms and chunk decays (16): 1296 B on the whole-chunk path (unbounded
gates: plus gc's rounding errors gd, 256), 1808 B on the block path (plus ga, 512).
``disable_recompute=True`` keeps w, u, qg, kd and the scan's h, v' as well (1792 B more). The
compiled operator (``chunk_kda_vjp``) keeps nothing and recomputes all of stage 1.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ...options import KDAInputs, KDAOptions, KDAShape
from .backward import gradients
from .common import chunk_tables, contiguous_inputs, current_record, graph_seqlens, launch, out_alloc, recording
from .forward import (Stage1, chunk_count, chunk_tables_of, forward_stages, longest_sequence, scan_pairs,
                      short_forward)
from .output import kda_fwd_segment_output_kernel
from .plan import ChunkPlan, cdiv, chunk_plan, current_tuning, device_facts, pow2, tuned


def plan_of(opts: KDAOptions, x: KDAInputs, train: bool) -> ChunkPlan:
    """The plan of a call on inputs ``x`` (the current tuning, this device's facts)."""
    tuning = current_tuning()
    chunks = chunk_count(opts, x.cu_seqlens, x.cu_seqlens_cpu)
    return chunk_plan(opts, x.q.dtype, train, chunks, device_facts(x.q.device, tuning), tuning,
                      scan_pairs(opts, x.cu_seqlens_cpu), longest_sequence(opts, x.cu_seqlens_cpu))


def graph_inputs(opts: KDAOptions, x: KDAInputs) -> tuple[KDAInputs, torch.Tensor | None]:
    """(x, None), or with use_graph (x with the boundaries the kernels read, the flag of boundaries
    that broke the contract): common.graph_seqlens, on the device."""
    if not opts.graph:
        return x, None
    cu, bad = graph_seqlens(x.cu_seqlens, opts.shape.T)
    return x._replace(cu_seqlens=cu), bad


def poison(bad: torch.Tensor | None, *outs):
    """use_graph: NaN in the outputs when the boundaries broke the contract (no read-back to raise)."""
    if bad is not None:
        for t in outs:
            if t is not None:
                t.masked_fill_(bad, float("nan"))


def chunk_forward(opts: KDAOptions, x: KDAInputs):
    """(o, final_state, h) through the two forward stages, without gradients."""
    x, bad = graph_inputs(opts, contiguous_inputs(x))
    plan = plan_of(opts, x, train=False)
    if plan.segments > 1:
        o, ht = segmented_forward(opts, plan, x)
        h = None
    elif plan.short is not None:
        o, ht = short_forward(opts, plan, x)
        h = None
    else:
        _, o, ht, h, _ = forward_stages(opts, plan, plan.forward, x)
    poison(bad, o, ht, h)
    return o, ht, h


def segmented_forward(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final_state) of an inference call whose sequences are cut into ``plan.segments`` each
    (plan.segment_count; docs/context_parallel.md has the maps): one call of the segments as
    sequences of their own, with K more value columns that run each segment's state map from the
    identity (v = 0 there, initial state I: outputs A_{1..t}^T scale q_t, final state A), all
    outputs in float32; then each segment's true initial state from the maps of the segments before
    it, S_in(p + 1) = A_p S_in(p) + B_p (the first starts from the call's own initial state, in its
    B), and its outputs plus (A_{1..t}^T scale q_t)^T S_in(p), rounded once
    (output.kda_fwd_segment_output_kernel)."""
    s, P = opts.shape, plan.segments
    B, T, HV, K, V = s.B, s.T, s.HV, s.K, s.V
    dev = x.q.device
    f32 = dict(dtype=torch.float32, device=dev)
    if x.cu_seqlens is None:
        seqs = [(b * T, (b + 1) * T) for b in range(B)]
    else:  # the host copy (varlen calls have it; use_graph never segments)
        cu = x.cu_seqlens_cpu.tolist()
        seqs = list(zip(cu[:-1], cu[1:]))
    cuts = [0]  # the segments' boundaries on the flattened token axis, P per sequence (empty ones too)
    for bos, eos in seqs:
        step = cdiv(eos - bos, P)
        cuts += [min(bos + i * step, eos) for i in range(1, P)] + [eos]
    cu_host = torch.tensor(cuts, dtype=torch.int64)
    h0 = torch.zeros(len(cuts) - 1, HV, K, V + K, **f32)
    h0[..., V:] = torch.eye(K, **f32)
    if x.initial_state is not None:
        h0[::P, :, :, :V] = x.initial_state.transpose(-1, -2) if opts.state_v_first else x.initial_state
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (x.q, x.k, x.v, x.g, x.beta)]
    v_ext = torch.cat([flat[2], flat[2].new_zeros(1, B * T, HV, K)], -1)
    opts_s = dataclasses.replace(opts, shape=KDAShape(1, B * T, s.H, HV, K, V + K, len(cuts) - 1),
                                 output_final_state=True, state_v_first=False)
    x_s = KDAInputs(flat[0], flat[1], v_ext, flat[3], flat[4], x.A_log, x.dt_bias, h0,
                    cu_host.to(dev, torch.int32), cu_host)
    # the short path (its pairs those the cut meant, give or take uneven segments), never cut again
    with tuned(segment_min_tokens=None, short_min_pairs=1):
        plan_s = plan_of(opts_s, x_s, train=False)
    if plan_s.short is not None:
        o_ext, ht_ext = short_forward(opts_s, plan_s, x_s, torch.float32)
    else:
        _, o_ext, ht_ext, _, _ = forward_stages(opts_s, plan_s, plan_s.forward, x_s, o_dtype=torch.float32)
    # the segments' true initial states beyond their own (0 for each sequence's first, whose initial
    # state the call gave), from the maps of those before: S_in(p + 1) = A_p S_in(p) + B_p
    maps = ht_ext.view(len(seqs), P, HV, K, V + K)
    s_in = torch.zeros(len(seqs), P, HV, K, V, **f32)
    S = maps[:, 0, :, :, :V]
    for p in range(1, P):
        s_in[:, p] = S
        S = maps[:, p, :, :, V:] @ S + maps[:, p, :, :, :V]
    o = out_alloc(opts)(1, B * T, HV, V, dtype=x.v.dtype, device=dev)
    so = plan.segment_output
    chunk_indices, _, NT = chunk_tables(cu_host, so.rows, dev)
    if NT > 0:
        NV = cdiv(V, so.bv)
        launch(kda_fwd_segment_output_kernel, (NT * NV, HV), o_ext, s_in, o, x_s.cu_seqlens, chunk_indices, B * T,
               HV=HV, K=K, V=V, C=so.rows, BK=pow2(K), BV=so.bv, NV=NV, SEGMENTS=P, PREC=so.prec,
               **so.launch.kwargs())
    o = o.view(B, T, HV, V)
    if not opts.output_final_state:
        return o, None
    return o, (S.transpose(-1, -2) if opts.state_v_first else S).contiguous()


class Kept(NamedTuple):
    """What the backward reads from the forward beyond the inputs (None where not kept): stage 1's
    intra part always; w, u, qg, kd and the scan's h, v' with ``disable_recompute``."""

    Aqk: torch.Tensor
    gl: torch.Tensor
    gc: torch.Tensor
    ga: torch.Tensor | None
    ls: torch.Tensor
    xs: torch.Tensor
    rs: torch.Tensor
    gd: torch.Tensor | None
    gok: torch.Tensor | None
    xh: torch.Tensor | None
    w: torch.Tensor | None = None
    u: torch.Tensor | None = None
    qg: torch.Tensor | None = None
    kd: torch.Tensor | None = None
    h: torch.Tensor | None = None
    vn: torch.Tensor | None = None


_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")  # saved first, in order


def _kept(p: Stage1, h=None, vn=None) -> Kept:
    """What the backward reads, by field name from stage 1's output (plus the scan's h, v')."""
    return Kept(**{f: getattr(p, f) for f in Kept._fields if f in Stage1._fields}, h=h, vn=vn)


class ChunkKDAFunction(torch.autograd.Function):
    """Forward and backward of the Triton chunk_kda. The context is set up apart from the forward
    (``setup_context``), as torch.func transforms require; what the backward reads from the forward
    (``Kept``) leaves the forward as extra outputs, non-differentiable, and lives in the saved
    tensors only (the chunk tables, cached host-side and possibly made under inference mode, are
    rebuilt instead)."""

    @staticmethod
    def forward(opts: KDAOptions, x: KDAInputs, q, k, v, g, beta, A_log, dt_bias, initial_state):
        # the tensors come again as arguments so that autograd sees them; x carries the rest
        x, bad = graph_inputs(opts, contiguous_inputs(x._replace(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log,
                                                                 dt_bias=dt_bias, initial_state=initial_state)))
        plan = plan_of(opts, x, train=True)
        p, o, ht, h, vn = forward_stages(opts, plan, plan.forward, x)
        poison(bad, o, ht)
        kept = _kept(p, h, vn) if opts.disable_recompute else _kept(p._replace(w=None, u=None, qg=None, kd=None))
        return (o, ht, *kept)

    @staticmethod
    def setup_context(ctx, inputs, output):
        opts, x, *tensors = inputs
        kept = output[2:]
        ctx.mark_non_differentiable(*(t for t in kept if t is not None))
        # no zero-filled gradients for the kept tensors (they would cost as much memory again)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, x.cu_seqlens, *kept)
        # the tensors live in saved_tensors only (a tensor of the graph held on ctx would be a cycle)
        ctx.x = x._replace(**{n: None for n in _INPUTS})
        ctx.opts = opts
        ctx.plan = plan_of(opts, x, train=True)  # the forward's (a cached pure function of the same facts)
        ctx.record = current_record()  # launches of the backward (another thread on CUDA) are recorded too

    @staticmethod
    @once_differentiable  # the kernels' backward has no backward: a double backward raises
    def backward(ctx, do, dht, *_):
        with recording(ctx.record):  # CUDA backwards run in the autograd engine's thread
            opts, plan = ctx.opts, ctx.plan
            saved = ctx.saved_tensors
            x = ctx.x._replace(**dict(zip(_INPUTS, saved[:len(_INPUTS)])))
            k = Kept(*saved[len(_INPUTS):])
            x, bad = graph_inputs(opts, contiguous_inputs(x))
            if do is None:  # a loss of the final state alone (o has v's shape and dtype)
                do = torch.zeros_like(x.v)
            need_dh0 = x.initial_state is not None and ctx.needs_input_grad[9]
            chunk_indices, chunk_offsets, NT_total = chunk_tables_of(opts, x.cu_seqlens, x.cu_seqlens_cpu)
            p = Stage1(**{f: getattr(k, f) for f in Stage1._fields if f in Kept._fields},
                       chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, NT_total=NT_total)
            if opts.disable_recompute:
                stage = [p, k.h, k.vn]
            else:
                stage = _recompute(opts, plan, x, p)
            del k, p, saved
            grads = gradients(opts, plan, x, stage, do, dht, need_dh0)
            poison(bad, *grads)
            return None, None, *grads


def _recompute(opts: KDAOptions, plan: ChunkPlan, x: KDAInputs, intra: Stage1 | None = None) -> list:
    """[stage 1's output, h, v'] for the backward: all of it, or from ``intra`` (forward_stages)."""
    p, _, _, h, vn = forward_stages(opts, plan, plan.recompute, x, intra)
    return [p, h, vn]


def chunk_kda_vjp(opts: KDAOptions, x: KDAInputs, do, dht) -> dict:
    """The gradients of every input from ``do`` and ``dht`` (None: no final state), recomputing the
    forward, without autograd: what the compiled backward (``fastkda.library``) calls, since
    ``torch.func`` hands an autograd Function's backward wrapped tensors, which kernels cannot take."""
    x, bad = graph_inputs(opts, contiguous_inputs(x))
    plan = plan_of(opts, x, train=True)
    grads = gradients(opts, plan, x, _recompute(opts, plan, x), do, dht, x.initial_state is not None)
    poison(bad, *grads)
    return dict(zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"), grads))


def chunk_kda_autograd(opts: KDAOptions, x: KDAInputs):
    """(o, final_state, None) with gradients through the Triton kernels."""
    o, ht = ChunkKDAFunction.apply(opts, x, x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, x.initial_state)[:2]
    return o, ht, None
