"""The Triton kernels stay inside their tensors whatever cu_seqlens holds: boundaries that disagree
with the host values the chunk tables were made from (a CUDA cu_seqlens beside a cu_seqlens_cpu
that lies about it, or changed after the tables were made) read no row outside [0, T) and no
per-chunk scratch outside the tables."""

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS, DEVICE

from fastkda import use_backend
from fastkda.backends import registry
from fastkda.options import chunk_options

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
SENTINEL = 1e30  # rows past T: any read of them makes the output non-finite or huge


def guarded_inputs(T: int, pad: int, H=1, K=16, V=16, seed=0):
    """q, k, v, g, beta of T rows, each the first rows of a tensor whose ``pad`` rows after them
    hold SENTINEL."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in (("q", (H, K)), ("k", (H, K)), ("v", (H, V)), ("g", (H, K)), ("beta", (H,))):
        full = torch.full((1, T + pad, *shape), SENTINEL)
        body = torch.randn(1, T, *shape, generator=gen)
        if name == "k":
            body = F.normalize(body, dim=-1)
        if name == "g":
            body = F.logsigmoid(body)
        if name == "beta":
            body = torch.rand(1, T, *shape, generator=gen)
        full[:, :T] = body
        out[name] = full[:, :T].to(DEVICE)
    return out


@pytest.mark.parametrize("told, read", [
    ([0, 10, 30, 40], [0, 40, 2000, 40]),  # a boundary past T, then one going back
    ([0, 10, 30, 40], [-50, 7, 8, 10**6]),  # negative start, an end far past T
    ([0, 40, 40, 40], [0, 1, 2, 40]),  # more chunks in a sequence than its tables hold
])
def test_kernels_clamp_boundaries(told, read):
    T = told[-1]
    x = guarded_inputs(T, pad=96)
    cu_host = torch.tensor(told, dtype=torch.int64)
    opts, inputs = chunk_options(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=None, output_final_state=True,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
        return_intermediate_states=False, state_v_first=False, cu_seqlens=cu_host.to(DEVICE),
        cu_seqlens_cpu=cu_host, cp_context=None, A_log=None, dt_bias=None, chunk_size=64,
    )
    # the kernels read boundaries the host never saw (the tables are those of ``told``)
    inputs = inputs._replace(cu_seqlens=torch.tensor(read, dtype=torch.int32, device=DEVICE))
    with torch.inference_mode(), use_backend("triton"):
        o, final, _ = registry.dispatch("chunk_kda", opts, inputs)
    assert o.shape == (1, T, 1, 16) and final.shape == (3, 1, 16, 16)
    # no sentinel row was read: every written value is far below it
    for name, t in (("o", o), ("final_state", final)):
        t = t.float()
        seen = t[torch.isfinite(t)]
        assert seen.numel() == 0 or seen.abs().max() < 1e6, f"{name} read a row past T"
