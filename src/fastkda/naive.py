"""Plain references, float64 by default: a per-token recurrence and the chunked form of docs/math.md section 2.

They favour obviousness over speed and are what every backend is tested against. Both take every
option of the public operators (GVA, varlen, states, state_v_first, l2norm, beta sigmoid,
allow_neg_eigval, scale and all gate modes) and return float64 tensors unless told otherwise.
"""

from __future__ import annotations

import torch

__all__ = [
    "naive_kda_gate",
    "naive_kda_lowerbound_gate",
    "naive_recurrent_kda",
    "naive_chunk_kda",
    "activate",
]


def _compute_dtype(*ts: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def naive_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``-exp(A_log) * softplus(g + dt_bias)`` for ``g`` of shape ``[..., H, K]``, ``A_log [H]``,
    ``dt_bias [H*K]``; computed in float32 (float64 for float64 inputs)."""
    H = g.shape[-2]
    cdt = _compute_dtype(g, A_log, dt_bias)
    x = g.to(cdt)
    if dt_bias is not None:
        x = x + dt_bias.to(cdt).view(H, -1)
    softplus = torch.logaddexp(x, torch.zeros_like(x))  # exact, no threshold
    return (-A_log.to(cdt).view(H, 1).exp() * softplus).to(output_dtype)


def naive_kda_lowerbound_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, in ``[lower_bound, 0)``; without
    ``A_log`` it is ``lower_bound * sigmoid(g + dt_bias)``."""
    H = g.shape[-2]
    cdt = _compute_dtype(g, A_log, dt_bias)
    x = g.to(cdt)
    if dt_bias is not None:
        x = x + dt_bias.to(cdt).view(H, -1)
    if A_log is not None:
        x = A_log.to(cdt).view(H, 1).exp() * x
    # exp(logsigmoid(x)) equals sigmoid(x), but its gradient is formed as y * sigmoid(-x): the autograd
    # of sigmoid forms y * (1 - y), which is 0 in float32 once y rounds to 1 (x > ~16.6)
    return (lower_bound * torch.exp(torch.nn.functional.logsigmoid(x))).to(output_dtype)


def activate(
    q, k, v, g, beta, *, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, dtype=torch.float64,
):
    """The per-token preprocessing of docs/math.md section 1, in ``dtype``.

    Returns ``q, k`` expanded to the value heads ``[B, T, HV, K]``, ``v``, the log-space decay ``g``
    and the effective ``beta``.
    """
    H, HV = q.shape[2], v.shape[2]
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        if lower_bound is None:
            g = naive_kda_gate(g.to(dtype), A_log.to(dtype), None if dt_bias is None else dt_bias.to(dtype), dtype)
        else:
            g = naive_kda_lowerbound_gate(
                g.to(dtype), None if A_log is None else A_log.to(dtype),
                None if dt_bias is None else dt_bias.to(dtype), lower_bound, dtype,
            )
    else:
        g = g.to(dtype)
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    return q, k, v, g, beta


def _sequences(T: int, B: int, cu_seqlens):
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _initial(initial_state, n, HV, K, V, state_v_first, dtype, device):
    if initial_state is None:
        return torch.zeros(HV, K, V, dtype=dtype, device=device)
    h = initial_state[n].to(dtype)
    return h.transpose(-1, -2) if state_v_first else h


def naive_recurrent_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
    dtype=torch.float64, return_all_states=False,
):
    """Token-by-token KDA (docs/math.md section 1).

    Returns ``(o, final_state)``: ``o [B, T, HV, V]``, ``final_state [N, HV, K, V]`` (``[N, HV, V, K]``
    with ``state_v_first``) or None, both in ``dtype``. With ``return_all_states=True`` a third item
    holds the state after every token, ``[B, T, HV, K, V]`` (same layout rule).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = activate(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, dtype=dtype,
    )
    o = torch.zeros(B, T, HV, V, dtype=dtype, device=q.device)
    states = torch.zeros(B, T, HV, K, V, dtype=dtype, device=q.device) if return_all_states else None
    finals = []
    for n, (b, bos, eos) in enumerate(_sequences(T, B, cu_seqlens)):
        S = _initial(initial_state, n, HV, K, V, state_v_first, dtype, q.device)  # [HV, K, V]
        for t in range(bos, eos):
            S = S * g[b, t].exp()[..., None]  # decay every key channel
            k_t = k[b, t]  # [HV, K]
            delta = beta[b, t][:, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k_t, S))
            S = S + k_t[..., None] * delta[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
            if states is not None:
                states[b, t] = S
        finals.append(S)
    final = None
    if output_final_state:
        final = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, dtype=dtype, device=q.device)
        if state_v_first:
            final = final.transpose(-1, -2)
    if return_all_states:
        return o, final, (states.transpose(-1, -2) if state_v_first else states)
    return o, final


def naive_chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
    chunk_size=64, dtype=torch.float64, return_intermediate_states=False,
):
    """The chunked form of docs/math.md section 2, written plainly (one sequence, one chunk at a time).

    Within a chunk with cumulative gate G: ``(I + L) A = Diag(beta)``,
    ``L_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)`` (j < i), ``w = A (k exp(G))``, ``u = A v``;
    across chunks ``v' = u - w S``, ``o = scale (q exp(G)) S + Aqk v'``,
    ``S <- exp(G_last) S + (k exp(G_last - G))^T v'``.
    Returns ``(o, final_state)`` or ``(o, final_state, h)`` with ``h`` the state at the start of
    every chunk, ``[B, NT, HV, K, V]`` (varlen: ``[1, total chunks, HV, K, V]``).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = activate(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, dtype=dtype,
    )
    o = torch.zeros(B, T, HV, V, dtype=dtype, device=q.device)
    finals, hs = [], []
    for n, (b, bos, eos) in enumerate(_sequences(T, B, cu_seqlens)):
        S = _initial(initial_state, n, HV, K, V, state_v_first, dtype, q.device)
        h_seq = []
        for cs in range(bos, eos, C):
            ce = min(cs + C, eos)
            h_seq.append(S)
            qc, kc, vc = q[b, cs:ce].transpose(0, 1), k[b, cs:ce].transpose(0, 1), v[b, cs:ce].transpose(0, 1)
            bc = beta[b, cs:ce].transpose(0, 1)  # [HV, c]
            G = g[b, cs:ce].transpose(0, 1).cumsum(1)  # [HV, c, K]
            c = ce - cs
            i_idx = torch.arange(c, device=q.device)
            below = i_idx[:, None] > i_idx[None, :]  # j < i
            diff = G[:, :, None, :] - G[:, None, :, :]  # [HV, i, j, K]; used only where j <= i
            decay = torch.where((below | (i_idx[:, None] == i_idx[None, :]))[..., None], diff, -torch.inf).exp()
            Akk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay) * below
            Aqk = scale * torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
            L = bc[:, :, None] * Akk
            # (I + L) X = rhs by a unit lower-triangular solve (differentiable, unlike row updates in place)
            rhs = torch.cat([bc[..., None] * kc * G.exp(), bc[..., None] * vc], -1)
            X = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
            w, u = X[..., :K], X[..., K:]
            vn = u - w @ S
            o[b, cs:ce] = (scale * (qc * G.exp()) @ S + Aqk @ vn).transpose(0, 1)
            S = G[:, -1, :, None].exp() * S + (kc * (G[:, -1:, :] - G).exp()).transpose(1, 2) @ vn
        finals.append(S)
        hs.append(h_seq)
    final = None
    if output_final_state:
        final = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, dtype=dtype, device=q.device)
        if state_v_first:
            final = final.transpose(-1, -2)
    if not return_intermediate_states:
        return o, final
    if cu_seqlens is not None:  # all chunks of all sequences, in order, batch 1
        hs = [[h for h_seq in hs for h in h_seq]]
    if any(hs):
        h = torch.stack([torch.stack(h_seq) for h_seq in hs])
    else:
        h = torch.zeros(len(hs), 0, HV, K, V, dtype=dtype, device=q.device)
    return o, final, (h.transpose(-1, -2) if state_v_first else h)
