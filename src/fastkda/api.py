"""Public operators: validate -> KDAOptions -> backend registry. Same names and defaults as
``fla.ops.kda`` (docs/api.md)."""

from __future__ import annotations

import torch

from . import platform
from .backends import registry
from .backends.registry import explain
from . import library  # noqa: F401  (registers the torch.library custom ops)
from .options import autocast_qkv, chunk_options, foreign_keywords, recurrent_options, state_layout

__all__ = ["chunk_kda", "fused_recurrent_kda", "explain"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    transpose_state_layout: bool | None = None,
    **kwargs,
):
    """Chunked Kimi Delta Attention, forward and backward (training and prefill).

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with ``HV % H == 0`` (GVA when ``HV > H``).
        g: ``[B, T, HV, K]``: the log-space decay, or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]``: post-sigmoid beta, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: multiplies q; defaults to ``K ** -0.5``. Any real number (NumPy's scalars, a
            one-element tensor).
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``).
        output_final_state: also return the last state of every sequence (float32).
        use_qk_l2norm_in_kernel: ``q <- q / sqrt(|q|^2 + 1e-6)``, k likewise.
        use_gate_in_kernel: ``g <- -exp(A_log) softplus(g + dt_bias)``, or with ``lower_bound``
            ``g <- lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` (``A_log`` optional then).
        use_beta_sigmoid_in_kernel / allow_neg_eigval: ``beta <- sigmoid(beta)`` (times 2).
        safe_gate: promise that every gate lies in ``[lower_bound, 0)`` with ``-5 <= lower_bound < 0``;
            enables the fast intra-chunk path. With a pre-gated ``g`` and no ``lower_bound``: the
            promise that ``g`` lies in ``[-5, 0]`` (as fla-core accepts it).
        disable_recompute: keep every forward intermediate for the backward instead of recomputing
            the cheap ones (w, u, q e^G, k e^(G_last - G), the states); the Triton backend's
            autograd keeps the intra-chunk matrices either way (docs/api.md).
        return_intermediate_states: also return ``h``, the state at the start of every chunk,
            ``[B, NT, HV, K, V]`` (varlen: ``[1, total chunks, HV, K, V]``; ``V, K`` last with
            ``state_v_first``) in the dtype of ``q`` (as fla-core returns it); inference mode only.
        state_v_first: states are ``[V, K]`` instead of ``[K, V]``.
        cu_seqlens: ``[N+1]`` int32/int64 sequence boundaries of a flattened batch (B = 1).
            The values are read on every call (one small device-to-host copy for a device tensor).
        cu_seqlens_cpu: the same values on the host: nothing is read back. It vouches for them: a
            CPU ``cu_seqlens`` that differs is a ``ValueError``; a device one is not compared (the
            result is then undefined, the kernels' indices stay in bounds).
        cp_context: a :class:`fastkda.distributed.CPContext`: q, k, v, g, beta are this rank's shard
            of one global (varlen) batch; incoming states come from the ranks before it.
        use_graph: with ``cu_seqlens``, never read the boundaries back to the host, so that a CUDA
            graph of the call (forward and backward) replays with new boundaries of the same
            shape: pad ``cu_seqlens`` with empty sequences to ``max_num_seqs + 1`` entries; it may
            end before T (those rows of the output and of the gradients are zero). Its values are
            not checked on the host: if they break the contract (not starting at 0, decreasing,
            ending past T), the output is NaN. ``cu_seqlens_cpu`` is not used. No effect without
            ``cu_seqlens`` (docs/api.md).
        max_num_seqs: with ``use_graph``, the number of (padded) sequences ``cu_seqlens`` must hold.
        A_log: ``[HV]`` (unit dimensions allowed); dt_bias: ``[HV*K]`` or ``[HV, K]``; chunk_size: 32 or 64.
        transpose_state_layout: the former name of ``state_v_first`` (deprecated: a warning).
        kwargs: as fla-core's, other keywords are accepted: :func:`fused_recurrent_kda`'s (an options
            dict shared by both) and ``head_first=False`` are ignored, a value of theirs that would
            change the result (``ssm_state_indices``, ``inplace_final_state=True``,
            ``head_first=True``) is a ``ValueError``, any other keyword is ignored with a warning
            (once per name).

    Returns:
        ``(o, final_state)``, or ``(o, final_state, h)`` with ``return_intermediate_states``.
        ``o`` has the dtype of ``v``; ``final_state`` is None unless asked for. On meta tensors:
        outputs of the right shapes, nothing computed (not with ``return_intermediate_states``).
    """
    if kwargs:
        foreign_keywords("chunk_kda", kwargs)
    state_v_first = state_layout(state_v_first, transpose_state_layout)
    q, k, v, ctx = autocast_qkv(q, k, v)
    compiling = torch.compiler.is_compiling()
    meta = isinstance(q, torch.Tensor) and q.device.type == "meta"  # shapes only: no values are read
    if compiling and return_intermediate_states:  # before the options read the inference mode, which tracing cannot
        raise NotImplementedError("`return_intermediate_states=True` is not supported under torch.compile")
    if compiling and use_graph is True and cu_seqlens is not None:
        raise NotImplementedError("`use_graph=True` with `cu_seqlens` is not supported under torch.compile")
    opts, inputs = chunk_options(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, A_log=A_log,
        dt_bias=dt_bias, chunk_size=chunk_size, use_graph=use_graph, max_num_seqs=max_num_seqs,
        check_values=not (compiling or meta),
    )
    if meta and return_intermediate_states:
        raise NotImplementedError("`return_intermediate_states=True` is not supported on meta tensors")
    if cp_context is not None:
        from .distributed.cp import chunk_kda_cp

        kw = dict(scale=opts.scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                  safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute, A_log=A_log,
                  dt_bias=dt_bias, chunk_size=chunk_size)
        with ctx:
            return chunk_kda_cp(chunk_kda, q, k, v, g, beta, kw, cp_context), None
    if compiling or meta:  # an opaque custom op (fastkda.library) with fake shapes and autograd
        o, final = torch.ops.fastkda.chunk_kda(
            q, k, v, g, beta, opts.scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, opts.lower_bound,
            state_v_first, cu_seqlens, inputs.A_log, inputs.dt_bias, opts.chunk_size,
        )
        return o, (final if output_final_state else None)
    with ctx:
        o, final, h = registry.dispatch("chunk_kda", opts, inputs)
    if return_intermediate_states:
        return o, final, h.to(q.dtype)  # the input dtype, as fla-core's h (half of float32's memory for 16-bit inputs)
    return o, final


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    raise_on_bad_index: bool = False,
    transpose_state_layout: bool | None = None,
    **kwargs,
):
    """Token-by-token Kimi Delta Attention for decoding, with serving-engine state pools.

    Arguments as :func:`chunk_kda`, plus:
        ssm_state_indices: ``[N]`` slot of every sequence in the pool passed as ``initial_state``
            (``[num_slots, HV, K, V]``, any strides: a view of a wider cache is read and written
            where it lies); ``-1`` marks a padding sequence: zero output, nothing touched.
            ``[N, 1 + num_draft]`` for speculative decoding. With ``inplace_final_state`` no two
            sequences of a call may touch one slot (read or write it); sequences that only read
            may share one, and one sequence may name a slot twice in its row (its later token's
            state stays there).
        num_accepted_tokens: ``[N]``; sequence n starts from slot
            ``ssm_state_indices[n, num_accepted_tokens[n] - 1]``.
        inplace_final_state: write the final state into ``initial_state`` (at the slots of
            ``ssm_state_indices``; with speculative decoding the state after token t goes to slot
            ``ssm_state_indices[n, t]``). The returned final state is then that tensor. A state
            whose elements overlap in memory (an expanded view) is a ``ValueError``.
        initial_state: unlike :func:`chunk_kda`'s, float32 or bfloat16 (a serving engine's pool
            of that cache dtype): read into float32, updated in float32, written back rounded to
            nearest; a returned final state other than the pool itself is float32.
        raise_on_bad_index: what a bad pool index (a slot outside ``[0, num_slots)`` other than
            -1, a ``num_accepted_tokens`` outside ``[1, 1 + num_draft]``, more tokens than columns,
            a slot shared by two sequences of an in-place call) or bad ``cu_seqlens`` values (not
            from 0, non-decreasing, to T) do on the Triton backend, which checks them on the
            device. Either way the call writes no state and returns zeros, and the decode kernel
            never touches memory outside the pool. False
            (default): the call does not synchronise with the host, and :func:`decode_error` reports
            the error later. True: the call reads its check back (one synchronisation) and raises
            ``ValueError``; not while a CUDA graph is being captured (a replay cannot raise; it
            reports through :func:`decode_error`). The PyTorch backend checks on the host and
            raises either way.
        transpose_state_layout: the former name of ``state_v_first`` (deprecated: a warning).
        kwargs: as :func:`chunk_kda`'s: its own keywords (``safe_gate``, ``chunk_size``, ...) and
            ``head_first=False`` are ignored (``cp_context`` and ``return_intermediate_states=True``
            are a ``ValueError``), any other keyword is ignored with a warning (once per name).

    Returns:
        ``(o, final_state)``; ``final_state`` is ``[N, HV, K, V]`` float32 with
        ``output_final_state``, the updated pool with ``inplace_final_state``, else None.
    """
    if kwargs:
        foreign_keywords("fused_recurrent_kda", kwargs)
    state_v_first = state_layout(state_v_first, transpose_state_layout)
    q, k, v, ctx = autocast_qkv(q, k, v)
    compiling = torch.compiler.is_compiling()
    opts, inputs = recurrent_options(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
        inplace_final_state=inplace_final_state, raise_on_bad_index=raise_on_bad_index, check_values=not compiling,
    )
    if compiling:  # the in-place op (a pool written in place) has no backward; the functional one has
        op = torch.ops.fastkda.fused_recurrent_kda if inplace_final_state else torch.ops.fastkda.fused_recurrent_kda_functional
        o, final = op(
            q, k, v, g, beta, inputs.A_log, inputs.dt_bias, opts.scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            opts.lower_bound, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, inplace_final_state,
            raise_on_bad_index,
        )
        if inplace_final_state:
            return o, initial_state
        return o, (final if output_final_state else None)
    with ctx:
        return registry.dispatch("fused_recurrent_kda", opts, inputs)


def decode_error(device=None) -> str | None:
    """What was wrong with the pool indices or the ``cu_seqlens`` of the first Triton
    ``fused_recurrent_kda`` call with ``ssm_state_indices`` or ``cu_seqlens`` on ``device``
    (default: the current CUDA device) that did not raise (the default
    ``raise_on_bad_index=False``, or a graph replay) since the last read, or None if there is none;
    reading it clears it, and nothing else does: a later call, good or bad, from any thread or
    stream, neither overwrites nor clears it.

    Such a call checks its indices and boundaries on the device (slots in the pool, accepted-token
    counts, tokens per sequence, with ``inplace_final_state`` no slot shared by two sequences;
    cu_seqlens from 0, non-decreasing, to T) and, finding a bad one, writes no state and returns
    zeros. An engine calls this after a step or a
    graph replay (it reads a device flag: one synchronisation). The PyTorch backend checks on the
    host and raises at once.
    """
    dev = platform.resolve_device(device)
    for backend in registry.backends():
        error = backend.take_decode_error(dev)
        if error is not None:
            return error
    return None


registry.register_operator(chunk_kda, "chunk_kda")
registry.register_operator(fused_recurrent_kda, "fused_recurrent_kda")
