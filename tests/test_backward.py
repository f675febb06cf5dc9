"""chunk_kda gradients on every backend against autograd through the float64 reference."""

import pytest
import torch
from conftest import BACKENDS, BACKWARD_BACKENDS, DEVICE, GPU
from helpers import (AXES, FORMS, GRAD_INPUTS, OPTION_SPACE, bounded, check, check_grads, forced_gates, grow,
                     launched, plain_options, random_case, scan_given_u, stage1_of, tol_for)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastkda import chunk_kda, use_backend
from fastkda.testing import Case, gate_param_scales, make_inputs, param_error, reference, rel_rms

# the per-token float64 reference with autograd is slow: backward axes use shorter sequences
BWD_AXES = {name: (c.replace(T=min(c.T, 80)) if c.seqlens is None else c) for name, c in AXES.items()}
BWD_AXES["varlen"] = Case(seqlens=(1, 40, 0, 33, 65))
BWD_AXES["deep_decay"] = AXES["deep_decay"].replace(T=200)


def backend_grads(backend, case, rng, disable_recompute=False, layout=None):
    """(inputs, gradients of every input, do, dht) of one backend's backward with random do, dht;
    ``layout``: raw gates set chunk by chunk (helpers.forced_gates)."""
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    if layout:
        forced_gates(x, case.chunk_size, layout)
    leaves = {n: x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)}
    with use_backend(backend):
        o, s = chunk_kda(**x, chunk_size=case.chunk_size, disable_recompute=disable_recompute)
    do = torch.randn(o.shape, generator=rng).to(o)
    ds = torch.randn(s.shape, generator=rng).to(s) if s is not None else None
    loss = (o.float() * do.float()).sum() + ((s * ds).sum() if s is not None else 0)
    got = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    return x, got, do, ds


def grads(backend, case, rng, disable_recompute=False, layout=None):
    """(backend gradients, float64 reference gradients)."""
    x, got, do, ds = backend_grads(backend, case, rng, disable_recompute, layout)
    leaves = {n: x[n] for n in got}
    o_r, s_r = reference(x)
    loss_r = (o_r * do.double()).sum() + ((s_r * ds.double()).sum() if ds is not None else 0)
    want = dict(zip(leaves, torch.autograd.grad(loss_r, list(leaves.values()), allow_unused=True)))
    return x, got, want


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("axis", list(BWD_AXES))
def test_backward_axis(backend, axis, rng):
    case = grow(BWD_AXES[axis], GPU)
    x, got, want = grads(backend, case, rng)
    check_grads(got, want, x, tol_for(case.dtype, backend))


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("sms", [2, 1024])
def test_u_in_scan_training(sms, rng, tune, launch_log):
    """The training forward's scan forms u itself where its programs (4 here) outnumber the SMs (2:
    as if crowded; Tuning.u_in_scan "crowded"), the backward's recomputation never (it keeps u for
    the backward's kernels); the gradients right either way."""
    tune(sm_count=sms)
    case = Case(T=40, H=2, HV=4, K=32, V=32, dtype=torch.bfloat16, gate="safe", l2norm=True, beta_sigmoid=True)
    x, got, want = grads("triton", case, rng)
    check_grads(got, want, x, tol_for(case.dtype, "triton"))
    assert scan_given_u(launch_log) == [sms != 2, True], launch_log  # the training forward, then the recomputation


RECOMPUTE_CASES = {  # float32 (block path), bfloat16 with a bounded or unbounded gate (whole-chunk path), varlen
    "f32": Case(T=90, gate="safe", l2norm=True, beta_sigmoid=True),
    "bf16_whole": Case(T=90, gate="safe", l2norm=True, beta_sigmoid=True, dtype=torch.bfloat16),
    "bf16_whole_softplus": Case(T=130, gate="softplus", l2norm=True, dtype=torch.bfloat16, A_log_range=(0.0, 2.0)),
    "bf16_whole_varlen": Case(seqlens=(1, 70, 0, 33), HV=4, gate="safe", dtype=torch.bfloat16),
    "softplus_varlen": Case(seqlens=(17, 0, 66), gate="softplus", l2norm=True),
}


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("name", list(RECOMPUTE_CASES))
def test_disable_recompute_same_gradients(backend, name, rng):
    case = grow(RECOMPUTE_CASES[name], GPU)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    _, g1, _, _ = backend_grads(backend, case, torch.Generator().manual_seed(seed))
    _, g2, _, _ = backend_grads(backend, case, torch.Generator().manual_seed(seed), disable_recompute=True)
    for name in g1:
        check(f"d{name}", g2[name], g1[name], 1e-6)


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("name", ["bf16_whole", "bf16_whole_softplus", "bf16_whole_varlen"])
def test_bf16_products(name, rng, launch_log):
    """Tuning.bf16_products on (the whole-chunk intra kernel's products from bfloat16 operands):
    the inference output within bfloat16's budget and within twice the error of tf32 products
    (measured 1.1x-1.6x on the CPU tier, whose conversion truncates; 1.2x on an H200, B1 T8192
    H64), every gradient of a training step that runs the kernel against the float64 reference;
    float16 inputs keep tf32 products (operands rounded to nearest), float32 inputs full-precision ones."""
    from fastkda.backends.triton.plan import Device, Tuning, chunk_plan, tuned

    case = grow(RECOMPUTE_CASES[name], GPU)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    x = make_inputs(case, device=DEVICE, generator=torch.Generator().manual_seed(seed))
    o_ref = reference(x)[0]
    errors = []
    for on in (False, True):
        with use_backend("triton"), torch.no_grad(), tuned(bf16_products=on):
            o = chunk_kda(**x, chunk_size=case.chunk_size)[0]
        check(f"o (BF16_PRODUCTS {on})", o, o_ref, tol_for(case.dtype, "triton"))
        errors.append(rel_rms(o, o_ref))
    assert errors[1] != errors[0], "BF16_PRODUCTS changed nothing"
    assert errors[1] <= 2 * errors[0], f"bfloat16 products: error {errors[1]:.3g} against {errors[0]:.3g} with tf32"
    opts, _ = plain_options(make_inputs(Case(T=20, gate="softplus")))  # the whole-chunk path in inference
    for dt, prec in ((torch.float16, "tf32_rn"), (torch.float32, "ieee")):
        s1 = chunk_plan(opts, dt, False, 4, Device(132, False), Tuning()).stage1
        assert s1.intra_prec == prec, (dt, s1.intra_prec)
    n = len(launched(launch_log, "kda_fwd_intra_chunk_kernel"))
    x, got, want = grads("triton", case, torch.Generator().manual_seed(seed))
    assert len(launched(launch_log, "kda_fwd_intra_chunk_kernel")) > n, "the training step did not take the whole-chunk path"
    check_grads(got, want, x, tol_for(case.dtype, "triton"))


X_CASES = {  # the whole-chunk path (bounded, unbounded gates, varlen), the block path (pre-activated gates), K = 64
    **{n: RECOMPUTE_CASES[n] for n in ("bf16_whole", "bf16_whole_softplus", "bf16_whole_varlen", "f32")},
    "bf16_block": Case(T=90, gate="pregated", l2norm=True, dtype=torch.bfloat16),
    "bf16_k64_v64": Case(T=90, K=64, V=64, gate="safe", beta_sigmoid=True, dtype=torch.bfloat16),
    "fp16": Case(T=90, gate="softplus", l2norm=True, dtype=torch.float16),
}


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("name", list(X_CASES))
def test_x_bf16(name, rng, launch_log):
    """Tuning.x_bf16: in inference, bfloat16 inputs get X in bfloat16 and bfloat16 w/u products
    (the whole-chunk and the block path; 64-column w/u programs from K = 64); the output within
    bfloat16's budget and within twice the error of float32 X; training keeps X in float32 for
    the backward (its gradients against the float64 reference) and, for bfloat16 inputs, a
    bfloat16 copy for the w/u kernel (Tuning.x_bf16_train), so that its forward output is inference's,
    bit for bit; float16 and float32 inputs keep float32 X."""
    from fastkda.backends.triton.plan import tuned

    case = grow(X_CASES[name], GPU)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    x = make_inputs(case, device=DEVICE, generator=torch.Generator().manual_seed(seed))
    o_ref = reference(x)[0]
    errors = []
    for on in (False, True):
        with use_backend("triton"), torch.no_grad(), tuned(x_bf16=on):
            o = chunk_kda(**x, chunk_size=case.chunk_size)[0]
        low = on and case.dtype == torch.bfloat16
        assert stage1_of(launch_log)["xs"].dtype == (torch.bfloat16 if low else torch.float32)
        check(f"o (X_BF16 {on})", o, o_ref, tol_for(case.dtype, "triton"))
        errors.append(rel_rms(o, o_ref))
    if case.dtype == torch.bfloat16:
        assert errors[1] != errors[0], "X_BF16 changed nothing"
        assert errors[1] <= 2 * errors[0], f"bfloat16 X: error {errors[1]:.3g} against {errors[0]:.3g} in float32"
    else:
        assert errors[1] == errors[0]
    xt = {**x, "q": x["q"].detach().clone().requires_grad_(True)}
    with use_backend("triton"):
        o_train = chunk_kda(**xt, chunk_size=case.chunk_size)[0].detach()
    p = stage1_of(launch_log)
    assert p["xs"].dtype == torch.float32, "training took a bfloat16 X"
    if case.dtype == torch.bfloat16:
        assert p["xh"] is not None and p["xh"].dtype == torch.bfloat16
        assert torch.equal(o_train, o), "the training forward differs from inference"
    else:
        assert p["xh"] is None
    x, got, want = grads("triton", case, torch.Generator().manual_seed(seed))
    check_grads(got, want, x, tol_for(case.dtype, "triton"))


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("bv", [32, 64])
@pytest.mark.parametrize("name", ["bf16_whole_varlen", "softplus_varlen"])
def test_scan_width_training(name, bv, rng, tune):
    """A training step at both forward-scan widths (Tuning.scan_bv, scan_bv_narrow; the backward's
    recomputed scan stores h and v' too): gradients against the float64 reference."""
    tune(scan_bv=bv, scan_bv_narrow=bv)
    case = grow(RECOMPUTE_CASES[name], GPU).replace(V=64)
    x, got, want = grads("triton", case, rng)
    check_grads(got, want, x, tol_for(case.dtype, "triton"))


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("name", ["bf16_whole_varlen", "softplus_varlen", "f32"])
def test_scan_crowded_width(name, rng, tune, launch_log):
    """The backward state scan at 128 value columns per program (Tuning.bwd_scan_bv_crowded: taken
    where 64-column programs would outnumber the SMs, here one SM per head) with one pipeline stage
    fewer (8 warps): every gradient of a training step against the float64 reference; the backward
    scan one program per head, the forward scans (the forward and the backward's recomputation) two
    of 64 columns."""
    case = grow(RECOMPUTE_CASES[name], GPU).replace(V=128)
    heads = (len(case.seqlens) if case.seqlens is not None else case.B) * (case.HV or case.H)
    tune(sm_count=heads)
    x, got, want = grads("triton", case, rng)
    fwd = launched(launch_log, "kda_fwd_scan_kernel", grids=True)
    bwd = launched(launch_log, "kda_bwd_scan_kernel", grids=True, options=("num_warps", "num_stages"))
    check_grads(got, want, x, tol_for(case.dtype, "triton"))
    bwd_kw = {"num_warps": 8, "num_stages": 2 if case.dtype != torch.float32 else 1}
    assert len(fwd) == 2 and len(bwd) == 1, (fwd, bwd)
    assert all(g == (2 * heads,) for g in fwd), fwd  # common.seq_grid: two 64-column blocks per head
    assert all(g == (heads,) and kw == bwd_kw for g, kw in bwd), bwd


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("name,disable_recompute", [*((n, False) for n in RECOMPUTE_CASES),
                                                     ("bf16_whole", True), ("softplus_varlen", True)])
def test_triton_recompute_launches(name, disable_recompute, rng, launch_log):
    """What one training step launches: stage 1's gates, intra and inverse once (the forward keeps
    them); its w/u kernel and the state scan once more in the backward by default, not with
    disable_recompute."""
    from fastkda.backends.triton.plan import Tuning

    stages = ("kda_fwd_gates_kernel", "kda_fwd_intra_kernel", "kda_fwd_intra_chunk_kernel", "kda_fwd_inverse_kernel",
              "kda_fwd_wu_kernel")
    case = grow(RECOMPUTE_CASES[name], GPU)
    backend_grads("triton", case, rng, disable_recompute=disable_recompute)
    launches = launched(launch_log, *stages, "kda_fwd_scan_kernel")
    again = 1 if disable_recompute else 2
    intra = 3 if name == "bf16_whole_softplus" else 1  # Tuning.split_unbounded: three passes for unbounded gates
    assert Tuning().split_unbounded, "the default splits the whole-chunk launches of unbounded gates"
    want = {"kda_fwd_gates_kernel": 1, "intra": intra, "kda_fwd_inverse_kernel": 1, "kda_fwd_wu_kernel": again,
            "kda_fwd_scan_kernel": again}
    got = {n: sum(1 for m in launches if m == n or (n == "intra" and "intra" in m)) for n in want}
    assert got == want, launches


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
def test_triton_kept_outputs_get_no_gradient(rng, monkeypatch):
    """The tensors the forward keeps for the backward leave the autograd Function as outputs: their
    backward receives None for them, not zero-filled tensors as large as what is kept."""
    from fastkda.backends.triton.function import ChunkKDAFunction

    seen = []
    backward = ChunkKDAFunction.backward

    def spy(ctx, do, dht, *rest):
        seen.append([g is None for g in rest])
        return backward(ctx, do, dht, *rest)

    monkeypatch.setattr(ChunkKDAFunction, "backward", staticmethod(spy))
    backend_grads("triton", grow(RECOMPUTE_CASES["softplus_varlen"], GPU), rng)
    assert len(seen) == 1 and seen[0] and all(seen[0]), seen


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("part", ["output", "final_state"])
def test_loss_of_one_output(backend, part, rng):
    """A loss of o alone or of the final state alone (the other output gets no gradient at all):
    the gradients match the reference's."""
    case = grow(Case(seqlens=(40, 0, 71), HV=2, gate="softplus", l2norm=True, beta_sigmoid=True), GPU)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    leaves = {n: x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)}
    with use_backend(backend):
        outs = chunk_kda(**x, chunk_size=case.chunk_size)
    i = 0 if part == "output" else 1
    w = torch.randn(outs[i].shape, generator=rng).to(outs[i])
    got = torch.autograd.grad((outs[i].float() * w.float()).sum(), list(leaves.values()), allow_unused=True)
    ref = reference(x)
    want = torch.autograd.grad((ref[i] * w.double()).sum(), list(leaves.values()), allow_unused=True)
    check_grads(dict(zip(leaves, got)), dict(zip(leaves, want)), x, tol_for(case.dtype, backend))


def test_gradcheck_float64():
    """Finite differences through the public API in float64 (PyTorch backend), every input."""
    case = Case(seqlens=(3, 0, 37), H=1, HV=2, K=4, V=3, dtype=torch.float64, gate="softplus", l2norm=True,
                beta_sigmoid=True, allow_neg_eigval=True, chunk_size=32, gate_spread=1.0)
    x = make_inputs(case, requires_grad=True)
    names = [n for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)]

    def f(*ts):
        kw = {**x, **dict(zip(names, ts))}
        with use_backend("torch"):
            o, s = chunk_kda(**kw, chunk_size=32)
        return o, s

    assert torch.autograd.gradcheck(f, [x[n] for n in names], eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_widest_heads(backend, dtype, rng):
    """K = 256 (the Triton limit) and V = 200 (not a power of two), forward and gradients; 16-bit
    inputs on the GPU tier: at K = 256 the state scans split V over several programs per head, and
    16-bit operands compile differently from float32 ones (plan.scan_bv keeps the forward-scan width
    that Triton 3.6 compiles correctly for them). The CPU tier's interpreter runs every dtype through
    the same code; there dbeta in float16 (a sum over K + V features whose terms cancel) exceeds its
    budget for some seeds."""
    if dtype != torch.float32 and not GPU:
        pytest.skip("16-bit inputs at K = 256: GPU tier")
    case = Case(T=40, H=1, HV=1, K=256, V=200, gate="safe", l2norm=True, beta_sigmoid=True, chunk_size=32, dtype=dtype)
    x, got, want = grads(backend, case.replace(T=1000, H=2, HV=4) if GPU else case, rng)
    check_grads(got, want, x, tol_for(case.dtype, backend))


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("axis,dtype,exact", [("extreme_safe", torch.bfloat16, None), ("extreme_lowerbound", torch.float16, None),
                                              ("safe_lb-5", torch.bfloat16, True), ("safe_lb-5", torch.float32, False)])
def test_triton_pair_sums(axis, dtype, exact, rng, tune):
    """The two ways the gate-gradient kernel sums a block's pair terms (Tuning.exact_pairs): the
    cheaper one (16-bit inputs by default; bfloat16 with a bounded gate: the whole-chunk kernel's)
    at extreme gates, the exact one for 16-bit inputs too, and the cheaper one for float32 inputs
    within the 16-bit budget."""
    tune(exact_pairs=exact)
    case = grow(BWD_AXES[axis].replace(dtype=dtype), GPU)
    x, got, want = grads("triton", case, rng)
    # float32 with the cheaper sum: up to 2e-4 of dg at extreme gates (Tuning.exact_pairs), float16's budget
    check_grads(got, want, x, tol_for(torch.float16 if dtype == torch.float32 else dtype, "triton"))


WHOLE_BWD_EXTRA = {  # feature widths that are not powers of two, the widest keys, a ragged varlen GVA batch
    "k48_v40": Case(T=90, K=48, V=40, gate="safe", dtype=torch.bfloat16),
    "k256": Case(T=40, K=256, V=32, H=1, HV=1, gate="safe", l2norm=True),
    "ragged_varlen_gva": Case(seqlens=(1, 70, 0, 47, 18), H=2, HV=6, gate="safe", l2norm=True, beta_sigmoid=True,
                              dtype=torch.bfloat16),
}


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("axis", [*BWD_AXES, *WHOLE_BWD_EXTRA])
def test_whole_chunk_backward(axis, rng, tune, launch_log):
    """Bounded gates on every axis: the backward after the whole-chunk stage 1, its gate kernel
    summing every pair of a chunk from row and column sums (docs/math.md section 5). bfloat16
    inputs take it by default and keep their budget; float16 and float32 inputs (the block path by
    default) are forced through it and held to their own (tf32x3 and ieee products)."""
    case = bounded(grow(BWD_AXES[axis], GPU) if axis in BWD_AXES else WHOLE_BWD_EXTRA[axis])
    if case.dtype != torch.bfloat16:
        tune(whole_backward=True)
    x, got, want = grads("triton", case, rng)
    # proves which gate kernel ran
    launches = launched(launch_log, "kda_bwd_gate_block_kernel", "kda_bwd_dg_kernel", "kda_bwd_gate_kernel")
    if any(t > 0 for t in (case.seqlens or (case.T,))):
        assert launches == ["kda_bwd_gate_block_kernel", "kda_bwd_dg_kernel"], launches
    check_grads(got, want, x, tol_for(case.dtype, "triton"))


WHOLE_ANY_BWD = {  # unbounded gates in training: (case, raw gates chunk by chunk: helpers.forced_gates; a first
    # chunk of huge gates would leave the initial state's gradient below float32's range, e^-100 and less)
    "softplus_mixed_bf16": (Case(T=192, gate="softplus", l2norm=True, beta_sigmoid=True, dtype=torch.bfloat16,
                                 A_log_range=(0.0, 2.0)), ("small", "huge", "front")),
    "softplus_chunk32_bf16_vfirst": (Case(T=96, gate="softplus", dtype=torch.bfloat16, chunk_size=32,
                                          A_log_range=(0.0, 2.0), state_v_first=True), ("small", "front", "huge")),
    "lowerbound_edge_bf16": (Case(T=192, gate="lowerbound", lower_bound=-8.0, dtype=torch.bfloat16,
                                  A_log_range=(0.0, 1.0)), ("edge", "small")),
    # the only case where dropping the rounding errors shows: bfloat16's budget hides them
    "softplus_front_f32_k48_v40": (Case(T=130, K=48, V=40, gate="softplus", A_log_range=(2.0, 4.0)), ("front", "small")),
    "softplus_varlen_gva_bf16": (Case(seqlens=(1, 70, 0, 47), H=2, HV=4, gate="softplus", dtype=torch.bfloat16), None),
}


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("split", [False, True], ids=["one_launch", "split"])
@pytest.mark.parametrize("axis", list(WHOLE_ANY_BWD))
def test_whole_chunk_backward_any_gate(axis, split, rng, tune, launch_log):
    """Unbounded gates in training take the whole-chunk path end to end (bfloat16 by default; float32
    forced, with its exact products): exact cumulative sums and, chunk by chunk, the middle anchor
    or the half-segment levels on the diagonal blocks in the forward and in the gate-gradient
    kernel. Every gradient against autograd through the float64 reference. ``split``:
    Tuning.split_unbounded (16-bit inputs: the plain chunks in launches of their own)."""
    tune(split_unbounded=split)
    base, layout = WHOLE_ANY_BWD[axis]
    case = grow(base, GPU)
    if case.dtype != torch.bfloat16:
        tune(whole_backward=True)
    x, got, want = grads("triton", case, rng, layout=layout)
    launches = launched(launch_log, "kda_bwd_gate_block_kernel", "kda_bwd_dg_kernel", "kda_bwd_gate_kernel")
    # the block kernel once per launch of the split's passes (the plan's), then one dg pass
    blocks = ["kda_bwd_gate_block_kernel"] * (3 if split and case.dtype != torch.float32 else 1)
    assert launches == [*blocks, "kda_bwd_dg_kernel"], launches
    if layout:  # both diagonal forms where the layout asks for them (1: middle anchor, 0: levels)
        forms = {FORMS[kind] for kind in layout}
        gok = stage1_of(launch_log)["gok"]
        assert forms <= {v & 1 for v in gok.flatten().tolist()}, (forms, gok)
    check_grads(got, want, x, tol_for(case.dtype, "triton"))
    if case.dtype == torch.float32:  # exact products and exponents: ~2e-7 (float32 differences of the sums: ~5e-6)
        for name in ("q", "k"):
            check(f"d{name}", got[name], want[name], 1e-6)


def _strong_decays(dtype, rng, edit=None):
    """Inputs of strong softplus decays (A_log drawn from U(2, 2.77); ``edit`` changes them in place)
    and the float64 reference against them: (inputs, o, final state, do, ds, reference gradients, the
    error scales of dA_log and ddt_bias: gate_param_scales)."""
    case = grow(Case(T=256, gate="softplus", dtype=dtype, l2norm=True, beta_sigmoid=True, A_log_range=(2.0, 2.77)), GPU)
    if GPU:  # the float64 reference's autograd keeps every token's states: one sequence of 1024 tokens
        case = case.replace(B=1, T=1024)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    if edit is not None:
        with torch.no_grad():
            edit(x)
    o_r, s_r = reference(x)
    do = torch.randn(o_r.shape, generator=rng).to(device=DEVICE)
    ds = torch.randn(s_r.shape, generator=rng).to(device=DEVICE)
    leaves = {n: x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)}
    loss = (o_r * do.double()).sum() + (s_r * ds.double()).sum()
    want = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    x = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    return x, o_r, s_r, do, ds, want, gate_param_scales(x, want["g"])


def _errors_under(plan, opts, inp, o_r, s_r, do, ds, want, scales):
    """(errors of o, the final state and every gradient against the reference, their units (_unit), the
    set of the gates kernel's gok words) of a training step under ``plan``: relative RMS; for dA_log and
    ddt_bias, sums over every token whose terms largely cancel, relative to the magnitude of their terms
    (``scales``, as check_grads)."""
    from fastkda.backends.triton.backward import gradients
    from fastkda.backends.triton.common import recorded_launches
    from fastkda.backends.triton.forward import forward_stages

    with torch.no_grad(), recorded_launches() as log:
        _, o, ht, _, _ = forward_stages(opts, plan, plan.forward, inp)
        stage1, _, _, h, vn = forward_stages(opts, plan, plan.recompute, inp)
        got = dict(zip(GRAD_INPUTS, gradients(opts, plan, inp, [stage1, h, vn], do.to(o.dtype), ds, True)))
    gok = [e.args["gok"] for e in log if e.name == "kda_fwd_gates_kernel"][-1]
    errors = {"o": rel_rms(o, o_r), "final_state": rel_rms(ht, s_r),
              **{f"d{n}": param_error(got[n], want[n], scales[n]) if n in scales else rel_rms(got[n], want[n])
                 for n in want}}
    units = {"o": _unit(o, o_r), "final_state": _unit(ht, s_r),
             **{f"d{n}": 2.0**-22 if n in scales else _unit(got[n], want[n]) for n in want}}
    return errors, units, set(gok.flatten().tolist())


def _unit(got, ref):
    """One unit in the last place of ``got``'s format at ``ref``'s largest element, relative to ``ref``'s
    norm: the least change of relative RMS error that a single element can make."""
    top = ref.abs().max().double()
    return (torch.finfo(got.dtype).eps * 2.0 ** torch.floor(torch.log2(top)) / ref.double().norm()).item()


def _assert_near(errors, ref, ratio, units):
    """Every error of ``errors`` within ``ratio`` times that of ``ref`` (another form's on the same
    inputs) or ``units`` above it (_errors_under: one unit of the tensor's format at its largest element;
    for A_log and dt_bias, whose errors are relative to their terms' magnitudes, 2^-22: a float32 sum's
    rounding, a few units of 2^-24 of the terms)."""
    for name, err in errors.items():
        bound = max(ratio * ref[name], ref[name] + units[name])
        assert err <= bound, (name, err, ref[name], units[name])


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("dtype,split", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False),
                                         (torch.float16, True), (torch.float32, False)],
                         ids=["bf16", "bf16_split", "fp16", "fp16_split", "f32"])  # float32 launches once
def test_whole_chunk_clamped_halves(dtype, split, rng, tune):
    """Strong softplus decays (A_log drawn from U(2, 2.77), raw gates of spread 2; fla's layer draws
    A_log = log U(1, 16)): the diagonal blocks past the middle anchor's span take, for 16-bit inputs, the
    16-token level and the middle anchors of their 8-token halves on gates clamped at -24 (base 2),
    in the forward's intra kernel and in the gate-gradient kernel alike (IntraPass.clamp). A factor
    the clamp changes is below 2^-24 either way: the output, the final state and the gradients of q,
    k, v, g, beta and the initial state are within 20% of the error of the exact levels (clamp 0, run
    on the same inputs) against the float64 reference (bfloat16 on the CPU tier, 16 seeds: 0.93x to
    1.07x) or within one unit of the tensor's format at its largest element of it (_unit: dg's and
    dbeta's norms are now and then mostly those of the last token's elements, through the final state's
    gradient, each a unit or two off in either form: bfloat16 dbeta 2.7e-3 higher clamped, one unit
    of 4.6e-3; float16 dg 1.43x, 2.9e-4 against 2.0e-4), those of A_log and dt_bias (relative to
    their terms' magnitudes, _errors_under) within 20% or 2^-22 of it (float16: 1e-7 to 5e-7, one
    seed's 3.5e-8 gave 1.69x: a float32 sum's rounding, a few units of 2^-24 of the terms). float32
    inputs keep the exact levels; with the clamp forced on them every error is within 3x the exact
    levels' (the anchors' exponents reach 96: about 1e-7 doubles; measured 0.8x to 2x), those of
    A_log and dt_bias (5e-9 to 1e-7) within 3x or 2^-22 of it, where a clamp of 2^-12 would show at
    1e-4."""
    import dataclasses

    from fastkda.backends.triton.common import contiguous_inputs
    from fastkda.backends.triton.function import plan_of
    from fastkda.backends.triton.plan import HALVES_CLAMP

    tune(split_unbounded=split, whole_backward=True)
    x, o_r, s_r, do, ds, want, scales = _strong_decays(dtype, rng)
    errors = {}
    opts, inp = plain_options(x, **{n: t for n, t in x.items() if n not in ("q", "k", "v", "g", "beta")})
    inp = contiguous_inputs(inp)
    plan = plan_of(opts, inp, train=True)
    planned = 0.0 if dtype == torch.float32 else HALVES_CLAMP  # float32: the exact levels (forced below)
    past = [ps.exact or ps.select == 2 for ps in plan.stage1.passes]  # passes of chunks past the middle anchor
    assert {ps.clamp for ps, p in zip(plan.stage1.passes, past) if p} == {planned}, plan.stage1.passes
    assert all(ps.clamp == 0.0 for ps, p in zip(plan.stage1.passes, past) if not p), plan.stage1.passes
    for form, clamp in (("clamped", HALVES_CLAMP), ("exact", 0.0)):
        passes = tuple(ps._replace(clamp=clamp if p else 0.0) for ps, p in zip(plan.stage1.passes, past))
        p = dataclasses.replace(plan, stage1=dataclasses.replace(plan.stage1, passes=passes))
        errors[form], units, gok = _errors_under(p, opts, inp, o_r, s_r, do, ds, want, scales)
        assert 0 in {v & 1 for v in gok}, gok  # chunks past the middle anchor's span
    # float32: the anchors' rounding doubles errors of ~1e-7; 16-bit: a few elements of the last token,
    # a unit off in either form
    f32 = dtype == torch.float32
    _assert_near(errors["clamped"], errors["exact"], 3.0 if f32 else 1.2, units)


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_plain_sums_past_middle_anchor(dtype, rng, tune):
    """Strong softplus decays (A_log drawn from U(2, 2.77), raw gates of unit spread and dt_bias 0, 3 higher
    in the last chunk, whose sums pass 2048): for bfloat16 inputs the chunks past the middle anchor's span
    whose sums stay within 2048 (base 2; plan.PLAIN_SUM_SPAN) take plain float32 sums in a pass of their
    own (gok == 0), the rest exact ones (bit 1); float16 inputs keep the span of 512. Against the float64
    reference, the output, the final state and every gradient are within 10% of their error with exact
    sums in every chunk past 512 (the same plan with lo_span 512, on the same inputs), those of A_log and
    dt_bias (relative to their terms' magnitudes) within 10% or 2^-22 of it (a float32 sum's rounding);
    the rounding errors are never read in the plain chunks (stored for the others alone: NaN there
    under poisoning)."""
    import dataclasses

    from fastkda.backends.triton.common import contiguous_inputs
    from fastkda.backends.triton.function import plan_of
    from fastkda.backends.triton.plan import PLAIN_SUM_SPAN

    def edit(x):  # dt_bias 0: every chunk within 2048 and past the middle anchor's span, but the last,
        x["dt_bias"].zero_()  # whose raw gates are 3 further up (sums past 2048)
        x["g"][:, -64:] += 3.0

    tune(whole_backward=True)
    x, o_r, s_r, do, ds, want, scales = _strong_decays(dtype, rng, edit)
    errors, kinds = {}, {}
    opts, inp = plain_options(x, **{n: t for n, t in x.items() if n not in ("q", "k", "v", "g", "beta")})
    inp = contiguous_inputs(inp)
    plan = plan_of(opts, inp, train=True)
    assert plan.stage1.lo_span == PLAIN_SUM_SPAN[dtype] and [ps.select for ps in plan.stage1.passes] == [1, 2, 3]
    for form, span in (("plan", plan.stage1.lo_span), ("exact", 512.0)):
        p = dataclasses.replace(plan, stage1=dataclasses.replace(plan.stage1, lo_span=span))
        errors[form], units, kinds[form] = _errors_under(p, opts, inp, o_r, s_r, do, ds, want, scales)
    # chunks past the middle anchor's span with exact sums either way; with plain ones too for bfloat16
    assert any(f & 2 for f in kinds["exact"]), kinds
    if dtype == torch.bfloat16:
        assert 0 in kinds["plan"] and any(f & 2 for f in kinds["plan"]), kinds
    else:
        assert kinds["plan"] == kinds["exact"], kinds
    _assert_near(errors["plan"], errors["exact"], 1.1, units)


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_whole_chunk_gradients_mirrored(chunk_size, rng):
    """The whole-chunk gate kernel reads dAqk and dAkk transposed from their upper triangles: at its
    launch, above the diagonal, each [C, C] matrix is exactly the transpose of its part below (every
    entry written: the buffers start as NaN), and dAkk's diagonal is zero."""
    from fastkda.backends.triton.common import recorded_launches

    seen = []

    def capture(e):  # s_dA, s_dL before the kernel runs
        if e.name == "kda_bwd_gate_block_kernel":
            seen.append((e.args["s_dA"].clone(), e.args["s_dL"].clone()))

    with recorded_launches(before=capture):
        grads("triton", grow(Case(T=90, gate="safe", dtype=torch.bfloat16, chunk_size=chunk_size), GPU), rng)
    (s_dA, s_dL), = seen
    for name, M in (("dAqk", s_dA), ("dAkk", s_dL)):
        assert M.shape[-2:] == (chunk_size, chunk_size)
        assert torch.equal(M.triu(1), M.tril(-1).transpose(-1, -2)), name
        assert M.tril(-1).abs().sum() > 0, name
    assert not s_dL.diagonal(dim1=-2, dim2=-1).any()


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("dtype,exact,whole", [(torch.bfloat16, None, True), (torch.bfloat16, True, False),
                                               (torch.float16, None, False), (torch.float32, None, False)])
def test_whole_chunk_backward_choice(dtype, exact, whole, rng, tune, launch_log):
    """Which gate kernel a bounded gate's backward takes by default: the whole-chunk one for
    bfloat16 only (Tuning.exact_pairs=True keeps the block path); the gradients hold either way."""
    tune(exact_pairs=exact)
    case = grow(Case(T=70, gate="safe", dtype=dtype, l2norm=True), GPU)
    x, got, want = grads("triton", case, rng)
    launches = launched(launch_log, "kda_bwd_gate_block_kernel", "kda_bwd_gate_kernel")
    assert launches == ["kda_bwd_gate_block_kernel" if whole else "kda_bwd_gate_kernel"], launches
    check_grads(got, want, x, tol_for(dtype, "triton"))


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
@pytest.mark.parametrize("case", [Case(T=70, gate="safe", dtype=torch.bfloat16, l2norm=True, beta_sigmoid=True),
                                  Case(seqlens=(5, 0, 66), HV=4, gate="softplus", l2norm=True),
                                  Case(T=70, gate="softplus", dtype=torch.bfloat16, A_log_range=(0.0, 2.0))],
                         ids=["bf16", "varlen", "bf16_softplus"])
def test_triton_vjp_matches_autograd(case, rng):
    """The compiled backward's entry (fastkda.library -> the backend's chunk_kda_vjp, no autograd)
    gives the autograd Function's gradients, initial and final state included."""
    from fastkda.library import chunk_kda_backward_op

    case = grow(case, GPU)
    x, got, do, ds = backend_grads("triton", case, rng)
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    with use_backend("triton"):
        res = chunk_kda_backward_op(
            do, ds if ds is not None else do.new_empty(0), x["q"], x["k"], x["v"], x["g"], x["beta"],
            x.get("scale") or case.K ** -0.5, x.get("initial_state"), x["output_final_state"], x.get("use_qk_l2norm_in_kernel", False), x.get("use_gate_in_kernel", False),
            x.get("use_beta_sigmoid_in_kernel", False), x.get("allow_neg_eigval", False), x.get("safe_gate", False),
            x.get("lower_bound"), x.get("state_v_first", False), x.get("cu_seqlens"), x.get("A_log"),
            x.get("dt_bias"), case.chunk_size)
    vjp = dict(zip(names, res))
    for name in got:
        check(f"d{name}", vjp[name], got[name], 1e-6)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_backward_deterministic(backend, rng):
    """Two runs of the same backward give bit-identical gradients (no atomics whose order varies)."""
    case = grow(Case(seqlens=(70, 1, 33), H=2, HV=4, gate="softplus", l2norm=True, beta_sigmoid=True), GPU)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    _, g1, _, _ = backend_grads(backend, case, torch.Generator().manual_seed(seed))
    _, g2, _, _ = backend_grads(backend, case, torch.Generator().manual_seed(seed))
    for name in g1:
        assert torch.equal(g1[name], g2[name]), f"d{name} differs between two runs"


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@settings(max_examples=4 if not GPU else 10, deadline=None, suppress_health_check=list(HealthCheck))
@given(dims=st.sampled_from([(16, 16), (32, 16), (16, 48)]), **OPTION_SPACE)
def test_backward_random_combinations(backend, gate, varlen, gva, beta_mode, l2, vfirst, chunk, state, dims, dtype,
                                     seed):
    """Random points of the whole option space, gradients of every input."""
    rng = torch.Generator().manual_seed(seed)
    case = random_case(rng, 90, gate, varlen, gva, beta_mode, l2, vfirst, chunk, state, dims, dtype)
    case = grow(case, GPU)
    x, got, want = grads(backend, case, rng)
    check_grads(got, want, x, tol_for(case.dtype, backend))


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_triton_backward_long_bf16(gate):
    """GPU tier: a long bf16 sequence at K=V=128 against the PyTorch backend in float64."""
    case = Case(T=4096, H=4, HV=8, K=128, V=128, dtype=torch.bfloat16, gate=gate, l2norm=True, beta_sigmoid=True)
    x = make_inputs(case, device=DEVICE, requires_grad=True)
    leaves = {n: x[n] for n in GRAD_INPUTS if isinstance(x.get(n), torch.Tensor)}
    with use_backend("triton"):
        o, s = chunk_kda(**x)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    got = torch.autograd.grad((o.float() * do.float()).sum() + (s * ds).sum(), list(leaves.values()))
    x64 = {n: (t.detach().double().requires_grad_() if n in leaves else t) for n, t in x.items()}
    with use_backend("torch"):
        o64, s64 = chunk_kda(**x64)
    want = torch.autograd.grad((o64 * do.double()).sum() + (s64 * ds.double()).sum(), [x64[n] for n in leaves])
    check_grads(dict(zip(leaves, got)), dict(zip(leaves, want)), x, tol_for(torch.bfloat16, "triton"))


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
def test_exclusive_cumsum_keeps_small_prefixes(rng):
    """tiles.exclusive_cumsum (the kd terms of the whole-chunk gate gradient): sum_{s < t} x_s with
    every term added once, so a small prefix before a large term survives, where an inclusive sum
    minus the term would return 0 in float32."""
    from triton_probes import exclusive_cumsum_kernel

    x = torch.randn(64, 16, generator=rng, dtype=torch.float64) * torch.logspace(-4, 4, 64, dtype=torch.float64)[:, None]
    x[:40, 3] = torch.rand(40, generator=rng, dtype=torch.float64) * 1e-3  # small terms, then a large one
    x[40, 3] = 1e8
    want = torch.cat([torch.zeros(1, 16, dtype=torch.float64), x.cumsum(0)[:-1]])
    x32 = x.float().to(DEVICE)
    y = torch.full_like(x32, float("nan"))
    exclusive_cumsum_kernel[(1,)](x32, y, N=64, M=16)
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    # every row against its float64 prefix, relative to the magnitude summed so far
    scale = torch.cat([torch.ones(1, 16, dtype=torch.float64), x.abs().cumsum(0)[:-1]])
    assert ((y - want).abs() / scale).max() < 1e-6
    # the small prefix before the large term survives; an inclusive sum minus the term loses it
    assert abs(y[40, 3] / want[40, 3] - 1) < 1e-6
    naive = x32.cpu().cumsum(0) - x32.cpu()
    assert naive[40, 3] == 0.0 and want[40, 3] > 1e-3


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_parameter_layouts(backend, rng):
    """A_log as [1, 1, HV, 1] (as checkpoints store it), dt_bias as [HV, K], both strided, and a
    strided cu_seqlens: the same output and gradients as flat contiguous ones, each gradient in its
    parameter's own shape."""
    case = grow(Case(seqlens=(9, 0, 40), HV=4, gate="softplus", l2norm=True, beta_sigmoid=True), GPU)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    HV, K = x["g"].shape[-2:]

    def run(x):
        leaves = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
        with use_backend(backend):
            o, _ = chunk_kda(**x, chunk_size=case.chunk_size)
        return o, torch.autograd.grad((o.float() * do).sum(), leaves)

    do = torch.randn(x["v"].shape, generator=rng).float().to(DEVICE)
    o1, g1 = run(x)
    A = torch.zeros(1, 1, HV, 2, device=DEVICE)
    A[..., 0] = x["A_log"].detach().view(1, 1, HV)
    A_log = A[..., :1].requires_grad_()  # [1, 1, HV, 1], strided
    b = torch.zeros(HV, 2 * K, device=DEVICE)
    b[:, ::2] = x["dt_bias"].detach().view(HV, K)
    dt_bias = b.requires_grad_()[:, ::2]  # [HV, K], strided
    cu = torch.zeros(2 * x["cu_seqlens"].numel(), dtype=x["cu_seqlens"].dtype, device=DEVICE)
    cu[::2] = x["cu_seqlens"]
    assert not (A_log.is_contiguous() or dt_bias.is_contiguous() or cu[::2].is_contiguous())
    o2, g2 = run({**x, "A_log": A_log, "dt_bias": dt_bias, "cu_seqlens": cu[::2]})
    assert g2[5].shape == (1, 1, HV, 1) and g2[6].shape == (HV, K)
    check("o", o2, o1, 1e-6)
    for name, a, b_ in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), g2, g1):
        check(name, a.reshape(b_.shape), b_, 1e-6)


@pytest.mark.skipif("triton" not in BACKWARD_BACKENDS, reason="no Triton")
def test_double_backward_raises(rng):
    """The Triton backward has no backward of its own: a second-order gradient through it raises
    (once-differentiable) instead of returning a wrong one."""
    x = make_inputs(Case(T=20, H=1, HV=1, K=16, V=16), device=DEVICE, requires_grad=True, generator=rng)
    with use_backend("triton"):
        o, s = chunk_kda(**x)
    (dq,) = torch.autograd.grad((o * o).sum() + s.sum(), x["q"], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def test_double_backward_torch_backend(rng):
    """The PyTorch backend differentiates twice: second-order gradients match the reference's."""
    x = make_inputs(Case(T=20, H=1, HV=1, K=16, V=16, dtype=torch.float64), requires_grad=True, generator=rng)

    def second_order(run):
        o, s = run()
        (dq,) = torch.autograd.grad((o * o).sum() + s.sum(), x["q"], create_graph=True)
        return torch.autograd.grad(dq.square().sum(), x["k"])[0]

    with use_backend("torch"):
        got = second_order(lambda: chunk_kda(**x))
    check("d2k", got, second_order(lambda: reference(x)), 1e-10)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_training_step_peak_memory(rng, monkeypatch):
    """The tensors a Triton training step allocates beyond its inputs peak at 20.15 units of one
    [B, T, HV, 128] bfloat16 tensor (K = V = 128, C = 64, bfloat16, safe gate): the backward's
    phase A frees the state gradients before allocating dqg and dw, and the states before dAqk,
    dAkk and dv; what only phase A reads is freed before the gate gradients, and dg is allocated
    after phase A. On the CPU every torch.empty/zeros is tracked to its release; on the GPU the
    allocator's peak is read, which sees every tensor of the step (the output's gradient and
    autograd's own among them): one unit more."""
    import weakref

    case = Case(T=256 if not GPU else 4096, H=4, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="safe",
                lower_bound=-5.0, l2norm=True, beta_sigmoid=True, initial_state=False, final_state=False)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    leaves = [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    unit = case.T * case.H * 128 * 2
    live, peak = [0], [0]
    if GPU:
        with use_backend("triton"):  # a first step: what a process allocates once is not the step's
            o, _ = chunk_kda(**x)
            torch.autograd.grad(o, leaves, torch.ones_like(o))
        del o
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        def tracked(fn):
            def alloc(*a, **k):
                t = fn(*a, **k)
                n = t.numel() * t.element_size()
                live[0] += n
                peak[0] = max(peak[0], live[0])
                weakref.finalize(t, lambda: live.__setitem__(0, live[0] - n))
                return t
            return alloc
        for name in ("empty", "zeros", "empty_like", "zeros_like"):
            monkeypatch.setattr(torch, name, tracked(getattr(torch, name)))
    with use_backend("triton"):
        o, _ = chunk_kda(**x)
        torch.autograd.grad(o, leaves, torch.ones_like(o))
    if GPU:
        peak[0] = torch.cuda.max_memory_allocated() - base
    assert peak[0] / unit <= (21.16 if GPU else 20.16), f"peak {peak[0] / unit:.2f} units of {unit} bytes"
