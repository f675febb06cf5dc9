"""GPU tier only: launches of more (sequence, value head) pairs than a CUDA grid's second dimension
holds (65535): the state scans and the decode kernel run on one grid dimension (common.seq_grid)."""

import pytest
import torch
from conftest import BACKWARD_BACKENDS, BACKENDS
from helpers import check, check_grads, tol_for

from fastkda import chunk_kda, fused_recurrent_kda, use_backend
from fastkda.testing import Case, make_inputs, reference

pytestmark = pytest.mark.gpu
N_SEQ, HV = 2100, 32  # 67200 (sequence, value head) pairs


def _case(rng):
    lens = torch.randint(1, 6, (N_SEQ,), generator=rng).tolist()
    lens[7] = 70  # one sequence longer than a chunk
    return Case(seqlens=tuple(lens), H=8, HV=HV, K=32, V=32, dtype=torch.bfloat16, gate="softplus", l2norm=True,
                beta_sigmoid=True)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_more_pairs_than_grid_rows(backend, op, rng):
    assert N_SEQ * HV > 65535
    case = _case(rng)
    x = make_inputs(case, device="cuda", generator=rng)
    if op == "recurrent":
        x.pop("safe_gate", None)
    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    with use_backend(backend), torch.inference_mode():
        o, s = fn(**x)
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, backend))
    check("final_state", s, s_ref, tol_for(case.dtype, backend))


@pytest.mark.parametrize("backend", [b for b in BACKWARD_BACKENDS if b != "torch"])
def test_more_pairs_than_grid_rows_backward(backend, rng):
    case = _case(rng)
    x = make_inputs(case, device="cuda", requires_grad=True, generator=rng)
    leaves = {n: t for n, t in x.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    with use_backend(backend):
        o, s = chunk_kda(**x)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    got = dict(zip(leaves, torch.autograd.grad((o.float() * do.float()).sum() + (s * ds).sum(), list(leaves.values()))))
    o_r, s_r = reference(x)
    loss_r = (o_r * do.double()).sum() + (s_r * ds.double()).sum()
    want = dict(zip(leaves, torch.autograd.grad(loss_r, list(leaves.values()), allow_unused=True)))
    check_grads(got, want, x, tol_for(case.dtype, backend))
