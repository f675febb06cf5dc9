"""torch.compile(fullgraph=True) over code that calls the operators (custom ops with fake shapes
and autograd)."""

import pytest
import torch
import conftest
from conftest import DEVICE
from helpers import check

from fastkda import chunk_kda, fused_recurrent_kda
from fastkda.layers import KimiDeltaAttention
from fastkda.testing import Case, make_inputs


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_compiled_layer_forward_backward(mode, rng):
    """Training through a compiled layer equals eager training (the recurrent op's functional form
    has a backward too)."""
    torch.manual_seed(conftest.TEST_SEED)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)
            self.attn = KimiDeltaAttention(hidden_size=32, num_heads=2, head_dim=16, mode=mode, force_mode=True,
                                           lower_bound=-5.0)

        def forward(self, x):
            return self.attn(self.proj(x))[0]

    model = Model().to(DEVICE)
    x = torch.randn(2, 40 if mode == "chunk" else 12, 32, generator=rng).to(DEVICE)
    eager = model(x)
    eager.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.square().sum().backward()
    check("compiled output", y, eager, 1e-5)
    for n, p in model.named_parameters():
        check(f"compiled d{n}", p.grad, grads[n], 1e-4)


def test_compiled_operators_varlen_and_pool(rng):
    x = make_inputs(Case(seqlens=(5, 30, 1), gate="softplus", l2norm=True, beta_sigmoid=True), device=DEVICE, generator=rng)

    def f(x):
        return chunk_kda(**x)

    o, s = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    o_e, s_e = f(x)
    check("o", o, o_e, 1e-6)
    check("final", s, s_e, 1e-6)

    pool = torch.randn(6, 2, 32, 32, device=DEVICE)
    pool_e = pool.clone()
    y = make_inputs(Case(B=3, T=1, gate="softplus", initial_state=False, final_state=False), device=DEVICE, generator=rng)
    idx = torch.tensor([4, -1, 0], device=DEVICE)

    def step(y, pool):
        return fused_recurrent_kda(**y, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)[0]

    o = torch.compile(step, fullgraph=True, backend="aot_eager")(y, pool)
    o_e = step(y, pool_e)
    check("decode o", o, o_e, 1e-6)
    assert torch.equal(pool, pool_e)

    def step_async(y, pool):  # the custom op carries raise_on_bad_index too
        return fused_recurrent_kda(**y, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True,
                                   raise_on_bad_index=False)[0]

    o = torch.compile(step_async, fullgraph=True, backend="aot_eager")(y, pool)
    o_e = step_async(y, pool_e)
    check("decode o, raise_on_bad_index=False", o, o_e, 1e-6)
    assert torch.equal(pool, pool_e)


def test_custom_ops_pass_opcheck(rng):
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) on the
    differentiable custom ops."""
    x = make_inputs(Case(B=2, T=5, H=1, HV=2, K=16, V=16, gate="softplus", l2norm=True, beta_sigmoid=True),
                    device=DEVICE, requires_grad=True, generator=rng)
    flags = (True, True, True, True, False)  # output_final_state, l2norm, gate, beta sigmoid, neg eigval
    chunk = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, x["initial_state"], *flags, False, None, False, None,
             x["A_log"], x["dt_bias"], 64)
    rec = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], 0.25, x["initial_state"], *flags, None,
           False, None, None, None, False, True)
    for op, args in ((torch.ops.fastkda.chunk_kda.default, chunk),
                     (torch.ops.fastkda.fused_recurrent_kda_functional.default, rec)):
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
