"""Results do not depend on what the memory a call allocates held before: every output, final
state, gradient and pool written alike, bit for bit, when each allocation starts as NaN (the
suite's poisoning) and when it starts as random bytes (what reused memory holds: finite values of
any size, infinities and NaNs, any integer). NaN alone lets through a read of memory nothing wrote
that a maximum, a minimum or a comparison drops, and a product that sends a huge finite value
through a zero (tf32x3 splits it into an infinite part)."""

import pytest
import torch
from conftest import DEVICE, GPU
from helpers import GRAD_INPUTS, grow

from fastkda import chunk_kda, fused_recurrent_kda, use_backend
from fastkda.backends import backends
from fastkda.testing import Case, make_inputs, poisoned

CHUNK = [b.name for b in backends() if "chunk_kda" in b.ops]
RECURRENT = [b.name for b in backends() if "fused_recurrent_kda" in b.ops]

# two chunks, the last one partial; strong softplus decays take the split passes (16-bit inputs)
TRAIN = {
    "f32_safe": Case(T=70, gate="safe", l2norm=True),
    "bf16_safe": Case(T=70, dtype=torch.bfloat16, gate="safe", l2norm=True, beta_sigmoid=True),
    "fp16_safe": Case(T=70, dtype=torch.float16, gate="safe", l2norm=True),
    "bf16_strong": Case(T=130, dtype=torch.bfloat16, gate="softplus", l2norm=True, A_log_range=(2.0, 2.77)),
    "fp16_strong": Case(T=130, dtype=torch.float16, gate="softplus", l2norm=True, A_log_range=(2.0, 2.77)),
    "bf16_varlen": Case(seqlens=(1, 40, 0, 33, 65), dtype=torch.bfloat16, gate="softplus", l2norm=True),
}


def _under(fill, run):
    with poisoned(fill=fill):
        return run()


def _assert_same(nan, bits):
    assert nan.keys() == bits.keys()
    for name, a in nan.items():
        b = bits[name]
        assert bool(torch.isfinite(a).all()), f"{name}: not finite with memory filled with NaN"
        diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()
        assert torch.equal(a, b), f"{name}: {diff} apart with memory filled with random bytes"


@pytest.mark.parametrize("backend", CHUNK)
@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "whole"])
@pytest.mark.parametrize("name", list(TRAIN))
def test_training_step(backend, name, whole, rng, tune):
    """A training step (forward, recomputation, backward) of a partial last chunk, varlen and the
    strong decays' passes, block and whole-chunk gate gradients (16-bit inputs; float32 keeps its
    own): o, the final state and every gradient."""
    if backend == "triton":
        tune(whole_backward=whole)
    elif whole:
        pytest.skip("one backward on this backend")
    case = grow(TRAIN[name], GPU)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    leaves = {n: x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)}
    do = torch.randn(x["v"].shape, generator=rng).to(x["v"])  # o: as v; the final state: as the initial one
    ds = torch.randn(x["initial_state"].shape, generator=rng).to(x["initial_state"])

    def step():
        with use_backend(backend):
            o, s = chunk_kda(**x, chunk_size=case.chunk_size)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + (s * ds).sum(), list(leaves.values()))
        return {"o": o.detach(), "final_state": s.detach(), **{f"d{n}": g for n, g in zip(leaves, grads)}}

    _assert_same(_under("nan", step), _under("bits", step))


@pytest.mark.parametrize("backend", CHUNK)
@pytest.mark.parametrize("T", [70, 300])
def test_inference(backend, T, rng):
    """chunk_kda without gradients (the short path, and parts of one sequence), bf16 and fp16 with the
    softplus gate: o and the final state."""
    for dtype in (torch.bfloat16, torch.float16):
        case = grow(Case(T=T, dtype=dtype, gate="softplus", l2norm=True, beta_sigmoid=True), GPU)
        x = make_inputs(case, device=DEVICE, generator=rng)

        def run():
            with use_backend(backend), torch.no_grad():
                o, s = chunk_kda(**x, chunk_size=case.chunk_size)
            return {"o": o, "final_state": s}

        _assert_same(_under("nan", run), _under("bits", run))


@pytest.mark.parametrize("backend", RECURRENT)
def test_decode_on_pool(backend, rng):
    """fused_recurrent_kda on a state pool, slots written in place (one padding slot): o and the pool."""
    case = grow(Case(B=3, T=4, dtype=torch.bfloat16, gate="softplus", l2norm=True, beta_sigmoid=True), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    h0 = x.pop("initial_state")
    pool = torch.randn(5, *h0.shape[1:], generator=rng).to(DEVICE)
    slots = torch.tensor([4, -1, 0], device=DEVICE)

    def run():
        p = pool.clone()
        with use_backend(backend):
            o, _ = fused_recurrent_kda(**x, initial_state=p, ssm_state_indices=slots, inplace_final_state=True)
        return {"o": o, "pool": p}

    _assert_same(_under("nan", run), _under("bits", run))


def test_unknown_fill_is_refused():
    with pytest.raises(ValueError, match=r"fill must be one of \('nan', 'bits'\), got 'zeros'"):
        with poisoned(fill="zeros"):
            pass
