"""The autograd Function of the Triton chunk_kda: forward stages 1-2, backward stages 1-2.

By default the forward keeps the part of stage 1 that is costly to recompute (gates, the intra-
chunk matrices Aqk and Akk, the inverse X: ``prepare.fwd_intra``) and the backward recomputes the
cheap rest (w, u, q e^G, k e^(G_last - G): ``prepare.fwd_wu``) and the state scan.

Held from the forward to the backward beyond the inputs, per token and value head, K = V = 128,
C = 64, bf16 inputs (bytes): gc (512), Akk and X (512), X's bfloat16 copy for the w/u kernel (128,
``prepare.X_BF16_TRAIN``), Aqk (128), the row norms and chunk decays (16): 1296 B on the whole-chunk
path (unbounded gates: plus gc's rounding errors gd, 256), 1808 B on the block path (plus ga, 512).
``disable_recompute=True`` keeps w, u, qg, kd and the scan's h, v' as well (1792 B more). The
compiled operator (``chunk_kda_vjp``, ``fastkda.library``) keeps nothing and recomputes all of
stage 1.

Peak memory of the backward, same units: stage 1's w, u (512), gc (512; the block path also ga,
512), Akk, X (512), Aqk (128); the scan's h (512) and v' (256); dH and dv' (1536); the chunk
kernel's dqg, dkd, dw (1536), dAqk, dAkk (512) and dv, dg (512): 6528 B (whole-chunk path) or
7040 B (block path, plus its gate kernel's block sums), i.e. 3.2 or 3.4 GiB for B1 T8192 H64. qg
and kd are freed before the chunk kernel (Aqk too when the backward recomputed it); dq and dk
(before l2norm) reuse the buffers of dqg and dkd.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...options import KDAInputs, KDAOptions
from .bwd_chunk import bwd_chunk, bwd_qk, whole_backward
from .bwd_scan import bwd_scan
from .common import contiguous, contiguous_inputs, dot_config, graph_seqlens
from .prepare import Prepared, chunk_tables_of, fwd_intra, fwd_wu, whole_forward
from .scan import fwd_scan, u_in_scan


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


def forward_stages(opts: KDAOptions, x: KDAInputs, outputs: bool = True, keep: bool = False, train: bool = False,
                   intra: Prepared | None = None):
    """Stage 1 and the scan on contiguous inputs: (stage-1 output, o, final_state, h, v'); see
    ``fwd_scan`` for ``outputs`` and ``keep``. Bounded gates and gates activated in the kernel take
    the whole-chunk path of stage 1 (``prepare.whole_forward``), unless the backward reads it
    (``train``) and needs the block path's scratches (``bwd_chunk.whole_backward``). ``intra``: the
    output of ``fwd_intra`` kept from the forward, from which only ``fwd_wu`` and the scan run."""
    if intra is None:
        whole = whole_forward(opts, train, whole_backward(opts, x.q.dtype))
        intra = fwd_intra(opts, x.q, x.k, x.g, x.beta, x.A_log, x.dt_bias, x.cu_seqlens, x.cu_seqlens_cpu, whole,
                          train)
    p = fwd_wu(opts, intra, x.q, x.k, x.v, x.beta, x.cu_seqlens, with_u=not u_in_scan(opts, intra, keep, x.q.dtype))
    o, ht, h, vn = fwd_scan(opts, p, x.initial_state, x.cu_seqlens, x.v.dtype, *dot_config(x.q.dtype),
                            outputs=outputs, keep=keep, v=x.v, beta=x.beta)
    return p, o, ht, h, vn


class ChunkKDAFunction(torch.autograd.Function):
    """Forward and backward of the Triton chunk_kda. The context is set up apart from the forward
    (``setup_context``), as torch.func transforms require; what the backward reads from the forward
    (``fwd_intra``'s part of stage 1; with ``disable_recompute`` all of stage 1 and the scan's h,
    v') leaves the forward as extra outputs, non-differentiable, and lives in the saved tensors
    only (the chunk tables, cached host-side and possibly made under inference mode, are rebuilt
    instead)."""

    @staticmethod
    def forward(opts: KDAOptions, x: KDAInputs, q, k, v, g, beta, A_log, dt_bias, initial_state):
        # the tensors come again as arguments so that autograd sees them; x carries the rest
        x, bad = graph_inputs(opts, contiguous_inputs(x._replace(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log,
                                                                 dt_bias=dt_bias, initial_state=initial_state)))
        p, o, ht, h, vn = forward_stages(opts, x, keep=opts.disable_recompute, train=True)
        poison(bad, o, ht)
        if opts.disable_recompute:  # stage 1's tensors, the scan's h, v'
            return (o, ht, *p[:11], p.gd, p.gok, p.xh, h, vn)
        return (o, ht, None, None, None, None, *p[4:11], p.gd, p.gok, p.xh)  # fwd_intra's part of stage 1

    @staticmethod
    def setup_context(ctx, inputs, output):
        opts, x, *tensors = inputs
        kept = output[2:]
        ctx.mark_non_differentiable(*(t for t in kept if t is not None))
        # no zero-filled gradients for the kept tensors (they would cost as much memory again)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, x.cu_seqlens, *kept)
        # the tensors live in saved_tensors only (a tensor of the graph held on ctx would be a cycle)
        ctx.x = x._replace(q=None, k=None, v=None, g=None, beta=None, A_log=None, dt_bias=None, initial_state=None,
                           cu_seqlens=None)
        ctx.opts = opts

    @staticmethod
    @once_differentiable  # the kernels' backward has no backward: a double backward raises
    def backward(ctx, do, dht, *_):
        opts = ctx.opts
        q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, *kept = ctx.saved_tensors
        x, bad = graph_inputs(opts, contiguous_inputs(ctx.x._replace(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log,
                                                                     dt_bias=dt_bias, initial_state=h0, cu_seqlens=cu_seqlens)))
        if do is None:  # a loss of the final state alone (o has v's shape and dtype)
            do = torch.zeros_like(x.v)
        need_dh0 = h0 is not None and ctx.needs_input_grad[9]
        p = Prepared(*kept[:11], *chunk_tables_of(opts, x.cu_seqlens, x.cu_seqlens_cpu), *kept[11:14])
        stage = [p, *kept[14:]] if opts.disable_recompute else _recompute(opts, x, p)
        del kept, p
        return gradients(opts, x, stage, do, dht, need_dh0, bad)


def _recompute(opts: KDAOptions, x: KDAInputs, intra: Prepared | None = None) -> list:
    """[stage 1's output, h, v'] for the backward: all of it, or from ``intra`` (see forward_stages)."""
    p, _, _, h, vn = forward_stages(opts, x, outputs=False, keep=True, train=True, intra=intra)
    return [p, h, vn]


def gradients(opts: KDAOptions, x: KDAInputs, stage: list, do, dht, need_dh0: bool, bad=None):
    """Backward stages 1 and 2 from ``stage`` = [stage 1's output, the scan's h, v'] (contiguous
    inputs ``x``): (None, None, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0), as the autograd
    Function returns them. ``stage`` is emptied, so that what only it holds is freed early: qg, kd
    (and Aqk, unless the autograd context keeps it) before the largest stage, the rest before the q/k
    reduction. With use_graph (``bad``: graph_inputs's flag), NaN in every gradient when the
    boundaries broke the contract."""
    p, h, vn = stage
    stage.clear()
    q, k, h0, cu_seqlens = x.q, x.k, x.initial_state, x.cu_seqlens
    DT, PREC, EMU = dot_config(q.dtype)
    do = contiguous(do)
    dht = contiguous(dht) if opts.output_final_state and dht is not None else None
    dhs, dvn, dh0 = bwd_scan(opts, p.qg, p.w, p.kd, p.Aqk, p.gl, do, dht, cu_seqlens, p.chunk_offsets, p.NT_total,
                             need_dh0, DT, PREC, EMU)
    p = p._replace(qg=None, kd=None, Aqk=None)  # read by the scans only: freed before the largest stage
    dqh, dkh, dv, dg, dbeta, dA_log, ddt_bias = bwd_chunk(opts, x, p, vn, h, dhs, do, dvn, cu_seqlens)
    del p, h, vn, dhs, dvn
    dq, dk = bwd_qk(q, dqh, opts.qk_l2norm), bwd_qk(k, dkh, opts.qk_l2norm)
    if opts.graph:  # the l2norm backward reads every row of q, k: the rows after the last sequence
        # get 0 * (their input), which is NaN for a NaN input; they are zero
        tail = (torch.arange(opts.shape.T, device=q.device) >= cu_seqlens[opts.shape.N])[None, :, None, None]
        dq.masked_fill_(tail, 0.0)
        dk.masked_fill_(tail, 0.0)
    if dh0 is not None:
        dh0 = dh0.to(h0.dtype)
    poison(bad, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)
    return None, None, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def chunk_kda_vjp(opts: KDAOptions, x: KDAInputs, do, dht) -> dict:
    """The gradients of every input from ``do`` and ``dht`` (None: no final state), recomputing the
    forward, without autograd: what the compiled backward (``fastkda.library``) calls, since
    ``torch.func`` hands an autograd Function's backward wrapped tensors, which kernels cannot take."""
    x, bad = graph_inputs(opts, contiguous_inputs(x))
    g = gradients(opts, x, _recompute(opts, x), do, dht, x.initial_state is not None, bad)[2:]
    return dict(zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"), g))


def chunk_kda_autograd(opts: KDAOptions, x: KDAInputs):
    """(o, final_state, None) with gradients through the Triton kernels."""
    o, ht = ChunkKDAFunction.apply(opts, x, x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, x.initial_state)[:2]
    return o, ht, None
