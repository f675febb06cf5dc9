"""PyTorch backend: the chunked algorithm vectorised over chunks and heads.

Runs on any device, float32 arithmetic (float64 for float64 inputs), autograd by torch. Sequences
(dense rows or varlen segments) are cut into chunks without padding them to the longest
(``ChunkLayout``): full chunks go through one state scan in which step t holds the t-th chunk of
every sequence that has one; each sequence's last, partial chunk is zero-padded to a power of two
(a padded token has g = 0, k = q = v = 0 and beta = 0: it changes no state) and runs after the
scan. Work and memory grow with the total tokens.

Intra-chunk decay factors ``exp(G_i - G_j)`` are never formed from ``exp(G)`` alone: pairs of
sub-blocks are anchored at a token between them so every exponent stays small (see
``intra_chunk`` and docs/math.md). Cumulative gates are summed in float64 so that their
differences stay exact for large gates, and gates are floored at GATE_FLOOR so that a hard reset
(g = -inf) or a huge gate never forms inf - inf nor swamps the gates summed after it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..naive import activate, naive_kda_gate, naive_kda_lowerbound_gate
from ..options import GateMode, GateOptions, KDAInputs, KDAOptions, graph_chunk_slots
from ..seqlens import check_seqlens, host_values
from .registry import Backend

# exp of every sum of gates that includes a gate at or below this is exactly 0 in float32 and
# float64 (gates are <= 0), as it is for the gate itself; float64 sums keep later gates exact
GATE_FLOOR = -1000.0


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def seq_lens(B: int, T: int, cu_host: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(length, first token) of every sequence: dense rows, or the segments of cu_seqlens."""
    if cu_host is None:
        return [T] * B, [b * T for b in range(B)]
    cu = cu_host.tolist()
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)], cu[:-1]


class ChunkLayout:
    """Maps the tokens of ``[B, T, ...]`` tensors (dense rows, or varlen segments with B = 1) to
    groups of chunks ``[n, c, ...]`` and back.

    Group 0 holds the full chunks (C tokens), step-major for the state scan: ``steps[t] = (offset,
    count)`` is the t-th full chunk of the first ``count`` sequences of ``order`` (sequences by
    number of full chunks, descending), so the sequences still running at step t are a prefix of
    ``order``. Each further group holds the last, partial chunks of sequences (``tail_seqs``) whose
    token count r has the same padded size c, a power of two with c/2 < r <= c. Sequences in
    ``skip`` get no chunks: their tokens map to zero rows on the way back.
    """

    def __init__(self, B: int, T: int, C: int, cu_host: torch.Tensor | None, device, skip=None):
        self.B, self.T, self.C = B, T, C
        self.varlen = cu_host is not None
        self.lens, starts = seq_lens(B, T, cu_host)
        N = self.N = len(self.lens)
        total = B * T if not self.varlen else T
        lens = [0 if skip is not None and skip[n] else L for n, L in enumerate(self.lens)]
        nf = [L // C for L in lens]  # full chunks per sequence
        order = sorted(range(N), key=lambda n: -nf[n])
        rank = [0] * N
        for i, n in enumerate(order):
            rank[n] = i
        self.steps, pos = [], 0
        running = N
        for t in range(nf[order[0]] if N else 0):
            while nf[order[running - 1]] <= t:
                running -= 1
            self.steps.append((pos, running))
            pos += running
        NF = pos
        # full chunk (n, c) sits at steps[c].offset + rank[n]
        full_start, full_pos = [0] * NF, []
        for n in range(N):
            for c in range(nf[n]):
                p = self.steps[c][0] + rank[n]
                full_start[p] = starts[n] + c * C
                full_pos.append(p)
        ar = torch.arange(C)
        srcs = [(torch.tensor(full_start, dtype=torch.long)[:, None] + ar).view(NF, C)]
        # partial last chunks by padded size
        tails: dict[int, list[int]] = {}
        for n, L in enumerate(lens):
            if L % C:
                tails.setdefault(1 << (L % C - 1).bit_length(), []).append(n)
        self.tail_seqs, tail_at = [], {}
        base, pad = NF, total  # index `total`: the zero row appended by `flat`
        for c in sorted(tails):
            seqs = tails[c]
            first = torch.tensor([starts[n] + nf[n] * C for n in seqs], dtype=torch.long)
            rem = torch.tensor([lens[n] % C for n in seqs], dtype=torch.long)
            arc = torch.arange(c)
            srcs.append(torch.where(arc < rem[:, None], first[:, None] + arc, pad))
            for i, n in enumerate(seqs):
                tail_at[n] = base + i
            self.tail_seqs.append(torch.tensor(seqs, dtype=torch.long, device=device))
            base += len(seqs)
        self.padded = len(srcs) > 1
        # every token's row in the concatenated groups (flattened); uncovered tokens the zero row
        flat_src = torch.cat([s.flatten() for s in srcs])
        rows = torch.arange(flat_src.numel())
        keep = flat_src < total
        tok_pos = torch.full((total + 1,), flat_src.numel(), dtype=torch.long)
        tok_pos[flat_src[keep]] = rows[keep]
        self.srcs = [s.to(device) for s in srcs]
        self.tok_pos = tok_pos[:total].to(device)
        self.covered = not bool((tok_pos[:total] == flat_src.numel()).any())
        # chunks in sequence order, as rows of the concatenated groups (group 0's rows then tails)
        chunk_pos, it = [], iter(full_pos)
        for n in range(N):
            chunk_pos += [next(it) for _ in range(nf[n])]
            if n in tail_at:
                chunk_pos.append(tail_at[n])
        self.chunk_pos = torch.tensor(chunk_pos, dtype=torch.long, device=device)
        # every sequence's final state: after its full chunks (rows 0..N-1), or after its tail
        self.final_pos = torch.tensor([tail_at[n] - NF + N if n in tail_at else n for n in range(N)],
                                      dtype=torch.long, device=device)
        self.order = torch.tensor(order, dtype=torch.long, device=device)
        self.rank = torch.tensor(rank, dtype=torch.long, device=device)
        self.NT = max(math.ceil(L / C) for L in self.lens) if N else 0  # chunks of the longest sequence

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [B*T (+ 1 zero row where chunks are padded), ...]."""
        x = x[0] if self.varlen else x.reshape(self.B * self.T, *x.shape[2:])
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])]) if self.padded else x

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[B, T, ...] -> one [n, c, ...] per group."""
        xf = self.flat(x)
        return [xf[s] for s in self.srcs]

    def merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """One [n, c, ...] per group -> [B, T, ...] (tokens of skipped sequences zero)."""
        rows = [p.flatten(0, 1) for p in parts]
        if not self.covered:
            rows.append(rows[0].new_zeros(1, *rows[0].shape[1:]))
        y = torch.cat(rows)[self.tok_pos]
        return y[None] if self.varlen else y.view(self.B, self.T, *y.shape[1:])

    def scan(self, S: torch.Tensor, step) -> torch.Tensor:
        """A state scan over the steps, from the states ``S`` [N, ...] in sequence order: at step t,
        ``step(rows, S_t)`` advances the states of the first ``count`` sequences of ``order`` (rows
        ``rows`` of group 0) and returns them. Returns the states after the last step of each
        sequence, in sequence order (a sequence with no step keeps its state)."""
        S_sorted = S[self.order]
        a0 = self.steps[0][1] if self.steps else 0
        S, done = S_sorted[:a0], []  # done[t]: the sequences that leave after step t
        for t, (off, a) in enumerate(self.steps):
            nxt = self.steps[t + 1][1] if t + 1 < len(self.steps) else 0
            S = step(slice(off, off + a), S)
            done.append(S[nxt:])
            S = S[:nxt]
        return torch.cat([*reversed(done), S_sorted[a0:]])[self.rank]


def _activate(opts: KDAOptions, x: KDAInputs, dtype):
    return activate(
        x.q, x.k, x.v, x.g, x.beta, use_qk_l2norm_in_kernel=opts.qk_l2norm,
        use_gate_in_kernel=opts.gate is not GateMode.PREGATED, A_log=x.A_log, dt_bias=x.dt_bias,
        lower_bound=opts.lower_bound, use_beta_sigmoid_in_kernel=opts.beta_sigmoid,
        allow_neg_eigval=opts.allow_neg_eigval, dtype=dtype,
    )


MIN_BLOCK = 16  # smallest diagonal block taken with one mid-anchored product (in chunks of 16 or more)
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

    qc, kc: [..., C, K] with C a power of two; G64: the within-chunk cumulative gate in float64, so
    that differences of long sums stay exact. Diagonal blocks of bs tokens take one product
    anchored at their middle token, ``(x e^(G - G_mid)) (k e^(G_mid - G))^T``, with bs the largest
    of C, C/2, .., min(16, C) whose factors stay within exp(MAX_HALF_SPAN) (the safe path of the
    spec; any gate when none fits: bs = 1). Above bs, halves of 2s-token blocks are paired and
    anchored at the later half's first token, so every exponent is <= 0. Returns two [..., C, C].
    """
    C = qc.shape[-2]
    Aqk = qc.new_zeros(*qc.shape[:-1], C)
    Akk = torch.zeros_like(Aqk)
    if qc.numel() == 0:
        return Aqk, Akk
    smallest = max(2, min(MIN_BLOCK, C))
    bs = C
    while bs >= smallest and _half_span(G64, bs) > MAX_HALF_SPAN:
        bs //= 2
    if bs < smallest:
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


def _prepare(qc, kc, vc, gc, bc, scale):
    """The per-chunk work of one group of chunks, qc, kc, gc: [n, HV, c, K], vc: [n, HV, c, V],
    bc: [n, HV, c]: Aqk [n, HV, c, c]; w [.., c, K] and u [.., c, V] of the WY form; q e^G scale;
    (k e^(G_last - G))^T [.., K, c]; e^(G_last) [.., K, 1]."""
    c, K = qc.shape[-2:]
    G64 = gc.to(torch.float64).cumsum(-2)
    G = G64.to(qc.dtype)
    Aqk, Akk = intra_chunk(qc, kc, G64, scale)
    # (I + Diag(beta) Akk) [w u] = Diag(beta) [k exp(G), v]
    eye = torch.eye(c, dtype=qc.dtype, device=qc.device)
    eG = G.exp()
    rhs = bc[..., None] * torch.cat([kc * eG, vc], -1)
    wu = torch.linalg.solve_triangular(eye + bc[..., None] * Akk, rhs, upper=False, unitriangular=True)
    qg = qc * eG * scale
    kd = (kc * (G64[..., -1:, :] - G64).to(qc.dtype).exp()).transpose(-1, -2)
    decay_last = G[..., -1:, :].transpose(-1, -2).exp()
    return Aqk, wu[..., :K], wu[..., K:], qg, kd, decay_last


def chunk_forward(opts: KDAOptions, x: KDAInputs):
    """(o, final_state, h) of chunk_kda; h is None unless intermediate states are asked for."""
    if opts.graph:
        return _graph_chunk_forward(opts, x)
    s, C = opts.shape, opts.chunk_size
    cdt = compute_dtype(x.q)
    q, k, v, g, beta = _activate(opts, x, cdt)  # [B, T, HV, *]
    g = g.clamp(min=GATE_FLOOR)
    lay = ChunkLayout(s.B, s.T, C, x.cu_seqlens_cpu, q.device)
    N, HV, K, V = lay.N, s.HV, s.K, s.V

    def heads_first(t):  # [n, c, HV, *] -> [n, HV, c, *]
        return t.transpose(1, 2).contiguous()

    groups = [_prepare(*parts, opts.scale)
              for parts in zip(*((heads_first(p) for p in lay.split(t)) for t in (q, k, v, g, beta)))]

    if x.initial_state is not None:
        S0 = x.initial_state.to(cdt)
        S0 = S0.transpose(-1, -2) if opts.state_v_first else S0
    else:
        S0 = q.new_zeros(N, HV, K, V)
    # the scan over full chunks: step t advances the first `a` sequences of lay.order by one chunk
    Aqk, w, u, qg, kd, dl = groups[0]
    hs, vns = [], []

    def step(rows, S):
        a = S.shape[0]
        S3 = S.reshape(a * HV, K, V)  # batch dims merged for baddbmm
        vn = torch.baddbmm(u[rows].flatten(0, 1), w[rows].flatten(0, 1), S3, alpha=-1)  # v' = u - w S
        hs.append(S)
        vns.append(vn.view(a, HV, C, V))
        return torch.baddbmm(dl[rows].flatten(0, 1) * S3, kd[rows].flatten(0, 1), vn).view(a, HV, K, V)

    S_mid = lay.scan(S0, step)  # after every full chunk
    H_full = torch.cat(hs) if hs else S0.new_zeros(0, HV, K, V)  # the state at every full chunk's start
    outs = [qg @ H_full + Aqk @ (torch.cat(vns) if vns else u)]
    # each sequence's partial last chunk, from its state after the full chunks
    starts, ends = [H_full], [S_mid]
    for seqs, (Aqk, w, u, qg, kd, dl) in zip(lay.tail_seqs, groups[1:]):
        Sb = S_mid[seqs]
        vn = u - w @ Sb
        outs.append(qg @ Sb + Aqk @ vn)
        starts.append(Sb)
        ends.append(dl * Sb + kd @ vn)
    o = lay.merge([t.transpose(1, 2) for t in outs]).to(x.v.dtype).contiguous()  # [B, T, HV, V]

    final = None
    if opts.output_final_state:
        final = torch.cat(ends)[lay.final_pos] if len(ends) > 1 else S_mid
        final = final.transpose(-1, -2) if opts.state_v_first else final
    h = None
    if opts.return_intermediate_states:
        h = torch.cat(starts)[lay.chunk_pos]  # [chunks in sequence order, HV, K, V]
        h = h[None] if lay.varlen else h.view(s.B, lay.NT, HV, K, V)
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


def check_pool_indices(opts: KDAOptions, x: KDAInputs, lens: list[int]) -> torch.Tensor:
    """Value checks of the pool indices on the host, before anything is read or written: slots in
    [0, num_slots) or -1 (padding) and, in a call that writes the pool, no slot read or written by
    two live sequences. Returns every sequence's start slot (-1: padding), a host tensor."""
    idx = x.ssm_state_indices.detach().cpu().long()
    num_slots = x.initial_state.shape[0]
    bad = (idx < -1) | (idx >= num_slots)
    if bad.any():
        n = bad.nonzero()[0].tolist()
        raise ValueError(
            f"`ssm_state_indices` holds slot {idx[tuple(n)].item()} at {n}; slots must be in [0, {num_slots}) or -1 (padding)"
        )
    if opts.spec_decode:
        acc = x.num_accepted_tokens.detach().cpu().long()
        cols = idx.shape[1]
        bad = (acc < 1) | (acc > cols)
        if bad.any():
            n = int(bad.nonzero()[0])
            raise ValueError(f"`num_accepted_tokens[{n}]`={int(acc[n])} must be in [1, {cols}]")
        for n, L in enumerate(lens):
            if L > cols:
                raise ValueError(f"sequence {n} has {L} tokens but `ssm_state_indices` has {cols} slots per sequence")
        start = idx.gather(1, (acc - 1)[:, None])[:, 0]
    else:
        start = idx if idx.ndim == 1 else idx[:, 0]
    if opts.inplace_final_state:  # every slot the call touches belongs to one sequence
        rows = idx.tolist()
        touched = []
        for n, s0 in enumerate(start.tolist()):
            used = set() if s0 < 0 else {s0}
            if s0 >= 0 and opts.spec_decode:  # the state after token t goes to slot idx[n, t]
                used.update(sl for sl in rows[n][: lens[n]] if sl >= 0)
            touched.append(used)
        if sum(map(len, touched)) > len(set().union(*touched)):  # names the first pair as the Triton check does
            for n, mine in enumerate(touched):
                for m in range(n + 1, len(touched)):
                    if mine & touched[m]:
                        raise ValueError(
                            f"`ssm_state_indices`: sequence {n} shares pool slot {min(mine & touched[m])} with "
                            f"sequence {m} ({rows[n]} and {rows[m]}); with inplace_final_state=True a slot may "
                            "belong to one sequence of a call only")
    return start


def recurrent_forward(opts: KDAOptions, x: KDAInputs):
    """(o, final_state) of fused_recurrent_kda; writes pools in place when asked. Step t advances
    every sequence with more than t tokens by one token (ChunkLayout with C = 1); padding
    sequences take no steps, read no slot and output zeros."""
    s = opts.shape
    cdt = compute_dtype(x.q)
    dev = x.q.device
    cu_host = x.cu_seqlens_cpu  # the options' checked copy; a device cu_seqlens they left unread is read here
    if cu_host is None and x.cu_seqlens is not None:
        cu_host = host_values(x.cu_seqlens, None, s.T)  # (this backend reads the pool indices back anyway)
    live = None
    if opts.pool:
        start_host = check_pool_indices(opts, x, seq_lens(s.B, s.T, cu_host)[0])
        live = start_host >= 0
    lay = ChunkLayout(s.B, s.T, 1, cu_host, dev, skip=None if live is None else (~live).tolist())
    N = lay.N
    q, k, v, g, beta = (lay.split(t)[0][:, 0] for t in _activate(opts, x, cdt))  # [tokens, HV, *], step-major

    if opts.pool:
        pool = x.initial_state
        rows = live.nonzero()[:, 0]
        start = start_host.to(dev)
        S = q.new_zeros(N, s.HV, *pool.shape[2:])  # padding sequences: zeros, no slot read
        if rows.numel():
            rows = rows.to(dev)
            S = S.index_copy(0, rows, pool[start[rows]].to(cdt))
    elif x.initial_state is not None:
        S = x.initial_state.to(cdt)
    else:
        S = q.new_zeros(N, s.HV, *opts.state_shape)
    S = S.transpose(-1, -2) if opts.state_v_first else S  # [N, HV, K, V]

    per_token = opts.pool and opts.inplace_final_state and opts.spec_decode
    outs, states = [], []

    def step(r, S):
        S = S * g[r].exp()[..., None]
        kt = k[r, :, :, None]  # [a, HV, K, 1]; products as sums: no matmul launch per token
        delta = beta[r, :, None] * (v[r] - (kt * S).sum(-2))
        S = S + kt * delta[:, :, None, :]
        outs.append(((q[r] * opts.scale)[..., None] * S).sum(-2))
        if per_token:
            states.append(S)
        return S

    S = lay.scan(S, step)
    o_steps = torch.cat(outs) if outs else q.new_zeros(0, s.HV, s.V)
    o = lay.merge([o_steps[:, None]]).to(x.v.dtype).contiguous()

    def layout(t):
        return t.transpose(-1, -2) if opts.state_v_first else t

    if opts.inplace_final_state:
        pool = x.initial_state
        with torch.no_grad():
            if not opts.pool:
                pool.copy_(layout(S))
            elif not opts.spec_decode:
                pool.index_copy_(0, start[rows], layout(S)[rows].to(pool.dtype))
            else:  # the state after token t of sequence n goes to slot idx[n, t]
                idx = x.ssm_state_indices.long()
                for t, St in enumerate(states):
                    seqs = lay.order[: St.shape[0]]
                    slots = idx[seqs, t]
                    ok = (slots >= 0).nonzero()[:, 0]
                    pool.index_copy_(0, slots[ok], layout(St)[ok].to(pool.dtype))
        return o, pool
    final = layout(S).float() if cdt == torch.float32 else layout(S)
    return o, (final if opts.output_final_state else None)


# ----------------------------------------------------------------------------------------------
# gates


def gate_forward(opts: GateOptions, g, A_log, dt_bias):
    if opts.gate is GateMode.SOFTPLUS:
        return naive_kda_gate(g, A_log, dt_bias, opts.output_dtype)
    return naive_kda_lowerbound_gate(g, A_log, dt_bias, opts.lower_bound, opts.output_dtype)


def gate_chunk_cumsum(opts: GateOptions, g, A_log, dt_bias, cu_seqlens, cu_host):
    """``cu_host``: the options' checked host copy of ``cu_seqlens``."""
    B, T = g.shape[:2]
    y = gate_forward(GateOptions(opts.gate, opts.lower_bound, compute_dtype(g)), g, A_log, dt_bias)
    lay = ChunkLayout(B, T, opts.chunk_size, cu_host, g.device)
    out = lay.merge([p.cumsum(1) for p in lay.split(y)])
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
