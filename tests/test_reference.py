"""The chunked reference equals the per-token reference (float64), on every option."""

import pytest
import torch
from helpers import check

from fastkda.testing import Case, make_inputs, reference

CASES = [
    Case(T=100),
    Case(B=2, T=70, H=1, HV=3, K=16, V=24, gate="softplus", l2norm=True),
    Case(seqlens=(1, 64, 0, 63, 65, 7), gate="lowerbound", beta_sigmoid=True, allow_neg_eigval=True),
    Case(T=90, gate="safe", lower_bound=-5.0, state_v_first=True, chunk_size=32),
    Case(T=90, gate="lowerbound_noA", lower_bound=-0.1, initial_state=False, scale=0.3),
    Case(T=130, gate="softplus", gate_spread=30.0, A_log_range=(-5.0, 5.0)),
    Case(T=96, gate="pregated_safe", dtype=torch.float64, chunk_size=32),
]


@pytest.mark.parametrize("case", CASES, ids=Case.describe)
def test_chunked_equals_recurrent(case, rng):
    x = make_inputs(case, generator=rng)
    o_r, s_r = reference(x, chunked=False)
    o_c, s_c, h = reference(x, chunked=True, chunk_size=case.chunk_size, return_intermediate_states=True)
    check("o", o_c, o_r, 1e-10)
    check("final_state", s_c, s_r, 1e-10)
    # h[:, c] is the state after the tokens before chunk c: compare with the per-token states
    _, _, states = reference(x, return_all_states=True)
    C = case.chunk_size
    if case.seqlens is None:
        for c in range(1, h.shape[1]):
            check(f"h[{c}]", h[:, c], states[:, c * C - 1], 1e-10)
    else:
        i, start = 0, 0
        for L in case.seqlens:
            for c in range(0, L, C):
                if c:
                    check(f"h[{i}]", h[0, i], states[0, start + c - 1], 1e-10)
                i += 1
            start += L
        assert h.shape[1] == i


def test_gate_references_match_formulas(rng):
    g = torch.randn(3, 4, 8, generator=rng, dtype=torch.float64) * 10
    A = torch.randn(4, generator=rng, dtype=torch.float64)
    b = torch.randn(32, generator=rng, dtype=torch.float64)
    from fastkda import naive_kda_gate, naive_kda_lowerbound_gate

    x = g + b.view(4, 8)
    sp = torch.where(x > 0, x + torch.log1p(torch.exp(-x.abs())), torch.log1p(torch.exp(x)))
    check("softplus gate", naive_kda_gate(g, A, b, torch.float64), -A.exp()[:, None] * sp, 1e-12)
    lb = naive_kda_lowerbound_gate(g, A, b, -3.0, torch.float64)
    check("lower-bound gate", lb, -3.0 / (1 + torch.exp(-A.exp()[:, None] * x)), 1e-12)
    assert bool(((lb >= -3.0) & (lb <= 0)).all())
    check("lower-bound gate, no A_log", naive_kda_lowerbound_gate(g, None, b, -3.0, torch.float64),
          -3.0 / (1 + torch.exp(-x)), 1e-12)


@pytest.mark.parametrize("case", CASES[1:4], ids=Case.describe)
def test_chunked_gradients_equal_recurrent(case, rng):
    """The GPU tier differentiates the chunked reference: its gradients equal the per-token ones."""
    x = make_inputs(case, requires_grad=True, generator=rng)
    leaves = {n: t for n, t in x.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    grads = []
    for chunked in (False, True):
        o, s = reference(x, chunked=chunked, chunk_size=case.chunk_size)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
        loss = (o * do).sum() + (s.square().sum() if s is not None else 0)
        grads.append(torch.autograd.grad(loss, list(leaves.values()), allow_unused=True))
    for name, got, want in zip(leaves, grads[1], grads[0]):
        assert (got is None) == (want is None), name
        if want is not None:
            check(f"d{name}", got, want, 1e-10)


def test_gate_param_scales_of_negligible_slopes():
    """Terms of dA_log and ddt_bias whose gate slope is at or below SLOPE_FLOOR (raw gates far down
    a lower-bound gate) have no typical dgate to scale: their own magnitude |dg_raw| counts, so that
    a head made only of such terms has the sum of their magnitudes as its scale, not 0 (a kernel's
    bfloat16-level agreement would otherwise read as an unbounded error)."""
    from fastkda.testing import SLOPE_FLOOR, gate_param_scales, gate_slope

    B, T, HV, K = 1, 4, 1, 2
    g = torch.full((B, T, HV, K), -80.0, dtype=torch.float64)
    x = dict(g=g, A_log=torch.zeros(HV, dtype=torch.float64), dt_bias=torch.zeros(HV * K, dtype=torch.float64),
             use_gate_in_kernel=True, lower_bound=-8.0)
    slope = gate_slope(x)
    assert (slope.abs() <= SLOPE_FLOOR).all()
    dg_raw = torch.tensor([1e-30, -2e-30, 3e-30, 4e-30] * 2, dtype=torch.float64).view(B, T, HV, K)
    scales = gate_param_scales(x, dg_raw, slope)
    torch.testing.assert_close(scales["dt_bias"], dg_raw.abs().sum((0, 1)).reshape(-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(scales["A_log"], (dg_raw.abs() * 80.0).sum((0, 1)).sum(-1), rtol=1e-12, atol=0)
