"""The Triton backend's launch plan: table tests of the pure function ``plan.chunk_plan`` (shapes
only: meta tensors), tuning overrides, and ``fastkda.explain`` printing a call's plan."""

import dataclasses
import re
import threading
import types

import pytest
import torch
from conftest import BACKENDS, DEVICE
from helpers import plain_options

from fastkda.backends.triton import plan as P
from fastkda.options import GateMode
from fastkda.testing import Case, make_inputs

H200 = P.Device(sm_count=132, interpret=False)


def opts_for(B, T, H, HV=None, K=128, V=128, dtype=torch.bfloat16, **kw):
    """Options of a call on meta tensors of these shapes."""
    HV = HV or H
    t = torch.empty(B, T, H, K, device="meta", dtype=dtype)
    tv = torch.empty(B, T, HV, V, device="meta", dtype=dtype)
    g = torch.empty(B, T, HV, K, device="meta", dtype=dtype)
    opts, _ = plain_options(dict(q=t, k=t, v=tv, g=g, beta=tv[..., 0]))
    return dataclasses.replace(opts, **kw)


def plan_for(opts, dtype=torch.bfloat16, train=False, dev=H200, **tuning):
    """The plan of ``opts``; the chunk-wide path unless ``short_min_pairs`` is given (the tables of
    its scan and stage 1 below)."""
    s = opts.shape
    tuning.setdefault("short_min_pairs", None)
    return P.chunk_plan(opts, dtype, train, s.B * -(-s.T // opts.chunk_size), dev, P.Tuning(**tuning))


SAFE = dict(safe_gate=True, lower_bound=-5.0, gate=GateMode.LOWER_BOUND)


@pytest.mark.parametrize("B,T,H,HV,dtype,kw,train,scan", [
    (1, 8192, 96, 96, torch.bfloat16, SAFE, False, (16, 64, 4, 3)),
    (1, 8192, 64, 64, torch.bfloat16, SAFE, False, (16, 32, 2, 3)),
    (1, 8192, 48, 48, torch.bfloat16, dict(gate=GateMode.SOFTPLUS), False, (16, 32, 2, 3)),
    (1, 8192, 32, 32, torch.bfloat16, SAFE, False, (16, 16, 2, 5)),  # cut in 2
    (4, 4096, 4, 12, torch.float32, dict(gate=GateMode.SOFTPLUS), False, (16, 32, 2, 2)),
    (1, 32768, 16, 16, torch.bfloat16, SAFE, False, (32, 16, 4, 5)),  # cut in 4
    (1, 32768, 16, 16, torch.bfloat16, dict(gate=GateMode.SOFTPLUS), False, (16, 16, 2, 5)),
    (1, 32768, 8, 8, torch.bfloat16, SAFE, False, None),  # fewer pairs than short_min_pairs
    (1, 8192, 1, 47, torch.bfloat16, dict(gate=GateMode.SOFTPLUS), False, (16, 32, 2, 3)),
    (1, 8192, 64, 64, torch.bfloat16, dict(gate=GateMode.SOFTPLUS), True, None),
    (1, 8192, 64, 64, torch.bfloat16, dict(), False, None),
    (1, 8192, 64, 64, torch.bfloat16, dict(safe_gate=True), False, (16, 32, 2, 3)),
    (1, 8192, 64, 64, torch.bfloat16, dict(gate=GateMode.SOFTPLUS, return_intermediate_states=True), False, None)])
def test_short_path_choice(B, T, H, HV, dtype, kw, train, scan):
    """The short path: inference calls of at least Tuning.short_min_pairs (16) sequence x value-head
    pairs with non-positive gates (bounded, or activated in the kernel), keys of at most 128 (values
    too for float16 inputs, which form u in stage 1), no intermediate states. ``scan``: its step
    (32 tokens, blocks merged in pairs, for bounded gates where 16-column programs would not
    outnumber the H200's 132 SMs), value columns (64, halved while the programs are fewer than the
    SMs), warps (4 at 64 columns or 32-token steps, else 2) and stages (3, 2 for float32; 5 for one
    sequence cut into parts whose scan runs 16 columns per program), the state held transposed; u
    formed there (X kept in float32) except for float16 inputs."""
    opts = opts_for(B, T, H, HV, dtype=dtype, **kw)
    p = plan_for(opts, dtype, train=train, short_min_pairs=P.Tuning().short_min_pairs)
    short = scan is not None
    assert (p.short is not None) is short
    if short:
        assert (p.forward.chunk, p.forward.BV, p.forward.launch.warps, p.forward.launch.stages) == scan
        assert p.short.chunk == scan[0]
        assert p.forward.form_u and p.short.form_u and p.short.bounded is opts.safe_gate
        assert p.stage1 is None and p.recompute is None and p.backward is None
        assert "short path" in p.describe() and f"{scan[0]}-token steps" in p.describe()
        assert ("merged in pairs" in p.describe()) is (scan[0] == 32)
        assert p.forward.state_t and "state held transposed" in p.describe()  # docs/kernels.md, "State orientation"
        # unbounded gates of bfloat16 inputs: one anchor on clamped gates; float16 and float32: the exact forms
        clamp = 12.0 if dtype == torch.bfloat16 and not opts.safe_gate else None
        assert p.short.anchor_clamp == clamp and (("clamped at -12" in p.describe()) is (clamp is not None))
        fp16 = plan_for(opts_for(B, T, H, HV, dtype=torch.float16, **kw), torch.float16, short_min_pairs=1).short
        assert fp16.form_u is False and fp16.anchor_clamp is None
        assert plan_for(opts_for(B, T, H, HV, K=256, dtype=dtype, **kw), dtype, short_min_pairs=1).short is None
        wide_v = plan_for(opts_for(B, T, H, HV, V=256, dtype=dtype, **kw), dtype, short_min_pairs=1).short
        assert (wide_v is not None) is (dtype != torch.float16)  # u formed in the scan: any V
        few = P.chunk_plan(opts, dtype, train, 1, H200, P.Tuning(), pairs=P.Tuning().short_min_pairs - 1)
        assert few.short is None  # a skewed varlen call: fewer pairs than sequences x value heads
    else:
        assert p.forward.chunk == opts.chunk_size and "short" not in p.describe()
        assert not p.forward.state_t and "transposed" not in p.describe()


@pytest.mark.parametrize("chunk", [16, 32, 24, 64, 0])
def test_short_chunk_forced(chunk):
    """Tuning.short_chunk forces the short path's chunk where it is 16 or 32, whatever the gates and
    heads; any other value is refused with a ValueError naming it (0 too: None is the plan's choice)."""
    opts = opts_for(1, 8192, 64, 64, dtype=torch.bfloat16, gate=GateMode.SOFTPLUS)
    if chunk in (16, 32):
        p = plan_for(opts, short_min_pairs=16, short_chunk=chunk)
        assert p.short.chunk == p.forward.chunk == chunk and f"{chunk}-token steps" in p.describe()
    else:
        with pytest.raises(ValueError, match=f"short_chunk must be None, 16 or 32, got {chunk}"):
            plan_for(opts, short_min_pairs=16, short_chunk=chunk)


@pytest.mark.parametrize("B,T,H,kw,parts,stages", [
    (1, 32768, 16, SAFE, (4, 8192), 5),  # 16-column programs: 128 on 132 SMs
    (1, 32768, 16, dict(gate=GateMode.SOFTPLUS), (4, 8192), 5),
    (1, 30000, 16, SAFE, (4, 7520), 5),  # parts of whole 32-token chunks, the last shorter
    (1, 12000, 32, SAFE, (2, 6000), 5),  # 16-token chunks at 256 programs: 2 per SM, 2 parts of >= 4096
    (1, 8192, 64, SAFE, (2, 4096), 3),  # 32-column programs: 256
    (1, 8192, 96, SAFE, (2, 4096), 3),  # 64-column programs: 192
    (1, 8192, 160, SAFE, (1, 8192), 3),  # 64-column programs: 320, more than 2 per SM
    (1, 8191, 64, SAFE, (1, 8191), 3),  # one part of 4096 at most
    (1, 8193, 64, SAFE, (2, 4112), 3),  # the last part 4081 tokens
    (1, 16384, 16, dict(safe_gate=True, dtype=torch.float32), (4, 4096), 2),  # float32: 2 stages at most
    (2, 32768, 8, SAFE, (1, 32768), 3),  # two sequences: never cut
    (1, 32768, 16, dict(safe_gate=True, graph=True), (1, 32768), 3)])  # use_graph: never cut
def test_short_parts_choice(B, T, H, kw, parts, stages):
    """A short-path call on one sequence whose scan has at most 2 programs per SM is cut along its
    tokens into T // 4096 parts (at most 4) of whole chunks, the last the rest, each part's stage 1
    beside the scan of the one before; a scan of 16 columns per program then takes
    Tuning.short_parts_scan_stages; explain says so."""
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    opts = opts_for(B, T, H, H, dtype=dtype, **kw)
    p = plan_for(opts, dtype, short_min_pairs=16)
    assert (p.short.parts, p.short.part_tokens) == parts
    assert p.forward.launch.stages == stages
    assert p.short.part_tokens % p.short.chunk == 0 or parts[0] == 1
    assert ("parts of" in p.describe()) is (parts[0] > 1)
    assert plan_for(opts, short_min_pairs=16, short_part_tokens=None).short.parts == 1


@pytest.mark.parametrize("field,value", [("short_part_tokens", 0), ("short_part_tokens", -5), ("short_parts", 0),
                                         ("short_parts_fill", 0), ("short_parts_scan_stages", 0)])
def test_short_parts_refuses(field, value):
    """Tuning.short_part_tokens below 1 (None: never cut), Tuning.short_parts, short_parts_fill and
    short_parts_scan_stages below 1 are refused with a ValueError naming the field and the value."""
    opts = opts_for(1, 32768, 16, 16, dtype=torch.bfloat16, **SAFE)
    with pytest.raises(ValueError, match=f"{field} must be .*, got {value}"):
        plan_for(opts, short_min_pairs=16, **{field: value})


@pytest.mark.parametrize("B,part", [(2, 4096), (1, 4100)])
def test_short_parts_refuse_what_they_cannot_view(B, part):
    """The parts' forward, handed a plan with parts for two sequences or parts of a part chunk (no plan
    makes these), raises RuntimeError before it allocates or launches anything."""
    from fastkda.backends.triton.forward import _short_forward_parts

    opts = opts_for(1, 32768, 16, dtype=torch.bfloat16, **SAFE)
    plan = plan_for(opts, short_min_pairs=16)
    assert plan.short.parts > 1
    plan = dataclasses.replace(plan, short=dataclasses.replace(plan.short, part_tokens=part))
    opts = dataclasses.replace(opts, shape=dataclasses.replace(opts.shape, B=B))
    with pytest.raises(RuntimeError, match=f"got B={B}, part of {part} tokens"):
        _short_forward_parts(opts, plan, types.SimpleNamespace(q=torch.empty(0, device="meta")), None)


@pytest.mark.parametrize("B,T,H,dtype,kw,train,pairs,segments", [
    (1, 32768, 16, torch.bfloat16, SAFE, False, None, 4),
    (1, 32768, 16, torch.float32, dict(gate=GateMode.SOFTPLUS), False, None, 4),
    (2, 16384, 8, torch.bfloat16, SAFE, False, None, 4),
    (1, 131072, 2, torch.bfloat16, SAFE, False, None, 32),
    (1, 32768, 1, torch.bfloat16, SAFE, False, None, 1),  # 64 segments would be under segment_min_tokens
    (1, 32768, 16, torch.bfloat16, SAFE, False, 40, 2),  # a skewed varlen call: 40 pairs as the scan sees them
    (1, 4096, 16, torch.bfloat16, SAFE, False, None, 1),  # segments under segment_min_tokens
    (1, 32768, 16, torch.bfloat16, SAFE, True, None, 1),  # training
    (1, 32768, 16, torch.float16, SAFE, False, None, 1),  # float16 forms u in stage 1: V + K in one tile
    (1, 32768, 16, torch.bfloat16, dict(), False, None, 1),  # pre-gated unbounded gates: no short path
    (1, 32768, 16, torch.bfloat16, dict(SAFE, graph=True), False, None, 1),  # use_graph: lengths unseen
    (1, 32768, 64, torch.bfloat16, SAFE, False, None, 1)])  # pairs enough: the short path as it is
def test_segment_count(B, T, H, dtype, kw, train, pairs, segments):
    """Inference calls that would take the short path but for their pairs are cut into the power
    of two of segments that gives it its pairs (48 here), each of at least
    Tuning.segment_min_tokens; the plan says so and leaves the rest to the segments' call."""
    opts = opts_for(B, T, H, dtype=dtype, **kw)
    tuning = dict(short_min_pairs=48, segment_min_tokens=2048)
    p = P.chunk_plan(opts, dtype, train, 1, H200, P.Tuning(**tuning), pairs=pairs)
    assert p.segments == segments
    if segments > 1:
        assert p.stage1 is None and p.forward is None and p.short is None
        assert f"cut into {segments} segments" in p.describe() and "output: 64 rows" in p.describe()
        assert p.segment_output.prec == ("tf32x3" if dtype == torch.float32 else "tf32")
        assert P.chunk_plan(opts, dtype, train, 1, H200, P.Tuning(short_min_pairs=48), pairs=pairs).segments == 1
        wide = opts_for(B, T, H, V=192, dtype=dtype, **kw)  # V + K = 320: wider than the kernels take
        assert P.chunk_plan(wide, dtype, train, 1, H200, P.Tuning(**tuning), pairs=pairs).segments == 1


@pytest.mark.parametrize("B,T,H,split", [(1, 32768, 16, True), (1, 8192, 64, False), (2, 8192, 64, False),
                                         (1, 2048, 4, False)])
def test_split_output_choice(B, T, H, split):
    """o leaves the scan for the output kernel on long sequences over few scan programs only; never
    with return_intermediate_states, nor in the backward's recomputation."""
    assert plan_for(opts_for(B, T, H)).forward.split_output is split
    assert not plan_for(opts_for(B, T, H, return_intermediate_states=True)).forward.split_output
    assert not plan_for(opts_for(B, T, H), train=True).recompute.split_output
    assert not plan_for(opts_for(B, T, H), split_min_chunks=None).forward.split_output


@pytest.mark.parametrize("B,T,H,HV,bv,stages,stages32", [
    (1, 32768, 16, 16, 32, 3, 2), (1, 8192, 32, 32, 32, 3, 2), (1, 8192, 64, 64, 64, 3, 2),
    (2, 8192, 32, 32, 64, 3, 2), (1, 2048, 96, 96, 64, 1, 1), (2, 1024, 64, 64, 64, 1, 1),
    (1, 1024, 66, 66, 64, 3, 2), (1, 1024, 67, 67, 64, 1, 1),
    (1, 1024, 33, 33, 32, 3, 2), (1, 1024, 34, 34, 64, 3, 2), (1, 1024, 2, 64, 64, 3, 2), (1, 1024, 8, 32, 32, 3, 2)])
def test_scan_width_choice(B, T, H, HV, bv, stages, stages32):
    """The scan's value columns per program: narrow while wide programs (sequences x value heads x
    V / 64) would fill at most half the SMs (132: 66 programs narrow, 68 wide), following the SM
    count; keys wider than 128 keep 64 columns. Its pipeline stages: scan_stages_crowded (1) once
    the programs outnumber the SMs (132 programs 3 stages, 134 one), at most 2 for float32 inputs."""
    opts = opts_for(B, T, H, HV)
    for dtype, want in ((torch.bfloat16, stages), (torch.float32, stages32)):
        sc = plan_for(opts, dtype).forward
        assert (sc.BV, sc.launch.stages) == (bv, want), dtype
    wide = plan_for(opts, dev=P.Device(4 * 132, False)).forward  # four times the SMs: wide programs now too few
    assert (wide.BV, wide.launch.stages) == (32 if B * HV * 2 <= 264 else 64, 3)
    assert plan_for(opts_for(B, T, H, HV, K=256)).forward.BV == 64


@pytest.mark.parametrize("sms", [8, 132, 528])
def test_scan_narrow_never_crowded(sms):
    """32-column scan programs always keep the pipelined loop: the plan picks them only where they
    number at most the SMs, so never with scan_stages_crowded (Triton 3.6 miscompiles 32 columns
    at one stage on sm_90). Every value-head count until 64-column programs number about 4x the
    SMs."""
    seen = set()
    for hv in range(1, 2 * sms + 2):
        opts = opts_for(1, 64, 1, hv)
        sc = plan_for(opts, dev=P.Device(sms, False)).forward
        seen.add(sc.BV)
        if sc.BV == 32:
            assert 4 * hv <= sms, hv  # 32-column programs: at most one per SM
            assert sc.launch.stages == P.Tuning().scan_stages, hv
    assert seen == {32, 64}


@pytest.mark.parametrize("gate,safe,dtype,train,whole", [
    ("pregated", False, torch.bfloat16, False, False), ("pregated", False, torch.bfloat16, True, False),
    ("softplus", False, torch.bfloat16, False, True), ("softplus", False, torch.bfloat16, True, True),
    ("softplus", False, torch.float32, False, True), ("softplus", False, torch.float32, True, False),
    ("softplus", False, torch.float16, True, False), ("lowerbound", True, torch.bfloat16, True, True),
    ("lowerbound", True, torch.float16, False, True), ("pregated", True, torch.float32, True, False)])
def test_stage1_path(gate, safe, dtype, train, whole):
    """Which path stage 1 takes: the whole-chunk one for bounded gates and gates activated in the
    kernel, in inference, and in training where the backward takes it too (bfloat16); exact sums
    (and split passes for 16-bit inputs) for unbounded gates on it; the backward follows stage 1."""
    gates = {"pregated": GateMode.PREGATED, "softplus": GateMode.SOFTPLUS, "lowerbound": GateMode.LOWER_BOUND}
    opts = opts_for(1, 256, 2, dtype=dtype, gate=gates[gate], safe_gate=safe,
                    lower_bound=-5.0 if gate == "lowerbound" else None)
    p = plan_for(opts, dtype, train=train)
    assert p.stage1.whole is whole
    assert p.stage1.exact_sums is (whole and not safe)
    assert p.stage1.split is (whole and not safe and dtype != torch.float32)
    if train:
        assert p.backward.whole is whole
    assert not plan_for(opts, dtype, train=train, whole_unbounded=False).stage1.whole or safe


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_pass_launches(dtype):
    """The split's second and third passes (the chunks past the middle anchor's span on plain sums; those
    with exact sums) take their own tiles and launches, in the forward's intra kernel and the
    backward's gate-block kernel, and for 16-bit inputs the clamped halves (plan.HALVES_CLAMP) on those
    diagonal blocks; bounded gates and float32 inputs launch once, with the first pass's (float32:
    the exact levels). The span of plain sums is the input dtype's (plan.PLAIN_SUM_SPAN)."""
    t = P.Tuning()
    soft = plan_for(opts_for(1, 256, 2, dtype=dtype, gate=GateMode.SOFTPLUS), dtype, train=dtype == torch.bfloat16)
    first = P.IntraPass(dtype == torch.float32, 0 if dtype == torch.float32 else 1, t.intra_whole_slice, t.intra_whole,
                        t.bwd_gate_block)
    assert soft.stage1.lo_span == {torch.bfloat16: 2048.0, torch.float16: 512.0, torch.float32: 512.0}[dtype]
    if dtype == torch.float32:
        assert soft.stage1.passes == (first,)
    else:
        past = P.IntraPass(False, 2, t.intra_levels_slice, t.intra_whole, t.bwd_gate_block_levels, P.HALVES_CLAMP)
        assert soft.stage1.passes == (first, past, past._replace(exact=True, select=3))
        assert f"{t.intra_levels_slice} columns" in soft.describe()
        assert f"clamped at -{P.HALVES_CLAMP:g}" in soft.describe()
        assert f"exact gate sums past {P.PLAIN_SUM_SPAN[dtype]:g} (base 2)" in soft.describe()
        one = plan_for(opts_for(1, 256, 2, dtype=dtype, gate=GateMode.SOFTPLUS), dtype, split_unbounded=False)
        assert one.stage1.passes == (first._replace(exact=True, select=0, clamp=P.HALVES_CLAMP),)
    safe = plan_for(opts_for(1, 256, 2, dtype=dtype, gate=GateMode.LOWER_BOUND, safe_gate=True, lower_bound=-5.0), dtype)
    assert safe.stage1.passes == (P.IntraPass(False, 0, t.intra_whole_slice, t.intra_whole, t.bwd_gate_block),)
    narrow = plan_for(opts_for(1, 256, 2, dtype=dtype, gate=GateMode.SOFTPLUS), dtype, intra_levels_slice=16)
    assert narrow.stage1.passes[-1].bs == (t.intra_whole_slice if dtype == torch.float32 else 16)


@pytest.mark.parametrize("dtype,train,x_dtype,copy,wu_prec", [
    (torch.bfloat16, False, torch.bfloat16, False, "bf16"), (torch.bfloat16, True, torch.float32, True, "bf16"),
    (torch.float16, False, torch.float32, False, "tf32_rn"), (torch.float32, True, torch.float32, False, "ieee")])
def test_x_precision(dtype, train, x_dtype, copy, wu_prec):
    """X as the inverse stores it, its bfloat16 copy for training, and the w/u products' precision;
    the interpreter emulates bfloat16 products."""
    s1 = plan_for(opts_for(1, 256, 2, dtype=dtype), dtype, train=train).stage1
    assert (s1.x_dtype, s1.x_copy, s1.wu_prec) == (x_dtype, copy, wu_prec)
    emulated = plan_for(opts_for(1, 256, 2, dtype=dtype), dtype, train=train, dev=P.Device(132, True)).stage1
    assert emulated.wu_prec == ("bf16_emulated" if wu_prec == "bf16" else wu_prec)


def test_backward_precisions():
    """The whole-chunk gate gradients' pair products: tf32 for bounded gates in bfloat16, tf32x3 for
    unbounded ones (dA_log weighs their residue by |y|); the block path sums pairs exactly for
    float32 only; float16 forms and contracts dv' at float32 accuracy."""
    safe = opts_for(1, 256, 2, gate=GateMode.LOWER_BOUND, safe_gate=True, lower_bound=-5.0)
    soft = opts_for(1, 256, 2, gate=GateMode.SOFTPLUS)
    assert plan_for(safe, train=True).backward.pair_prec == "tf32"
    assert plan_for(soft, train=True).backward.pair_prec == "tf32x3"
    assert plan_for(soft, torch.float32, train=True).backward.exact_pairs
    assert not plan_for(soft, torch.float16, train=True).backward.exact_pairs
    assert plan_for(soft, train=False).backward is None
    # float16: dv' at float32 accuracy (dH as two operands in the scan, phase A's dv' products tf32x3)
    for dtype, split, dv_prec in ((torch.bfloat16, 0.0, "tf32"), (torch.float16, P.DH_SPLIT_SCALE, "tf32x3"),
                                  (torch.float32, 0.0, "ieee")):
        p = plan_for(safe, dtype, train=True)
        assert (p.backward.scan_dh_split, p.backward.dv_prec) == (split, dv_prec)
        assert ("dH as two operands" in p.describe()) == bool(split)


def test_dg_launch_by_gate():
    """The dg pass launches by the gate's activation: the softplus derivative at its own launch, the
    others (lower bound, pregated) at the capped one; wide features at least 4 warps, no cap."""
    t = P.Tuning()
    for gate, want in ((GateMode.SOFTPLUS, t.bwd_dg_softplus), (GateMode.LOWER_BOUND, t.bwd_dg),
                       (GateMode.PREGATED, t.bwd_dg)):
        assert plan_for(opts_for(1, 256, 2, gate=gate), train=True).backward.dg == want
    assert t.bwd_dg != t.bwd_dg_softplus
    wide = plan_for(opts_for(1, 256, 2, K=256, gate=GateMode.LOWER_BOUND), train=True).backward.dg
    assert wide == P.Launch(max(t.bwd_dg.warps, 4), t.bwd_dg.stages, None)


def test_plan_is_pure_and_cached():
    """Same inputs, the same plan object; a tuning change, a different plan."""
    opts = opts_for(1, 1024, 4)
    assert plan_for(opts) is plan_for(opts)
    assert plan_for(opts, scan_bv=32) is not plan_for(opts)
    assert plan_for(opts, scan_bv=32) == plan_for(opts, scan_bv=32)


def test_tuned_is_scoped():
    """``tuned`` overrides for the block only, in this thread only; unknown fields are a TypeError."""
    base = P.current_tuning()
    seen = []
    with P.tuned(scan_bv=32) as t:
        assert P.current_tuning() is t and t.scan_bv == 32
        with P.tuned(sm_count=7):
            assert (P.current_tuning().scan_bv, P.current_tuning().sm_count) == (32, 7)
        worker = threading.Thread(target=lambda: seen.append(P.current_tuning().scan_bv))
        worker.start()
        worker.join()
    assert seen == [base.scan_bv]
    assert P.current_tuning() == base
    with pytest.raises(TypeError, match="scan_widht"):
        with P.tuned(scan_widht=3):
            pass


def test_stage1_refuses_pregated_gates_on_whole_path():
    """The whole-chunk path needs gates activated in the kernel (nothing bounds a pre-activated
    gate's sign): a plan made for softplus gates refuses pre-activated ones before any launch."""
    from fastkda.backends.triton.forward import stage1_intra

    x = make_inputs(Case(T=20))
    opts, inp = plain_options(x)
    plan = plan_for(dataclasses.replace(opts, gate=GateMode.SOFTPLUS), torch.float32)
    assert plan.stage1.whole
    with pytest.raises(RuntimeError, match="gates activated in the kernel"):
        stage1_intra(opts, plan, inp)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_explain_shows_the_plan():
    """``fastkda.explain`` names the backend and, for the Triton backend, prints the call's plan."""
    import fastkda

    x = make_inputs(Case(T=70, gate="softplus", dtype=torch.bfloat16), device=DEVICE)
    with fastkda.use_backend("triton"):
        e = fastkda.explain(fastkda.chunk_kda, **x)
        backend, reasons = e
        assert backend == "triton" and e.backend == "triton" and reasons
        assert "stage 1: whole-chunk path" in e.plan and "scan:" in e.plan and "backward" not in e.plan
        xt = {**x, "q": x["q"].clone().requires_grad_(True)}
        assert "backward chunk" in fastkda.explain(fastkda.chunk_kda, **xt).plan
        assert "chunk plan" in str(e)


@pytest.mark.parametrize("K,V,state_bytes,bv,warps,stages", [
    (128, 128, 4, 64, 2, 1), (64, 64, 4, 64, 2, 1), (64, 32, 4, 32, 2, 1), (128, 128, 2, 64, 2, 2),
    (128, 16, 2, 16, 2, 2), (64, 64, 2, 32, 1, 1), (32, 128, 2, 32, 1, 1), (256, 256, 4, 32, 4, 1),
    (256, 128, 2, 32, 4, 1)])
def test_decode_plan(K, V, state_bytes, bv, warps, stages):
    """The decode tiles: 64 float32 columns on two warps; of a bfloat16 pool 64 columns on two
    warps, pipelined, for K = 128, 32 columns on one warp for smaller keys; no more than V; keys
    beyond 128 the wide launch."""
    p = P.decode_plan(K, V, state_bytes, P.Tuning())
    assert (p.BK, p.BV, p.launch.warps, p.stages) == (P.pow2(K), bv, warps, stages)


@pytest.mark.parametrize("pool,entries,check", [(False, 1, 0), (True, 1, 2), (True, 32, 2), (True, 33, 1),
                                                (True, 4096, 1)])
def test_decode_check_by_call_size(pool, entries, check):
    """A pool call of at most decode_inline_check index entries is checked by the decode programs
    (one launch), a larger one by the check kernel first; a call without a pool is not checked."""
    assert P.decode_plan(128, 128, 4, P.Tuning()).check(pool, entries) == check
    assert P.decode_plan(128, 128, 4, P.Tuning(decode_slot_check=False)).check(pool, entries) == 0


def test_decode_grid():
    """Decode programs loop over the state tiles: one program per tile up to the launch's
    programs per SM, fewer programs (each taking several tiles) beyond."""
    p = P.decode_plan(128, 128, 4, P.Tuning(), sms=132)
    assert p.grid(7) == (7,)
    assert p.grid(10**6) == (132 * P.Tuning().decode_f32.programs_per_sm,)
    few = P.Tuning(decode_f32=P.DecodeLaunch(64, 2, 1, 2))
    assert P.decode_plan(128, 128, 4, few, sms=10).grid(10**6) == (20,)


def test_decode_choice():
    """What a decode call launches: a large pool call the check kernel first and, where the device
    takes it, the decode kernel as a dependent launch, its programs looping over the tiles (the
    loop pipelined only for one token per sequence); a small one a program per tile checking the
    call itself."""
    bf16 = P.decode_plan(128, 128, 2, P.Tuning(), sms=132, pdl=True)
    big = bf16.choose(True, 4096, 1, True, 10**6)
    assert (big.check, big.dependent, big.grid, big.one_tile, big.stages) == (1, True, (132 * 4,), False, 2)
    assert bf16.choose(True, 4096, 1, False, 10**6).stages == 1
    assert not P.decode_plan(128, 128, 2, P.Tuning(), sms=132, pdl=False).choose(True, 4096, 1, True, 8).dependent
    small = bf16.choose(True, 3, 1, True, 24)
    assert (small.check, small.dependent, small.grid, small.one_tile, small.check_rows) == (2, False, (24,), True, 32)
    assert bf16.choose(False, 3, 1, True, 24).check == 0


def test_decode_inline_rows():
    """The decode programs' own check covers 32 index entries: 32 sequences of one column, 4 of 8;
    decode_inline_check beyond 64 (whose [entries]^2 comparison would not fit registers) is refused."""
    p = P.decode_plan(128, 128, 4, P.Tuning())
    assert (p.inline_rows(1), p.inline_rows(8), p.inline_rows(32)) == (32, 4, 1)
    with pytest.raises(ValueError, match="decode_inline_check"):
        P.decode_plan(128, 128, 4, P.Tuning(decode_inline_check=65))


def test_explain_shows_the_decode_plan():
    """``fastkda.explain`` of a decode call on a bfloat16 pool prints the launch the pool's dtype takes."""
    import fastkda

    x = make_inputs(Case(B=3, T=1, K=64, V=64, gate="softplus", dtype=torch.bfloat16, initial_state=False),
                    device=DEVICE)
    pool = torch.zeros(5, x["v"].shape[2], x["q"].shape[3], x["v"].shape[3], device=DEVICE, dtype=torch.bfloat16)
    with fastkda.use_backend("triton"):
        plan = fastkda.explain(fastkda.fused_recurrent_kda, **x, initial_state=pool,
                               ssm_state_indices=torch.tensor([0, 2, -1], device=DEVICE), inplace_final_state=True).plan
    assert re.search(r"decode plan: tiles of 32 value columns, (\d+) of them over \1 programs \(1 warp each\), "
                     "index check in the decode programs$", plan), plan
    big = torch.arange(40, device=DEVICE)
    xb = make_inputs(Case(B=40, T=1, K=64, V=64, gate="softplus", dtype=torch.bfloat16, initial_state=False),
                     device=DEVICE)
    with fastkda.use_backend("triton"):
        plan = fastkda.explain(fastkda.fused_recurrent_kda, **xb, initial_state=pool.new_zeros(40, *pool.shape[1:]),
                               ssm_state_indices=big, inplace_final_state=True).plan
    assert "index check kernel" in plan, plan
