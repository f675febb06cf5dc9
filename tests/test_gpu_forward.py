"""GPU tier only: chunk_kda forward at real shapes, gate extremes, long sequences, 64-bit offsets."""

import pytest
import torch
from conftest import BACKENDS
from helpers import check, tol_for

from fastkda import chunk_kda, explain, use_backend
from fastkda.testing import Case, make_inputs, reference

pytestmark = pytest.mark.gpu
GPU_BACKENDS = [b for b in BACKENDS if b != "torch"]

REAL = {
    "T16384_H96_safe": Case(T=16384, H=96, HV=96, K=128, V=128, dtype=torch.bfloat16, gate="safe", l2norm=True, beta_sigmoid=True),
    "T8192_H16_HV64_softplus": Case(T=8192, H=16, HV=64, K=128, V=128, dtype=torch.bfloat16, gate="softplus", l2norm=True, beta_sigmoid=True),
    "varlen_H32": Case(seqlens=(1300, 547, 2048, 963, 271, 3063, 1, 64), H=32, HV=32, K=128, V=128, dtype=torch.bfloat16, gate="safe", l2norm=True, beta_sigmoid=True),
    "lb-5": Case(T=4096, H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, gate="safe", lower_bound=-5.0, gate_spread=30.0, A_log_range=(-5.0, 5.0), l2norm=True),
    "lb-0.1": Case(T=4096, H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, gate="safe", lower_bound=-0.1, gate_spread=30.0, A_log_range=(-5.0, 5.0), l2norm=True),
    "softplus_extreme": Case(T=4096, H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, gate="softplus", gate_spread=30.0, A_log_range=(-5.0, 5.0), l2norm=True),
    "lowerbound_extreme_fp32": Case(T=4096, H=4, HV=8, K=128, V=64, dtype=torch.float32, gate="lowerbound", lower_bound=-30.0, gate_spread=30.0, A_log_range=(-5.0, 5.0)),
    "deep_decay_T65536": Case(T=65536, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, gate="safe", lower_bound=-5.0, A_log_range=(2.0, 5.0), l2norm=True),
    "k256_v256_fp16": Case(T=2048, H=2, HV=4, K=256, V=256, dtype=torch.float16, gate="lowerbound_noA", l2norm=True),
    "k96_v80_chunk32": Case(T=3000, H=3, HV=6, K=96, V=80, dtype=torch.bfloat16, gate="softplus", chunk_size=32, state_v_first=True),
}


# the float64 chunked reference of T16384 H96 holds about 17 GB: alone, not beside parallel workers
BIG = {"T16384_H96_safe"}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("path", ["short", "chunk"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.bigmem) if n in BIG else n for n in REAL])
def test_real_shapes(backend, path, name, rng, tune):
    """Each shape on both forward paths of the Triton backend: the short one (16-token blocks, merged
    in pairs for the bounded gates of these few heads; keys and values of at most 128) and the
    chunk-wide one, each forced."""
    case = REAL[name]
    if path == "short" and max(case.K, case.V) > 128:
        pytest.skip("the short path takes keys and values of at most 128")
    tune(short_min_pairs=1 if path == "short" else None)
    x = make_inputs(case, device="cuda", generator=rng)
    with use_backend(backend), torch.inference_mode():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, backend))
    check("final_state", s, s_ref, tol_for(case.dtype, backend))


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("how", ["caller_stream", "graph"])
def test_short_parts_streams(how, rng, tune):
    """A call cut into parts (its scans on a stream of their own) issued from a caller's stream right
    after that stream wrote the inputs (late, behind a sleep) and read on that stream at once, or
    captured in a CUDA graph and replayed on new inputs: the outputs of one uncut call on the same
    inputs, bit for bit."""
    from fastkda.backends.triton.plan import tuned

    case = Case(T=3 * 4096 + 129, H=4, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="safe", l2norm=True,
                beta_sigmoid=True)
    tune(short_min_pairs=1)
    x = make_inputs(case, device="cuda", generator=rng)
    fresh = make_inputs(case, device="cuda", generator=rng)
    names = [n for n, t in x.items() if isinstance(t, torch.Tensor)]  # the gate parameters too
    with use_backend("triton"), torch.inference_mode():
        assert "parts:" in str(explain(chunk_kda, **x).plan)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if how == "caller_stream":
                torch.cuda._sleep(1 << 26)  # the inputs' writes come late: a scan that does not wait reads old ones
                for n in names:  # written on the caller's stream just before the call
                    x[n].copy_(fresh[n])
                o, s = chunk_kda(**x)
                o, s = o.clone(), s.clone()  # read on the caller's stream at once: the call must have joined the scans
            else:
                chunk_kda(**x)  # compiled and warmed on a side stream, as graph capture asks
        torch.cuda.current_stream().wait_stream(side)
        if how == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                o, s = chunk_kda(**x)
            for n in names:
                x[n].copy_(fresh[n])
            o.fill_(float("nan"))
            s.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        with tuned(short_part_tokens=None):
            o1, s1 = chunk_kda(**fresh)
    assert torch.equal(o, o1) and torch.equal(s, s1)


@pytest.mark.bigmem
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_more_than_2_31_elements(backend):
    """q, k, v, g of 2^31 + elements: a last short sequence sits past every 32-bit offset."""
    H, K = 64, 128
    tail = 300
    T = 2**31 // (H * K) + tail
    case = Case(seqlens=(T - tail, tail), H=H, HV=H, K=K, V=K, dtype=torch.bfloat16, gate="safe", initial_state=False,
                l2norm=True, beta_sigmoid=True)
    x = make_inputs(case, device="cuda")  # drawn on the GPU: 2^31 values are slow to draw on the CPU
    assert x["q"].numel() > 2**31
    with use_backend(backend), torch.inference_mode():
        o, s = chunk_kda(**x)
    sub = {n: (x[n][:, T - tail:] if n in ("q", "k", "v", "g", "beta") else x[n]) for n in x}
    sub["cu_seqlens"] = torch.tensor([0, tail], device="cuda", dtype=torch.int32)
    o_ref, s_ref = reference(sub)
    check("o of the last sequence", o[:, T - tail:], o_ref, tol_for(case.dtype, backend))
    check("final state of the last sequence", s[1:], s_ref, tol_for(case.dtype, backend))
