"""The KimiDeltaAttention layer: forward/backward, prefill + decode == one forward, varlen ==
per-sequence runs, the short convolution against its definition and through the causal-conv1d
interface, checkpoint A_log shapes."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import conftest
from conftest import DEVICE, GPU
from helpers import check

from fastkda.layers import GatedRMSNorm, KDACache, KimiDeltaAttention, ShortConvolution
from fastkda.layers import kda as kda_layer

DIMS = dict(hidden_size=64, num_heads=2, head_dim=16, num_v_heads=4, conv_size=4)


def layer(dtype=torch.float32, **kw):
    torch.manual_seed(conftest.TEST_SEED)  # the same weights for every layer() of one test, fresh per test
    m = KimiDeltaAttention(**{**DIMS, **kw}).to(DEVICE, dtype)
    with torch.no_grad():
        m.dt_bias.normal_()
    return m


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forward_backward(lower_bound, rng):
    m = layer(lower_bound=lower_bound, mode="chunk")
    x = torch.randn(2, 50, 64, generator=rng).to(DEVICE).requires_grad_()
    y, attn, past = m(x)
    assert attn is None and past is None
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize("lower_bound,conv", [(None, 4), (-3.0, 4), (None, 2), (None, 1)])
def test_prefill_then_decode_equals_full_forward(lower_bound, conv, rng):
    m = layer(lower_bound=lower_bound, conv_size=conv).eval()
    T, steps = 70, 6
    x = torch.randn(2, T + steps, 64, generator=rng).to(DEVICE)
    with torch.no_grad():
        full = layer(lower_bound=lower_bound, conv_size=conv, mode="chunk").eval()(x)[0]
        cache = KDACache()
        outs = [m(x[:, :T], cache=cache)[0]]
        for t in range(T, T + steps):
            outs.append(m(x[:, t: t + 1], cache=cache)[0])
    check("prefill + decode", torch.cat(outs, 1), full, 2e-5)


@pytest.mark.parametrize("conv", [4, 1])
def test_varlen_equals_per_sequence(conv, rng):
    m = layer(mode="chunk", conv_size=conv)
    lens = [5, 1, 40, 17]
    xs = [torch.randn(1, n, 64, generator=rng).to(DEVICE) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    with torch.no_grad():
        y = m(torch.cat(xs, 1), cu_seqlens=cu)[0]
        want = torch.cat([m(xi)[0] for xi in xs], 1)
    check("varlen", y, want, 2e-6)


@pytest.mark.parametrize("conv", [4, 1])
def test_varlen_decode_with_cache(conv, rng):
    """Two ragged sequences prefilled together (varlen), then one decode step each (a convolution
    of one tap keeps no inputs in its cache)."""
    m = layer(conv_size=conv).eval()
    lens = [9, 30]
    xs = [torch.randn(1, n + 1, 64, generator=rng).to(DEVICE) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    with torch.no_grad():
        cache = KDACache()
        m(torch.cat([x[:, :-1] for x in xs], 1), cache=cache, cu_seqlens=cu)
        step = m(torch.cat([x[:, -1:] for x in xs], 0), cache=cache)[0]
        want = torch.cat([layer(mode="chunk", conv_size=conv).eval()(x)[0][:, -1:] for x in xs], 0)
    check("decode after varlen prefill", step, want, 2e-5)


@pytest.mark.parametrize("conv", [4, 0])
def test_cache_reorder(conv, rng):
    """KDACache.reorder keeps the chosen sequences in the chosen order: decoding after it equals
    decoding a cache of those sequences alone (a layer without the convolution too)."""
    m = layer(conv_size=conv).eval()
    x = torch.randn(3, 12, 64, generator=rng).to(DEVICE)
    keep = torch.tensor([2, 0], device=DEVICE)
    with torch.no_grad():
        cache, alone = KDACache(), KDACache()
        m(x[:, :11], cache=cache)
        cache.reorder(keep)
        got = m(x[keep, 11:], cache=cache)[0]
        m(x[keep, :11], cache=alone)
        want = m(x[keep, 11:], cache=alone)[0]
    check("decode after reorder", got, want, 1e-6)
    before = {k: v.clone() for k, v in cache.recurrent_states.items()}
    convs = {k: [None if s is None else s.clone() for s in v] for k, v in cache.conv_states.items()}
    rule = r"`index` must be a 1-D int32 or int64 tensor, got "
    for bad, match in ((torch.tensor([0, 2], device=DEVICE), r"in \[0, 2\), got values from 0 to 2"),
                       (torch.tensor([-1], device=DEVICE), r"in \[0, 2\), got values from -1 to -1"),
                       (torch.tensor([[0]], device=DEVICE), rule + "torch.Tensor torch.int64"),
                       (torch.tensor([0.0], device=DEVICE), rule + "torch.Tensor torch.float32"),
                       ([0], rule + "list")):
        with pytest.raises(ValueError, match=match):
            cache.reorder(bad)
    assert all(torch.equal(cache.recurrent_states[k], v) for k, v in before.items())
    for key, states in convs.items():
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(cache.conv_states[key], states)), key


def test_short_convolution_kernel_size():
    with pytest.raises(ValueError, match=r"`kernel_size` must be a positive int, got 0"):
        ShortConvolution(8, 0)


def test_short_convolution_definition(rng):
    conv = ShortConvolution(8, 4).to(DEVICE)
    x = torch.randn(2, 11, 8, generator=rng).to(DEVICE)
    cache = torch.randn(2, 8, 3, generator=rng).to(DEVICE)
    y, new = conv(x, cache=cache, output_final_state=True)
    xp = torch.cat([cache.transpose(1, 2), x], 1)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(xp.transpose(1, 2), conv.weight, groups=8)).transpose(1, 2)
    check("conv", y, ref, 1e-6)
    assert torch.equal(new, xp[:, -3:].transpose(1, 2))


def test_short_convolution_kernel_size_wide_cache(rng):
    """cache_width=kernel_size (fla's layout): the cache's oldest input is carried, never read; the
    new cache is the last kernel_size inputs; the outputs are those of the narrow cache."""
    conv = ShortConvolution(8, 4).to(DEVICE)
    x = torch.randn(2, 2, 8, generator=rng).to(DEVICE)
    wide = torch.randn(2, 8, 4, generator=rng).to(DEVICE)
    y, new = conv(x, cache=wide, output_final_state=True, cache_width=4)
    y_ref, _ = conv(x, cache=wide[..., 1:].clone(), output_final_state=True)
    check("y", y, y_ref, 0)
    assert torch.equal(new, torch.cat([wide, x.transpose(1, 2)], 2)[..., -4:])
    y0, new0 = conv(x, output_final_state=True, cache_width=4)  # no cache: zeros before the first token
    assert torch.equal(new0[..., :2], torch.zeros(2, 8, 2, device=DEVICE)) and torch.equal(new0[..., 2:], x.transpose(1, 2))
    with pytest.raises(ValueError, match=r"`cache_width` must be kernel_size - 1 = 3 or kernel_size = 4, got 2"):
        conv(x, cache_width=2)
    with pytest.raises(ValueError, match=r"`cache` must be \[N, 8, 3\] with N=2 sequences .*got \[2, 8, 4\]"):
        conv(x, cache=wide)


def test_short_convolution_argument_rules(rng):
    """ShortConvolution's inputs: a ValueError naming the argument before any work (the values of
    cu_seqlens are the layer's to check: a convolution of each layer's three runs per step)."""
    conv = ShortConvolution(8, 4).to(DEVICE)
    x = torch.randn(1, 5, 8, generator=rng).to(DEVICE)
    with pytest.raises(ValueError, match=r"`hidden_size` must be a positive int, got 2\.5"):
        ShortConvolution(2.5)
    with pytest.raises(ValueError, match=r"`x` must be a floating \[B, T, hidden_size=8\] .*shape \[1, 5, 7\]"):
        conv(x[..., :7])
    with pytest.raises(ValueError, match=r"`x` must be a floating \[B, T, hidden_size=8\] .*shape \[5, 8\]"):
        conv(x[0])
    with pytest.raises(ValueError, match=r"`cache` must be \[N, 8, 3\] with N=2 sequences .*got \[3, 8, 3\]"):
        conv(x, cache=torch.zeros(3, 8, 3, device=DEVICE), cu_seqlens=torch.tensor([0, 2, 5], device=DEVICE))
    with pytest.raises(ValueError, match=r"`cache` must be \[N, 8, 3\] with N=1 sequences .*got \[2, 8, 3\]"):
        conv(x, cache=torch.zeros(2, 8, 3, device=DEVICE))
    with pytest.raises(ValueError, match=r"`cu_seqlens` must be int32 or int64, got torch.float32"):
        conv(x, cu_seqlens=torch.tensor([0.0, 2.0, 5.0]).to(DEVICE))
    with pytest.raises(ValueError, match=r"`cu_seqlens` needs the batch flattened to 1 .*got batch size 2"):
        conv(torch.cat([x, x]), cu_seqlens=torch.tensor([0, 2, 5]).to(DEVICE))
    with pytest.raises(ValueError, match=r"`cu_seqlens` must be a 1-D tensor \[N\+1\], got shape \[0\]"):
        conv(x, cu_seqlens=torch.zeros(0, dtype=torch.int32, device=DEVICE))


def test_cache_of_another_model(rng):
    """A cache whose recurrent state does not fit this layer (another model's heads or head sizes,
    another dtype): a ValueError naming the cache and the layer, before anything is written."""
    m = layer(conv_size=0).eval()
    cache = KDACache(recurrent_states={0: torch.zeros(1, 4, 8, 8, device=DEVICE)})
    with torch.no_grad(), pytest.raises(ValueError, match=r"`cache` holds a recurrent state of shape \[1, 4, 8, 8\] "
                                                           r"and torch.float32 for layer 0, but this layer's is "
                                                           r"\[1, 4, 16, 16\] float32"):
        m(torch.randn(1, 3, 64, generator=rng).to(DEVICE), cache=cache)
    assert cache.recurrent_states[0].shape == (1, 4, 8, 8)


def test_checkpoint_A_log_shape():
    m = layer()
    sd = m.state_dict()
    sd["A_log"] = (sd["A_log"] + 0.5).view(1, 1, -1, 1)  # values the fresh layer does not hold
    m2 = layer()
    m2.load_state_dict(sd)
    assert m2.A_log.shape == m.A_log.shape and torch.equal(m2.A_log, m.A_log + 0.5)


@pytest.mark.skipif(not GPU, reason="GPU tier")
@pytest.mark.gpu
def test_layer_bf16_gpu(rng):
    m = layer(torch.bfloat16, lower_bound=-5.0, mode="chunk")
    x = torch.randn(2, 300, 64, generator=rng).to(DEVICE, torch.bfloat16)
    ref = layer(torch.float32, lower_bound=-5.0, mode="chunk")(x.float())[0]
    check("bf16 layer", m(x)[0].float(), ref, 3e-2)


def _stand_in_causal_conv1d(calls):
    """A PyTorch stand-in for the causal-conv1d package's ``causal_conv1d_fn``, with its interface
    and input rules (channels contiguous when initial states or seq_idx are given; not both), so
    the layer's use of it is tested without a GPU."""

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        calls.append("fn")
        assert x.dim() == 3 and weight.shape == (x.shape[1], weight.shape[1]) and activation in (None, "silu")
        assert seq_idx is None or initial_states is None, "seq_idx takes no initial states"
        if seq_idx is not None or initial_states is not None:
            assert x.stride(1) == 1, "channels must be contiguous"
        B, D, T = x.shape
        W = weight.shape[1]
        init = initial_states if initial_states is not None else x.new_zeros(B, D, W - 1)
        xp = torch.cat([init, x], 2)
        if seq_idx is not None:  # zero the inputs of another sequence inside every window
            s = torch.cat([seq_idx.new_full((B, W - 1), -1), seq_idx], 1)
            win = xp.unfold(2, W, 1)  # [B, D, T, W]
            same = s.unfold(1, W, 1) == seq_idx[..., None]  # [B, T, W]
            y = (win * same[:, None] * weight[None, :, None, :]).sum(-1)
            y = y + (bias[None, :, None] if bias is not None else 0)
        else:
            y = F.conv1d(xp, weight[:, None, :], bias, groups=D)
        y = F.silu(y) if activation else y
        return (y, xp[..., -(W - 1):].contiguous()) if return_final_states else y

    return causal_conv1d_fn


@pytest.mark.parametrize("bias", [False, True])
def test_short_convolution_through_causal_conv1d(bias, rng):
    """With the package "installed" (a stand-in) the convolution takes its kernel where it applies
    and gives the PyTorch path's outputs, caches and gradients; a varlen batch with a cache, a
    hidden size that does not divide by 8 and float64 stay on the PyTorch path."""
    conv = ShortConvolution(8, 4, bias=bias).to(DEVICE)
    with torch.no_grad():
        if bias:
            conv.bias.normal_()
    x = torch.randn(2, 11, 8, generator=rng).to(DEVICE)
    cache = torch.randn(2, 8, 3, generator=rng).to(DEVICE)
    cache_before = cache.clone()
    cu = torch.tensor([0, 5, 5, 16, 22], device=DEVICE)
    xv = torch.randn(1, 22, 8, generator=rng).to(DEVICE)
    cases = {  # name: (x, kwargs, route through the package)
        "dense": (x, dict(), "fn"),
        "dense, cache, final": (x, dict(cache=cache, output_final_state=True), "fn"),
        "decode step": (x[:, :1], dict(cache=cache, output_final_state=True), "fn"),
        "varlen, final": (xv, dict(cu_seqlens=cu, output_final_state=True), "fn"),
        "varlen, cache": (xv, dict(cu_seqlens=cu, cache=torch.randn(4, 8, 3, generator=rng).to(DEVICE)), None),
        "float64": (x.double(), dict(), None),
    }
    calls = []
    for name, (xi, kw, route) in cases.items():
        grad = name not in ("decode step", "float64")
        xi = xi.clone().requires_grad_(grad)
        conv.to(xi.dtype)
        conv.kernel_devices = ()
        with torch.set_grad_enabled(grad):
            y_ref, c_ref = conv(xi, **kw)
        conv.kernel_fn, conv.kernel_devices = _stand_in_causal_conv1d(calls), (torch.device(DEVICE).type,)
        calls.clear()
        with torch.set_grad_enabled(grad):
            y, c = conv(xi, **kw)
        conv.kernel_fn = None
        assert calls == ([route] if route else []), name
        check(f"{name}: y", y, y_ref, 1e-6)
        assert (c is None) == (c_ref is None), name
        if c is not None:
            check(f"{name}: cache", c, c_ref, 1e-6)
            assert c.dtype == c_ref.dtype
        if grad:
            g = torch.randn(y.shape, generator=rng).to(y)
            dx_ref, dw_ref = torch.autograd.grad(y_ref, [xi, conv.weight], g)
            dx, dw = torch.autograd.grad(y, [xi, conv.weight], g)
            check(f"{name}: dx", dx, dx_ref, 1e-6)
            check(f"{name}: dweight", dw, dw_ref, 1e-6)
    assert torch.equal(cache, cache_before)  # no call (the decode step included) wrote the caller's cache
    odd = ShortConvolution(12, 4).to(DEVICE)  # 12 channels: not for the package's kernel
    calls.clear()
    odd.kernel_fn, odd.kernel_devices = _stand_in_causal_conv1d(calls), (torch.device(DEVICE).type,)
    odd(torch.randn(1, 5, 12, generator=rng).to(DEVICE))
    assert calls == []


@pytest.mark.skipif(not GPU, reason="GPU tier")
@pytest.mark.gpu
def test_causal_conv1d_package_matches_torch(rng):
    """Where the causal-conv1d package is installed: its kernels against the PyTorch path, bf16."""
    pytest.importorskip("causal_conv1d")
    assert kda_layer.CAUSAL_CONV1D is not None
    conv = ShortConvolution(256, 4).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 300, 256, generator=rng).to(DEVICE, torch.bfloat16)
    cache = torch.randn(2, 256, 3, generator=rng).to(DEVICE, torch.bfloat16)
    y, c = conv(x, cache=cache, output_final_state=True)
    y1, c1 = conv(x[:, :1], cache=cache, output_final_state=True)
    conv.kernel_devices = ()
    y_ref, c_ref = conv(x, cache=cache, output_final_state=True)
    y1_ref, c1_ref = conv(x[:, :1], cache=cache, output_final_state=True)
    check("y", y.float(), y_ref.float(), 1e-2)
    check("decode y", y1.float(), y1_ref.float(), 1e-2)
    assert torch.equal(c, c_ref) and torch.equal(c1, c1_ref)


@pytest.mark.parametrize("over,exc,match", [
    (dict(num_heads=0), ValueError, r"`num_heads` must be a positive int, got 0"),
    (dict(head_dim=0), ValueError, r"`head_dim` must be an int in \[1, 256\], got 0"),
    (dict(head_dim=257), ValueError, r"`head_dim` must be an int in \[1, 256\], got 257"),
    (dict(hidden_size=0), ValueError, r"`hidden_size` must be a positive int, got 0"),
    (dict(num_v_heads=0), ValueError, r"`num_v_heads` must be None or a positive int, got 0"),
    (dict(num_v_heads=3), ValueError, r"`num_v_heads`=3 must be a multiple of `num_heads`=2"),
    (dict(head_v_dim=0), ValueError, r"`head_v_dim` must be None or a positive int, got 0"),
    (dict(conv_size=-1), ValueError, r"`conv_size` must be a non-negative int \(0: no convolution\), got -1"),
    (dict(conv_size=2.0), ValueError, r"`conv_size` must be a non-negative int .*got 2\.0"),
    (dict(chunk_size=16), ValueError, r"`chunk_size` must be either 32 or 64, got 16"),
    (dict(lower_bound=0.0), ValueError,
     r"`lower_bound` must be a finite negative number \(.*float32's range\), got 0\.0"),
    (dict(lower_bound=-6.0, safe_gate=True), ValueError, r"`safe_gate=True` needs `lower_bound` in \[-5, 0\), got lower_bound=-6\.0"),
    (dict(safe_gate=True), ValueError, r"`safe_gate=True` needs `lower_bound` in \[-5, 0\), got lower_bound=None"),
    (dict(lower_bound="x"), TypeError, r"`lower_bound` must be a real number or None, got str"),
    (dict(norm_eps=0.0), ValueError, r"`norm_eps` must be a positive finite number, got 0\.0"),
    (dict(mode="x"), ValueError, r"`mode` must be 'chunk' or 'fused_recurrent' \(or 'auto'\), got 'x'"),
    (dict(mode=None), ValueError, r"`mode` must be .*got None"),
    (dict(mode="auto", force_mode=True), ValueError, r"`force_mode=True` needs `mode` 'chunk' or 'fused_recurrent', got 'auto'"),
    (dict(expand_v=1.3), ValueError, r"`expand_v`=1\.3 gives a value head dim head_dim \* expand_v = 16 \* 1\.3 = 20\.8.*not a positive integer"),
    (dict(expand_v=0), ValueError, r"`expand_v` must be a positive finite number, got 0\.0"),
    (dict(expand_v="2"), TypeError, r"`expand_v` must be a real number or None, got str"),
    (dict(expand_v=2, head_v_dim=8), ValueError, r"`head_v_dim`=8 disagrees with `expand_v`=2\.0 \(head_dim \* expand_v = 32\.0\)"),
    (dict(use_short_conv=1), TypeError, r"`use_short_conv` must be a bool, got int: 1"),
    (dict(conv_bias=None), TypeError, r"`conv_bias` must be a bool, got NoneType: None"),
    (dict(allow_neg_eigval="yes"), TypeError, r"`allow_neg_eigval` must be a bool, got str: 'yes'"),
    (dict(layer_idx=-1), ValueError, r"`layer_idx` must be None or a non-negative int, got -1"),
])
def test_constructor_rules(over, exc, match):
    with pytest.raises(exc, match=match):
        KimiDeltaAttention(**{**DIMS, **over})


def test_constructor_numpy_numbers():
    m = KimiDeltaAttention(**{**DIMS, "lower_bound": np.float32(-5.0), "chunk_size": np.int64(32)})
    assert m.lower_bound == -5.0 and type(m.lower_bound) is float and m.chunk_size == 32 and type(m.chunk_size) is int


@pytest.mark.parametrize("conv", [4, 0])
def test_cache_of_another_batch_size(conv, rng):
    """A KDACache holds its sequences' states: a forward with another number of sequences is a
    ValueError naming the cache, raised before anything is read or written."""
    m = layer(conv_size=conv).eval()
    with torch.no_grad():
        cache = KDACache()
        m(torch.randn(2, 5, 64, generator=rng).to(DEVICE), cache=cache)
        before = {k: (v.clone(), tuple(None if c is None else c.clone() for c in cache.conv_states[k]))
                  for k, v in cache.recurrent_states.items()}
        with pytest.raises(ValueError, match=r"`cache` holds 2 sequences for layer 0, but the input has 3"):
            m(torch.randn(3, 1, 64, generator=rng).to(DEVICE), cache=cache)
        cu = torch.tensor([0, 2, 3, 4], device=DEVICE)
        with pytest.raises(ValueError, match=r"`cache` holds 2 sequences for layer 0, but the input has 3"):
            m(torch.randn(1, 4, 64, generator=rng).to(DEVICE), cache=cache, cu_seqlens=cu)
    for k, (s, convs) in before.items():
        assert torch.equal(cache.recurrent_states[k], s)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(cache.conv_states[k], convs))


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_varlen_with_host_boundaries(mode, rng):
    """Given cu_seqlens_cpu, the layer and chunk_kda read no boundaries back from cu_seqlens (no
    host synchronisation per layer): the same outputs and caches as without it."""
    from fastkda import seqlens

    m = layer(conv_size=4, mode=mode, force_mode=True).eval()
    lens = [5, 1, 40, 17]
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    cu = cu_cpu.to(DEVICE, torch.int32)
    x = torch.randn(1, sum(lens), 64, generator=rng).to(DEVICE)
    with torch.no_grad():
        want_cache = KDACache()
        want = m(x, cache=want_cache, cu_seqlens=cu)[0]
        cache = KDACache()
        with seqlens.no_device_reads():
            got = m(x, cache=cache, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)[0]
    check("varlen", got, want, 0)
    for k in want_cache.recurrent_states:
        assert torch.equal(cache.recurrent_states[k], want_cache.recurrent_states[k])
        assert all(torch.equal(a, b) for a, b in zip(cache.conv_states[k], want_cache.conv_states[k]))
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu` was given without `cu_seqlens`"):
        m(x, cu_seqlens_cpu=cu_cpu)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("bad,exc,match", [
    (dict(cu_seqlens=[0, 2, 5]), TypeError, r"`cu_seqlens` must be a torch.Tensor, got list"),
    (dict(cu_seqlens=torch.tensor([[0, 2, 5]])), ValueError,
     r"`cu_seqlens` must be a 1-D tensor \[N\+1\], got shape \[1, 3\]"),
    (dict(cu_seqlens=torch.tensor([0, 2, 4])), ValueError, r"`cu_seqlens` must end at the total length T=5, got 4"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5]), cu_seqlens_cpu=torch.tensor([0, 3, 5])), ValueError,
     r"`cu_seqlens` and `cu_seqlens_cpu` must hold the same values, got cu_seqlens\[1\]=2 and cu_seqlens_cpu\[1\]=3"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5]), cu_seqlens_cpu=torch.tensor([0.0, 2.0, 5.0])), ValueError,
     r"`cu_seqlens_cpu` must be a CPU int tensor shaped like cu_seqlens \[3\]"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5], device="meta")), ValueError,
     r"`cu_seqlens` is on meta but `hidden_states` is on"),
    (dict(x=torch.randn(2, 5, 64), cu_seqlens=torch.tensor([0, 2, 5])), ValueError,
     r"`cu_seqlens` needs the batch flattened to 1 .*got batch size 2"),
    (dict(x=torch.randn(1, 5, 63)), ValueError,
     r"`hidden_states` must be a floating \[batch, seq_len, hidden_size=64\] tensor, got shape \[1, 5, 63\]"),
    (dict(x=torch.ones(1, 5, 64, dtype=torch.int64)), ValueError, r"`hidden_states` must be a floating .*torch.int64"),
    (dict(use_cache="no"), TypeError, r"`use_cache` must be a bool or None, got str: 'no'"),
    (dict(use_cache=np.bool_(True)), TypeError, r"`use_cache` must be a bool or None, got numpy\.bool"),
    (dict(cu_seqlens=torch.tensor([0, 2, 4]), use_cache=False), ValueError,
     r"`cu_seqlens` must end at the total length T=5, got 4"),
])
def test_forward_argument_rules(mode, bad, exc, match):
    """Bad boundaries, inputs and flags: a ValueError or TypeError naming the argument, raised before
    the convolution or the cache is touched (a CPU cu_seqlens and its host copy are compared, also on
    the token-by-token path, whose operator takes no host copy)."""
    bad = dict(bad)  # (shared by both modes' parameter sets)
    if "cu_seqlens_cpu" in bad and "values" in match and DEVICE != "cpu":
        pytest.skip("a host copy vouches for a device cu_seqlens: compared only with a CPU one")
    if bad.get("use_cache") is False and DEVICE != "cpu":
        pytest.skip("a decode step without a cache write reads no device cu_seqlens back: values unchecked")
    m = layer(conv_size=4, mode=mode, force_mode=True).eval()
    x = bad.pop("x", torch.randn(1, 5, 64)).to(DEVICE)
    if isinstance(bad.get("cu_seqlens"), torch.Tensor) and bad["cu_seqlens"].device.type != "meta":
        bad["cu_seqlens"] = bad["cu_seqlens"].to(DEVICE)
    cache = KDACache()
    with torch.no_grad():
        with pytest.raises(exc, match=match):
            m(x, past_key_values=cache, use_cache=bad.pop("use_cache", True), **bad)
    assert not cache.recurrent_states and not cache.conv_states


def test_gated_rms_norm_rules():
    for eps in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match=rf"`eps` must be a positive finite number, got {re.escape(repr(eps))}"):
            GatedRMSNorm(8, eps=eps)
    with pytest.raises(ValueError, match=r"`dim` must be a positive int, got 0"):
        GatedRMSNorm(0)


def test_float64_layer_decodes_from_its_cache(rng):
    """A float64 layer (the PyTorch backend) keeps float64 states in its cache and reads them back:
    prefill, then one token, equals one forward over both."""
    m = layer(torch.float64, conv_size=4).eval()
    x = torch.randn(2, 6, 64, generator=rng, dtype=torch.float64).to(DEVICE)
    with torch.no_grad():
        cache = KDACache()
        m(x[:, :5], cache=cache)
        assert cache.recurrent_states[0].dtype == torch.float64
        step = m(x[:, 5:], cache=cache)[0]
        full = m(x)[0]
    check("decode step", step, full[:, 5:], 1e-10)
