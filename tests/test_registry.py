"""Backend selection: priorities, verifiers with visible reasons, forcing and forbidding."""

import logging

import pytest
import torch

import fastkda
import fastkda.backends
from fastkda import BackendUnavailableError, chunk_kda, use_backend
from fastkda.backends import Backend, register, registry, select
from fastkda.testing import Case, make_inputs
from helpers import plain_options


class _Picky(Backend):
    name = "picky-test"
    priority = 10_000
    ops = ("chunk_kda",)

    def __init__(self):
        self.calls = 0

    def verify(self, op, opts, inputs):
        if opts.shape.K != 8:
            return False, f"needs K == 8, got K={opts.shape.K}"
        return True, "K == 8"

    def chunk_kda(self, opts, inputs):
        self.calls += 1
        return registry.get("torch").chunk_kda(opts, inputs)


@pytest.fixture
def picky():
    b = register(_Picky())
    yield b
    registry.unregister(b.name)


def _call(K, **kw):
    x = make_inputs(Case(T=10, K=K, V=8))
    return chunk_kda(**x, **kw)


def test_priority_and_verifier(picky, caplog):
    with caplog.at_level(logging.DEBUG, logger="fastkda.backends"):
        _call(16)
    assert picky.calls == 0
    assert "needs K == 8, got K=16" in caplog.text
    _call(8)
    assert picky.calls == 1


def test_select_reports_reasons(picky):
    x = make_inputs(Case(T=10, K=16, V=8))
    opts, inputs = plain_options(x)
    backend, reasons = select("chunk_kda", opts, inputs)
    assert backend.name != "picky-test"
    assert ("picky-test", "needs K == 8, got K=16") in reasons


def test_forced_backend_never_falls_back(picky, monkeypatch):
    monkeypatch.setenv("FASTKDA_BACKEND", "picky-test")
    with pytest.raises(BackendUnavailableError, match=r"FASTKDA_BACKEND=picky-test cannot run chunk_kda: needs K == 8, got K=16"):
        _call(16)
    _call(8)
    assert picky.calls == 1


def test_forced_unknown_backend(monkeypatch):
    monkeypatch.setenv("FASTKDA_BACKEND", "nope")
    with pytest.raises(BackendUnavailableError, match=r"unknown fastkda backend 'nope'"):
        _call(8)


def test_forced_backend_without_the_op(picky):
    x = make_inputs(Case(T=3, K=8, V=8))
    from fastkda import fused_recurrent_kda

    with use_backend("picky-test"), pytest.raises(BackendUnavailableError, match="does not implement fused_recurrent_kda"):
        fused_recurrent_kda(**x)


def test_disabled_backends(picky, monkeypatch):
    monkeypatch.setenv("FASTKDA_DISABLE_BACKENDS", "picky-test")
    _call(8)
    assert picky.calls == 0
    monkeypatch.setenv("FASTKDA_DISABLE_BACKENDS", "picky-test,torch")
    if all(b.name in ("picky-test", "torch") for b in registry.backends()):
        with pytest.raises(BackendUnavailableError, match="disabled by FASTKDA_DISABLE_BACKENDS"):
            _call(8)


def test_use_backend_context_restores(picky):
    with use_backend("torch"):
        _call(8)
        with use_backend(None):
            _call(8)
        assert registry.forced_backend() == "torch"
    assert picky.calls == 1
    assert registry.forced_backend() is None


def test_torch_is_the_cpu_default():
    """CPU tensors go to the PyTorch backend, also when TRITON_INTERPRET=1 (the interpreter
    serves CPU tensors only when the triton backend is forced)."""
    x = make_inputs(Case(T=5))
    opts, inputs = plain_options(x)
    assert select("chunk_kda", opts, inputs)[0].name == "torch"


@pytest.mark.gpu
def test_triton_is_the_cuda_default(monkeypatch):
    """Unforced CUDA calls of chunk_kda and fused_recurrent_kda go to the Triton backend."""
    import torch

    from fastkda import explain, fused_recurrent_kda

    monkeypatch.delenv("FASTKDA_BACKEND", raising=False)
    x = make_inputs(Case(T=70, H=2, K=32, V=32), device="cuda")
    for fn in (chunk_kda, fused_recurrent_kda):
        name, reasons = explain(fn, **x)
        assert name == "triton", reasons
        o = fn(**x)[0]
        assert torch.isfinite(o).all()


def test_forward_only_backend_skipped_when_gradients_are_needed(picky):
    """A backend without the op's backward (``differentiable``) serves only calls that need no
    gradient; one that does goes on to the next backend, with the reason, and gets its gradients."""
    x = make_inputs(Case(T=10, K=8, V=8), requires_grad=True)
    o, _ = chunk_kda(**x)
    assert picky.calls == 0 and o.requires_grad
    name, reasons = fastkda.explain(chunk_kda, **x)
    assert name != "picky-test"
    assert ("picky-test", "has no backward for chunk_kda, and the call needs gradients") in reasons
    with torch.no_grad():
        chunk_kda(**x)
    assert picky.calls == 1
    with use_backend("picky-test"), pytest.raises(BackendUnavailableError, match="has no backward for chunk_kda"):
        chunk_kda(**x)
    assert fastkda.backends.explain(chunk_kda, **x) == (name, reasons)  # also from the backends package


@pytest.mark.skipif("triton" not in [b.name for b in fastkda.backends.backends()], reason="no Triton")
def test_torch_func_transforms_go_to_the_pytorch_backend():
    """The Triton kernels take plain tensors only: under torch.func transforms the Triton backend
    declines with its reason, and the call runs (differentiably) on the PyTorch backend."""
    x = make_inputs(Case(T=20, K=16, V=16))
    q = x.pop("q")
    got = torch.func.grad(lambda q: chunk_kda(q, **x)[0].sum())(q)
    qq = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(chunk_kda(qq, **x)[0].sum(), qq)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with use_backend("triton"), pytest.raises(BackendUnavailableError, match="torch.func transforms"):
        torch.func.grad(lambda q: chunk_kda(q, **x)[0].sum())(q)


class _Keeper(Backend):
    """A backend that kept a decode error for one device."""

    name = "keeper-test"
    priority = -10

    def __init__(self):
        self.kept = {"cpu": "slot 7 is outside the pool"}

    def verify(self, op, opts, inputs):
        return False, "serves nothing"

    def take_decode_error(self, device):
        return self.kept.pop(str(device), None)


def test_decode_error_asks_every_backend():
    """fastkda.decode_error returns the message a registered backend kept for the device and
    clears it there; None once no backend has one."""
    while fastkda.decode_error("cpu") is not None:  # what earlier calls in this process left
        pass
    b = register(_Keeper())
    try:
        assert fastkda.decode_error("cpu") == "slot 7 is outside the pool"
        assert fastkda.decode_error("cpu") is None
    finally:
        registry.unregister(b.name)
