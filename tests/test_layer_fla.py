"""fastkda's KimiDeltaAttention as a drop-in for fla's (flash-linear-attention 0.6.0).

CPU tier: tests/data/fla_kda_layer.pt, written by tools/fla_layer_fixture.py with fla's layer,
holds three small layers' state dicts, inputs and outputs (whole batches, padded batches, prefill +
decode steps with fla's cache, training mode) and the cache's states. fla's KDA operator was
replaced there by a float64 reference, so the file pins the layer's wiring: projections, short
convolution, gates, gated norm, output gate, padding and cache handling. Each state dict loads into
fastkda's layer strictly, and fastkda's outputs and states match at float32.

GPU tier (with fla installed): fla's layer itself, both ways (fla's state dict into fastkda's layer
and fastkda's into fla's), bf16, with padding masks and cache decoding, a cache shared by the two.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, GPU
from helpers import check

from fastkda import use_backend
from fastkda.layers import KDACache, KimiDeltaAttention

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "fla_kda_layer.pt")
DATA = torch.load(FIXTURE, weights_only=True)
CASES = sorted(DATA["cases"])
TOL = 1e-5 if DEVICE == "cpu" else 2e-3  # relative RMS, float32 (the GPU kernels' float32 dots may run in tf32)


@pytest.fixture(autouse=True)
def _torch_backend_on_cpu():
    """On the CPU tier the layer's operators run on the PyTorch backend (the interpreter is slow)."""
    if DEVICE == "cpu":
        with use_backend("torch"):
            yield
    else:
        yield


class LayerCache:
    """The interface of fla's ``Cache`` that its layers use: ``len``, ``cache[i]``, ``update``."""

    def __init__(self):
        self.states, self.updates = [], []

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def update(self, recurrent_state=None, conv_state=None, layer_idx=0, offset=1, **_):
        self.updates.append((layer_idx, offset))
        while len(self.states) <= layer_idx:
            self.states.append({"recurrent_state": None, "conv_state": None})
        if recurrent_state is not None:
            self.states[layer_idx]["recurrent_state"] = recurrent_state
        if conv_state is not None:
            self.states[layer_idx]["conv_state"] = conv_state
        return self.states[layer_idx]


def fastkda_layer(name: str) -> KimiDeltaAttention:
    case = DATA["cases"][name]
    m = KimiDeltaAttention(**case["config"])
    m.load_state_dict(case["state_dict"], strict=True)
    return m.to(DEVICE).eval()


def to_dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("name", CASES)
def test_state_dict_names_and_shapes_are_fla_s(name):
    """A fastkda layer built with fla's arguments has fla's parameter names and shapes: fla's state
    dict loads into it strictly, and its own loads into fla's layer."""
    case = DATA["cases"][name]
    ours = KimiDeltaAttention(**case["config"]).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in case["state_dict"].items()}
    fastkda_layer(name)


@pytest.mark.parametrize("name", CASES)
def test_outputs_match_fla(name):
    """Whole batch, left-padded batch (attention_mask), and training mode (gradients on)."""
    case = DATA["cases"][name]
    m = fastkda_layer(name)
    x, mask = to_dev(case["x"], case["attention_mask"])
    with torch.no_grad():
        o, attn, past = m(x)
        assert attn is None and past is None
        check("output", o, case["out"].to(DEVICE), TOL)
        o = m(x, attention_mask=mask)[0]
        check("output, attention_mask", o, case["out_masked"].to(DEVICE), TOL)
        assert not o[mask == 0].any(), "padding positions must be zeros"
        # a boolean mask and one of floats mean the same
        assert torch.equal(m(x, attention_mask=mask.bool())[0], o)
    m.train()
    o = m(x)[0]
    check("output, training", o.detach(), case["out_train"].to(DEVICE), TOL)


@pytest.mark.parametrize("cache_kind", ["fla", "kda"])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "mask"])
@pytest.mark.parametrize("name", CASES)
def test_decode_matches_fla(name, masked, cache_kind):
    """Prefill then decode steps with a cache: fla's outputs at every step; with a cache of fla's
    interface, the states it holds afterwards are fla's too (layouts included)."""
    case = DATA["cases"][name]
    T0, steps = DATA["prefill"], DATA["steps"]
    m = fastkda_layer(name)
    x, mask = to_dev(case["x"], case["attention_mask"])
    key = "decode_masked" if masked else "decode"
    cache = LayerCache() if cache_kind == "fla" else KDACache()
    with torch.no_grad():
        for i, (lo, hi) in enumerate([(0, T0)] + [(t, t + 1) for t in range(T0, T0 + steps)]):
            am = mask[:, :hi] if masked else None  # as a model passes it: every token so far
            o, _, past = m(x[:, lo:hi], attention_mask=am, past_key_values=cache, use_cache=True)
            assert past is cache
            check(f"{key} step {i}", o, case[key][i].to(DEVICE), TOL)
    if cache_kind == "fla":
        idx = case["config"]["layer_idx"]
        assert [u[0] for u in cache.updates] == [idx] * (steps + 1)
        assert [u[1] for u in cache.updates] == [T0] + [1] * steps  # offset: the tokens of each call
        state = cache[idx]
        check("recurrent state", state["recurrent_state"], case[key + "_recurrent_state"].to(DEVICE), TOL)
        want = case[key + "_conv_state"]
        if want is None:
            assert state["conv_state"] is None
        else:
            for got, ref in zip(state["conv_state"], want):
                assert got.shape == ref.shape
                check("conv state", got, ref.to(DEVICE), TOL)


def kimi_names(sd: dict) -> dict:
    """A state dict as the Kimi Linear checkpoints name it: low-rank pairs f_a/f_b/g_a/g_b, no
    output-gate bias, A_log as [1, 1, HV, 1]."""
    names = {"f_proj.0": "f_a_proj", "f_proj.1": "f_b_proj", "g_proj.0": "g_a_proj", "g_proj.1": "g_b_proj"}
    out = {}
    for k, v in sd.items():
        if k == "g_proj.1.bias":
            continue
        head, _, leaf = k.rpartition(".")
        out[f"{names.get(head, head)}.{leaf}" if head else k] = v
    out["A_log"] = sd["A_log"].view(1, 1, -1, 1)
    return out


@pytest.mark.parametrize("prefix", ["", "model.layers.0.self_attn."])
def test_kimi_linear_names_load(prefix):
    """Kimi Linear's names load strictly (also inside a model, with a prefix): the output gate gets
    a zero bias, and the layer computes what fla's names with a zero bias give."""
    case = DATA["cases"]["gva_expand_v"]
    sd = {k: v.clone() for k, v in case["state_dict"].items()}
    sd["g_proj.1.bias"].zero_()
    want = KimiDeltaAttention(**case["config"])
    want.load_state_dict(sd, strict=True)
    kimi = kimi_names(sd)
    assert "g_b_proj.weight" in kimi and "g_proj.1.bias" not in kimi and kimi["A_log"].dim() == 4
    m = KimiDeltaAttention(**case["config"])
    if prefix:
        model = torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        model.model.layers[0].self_attn = m
        model.load_state_dict({prefix + k: v for k, v in kimi.items()}, strict=True)
    else:
        m.load_state_dict(kimi, strict=True)
    for k, v in want.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    # a checkpoint that does carry the output gate's bias keeps it
    kimi["g_b_proj.bias"] = torch.randn(kimi["g_b_proj.weight"].shape[0])
    m.load_state_dict(kimi, strict=True)
    assert torch.equal(m.g_proj[1].bias, kimi["g_b_proj.bias"])


def test_initial_values_are_fla_s():
    """A_log = log U(1, 16) (0 with safe_gate), dt_bias = softplus^-1(dt), dt log-uniform in
    [1e-3, 1e-1]; the output-gate bias and conv bias as nn.Linear's / nn.Conv1d's; o_norm.weight 1."""
    torch.manual_seed(0)
    m = KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=4, num_v_heads=8, conv_bias=True)
    assert m.A_log.shape == (8,) and m.A_log.dtype == torch.float32
    assert (m.A_log >= 0).all() and (m.A_log <= math.log(16)).all()
    dt = F.softplus(m.dt_bias.double())
    assert m.dt_bias.shape == (8 * 16,) and (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 1e-1 * (1 + 1e-5)).all()
    assert dt.log().std() > 0.5  # spread over the decades, not one value
    assert m.A_log._no_weight_decay and m.dt_bias._no_weight_decay
    assert torch.equal(m.o_norm.weight, torch.ones(16))
    assert m.g_proj[1].bias.abs().max() <= 16**-0.5 and m.g_proj[1].bias.any()
    assert m.q_conv1d.bias.abs().max() <= 4**-0.5 and m.q_conv1d.bias.any()
    safe = KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=4, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(safe.A_log, torch.zeros(4))
    # fla's defaults
    d = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2)
    assert (d.mode, d.layer_idx, d.norm_eps, d.o_norm.eps, d.conv_size, d.use_short_conv) == ("chunk", None, 1e-5, 1e-5, 4, True)
    assert (d.expand_v, d.head_v_dim, d.num_v_heads, d.safe_gate, d.allow_neg_eigval, d.lower_bound) == (1, 8, 2, False, False, None)


def test_fla_positional_order():
    m = KimiDeltaAttention(32, 2, 8, 2)  # hidden_size, expand_v, head_dim, num_heads
    assert (m.hidden_size, m.head_v_dim, m.head_k_dim, m.num_heads) == (32, 16, 8, 2)


def test_unknown_constructor_keywords_warn():
    with pytest.warns(UserWarning, match=r"ignores the keyword arguments \['attn_mode', 'foo'\]"):
        KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, foo=1, attn_mode="chunk")


@pytest.mark.parametrize("mode,force,training,grad,T,want", [
    ("chunk", False, False, False, 10, "fused_recurrent"),  # decoding / short inputs at inference
    ("chunk", False, False, False, 65, "chunk"),
    ("chunk", False, False, True, 10, "chunk"),  # gradients: the chunked kernel
    ("chunk", False, True, False, 10, "chunk"),  # training mode
    ("fused_recurrent", False, False, False, 65, "fused_recurrent"),
    ("fused_recurrent", False, True, True, 65, "chunk"),
    ("auto", False, False, False, 10, "fused_recurrent"),
    ("auto", False, False, False, 65, "chunk"),
    ("chunk", True, False, False, 10, "chunk"),  # force_mode: the mode's kernel always
    ("fused_recurrent", True, True, True, 65, "fused_recurrent"),
])
def test_kernel_choice(mode, force, training, grad, T, want):
    """fla's rule: gradients take the chunked kernel, inference inputs of at most 64 tokens the
    recurrent one, others `mode`'s; force_mode keeps `mode`'s. The call runs with that choice."""
    m = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, mode=mode, force_mode=force).to(DEVICE)
    m.train(training)
    with torch.set_grad_enabled(grad):
        assert ("fused_recurrent" if m._recurrent(T) else "chunk") == want
        o = m(torch.randn(1, T, 32, device=DEVICE))[0]
    assert o.shape == (1, T, 32) and bool(torch.isfinite(o).all())


def test_use_short_conv_false_applies_silu():
    """Without the convolution q, k, v are silu of their projections (conv_size=0 keeps them as
    projected: fastkda's earlier meaning)."""
    torch.manual_seed(0)
    a = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, use_short_conv=False).to(DEVICE).eval()
    b = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, conv_size=0).to(DEVICE).eval()
    b.load_state_dict(a.state_dict(), strict=True)
    assert not hasattr(a, "q_conv1d") and not hasattr(b, "q_conv1d")
    x = torch.randn(2, 7, 32, device=DEVICE)
    with torch.no_grad():
        plain = b(x)[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(b, name, torch.nn.Sequential(getattr(b, name), torch.nn.SiLU()))
        assert torch.equal(a(x)[0], b(x)[0])
        assert not torch.allclose(a(x)[0], plain)


def test_forward_argument_errors(rng):
    m = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2).to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE)
    with pytest.raises(TypeError, match=r"`attention_mask` must be a \[batch, seq_len\] tensor or None, got KDACache; "
                                        r"pass a cache as `past_key_values=`"):
        m(x, KDACache())  # fastkda's former positional cache
    with pytest.raises(ValueError, match=r"`attention_mask` must be \[batch, seq_len\] = \[2, >= 5\].*got shape \[2, 4\]"):
        m(x, attention_mask=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"`attention_mask` must be .*got shape \[2, 5, 5\]"):
        m(x, attention_mask=torch.ones(2, 5, 5, device=DEVICE))
    with pytest.raises(ValueError, match=r"`past_key_values` needs the layer's `layer_idx`.*got layer_idx=None"):
        m(x, past_key_values=LayerCache(), use_cache=True)
    with pytest.raises(TypeError, match=r"`past_key_values` must be a KDACache, a cache with fla's layer-cache interface "
                                        r"or None, got dict"):
        m(x, past_key_values={})
    with pytest.raises(ValueError, match=r"pass the cache once: as `cache` or as `past_key_values`, not both"):
        m(x, cache=KDACache(), past_key_values=KDACache())
    with pytest.raises(ValueError, match=r"`hidden_states` must be a \[batch, seq_len, hidden_size\] tensor"):
        m(x[0])


def test_cache_read_only_without_use_cache():
    """A cache given without use_cache is read, not written (a KDACache given as `cache=` is
    written: fastkda's earlier form); the layer runs without layer_idx on a KDACache (key 0)."""
    m = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2).to(DEVICE).eval()
    x = torch.randn(2, 6, 32, device=DEVICE)
    with torch.no_grad():
        c = KDACache()
        m(x[:, :5], cache=c)
        before = c.recurrent_states[0].clone()
        o1 = m(x[:, 5:], past_key_values=c)[0]
        assert torch.equal(c.recurrent_states[0], before)
        o2 = m(x[:, 5:], past_key_values=c, use_cache=True)[0]
        assert torch.equal(o1, o2) and not torch.equal(c.recurrent_states[0], before)
        fla_cache = LayerCache()
        m.layer_idx = 0
        m(x, past_key_values=fla_cache)
        assert len(fla_cache) == 0 and fla_cache.updates == []


def test_mask_with_cu_seqlens_takes_cu_seqlens():
    """As in fla: explicit cu_seqlens win over attention_mask."""
    m = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2).to(DEVICE).eval()
    x = torch.randn(1, 9, 32, device=DEVICE)
    cu = torch.tensor([0, 4, 9], device=DEVICE)
    with torch.no_grad():
        assert torch.equal(m(x, attention_mask=torch.zeros(1, 9, device=DEVICE), cu_seqlens=cu)[0], m(x, cu_seqlens=cu)[0])


def _fla_gpu():
    """fla's layer module and Cache, with fla's own KDA kernels; skips without them."""
    fla_kda = pytest.importorskip("fla.layers.kda")
    cache_utils = pytest.importorskip("fla.models.utils")
    if not fla_kda.chunk_kda.__module__.startswith("fla"):
        pytest.skip("fla's KDA entry points are routed to fastkda in this process")
    return fla_kda, cache_utils.Cache


GPU_CONFIGS = {
    "gva": dict(hidden_size=256, head_dim=64, num_heads=4, num_v_heads=8, layer_idx=0),
    "safe_gate": dict(hidden_size=256, head_dim=64, num_heads=4, expand_v=2, safe_gate=True, lower_bound=-5.0,
                      allow_neg_eigval=True, conv_bias=True, layer_idx=2),
}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="GPU tier")
@pytest.mark.parametrize("direction", ["fla_to_fastkda", "fastkda_to_fla"])
@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_against_fla_layer_gpu(name, direction):
    """fla's layer and fastkda's with one state dict (loaded strictly either way), bf16: the same
    outputs for a batch, a left-padded batch, and prefill + decode with fla's Cache and with a
    KDACache; fastkda's layer continues decoding from a cache that fla's layer filled."""
    fla_kda, Cache = _fla_gpu()
    config = GPU_CONFIGS[name]
    torch.manual_seed(0)
    fla_layer, ours = fla_kda.KimiDeltaAttention(**config), KimiDeltaAttention(**config)
    src, dst = (fla_layer, ours) if direction == "fla_to_fastkda" else (ours, fla_layer)
    with torch.no_grad():
        for p in src.parameters():  # away from the initial values (ones, zeros)
            p.add_(0.1 * torch.randn_like(p))
    dst.load_state_dict(src.state_dict(), strict=True)
    fla_layer, ours = (mod.to("cuda", torch.bfloat16).eval() for mod in (fla_layer, ours))
    B, T, T0, steps, tol = 3, 300, 100, 4, 3e-2
    x = torch.randn(B, T, config["hidden_size"], device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(B, T, dtype=torch.long, device="cuda")
    mask[0, :37] = 0
    mask[2, :150] = 0
    with torch.no_grad():
        check("output", ours(x)[0].float(), fla_layer(x)[0].float(), tol)
        got, want = ours(x, attention_mask=mask)[0], fla_layer(x, attention_mask=mask)[0]
        check("output, attention_mask", got.float(), want.float(), tol)
        assert not got[mask == 0].any()
        for masked in (False, True):
            caches = {"fla": Cache(), "ours, fla's cache": Cache(), "ours, KDACache": KDACache(), "ours after fla": Cache()}
            layers = {"fla": fla_layer, "ours, fla's cache": ours, "ours, KDACache": ours, "ours after fla": fla_layer}
            outs = {k: [] for k in caches}
            for i, (lo, hi) in enumerate([(0, T0)] + [(t, t + 1) for t in range(T0, T0 + steps)]):
                am = mask[:, :hi] if masked else None
                if i == 1:
                    layers["ours after fla"] = ours  # fastkda's layer decodes from fla's prefill
                for k, cache in caches.items():
                    outs[k].append(layers[k](x[:, lo:hi], attention_mask=am, past_key_values=cache, use_cache=True)[0])
            for k in caches:
                if k != "fla":
                    for i, (a, b) in enumerate(zip(outs[k], outs["fla"])):
                        check(f"{k}, mask={masked}, step {i}", a.float(), b.float(), tol)
            idx = config["layer_idx"]
            check("recurrent state in fla's cache", caches["ours, fla's cache"][idx]["recurrent_state"],
                  caches["fla"][idx]["recurrent_state"], tol)
