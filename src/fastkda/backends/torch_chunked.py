"""PyTorch backend: the chunked algorithm vectorised over sequences, heads and chunks.

Runs on any device, float32 arithmetic (float64 for float64 inputs), autograd by torch. Sequences
(dense rows or varlen segments) are laid out as ``[N, NT*C]`` with zero padding: a padded token has
g = 0, k = q = v = 0 and beta = 0, so it changes no state and its output is dropped.

Intra-chunk decay factors ``exp(G_i - G_j)`` are never formed from ``exp(G)`` alone: pairs of
sub-blocks are anchored at a token between them so every exponent stays small (see
``intra_chunk`` and docs/math.md). Cumulative gates are summed in float64 so that their
differences stay exact for large gates.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..naive import activate, naive_kda_gate, naive_kda_lowerbound_gate
from ..options import GateMode, GateOptions, KDAInputs, KDAOptions, check_seqlens, graph_chunk_slots
from .registry import Backend

def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class SeqLayout:
    """Maps ``[B, T, ...]`` tensors (dense, or varlen with B = 1) to padded ``[N, NT*C, ...]``."""

    def __init__(self, B: int, T: int, C: int, cu_host: torch.Tensor | None, device):
        self.B, self.T, self.C = B, T, C
        self.varlen = cu_host is not None
        if self.varlen:
            cu = cu_host.tolist()
            self.lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        else:
            self.lens = [T] * B
        self.N = len(self.lens)
        # a dense batch keeps its T even when B = 0 (the output is [0, T, ...])
        self.NT = max((math.ceil(n / C) for n in self.lens), default=0) if self.varlen else math.ceil(T / C)
        self.Tp = self.NT * C
        if self.varlen:
            starts = cu[:-1]
            pos = torch.arange(self.Tp)
            src = torch.tensor(starts, dtype=torch.long)[:, None] + pos[None, :]
            valid = pos[None, :] < torch.tensor(self.lens, dtype=torch.long)[:, None]
            self.src = torch.where(valid, src, T).to(device)  # T indexes the appended zero row
            dst = [n * self.Tp + torch.arange(L) for n, L in enumerate(self.lens)]
            self.dst = (torch.cat(dst) if dst else torch.zeros(0, dtype=torch.long)).to(device)  # no sequences: none

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        if self.varlen:
            flat = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
            return flat[self.src]
        pad = [0, 0] * (x.ndim - 2) + [0, self.Tp - self.T]
        return F.pad(x, pad)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        if self.varlen:
            return y.reshape(self.N * self.Tp, *y.shape[2:])[self.dst][None]
        return y[:, : self.T]

    def chunk_valid(self) -> torch.Tensor:
        """[N, NT] bool: the chunk holds at least one real token."""
        nt = torch.tensor([math.ceil(n / self.C) for n in self.lens], dtype=torch.long)
        return torch.arange(self.NT)[None, :] < nt[:, None]


def _activate(opts: KDAOptions, x: KDAInputs, dtype):
    return activate(
        x.q, x.k, x.v, x.g, x.beta, use_qk_l2norm_in_kernel=opts.qk_l2norm,
        use_gate_in_kernel=opts.gate is not GateMode.PREGATED, A_log=x.A_log, dt_bias=x.dt_bias,
        lower_bound=opts.lower_bound, use_beta_sigmoid_in_kernel=opts.beta_sigmoid,
        allow_neg_eigval=opts.allow_neg_eigval, dtype=dtype,
    )


MIN_BLOCK = 16  # smallest diagonal block taken with one mid-anchored product
MAX_HALF_SPAN = 64.0  # mid-anchored factors stay within exp(+-64): far from float32 overflow


def _fill_blocks(A, blocks, s, offset=0):
    """Copy [..., P, s, s] blocks into every (2s or s)-token diagonal block of A [..., C, C]:
    into its (later half, earlier half) corner for offset=1 (rows p*2s+s.., cols p*2s..), or
    onto the diagonal blocks themselves for offset=0 (rows and cols p*s..)."""
    P = blocks.shape[-3]
    w = s * (1 + offset)
    view = torch.diagonal(A.unflatten(-1, (P, w)).unflatten(-3, (P, w)), dim1=-4, dim2=-2)  # [..., w, w, P]
    view[..., offset * s :, : s, :].copy_(blocks.movedim(-3, -1))


def _anchored_level(Aqk, Akk, qc, kc, G64, s):
    """Pair the halves a < b of every 2s-token block, anchored at b's first token m:
    ``exp(G_i - G_j) = exp(G_i - G_m) * exp(G_m - G_j)``, both exponents <= 0 for any gate."""
    P = qc.shape[-2] // (2 * s)
    qv, kv, Gv = (t.unflatten(-2, (P, 2, s)) for t in (qc, kc, G64))  # [..., P, 2, s, K]
    Gm = Gv[..., 1, :1, :]  # [..., P, 1, K]
    row = (Gv[..., 1, :, :] - Gm).to(qc.dtype).exp()  # [..., P, s, K]
    kcol = (kv[..., 0, :, :] * (Gm - Gv[..., 0, :, :]).to(qc.dtype).exp()).transpose(-1, -2)  # [..., P, K, s]
    _fill_blocks(Aqk, (qv[..., 1, :, :] * row) @ kcol, s, 1)
    _fill_blocks(Akk, (kv[..., 1, :, :] * row) @ kcol, s, 1)


def _half_span(G64, bs: int) -> float:
    """Largest sum of gates between a bs-token block's first (or last) token and its middle."""
    Gb = G64.unflatten(-2, (G64.shape[-2] // bs, bs))
    Gmid = Gb[..., bs // 2 : bs // 2 + 1, :]
    return max((Gb[..., :1, :] - Gmid).amax().item(), (Gmid - Gb[..., -1:, :]).amax().item())


def intra_chunk(qc, kc, G64, scale):
    """Aqk (j <= i, times scale) and Akk (j < i) of every chunk, without overflow for any gate.

    qc, kc: [..., C, K]; G64: the within-chunk cumulative gate in float64, so that differences of
    long sums stay exact. Diagonal blocks of bs tokens take one product anchored at their middle
    token, ``(x e^(G - G_mid)) (k e^(G_mid - G))^T``, with bs the largest of C, C/2, .., 16 whose
    factors stay within exp(MAX_HALF_SPAN) (the safe path of the spec; any gate when none fits:
    bs = 1). Above bs, halves of 2s-token blocks are paired and anchored at the later half's first
    token, so every exponent is <= 0. Returns two [..., C, C].
    """
    C = qc.shape[-2]
    Aqk = qc.new_zeros(*qc.shape[:-1], C)
    Akk = torch.zeros_like(Aqk)
    if qc.numel() == 0:
        return Aqk, Akk
    bs = C
    while bs >= MIN_BLOCK and _half_span(G64, bs) > MAX_HALF_SPAN:
        bs //= 2
    if bs < MIN_BLOCK:
        bs = 1
    s = C // 2
    while s >= bs:
        _anchored_level(Aqk, Akk, qc, kc, G64, s)
        s //= 2
    if bs == 1:
        Aqk += torch.diag_embed((qc * kc).sum(-1))  # exp(G_i - G_i) = 1
    else:
        NB = C // bs
        Gb = G64.unflatten(-2, (NB, bs))
        d = (Gb - Gb[..., bs // 2 : bs // 2 + 1, :]).to(qc.dtype)  # [..., NB, bs, K]
        up = d.exp()
        kb = (kc.unflatten(-2, (NB, bs)) * (-d).exp()).transpose(-1, -2)  # [..., NB, K, bs]
        ar = torch.arange(bs, device=qc.device)
        for A, x, keep in ((Aqk, qc, ar[:, None] >= ar[None, :]), (Akk, kc, ar[:, None] > ar[None, :])):
            _fill_blocks(A, torch.where(keep, (x.unflatten(-2, (NB, bs)) * up) @ kb, 0.0), bs)
    return Aqk * scale, Akk


def chunk_forward(opts: KDAOptions, x: KDAInputs):
    """(o, final_state, h) of chunk_kda; h is None unless intermediate states are asked for."""
    if opts.graph:
        return _graph_chunk_forward(opts, x)
    s, C = opts.shape, opts.chunk_size
    cdt = compute_dtype(x.q)
    q, k, v, g, beta = _activate(opts, x, cdt)  # [B, T, HV, *]
    lay = SeqLayout(s.B, s.T, C, x.cu_seqlens_cpu, q.device)
    N, NT = lay.N, lay.NT

    def chunks(t):  # [B, T, HV, *] -> chunk-major [NT, N, HV, C, *]
        t = lay.pad(t).unflatten(1, (NT, C))
        return (t.permute(1, 0, 3, 2, 4) if t.ndim == 5 else t.permute(1, 0, 3, 2)).contiguous()

    qc, kc, vc, gc, bc = (chunks(t) for t in (q, k, v, g, beta))
    G64 = gc.to(torch.float64).cumsum(-2)
    G = G64.to(cdt)
    Aqk, Akk = intra_chunk(qc, kc, G64, opts.scale)
    # (I + Diag(beta) Akk) [w u] = Diag(beta) [k exp(G), v]
    eye = torch.eye(C, dtype=cdt, device=q.device)
    eG = G.exp()
    rhs = bc[..., None] * torch.cat([kc * eG, vc], -1)
    wu = torch.linalg.solve_triangular(eye + bc[..., None] * Akk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., : s.K], wu[..., s.K :]
    qg = qc * eG * opts.scale
    kd = (kc * (G64[..., -1:, :] - G64).to(cdt).exp()).transpose(-1, -2)  # k exp(G_last - G): [NT, N, HV, K, C]
    decay_last = G[..., -1:, :].transpose(-1, -2).exp()  # [NT, N, HV, K, 1]

    if x.initial_state is not None:
        S = x.initial_state.to(cdt)
        S = S.transpose(-1, -2) if opts.state_v_first else S
    else:
        S = q.new_zeros(N, s.HV, s.K, s.V)
    u3, w3, kd3, dl3 = (t.flatten(1, 2) for t in (u, w, kd, decay_last))  # batch dims merged for baddbmm
    S = S.reshape(N * s.HV, s.K, s.V)
    hs, vns = [], []
    for t in range(NT):  # only the state recurrence is sequential; outputs are batched after it
        hs.append(S)
        vns.append(torch.baddbmm(u3[t], w3[t], S, alpha=-1))  # v' = u - w S
        S = torch.baddbmm(dl3[t] * S, kd3[t], vns[-1])
    S = S.view(N, s.HV, s.K, s.V)
    if NT:
        H_all = torch.stack(hs).view(NT, N, s.HV, s.K, s.V)  # state at every chunk start
        o_pad = (qg @ H_all + Aqk @ torch.stack(vns).view_as(u)).permute(1, 0, 3, 2, 4)  # [N, NT, C, HV, V]
    else:
        H_all, o_pad = q.new_zeros(0, N, s.HV, s.K, s.V), q.new_zeros(N, 0, C, s.HV, s.V)
    o = lay.unpad(o_pad.flatten(1, 2)).to(x.v.dtype).contiguous()  # [B, T, HV, V]

    final = None
    if opts.output_final_state:
        final = S.transpose(-1, -2) if opts.state_v_first else S
    h = None
    if opts.return_intermediate_states:
        h = H_all.transpose(0, 1)  # [N, NT, HV, K, V]
        if lay.varlen:
            h = h[lay.chunk_valid().to(h.device)][None]
        if opts.state_v_first:
            h = h.transpose(-1, -2)
    return o, final, h


def _graph_chunk_forward(opts: KDAOptions, x: KDAInputs):
    """use_graph on this backend: the boundaries read and checked on the host (this backend cannot
    be captured in a CUDA graph), the call run on the rows they cover, and the results laid out as
    the Triton backend's: zero rows after the last sequence (their inputs never read, so neither
    they nor their gradients can carry NaN into the others) and h with one slot per chunk slot of
    its fixed-size tables."""
    from .. import platform

    if platform.capturing(x.cu_seqlens.device):
        raise NotImplementedError("use_graph: the PyTorch backend reads `cu_seqlens` on the host and cannot be "
                                  "captured in a CUDA graph (the Triton backend, which can, declined this call: "
                                  "see fastkda.explain)")
    s, C = opts.shape, opts.chunk_size
    cu_host = x.cu_seqlens.detach().to("cpu", torch.int64)
    check_seqlens(cu_host.tolist(), s.T, short_ok=True)
    n = int(cu_host[-1])
    rows = {f: getattr(x, f)[:, :n] for f in ("q", "k", "v", "g", "beta")}
    inner = dataclasses.replace(opts, shape=dataclasses.replace(s, T=n), graph=False)
    o, final, h = chunk_forward(inner, x._replace(**rows, cu_seqlens_cpu=cu_host))
    o = F.pad(o, [0, 0] * (o.ndim - 2) + [0, s.T - n])
    if h is not None:
        h = F.pad(h, [0, 0] * (h.ndim - 2) + [0, graph_chunk_slots(s.T, s.N, C) - h.shape[1]])
    return o, final, h


# ----------------------------------------------------------------------------------------------
# decoding


def check_pool_indices(opts: KDAOptions, x: KDAInputs, lens: list[int]) -> None:
    """Value checks of the pool indices (host side); raises before anything is written."""
    idx = x.ssm_state_indices.detach().cpu()
    num_slots = x.initial_state.shape[0]
    bad = (idx < -1) | (idx >= num_slots)
    if bad.any():
        n = bad.nonzero()[0].tolist()
        raise ValueError(
            f"`ssm_state_indices` holds slot {idx[tuple(n)].item()} at {n}; slots must be in [0, {num_slots}) or -1 (padding)"
        )
    if opts.spec_decode:
        acc = x.num_accepted_tokens.detach().cpu()
        cols = idx.shape[1]
        bad = (acc < 1) | (acc > cols)
        if bad.any():
            n = int(bad.nonzero()[0])
            raise ValueError(f"`num_accepted_tokens[{n}]`={int(acc[n])} must be in [1, {cols}]")
        for n, L in enumerate(lens):
            if L > cols:
                raise ValueError(f"sequence {n} has {L} tokens but `ssm_state_indices` has {cols} slots per sequence")


def recurrent_forward(opts: KDAOptions, x: KDAInputs):
    """(o, final_state) of fused_recurrent_kda; writes pools in place when asked."""
    s = opts.shape
    cdt = compute_dtype(x.q)
    cu_host = None if x.cu_seqlens is None else x.cu_seqlens.detach().to("cpu", torch.int64)
    lay = SeqLayout(s.B, s.T, 1, cu_host, x.q.device)
    if opts.pool:
        check_pool_indices(opts, x, lay.lens)
    q, k, v, g, beta = (lay.pad(t) for t in _activate(opts, x, cdt))  # [N, Tmax, HV, *]
    N, dev = lay.N, x.q.device

    live = torch.ones(N, dtype=torch.bool, device=dev)
    if opts.pool:
        idx = x.ssm_state_indices.long()
        if opts.spec_decode:
            start = idx.gather(1, (x.num_accepted_tokens.long() - 1)[:, None])[:, 0]
        else:
            start = idx if idx.ndim == 1 else idx[:, 0]
        live = start >= 0  # -1: a padding sequence
        if x.initial_state.shape[0]:
            S = x.initial_state[start.clamp(min=0)].to(cdt) * live[:, None, None, None]
        else:  # an empty pool: every sequence is padding (the indices were checked above)
            S = q.new_zeros(N, s.HV, *x.initial_state.shape[2:])
    elif x.initial_state is not None:
        S = x.initial_state.to(cdt)
    else:
        S = q.new_zeros(N, s.HV, *opts.state_shape)
    S = S.transpose(-1, -2) if opts.state_v_first else S  # [N, HV, K, V]

    per_token = opts.pool and opts.inplace_final_state and opts.spec_decode
    outs, states = [], []
    for t in range(lay.Tp):
        S = S * g[:, t].exp()[..., None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t] * opts.scale, S))
        if per_token:
            states.append(S)
    o_pad = torch.stack(outs, 1) if outs else q.new_zeros(N, 0, s.HV, s.V)
    o_pad = o_pad * live[:, None, None, None]
    o = lay.unpad(o_pad).to(x.v.dtype).contiguous()
    S = S * live[:, None, None, None]

    def layout(t):
        return t.transpose(-1, -2) if opts.state_v_first else t

    if opts.inplace_final_state:
        pool = x.initial_state
        with torch.no_grad():
            if not opts.pool:
                pool.copy_(layout(S))
            elif not opts.spec_decode:
                rows = live.nonzero()[:, 0]
                pool.index_copy_(0, start[rows], layout(S)[rows].to(pool.dtype))
            else:  # the state after token t of sequence n goes to slot idx[n, t]
                for t, St in enumerate(states):
                    ok = live & (torch.tensor(lay.lens, device=dev) > t) & (idx[:, t] >= 0)
                    rows = ok.nonzero()[:, 0]
                    pool.index_copy_(0, idx[rows, t], layout(St)[rows].to(pool.dtype))
        return o, pool
    final = layout(S).float() if cdt == torch.float32 else layout(S)
    return o, (final if opts.output_final_state else None)


# ----------------------------------------------------------------------------------------------
# gates


def gate_forward(opts: GateOptions, g, A_log, dt_bias):
    if opts.gate is GateMode.SOFTPLUS:
        return naive_kda_gate(g, A_log, dt_bias, opts.output_dtype)
    return naive_kda_lowerbound_gate(g, A_log, dt_bias, opts.lower_bound, opts.output_dtype)


def gate_chunk_cumsum(opts: GateOptions, g, A_log, dt_bias, cu_seqlens):
    B, T = g.shape[:2]
    cu_host = None if cu_seqlens is None else cu_seqlens.detach().to("cpu", torch.int64)
    y = gate_forward(GateOptions(opts.gate, opts.lower_bound, compute_dtype(g)), g, A_log, dt_bias)
    lay = SeqLayout(B, T, opts.chunk_size, cu_host, g.device)
    yc = lay.pad(y).unflatten(1, (lay.NT, opts.chunk_size)).cumsum(2).flatten(1, 2)
    out = lay.unpad(yc)
    if opts.scale is not None:
        out = out * opts.scale
    return out.to(opts.output_dtype)


class TorchBackend(Backend):
    name = "torch"
    priority = 0
    ops = ("chunk_kda", "fused_recurrent_kda", "kda_gate", "kda_gate_chunk_cumsum")
    differentiable = ops

    def verify(self, op, opts, inputs):
        return True, "runs every option on any device"

    def chunk_kda(self, opts, inputs):
        return chunk_forward(opts, inputs)

    def fused_recurrent_kda(self, opts, inputs):
        return recurrent_forward(opts, inputs)

    def kda_gate(self, opts, inputs):
        return gate_forward(opts, *inputs)

    def kda_gate_chunk_cumsum(self, opts, inputs):
        return gate_chunk_cumsum(opts, *inputs)
