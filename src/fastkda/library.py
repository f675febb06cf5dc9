"""``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)`` sees the operators as
opaque nodes with known output shapes. Each op's implementation is the eager public function.

``fastkda::chunk_kda`` and its backward ``fastkda::chunk_kda_backward`` (which calls the chosen
backend's own ``chunk_kda_vjp`` where it has one, else recomputes the forward with autograd
through the backend's differentiable implementation); ``fastkda::fused_recurrent_kda`` (it may
write the state pool in place: forward only) and ``fastkda::fused_recurrent_kda_functional`` (the
same without the in-place write) with its backward ``fastkda::fused_recurrent_kda_backward``
(recomputed with autograd, as above). The public functions (:mod:`fastkda.api`) route here only
while compiling; eager calls go straight to the backend registry, as the ops' bodies do.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from .backends import registry
from .dtypes import state_dtype
from .options import autocast_qkv, chunk_options, recurrent_options


_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _chunk_options(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                   state_v_first, cu_seqlens, A_log, dt_bias, chunk_size):
    """(options, inputs) of a chunk_kda call; its parameters are the op's arguments, in order."""
    return chunk_options(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=False, return_intermediate_states=False,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None, cp_context=None, A_log=A_log,
        dt_bias=dt_bias, chunk_size=chunk_size)


def _chunk(q, k, v, *args):
    """The eager operator, as ``fastkda.chunk_kda`` runs it (inside a custom op nothing is being
    compiled): the options, then the backend the registry picks (_chunk_options's arguments)."""
    q, k, v, ctx = autocast_qkv(q, k, v)
    opts, inputs = _chunk_options(q, k, v, *args)
    with ctx:
        o, final, _ = registry.dispatch("chunk_kda", opts, inputs)
    return o, final


@torch.library.custom_op("fastkda::chunk_kda", mutates_args=())
def chunk_kda_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Optional[Tensor],
    output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool, lower_bound: Optional[float],
    state_v_first: bool, cu_seqlens: Optional[Tensor], A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    o, final = _chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                      state_v_first, cu_seqlens, A_log, dt_bias, chunk_size)
    o = o.detach().contiguous()
    return o, (final.detach().contiguous() if final is not None else q.new_empty(0, dtype=torch.float32))


def _state_shape(q, v, initial_state, cu_seqlens, state_v_first):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


@chunk_kda_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
      use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias,
      chunk_size):
    o = v.new_empty(v.shape)
    if not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    return o, q.new_empty(_state_shape(q, v, initial_state, cu_seqlens, state_v_first), dtype=state_dtype(q.dtype))


def _chunk_backend(*args):
    """(backend, options, inputs) the registry picks for this chunk_kda call (_chunk_options's arguments)."""
    opts, inputs = _chunk_options(*args)
    return registry.select("chunk_kda", opts, inputs)[0], opts, inputs


@torch.library.custom_op("fastkda::chunk_kda_backward", mutates_args=())
def chunk_kda_backward_op(
    do: Tensor, dfinal: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool,
    lower_bound: Optional[float], state_v_first: bool, cu_seqlens: Optional[Tensor], A_log: Optional[Tensor],
    dt_bias: Optional[Tensor], chunk_size: int,
) -> list[Tensor]:
    """Gradients of (q, k, v, g, beta, initial_state, A_log, dt_bias); empty for absent inputs."""
    named = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    diff = [n for n, t in named.items() if t is not None and t.is_floating_point()]
    with_final = output_final_state and dfinal.numel() > 0

    def forward(*ts):
        a = {**named, **dict(zip(diff, ts))}
        o, final = _chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], scale, a["initial_state"], with_final,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          safe_gate, lower_bound, state_v_first, cu_seqlens, a["A_log"], a["dt_bias"], chunk_size)
        return (o, final) if with_final else (o,)

    backend, opts, inputs = _chunk_backend(q, k, v, g, beta, scale, initial_state, with_final, use_qk_l2norm_in_kernel,
                                           use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                           lower_bound, state_v_first, cu_seqlens, A_log, dt_bias, chunk_size)
    if hasattr(backend, "chunk_kda_vjp"):  # kernels with their own backward: called directly
        got = backend.chunk_kda_vjp(opts, inputs, do, dfinal if with_final else None)
        return _grad_list(named, got)
    return _grad_list(named, _vjp(forward, named, diff, do, dfinal, with_final))


def _vjp(forward, named: dict, diff: list, do, dfinal, with_final: bool) -> dict:
    """{name: gradient} of the inputs ``diff`` of ``forward(*tensors) -> (o[, final])``, recomputed
    with autograd (custom ops run below the autograd dispatch key; torch.func's own transform
    still records)."""
    _, vjp = torch.func.vjp(forward, *(named[n] for n in diff))
    return dict(zip(diff, vjp((do, dfinal) if with_final else (do,))))


def _grad_list(named: dict, got: dict) -> list:
    """The gradients in _GRAD_NAMES order, each laid out as its input (the fake implementation's
    layout; zeros where none reached it), empty for absent inputs."""
    res = []
    for n in _GRAD_NAMES:
        t = named[n]
        if t is None:
            res.append(named["q"].new_empty(0))
        else:
            d = got.get(n)
            out = torch.empty_like(t)
            res.append(out.zero_() if d is None else out.copy_(d))
    return res


def _grads_fake(named: dict) -> list:
    return [named["q"].new_empty(0) if named[n] is None else torch.empty_like(named[n]) for n in _GRAD_NAMES]


@chunk_kda_backward_op.register_fake
def _(do, dfinal, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
      cu_seqlens, A_log, dt_bias, chunk_size):
    return _grads_fake(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias))


_ARG_NAMES = tuple(inspect.signature(_chunk_options).parameters)  # the op's arguments, in order


def _register_autograd(op, arg_names: tuple, backward_op) -> None:
    """Autograd of ``op`` (arguments ``arg_names``, outputs (o, final)): the backward op takes
    (do, dfinal, *the op's arguments) and returns the gradients in _GRAD_NAMES order."""

    def setup_context(ctx, inputs, output):
        ctx.args = dict(zip(arg_names, inputs))
        ctx.tensor_names = [n for n in arg_names if isinstance(ctx.args[n], Tensor)]
        ctx.save_for_backward(*(ctx.args[n] for n in ctx.tensor_names))

    def backward(ctx, do, dfinal):
        args = dict(ctx.args)
        args.update(zip(ctx.tensor_names, ctx.saved_tensors))
        grads = dict(zip(_GRAD_NAMES, backward_op(do, dfinal, *(args[n] for n in arg_names))))
        return tuple(grads.get(n) if args[n] is not None and n in grads else None for n in arg_names)

    op.register_autograd(backward, setup_context=setup_context)


_register_autograd(chunk_kda_op, _ARG_NAMES, chunk_kda_backward_op)


def _fused_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    scale: float, initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: Optional[float],
    state_v_first: bool, cu_seqlens: Optional[Tensor], ssm_state_indices: Optional[Tensor],
    num_accepted_tokens: Optional[Tensor], inplace_final_state: bool, raise_on_bad_index: bool,
) -> tuple[Tensor, Tensor]:
    """The eager operator; the final state is an empty tensor when it is not asked for or is the
    pool itself (a custom op's output may not alias an input). Runs as ``fastkda.fused_recurrent_kda``
    does: the options, then the backend the registry picks."""
    q, k, v, ctx = autocast_qkv(q, k, v)
    opts, inputs = recurrent_options(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
        inplace_final_state=inplace_final_state, raise_on_bad_index=raise_on_bad_index,
    )
    with ctx:
        o, final = registry.dispatch("fused_recurrent_kda", opts, inputs)
    if inplace_final_state or final is None:
        final = q.new_empty(0, dtype=torch.float32)
    return o.contiguous(), final.contiguous()


def _fused_recurrent_fake(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          lower_bound, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                          inplace_final_state, raise_on_bad_index):
    o = v.new_empty(v.shape)
    if inplace_final_state or not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    return o, q.new_empty(_state_shape(q, v, None, cu_seqlens, state_v_first), dtype=state_dtype(q.dtype))


# in place (decoding into a pool): forward only
fused_recurrent_kda_op = torch.library.custom_op("fastkda::fused_recurrent_kda", _fused_recurrent,
                                                 mutates_args=("initial_state",))
fused_recurrent_kda_op.register_fake(_fused_recurrent_fake)
# without the in-place write: differentiable
fused_recurrent_kda_functional_op = torch.library.custom_op("fastkda::fused_recurrent_kda_functional",
                                                            _fused_recurrent, mutates_args=())
fused_recurrent_kda_functional_op.register_fake(_fused_recurrent_fake)

_REC_ARG_NAMES = tuple(inspect.signature(_fused_recurrent).parameters)


@torch.library.custom_op("fastkda::fused_recurrent_kda_backward", mutates_args=())
def fused_recurrent_kda_backward_op(
    do: Tensor, dfinal: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
    dt_bias: Optional[Tensor], scale: float, initial_state: Optional[Tensor], output_final_state: bool,
    use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
    lower_bound: Optional[float], state_v_first: bool, cu_seqlens: Optional[Tensor], ssm_state_indices: Optional[Tensor],
    num_accepted_tokens: Optional[Tensor], inplace_final_state: bool, raise_on_bad_index: bool,
) -> list[Tensor]:
    """Gradients of (q, k, v, g, beta, initial_state, A_log, dt_bias) of the functional op, from a
    recomputation with autograd (the backend registry picks one with this op's backward)."""
    named = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    diff = [n for n, t in named.items() if t is not None and t.is_floating_point()]
    with_final = output_final_state and dfinal.numel() > 0

    def forward(*ts):
        a = {**named, **dict(zip(diff, ts))}
        o, final = _fused_recurrent(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], scale,
                                    a["initial_state"], with_final, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                                    cu_seqlens, ssm_state_indices, num_accepted_tokens, False, raise_on_bad_index)
        return (o, final) if with_final else (o,)

    return _grad_list(named, _vjp(forward, named, diff, do, dfinal, with_final))


@fused_recurrent_kda_backward_op.register_fake
def _(do, dfinal, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, *rest):
    return _grads_fake(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias))


_register_autograd(fused_recurrent_kda_functional_op, _REC_ARG_NAMES, fused_recurrent_kda_backward_op)
