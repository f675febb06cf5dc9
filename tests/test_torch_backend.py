"""The PyTorch backend: hard resets and huge negative gates, padding and bad pool slots, varlen cost
that grows with the total tokens; and the dtype of the intermediate states h on every backend."""

import math

import pytest
import torch
from conftest import BACKENDS, DEVICE
from helpers import check
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fastkda import chunk_kda, fused_recurrent_kda, kda_gate_chunk_cumsum, use_backend
from fastkda.testing import Case, make_inputs, reference, tolerance

# relative RMS limits of the cases with resets: about 3x the worst errors measured over many seeds
# (float32 1.5e-7, float64 4e-16)
EXACT = {torch.float32: 5e-7, torch.float64: 1.5e-15}

HUGE = {"-inf": -math.inf, "-1e17": -1e17, "f32_lowest": torch.finfo(torch.float32).min}


def _reset(x: dict, value: float, C: int, rng) -> None:
    """Hard resets in place: whole gate rows mid-chunk, at a chunk start and at the last token, the
    first token of one head, and single key channels of the last head at random tokens."""
    g = x["g"]
    T = g.shape[1]
    with torch.no_grad():
        g[:, 0, 0] = value
        for t in {C // 2 + 3, C, 2 * C + 1, T - 1}:
            if t < T:
                g[:, t] = value
        for t in torch.randint(0, T, (4,), generator=rng).tolist():
            g[:, t, -1, ::3] = value


def _chunk_states(states: torch.Tensor, h0: torch.Tensor, lens, C: int) -> torch.Tensor:
    """The reference states at every chunk start, [1, total chunks, HV, K, V], from the per-token
    states ([1, T, HV, K, V]) and the initial states."""
    out, start = [], 0
    for n, L in enumerate(lens):
        for c in range(0, L, C):
            out.append(h0[n] if c == 0 else states[0, start + c - 1])
        start += L
    return torch.stack(out)[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("value", list(HUGE))
def test_chunk_hard_reset(value, chunk, dtype, rng):
    """A pre-gated g of -inf (a hard reset), -1e17 or float32's lowest: the decay across it is 0
    and every later small gate still counts. Output, final state and the states at chunk starts
    against the per-token float64 reference; ragged varlen with resets across chunk boundaries."""
    case = Case(seqlens=(1, 150, 0, 64, 97), H=2, HV=4, dtype=dtype, chunk_size=chunk)
    x = make_inputs(case, device=DEVICE, generator=rng)
    _reset(x, HUGE[value], chunk, rng)
    o_ref, s_ref, states = reference(x, chunked=False, return_all_states=True)
    h_ref = _chunk_states(states, x["initial_state"].double(), case.seqlens, chunk)
    with use_backend("torch"), torch.inference_mode():
        o, s, h = chunk_kda(**x, chunk_size=chunk, return_intermediate_states=True)
    check("o", o, o_ref, EXACT[dtype])
    check("final_state", s, s_ref, EXACT[dtype])
    check("h", h, h_ref, EXACT[dtype])


@pytest.mark.parametrize("value", list(HUGE))
def test_chunk_hard_reset_backward(value, rng):
    """Gradients through a hard reset are finite and match float64 autograd of the per-token
    reference (the gradient of a gate at -inf is 0)."""
    case = Case(B=2, T=150, H=1, HV=2, K=16, V=16)
    x = make_inputs(case, device=DEVICE, generator=rng)
    _reset(x, HUGE[value], 64, rng)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in names}
    with use_backend("torch"):
        o, s = chunk_kda(**{**x, **leaves})
    do, ds = torch.randn_like(o), torch.randn_like(s)
    got = torch.autograd.grad((o * do).sum() + (s * ds).sum(), [leaves[n] for n in names])
    ref_leaves = {n: x[n].detach().double().requires_grad_(True) for n in names}
    o_r, s_r = reference({**x, **ref_leaves}, chunked=False)
    want = torch.autograd.grad((o_r * do.double()).sum() + (s_r * ds.double()).sum(), [ref_leaves[n] for n in names])
    check("o", o, o_r, EXACT[torch.float32])
    for n, a, b in zip(names, got, want):
        check(f"d{n}", a, b, EXACT[torch.float32])


def test_chunk_reset_from_activated_gate(rng):
    """A softplus gate whose exp(A_log) overflows float32 activates to -inf in float32 (about
    -1e39 in float64): a hard reset on every token of that head."""
    case = Case(T=150, H=1, HV=3, gate="softplus")
    x = make_inputs(case, device=DEVICE, generator=rng)
    x["A_log"][1] = 90.0
    o_ref, s_ref = reference(x, chunked=False)
    with use_backend("torch"):
        o, s = chunk_kda(**x)
    check("o", o, o_ref, EXACT[torch.float32])
    check("final_state", s, s_ref, EXACT[torch.float32])


@pytest.mark.parametrize("value", list(HUGE))
def test_decode_hard_reset(value, rng):
    """The decoding path with the same gates, varlen, states read from and written to a pool."""
    case = Case(seqlens=(1, 150, 0, 64, 97), H=2, HV=4)
    x = make_inputs(case, device=DEVICE, generator=rng)
    _reset(x, HUGE[value], 64, rng)
    o_ref, s_ref = reference(x, chunked=False)
    h0 = x.pop("initial_state")
    pool = torch.full((7, *h0.shape[1:]), math.nan, device=DEVICE)
    slots = torch.tensor([6, 0, 3, 2, 5], device=DEVICE)
    pool[slots] = h0
    with use_backend("torch"):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=slots, inplace_final_state=True)
    check("o", o, o_ref, EXACT[torch.float32])
    check("pool states", pool[slots], s_ref, EXACT[torch.float32])


# ----------------------------------------------------------------------------------------------
# pools: padding reads nothing, bad or shared slots raise before anything is written


def _nan_pool(num_slots, HV, K, V):
    """A pool as torch.empty may leave it: NaN wherever no live sequence's state was put."""
    return torch.full((num_slots, HV, K, V), math.nan, device=DEVICE)


def _bits(t):
    return t.view(torch.int32).clone()


@pytest.mark.parametrize("inplace", [False, True])
def test_padding_reads_nothing(inplace, rng):
    """Padding sequences (-1) read no slot (slot 0 and every unused slot are NaN) and write none:
    their outputs and final states are exactly 0; live sequences match the reference."""
    case = Case(B=4, T=3, H=1, HV=2, K=16, V=24)
    x = make_inputs(case, device=DEVICE, generator=rng)
    h0 = x.pop("initial_state")
    pool = _nan_pool(6, 2, 16, 24)
    idx = torch.tensor([3, -1, 1, -1], device=DEVICE)
    live = torch.tensor([0, 2], device=DEVICE)
    pool[idx[live]] = h0[live]
    before = _bits(pool)
    o_ref, s_ref = reference({**x, "initial_state": h0})
    with use_backend("torch"):
        o, s = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=inplace)
    pad = torch.tensor([1, 3], device=DEVICE)
    assert torch.equal(o[pad], torch.zeros_like(o[pad])), "padding outputs must be exactly zero"
    check("o", o[live], o_ref[live], EXACT[torch.float32])
    unused = torch.tensor([0, 2, 4, 5], device=DEVICE)
    assert torch.equal(_bits(pool)[unused], before[unused]), "a slot of no live sequence changed"
    if inplace:
        assert s is pool
        check("pool states", pool[idx[live]], s_ref[live], EXACT[torch.float32])
    else:
        assert torch.equal(_bits(pool), before)
        check("final_state", s[live], s_ref[live], EXACT[torch.float32])
        assert torch.equal(s[pad], torch.zeros_like(s[pad]))


def test_padding_reads_nothing_speculative(rng):
    """Speculative decoding: a padding row (start slot -1) reads and writes nothing, whatever its
    other columns and the NaN slots hold."""
    case = Case(seqlens=(2, 3, 1), H=1, HV=2, K=16, V=16, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = _nan_pool(8, 2, 16, 16)
    idx = torch.tensor([[4, 5, 1], [-1, -1, -1], [2, 6, 7]], device=DEVICE)
    acc = torch.tensor([1, 1, 2], device=DEVICE)
    h0 = torch.randn(3, 2, 16, 16, generator=rng).to(DEVICE)
    pool[4], pool[6] = h0[0], h0[2]
    before = _bits(pool)
    o_ref, _, states = reference({**x, "initial_state": h0}, chunked=False, return_all_states=True)
    with use_backend("torch"):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
                                   inplace_final_state=True)
    assert torch.equal(o[0, 2:5], torch.zeros_like(o[0, 2:5])), "padding outputs must be exactly zero"
    live = torch.tensor([0, 1, 5], device=DEVICE)
    check("o", o[0, live], o_ref[0, live], EXACT[torch.float32])
    check("states", pool[torch.tensor([4, 5, 2], device=DEVICE)], states[0, live], EXACT[torch.float32])
    untouched = torch.tensor([0, 1, 3, 6, 7], device=DEVICE)
    assert torch.equal(_bits(pool)[untouched], before[untouched])


@pytest.mark.parametrize(
    "idx,acc,match",
    [
        ([1, 9, 2], None, r"ssm_state_indices.*slot 9"),
        ([1, -2, 2], None, r"ssm_state_indices.*slot -2"),
        ([1, 2, 1], None, r"ssm_state_indices.*sequence 0 shares pool slot 1 with sequence 2"),
        ([[1, 3], [2, 9], [0, 5]], [1, 1, 1], r"ssm_state_indices.*slot 9"),
        ([[1, 3], [3, 4], [5, 0]], [1, 1, 1], r"ssm_state_indices.*sequence 0 shares pool slot 3 with sequence 1"),
        ([[1, 3], [2, 4], [0, 1]], [1, 1, 2], r"ssm_state_indices.*sequence 0 shares pool slot 1 with sequence 2"),
    ],
    ids=["too_big", "below_-1", "shared", "spec_too_big", "shared_written", "shared_read"],
)
def test_bad_or_shared_slots_write_nothing(idx, acc, match, rng):
    """A slot outside [0, num_slots) other than -1, or a slot that two live sequences read or
    write in an in-place call: ValueError naming `ssm_state_indices`, and no slot changes."""
    spec = acc is not None
    case = Case(seqlens=(2, 2, 1) if spec else (1, 1, 1), H=1, HV=2, K=16, V=16, initial_state=False,
                final_state=False)
    x = make_inputs(case, device=DEVICE, generator=rng)
    pool = torch.randn(6, 2, 16, 16, device=DEVICE)
    before = _bits(pool)
    kw = dict(initial_state=pool, ssm_state_indices=torch.tensor(idx, device=DEVICE), inplace_final_state=True)
    if spec:
        kw["num_accepted_tokens"] = torch.tensor(acc, device=DEVICE)
    with use_backend("torch"), pytest.raises(ValueError, match=match):
        fused_recurrent_kda(**x, **kw)
    assert torch.equal(_bits(pool), before)


def test_shared_slot_read_only_and_padding_allowed(rng):
    """Without in-place writes two sequences may start from one slot (nothing is written); any
    number of padding rows may carry -1."""
    case = Case(B=4, T=2, H=1, HV=2, K=16, V=16)
    x = make_inputs(case, device=DEVICE, generator=rng)
    x.pop("initial_state")
    pool = torch.randn(3, 2, 16, 16, device=DEVICE)
    idx = torch.tensor([2, -1, 2, -1], device=DEVICE)
    with use_backend("torch"):
        o, s = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx)
    o_ref, s_ref = reference({**x, "initial_state": pool[[2, 0, 2, 0]]})
    live = torch.tensor([0, 2], device=DEVICE)
    check("o", o[live], o_ref[live], EXACT[torch.float32])
    check("final_state", s[live], s_ref[live], EXACT[torch.float32])


# ----------------------------------------------------------------------------------------------
# varlen cost grows with the total tokens


class _Allocated(TorchDispatchMode):
    """Counts the bytes of every new storage the aten operators return (views and in-place
    results share their input's storage and count nothing)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def _allocated(fn) -> int:
    with _Allocated() as count:
        fn()
    return count.bytes


def _varlen_and_dense(rng, longest, **kw):
    """The same tokens twice: 63 sequences of 1 to 40 tokens beside one of ``longest``, and one
    sequence."""
    lens = [1] * 40 + torch.randint(1, 41, (23,), generator=rng).tolist() + [longest]
    case = Case(seqlens=tuple(lens), H=1, HV=2, K=32, V=32, **kw)
    x = make_inputs(case, device=DEVICE, generator=rng)
    dense = {**x, "cu_seqlens": torch.tensor([0, case.T], dtype=torch.int32, device=DEVICE),
             "initial_state": x["initial_state"][:1]}
    return x, dense


# allocations of the varlen batch over those of the same tokens as one sequence (measured 1.0 to 1.3;
# 18 to 35 when every sequence is padded to the longest)
ALLOC_RATIO = 2.5


@pytest.mark.parametrize("grad", [False, True])
def test_chunk_varlen_cost_grows_with_tokens(grad, rng):
    """chunk_kda on 63 short sequences beside a long one allocates about what the same tokens as
    one sequence do (forward, and forward plus backward), and still matches the reference."""
    x, dense = _varlen_and_dense(rng, 1024)
    outs = {}

    def run(inputs):
        def call():
            leaves = {n: inputs[n].detach().clone().requires_grad_(grad) for n in ("q", "k", "v", "g", "beta")}
            with use_backend("torch"):
                o, s = chunk_kda(**{**inputs, **leaves})
            if grad:
                (o.sum() + s.sum()).backward()
            outs[id(inputs)] = o.detach()
        return call

    ratio = _allocated(run(x)) / _allocated(run(dense))
    assert ratio <= ALLOC_RATIO, f"the varlen batch allocates {ratio:.1f}x what one sequence of its tokens does"
    o_ref, _ = reference(x, chunked=True)
    check("o", outs[id(x)], o_ref, 1e-6)  # measured up to 3.7e-7


def test_decode_varlen_cost_grows_with_tokens(rng):
    """fused_recurrent_kda and kda_gate_chunk_cumsum on the same ragged batch allocate about what
    one sequence of its tokens does."""
    x, dense = _varlen_and_dense(rng, 256, gate="softplus")
    with use_backend("torch"):
        ratio = _allocated(lambda: fused_recurrent_kda(**x)) / _allocated(lambda: fused_recurrent_kda(**dense))
        assert ratio <= ALLOC_RATIO, f"decoding: the varlen batch allocates {ratio:.1f}x one sequence's"
        gate = dict(g=x["g"], A_log=x["A_log"], chunk_size=64, dt_bias=x["dt_bias"])
        ratio = (_allocated(lambda: kda_gate_chunk_cumsum(**gate, cu_seqlens=x["cu_seqlens"]))
                 / _allocated(lambda: kda_gate_chunk_cumsum(**gate, cu_seqlens=dense["cu_seqlens"])))
        assert ratio <= ALLOC_RATIO, f"gate cumsum: the varlen batch allocates {ratio:.1f}x one sequence's"


# ----------------------------------------------------------------------------------------------
# h in the input dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_intermediate_states_dtype(backend, dtype, rng):
    """return_intermediate_states returns h in the dtype of q (as fla-core does), its values the
    reference's states at chunk starts to the tolerance of that dtype."""
    if dtype == torch.float64 and backend != "torch":
        pytest.skip("float64 inputs: the PyTorch backend only")
    case = Case(seqlens=(70, 1, 130), H=1, HV=2, dtype=dtype, gate="safe", l2norm=True)
    x = make_inputs(case, device=DEVICE, generator=rng)
    with use_backend(backend), torch.inference_mode():
        o, s, h = chunk_kda(**x, return_intermediate_states=True)
    assert h.dtype == dtype and s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _, _, h_ref = reference(x, chunked=True, return_intermediate_states=True)
    check("h", h, h_ref, tolerance(dtype, backend))


# ----------------------------------------------------------------------------------------------
# boundaries the options leave unread


@pytest.mark.parametrize("cu", [[0, 5], [0, 2, 1], [1, 3]])
def test_decode_reads_and_checks_unread_boundaries(cu, rng):
    """Decoding leaves a device cu_seqlens unread (no synchronisation); this backend reads it and
    checks it: a ValueError naming cu_seqlens, never an out-of-range gather. (Options built with
    check_values=False leave any cu_seqlens unread, as they do a device one.)"""
    from fastkda.backends import registry
    from fastkda.options import recurrent_options

    x = make_inputs(Case(B=1, T=3, H=2, K=8, V=8), device=DEVICE, generator=rng)
    opts, inputs = recurrent_options(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=None, dt_bias=None, scale=None, initial_state=None,
        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
        cu_seqlens=torch.tensor(cu, device=x["q"].device), ssm_state_indices=None, num_accepted_tokens=None,
        inplace_final_state=False, check_values=False)
    assert inputs.cu_seqlens_cpu is None
    with pytest.raises(ValueError, match="`cu_seqlens` must"):
        registry.get("torch").fused_recurrent_kda(opts, inputs)
