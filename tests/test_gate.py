"""Gate helpers: fused_kda_gate (with gradients) and kda_gate_chunk_cumsum against the references."""

import pytest
import torch
from conftest import DEVICE
from helpers import check

from fastkda import platform
from fastkda.testing import param_error
from fastkda import fused_kda_gate, kda_gate_chunk_cumsum, naive_kda_gate, naive_kda_lowerbound_gate, use_backend
from fastkda.backends import backends

GATE_BACKENDS = [b.name for b in backends() if "kda_gate" in b.ops]
CUMSUM_BACKENDS = [b.name for b in backends() if "kda_gate_chunk_cumsum" in b.ops]
MODES = [
    ("softplus", None, True, True),
    ("softplus_no_bias", None, True, False),
    ("lowerbound", -5.0, True, True),
    ("lowerbound_noA", -0.1, False, True),
]


def _params(H, K, has_A, has_bias, rng, spread=1.0):
    A = (torch.rand(H, generator=rng) * 10 - 5) if has_A else None
    b = torch.randn(H * K, generator=rng) * spread if has_bias else None
    return A, b


def _ref(g, A, b, lb):
    g, A, b = (None if t is None else t.double() for t in (g, A, b))
    if lb is None:
        return naive_kda_gate(g, A, b, torch.float64)
    return naive_kda_lowerbound_gate(g, A, b, lb, torch.float64)


@pytest.mark.parametrize("backend", GATE_BACKENDS)
@pytest.mark.parametrize("mode,lb,has_A,has_bias", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kda_gate(backend, mode, lb, has_A, has_bias, dtype, rng):
    H, K = 3, 40
    g = (torch.randn(2, 17, H, K, generator=rng) * 30).to(dtype).to(DEVICE).requires_grad_()
    A, b = _params(H, K, has_A, has_bias, rng, spread=5.0)
    A = A.to(DEVICE).requires_grad_() if A is not None else None
    b = b.to(DEVICE).requires_grad_() if b is not None else None
    with use_backend(backend):
        y = fused_kda_gate(g, A, b, lower_bound=lb, output_dtype=torch.float32)
    assert y.dtype == torch.float32
    ref = _ref(g, A, b, lb)
    check("gate", y, ref, 1e-6)
    dy = torch.randn(y.shape, generator=rng).to(DEVICE)
    leaves = [t for t in (g, A, b) if t is not None]
    got = torch.autograd.grad((y * dy).sum(), leaves)
    want = torch.autograd.grad((ref * dy.double()).sum(), leaves)
    # bf16 gradients are rounded once: within an ulp (2^-8 relative) of the reference, which the
    # interpreter's truncating float32 -> bfloat16 conversion can double
    tol = 1e-5 if dtype == torch.float32 else 4e-3 * (2 if backend == "triton" and platform.triton_interpret() else 1)
    check("dg", got[0], want[0], tol)
    # dA_log and ddt_bias (float32) sum terms of both signs over tokens: their error relative to the
    # terms' magnitudes, float32's rounding of each term and of the sums
    params = [(n, t) for n, t in (("dA_log", A), ("ddt_bias", b)) if t is not None]
    for (name, p), a, r in zip(params, got[1:], want[1:]):
        err = param_error(a, r, _term_magnitudes(g, A, b, lb, dy, p))
        assert err <= 1e-6, f"{name}: error {err:.3g} relative to its terms > 1e-6"


def _term_magnitudes(g, A, b, lb, dy, p):
    """sum over the elements y_e that parameter entry i reaches of |dy_e dy_e/dp_i| (float64): each
    gate element depends on one entry of A_log and one of dt_bias, so the derivative along all-ones
    (J 1, by the double-vjp identity) gives every element's own dy_e/dp."""
    t = p.detach().double().requires_grad_()
    y = _ref(g.detach(), *(t if q is p else (None if q is None else q.detach()) for q in (A, b)), lb)
    u = torch.zeros_like(y, requires_grad=True)
    (vjp,) = torch.autograd.grad(y, t, u, create_graph=True)
    (dy_dp,) = torch.autograd.grad(vjp, u, torch.ones_like(vjp))
    terms = (dy.double() * dy_dp).abs()
    H, K = g.shape[-2:]
    per_head = terms.reshape(-1, H, K).sum(0)
    return per_head.sum(-1) if p is A else per_head.reshape(-1)


@pytest.mark.parametrize("backend", GATE_BACKENDS)
def test_lowerbound_gate_saturated_gradient(backend):
    """Where sigmoid rounds to 1 in float32 (x > ~16.6) the gradient is tiny but not zero: every
    element must keep its own relative accuracy, not only the RMS over the tensor."""
    x = torch.linspace(-40.0, 40.0, 2 * 3 * 64).view(1, 6, 2, 32).to(DEVICE).requires_grad_()
    with use_backend(backend):
        y = fused_kda_gate(x, None, None, lower_bound=-5.0, output_dtype=torch.float32)
    (got,) = torch.autograd.grad(y.sum(), x)
    xd = x.detach().double()
    want = -5.0 * torch.sigmoid(xd) * torch.sigmoid(-xd)
    rel = ((got.double() - want).abs() / want.abs()).max().item()
    assert rel < 1e-5, f"worst element relative error {rel:.3g}"


@pytest.mark.parametrize("backend", CUMSUM_BACKENDS)
@pytest.mark.parametrize("mode,lb,has_A,has_bias", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
def test_kda_gate_chunk_cumsum(backend, mode, lb, has_A, has_bias, varlen, chunk, rng):
    H, K = 2, 24
    lens = [0, 1, 70, 33, 64] if varlen else [100, 100]
    B, T = (1, sum(lens)) if varlen else (2, 100)
    g = (torch.randn(B, T, H, K, generator=rng) * 3).to(DEVICE)
    A, b = _params(H, K, has_A, has_bias, rng)
    A, b = (None if t is None else t.to(DEVICE) for t in (A, b))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE) if varlen else None
    scale = 1.4426950408889634
    with use_backend(backend):
        y = kda_gate_chunk_cumsum(g, A, chunk, scale=scale, dt_bias=b, cu_seqlens=cu, lower_bound=lb)
    act = _ref(g, A, b, lb)
    want = torch.empty_like(act)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if varlen else None
    for r in range(B):
        bounds = [(starts[i].item(), starts[i + 1].item()) for i in range(len(lens))] if varlen else [(0, T)]
        for s, e in bounds:
            for c in range(s, e, chunk):
                want[r, c: min(c + chunk, e)] = act[r, c: min(c + chunk, e)].cumsum(0) * scale
    check("chunk cumsum", y, want, 1e-6)



@pytest.mark.parametrize("backend", sorted(set(GATE_BACKENDS) & set(CUMSUM_BACKENDS)))
def test_gates_take_strided_parameters(backend, rng):
    """Strided A_log, dt_bias (as [HV, K] too) and cu_seqlens give what contiguous copies give (the
    Triton kernels index them densely), with gradients in the parameters' own shapes."""
    H, K = 2, 24
    g = torch.randn(1, 30, H, K, generator=rng).to(DEVICE)
    A = torch.randn(H, 2, generator=rng).to(DEVICE).requires_grad_()
    b = torch.randn(H, 2 * K, generator=rng).to(DEVICE).requires_grad_()
    A_c = A.detach()[:, 0].contiguous().requires_grad_()
    b_c = b.detach()[:, ::2].reshape(H * K).contiguous().requires_grad_()
    cu = torch.tensor([0, 0, 7, 0, 30, 0], device=DEVICE)[::2]
    assert not (A[:, 0].is_contiguous() or b[:, ::2].is_contiguous() or cu.is_contiguous())
    with use_backend(backend):
        got = kda_gate_chunk_cumsum(g, A.detach()[:, 0], 16, dt_bias=b.detach()[:, ::2], cu_seqlens=cu)
        want = kda_gate_chunk_cumsum(g, A_c.detach(), 16, dt_bias=b_c.detach(), cu_seqlens=cu.contiguous())
        y = fused_kda_gate(g, A[:, 0], b[:, ::2])
        y_c = fused_kda_gate(g, A_c, b_c)
    assert torch.equal(got, want)
    check("gate", y, y_c, 1e-6)
    dA, db = torch.autograd.grad(y.sum(), (A, b))
    dA_c, db_c = torch.autograd.grad(y_c.sum(), (A_c, b_c))
    check("dA_log", dA[:, 0], dA_c, 1e-6)
    check("ddt_bias", db[:, ::2].reshape(-1), db_c, 1e-6)
    assert not dA[:, 1].any() and not db[:, 1::2].any()


@pytest.mark.skipif("triton" not in CUMSUM_BACKENDS, reason="no Triton")
def test_triton_declines_what_its_programs_cannot_hold(rng):
    """A cumulative-sum chunk of more than 64 x 256 elements (one program holds it) is declined by
    the Triton backend with its reason (forced: BackendUnavailableError; by default the PyTorch
    backend serves the call); a long chunk of narrow features is not."""
    from fastkda import BackendUnavailableError

    g = torch.randn(1, 130, 2, 256, generator=rng).to(DEVICE)
    A = torch.rand(2, generator=rng).to(DEVICE)
    with use_backend("triton"):
        with pytest.raises(BackendUnavailableError, match="chunk_size=128, K=256"):
            kda_gate_chunk_cumsum(g, A, 128)
        narrow = kda_gate_chunk_cumsum(g[..., :8], A, 128)
    check("chunk 128 by default", kda_gate_chunk_cumsum(g, A, 128), kda_gate_chunk_cumsum(g.double(), A.double(), 128),
          1e-6)
    check("chunk 128, K = 8", narrow, kda_gate_chunk_cumsum(g[..., :8].double(), A.double(), 128), 1e-6)
