"""fused_recurrent_kda: every option against the float64 reference, and the serving paths:
state pools with padding slots, speculative decoding with rollback, in-place writes."""

import pytest
import torch
from conftest import DEVICE, GPU
from helpers import AXES, check, grow, tol_for

from fastkda import chunk_kda, decode_error, fused_recurrent_kda, use_backend
from fastkda.backends import backends
from fastkda.testing import Case, make_inputs, reference, rel_rms

BACKENDS = [b.name for b in backends() if "fused_recurrent_kda" in b.ops]
REC_AXES = {n: c for n, c in AXES.items() if not n.startswith("chunk32")}
OPTION_KEYS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "lower_bound",
               "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", list(REC_AXES))
def test_recurrent_axis(backend, axis, rng):
    case = grow(REC_AXES[axis], GPU)
    if case.T > 300:
        case = case.replace(T=300)
    x = make_inputs(case, device=DEVICE, generator=rng)
    x.pop("safe_gate", None)  # a chunk_kda promise; decoding has no fast path to enable
    with use_backend(backend):
        o, s = fused_recurrent_kda(**x)
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, backend))
    if case.final_state:
        check("final_state", s, s_ref, tol_for(case.dtype, backend))
    else:
        assert s is None


def _sequence_inputs(case, rng):
    """Per-sequence tensors, flattened varlen, with the options of ``case``."""
    x = make_inputs(case, device=DEVICE, generator=rng)
    x.pop("safe_gate", None)
    x.pop("initial_state", None)
    return x


def _rows(x, cu, n, a, b):
    """Tokens a:b of sequence n of a flattened varlen input, as a batch row [1, b-a, ...]."""
    s = int(cu[n])
    return {k: x[k][:, s + a: s + b] for k in ("q", "k", "v", "g", "beta")}


def _pool_tol(pool_dtype, backend) -> float:
    """The error budget a pool's dtype adds (its states rounded at every step): bfloat16's, twice
    that for the Triton kernels under the interpreter, whose conversion truncates (a bias that adds
    up over the steps) where the GPU rounds to nearest."""
    tol = tol_for(pool_dtype, "torch")
    return 2 * tol if pool_dtype == torch.bfloat16 and backend == "triton" and not GPU else tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vfirst,pool_dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16),
                                               (True, torch.bfloat16)], ids=["f32", "vfirst-f32", "bf16", "vfirst-bf16"])
def test_serving_prefill_then_decode_on_pool(backend, vfirst, pool_dtype, rng):
    """Prefill 8 ragged sequences with chunk_kda into pool slots, then 32 decode steps on the
    pool with padding slots; everything equals one full-sequence reference run (within bfloat16's
    budget for a bfloat16 pool: its states are rounded at every step)."""
    steps, n_seq, num_slots = 32, 8, 13
    prefill = [int(t) for t in torch.randint(1, 40 if not GPU else 700, (n_seq,), generator=rng)]
    prefill[2] = 1
    lens = [p + steps for p in prefill]
    case = grow(Case(seqlens=tuple(lens), H=2, HV=4, gate="softplus", l2norm=True, beta_sigmoid=True,
                     state_v_first=vfirst), False)
    if GPU:
        case = case.replace(K=128, V=128)
    x = _sequence_inputs(case, rng)
    cu = x["cu_seqlens"].tolist()
    opts = {k: x[k] for k in OPTION_KEYS if k in x}
    o_ref, s_ref = reference(x)

    # prefill: the first prefill[n] tokens of every sequence, varlen, into random pool slots
    pre = {k: torch.cat([_rows(x, cu, n, 0, p)[k] for n, p in enumerate(prefill)], 1) for k in ("q", "k", "v", "g", "beta")}
    cu_pre = torch.tensor([0, *torch.tensor(prefill).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    with use_backend(backend):
        o_pre, s_pre = chunk_kda(**pre, **opts, cu_seqlens=cu_pre, output_final_state=True)
    ref_pre = torch.cat([o_ref[:, cu[n]: cu[n] + p] for n, p in enumerate(prefill)], 1)
    check("prefill o", o_pre, ref_pre, tol_for(case.dtype, backend))
    pool = torch.randn(num_slots, case.HV, *s_pre.shape[2:], device=DEVICE).to(pool_dtype)
    slots = torch.randperm(num_slots, generator=rng)[:n_seq].to(DEVICE)
    tol = max(tol_for(case.dtype, backend), _pool_tol(pool_dtype, backend))
    pool[slots] = s_pre.to(pool_dtype)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots.cpu()] = False
    pool_before = pool.clone()

    outs = []
    for t in range(steps):
        # batch of n_seq + 2 rows: live sequences in a random order plus two padding rows
        order = torch.randperm(n_seq + 2, generator=rng)
        idx = torch.full((n_seq + 2,), -1, dtype=torch.int32)
        batch = {k: torch.randn(n_seq + 2, 1, *x[k].shape[2:], device=DEVICE).to(x[k].dtype) for k in ("q", "k", "v", "g", "beta")}
        for row, n in enumerate(order.tolist()):
            if n < n_seq:
                idx[row] = slots[n]
                tok = _rows(x, cu, n, prefill[n] + t, prefill[n] + t + 1)
                for k in batch:
                    batch[k][row] = tok[k][0]
        with use_backend(backend):
            o, ret = fused_recurrent_kda(**batch, **opts, initial_state=pool, ssm_state_indices=idx.to(DEVICE),
                                         inplace_final_state=True)
        assert ret is pool
        pad_rows = (idx < 0).nonzero()[:, 0]
        assert torch.equal(o[pad_rows.to(DEVICE)], torch.zeros_like(o[pad_rows.to(DEVICE)])), "padding rows must be zero"
        inv = {n: row for row, n in enumerate(order.tolist()) if n < n_seq}
        outs.append(torch.stack([o[inv[n], 0] for n in range(n_seq)]))
    got = torch.stack(outs, 1)  # [n_seq, steps, HV, V]
    want = torch.stack([o_ref[0, cu[n] + prefill[n]: cu[n + 1]] for n in range(n_seq)])
    check("decode o", got, want, tol)
    check("pool states", pool[slots], s_ref, tol)
    assert pool.dtype == pool_dtype
    assert torch.equal(pool[untouched.to(DEVICE)], pool_before[untouched.to(DEVICE)]), "slots of no sequence changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("varlen,pool_dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
                         ids=["dense", "varlen", "varlen-bf16"])
def test_speculative_decoding_rollback(backend, varlen, pool_dtype, rng, check_path):
    """Draft tokens write their states to slots [n, t]; the next step starts from the last
    accepted one, so rejected drafts roll back (a bfloat16 pool within its budget)."""
    n_seq, draft, num_slots = 3, 3, 16
    prefix = 20
    total = prefix + 2 * (1 + draft)
    case = Case(seqlens=(total,) * n_seq, H=2, HV=4, gate="lowerbound", lower_bound=-3.0, beta_sigmoid=True)
    x = _sequence_inputs(case, rng)
    cu = x["cu_seqlens"].tolist()
    opts = {k: x[k] for k in OPTION_KEYS if k in x}
    idx = torch.randperm(num_slots, generator=rng)[: n_seq * (1 + draft)].view(n_seq, 1 + draft).to(DEVICE)
    pool = torch.randn(num_slots, case.HV, case.K, case.V, device=DEVICE).to(pool_dtype)
    tol = max(tol_for(case.dtype, backend), _pool_tol(pool_dtype, backend))
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[idx.flatten()] = False
    before = pool.clone()
    # the prefix: chunked prefill, states into column 0
    pre = {k: torch.cat([_rows(x, cu, n, 0, prefix)[k] for n in range(n_seq)], 0) for k in ("q", "k", "v", "g", "beta")}
    with use_backend(backend):
        _, s0 = chunk_kda(**pre, **opts, output_final_state=True)
    pool[idx[:, 0]] = s0.to(pool_dtype)
    accepted = [1] * n_seq
    kept = [list(range(prefix)) for _ in range(n_seq)]  # tokens each sequence really consumed
    pos = [prefix] * n_seq
    for step in range(2):
        ntok = [1 + draft] * n_seq if not varlen else [1 + draft, 2, 1]
        toks = [list(range(pos[n], pos[n] + ntok[n])) for n in range(n_seq)]
        rows = [{k: x[k][:, [cu[n] + t for t in toks[n]]] for k in ("q", "k", "v", "g", "beta")} for n in range(n_seq)]
        batch = {k: torch.cat([r[k] for r in rows], 1 if varlen else 0) for k in ("q", "k", "v", "g", "beta")}
        kw = {}
        if varlen:
            kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(ntok).cumsum(0).tolist()], device=DEVICE)
        with use_backend(backend):
            o, _ = fused_recurrent_kda(**batch, **opts, initial_state=pool, ssm_state_indices=idx,
                                       num_accepted_tokens=torch.tensor(accepted, device=DEVICE),
                                       inplace_final_state=True, **kw)
        for n in range(n_seq):
            seq_tokens = kept[n] + toks[n]
            sub = {k: x[k][:, [cu[n] + t for t in seq_tokens]] for k in ("q", "k", "v", "g", "beta")}
            o_r, _, states = reference({**sub, **opts}, return_all_states=True)
            got_o = o[n] if not varlen else o[0, sum(ntok[:n]): sum(ntok[: n + 1])]
            check(f"step {step} seq {n} o", got_o, o_r[0, len(kept[n]):], tol)
            for t in range(ntok[n]):  # the state after every draft token sits in slot idx[n, t]
                check(f"step {step} seq {n} state {t}", pool[idx[n, t]], states[0, len(kept[n]) + t], tol)
        # the verifier accepts a random prefix of every sequence's tokens
        accepted = [int(torch.randint(1, ntok[n] + 1, (1,), generator=rng)) for n in range(n_seq)]
        for n in range(n_seq):
            kept[n] += toks[n][: accepted[n]]
            pos[n] += ntok[n]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_without_pool_and_padding_sequences(backend, rng):
    case = Case(B=3, T=5, H=1, HV=2)
    x = make_inputs(case, device=DEVICE, generator=rng)
    h0 = x.pop("initial_state")
    o_ref, s_ref = reference({**x, "initial_state": h0})
    h = h0.clone()
    with use_backend(backend):
        o, ret = fused_recurrent_kda(**x, initial_state=h, inplace_final_state=True)
    assert ret is h
    check("o", o, o_ref, tol_for(case.dtype, backend))
    check("in-place state", h, s_ref, tol_for(case.dtype, backend))
    # an all-padding batch touches nothing and returns zeros
    pool = torch.randn(4, 2, 32, 32, device=DEVICE)
    snap = pool.clone()
    with use_backend(backend):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([-1, -1, -1], device=DEVICE),
                                   inplace_final_state=True)
    assert torch.equal(pool, snap) and not o.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_read_only_returns_final_states(backend, rng):
    case = Case(B=3, T=4, H=1, HV=2, state_v_first=True)
    x = make_inputs(case, device=DEVICE, generator=rng)
    h0 = x.pop("initial_state")
    pool = torch.randn(5, *h0.shape[1:], device=DEVICE)
    slots = torch.tensor([4, -1, 0], device=DEVICE)
    pool[4], pool[0] = h0[0], h0[2]
    snap = pool.clone()
    with use_backend(backend):
        o, s = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=slots)
    assert torch.equal(pool, snap)
    o_ref, s_ref = reference({**x, "initial_state": h0})
    live = torch.tensor([0, 2], device=DEVICE)
    check("o", o[live], o_ref[live], tol_for(case.dtype, backend))
    check("final", s[live], s_ref[live], tol_for(case.dtype, backend))
    assert not o[1].any()


def outside(seq, slots) -> str:
    """The pattern of the decode check's error for sequence ``seq`` of a pool of ``slots`` slots (its
    bad value follows)."""
    return rf"of sequence {seq} holds a slot outside \[0, {slots}\) other than -1 \(padding\)"


# a bad slot as the decode check names it (then its value), or as the host check does
OUTSIDE = r"`ssm_state_indices` (" + outside(1, 6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "idx,acc,match",
    [
        ([0, 7, 1], None, OUTSIDE + r": 7;|holds slot 7 at)"),
        ([0, -3, 1], None, OUTSIDE + r": -3;|holds slot -3 at)"),
        ([[0, 1], [2, 9], [3, 4]], [1, 1, 2], OUTSIDE + r": \[2, 9\];|holds slot 9 at)"),
        ([[0, 1], [2, 5], [3, 4]], [1, 3, 1],
         r"num_accepted_tokens\[1\]`? must be in \[1, 2\], got 3|num_accepted_tokens\[1\]`=3"),
    ],
)
def test_bad_indices_change_nothing(backend, idx, acc, match, rng, check_path):
    """One bad index anywhere with raise_on_bad_index=True: a ValueError naming it and its value,
    and not a single pool slot changes."""
    case = Case(B=3, T=1, H=1, HV=2, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.randn(6, 2, 32, 32, device=DEVICE)
    snap = pool.clone()
    kw = dict(initial_state=pool, ssm_state_indices=torch.tensor(idx, device=DEVICE), inplace_final_state=True,
              raise_on_bad_index=True)
    if acc is not None:
        kw["num_accepted_tokens"] = torch.tensor(acc, device=DEVICE)
    with use_backend(backend), pytest.raises(ValueError, match=match):
        fused_recurrent_kda(**x, **kw)
    assert torch.equal(pool, snap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [False, True], ids=["decode", "spec"])
def test_bf16_pool_is_the_float32_step_rounded(backend, spec, rng, tune):
    """A decode step on a bfloat16 pool computes in float32 what the step on a float32 pool holding
    the same values computes, and stores it rounded to nearest. The PyTorch backend: bit for bit.
    The Triton kernels, both pools at the float32 pool's launch (a different tile would sum in a
    different order): the two pools' compilations may still order a float32 sum differently (outputs
    within 1e-6), so a stored state may round to the neighbouring value where the float32 state
    lies within that of a rounding boundary: at most one unit apart (or, for a value left by
    cancellation, a float32 rounding of its terms), and on the GPU at most 1% of
    the states (truncating instead of rounding changes about half of them; the interpreter's
    conversion to bfloat16 truncates, so there only the one-unit bound holds)."""
    from fastkda.backends.triton.plan import Tuning

    tune(decode_bf16=Tuning().decode_f32, decode_bf16_k128=Tuning().decode_f32)
    pool_dtype = torch.bfloat16
    N, HV, draft, num_slots = 5, 4, 2, 20
    case = Case(B=N, T=1 + draft if spec else 1, H=2, HV=HV, gate="softplus", l2norm=True, beta_sigmoid=True,
                initial_state=False, final_state=False)
    if GPU:
        case = case.replace(K=128, V=128)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool16 = torch.randn(num_slots, HV, case.K, case.V, device=DEVICE).to(pool_dtype)
    pool32 = pool16.float()
    if spec:
        idx = torch.randperm(num_slots, generator=rng)[: N * (1 + draft)].view(N, 1 + draft).to(DEVICE)
        kw = dict(num_accepted_tokens=torch.randint(1, 2 + draft, (N,), generator=rng).to(DEVICE))
    else:
        idx = torch.randperm(num_slots, generator=rng)[:N].to(DEVICE)
        kw = {}
    with use_backend(backend):
        o16, _ = fused_recurrent_kda(**x, initial_state=pool16, ssm_state_indices=idx, inplace_final_state=True, **kw)
        o32, _ = fused_recurrent_kda(**x, initial_state=pool32, ssm_state_indices=idx, inplace_final_state=True, **kw)
    want = pool32.to(pool_dtype)
    if backend == "torch":
        assert torch.equal(o16, o32) and torch.equal(pool16, want), (pool16 != want).sum()
        return
    assert rel_rms(o16, o32) <= 1e-6, rel_rms(o16, o32)
    # one unit of the stored value, or (a value left by cancellation) a float32 rounding of the
    # terms it came from: 1e-6 of the pool's RMS
    unit = torch.maximum(want.float().abs() * 2.0**-7, 1e-6 * want.float().pow(2).mean().sqrt())
    off = (pool16.float() - want.float()).abs() / unit
    assert bool((off <= 1).all()), f"a state {off.max():.3g} units off: {want.flatten()[off.argmax()]:.6g}"
    if GPU:
        changed = (pool16 != want).float().mean().item()
        assert changed <= 0.01, f"{changed:.1%} of the stored states differ from the float32 step's rounded"


@pytest.mark.gpu
@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_outputs_past_2_31_elements():
    """One sequence whose outputs pass 2^31 elements (T * HV * V; 4.3 GB of bfloat16): every token's
    output lands in its own row, the last ones as a second call from the state the first part leaves
    gives them (32-bit offsets in the token loop would wrap those rows to before the output)."""
    HV, K, V = 64, 16, 128
    T = 2**31 // (HV * V) + 48
    q, k = (torch.randn(1, T, 1, K, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, HV, V, device=DEVICE, dtype=torch.bfloat16)
    g = -0.1 * torch.rand(1, T, HV, K, device=DEVICE, dtype=torch.bfloat16)
    beta = torch.rand(1, T, HV, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    split = T - 64  # the tail: the last 64 tokens, past 2^31 output elements
    with use_backend("triton"):
        o, s = fused_recurrent_kda(q, k, v, g, beta, **kw)
        _, s1 = fused_recurrent_kda(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split], **kw)
        o2, s2 = fused_recurrent_kda(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:],
                                     initial_state=s1, **kw)
    assert bool(torch.isfinite(o).all())  # outputs are NaN until written
    check("tail o", o[:, split:].float(), o2.float(), 1e-3)
    check("final state", s, s2, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode(backend, pool_dtype, rng, check_path):
    """16 decode steps captured in one CUDA graph and replayed equal 16 eager steps."""
    N, HV, K, V, slots = 8, 4, 128, 128, 12
    case = Case(B=N, T=1, H=2, HV=HV, K=K, V=V, dtype=torch.bfloat16, gate="softplus", l2norm=True,
                beta_sigmoid=True, initial_state=False, final_state=False)
    steps = [make_inputs(case, device=DEVICE, generator=rng) for _ in range(16)]
    idx = torch.tensor([3, -1, 0, 7, 11, 2, -1, 5], device=DEVICE)
    pool0 = torch.randn(slots, HV, K, V, device=DEVICE).to(pool_dtype)

    def run(pool, bufs):
        outs = []
        for x in bufs:
            o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
            outs.append(o)
        return outs

    with use_backend(backend):
        eager_pool = pool0.clone()
        eager = run(eager_pool, steps)
        graph_pool = pool0.clone()
        static = [{k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in x.items()} for x in steps]
        run(graph_pool.clone(), static)  # warm-up: compilation outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run(graph_pool, static)
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)
    assert torch.equal(graph_pool, eager_pool)
    assert decode_error(DEVICE) is None
    # a bad index inside a captured graph: the replay writes nothing, returns zeros, sets the flag
    bad = idx.clone()
    bad[3] = slots
    with use_backend(backend):
        bad_graph = torch.cuda.CUDAGraph()
        snap = graph_pool.clone()
        with torch.cuda.graph(bad_graph):
            o_bad, _ = fused_recurrent_kda(**static[0], initial_state=graph_pool, ssm_state_indices=bad,
                                           inplace_final_state=True)
        bad_graph.replay()
    assert "sequence 3 holds" in decode_error(DEVICE)
    assert torch.equal(graph_pool, snap) and not o_bad.any()


@pytest.mark.gpu
@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("N", [4, 40], ids=["one-launch", "check-kernel"])
def test_decode_launches_follow_alignment(N, rng):
    """A decode layout's launches after its first skip Triton's argument binding: a call of the same
    layout whose q, v, or index row lie off 16 bytes gets its own compilation (a kernel specialised
    on aligned pointers would fault or misread), and an aligned call after it the aligned one."""
    H, K, slots = 2, 128, 2 * N
    case = Case(B=N, T=1, H=H, K=K, V=K, dtype=torch.bfloat16, gate="softplus", l2norm=True, beta_sigmoid=True,
                initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    x.pop("safe_gate", None)
    idx = torch.randperm(slots, generator=rng)[:N].to(DEVICE, torch.int32)
    pool0 = torch.randn(slots, H, K, K, device=DEVICE)

    def off(t):  # the same values and strides, one element past an aligned start
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
        return buf.view(t.shape).copy_(t)

    calls = [x, {**x, "q": off(x["q"])}, {**x, "v": off(x["v"])}, x]
    rows = [idx, off(idx), idx, idx]
    outs, pools = [], []
    with use_backend("triton"):
        for xi, row in zip(calls, rows):
            assert (xi["q"].data_ptr() % 16 == 0) == (xi is not calls[1])
            pool = pool0.clone()
            o, _ = fused_recurrent_kda(**xi, initial_state=pool, ssm_state_indices=row, inplace_final_state=True)
            outs.append(o)
            pools.append(pool)
    torch.cuda.synchronize()
    o_ref, s_ref = reference({**x, "initial_state": pool0[idx.long()], "output_final_state": True})
    for o, pool in zip(outs, pools):
        check("o", o, o_ref, tol_for(case.dtype, "triton"))
        check("final_state", pool[idx.long()], s_ref, tol_for(case.dtype, "triton"))
    assert torch.equal(outs[3], outs[0]) and torch.equal(pools[3], pools[0])


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_index_check_names_first_bad_sequence(rng, tune, check_path):
    """The index check (the check kernel walking the sequences in steps of 4, or the decode
    programs' own) names the first bad sequence, whichever step it falls in, and the pool stays
    bit-identical."""
    tune(decode_check_rows=4)
    case = Case(B=11, T=1, H=1, HV=1, K=16, V=16, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.randn(12, 1, 16, 16, device=DEVICE)
    snap = pool.clone()
    idx = torch.arange(11, device=DEVICE)
    idx[5], idx[9] = 12, -2  # sequence 5 (second step) is the first bad one
    with use_backend("triton"), pytest.raises(ValueError, match=r"`ssm_state_indices` " + outside(5, 12) + ": 12"):
        fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True,
                            raise_on_bad_index=True)
    assert torch.equal(pool, snap)
    assert decode_error(DEVICE) is None  # reported by raising
    # without raising (the default), the flag an engine reads keeps the first bad call through
    # later good ones
    good = idx.clone()
    good[5], good[9] = -1, 11  # slot 11: no other sequence names it
    with use_backend("triton"):
        fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
        assert torch.equal(pool, snap)
        idx[5] = -1  # now sequence 9 is the first bad one
        fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, raise_on_bad_index=False)
        fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=good, inplace_final_state=True)
    assert "sequence 5 holds a slot outside the pool" in decode_error(DEVICE)
    assert decode_error(DEVICE) is None  # read once
    assert not torch.equal(pool, snap)  # the good call wrote its slots


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_index_without_raising(backend, rng, check_path):
    """raise_on_bad_index=False: the Triton call does not read its check back (no synchronisation),
    returns zeros and touches no slot, and decode_error() names the bad sequence; the PyTorch
    backend checks on the host and raises anyway. Valid calls give the same numbers either way."""
    case = Case(B=3, T=1, H=1, HV=2, K=16, V=24, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.randn(5, 2, 16, 24, device=DEVICE)
    good = torch.tensor([4, -1, 0], device=DEVICE)
    with use_backend(backend):
        ref_pool = pool.clone()
        o_ref, _ = fused_recurrent_kda(**x, initial_state=ref_pool, ssm_state_indices=good, inplace_final_state=True)
        new_pool = pool.clone()
        o, _ = fused_recurrent_kda(**x, initial_state=new_pool, ssm_state_indices=good, inplace_final_state=True,
                                   raise_on_bad_index=False)
        assert torch.equal(o, o_ref) and torch.equal(new_pool, ref_pool)
        assert not torch.equal(new_pool[4], pool[4])  # the call did write its slots
        bad = torch.tensor([4, 5, 0], device=DEVICE)
        snap = pool.clone()
        if backend == "torch":
            with pytest.raises(ValueError, match=r"`ssm_state_indices` holds slot 5 at \[1\]"):
                fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=bad, inplace_final_state=True,
                                    raise_on_bad_index=False)
        else:
            def no_read_back(*args, **kwargs):
                raise AssertionError("raise_on_bad_index=False read the index check back")

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(torch.Tensor, "item", no_read_back)  # how the wrapper reads the check back
                o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=bad, inplace_final_state=True,
                                           raise_on_bad_index=False)
            assert torch.equal(o, torch.zeros_like(o))
            # a later call that raises reports its own error and keeps this one for decode_error()
            with pytest.raises(ValueError, match=r"`ssm_state_indices` " + outside(0, 5) + ": 7"):
                fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([7, 0, 4], device=DEVICE),
                                    inplace_final_state=True, raise_on_bad_index=True)
            assert "sequence 1 holds a slot outside the pool" in decode_error(DEVICE)
            assert decode_error(DEVICE) is None
        assert torch.equal(pool, snap)
        with pytest.raises(TypeError, match=r"`raise_on_bad_index` must be a bool, got NoneType: None"):
            fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=good, raise_on_bad_index=None)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("B,inline_limit,launches", [(3, 32, ["kda_recurrent_kernel"]),
                                                     (3, 0, ["kda_check_indices_kernel", "kda_recurrent_kernel"])])
def test_small_pool_call_is_one_launch(B, inline_limit, launches, rng, tune, launch_log):
    """A pool call within decode_inline_check index entries is one launch (the decode programs
    check the call); beyond it (here: the limit set to 0) the check kernel launches first. Both
    write the same numbers."""
    tune(decode_inline_check=inline_limit)
    case = Case(B=B, T=1, H=1, HV=2, K=16, V=16, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.randn(5, 2, 16, 16, device=DEVICE)
    want = pool.clone()
    with use_backend("torch"):
        o_ref, _ = fused_recurrent_kda(**x, initial_state=want, ssm_state_indices=torch.tensor([4, -1, 0], device=DEVICE),
                                       inplace_final_state=True)
    with use_backend("triton"):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([4, -1, 0], device=DEVICE),
                                   inplace_final_state=True)
    assert [r.name for r in launch_log] == launches
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(pool, want) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_keeps_its_slot_bit_for_bit(backend, rng, check_path):
    """A sequence without tokens (varlen) in a pool call written in place: its slot comes back bit
    for bit, infinities and NaN included (the other sequences' slots are written)."""
    case = Case(T=2, H=1, HV=2, K=16, V=16, seqlens=(1, 0, 1), initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.randn(4, 2, 16, 16, generator=rng)
    pool[1, 0, 3, 5], pool[1, 1, 7, 2], pool[1, 0, 9, 9] = float("inf"), float("-inf"), float("nan")
    pool = pool.to(DEVICE)
    before = pool.clone()
    with use_backend(backend):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([0, 1, 2], device=DEVICE),
                                   inplace_final_state=True)
    assert torch.equal(pool[1].view(torch.int32), before[1].view(torch.int32))
    assert not torch.equal(pool[0], before[0]) and not torch.equal(pool[2], before[2])
    assert torch.isfinite(o).all()


def _strided(t):
    """The same values as ``t`` in a non-contiguous tensor (every other element of a wider one)."""
    wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., ::2] = t
    out = wide[..., ::2]
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [False, True])
def test_strided_index_and_parameter_tensors(backend, spec, rng):
    """Non-contiguous ssm_state_indices, num_accepted_tokens, A_log, dt_bias and cu_seqlens give
    what their contiguous copies give, pools included (the Triton kernels index them densely)."""
    lens = (2, 0, 1) if spec else (1, 1, 1)
    case = Case(seqlens=lens, H=1, HV=2, K=16, V=16, gate="softplus", initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    x.pop("safe_gate", None)
    pool = torch.randn(6, 2, 16, 16, device=DEVICE)
    if spec:
        kw = dict(ssm_state_indices=torch.tensor([[5, 1], [-1, -1], [0, 3]], device=DEVICE),
                  num_accepted_tokens=torch.tensor([2, 1, 1], device=DEVICE))
    else:
        kw = dict(ssm_state_indices=torch.tensor([5, -1, 2], device=DEVICE))
    want_pool = pool.clone()
    with use_backend(backend):
        want, _ = fused_recurrent_kda(**x, **kw, initial_state=want_pool, inplace_final_state=True)
        strided = {n: _strided(t) for n, t in kw.items()}  # 2-D indices: rows of a wider [N, 4] table
        xs = {**x, **{n: _strided(x[n]) for n in ("A_log", "dt_bias", "cu_seqlens")}}
        got_pool = pool.clone()
        got, _ = fused_recurrent_kda(**xs, **strided, initial_state=got_pool, inplace_final_state=True)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
    assert not torch.equal(got_pool, pool)  # the calls wrote their slots


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["columns", "heads_first_vfirst"])
def test_strided_pool_written_in_place(backend, layout, rng):
    """A pool that is one layer's view of a wider cache (non-contiguous: the first 16 of 24
    columns, or a head-major cache seen slot-major with V-first states) is read and written in
    place like a contiguous one; the rest of the wider cache stays as it was."""
    vfirst = layout == "heads_first_vfirst"
    case = Case(B=3, T=1, H=1, HV=2, K=16, V=16, initial_state=False, final_state=False, state_v_first=vfirst)
    x = make_inputs(case, device=DEVICE, generator=rng)
    idx = torch.tensor([3, -1, 1], device=DEVICE)
    if vfirst:
        cache = torch.randn(2, 4, 16, 24, device=DEVICE)  # [HV, slots, V, K + 8]
        pool = cache[..., :16].transpose(0, 1)
        slot = lambda c, i: c[:, i]  # noqa: E731
    else:
        cache = torch.randn(4, 2, 16, 24, device=DEVICE)  # [slots, HV, K, V + 8]
        pool = cache[..., :16]
        slot = lambda c, i: c[i]  # noqa: E731
    before = cache.clone()
    assert not pool.is_contiguous()
    dense = pool.clone()
    with use_backend(backend):
        want, _ = fused_recurrent_kda(**x, initial_state=dense, ssm_state_indices=idx, inplace_final_state=True)
        got, ret = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    assert ret is pool
    if GPU:  # compiled for other strides, the launch may take another register layout and sum order
        assert rel_rms(got, want) <= 1e-6 and rel_rms(pool, dense) <= 1e-6
    else:
        assert torch.equal(got, want) and torch.equal(pool, dense)
    assert torch.equal(cache[..., 16:], before[..., 16:])
    assert all(torch.equal(slot(cache, i), slot(before, i)) for i in (0, 2))
    assert not torch.equal(slot(cache, 3), slot(before, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_pool_all_padding(backend, rng):
    """A pool of no slots with every sequence padding: zeros out, nothing to write, no error."""
    case = Case(B=2, T=1, H=1, HV=2, K=16, V=16, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.zeros(0, 2, 16, 16, device=DEVICE)
    with use_backend(backend):
        o, ret = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([-1, -1], device=DEVICE),
                                     inplace_final_state=True)
    assert ret is pool and o.shape == x["v"].shape and not o.any()


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("mode", ["decode-bf16", "varlen-bf16", "spec", "final-state"])
def test_few_programs_loop_over_every_tile(mode, rng, tune, check_path, launch_log):
    """Three decode programs, each looping over a third of the call's (value block, sequence, head)
    tiles (20 or 40: an uneven split), give the one-program-per-tile results bit for bit (outputs,
    pool, final states), and a bad index still writes nothing; the loop pipelined (a bfloat16 pool,
    one token per sequence) within float32 rounding."""
    from fastkda.backends.triton.plan import DecodeLaunch, tuned

    spec, varlen = mode == "spec", mode == "varlen-bf16"
    pool_dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float32
    n_seq, cols, num_slots = 5, (3 if spec else 1), 24
    case = Case(B=1 if varlen else n_seq, T=7 if varlen else (cols if spec else 1), H=2, HV=4, K=32, V=64,
                seqlens=(2, 1, 0, 3, 1) if varlen else None, gate="softplus", beta_sigmoid=True, l2norm=True,
                initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    x.pop("initial_state", None)
    x.pop("output_final_state", None)
    idx = torch.randperm(num_slots, generator=rng)[: n_seq * cols].view(n_seq, cols).to(DEVICE)
    kw = dict(ssm_state_indices=idx if spec else idx[:, 0], inplace_final_state=mode != "final-state",
              output_final_state=mode == "final-state")
    if spec:
        kw["num_accepted_tokens"] = torch.randint(1, cols + 1, (n_seq,), generator=rng).to(DEVICE)
    pool0 = torch.randn(num_slots, case.HV, case.K, case.V, generator=rng).to(DEVICE, pool_dtype)

    def run(**tuning):
        pool = pool0.clone()
        with use_backend("triton"), tuned(**tuning):
            o, final = fused_recurrent_kda(**x, initial_state=pool, **kw)
        return o, pool, final

    o1, pool1, final1 = run()
    assert launch_log[-1].args["ONE_TILE"]
    few = dict(sm_count=1, decode_f32=DecodeLaunch(64, 2, 1, 3), decode_bf16=DecodeLaunch(32, 1, 1, 3))
    o2, pool2, final2 = run(**few)
    last = launch_log[-1]
    assert last.name == "kda_recurrent_kernel" and last.grid == (3,) and not last.args["ONE_TILE"]
    assert last.args["n_tiles"] in (20, 40)
    assert torch.equal(o1, o2) and torch.equal(pool1, pool2)
    if mode == "final-state":
        assert torch.equal(final1, final2)
    else:
        assert not torch.equal(pool1, pool0)
    if mode == "decode-bf16":  # the pipelined loop: float32 sums in another order, then the same rounding
        o3, pool3, _ = run(sm_count=1, decode_bf16=DecodeLaunch(32, 1, 2, 3))
        assert launch_log[-1].args["STAGES"] == 2
        assert rel_rms(o3, o1) < 1e-5 and rel_rms(pool3, pool1) < 1e-4
    bad = kw["ssm_state_indices"].clone()
    bad.view(-1)[-1] = num_slots
    pool = pool0.clone()
    with use_backend("triton"), tuned(**few):
        with pytest.raises(ValueError, match=r"`ssm_state_indices` " + outside(r"\d+", num_slots) + f": .*{num_slots}"):
            fused_recurrent_kda(**x, initial_state=pool, **{**kw, "ssm_state_indices": bad}, raise_on_bad_index=True)
    assert torch.equal(pool, pool0)
