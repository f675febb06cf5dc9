"""chunk_kda forward on every backend, every axis of fastkda.testing.AXES, against the float64
per-token reference."""

import math

import pytest
import torch
from conftest import BACKENDS, DEVICE, GPU
from helpers import (AXES, OPTION_SPACE, bounded, check, forced_gates, grow, launched, plain_options, random_case,
                     scan_given_u, short_forms, stage1_of, tol_for)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastkda import chunk_kda, use_backend
from fastkda.testing import Case, make_inputs, reference, rel_rms


def run_forward(backend, case, rng, intermediate=False):
    x = make_inputs(case, device=DEVICE, generator=rng)
    with use_backend(backend):
        if intermediate:
            with torch.inference_mode():
                o, s, h = chunk_kda(**x, chunk_size=case.chunk_size, return_intermediate_states=True)
        else:
            o, s = chunk_kda(**x, chunk_size=case.chunk_size)
            h = None
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    if case.final_state:
        assert s.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32)
    else:
        assert s is None
    return x, o, s, h


def checked_forward(case, rng):
    """The Triton forward of ``case`` against the float64 reference: output and final state."""
    x, o, s, _ = run_forward("triton", case, rng)
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    if case.final_state:
        check("final_state", s, s_ref, tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", list(AXES))
def test_forward_axis(backend, axis, rng):
    case = grow(AXES[axis], GPU)
    x, o, s, _ = run_forward(backend, case, rng)
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, backend)
    check("o", o, o_ref, tol)
    if case.final_state:
        check("final_state", s, s_ref, tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", ["dense", "varlen", "chunk32_varlen_safe", "state_v_first", "gva"])
def test_intermediate_states(backend, axis, rng):
    case = grow(AXES[axis], GPU)
    x, o, s, h = run_forward(backend, case, rng, intermediate=True)
    o_ref, s_ref, h_ref = reference(x, chunked=True, chunk_size=case.chunk_size, return_intermediate_states=True)
    tol = tol_for(case.dtype, backend)
    check("o", o, o_ref, tol)
    check("h", h, h_ref, tol)
    assert h.dtype == x["q"].dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend, rng):
    case = grow(Case(T=90, HV=2, gate="softplus"), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    # the same values behind non-contiguous views
    for name in ("q", "k", "v", "g"):
        t = x[name]
        x[name] = torch.cat([t, t], -1)[..., : t.shape[-1]]
        assert not x[name].is_contiguous()
    x["beta"] = x["beta"].transpose(1, 2).contiguous().transpose(1, 2)
    with use_backend(backend):
        o, s = chunk_kda(**x)
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, backend))
    check("final_state", s, s_ref, tol_for(case.dtype, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast(backend, rng):
    case = grow(Case(T=70, gate="safe", l2norm=True), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    dt = torch.bfloat16
    with use_backend(backend), torch.autocast(DEVICE, dtype=dt):
        o, s = chunk_kda(**x)
    assert o.dtype == dt and s.dtype == torch.float32
    o_ref, s_ref = reference({**x, **{n: x[n].to(dt) for n in ("q", "k", "v")}})
    check("o", o, o_ref, tol_for(dt, backend))
    check("final_state", s, s_ref, tol_for(dt, backend))


def test_empty_batch_and_all_empty_sequences(rng):
    x = make_inputs(Case(seqlens=(0, 0)), generator=rng)
    o, s = chunk_kda(**x)
    assert o.shape == (1, 0, 2, 32)
    assert torch.equal(s, x["initial_state"])


def test_inference_mode_and_no_grad(rng):
    x = make_inputs(Case(T=40), device=DEVICE, generator=rng)
    with torch.no_grad():
        o1, _ = chunk_kda(**x)
    with torch.inference_mode():
        o2, _ = chunk_kda(**x)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12 if not GPU else 16, deadline=None, suppress_health_check=list(HealthCheck))
@given(dims=st.sampled_from([(16, 16), (32, 16), (16, 64), (64, 32)]), **OPTION_SPACE)
def test_forward_random_combinations(backend, gate, varlen, gva, beta_mode, l2, vfirst, chunk, state, dims, dtype,
                                    seed):
    """Random points of the whole option space, not only one axis at a time."""
    rng = torch.Generator().manual_seed(seed)
    case = random_case(rng, 130, gate, varlen, gva, beta_mode, l2, vfirst, chunk, state, dims, dtype)
    case = grow(case, GPU)
    x, o, s, _ = run_forward(backend, case, rng)
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, backend))
    check("final_state", s, s_ref, tol_for(case.dtype, backend))


WHOLE_EXTRA = {  # feature widths that are not powers of two, the widest keys; kept small on the GPU
    # tier too, where grow() makes every other axis's lengths multiples of 16
    "k48_v40": Case(T=90, K=48, V=40, gate="safe"),
    "k256": Case(T=70, K=256, V=32, H=1, HV=1, gate="safe", l2norm=True),
    "ragged_varlen_gva": Case(seqlens=(1, 90, 0, 47, 130), H=2, HV=6, gate="safe", l2norm=True, beta_sigmoid=True),
}


@pytest.mark.parametrize("axis", [*AXES, *WHOLE_EXTRA])
def test_whole_chunk_path(axis, rng, tune, launch_log):
    """Bounded gates: the Triton forward's whole-chunk path (docs/math.md section 3) on every
    axis, against the reference, and the block path (which the training forward takes for the
    backward to read, except for bfloat16; forced here) on the same inputs."""
    # the training forward below: the block path; the inference call's short path off (the GPU
    # tier's grown cases have the pairs that take it)
    tune(whole_backward=False, short_min_pairs=None)
    case = bounded(grow(AXES[axis], GPU) if axis in AXES else WHOLE_EXTRA[axis])
    x = make_inputs(case, device=DEVICE, generator=rng)
    with use_backend("triton"):
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
        assert len(launched(launch_log, "kda_fwd_intra_chunk_kernel")) == 1, "the whole-chunk path did not run"
        xb = {**x, "q": x["q"].detach().clone().requires_grad_(True)}
        o_b, s_b = chunk_kda(**xb, chunk_size=case.chunk_size, disable_recompute=True)
        assert len(launched(launch_log, "kda_fwd_intra_chunk_kernel")) == 1, "the block path launched the whole-chunk kernel"
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    check("o (whole-chunk path)", o, o_ref, tol)
    check("o (block path)", o_b.detach(), o_ref, tol)
    if case.final_state:
        check("final_state (whole-chunk path)", s, s_ref, tol)
        check("final_state (block path)", s_b.detach(), s_ref, tol)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("sms", [2, 1024])
def test_scan_stages_launch(sms, rng, tune, launch_log):
    """The forward scan launches with the plan's stages: one once its programs (4 here) outnumber
    the SMs (2: as if crowded), scan_stages otherwise; the output right either way."""
    from fastkda.backends.triton.plan import Tuning

    tune(sm_count=sms)
    case = Case(T=40, H=2, HV=4, K=32, V=32, dtype=torch.bfloat16, gate="safe", l2norm=True)
    x, o, s, _ = run_forward("triton", case, rng)
    o_ref, s_ref = reference(x, chunked=True, chunk_size=case.chunk_size)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    check("final_state", s, s_ref, tol)
    stages = Tuning().scan_stages_crowded if sms == 2 else Tuning().scan_stages
    got = launched(launch_log, "kda_fwd_scan_kernel", options=("num_stages",))
    assert got == [("kda_fwd_scan_kernel", {"num_stages": stages})], got


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_seq_grid_one_dimension():
    """The per-sequence kernels (state scans, decoding) launch on one grid dimension, blocks of value
    columns times (sequence, value head) pairs: a grid's second dimension may not exceed 65535
    programs, which 4096 sequences of 32 value heads would."""
    from fastkda.backends.triton.common import seq_grid

    assert seq_grid(128, 64, 4096 * 32) == (2 * 4096 * 32,)
    assert seq_grid(100, 32, 3) == (12,)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("bv", [16, 32, 64])
@pytest.mark.parametrize("axis", ["varlen", "k_ne_v", "state_v_first", "bf16"])
def test_scan_width(axis, bv, rng, tune, launch_log):
    """The Triton forward at every scan width (value columns per program: V / bv programs per head,
    V = 64 on the CPU tier, 64 or 128 on the GPU tier) gives the reference's output and final
    state, and with return_intermediate_states the states at chunk starts; the launch took that
    width."""
    tune(scan_bv=bv, scan_bv_narrow=bv)
    case = grow(AXES[axis], GPU)
    case = case.replace(V=64 if case.V == 32 else case.V)
    x, o, s, _ = run_forward("triton", case, rng)
    o_ref, s_ref, h_ref = reference(x, chunked=True, chunk_size=case.chunk_size, return_intermediate_states=True)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    if case.final_state:
        check("final_state", s, s_ref, tol)
    with use_backend("triton"), torch.inference_mode():
        o, _, h = chunk_kda(**x, chunk_size=case.chunk_size, return_intermediate_states=True)
    check("o (with h)", o, o_ref, tol)
    check("h", h, h_ref, tol)
    pairs = (len(case.seqlens) if case.seqlens is not None else case.B) * case.HV  # (sequence, value head) pairs
    grids = launched(launch_log, "kda_fwd_scan_kernel", grids=True)  # (V / bv x sequences x value heads,)
    assert grids and all(g == (-(-case.V // bv) * pairs,) for g in grids), grids  # common.seq_grid


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("u_in", [True, False])
@pytest.mark.parametrize("axis", ["varlen", "gva", "k_ne_v", "k64_v16", "beta_sigmoid", "neg_eigval", "softplus",
                                  "bf16", "fp16", "chunk32_varlen_safe", "t_chunk_plus_one"])
def test_u_in_scan(axis, u_in, rng, tune, launch_log):
    """The scan forming u = X (beta v) itself (Tuning.u_in_scan) and the w/u kernel writing it give
    the reference's output and final state; with the option on the w/u kernel launches for w's
    slices alone and hands the scan no u (except for float16 inputs, which always keep it)."""
    from fastkda.backends.triton.plan import Tuning, pow2

    tune(u_in_scan=u_in)
    case = grow(AXES[axis], GPU)
    checked_forward(case, rng)
    u_in = u_in and case.dtype != torch.float16  # float32 X, 16-bit inputs: the plan keeps u out of the scan
    assert scan_given_u(launch_log) == [not u_in], launch_log
    t = Tuning()
    bs = t.wu_slice_x16 if case.dtype == torch.bfloat16 and t.x_bf16 else t.wu_slice
    bs = min(bs, pow2(case.K), pow2(case.V))
    slices = -(-case.K // bs) + (0 if u_in else -(-case.V // bs))
    lengths = case.seqlens or [case.T] * case.B
    chunks = sum(-(-n // case.chunk_size) for n in lengths)
    n_heads = case.HV if t.heads_first else 1  # (HV * parts,) or (parts, HV): common.chunk_grid
    grids = launched(launch_log, "kda_fwd_wu_kernel", grids=True)
    assert [g[0] for g in grids] == [chunks * slices * n_heads], (grids, chunks, slices)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("axis", ["varlen", "gva", "k_ne_v", "chunk32_varlen_safe", "softplus", "pregated_safe", "bf16",
                                  "t_short"])
def test_stage1_launch_order(axis, heads_first, rng, tune, launch_log):
    """Stage 1 launched value heads first (Tuning.heads_first: one grid dimension, HV x parts) or
    chunks first (grid (parts, HV)) gives the reference's output and final state; every stage-1
    grid has the form asked."""
    tune(heads_first=heads_first)
    names = ("kda_fwd_gates_kernel", "kda_fwd_intra_chunk_kernel", "kda_fwd_intra_kernel", "kda_fwd_inverse_kernel",
             "kda_fwd_wu_kernel")
    case = grow(AXES[axis], GPU)
    checked_forward(case, rng)
    grids = launched(launch_log, *names, grids=True)
    assert len(grids) >= 4, grids
    if heads_first:
        assert all(len(g) == 1 and g[0] % case.HV == 0 for g in grids), (grids, case.HV)
    else:
        assert all(len(g) == 2 and g[1] == case.HV for g in grids), (grids, case.HV)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("x_bf16", [True, False])
def test_u_in_scan_needs_16bit_x(x_bf16, rng, tune, launch_log):
    """bfloat16 inputs have the scan form u only with X in bfloat16 (Tuning.x_bf16): with float32
    X the w/u kernel keeps u (the plan's form_u); the output right either way."""
    tune(u_in_scan=True, x_bf16=x_bf16)
    checked_forward(grow(AXES["bf16"], GPU), rng)
    assert scan_given_u(launch_log) == [not x_bf16], launch_log


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("sms", [2, 1024])
def test_u_in_scan_default_choice(sms, rng, tune, launch_log):
    """By default (Tuning.u_in_scan "crowded") the scan forms u itself where its programs (4 here)
    outnumber the SMs (2: as if crowded); the output right either way (training:
    test_backward.py::test_u_in_scan_training)."""
    from fastkda.backends.triton.plan import Tuning

    assert Tuning().u_in_scan == "crowded"
    tune(sm_count=sms)
    case = Case(T=40, H=2, HV=4, K=32, V=32, dtype=torch.bfloat16, gate="safe", l2norm=True)
    x, o, s, _ = run_forward("triton", case, rng)
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    check("final_state", s, s_ref, tol)
    assert scan_given_u(launch_log) == [sms != 2], launch_log


@pytest.mark.parametrize("axis", ["dense", "varlen", "gva", "k_ne_v", "state_v_first", "chunk32", "bf16", "no_states",
                                  "t_short", "chunk32_varlen_safe"])
def test_split_output(axis, rng, tune, launch_log):
    """The Triton scan handing o to the chunk-parallel output kernel (long sequences) gives the
    reference's output and final state."""
    tune(split_min_chunks=1, split_max_programs=1 << 30)
    case = grow(AXES[axis], GPU)
    x, o, s, _ = run_forward("triton", case, rng)
    assert launched(launch_log, "kda_fwd_output_kernel"), "the output kernel did not run"
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    if case.final_state:
        check("final_state", s, s_ref, tol)


ANY_GATE = {  # unbounded gates (inference): (case, raw gates chunk by chunk, cyclic; None: as drawn)
    "softplus_varlen_gva": (Case(seqlens=(70, 1, 0, 93), H=2, HV=4, gate="softplus", l2norm=True, beta_sigmoid=True),
                            None),
    "softplus_mixed": (Case(T=192, gate="softplus", A_log_range=(0.0, 2.0)), ("small", "huge", "front")),
    "softplus_front_chunk32_k48": (Case(T=96, K=48, V=40, gate="softplus", chunk_size=32, A_log_range=(2.0, 4.0),
                                        state_v_first=True), ("front", "small", "huge")),
    "lowerbound_mixed": (Case(T=192, gate="lowerbound", lower_bound=-8.0, A_log_range=(0.0, 1.0)),
                         ("edge", "small", "edge")),
    "softplus_bf16_k64_v16": (Case(T=192, K=64, V=16, gate="softplus", dtype=torch.bfloat16, l2norm=True,
                                   A_log_range=(0.0, 2.0), initial_state=False), ("small", "huge")),
    "softplus_partial_chunk": (Case(T=100, gate="softplus", A_log_range=(2.0, 4.0)), ("front",)),
}


SHORT_EXTRA = {  # beside AXES (pre-gated ones made bounded: the short path takes non-positive gates only)
    "k48_v40": WHOLE_EXTRA["k48_v40"],
    "k48_v40_vfirst": Case(T=90, K=48, V=40, gate="safe", state_v_first=True),
    "ragged_varlen_gva": WHOLE_EXTRA["ragged_varlen_gva"],
    "fp16_safe_gva": Case(seqlens=(17, 0, 40), H=2, HV=4, gate="safe", dtype=torch.float16, l2norm=True),
    "bf16_softplus_vfirst": Case(T=70, gate="softplus", dtype=torch.bfloat16, state_v_first=True, beta_sigmoid=True),
}


def short_case(axis: str) -> Case:
    case = grow(AXES[axis], GPU) if axis in AXES else SHORT_EXTRA[axis]
    return bounded(case) if case.gate == "pregated" else case


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("axis", [*AXES, *SHORT_EXTRA])
def test_short_path(axis, chunk, rng, tune, launch_log):
    """The short path (stage 1 in one kernel over 16-token blocks, as chunks or merged in pairs, the
    scan stepping ``chunk`` tokens), on every axis, against the reference; forced here (the plan takes
    it from 16 sequence x value-head pairs on). Its launches: the short kernel and the scan, nothing of
    the chunk-wide stage 1; u from the scan (X kept) except for float16 inputs."""
    tune(short_min_pairs=1, short_chunk=chunk)
    case = short_case(axis)
    x = make_inputs(case, device=DEVICE, generator=rng)
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
    names = [e.name for e in launch_log]
    assert names == ["kda_fwd_short_kernel", "kda_fwd_scan_kernel"] or (names == [] and x["q"].shape[1] == 0), names
    scan = launch_log[-1]
    assert scan.args["C"] == launch_log[0].args["C"] == chunk
    assert scan.args["A_FULL"]  # stage 1 wrote zeros above Aqk's diagonal: rows load unmasked
    assert (scan.args["u"] is None) == (case.dtype != torch.float16)
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    if case.final_state:
        check("final_state", s, s_ref, tol)


PARTS = {  # one sequence, cut along its tokens: (case, short_part_tokens)
    "safe": (Case(T=150, gate="safe", dtype=torch.bfloat16, l2norm=True, beta_sigmoid=True), 40),
    "softplus_vfirst": (Case(T=150, gate="softplus", dtype=torch.bfloat16, state_v_first=True), 40),
    "no_states": (Case(T=100, gate="safe", initial_state=False, final_state=False), 32),
    "varlen_one": (Case(seqlens=(97,), gate="lowerbound", dtype=torch.float16, l2norm=True), 16),
}


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("axis", list(PARTS))
def test_short_parts(axis, chunk, rng, tune, launch_log):
    """One sequence cut into parts along its tokens (each part's stage 1 beside the scan of the part
    before, on two streams on a GPU): o and the final state bit for bit those of one scan over the
    whole sequence, and within the reference's tolerance; the launches alternate stage 1 and scan,
    each part's scan from the state that the one before left, each part's stage 1 into its rows of
    tensors made once for the whole sequence."""
    case, part = PARTS[axis]
    if GPU:  # real shapes: parts of 4096 tokens, the last one shorter
        case, part = case.replace(T=3 * 4096 + 129, K=128, V=128, H=4, HV=4, seqlens=None), 4096
        if axis == "varlen_one":
            case = case.replace(seqlens=(case.T,))
    x = make_inputs(case, device=DEVICE, generator=rng)
    tune(short_min_pairs=1, short_chunk=chunk, short_part_tokens=None)
    with use_backend("triton"), torch.no_grad():
        o1, s1 = chunk_kda(**x, chunk_size=case.chunk_size)
    whole = len(launch_log)
    tune(short_part_tokens=part, short_parts=8, short_parts_fill=1 << 20)
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
    parts = launch_log[whole:]
    T = x["q"].shape[1]
    n = min(8, T // part)
    tokens = -(-(-(-T // n)) // chunk) * chunk
    assert [e.name for e in parts] == ["kda_fwd_short_kernel", "kda_fwd_scan_kernel"] * -(-T // tokens)
    for i, (s1_launch, scan) in enumerate(zip(parts[::2], parts[1::2])):
        assert s1_launch.args["T"] == scan.args["T"] == min(tokens, T - i * tokens)
        if i > 0:
            assert scan.args["h0"] is parts[2 * i - 1].args["ht"]
        # stage 1's outputs: one tensor for the whole sequence, each part writing its own tokens' rows
        w, w0 = s1_launch.args["w"], parts[0].args["w"]
        assert w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
        assert w.data_ptr() - w0.data_ptr() == i * tokens * w.stride(1) * w.element_size()
    assert torch.equal(o, o1)
    assert (s is None) is (s1 is None) is (not case.final_state)
    if s is not None:
        assert torch.equal(s, s1)
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    check("o", o, o_ref, tol)
    if case.final_state:
        check("final_state", s, s_ref, tol)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("lens,short", [((26, 26, 26, 25), True), ((100, 1, 1, 1), False), ((30, 0, 30, 30, 13), True)])
def test_short_path_counts_the_longest_sequence(lens, short, rng, tune, launch_log):
    """The plan counts a varlen call's pairs as its scan sees them: value heads times the tokens over
    the longest sequence's (forward.scan_pairs). With the threshold at 6 and two value heads, four
    equal sequences make 7 pairs (short path), one long and three single tokens 2 (chunk-wide), an
    empty one counts nothing."""
    tune(short_min_pairs=6)
    case = Case(seqlens=lens, H=1, HV=2, gate="safe")
    x = make_inputs(case, device=DEVICE, generator=rng)
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x)
    assert bool(launched(launch_log, "kda_fwd_short_kernel")) is short
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, "triton"))


SHORT_ANY_GATE = {  # (case, raw gates forced 16-token chunk by chunk, grown on the GPU tier): "small",
    # and at a bound of -12 nats (-17.3 in base 2) "near" (an exponent of 86.6, just within 2^96), take
    # the middle anchor; at that bound "edge" (121 from the middle token: gate 0 enters no factor) and
    # "huge", and "huge" and "front" of softplus gates the halves, on clamped gates; "pivots" (tokens 0
    # and 8 huge) the halves where gate 8 passes 96 in base 2 (A_log above about 0.6), else the middle
    # anchor; the safe gate's chunks always the middle anchor
    "softplus_mixed": (Case(T=112, gate="softplus", A_log_range=(0.0, 2.0)), ("small", "huge", "front", "pivots"),
                       True),
    "lowerbound_edge_near": (Case(T=96, gate="lowerbound", lower_bound=-12.0, A_log_range=(0.0, 1.0)),
                             ("edge", "near", "small", "huge"), True),
    "softplus_bf16_forms": (Case(T=64, gate="softplus", dtype=torch.bfloat16, l2norm=True, A_log_range=(0.0, 2.0)),
                            ("pivots", "small", "huge", "front"), True),
    "softplus_bf16_varlen_gva": (Case(seqlens=(40, 1, 0, 70), H=2, HV=4, gate="softplus", dtype=torch.bfloat16,
                                      l2norm=True, A_log_range=(0.0, 2.0)), ("huge", "small", "front", "pivots"), True),
    "softplus_fp16_k48": (Case(T=64, K=48, V=40, gate="softplus", dtype=torch.float16, A_log_range=(2.0, 4.0)),
                          ("front", "small"), True),
    # the safe gate at its bound of -5 nats ("huge": a whole chunk, "edge": its first half): e^G down to
    # 2^-115, built from the middle anchor's factors near 2^58
    "safe_at_bound": (Case(T=88, gate="safe", A_log_range=(0.0, 1.0)), ("huge", "edge", "small"), True),
    # kept small on the GPU tier too: a partial last chunk and K = 48 on the halves
    "softplus_partial_k48": (Case(T=70, K=48, V=40, gate="softplus", A_log_range=(2.0, 4.0), state_v_first=True),
                             ("huge", "front"), False),
}


SHORT_FORMS = {"softplus_mixed": {"anchor", "halves"}, "lowerbound_edge_near": {"anchor", "halves"},
               "softplus_bf16_varlen_gva": {"anchor", "halves"}, "softplus_fp16_k48": {"anchor", "halves"},
               "safe_at_bound": {"anchor"}, "softplus_partial_k48": {"halves"},
               "softplus_bf16_forms": {"anchor", "halves"}}


@pytest.mark.parametrize("axis", [a for a, (case, _, _) in SHORT_ANY_GATE.items() if case.gate != "safe"])
def test_short_path_layouts_take_their_forms(axis, rng):
    """The layouts of test_short_path_any_gate reach the short kernel's forms they mean to, on both
    tiers (helpers.short_forms), whatever the random gates of the other chunks add (a varlen case's
    later sequences miss the layout's chunk grid); bfloat16 and float32 inputs each reach both (the
    kernel takes them for float16 and float32 inputs; bfloat16 ones take the middle anchor on
    clamped gates in every chunk, test_short_path_clamped_anchor). (The safe gate has one form.)"""
    base, layout, grown = SHORT_ANY_GATE[axis]
    x = make_inputs(grow(base, GPU) if grown else base, device=DEVICE, generator=rng)
    forced_gates(x, 16, layout)
    assert SHORT_FORMS[axis] <= short_forms(x)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("heads_first,chunk", [(True, 16), (False, 16), (True, 32)])
@pytest.mark.parametrize("axis", list(SHORT_ANY_GATE))
def test_short_path_any_gate(axis, heads_first, chunk, rng, tune, launch_log):
    """Gates forced chunk by chunk on the short path. Unbounded gates: each 16-token chunk takes the
    middle anchor or, where its factors would pass 2^96, its halves' anchors on gates clamped at
    -24 (base 2) (float16 and float32 inputs; bfloat16 ones the middle anchor on gates clamped at
    -12); float32 inputs at float32's precision (1e-6). Safe gates at
    their bound (the middle anchor's extremes) within 4e-6: e^G and e^(G_15 - G) are products of two
    exponentials, each the GPU's ex2.approx (2 ulp) there (1.7e-6 measured on the H200; 1.2e-7 in the
    interpreter). ``heads_first``: the order of the programs (Tuning.heads_first); ``chunk``: the
    short path's chunks (16-token blocks merged in pairs at 32)."""
    tune(short_min_pairs=1, heads_first=heads_first, short_chunk=chunk)
    base, layout, grown = SHORT_ANY_GATE[axis]
    case = grow(base, GPU) if grown else base
    x = make_inputs(case, device=DEVICE, generator=rng)
    forced_gates(x, 16, layout)
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
    short = [e.args["HEADS_FIRST"] for e in launch_log if e.name == "kda_fwd_short_kernel"]
    assert short == [heads_first], short
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    exact = (4e-6 if case.gate == "safe" else 1e-6) if case.dtype == torch.float32 else tol
    check("o", o, o_ref, exact)
    if case.final_state:
        check("final_state", s, s_ref, exact)


def short_stage1_of(opts, plan, inp):
    """The short path's stage 1 of a call (plan.short) on its chunk tables."""
    from fastkda.backends.triton import forward, short

    tables = forward.chunk_tables_of(opts, inp.cu_seqlens, inp.cu_seqlens_cpu, plan.short.chunk)
    return short.short_stage1(opts, plan, inp, tables)


def scan_of(opts, plan, sc, s1, xs, inp):
    """The forward scan ``sc`` (a ScanPlan) on a stage 1's tensors ``s1``, X in ``xs``."""
    from fastkda.backends.triton import scan

    return scan.fwd_scan(opts, plan, sc, s1.w, s1.u, xs, s1.qg, s1.kd, s1.Aqk, s1.gl, s1.chunk_indices,
                         s1.chunk_offsets, s1.NT_total, inp)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("axis", ["softplus_bf16_forms", "softplus_bf16_varlen_gva"])
def test_short_path_clamped_anchor(axis, chunk, rng, tune):
    """bfloat16 inputs of unbounded gates: the short kernel takes the middle anchor on gates clamped
    at -12 (base 2) in every 16-token block (ShortPlan.anchor_clamp); on the layouts of
    test_short_path_any_gate its output is within 5% of the exact forms' error against the float64
    reference (the middle anchor or the halves on gates clamped at -24, run on the same inputs: the
    same stage 1 but for the plan's clamp): over 40 seeds within 1.4% but for one (2.9%), where a
    clamp at -6 is 11% to 36% further off. The clamp leaves the decays alone: the final state
    differs from the exact forms' only by the order of float32 sums (up to 5% of its error either
    way) and is held to the bfloat16 tolerance.
    ``chunk``: the short path's chunks (16-token blocks merged in pairs at 32)."""
    import dataclasses

    from fastkda.backends.triton.function import plan_of

    tune(short_min_pairs=1, short_chunk=chunk)
    base, layout, grown = SHORT_ANY_GATE[axis]
    x = make_inputs(grow(base, GPU) if grown else base, device=DEVICE, generator=rng)
    forced_gates(x, 16, layout)
    o_ref, s_ref = reference(x)
    errors = {}
    with torch.inference_mode():
        opts, inp = plain_options(x, **{n: t for n, t in x.items() if n not in ("q", "k", "v", "g", "beta")})
        plan = plan_of(opts, inp, train=False)
        assert plan.short is not None and plan.short.anchor_clamp == 12.0, plan.short
        for form, clamp in (("clamped", plan.short.anchor_clamp), ("exact", None)):
            p = dataclasses.replace(plan, short=dataclasses.replace(plan.short, anchor_clamp=clamp))
            s1 = short_stage1_of(opts, p, inp)
            o, ht, _, _ = scan_of(opts, p, p.forward, s1, s1.xs, inp)
            errors[form] = (rel_rms(o, o_ref), rel_rms(ht, s_ref))
    assert errors["clamped"][0] <= 1.05 * errors["exact"][0], errors
    assert errors["clamped"][1] <= tol_for(torch.bfloat16, "triton"), errors


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_path_infinite_gates(dtype, rng, tune, launch_log):
    """Softplus gates of -inf (raw input +inf) on the short path, in chunks of each form: token 0
    (the middle anchor), tokens 0 and 8, tokens 0 and 5 (the halves), the rest near 0.
    Every factor spanning such a gate is 0, as for a gate far below float32's range: the outputs
    equal those of raw inputs of 1e4 (gates below -2^14 in base 2) and the reference's on them."""
    tune(short_min_pairs=1)
    case = Case(T=64, gate="softplus", dtype=dtype, A_log_range=(1.0, 2.0))
    x = make_inputs(case, device=DEVICE, generator=rng)
    with torch.no_grad():
        x["g"].copy_(-30.0 - x["g"].abs())
    huge = {n: t.clone() if n == "g" else t for n, t in x.items()}
    for c, tokens in enumerate(((0,), (0, 8), (0, 5), ())):
        for t in tokens:
            x["g"][:, 16 * c + t] = float("inf")
            huge["g"][:, 16 * c + t] = 1e4
    assert short_forms(huge) == {"anchor", "halves"}
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
        o_h, s_h = chunk_kda(**huge, chunk_size=case.chunk_size)
    assert [e.name for e in launch_log].count("kda_fwd_short_kernel") == 2, [e.name for e in launch_log]
    assert torch.equal(o, o_h) and torch.equal(s, s_h)
    o_ref, s_ref = reference(huge)
    tol = 1e-6 if dtype == torch.float32 else tol_for(dtype, "triton")
    check("o", o, o_ref, tol)
    check("final_state", s, s_ref, tol)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_short_path_not_where_it_does_not_apply(rng, tune, launch_log):
    """Forced on, the short path still leaves alone: training, intermediate states (chunk-sized),
    pre-gated unbounded gates, keys wider than 128, values wider than 128 in float16 (stage 1
    forms u there, in one tile)."""
    tune(short_min_pairs=1)
    cases = {"train": Case(T=40, gate="safe"), "intermediate": Case(T=40, gate="safe"), "pregated": Case(T=40),
             "k256": WHOLE_EXTRA["k256"], "v256_fp16": Case(T=40, K=64, V=256, gate="safe", dtype=torch.float16)}
    for name, case in cases.items():
        x = make_inputs(case, device=DEVICE, generator=rng, requires_grad=name == "train")
        with use_backend("triton"):
            if name == "intermediate":
                with torch.inference_mode():
                    chunk_kda(**x, return_intermediate_states=True)
            else:
                chunk_kda(**x)
        assert not launched(launch_log, "kda_fwd_short_kernel"), name
        assert launched(launch_log, "kda_fwd_gates_kernel"), name
        launch_log.clear()


SEGMENTED = {  # inference calls of few (sequence, value head) pairs, their sequences cut into segments
    "dense": Case(T=200, gate="safe", H=1, HV=2),
    "batch2_bf16_softplus": Case(B=2, T=130, gate="softplus", H=1, HV=2, dtype=torch.bfloat16, l2norm=True,
                                 beta_sigmoid=True),
    "varlen_vfirst": Case(seqlens=(150, 0, 70, 33), gate="softplus", H=1, HV=2, state_v_first=True),
    "lowerbound_no_state": Case(T=320, gate="lowerbound", lower_bound=-3.0, H=1, HV=1, initial_state=False,
                                final_state=False),
    "v200": Case(T=256, K=32, V=200, gate="safe", H=1, HV=1),  # V + K past 128: the short path all the same
    "uneven": Case(T=201, gate="safe", H=1, HV=2),  # 4 segments of 51, 51, 51, 48 tokens: 7 pairs, not 8
    "k48_negeig_scale": Case(T=200, K=48, V=40, H=1, HV=2, gate="softplus", beta_sigmoid=True, allow_neg_eigval=True,
                             scale=0.37),
    "varlen_short_seqs": Case(seqlens=(150, 3, 0, 70), gate="safe", H=1, HV=4),  # 3 tokens in 2 segments
}


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("axis", list(SEGMENTED))
def test_segmented_forward(axis, rng, tune, launch_log):
    """Few pairs, long sequences (Tuning.segment_min_tokens): each sequence cut into segments run as
    sequences of their own with K more value columns (the state maps from the identity), outputs
    corrected and final states composed after: one short-path call (whatever its pairs come to with
    uneven segments) and the output kernel, against the reference at the forward's tolerance, the
    initial state entering each sequence's first segment only."""
    tune(segment_min_tokens=32, short_min_pairs=8)
    case = SEGMENTED[axis]
    x = make_inputs(case, device=DEVICE, generator=rng)
    with torch.no_grad():  # raw gate inputs pulled down: weak decays, each segment's state reaches the next
        x["g"] -= 6.0
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
    short = [e for e in launch_log if e.name == "kda_fwd_short_kernel"]
    assert len(short) == 1 and not launched(launch_log, "kda_fwd_gates_kernel")
    assert short[0].args["V"] == case.V + case.K and short[0].args["T"] == case.B * case.T
    o_ref, s_ref = reference(x)
    check("o", o, o_ref, tol_for(case.dtype, "triton"))
    if case.final_state:
        check("final_state", s, s_ref, tol_for(case.dtype, "triton"))
    else:
        assert s is None


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_segmented_forward_not_where_it_does_not_apply(rng, tune, launch_log):
    """Segments only for inference calls that would take the short path but for their pairs, with
    sequences long enough: not in training, not with use_graph's fixed boundaries, not for float16
    inputs (u formed in stage 1 over V + K columns), not for short sequences or many pairs."""
    tune(segment_min_tokens=32, short_min_pairs=8)
    base = Case(T=200, gate="safe", H=1, HV=2)
    cases = {"train": (base, {}), "fp16": (Case(T=200, gate="safe", H=1, HV=2, dtype=torch.float16), {}),
             "short": (Case(T=100, gate="safe", H=1, HV=2), {}), "pairs": (Case(T=200, gate="safe", H=4, HV=8), {}),
             "graph": (Case(seqlens=(150, 50), gate="safe", H=1, HV=2), {"use_graph": True})}
    for name, (case, extra) in cases.items():
        x = make_inputs(case, device=DEVICE, generator=rng, requires_grad=name == "train")
        with use_backend("triton"):
            o, _ = chunk_kda(**x, **extra)
        v = [e.args["V"] for e in launch_log if "V" in e.args and e.name.startswith("kda_fwd")]
        assert v and all(n == case.V for n in v), (name, v)
        launch_log.clear()


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("split", [False, True], ids=["one_launch", "split"])
@pytest.mark.parametrize("axis", list(ANY_GATE))
def test_whole_chunk_any_gate(axis, split, rng, tune, launch_log):
    """Unbounded gates in inference take the whole-chunk path too: cumulative sums kept exactly
    (float32 plus their rounding errors) and, chunk by chunk, the middle anchor or the half-segment
    levels on the diagonal blocks (docs/math.md section 3). Against the reference (float32 inputs:
    at float32's precision, which differences of plain float32 sums miss at these gates), and the
    block path (Tuning.whole_unbounded off) on the same inputs. ``split``: Tuning.split_unbounded
    (16-bit inputs: the plain chunks in a launch of their own)."""
    from fastkda.backends.triton.plan import tuned

    tune(split_unbounded=split, short_min_pairs=None)  # the chunk-wide path, whatever the shape
    base, layout = ANY_GATE[axis]
    case = grow(base, GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    forms = forced_gates(x, case.chunk_size, layout) if layout else set()
    with use_backend("triton"), torch.no_grad():
        o, s = chunk_kda(**x, chunk_size=case.chunk_size)
        p = stage1_of(launch_log)
        assert p["ga"] is None and p["gd"] is not None, "the whole-chunk path for unbounded gates did not run"
        intra = launched(launch_log, "kda_fwd_intra_chunk_kernel")
        assert len(intra) == (3 if split and case.dtype != torch.float32 else 1), intra
        seen = {v & 1 for v in p["gok"].flatten().tolist()}
        assert forms <= seen, f"diagonal forms {seen}, expected {forms} among them (1: middle anchor, 0: levels)"
        with tuned(whole_unbounded=False):
            o_b, s_b = chunk_kda(**x, chunk_size=case.chunk_size)
        assert stage1_of(launch_log)["ga"] is not None, "the block path did not run"
    o_ref, s_ref = reference(x)
    tol = tol_for(case.dtype, "triton")
    exact = 1e-6 if case.dtype == torch.float32 else tol  # float32 products, exact exponents: ~1e-7
    check("o (whole-chunk path)", o, o_ref, exact)
    check("o (block path)", o_b, o_ref, tol)
    if case.final_state:
        check("final_state (whole-chunk path)", s, s_ref, exact)
        check("final_state (block path)", s_b, s_ref, tol)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_gates_slice_width(gate, rng, launch_log):
    """The gates kernel's slice width (Tuning.gates_slice_whole on the whole-chunk path) only groups its
    feature columns, each summed on its own: 16 and 32 columns both match the reference and each
    other bit for bit on the CPU tier, within 5e-6 on the GPU tier (the whole-chunk path, float32;
    K = 64 on the CPU tier, 128 on the GPU tier)."""
    from fastkda.backends.triton.plan import tuned

    case = Case(T=100, K=64, V=32, gate=gate, l2norm=True, dtype=torch.float32, A_log_range=(0.0, 2.0))
    x = make_inputs(grow(case, GPU), device=DEVICE, generator=rng)
    o_ref, s_ref = reference(x)
    outs = []
    for width in (32, 16):
        with use_backend("triton"), torch.no_grad(), tuned(whole_unbounded=True, gates_slice_whole=width):
            o, s = chunk_kda(**x)
        p = stage1_of(launch_log)
        assert p["ga"] is None and (p["gd"] is not None) == (gate == "softplus"), "not the whole-chunk path"
        check(f"o ({width} columns)", o, o_ref, tol_for(torch.float32, "triton"))
        check(f"final_state ({width} columns)", s, s_ref, tol_for(torch.float32, "triton"))
        outs.append((o, s))
    if not GPU:  # the interpreter's cumulative sums run down each column in order, whatever the width
        assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1]), "16 and 32 columns differ"
        return
    # on the GPU the order of tl.cumsum's additions follows the tile's layout, which the width sets
    check("o (16 against 32 columns)", outs[1][0], outs[0][0], 5e-6)
    check("final_state (16 against 32 columns)", outs[1][1], outs[0][1], 5e-6)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("fast", [0, 1, 2])
def test_softplus_forms(fast, rng):
    """common.softplus's forms against float64 on [-40, 40] and random inputs: the exact one (0) and
    the gates kernel's for 16-bit inputs (1: tl.log2; 2: the hardware's lg2.approx, GPU only) off by
    at most 3e-7 + 1e-7 |softplus| (absolute: the gates are summed; measured on an H200 4.6e-7 at
    softplus 30, every form). Dropping the rounding correction or a wrong constant fails it."""
    from triton_probes import softplus_kernel

    if fast == 2 and not GPU:
        pytest.skip("inline assembly: GPU only")
    x = torch.cat([torch.linspace(-40.0, 40.0, 1024, dtype=torch.float64),
                   torch.randn(1024, generator=rng, dtype=torch.float64) * 3]).float().to(DEVICE)
    y = torch.full_like(x, float("nan"))
    softplus_kernel[(1,)](x, y, N=x.numel(), FAST=fast)
    want = torch.nn.functional.softplus(x.double())
    err = (y.double() - want).abs()
    assert bool((err <= 3e-7 + 1e-7 * want).all()), (fast, err.max().item())


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("fast", [0, 2])
def test_sigmoid_forms(fast, rng):
    """common.sigmoid's forms against float64 on [-100, 100] and random inputs: tl.sigmoid (0) and
    the hardware's ex2.approx and rcp.approx (2, GPU only), off by at most 4e-7 relative plus 1e-9
    (ex2.approx's 2 ulp and rcp.approx's 1 ulp, with margin; far out, the float32 rounding of the
    exponent's argument makes the relative error of values below 1e-9 grow, as for any float32
    sigmoid); exactly 0, 1 and 0.5 at -1e4, 1e4 and 0, NaN kept. A wrong constant fails it."""
    from triton_probes import sigmoid_kernel

    if fast == 2 and not GPU:
        pytest.skip("inline assembly: GPU only")
    x = torch.cat([torch.linspace(-100.0, 100.0, 1024, dtype=torch.float64),
                   torch.randn(1020, generator=rng, dtype=torch.float64) * 4,
                   torch.tensor([-1e4, 1e4, 0.0, float("nan")], dtype=torch.float64)]).float().to(DEVICE)
    y = torch.full_like(x, float("nan"))
    sigmoid_kernel[(1,)](x, y, N=x.numel(), FAST=fast)
    want = torch.sigmoid(x.double())
    assert bool(torch.isnan(y[-1])), "NaN in, NaN out"
    y, want = y[:-1].double(), want[:-1]
    err = (y - want).abs() - 4e-7 * want
    assert bool((err <= 1e-9).all()), (fast, err.max().item())
    assert y[-3].item() == 0.0 and y[-2].item() == 1.0 and y[-1].item() == 0.5, y[-3:].tolist()


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 to the nearest tf32, ties away from zero, by the integer bits (int64: no overflow);
    infinities and NaNs as they are."""
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (((b + 0x1000) >> 13) << 13) & 0xFFFFFFFF
    r = torch.where((b & 0x7F800000) == 0x7F800000, b, r)
    return torch.where(r >= 2**31, r - 2**32, r).to(torch.int32).view(torch.float32)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_round_tf32(rng):
    """tiles.round_tf32 bit for bit against the integer form, and within half a tf32 unit (2^-11
    relative) of its input, on values of every size and sign, zeros, halfway cases, the largest
    float32 (rounds to infinity), infinities and NaNs (kept, bit for bit: a carry into the exponent
    or the sign would make them numbers)."""
    from triton_probes import round_tf32_kernel

    x = torch.randn(4096, generator=rng) * torch.exp2(torch.randint(-60, 60, (4096,), generator=rng).float())
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])
    x[4:8] = torch.tensor([1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, 2**-126])  # ties, and the smallest normal
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000, 0x7FF00000], dtype=torch.int32).view(torch.float32)
    x[8:13] = nans
    x[13] = torch.finfo(torch.float32).max
    x = x.to(DEVICE)
    y = torch.full_like(x, float("nan"))
    round_tf32_kernel[(1,)](x, y, N=x.numel())
    want = _round_tf32(x.cpu()).to(DEVICE)
    assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (x[y != want][:4], y[y != want][:4])
    assert float(y[4]) == 1 + 2**-10 and float(y[5]) == -(1 + 2**-10) and float(y[6]) == 1 + 2**-9
    assert bool(y[8:13].isnan().all()) and float(y[13]) == float("inf")
    finite = torch.isfinite(x) & (x != 0) & (x != torch.finfo(torch.float32).max)
    assert bool(((y - x).abs() <= x.abs() * 2.0**-11)[finite].all())
    assert bool((y.view(torch.int32) & 0x1FFF == 0)[torch.isfinite(x)].all()), "low 13 bits left"


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_tf32_rn_products(rng):
    """tiles.prod's "tf32_rn" (the float16 path's products of float32 operands) is the product of
    the operands rounded to nearest tf32, to float32 accumulation (1e-6 relative). On the GPU the
    plain "tf32" product truncates them instead: on positive operands its one-signed errors add up
    to more than twice the rounded product's error against the exact one, the bias the rounding
    removes. The interpreter's "tf32" products are float32 ones."""
    from triton_probes import prod_kernel

    M, N, K = 64, 32, 64
    a = (torch.rand(M, K, generator=rng) + 0.1).to(DEVICE)  # positive: truncation errors of one sign
    b = (torch.rand(K, N, generator=rng) + 0.1).to(DEVICE)
    exact = a.double() @ b.double()
    got = {}
    for prec in ("tf32_rn", "tf32", "ieee"):
        c = torch.full((M, N), float("nan"), device=DEVICE)
        prod_kernel[(1,)](a, b, c, M=M, N=N, K=K, PREC=prec)
        got[prec] = c.double()
    rounded = _round_tf32(a.cpu()).double().to(DEVICE) @ _round_tf32(b.cpu()).double().to(DEVICE)
    assert rel_rms(got["tf32_rn"], rounded) <= 1e-6, rel_rms(got["tf32_rn"], rounded)
    assert rel_rms(got["ieee"], exact) <= 1e-6
    err_rn, err_tf32 = rel_rms(got["tf32_rn"], exact), rel_rms(got["tf32"], exact)
    assert err_rn <= 2.0**-11, err_rn
    if GPU:
        assert err_tf32 > 2 * err_rn, (err_tf32, err_rn)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gates_exact_where_needed(dtype, rng, launch_log):
    """Unbounded gates on the whole-chunk path: with split launches (16-bit inputs) the gates kernel
    keeps plain float32 sums in the chunks whose sums stay within the plan's span (gok's bit 1 clear:
    plan.PLAIN_SUM_SPAN), storing no rounding errors there (gd stays as allocated: NaN under
    poisoning, which every reader of those chunks would show), and exact sums (gc + gd) in the
    others, which a second pass stores; float32 inputs exact sums everywhere. Against float64 sums
    of gates activated in float64: the kernel's float32 activation is off by a few units of 2^-24
    per gate, times |x| where e^-|x| is taken of a rounded x = g + dt_bias (W: |gate| (|x| + 8)
    2^-24 summed over the chunk), and the fast softplus of 16-bit inputs by up to 3e-7 exp(A_log)
    more (test_softplus_forms); plain float32 sums add up to 63 roundings (S 2^-18, S the chunk's
    sum of |gate|)."""
    from fastkda.backends.triton.plan import Tuning

    assert Tuning().split_unbounded, "the default splits the launches of unbounded gates"
    case = grow(Case(T=256, gate="softplus", dtype=dtype, A_log_range=(0.0, 2.0)), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    forced_gates(x, 64, ("small", "huge", "front", "small"))
    with use_backend("triton"), torch.no_grad():
        chunk_kda(**x)
    p = stage1_of(launch_log)
    assert p["gd"] is not None and p["ga"] is None, "not the whole-chunk path for unbounded gates"
    B, T, HV, K = p["gc"].shape
    NT = T // 64
    a = x["A_log"].double().exp().view(1, 1, 1, HV, 1)
    xin = x["g"].double() + x["dt_bias"].double().view(HV, K)
    act = (-a.view(1, 1, HV, 1) * torch.nn.functional.softplus(xin) / math.log(2.0)).view(B, NT, 64, HV, K)
    exact = act.cumsum(2)
    S = act.abs().sum(2, keepdim=True)
    W = (act.abs() * (xin.abs().view_as(act) + 8) * 2.0**-24).sum(2, keepdim=True)
    slack = (64 * 3e-7 / math.log(2.0)) * a if dtype != torch.float32 else 0.0
    gc, gd = p["gc"].double().view(B, NT, 64, HV, K), p["gd"].double().view(B, NT, 64, HV, K)
    gok = p["gok"].view(B, NT, 1, HV, 1).expand_as(gc)
    plain = (gok & 2) == 0 if dtype != torch.float32 else torch.zeros_like(gc, dtype=torch.bool)
    if dtype != torch.float32:
        assert bool(plain.any()) and bool((~plain).any()), p["gok"]  # both forms of chunk
    err = (gc + gd - exact).abs()
    assert bool((err <= W + slack)[~plain].all()), err[~plain].max()
    assert bool((gd != 0)[~plain & (S > 1e3)].any()), "no rounding errors stored in chunks of large sums"
    assert bool(gd[plain].isnan().all()), "rounding errors stored in plain chunks"
    err = (gc - exact).abs()
    assert bool((err <= W + S * 2.0**-18 + slack)[plain].all()), err[plain].max()


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0, 3e3, 1e6])
def test_exact_cumsum(scale, rng):
    """The gates kernel's cumulative sums without float64 (chunk_gates.exact_cumsum): float32 sum plus
    rounding error equal the float64 sum of the float32 gates to ~2^-33 of the column's magnitude
    (a plain float32 cumulative sum is off by ~2^-24 of it), on columns mixing zeros, tiny values,
    one huge value and gates of every size."""
    from triton_probes import exact_cumsum_kernel

    x = -torch.rand(64, 32, generator=rng, dtype=torch.float64).mul(scale).float()
    x[:, 0] = 0.0
    x[:, 1] *= 1e-7
    x[::5, 2] *= 1e4
    x[7, 3] = -scale * 1e5
    x = x.to(DEVICE)
    G, E = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    exact_cumsum_kernel[(1,)](x, G, E, C=64, BS=32)
    exact = torch.cumsum(x.double(), 0)
    bound = x.double().abs().sum(0) * 2.0**-33
    assert bool(((G.double() + E.double() - exact).abs() <= bound).all())
    assert bool(((G.double() - exact).abs() <= exact.abs() * 2.0**-24 + bound).all())  # G: float32 rounding of G + E
    plain = x.cpu().clone()  # float32 sums row by row (torch's cumsum accumulates wider on the CPU)
    for i in range(1, 64):
        plain[i] += plain[i - 1]
    assert bool(((plain.double() - exact.cpu()).abs() > bound.cpu()).any())  # which the bound tells apart


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sequences(backend):
    """No sequences at all (cu_seqlens = [0], or a dense batch of B = 0): outputs shaped like v,
    final states of N = 0, on every op."""
    from fastkda import fused_recurrent_kda, kda_gate_chunk_cumsum

    for shape, cu in (((1, 0), torch.tensor([0], device=DEVICE)), ((0, 10), None)):
        q, k, v = (torch.randn(*shape, 1, 16, device=DEVICE) for _ in range(3))
        g, beta = -torch.rand(*shape, 1, 16, device=DEVICE), torch.rand(*shape, 1, device=DEVICE)
        with use_backend(backend):
            for fn in (chunk_kda, fused_recurrent_kda):
                o, s = fn(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
                assert o.shape == v.shape and s.shape == (0, 1, 16, 16), (fn.__name__, cu, o.shape, s.shape)
            assert kda_gate_chunk_cumsum(g, torch.zeros(1, device=DEVICE), 16, cu_seqlens=cu).shape == g.shape


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("path", ["short", "chunk"])
@pytest.mark.parametrize("axis", ["state_v_first", "varlen", "bf16", "gva", "bf16_softplus_vfirst", "k48_v40",
                                  "k48_v40_vfirst"])
def test_scan_state_orientations(path, axis, rng, tune):
    """The forward scan with the state held as [K, BV] and transposed ([BV, K], ScanPlan.state_t:
    the short path's form) on the same stage 1, short or chunk-wide: both give the reference's
    output and final state, and on the chunk-wide path its states at chunk starts (in the state's
    layout); h and v' kept for the backward ([K, V] order) agree between the two forms."""
    import dataclasses

    from fastkda.backends.triton import forward
    from fastkda.backends.triton.function import plan_of

    case = short_case(axis).replace(initial_state=True, final_state=True)  # short_case: gates the short path takes
    x = make_inputs(case, device=DEVICE, generator=rng)
    o_ref, s_ref, h_ref = reference(x, chunked=True, chunk_size=case.chunk_size, return_intermediate_states=True)
    tune(short_min_pairs=1 if path == "short" else None)
    tol = tol_for(case.dtype, "triton")
    with torch.inference_mode():
        opts, inp = plain_options(x, **{n: t for n, t in x.items() if n not in ("q", "k", "v", "g", "beta")},
                                  chunk_size=case.chunk_size, return_intermediate_states=path == "chunk")
        plan = plan_of(opts, inp, train=False)
        if path == "short":
            assert plan.short is not None
            s1 = short_stage1_of(opts, plan, inp)
            xs = s1.xs
        else:
            assert plan.short is None
            s1 = forward.stage1_wu(opts, plan, plan.forward, forward.stage1_intra(opts, plan, inp), inp)
            xs = forward.wu_x(s1)
        assert plan.forward.state_t == (path == "short")
        kept = []
        for state_t in (False, True):
            def run(**changes):
                return scan_of(opts, plan, dataclasses.replace(plan.forward, state_t=state_t, **changes), s1, xs, inp)

            o, ht, h, _ = run()
            check(f"o (state_t={state_t})", o, o_ref, tol)
            check(f"final_state (state_t={state_t})", ht, s_ref, tol)
            if path == "chunk":
                check(f"h (state_t={state_t})", h, h_ref, tol)
            kept.append(run(keep=True, h_state_layout=False)[2:])
        for name, a, b in zip(("h kept", "v' kept"), *kept):
            check(name, b.float(), a.float(), tol)
