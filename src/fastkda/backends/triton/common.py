"""Shared pieces of the Triton backend: gate activation and its backward, where a program's chunk
or sequence lies (varlen aware), the chunk tables, and ``launch``, through which the kernels start
(``recorded_launches`` lists them: which kernels ran, with which arguments), with ``CompiledLaunch``
for the repeated launches of the decode kernels, the short path's stage 1 and the state scan.
Everything jitted here runs in the Triton interpreter too (plain ``tl`` ops only)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, NamedTuple

import torch
import triton
import triton.language as tl

from ... import platform
from ...alloc import new_empty
from ...options import GateMode, graph_chunk_slots
from ...seqlens import seqlens_derived
from .plan import cdiv


# gate modes, as constexpr ints
GATE_PREGATED = 0
GATE_SOFTPLUS = 1
GATE_LOWER_BOUND = 2


class Launched(NamedTuple):
    """One recorded launch: the kernel's name, its grid, its arguments by name, its launch options."""

    name: str
    grid: tuple
    args: dict
    options: dict


_RECORD: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("fastkda_triton_launches", default=None)


@contextlib.contextmanager
def recorded_launches(before: Callable[[Launched], None] | None = None, run: bool = True) -> Iterator[list[Launched]]:
    """The launches made inside the block (this thread or task only), in order; ``before`` is
    called with each record just before its kernel starts (its arguments as they are then).
    ``run=False``: the kernels do not run (what a call launches, for tools that count its bytes;
    the outputs hold whatever their allocation held)."""
    log: list[Launched] = []
    token = _RECORD.set((log, before, run))
    try:
        yield log
    finally:
        _RECORD.reset(token)


def current_record():
    """The active recording (None: none), for work that runs in another thread on this call's
    behalf: the autograd engine runs CUDA backwards in a thread of its own (``recording``)."""
    return _RECORD.get()


@contextlib.contextmanager
def recording(record) -> Iterator[None]:
    """Make ``record`` (from ``current_record``) the active recording inside the block."""
    token = _RECORD.set(record)
    try:
        yield
    finally:
        _RECORD.reset(token)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, recorded inside ``recorded_launches``."""
    record = _RECORD.get()
    if record is not None:
        names = kernel.arg_names
        bound = dict(zip(names, args))
        bound.update({n: v for n, v in kwargs.items() if n in names})
        entry = Launched(kernel.fn.__name__, tuple(grid), bound, {n: v for n, v in kwargs.items() if n not in names})
        record[0].append(entry)
        if record[1] is not None:
            record[1](entry)
        if not record[2]:
            return
    kernel[grid](*args, **kwargs)


class CompiledLaunch:
    """Launches of one kernel whose arguments after its tensors and launch options are fixed (a
    call's sizes and options), straight through the compiled kernel: the first launch of each
    signature (device, Triton's debug switch, and each tensor's dtype and 16-byte alignment, which
    are what Triton specialises a tensor on; not the grid, which no compiled kernel depends on) goes
    through Triton's own launch, which compiles; later ones skip Triton's binding of the arguments
    (most of its host time for a kernel of many arguments). Under the interpreter and inside
    ``recorded_launches`` every launch goes through ``launch``."""

    def __init__(self, kernel, kwargs: dict):
        """``kwargs``: the kernel's arguments from its first one named there on (those before it, its
        tensors, are passed per launch) and its launch options."""
        names = kernel.arg_names
        names = names[next(i for i, n in enumerate(names) if n in kwargs):]
        self.kernel = kernel
        self.args = tuple(kwargs[n] for n in names)  # positional: they bind fastest
        self.options = {n: v for n, v in kwargs.items() if n not in names}
        self._compiled: dict = {}

    def __call__(self, grid: tuple, *tensors) -> None:
        if _RECORD.get() is not None or platform.triton_interpret():
            launch(self.kernel, grid, *tensors, *self.args, **self.options)
            return
        key = (torch.cuda.current_device(), triton.knobs.runtime.debug,
               tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in tensors))
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.kernel[grid](*tensors, *self.args, **self.options)
        else:  # (the compiled kernel's launcher takes three grid dimensions)
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*tensors, *self.args)


@triton.jit
def log1p(x):
    """log(1 + x), accurate for small x (the rounding of 1 + x is corrected)."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """1 / (1 + e^-x); FAST 2 (softplus's form 2: the GPU, not the interpreter): the hardware's
    ex2.approx and rcp.approx (2 ulp and 1 ulp: three instructions instead of tl.sigmoid's dozen
    of range checks and scalings), 0 and 1 at the extremes."""
    if FAST == 2:
        y = tl.inline_asm_elementwise(
            "{ .reg .f32 t; ex2.approx.ftz.f32 t, $1; add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
            "=f,f", [x * -1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def softplus(x, FAST: tl.constexpr):
    """log(1 + e^x) without overflow or cancellation. FAST 0: log1p's (a division and tl.log); 1: with
    t = e^-|x| and u = 1 + t rounded, log(u) + (t - (u - 1)) / u, the division (of a term below
    2^-24) by 1.5 - u / 2 (exact at u = 1 and 2, within 12% between) and log(u) from tl.log2; 2: as 1
    with the hardware's log2 (lg2.approx, absolute error about 2^-22 on [1, 2]: a gate off by about
    1e-7 times its scale, for 16-bit inputs; no inline assembly in the interpreter, which takes 1)."""
    if FAST == 0:
        y = tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x)))
    else:
        t = tl.exp(-tl.abs(x))
        u = 1.0 + t
        if FAST == 2:
            b_l = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                            pack=1)
        else:
            b_l = tl.log2(u)
        y = tl.maximum(x, 0.0) + (b_l * 0.6931471805599453 + (t - (u - 1.0)) * (1.5 - 0.5 * u))
    return y


@triton.jit
def activate_gate(b_g, A_log, dt_bias, i_hv, o_k, m_k, lower_bound, GATE: tl.constexpr, HAS_A: tl.constexpr,
                  HAS_BIAS: tl.constexpr, K: tl.constexpr, FAST: tl.constexpr):
    """The log-space decay of a [rows, BK] block of raw gate inputs (docs/math.md section 4), float32;
    FAST: softplus's form (and with 2 the lower-bound gate's sigmoid from the hardware's approximations)."""
    if GATE == 0:
        return b_g
    if HAS_BIAS:
        b_g = b_g + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    if HAS_A:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        b_a = 1.0
    if GATE == 1:
        return -b_a * softplus(b_g, FAST)
    return lower_bound * sigmoid(b_a * b_g, FAST)


@triton.jit
def gate_backward(b_x, b_dy, A_log, i_hv, lower_bound, GATE: tl.constexpr, HAS_A: tl.constexpr):
    """(dL/dx, the summand of dL/dA_log) of y = gate(x) for raw inputs x (``dt_bias`` added) and
    dL/dy = b_dy, float32 (docs/math.md section 4)."""
    if HAS_A:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        b_a = 1.0
    if GATE == 1:  # y = -a softplus(x): dy/dx = -a sigmoid(x), dy/dA_log = y
        b_dx = -b_a * tl.sigmoid(b_x) * b_dy
        return b_dx, -b_a * softplus(b_x, 0) * b_dy
    # y = lb sigmoid(a x): dy/dx = lb s (1 - s) a, dy/dA_log = lb s (1 - s) a x; 1 - s is taken as
    # sigmoid(-a x): the difference cancels catastrophically once s is near 1
    b_z = b_a * b_x
    b_dx = lower_bound * tl.sigmoid(b_z) * tl.sigmoid(-b_z) * b_a * b_dy
    return b_dx, b_dx * b_x


@triton.jit
def seq_bounds(cu_seqlens, i_n, T):
    """(first token, length) of sequence i_n, its boundaries clamped to [0, T] and its end to at
    least its start: whatever cu_seqlens holds, rows [bos, bos + length) lie within the T rows."""
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n).to(tl.int64), 0), T)
    eos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), bos), T)
    return bos, eos - bos


@triton.jit
def chunk_location(i_c, cu_seqlens, chunk_indices, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, first token of the sequence, its length) of global chunk i_c.
    Varlen: the boundaries are clamped to [0, T] (seq_bounds)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos, T_seq = seq_bounds(cu_seqlens, i_n, T)
    else:
        NT = tl.cdiv(T, C)
        i_n, i_t = i_c // NT, i_c % NT
        bos = i_n * T
        T_seq = T
    return i_n, i_t, bos, T_seq


@triton.jit
def sequence_location(i_n, cu_seqlens, chunk_offsets, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token, length, first global chunk index) of sequence i_n. Varlen: the boundaries
    clamped to [0, T] and the length to the chunks the host's tables give the sequence, so that
    boundaries changed behind the tables' back (values the host never saw) index nothing outside
    the tensors and the per-chunk scratches."""
    if IS_VARLEN:
        bos, T_seq = seq_bounds(cu_seqlens, i_n, T)
        c_off = tl.load(chunk_offsets + i_n).to(tl.int64)
        T_seq = tl.minimum(T_seq, (tl.load(chunk_offsets + i_n + 1).to(tl.int64) - c_off) * C)
    else:
        bos = i_n * T
        T_seq = T
        c_off = i_n * tl.cdiv(T, C)
    return bos, T_seq, c_off


def chunk_grid(parts: int, HV: int, heads_first: bool = False) -> tuple[int, ...]:
    """The grid of a chunk_program kernel with ``parts`` programs per value head: (parts, HV), or
    ``heads_first`` (its HEADS_FIRST) one dimension of HV x parts programs, the value head varying fastest
    (one dimension: a grid's second may not exceed 65535, which parts can)."""
    return (HV * parts,) if heads_first else (parts, HV)


def seq_grid(V: int, BV: int, NH: int) -> tuple[int]:
    """The grid of a per-sequence kernel (seq_program): cdiv(V, BV) value-column blocks times NH
    (sequence, value head) pairs in one dimension, the block varying fastest (a grid's second
    dimension may not exceed 65535, which NH can: thousands of sequences times the heads)."""
    return (cdiv(V, BV) * NH,)


@triton.jit
def seq_program(V: tl.constexpr, BV: tl.constexpr):
    """(value-column block, (sequence, value head) pair) of this program in a seq_grid."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_pid = tl.program_id(0).to(tl.int64)
    return (i_pid % NV).to(tl.int32), i_pid // NV


@triton.jit
def chunk_program(cu_seqlens, chunk_indices, T, HV: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr,
                  NSUB: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """(part of the chunk, value head, slot of the pair in the per-chunk scratches, first token of
    the sequence, its length, first token of the chunk within it) of this program. Grids are
    (chunks * NSUB, value heads), or with HEADS_FIRST value heads * chunks * NSUB, the head varying fastest
    (chunk_grid): the NSUB programs of one chunk (its row blocks or feature slices) run close
    together and share what they read through the L2 cache."""
    if HEADS_FIRST:
        i_pid = tl.program_id(0).to(tl.int64)
        i_hv, i_x = i_pid % HV, i_pid // HV
    else:
        i_hv, i_x = tl.program_id(1).to(tl.int64), tl.program_id(0).to(tl.int64)
    i_c, i_sub = i_x // NSUB, (i_x % NSUB).to(tl.int32)
    _, i_t, bos, T_seq = chunk_location(i_c, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    return i_sub, i_hv, i_c * HV + i_hv, bos, T_seq, i_t * C


def contiguous(t):
    """t, made contiguous if it is not (None stays None)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def contiguous_inputs(x, keep: tuple[str, ...] = ()):
    """``x`` (a KDAInputs) with every tensor contiguous, as the kernels index them, except the
    fields named in ``keep``."""
    changed = {n: t.contiguous() for n, t in zip(x._fields, x)
               if isinstance(t, torch.Tensor) and not t.is_contiguous() and n not in keep}
    return x._replace(**changed) if changed else x  # decoding calls: usually nothing to change


_GATE_CODES = {GateMode.PREGATED: GATE_PREGATED, GateMode.SOFTPLUS: GATE_SOFTPLUS,
               GateMode.LOWER_BOUND: GATE_LOWER_BOUND}


def gate_code(gate) -> int:
    return _GATE_CODES[gate]


def gate_launch(opts, has_a: bool, has_bias: bool) -> dict:
    """The gate arguments of the chunk kernels (lower_bound, GATE, HAS_A, HAS_BIAS) for a call with
    A_log and dt_bias given or not."""
    return dict(lower_bound=opts.lower_bound if opts.lower_bound is not None else 0.0, GATE=gate_code(opts.gate),
                HAS_A=bool(has_a), HAS_BIAS=bool(has_bias))


def chunk_tables(cu_host: torch.Tensor, C: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chunk_indices [NT_total, 2] int32: (sequence, chunk in sequence), chunk_offsets [N+1] int32,
    NT_total) of the host copy of cu_seqlens, kept by its values (seqlens.seqlens_derived)."""
    def make():
        cu = cu_host.tolist()
        counts = [cdiv(cu[i + 1] - cu[i], C) for i in range(len(cu) - 1)]
        idx = [(n, c) for n, cnt in enumerate(counts) for c in range(cnt)]
        offsets = [0]
        for cnt in counts:
            offsets.append(offsets[-1] + cnt)
        ci = torch.tensor(idx, dtype=torch.int32).view(-1, 2).to(device)
        return ci, torch.tensor(offsets, dtype=torch.int32).to(device), len(idx)

    return seqlens_derived(cu_host, ("chunks", C, str(device)), make)


def out_alloc(opts):
    """Allocator of the outputs indexed by token: zeros with ``use_graph`` (rows past the last
    sequence are never written and must read as zero), else uninitialised (every row is written)."""
    return torch.zeros if opts.graph else new_empty


def graph_seqlens(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``use_graph``: (the boundaries the kernels read [N+3] int64, whether ``cu_seqlens`` broke its
    contract, a 0-dim bool), on the device, without reading anything back. The values are made
    safe to index with: clamped to [0, T] and non-decreasing. Two entries follow, 0 and 1: a
    one-token sequence N+1 at the first row, whose chunk 1 (tokens C.. of a one-token sequence) is
    where the slots past the last real chunk point (chunk_tables_static): a chunk that starts past
    its sequence's end, whose programs return at once (every kernel on chunk_program)."""
    cu = cu_seqlens.to(torch.int64)
    safe = torch.cummax(cu.clamp(0, T), 0).values
    bad = (safe != cu).any() | (cu[0] != 0)
    return torch.cat([safe, torch.arange(2, device=safe.device)]), bad  # no host data: capturable


def chunk_tables_static(cu_ext: torch.Tensor, N: int, T: int, C: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``use_graph``: (chunk_indices [nt_max, 2] int32, chunk_offsets [N+1] int32, nt_max) built on
    the device from ``graph_seqlens``'s boundaries, their size fixed by the shapes alone
    (options.graph_chunk_slots). The slots past the last real chunk hold (N + 1, 1) (see
    graph_seqlens)."""
    nt_max = graph_chunk_slots(T, N, C)
    counts = (cu_ext[1:N + 1] - cu_ext[:N] + C - 1) // C
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    slot = torch.arange(nt_max, device=cu_ext.device)
    seq = torch.searchsorted(offsets[1:], slot, right=True)  # the sequence whose chunks hold the slot
    real = slot < offsets[-1]
    seq_c = seq.clamp(max=max(N - 1, 0))
    ci = torch.stack([torch.where(real, seq_c, N + 1), torch.where(real, slot - offsets[seq_c], 1)], 1)
    return ci.to(torch.int32), offsets.to(torch.int32), nt_max
