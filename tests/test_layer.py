"""The KimiDeltaAttention layer: forward/backward, prefill + decode == one forward, varlen ==
per-sequence runs, the short convolution against its definition, checkpoint A_log shapes."""

import pytest
import torch
from conftest import DEVICE, GPU
from helpers import check

from fastkda.layers import KDACache, KimiDeltaAttention, ShortConvolution

DIMS = dict(hidden_size=64, num_heads=2, head_dim=16, num_v_heads=4, conv_size=4)


def layer(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    m = KimiDeltaAttention(**{**DIMS, **kw}).to(DEVICE, dtype)
    with torch.no_grad():
        m.dt_bias.normal_()
    return m


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forward_backward(lower_bound, rng):
    m = layer(lower_bound=lower_bound, mode="chunk")
    x = torch.randn(2, 50, 64, generator=rng).to(DEVICE).requires_grad_()
    y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize("lower_bound", [None, -3.0])
def test_prefill_then_decode_equals_full_forward(lower_bound, rng):
    m = layer(lower_bound=lower_bound).eval()
    T, steps = 70, 6
    x = torch.randn(2, T + steps, 64, generator=rng).to(DEVICE)
    with torch.no_grad():
        full = layer(lower_bound=lower_bound, mode="chunk").eval()(x)
        cache = KDACache()
        outs = [m(x[:, :T], cache=cache)]
        for t in range(T, T + steps):
            outs.append(m(x[:, t: t + 1], cache=cache))
    check("prefill + decode", torch.cat(outs, 1), full, 2e-5)


def test_varlen_equals_per_sequence(rng):
    m = layer(mode="chunk")
    lens = [5, 1, 40, 17]
    xs = [torch.randn(1, n, 64, generator=rng).to(DEVICE) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    with torch.no_grad():
        y = m(torch.cat(xs, 1), cu_seqlens=cu)
        want = torch.cat([m(xi) for xi in xs], 1)
    check("varlen", y, want, 2e-6)


def test_varlen_decode_with_cache(rng):
    """Two ragged sequences prefilled together (varlen), then one decode step each."""
    m = layer().eval()
    lens = [9, 30]
    xs = [torch.randn(1, n + 1, 64, generator=rng).to(DEVICE) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    with torch.no_grad():
        cache = KDACache()
        m(torch.cat([x[:, :-1] for x in xs], 1), cache=cache, cu_seqlens=cu)
        step = m(torch.cat([x[:, -1:] for x in xs], 0), cache=cache)
        want = torch.cat([layer(mode="chunk").eval()(x)[:, -1:] for x in xs], 0)
    check("decode after varlen prefill", step, want, 2e-5)


def test_short_convolution_definition(rng):
    conv = ShortConvolution(8, 4).to(DEVICE)
    x = torch.randn(2, 11, 8, generator=rng).to(DEVICE)
    cache = torch.randn(2, 8, 3, generator=rng).to(DEVICE)
    y, new = conv(x, cache=cache, output_final_state=True)
    xp = torch.cat([cache.transpose(1, 2), x], 1)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(xp.transpose(1, 2), conv.weight, groups=8)).transpose(1, 2)
    check("conv", y, ref, 1e-6)
    assert torch.equal(new, xp[:, -3:].transpose(1, 2))


def test_checkpoint_A_log_shape():
    m = layer()
    sd = m.state_dict()
    sd["A_log"] = sd["A_log"].view(1, 1, -1, 1).clone()
    m2 = layer()
    m2.load_state_dict(sd)
    assert torch.equal(m2.A_log, m.A_log)


@pytest.mark.skipif(not GPU, reason="GPU tier")
@pytest.mark.gpu
def test_layer_bf16_gpu(rng):
    m = layer(torch.bfloat16, lower_bound=-5.0, mode="chunk")
    x = torch.randn(2, 300, 64, generator=rng).to(DEVICE, torch.bfloat16)
    ref = layer(torch.float32, lower_bound=-5.0, mode="chunk")(x.float())
    check("bf16 layer", m(x).float(), ref, 3e-2)
