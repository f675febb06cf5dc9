"""The launch plan of a call: which path, which precisions, which launches, decided in one place.

``chunk_plan`` is a pure function of (options, input dtype, training or not, chunk count, device
facts, tuning): the kernel modules launch what its ``ChunkPlan`` says and decide nothing.
``decode_plan`` does the same for decoding. ``Tuning`` holds every tuning default; ``tuned``
overrides fields for the calls inside a ``with`` block (this thread or task only), for experiments
and tests. ``fastkda.explain`` prints a call's plan. The reasons behind the defaults are in
docs/kernels.md; their measurements in BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
import triton.language as tl

from ... import platform
from ...options import GateMode, KDAOptions


class Launch(NamedTuple):
    """Launch options of one kernel: warps, pipeline stages, register cap (None: the compiler's)."""

    warps: int
    stages: int | None = 1  # None: Triton's default
    maxnreg: int | None = None

    def kwargs(self) -> dict:
        kw = dict(num_warps=self.warps)
        if self.stages is not None:
            kw["num_stages"] = self.stages
        if self.maxnreg:
            kw["maxnreg"] = self.maxnreg
        return kw


class DecodeLaunch(NamedTuple):
    """The decode kernel's tiles and programs: value columns per tile, warps, software-pipelining
    stages of a program's loop over its tiles (calls of one token per sequence; 1: none), and at
    most this many programs per SM (a call with more tiles gives each program several)."""

    bv: int
    warps: int
    stages: int
    programs_per_sm: int


@dataclass(frozen=True)
class Tuning:
    """Tuning defaults of the Triton kernels (K, V <= 128 unless said; wider features take at least
    4 warps and no register cap). Paths and precisions here change the numbers within the error
    budget of docs/kernels.md; the rest only the speed."""

    # stage 1: which path
    whole_unbounded: bool = True  # gates activated in the kernel, unbounded, take the whole-chunk path
    split_unbounded: bool = True  # 16-bit inputs: chunks with small sums in launches of their own
    bf16_products: bool = True  # bfloat16 inputs: whole-chunk intra products from bfloat16 operands
    x_bf16: bool = True  # bfloat16 inputs, inference: X stored as bfloat16, bfloat16 w/u products
    x_bf16_train: bool = True  # and in training a bfloat16 copy of X for the w/u kernel
    fast_softplus: bool = True  # 16-bit inputs: the fast softplus form (common.softplus)
    heads_first: bool = True  # stage-1 grids: value heads vary fastest (common.chunk_grid)
    # stage 1: launches (warps, stages, register cap) and feature columns per tile
    gates: Launch = Launch(4)
    gates_whole: Launch = Launch(2)
    intra: Launch = Launch(2, 1, 128)
    intra_whole: Launch = Launch(4)
    inverse: Launch = Launch(2)
    wu: Launch = Launch(8)
    wu_x16: Launch = Launch(4)
    slice: int = 32
    gates_slice: int = 32
    gates_slice_whole: int = 16
    intra_whole_slice: int = 64
    intra_levels_slice: int = 32  # the split's second and third passes (past the middle anchor's span, exact sums)
    wu_slice: int = 32
    wu_slice_x16: int = 64
    # the short path (inference: stage 1 in one kernel over 16-token blocks, the scan over their
    # chunks; the stage-1 fields above are the chunk-wide path's)
    short_min_pairs: int | None = 16  # at least this many (sequence, value head) pairs (None: never)
    short: Launch = Launch(2)  # 16-token chunks
    # 32-token chunks (stage 1 merges its blocks in pairs) for bounded gates where the scan's
    # 16-column programs would not outnumber the SMs; 16 or 32 forces the chunk
    short_chunk: int | None = None
    short_pair: Launch = Launch(2)  # 32-token chunks
    short_scan_bv: int = 64  # the widest; halved (to 16) while the programs fill fewer than
    short_scan_fill: int = 1  # this many per SM
    short_scan_warps_narrow: int = 2  # 16-token steps below 64 columns (else scan_warps)
    short_scan_stages: int = 3
    # one long sequence whose scan has at most short_parts_fill programs per SM: cut along its tokens
    # into T // short_part_tokens parts (at most short_parts; the last the rest), each part's stage 1
    # running beside the scan of the part before (two streams; None: never)
    short_part_tokens: int | None = 4096
    short_parts: int = 4
    short_parts_fill: int = 2
    # the stages of a cut sequence's scan at 16 value columns (few heads), which runs beside the
    # next part's stage 1: chosen by measurement (BENCHMARKS.md, "Parts")
    short_parts_scan_stages: int = 5
    # inference calls with fewer pairs than short_min_pairs: each sequence cut into segments of at
    # least this many tokens, run as sequences of their own (their state maps composed after), so
    # that the short path has its pairs (None: never)
    segment_min_tokens: int | None = None
    # forward scan
    scan_bv: int = 64
    scan_bv_narrow: int = 32  # where scan_bv-wide programs would fill at most half the SMs
    scan_bv_wide_keys: int = 64  # K > 128
    scan_warps: int = 4
    scan_stages: int = 3
    scan_stages_crowded: int = 1
    u_in_scan: bool | str = "crowded"  # the scan forms u itself: True, False or "crowded"
    split_min_chunks: int | None = 64  # o from its own kernel: long sequences (None: never) ...
    split_max_programs: int = 64  # ... and few scan programs
    output_bv: int = 64
    output: Launch = Launch(4, None)
    # backward
    exact_pairs: bool | None = None  # block path's within-block pair sums exactly (None: float32 only)
    whole_backward: bool | None = None  # whole-chunk backward for the gates it serves (None: bfloat16)
    bwd_scan_bv: int = 64
    bwd_scan_bv_wide_keys: int = 32  # K > 128: fewer registers per program
    bwd_scan_bv_crowded: int | None = 128
    bwd_scan_warps: int = 8
    bwd_scan_stages: int = 3
    bwd_state: Launch = Launch(4, 2)  # two stages: the next value slice's loads start early
    bwd_v: Launch = Launch(4, 2)
    bwd_k: Launch = Launch(2)
    bwd_gate: Launch = Launch(2, 1, 128)
    bwd_gate_block: Launch = Launch(1)
    bwd_gate_block_levels: Launch = Launch(1)  # the split's second and third passes
    bwd_dg: Launch = Launch(2, 1, 168)
    bwd_dg_softplus: Launch = Launch(4)  # the softplus derivative's tiles spill at the cap above
    bwd_state_slice: int = 32
    bwd_gate_block_slice: int = 32
    bwd_dg_slice: int = 64
    bwd_qk_rows: int = 16
    bwd_qk: Launch = Launch(4, None)
    # decoding and the elementwise gate kernels
    # (value columns, warps, stages, programs per SM) of the decode kernel, by pool dtype and K
    decode_f32: DecodeLaunch = DecodeLaunch(64, 2, 1, 32)  # float32 pools: 256-byte row segments
    decode_bf16: DecodeLaunch = DecodeLaunch(32, 1, 1, 16)  # bfloat16 pools, K <= 64
    decode_bf16_k128: DecodeLaunch = DecodeLaunch(64, 2, 2, 4)  # bfloat16 pools, 64 < K <= 128
    decode_wide: DecodeLaunch = DecodeLaunch(32, 4, 1, 16)  # K > 128
    decode_check_rows: int = 1024  # sequences per step of the index check kernel (each step waits on its loads)
    decode_check_warps: int = 8
    decode_inline_check: int = 32  # calls of at most this many index entries (<= 64): checked by the decode programs
    decode_slot_check: bool = True  # the device-side check of indices and cu_seqlens (kernels bound slots anyway)
    decode_pdl: bool = True  # the decode kernel starts while the check kernel runs
    gate_rows: int = 32
    # device facts (None: the device's own)
    sm_count: int | None = None

    def __post_init__(self):  # plans are cached by their inputs: hash the many fields once
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self) -> int:
        return self._hash


# the products' precision per input dtype in the gate-gradient kernel of the whole-chunk path: a
# pair term enters dg twice, rounded apart; unbounded gates weigh the residue by |y| in dA_log
PAIR_PREC = {torch.bfloat16: "tf32", torch.float16: "tf32x3", torch.float32: "ieee"}
PAIR_PREC_UNBOUNDED = {torch.bfloat16: "tf32x3", torch.float16: "tf32x3", torch.float32: "ieee"}
# float16 inputs: dv' (= Aqk^T dO + kd dH) carries 2^-12 roundings that a token's dbeta (v . X^T dv',
# a small sum of large terms at a chunk's last token) takes many-fold. The backward scan takes dH
# (float32) as float16 hi + residue times 2^11 (below 2^-11 |dH|: a normal float16 wherever hi is);
# phase A's two products of dv' take tf32x3 (tf32 rounds as float16 does). docs/kernels.md
DH_SPLIT_SCALE = 2048.0
DV_PREC_FP16 = "tf32x3"
# the short path's clamp of unbounded gates (base 2) under its one anchor, for bfloat16 inputs: 8
# clamped gates span at most 2^96, as the middle anchor's factors do (short.SPAN)
SHORT_ANCHOR_CLAMP = 12.0
# 16-bit inputs on the whole-chunk path: the clamp of unbounded gates (base 2) under the middle
# anchors of the 8-token halves of the diagonal blocks that the middle anchor would overflow: 4
# clamped gates span at most 2^96 (chunk_gates.DIAG_SPAN), and a factor it changes is below 2^-24
HALVES_CLAMP = 24.0
# unbounded gates on the whole-chunk path, 16-bit inputs (the split passes): a chunk whose cumulative
# gates (base 2) stay within this span takes plain float32 sums, off by a few units in the last place
# of the span (2^-14 at 512, 2^-12 at 2048: a factor error of at most about 2^-11, below a fourth of
# bfloat16's 2^-9 operand rounding); beyond it, float32 sums plus their rounding errors (docs/math.md
# section 3). float32 inputs take exact sums everywhere: their span sets only gok's bit 1
PLAIN_SUM_SPAN = {torch.bfloat16: 2048.0, torch.float16: 512.0, torch.float32: 512.0}

_TUNING: contextvars.ContextVar[Tuning] = contextvars.ContextVar("fastkda_triton_tuning", default=Tuning())


def current_tuning() -> Tuning:
    return _TUNING.get()


@contextlib.contextmanager
def tuned(**changes) -> Iterator[Tuning]:
    """Override ``Tuning`` fields for the calls made inside the block (this thread or task only)."""
    names = {f.name for f in dataclasses.fields(Tuning)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"tuned(): unknown Tuning fields {unknown}")
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), **changes))
    try:
        yield _TUNING.get()
    finally:
        _TUNING.reset(token)


class Device(NamedTuple):
    """The facts of the device a plan depends on."""

    sm_count: int
    interpret: bool  # the Triton interpreter (CPU tensors): plain tl twins, emulated bfloat16 products


def device_facts(dev: torch.device, tuning: Tuning) -> Device:
    sms = tuning.sm_count if tuning.sm_count is not None else platform.sm_count(dev)
    return Device(sms, platform.triton_interpret())


# ------------------------------------------------------------------------------------------------
# small host helpers


def pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n, at least lo (plain Python: microseconds per call matter)."""
    return max(lo, 1 << max(int(n) - 1, 0).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


class Dot(NamedTuple):
    """Matrix products for inputs of one dtype: operand dtype, input precision, and whether bfloat16
    products are emulated (the interpreter's are wrong: tiles.as_operand)."""

    dtype: object
    prec: str
    emulate: bool


def dot_for(dtype: torch.dtype, interpret: bool) -> Dot:
    """bfloat16 inputs: tf32 products of float32 operands as the tensor cores read them (truncated);
    float16 inputs, whose own rounding is as fine as tf32's: rounded to nearest first (tiles.prod's
    "tf32_rn"); float32 inputs: full precision."""
    if dtype == torch.bfloat16:
        return Dot(tl.bfloat16, "tf32", interpret)
    if dtype == torch.float16:
        return Dot(tl.float16, "tf32_rn", False)
    return Dot(tl.float32, "ieee", False)


def _bf16_prec(interpret: bool) -> str:
    """tiles.prod's precision for bfloat16 operands (emulated under the interpreter)."""
    return "bf16_emulated" if interpret else "bf16"


def _wide(launch: Launch, BK: int, BV: int) -> Launch:
    """At least 4 warps and no register cap for features beyond 128 (the tiles grow with them)."""
    if max(BK, BV) > 128:
        return Launch(max(launch.warps, 4), launch.stages, None)
    return launch


def scan_stages(stages: int, BK: int, BV: int, elem_size: int) -> int:
    """Pipeline stages of a state scan: ``stages`` for K <= 128 and 16-bit operands, at most 2 for
    float32 (twice the shared memory), 1 for wider keys; one fewer beyond 64 value columns (one for
    float32), within the 227 KB of shared memory of a Hopper SM."""
    if BK > 128:
        return 1
    stages = stages if elem_size <= 2 else min(stages, 2)
    return stages if BV <= 64 else max(1, stages - 1 if elem_size <= 2 else 1)


def scan_warps(warps: int, BK: int, BV: int) -> int:
    """Warps of a state scan's program: ``warps`` up to a [128, 64] state, 8 beyond (registers)."""
    return warps if BK * BV <= 128 * 64 else max(warps, 8)


def softplus_form(dtype: torch.dtype, interpret: bool, tuning: Tuning) -> int:
    """common.softplus's FAST for gate inputs of ``dtype``: 16-bit inputs the fast forms (the plain
    tl twin under the interpreter), float32 the exact one."""
    if not tuning.fast_softplus or dtype == torch.float32:
        return 0
    return 1 if interpret else 2


# ------------------------------------------------------------------------------------------------
# the chunk plan


class IntraPass(NamedTuple):
    """One launch of the whole-chunk intra kernel (and of the backward's gate-block kernel): which
    chunks (tiles.chunk_form's SELECT), exact sums or not, feature columns per tile, launches, and
    the clamp of the gates where a chunk's diagonal blocks take their halves' middle anchors (0: the
    half-segment levels down to 2 tokens)."""

    exact: bool
    select: int  # tiles.chunk_form's SELECT
    bs: int
    launch: Launch
    gate_block: Launch
    clamp: float = 0.0


@dataclass(frozen=True)
class Stage1Plan:
    """Forward stage 1 (gates, intra-chunk products, the inverse, w/u): docs/kernels.md section 1."""

    whole: bool  # the whole-chunk path (else the block path)
    exact_sums: bool  # unbounded gates on the whole-chunk path: float32 sums plus rounding errors
    lo_span: float  # where the chunks whose sums stay within it (base 2) need no rounding errors
    passes: tuple[IntraPass, ...]  # whole-chunk path: its intra launches (one, or the split's three)
    heads_first: bool
    softplus_form: int
    x_dtype: torch.dtype  # X as the inverse stores it
    x_copy: bool  # and a bfloat16 copy for the w/u kernel (training)
    BK: int
    BS: int  # feature columns per tile (block path, inverse)
    gates_bs: int
    gates: Launch
    intra_bs: int  # block path (the whole-chunk path's: passes)
    intra_prec: str
    intra: Launch  # block path
    inverse: Launch
    wu_bs: int
    wu_prec: str  # the products w = X (beta k e^G), u = X (beta v) (and the scan's u)
    wu: Launch

    @property
    def split(self) -> bool:
        return len(self.passes) > 1


@dataclass(frozen=True)
class ShortPlan:
    """Forward stage 1 in one kernel (short.py), for inference: 16-token blocks, as chunks of their
    own or merged in pairs into 32-token chunks (``chunk``)."""

    bounded: bool  # safe_gate: the middle anchor on every chunk (no span test)
    # unbounded gates: the middle anchor on every chunk, its gates clamped at -anchor_clamp (base 2);
    # None: the exact forms (the middle anchor within 2^96, else the halves' anchors)
    anchor_clamp: float | None
    prec: str  # the Aqk, Akk products and w = X (beta k e^G) (and u where stage 1 forms it)
    inv_prec: str  # the products of the 16 x 16 inverse (tiles.inv_unit_lower)
    form_u: bool  # X stored (float32), u formed in the scan
    softplus_form: int
    heads_first: bool
    BK: int
    BV: int
    chunk: int  # 16 or 32: the scan's step
    launch: Launch
    parts: int = 1  # the sequence cut along its tokens (short_parts): each part's stage 1 beside the scan of the one before
    part_tokens: int = 0  # tokens per part, a multiple of chunk, the last part the rest (parts = 1: T)


@dataclass(frozen=True)
class ScanPlan:
    """Forward stage 2, the state scan (and the output kernel where o leaves it)."""

    outputs: bool  # o and the final state
    keep: bool  # h and v' for the backward (in the input dtype)
    form_u: bool  # the scan forms u = X (beta v) itself (stage 1 leaves u out)
    BV: int
    launch: Launch
    split_output: bool  # o from kda_fwd_output_kernel
    output_bv: int
    output: Launch
    chunk: int  # tokens per step (the call's chunk size; the short path's, ShortPlan.chunk)
    u_prec: str  # the product u = X (beta v) where the scan forms u
    h_state_layout: bool  # h in the state's layout (V-first states: [V, K]); h kept or split: [K, V]
    a_full: bool = False  # stage 1 wrote Aqk's whole chunk blocks, zeros above the diagonal (short path)
    state_t: bool = False  # the state held transposed, [BV, K] (short path: docs/kernels.md)


class SegmentOutput(NamedTuple):
    """The output kernel of a segmented call (output.kda_fwd_segment_output_kernel): rows and value
    columns per program, the product's precision, the launch."""

    rows: int
    bv: int
    prec: str
    launch: Launch


@dataclass(frozen=True)
class BackwardPlan:
    """Backward stage 1 (state scan) and stage 2 (chunk-parallel gradients)."""

    scan_bv: int
    scan: Launch
    scan_dh_split: float  # backward scan, kd dH: dH's rounding residue times this as a second operand (0: none)
    dv_prec: str  # phase A's products of dv' (a = X^T dv', dw = -dv' S^T)
    BS: int
    state_bs: int
    state: Launch  # phase A's state products (kda_bwd_state_kernel, two launches)
    v: Launch  # phase A's products within the chunk (kda_bwd_v_kernel)
    k: Launch
    whole: bool  # the whole-chunk gate gradients (kda_bwd_gate_block_kernel, kda_bwd_dg_kernel)
    pair_prec: str
    gate_block_bs: int  # its launches: each stage-1 pass's gate_block
    dg_bs: int
    dg: Launch
    exact_pairs: bool  # block path: within-block pair sums exactly
    diag_prec: str
    gate: Launch
    qk_rows: int
    qk: Launch  # the l2-norm backward and the sum over a key head's value heads


@dataclass(frozen=True)
class ChunkPlan:
    train: bool
    dot: Dot
    chunks: int  # chunk slots of the launch grids
    stage1: Stage1Plan | None  # None on the short path
    forward: ScanPlan | None  # the call's own scan (None: segmented)
    recompute: ScanPlan | None  # training: the backward's recomputation of the scan
    backward: BackwardPlan | None
    short: ShortPlan | None = None  # the short path: it replaces stage 1, the scan steps its chunks
    segments: int = 1  # inference: each sequence cut into this many (segment_count), the call's plan then theirs
    segment_output: SegmentOutput | None = None  # with segments

    def describe(self) -> str:
        """The plan as text, one stage per line (what ``fastkda.explain`` prints)."""
        if self.segments > 1:
            so = self.segment_output
            return (f"chunk plan: inference, each sequence cut into {self.segments} segments run as sequences of "
                    "their own with K more value columns (their state maps from the identity, float32 outputs), "
                    "the maps composed after; the segments' call has a plan of its own\n"
                    f"  output: {so.rows} rows, {so.bv} value columns {_fmt(so.launch)}, products {so.prec}")
        if self.short is not None:
            sp, sc = self.short, self.forward
            lines = [f"chunk plan: inference, {sp.chunk}-token chunks, products {self.dot.prec}"]
            blocks = "16-token blocks" + (" merged in pairs" if sp.chunk == 32 else "")
            lines.append(f"  stage 1: short path, {blocks} in one kernel {_fmt(sp.launch)}; middle anchor"
                         + ("" if sp.bounded else f" on gates clamped at -{sp.anchor_clamp:g} (base 2)"
                            if sp.anchor_clamp else " (the halves on clamped gates where the gates span more)")
                         + f"; products {sp.prec}, inverse {sp.inv_prec}; "
                         + ("X float32 for the scan" if sp.form_u else "u in stage 1"))
            lines.append(f"  scan: {sc.chunk}-token steps, {sc.BV} value columns {_fmt(sc.launch)}"
                         + ("; state held transposed" if sc.state_t else "")
                         + (f"; forms u ({sc.u_prec})" if sc.form_u else ""))
            if sp.parts > 1:
                lines.append(f"  parts: the sequence cut into {sp.parts} parts of {sp.part_tokens} tokens, the stage 1 "
                             "of each beside the scan of the one before (two streams)")
            return "\n".join(lines)
        s = self.stage1
        lines = [f"chunk plan: {'training' if self.train else 'inference'}, {self.chunks} chunk slots, "
                 f"products {self.dot.prec}"]
        path = "whole-chunk" if s.whole else "block"
        clamp = max((p.clamp for p in s.passes), default=0.0)
        sums = ""
        if s.exact_sums:
            sums = f", exact gate sums past {s.lo_span:g} (base 2)" if s.split else ", exact gate sums"
        lines.append(f"  stage 1: {path} path" + sums
                     + (f", diagonal blocks past the middle anchor's span: their halves' anchors on gates "
                        f"clamped at -{clamp:g} (base 2)" if clamp else "")
                     + (f", {len(s.passes)} passes" if s.split else "") + f"; X {_name(s.x_dtype)}"
                     + (" + bfloat16 copy" if s.x_copy else "") + f"; intra {s.intra_prec}, w/u {s.wu_prec}")
        intra = "; ".join(f"{p.bs} columns {_fmt(p.launch)}" for p in s.passes) if s.whole else \
            f"{s.intra_bs} columns {_fmt(s.intra)}"
        lines.append(f"    gates {s.gates_bs} columns {_fmt(s.gates)}; intra {intra}; "
                     f"inverse {_fmt(s.inverse)}; w/u {s.wu_bs} columns {_fmt(s.wu)}")
        for name, sc in (("scan", self.forward), ("recompute scan", self.recompute)):
            if sc is not None:
                lines.append(f"  {name}: {sc.BV} value columns {_fmt(sc.launch)}" + ("; forms u" if sc.form_u else "")
                             + ("; keeps h, v'" if sc.keep else "")
                             + (f"; o from the output kernel ({sc.output_bv} columns)" if sc.split_output else ""))
        b = self.backward
        if b is not None:
            lines.append(f"  backward scan: {b.scan_bv} value columns {_fmt(b.scan)}"
                         + (f"; dH as two operands (residue x {b.scan_dh_split:g})" if b.scan_dh_split else ""))
            blocks = "; ".join(_fmt(p.gate_block) for p in s.passes)
            gates = (f"whole-chunk gate gradients ({b.pair_prec} pairs, {b.gate_block_bs} columns {blocks}; "
                     f"dg {b.dg_bs} columns {_fmt(b.dg)})" if b.whole else
                     f"block gate gradients ({'exact' if b.exact_pairs else 'row/column'} pair sums, "
                     f"diagonal {b.diag_prec}, {_fmt(b.gate)})")
            lines.append(f"  backward chunk: state products from dH, then from h, {b.state_bs} columns "
                         f"{_fmt(b.state)}; dv {_fmt(b.v)} (dv' products {b.dv_prec}), dk {_fmt(b.k)}; {gates}; "
                         f"dq, dk per key head {b.qk_rows} rows {_fmt(b.qk)}")
        return "\n".join(lines)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _fmt(launch: Launch) -> str:
    stages = f", {_n(launch.stages, 'stage')}" if launch.stages is not None else ""
    cap = f", <= {launch.maxnreg} registers" if launch.maxnreg else ""
    return f"({_n(launch.warps, 'warp')}{stages}{cap})"


def whole_gates(opts: KDAOptions, tuning: Tuning) -> bool:
    """Gates the whole-chunk path serves: bounded ones (safe_gate) or any gate activated in the
    kernel (non-positive by construction)."""
    return opts.safe_gate or (tuning.whole_unbounded and opts.gate != GateMode.PREGATED)


def whole_backward(opts: KDAOptions, dtype: torch.dtype, tuning: Tuning) -> bool:
    """Whether the backward takes the whole-chunk path (and so the training forward's stage 1)."""
    if not whole_gates(opts, tuning):
        return False
    if tuning.whole_backward is not None:
        return tuning.whole_backward
    return dtype == torch.bfloat16 and not tuning.exact_pairs


def _scan_programs(opts: KDAOptions, BV: int) -> int:
    s = opts.shape
    return cdiv(s.V, BV) * s.N * s.HV


def scan_bv(opts: KDAOptions, sms: int, tuning: Tuning) -> int:
    """Value columns per forward-scan program: narrow where wide programs would fill at most half
    the SMs (each program is one chain of dependent products), else scan_bv; K > 128
    takes scan_bv_wide_keys (Triton 3.6 miscompiles 32 columns over several programs per head
    there)."""
    s = opts.shape
    if s.K > 128:
        bv = tuning.scan_bv_wide_keys
    elif _scan_programs(opts, tuning.scan_bv) <= sms // 2:
        bv = tuning.scan_bv_narrow
    else:
        bv = tuning.scan_bv
    return min(pow2(s.V), bv)


def short_scan_bv(opts: KDAOptions, sms: int, tuning: Tuning) -> int:
    """Value columns per program of the short path's scan: Tuning.short_scan_bv, halved down to 16
    while the programs would fill fewer than Tuning.short_scan_fill per SM (each program is one
    chain of dependent products: more, narrower chains finish sooner until the SMs are full)."""
    bv = min(pow2(opts.shape.V), tuning.short_scan_bv)
    while bv > 16 and _scan_programs(opts, bv) < tuning.short_scan_fill * sms:
        bv //= 2
    return bv


def short_parts(opts: KDAOptions, chunk: int, programs: int, sms: int, tuning: Tuning) -> tuple[int, int]:
    """(parts, tokens per part) of a short-path call: one sequence (B = 1, not use_graph) whose scan
    runs at most Tuning.short_parts_fill ``programs`` per SM (the SMs mostly idle through its chain)
    is cut along its tokens into T // Tuning.short_part_tokens parts, at most Tuning.short_parts,
    of T / parts tokens rounded up to whole chunks (the last part the rest, which may be shorter
    than short_part_tokens), so that the stage 1 of each part runs beside the scan of the part
    before (forward.short_forward). (1, T): not cut."""
    s = opts.shape
    if tuning.short_part_tokens is not None and tuning.short_part_tokens < 1:
        raise ValueError(f"Tuning.short_part_tokens must be None or positive, got {tuning.short_part_tokens!r}")
    if tuning.short_parts < 1:
        raise ValueError(f"Tuning.short_parts must be positive, got {tuning.short_parts!r}")
    if tuning.short_parts_fill < 1:
        raise ValueError(f"Tuning.short_parts_fill must be positive, got {tuning.short_parts_fill!r}")
    if tuning.short_parts_scan_stages < 1:
        raise ValueError(f"Tuning.short_parts_scan_stages must be positive, got {tuning.short_parts_scan_stages!r}")
    if (tuning.short_part_tokens is None or s.N != 1 or opts.graph  # one sequence: B = 1 too
            or programs > tuning.short_parts_fill * sms):
        return 1, s.T
    parts = min(tuning.short_parts, s.T // tuning.short_part_tokens)
    if parts < 2:
        return 1, s.T
    tokens = cdiv(cdiv(s.T, parts), chunk) * chunk
    return cdiv(s.T, tokens), tokens


def _stage1(opts: KDAOptions, dtype: torch.dtype, train: bool, dev: Device, tuning: Tuning, dot: Dot) -> Stage1Plan:
    s = opts.shape
    whole = whole_gates(opts, tuning) and (not train or whole_backward(opts, dtype, tuning))
    exact = whole and not opts.safe_gate
    BK, BV = pow2(s.K), pow2(s.V)
    passes = ()
    if whole:
        intra, bs = _wide(tuning.intra_whole, BK, BK), min(tuning.intra_whole_slice, BK)
        gate_block = _wide(tuning.bwd_gate_block, BK, BV)
        # unbounded gates of 16-bit inputs: the diagonal blocks past the middle anchor's span take the
        # 16-token level and their halves' middle anchors on clamped gates (off by at most 2^-24
        # |q_d k_d| per term: docs/math.md section 3) instead of the levels of 8, 4 and 2 tokens;
        # float32 inputs keep those exact levels
        clamp = HALVES_CLAMP if exact and dtype != torch.float32 else 0.0
        if exact and tuning.split_unbounded and dtype != torch.float32:
            # three passes: the middle anchor on plain sums; the chunks past its span on plain sums; those
            # with exact sums. The last two take the diagonal blocks' halves: tiles narrower than the
            # first pass's (whose 64-column ones spill there) and launches of their own
            levels_bs, levels = min(tuning.intra_levels_slice, BK), _wide(tuning.bwd_gate_block_levels, BK, BV)
            passes = (IntraPass(False, 1, bs, intra, gate_block),
                      IntraPass(False, 2, levels_bs, intra, levels, clamp),
                      IntraPass(True, 3, levels_bs, intra, levels, clamp))
        else:
            passes = (IntraPass(exact, 0, bs, intra, gate_block, clamp),)
    x16 = tuning.x_bf16 and dtype == torch.bfloat16
    x_dtype = torch.bfloat16 if x16 and not train else torch.float32
    x_copy = x16 and train and tuning.x_bf16_train
    low = x_dtype != torch.float32 or x_copy  # the w/u kernel reads X in bfloat16
    BS = min(tuning.slice, BK, BV)
    intra_prec = _bf16_prec(dev.interpret) if whole and tuning.bf16_products and dtype == torch.bfloat16 else dot.prec
    return Stage1Plan(
        whole=whole, exact_sums=exact, lo_span=PLAIN_SUM_SPAN[dtype], passes=passes, heads_first=tuning.heads_first,
        softplus_form=softplus_form(dtype, dev.interpret, tuning), x_dtype=x_dtype, x_copy=x_copy,
        BK=BK, BS=BS,
        # gates, intra and inverse do not see V: their warps follow K alone
        gates_bs=min(tuning.gates_slice_whole if whole else tuning.gates_slice, BS),
        gates=_wide(tuning.gates_whole if whole else tuning.gates, BK, BK),
        intra_bs=BS, intra_prec=intra_prec, intra=_wide(tuning.intra, BK, BK),
        inverse=_wide(tuning.inverse, BK, BK),
        wu_bs=min(tuning.wu_slice_x16 if low else tuning.wu_slice, BK, BV),
        wu_prec=_bf16_prec(dev.interpret) if low else dot.prec,
        wu=_wide(tuning.wu_x16 if low else tuning.wu, BK, BV))


def _scan(opts: KDAOptions, dtype: torch.dtype, s1: Stage1Plan, chunks: int, outputs: bool, keep: bool, dev: Device,
          tuning: Tuning, dot_prec: str) -> ScanPlan:
    s = opts.shape
    BK = pow2(s.K)
    BV = scan_bv(opts, dev.sm_count, tuning)
    crowded = _scan_programs(opts, BV) > dev.sm_count
    # u in the scan: not where u is kept for the backward, nor for 16-bit inputs with float32 X (Triton
    # 3.6's code for that tf32 product beside the scan's float16 ones faults on sm_90)
    form_u = False
    if tuning.u_in_scan and not keep and (dtype == torch.float32 or s1.x_dtype != torch.float32 or s1.x_copy):
        form_u = crowded if tuning.u_in_scan == "crowded" else True
    split = (outputs and not keep and tuning.split_min_chunks is not None and not opts.return_intermediate_states
             and s.N > 0 and chunks >= tuning.split_min_chunks * s.N
             and _scan_programs(opts, tuning.scan_bv) <= tuning.split_max_programs)
    elem = dtype.itemsize
    stages = scan_stages(tuning.scan_stages_crowded if crowded else tuning.scan_stages, BK, BV, elem)
    return ScanPlan(outputs=outputs, keep=keep, form_u=form_u, BV=BV,
                    launch=Launch(scan_warps(tuning.scan_warps, BK, BV), stages),
                    split_output=split, output_bv=min(pow2(s.V), tuning.output_bv), output=tuning.output,
                    chunk=opts.chunk_size, u_prec=s1.wu_prec if form_u else dot_prec,
                    h_state_layout=opts.state_v_first and not (keep or split))


def short_path(opts: KDAOptions, dtype: torch.dtype, train: bool, tuning: Tuning, pairs: int) -> bool:
    """Whether an inference call takes the short path: non-positive gates (bounded, or activated in
    the kernel), keys of at most 128 and values too unless the scan forms u (float16 inputs form it
    in stage 1, in one tile), no intermediate states asked for (they are the chunk size's), and
    enough (sequence, value head) pairs (``pairs``: forward.scan_pairs) that the scan's longer chain
    of 16- or 32-token steps costs less than the chunk-wide stage 1 it saves (docs/kernels.md)."""
    return (not train and tuning.short_min_pairs is not None and pairs >= tuning.short_min_pairs
            and (opts.safe_gate or opts.gate != GateMode.PREGATED) and not opts.return_intermediate_states
            and opts.shape.K <= 128 and (opts.shape.V <= 128 or dtype != torch.float16))


def segment_count(opts: KDAOptions, dtype: torch.dtype, train: bool, tuning: Tuning, pairs: int,
                  longest: int) -> int:
    """The segments each sequence of a call is cut into (1: none). An inference call that would take
    the short path but for its few (sequence, value head) pairs (``pairs``, as scan_pairs counts
    them) gets the power of two of segments that multiplies its pairs up to Tuning.short_min_pairs,
    if its longest sequence (``longest`` tokens) makes segments of Tuning.segment_min_tokens at
    least; shorter sequences are cut as many times. The segments run as sequences of their own
    with K more value columns (V + K of them, at most the kernels' widest; float16 inputs, which form
    u in stage 1, are left alone) on the short path; use_graph's fixed boundaries are never cut."""
    s = opts.shape
    if (tuning.segment_min_tokens is None or tuning.short_min_pairs is None or pairs <= 0
            or pairs >= tuning.short_min_pairs or opts.graph or dtype == torch.float16
            or s.V + s.K > platform.TRITON_MAX_DIM
            or not short_path(opts, dtype, train, tuning, tuning.short_min_pairs)):
        return 1
    segments = pow2(cdiv(tuning.short_min_pairs, pairs), 1)
    return segments if longest // segments >= tuning.segment_min_tokens else 1


def _short(opts: KDAOptions, dtype: torch.dtype, dev: Device, tuning: Tuning, dot: Dot) -> tuple[ShortPlan, ScanPlan]:
    s = opts.shape
    BK, BV = pow2(s.K), pow2(s.V)
    low = _bf16_prec(dev.interpret) if dtype == torch.bfloat16 else dot.prec
    # X kept in float32 for the scan's u (fewer bytes than u, and no rounding of u); float16 inputs
    # form u in stage 1 (Triton 3.6's code for a tf32 product beside float16 ones faults on sm_90)
    form_u = dtype != torch.float16
    # the inverse in tf32 (operands rounded to nearest) for bfloat16 inputs, whose own rounding is 16
    # times coarser; exact products for float32 and float16 ones
    inv_prec = "tf32_rn" if dtype == torch.bfloat16 else "ieee"
    # unbounded gates of bfloat16 inputs: one anchor on gates clamped at -12 (8 of them span 2^96),
    # off by at most 2^-12 |q_d k_d| per term (docs/math.md section 3); float16 and float32 inputs,
    # whose outputs that would show in, keep the exact forms
    clamp = SHORT_ANCHOR_CLAMP if dtype == torch.bfloat16 and not opts.safe_gate else None
    if tuning.short_chunk not in (None, 16, 32):
        raise ValueError(f"Tuning.short_chunk must be None, 16 or 32, got {tuning.short_chunk!r}")
    chunk = tuning.short_chunk or (32 if opts.safe_gate and _scan_programs(opts, 16) <= dev.sm_count else 16)
    bv = short_scan_bv(opts, dev.sm_count, tuning)
    parts, part_tokens = short_parts(opts, chunk, _scan_programs(opts, bv), dev.sm_count, tuning)
    sp = ShortPlan(bounded=opts.safe_gate, anchor_clamp=clamp, prec=low, inv_prec=inv_prec, form_u=form_u,
                   softplus_form=softplus_form(dtype, dev.interpret, tuning), heads_first=tuning.heads_first,
                   BK=BK, BV=BV, chunk=chunk, launch=tuning.short_pair if chunk == 32 else tuning.short,
                   parts=parts, part_tokens=part_tokens)
    warps = tuning.scan_warps if bv >= 64 or chunk == 32 else tuning.short_scan_warps_narrow
    stages = tuning.short_parts_scan_stages if parts > 1 and bv <= 16 else tuning.short_scan_stages
    scan = ScanPlan(outputs=True, keep=False, form_u=form_u, BV=bv,
                    launch=Launch(scan_warps(warps, BK, bv), scan_stages(stages, BK, bv, dtype.itemsize)),
                    split_output=False, output_bv=min(BV, tuning.output_bv), output=tuning.output, chunk=chunk,
                    u_prec="tf32" if dtype == torch.bfloat16 else dot.prec, h_state_layout=opts.state_v_first,
                    a_full=True, state_t=True)
    return sp, scan


def _backward(opts: KDAOptions, dtype: torch.dtype, s1: Stage1Plan, dev: Device, tuning: Tuning,
              dot: Dot) -> BackwardPlan:
    s = opts.shape
    BK, BV = pow2(s.K), pow2(s.V)
    bv = min(BV, tuning.bwd_scan_bv if BK <= 128 else tuning.bwd_scan_bv_wide_keys)
    if BK <= 128 and tuning.bwd_scan_bv_crowded and cdiv(s.V, bv) * s.N * s.HV > dev.sm_count:
        bv = min(BV, tuning.bwd_scan_bv_crowded)
    exact = tuning.exact_pairs if tuning.exact_pairs is not None else dtype == torch.float32
    return BackwardPlan(
        scan_bv=bv, scan=Launch(scan_warps(tuning.bwd_scan_warps, BK, bv),
                                scan_stages(tuning.bwd_scan_stages, BK, bv, dtype.itemsize)),
        scan_dh_split=DH_SPLIT_SCALE if dtype == torch.float16 else 0.0,
        dv_prec=DV_PREC_FP16 if dtype == torch.float16 else dot.prec,
        BS=min(tuning.slice, BK, BV), state_bs=min(tuning.bwd_state_slice, BK),
        state=_wide(tuning.bwd_state, BK, BV), v=_wide(tuning.bwd_v, BK, BV), k=_wide(tuning.bwd_k, BK, BV),
        whole=s1.whole,
        pair_prec=(PAIR_PREC if opts.safe_gate else PAIR_PREC_UNBOUNDED)[dtype],
        gate_block_bs=min(tuning.bwd_gate_block_slice, BK),
        dg_bs=min(tuning.bwd_dg_slice, BK),
        dg=_wide(tuning.bwd_dg_softplus if opts.gate == GateMode.SOFTPLUS else tuning.bwd_dg, BK, BV),
        exact_pairs=exact, diag_prec=dot.prec if exact else "tf32x3", gate=_wide(tuning.bwd_gate, BK, BV),
        qk_rows=tuning.bwd_qk_rows, qk=tuning.bwd_qk)


@functools.lru_cache(maxsize=256)
def chunk_plan(opts: KDAOptions, dtype: torch.dtype, train: bool, chunks: int, dev: Device,
               tuning: Tuning, pairs: int | None = None, longest: int | None = None) -> ChunkPlan:
    """The plan of a chunk_kda call on inputs of ``dtype`` with ``chunks`` chunk slots (a pure
    function; cached). ``train``: the forward of a training step, whose backward reads stage 1.
    ``pairs``: the (sequence, value head) pairs as the scan sees them (forward.scan_pairs; None:
    sequences x value heads); ``longest``: the longest sequence's tokens (forward.longest_sequence;
    None: T)."""
    dot = dot_for(dtype, dev.interpret)
    pairs = opts.shape.N * opts.shape.HV if pairs is None else pairs
    segments = segment_count(opts, dtype, train, tuning, pairs, opts.shape.T if longest is None else longest)
    if segments > 1:
        # float32 inputs: three tf32 products on 32 columns (Triton's float32 products on the cores,
        # and tf32x3 on 64 columns, spill at these tiles: offline sm_90 compiles)
        prec = "tf32x3" if dot.prec == "ieee" else dot.prec
        out = SegmentOutput(64, min(pow2(opts.shape.V), 32 if prec == "tf32x3" else 64), prec, Launch(4, None))
        return ChunkPlan(train=False, dot=dot, chunks=chunks, stage1=None, forward=None, recompute=None, backward=None,
                         segments=segments, segment_output=out)
    if short_path(opts, dtype, train, tuning, pairs):
        short, fwd = _short(opts, dtype, dev, tuning, dot)
        return ChunkPlan(train=False, dot=dot, chunks=chunks, stage1=None, forward=fwd, recompute=None, backward=None,
                         short=short)
    s1 = _stage1(opts, dtype, train, dev, tuning, dot)
    fwd = _scan(opts, dtype, s1, chunks, True, train and opts.disable_recompute, dev, tuning, dot.prec)
    recompute = _scan(opts, dtype, s1, chunks, False, True, dev, tuning, dot.prec) if train else None
    bwd = _backward(opts, dtype, s1, dev, tuning, dot) if train else None
    return ChunkPlan(train=train, dot=dot, chunks=chunks, stage1=s1, forward=fwd, recompute=recompute, backward=bwd)


class GatePlan(NamedTuple):
    """The elementwise gate kernels' tiles (gate.py): rows of [rows, BK] per program."""

    rows: int
    BK: int


def gate_plan(K: int, tuning: Tuning) -> GatePlan:
    return GatePlan(tuning.gate_rows, pow2(K, 1))


# ------------------------------------------------------------------------------------------------
# decoding


class DecodeChoice(NamedTuple):
    """What a decode call of given sizes launches (DecodePlan.choose)."""

    check: int  # 0 no index check, 1 the check kernel first, 2 in the decode programs
    dependent: bool  # the decode kernel launched while the check kernel runs
    grid: tuple[int]
    one_tile: bool  # a program per tile (no loop over tiles)
    stages: int  # of the loop over tiles
    check_rows: int  # sequences a decode program checks itself (check 2)


class DecodePlan(NamedTuple):
    BK: int
    BV: int
    launch: Launch
    check_rows: int
    check_launch: Launch
    inline_check: int
    slot_check: bool
    pdl: bool  # a check kernel lets the decode kernel start early (programmatic dependent launch)
    max_programs: int  # programs of the decode kernel, each looping over state tiles
    stages: int  # of that loop, for calls of one token per sequence

    def grid(self, tiles: int) -> tuple[int]:
        """The decode kernel's grid for ``tiles`` (value block, sequence, value head) tiles."""
        return (min(tiles, self.max_programs),)

    def choose(self, checked: bool, entries: int, cols: int, one_token: bool, tiles: int) -> DecodeChoice:
        """The launches of a call with ``entries`` index entries (sequences x ``cols``, the padded
        columns), ``tiles`` state tiles; ``checked``: a call whose indices or boundaries the device
        checks (a pool, or cu_seqlens); ``one_token``: one token per sequence."""
        check = self.check(checked, entries)
        grid = self.grid(tiles)
        return DecodeChoice(check, self.pdl and check == 1, grid, grid[0] == tiles, self.stages if one_token else 1,
                            self.inline_rows(cols) if check == 2 else 1)

    def inline_rows(self, cols: int) -> int:
        """The sequences a decode program checks itself (a power of two) for index rows of ``cols``
        (a power of two) columns: the call's ``[rows * cols]^2`` entry pairs stay within 64^2."""
        return max(pow2(self.inline_check) // cols, 1)

    def check(self, checked: bool, entries: int) -> int:
        """How a call with ``entries`` index entries (sequences x padded columns) checks them: 0 not
        at all (nothing to check, or the check switched off), 1 a check kernel before the decode
        kernel, 2 in the decode programs (small calls: one launch)."""
        if not (checked and self.slot_check):
            return 0
        return 2 if entries <= self.inline_check else 1


@functools.lru_cache(maxsize=64)
def decode_plan(K: int, V: int, state_bytes: int, tuning: Tuning, sms: int = platform.NOMINAL_SMS,
                pdl: bool = False) -> DecodePlan:
    """The decode launch for K x V states of ``state_bytes`` per element (4, or 2 for a bfloat16
    pool) on a device of ``sms`` SMs; ``pdl``: the device takes programmatic dependent launches
    (compiled, sm_90 and later)."""
    BK = pow2(K)
    if BK > 128:
        dl = tuning.decode_wide
    elif state_bytes >= 4:
        dl = tuning.decode_f32
    else:
        dl = tuning.decode_bf16_k128 if BK > 64 else tuning.decode_bf16
    BV = min(pow2(V), dl.bv)
    if not 0 <= tuning.decode_inline_check <= 64:  # call_error compares [entries]^2 pairs in registers
        raise ValueError(f"Tuning.decode_inline_check must be in [0, 64], got {tuning.decode_inline_check}")
    return DecodePlan(BK, BV, Launch(dl.warps, None), tuning.decode_check_rows, Launch(tuning.decode_check_warps, None),
                      tuning.decode_inline_check, tuning.decode_slot_check, pdl and tuning.decode_pdl,
                      sms * dl.programs_per_sm, dl.stages)
