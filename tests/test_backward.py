"""chunk_kda gradients on every backend against autograd through the float64 reference."""

import pytest
import torch
from conftest import BACKWARD_BACKENDS, DEVICE, GPU
from helpers import AXES, check, grow, tol_for

from fastkda import chunk_kda, use_backend
from fastkda.testing import Case, make_inputs, reference

GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

# the per-token float64 reference with autograd is slow: backward axes use shorter sequences
BWD_AXES = {name: (c.replace(T=min(c.T, 80)) if c.seqlens is None else c) for name, c in AXES.items()}
BWD_AXES["varlen"] = Case(seqlens=(1, 40, 0, 33, 65))
BWD_AXES["deep_decay"] = AXES["deep_decay"].replace(T=200)


def grads(backend, case, rng, disable_recompute=False):
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    leaves = {n: x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)}
    with use_backend(backend):
        o, s = chunk_kda(**x, chunk_size=case.chunk_size, disable_recompute=disable_recompute)
    do = torch.randn(o.shape, generator=rng).to(o)
    ds = torch.randn(s.shape, generator=rng).to(s) if s is not None else None
    loss = (o.float() * do.float()).sum() + ((s * ds).sum() if s is not None else 0)
    got = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    o_r, s_r = reference(x)
    loss_r = (o_r * do.double()).sum() + ((s_r * ds.double()).sum() if s is not None else 0)
    want = dict(zip(leaves, torch.autograd.grad(loss_r, list(leaves.values()), allow_unused=True)))
    return got, want


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("axis", list(BWD_AXES))
def test_backward_axis(backend, axis, rng):
    case = grow(BWD_AXES[axis], GPU)
    got, want = grads(backend, case, rng)
    tol = tol_for(case.dtype, backend)
    for name, ref in want.items():
        if ref is None:  # the input plays no part (e.g. lower_bound only)
            assert got[name] is None or not got[name].any(), name
            continue
        assert got[name] is not None, f"d{name} missing"
        check(f"d{name}", got[name], ref, tol)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_disable_recompute_same_gradients(backend, rng):
    case = grow(Case(T=90, gate="safe", l2norm=True, beta_sigmoid=True), GPU)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    g1, _ = grads(backend, case, torch.Generator().manual_seed(seed))
    g2, _ = grads(backend, case, torch.Generator().manual_seed(seed), disable_recompute=True)
    for name in g1:
        check(f"d{name}", g2[name], g1[name], 1e-6)


def test_gradcheck_float64():
    """Finite differences through the public API in float64 (PyTorch backend), every input."""
    case = Case(seqlens=(3, 0, 37), H=1, HV=2, K=4, V=3, dtype=torch.float64, gate="softplus", l2norm=True,
                beta_sigmoid=True, allow_neg_eigval=True, chunk_size=32, gate_spread=1.0)
    x = make_inputs(case, requires_grad=True)
    names = [n for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)]

    def f(*ts):
        kw = {**x, **dict(zip(names, ts))}
        with use_backend("torch"):
            o, s = chunk_kda(**kw, chunk_size=32)
        return o, s

    assert torch.autograd.gradcheck(f, [x[n] for n in names], eps=1e-6, atol=1e-6, rtol=1e-4)
