"""Every keyword option of the public operators, checked once and frozen.

``chunk_options`` / ``recurrent_options`` / ``gate_options`` turn the ~20 keyword arguments of a
call into a small frozen dataclass plus the tensors (:class:`KDAInputs`). Every rule of the API
(docs/api.md) lives here and raises ``ValueError`` / ``TypeError`` naming the argument and the bad
value before any work is done. Nothing below this module re-checks arguments.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import numbers
import threading
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .dtypes import FLOAT_DTYPES, INDEX_DTYPES
from .seqlens import host_values

MAX_K = 256


class GateMode(str, enum.Enum):
    PREGATED = "pregated"  # g already is the log-space decay
    SOFTPLUS = "softplus"  # g = -exp(A_log) * softplus(g + dt_bias)
    LOWER_BOUND = "lower_bound"  # g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))


@dataclass(frozen=True)
class KDAShape:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # number of sequences: B, or len(cu_seqlens) - 1


@dataclass(frozen=True)
class KDAOptions:
    shape: KDAShape
    scale: float
    qk_l2norm: bool
    gate: GateMode
    lower_bound: float | None
    safe_gate: bool
    beta_sigmoid: bool
    allow_neg_eigval: bool
    output_final_state: bool
    state_v_first: bool
    chunk_size: int = 64
    disable_recompute: bool = False
    return_intermediate_states: bool = False
    # use_graph with cu_seqlens: chunk tables built on the device in sizes fixed by the shapes, the
    # boundaries never read back (a CUDA graph replays with new ones); rows past cu_seqlens[-1] are zero
    graph: bool = False
    # decoding only
    pool: bool = False  # ssm_state_indices given: initial_state is a pool of slots
    spec_decode: bool = False  # 2-D ssm_state_indices + num_accepted_tokens
    inplace_final_state: bool = False
    raise_on_bad_index: bool = False  # read the device-side pool index check back and raise (one sync)

    @property
    def beta_scale(self) -> float:
        return 2.0 if self.allow_neg_eigval else 1.0

    @property
    def state_shape(self) -> tuple[int, int]:
        s = self.shape
        return (s.V, s.K) if self.state_v_first else (s.K, s.V)


class KDAInputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None  # host copy of cu_seqlens (int64)
    ssm_state_indices: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class GateOptions:
    gate: GateMode  # SOFTPLUS or LOWER_BOUND
    lower_bound: float | None
    output_dtype: torch.dtype
    chunk_size: int | None = None  # kda_gate_chunk_cumsum only
    scale: float | None = None  # kda_gate_chunk_cumsum only: multiplies the cumsum


# ----------------------------------------------------------------------------------------------
# small checks, each naming the argument and the value


def _fmt(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={list(x.shape)}, dtype={x.dtype}, device={x.device})"
    return repr(x)


def type_name(x: Any) -> str:
    """The type of ``x`` as an error names it: builtins plain, others with their module
    (``numpy.bool``, not a bare ``bool`` beside the ``bool`` it must be)."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _tensor(name: str, x: Any, *, optional: bool = False) -> torch.Tensor | None:
    if x is None and optional:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type_name(x)}: {x!r:.80}")
    return x


def bool_of(name: str, x: Any) -> bool:
    """``x``, which must be a bool (not a NumPy bool or an int)."""
    if not isinstance(x, bool):
        raise TypeError(f"`{name}` must be a bool, got {type_name(x)}: {x!r:.80}")
    return x


def _float_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"`{name}` must be bfloat16, float16, float32 or float64, got {x.dtype}")


def _same_device(ref: torch.Tensor, ref_name: str, **named: torch.Tensor | None) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"`{name}` is on {t.device} but `{ref_name}` is on {ref.device}; all tensors must share "
                             "one device")


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"`{name}` must have shape {what}={list(expected)}, got {list(x.shape)}")


def real_number(name: str, x: Any) -> float:
    """A real scalar as a float: int, float, NumPy's real scalars, a one-element real tensor (read
    with ``.item()``: one synchronisation for a device tensor), not one that requires grad while
    grad is enabled (its gradient would be lost). Not bool."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype == torch.bool or x.is_complex() or x.device.type == "meta":
            raise TypeError(f"`{name}` must be a real number or a one-element real tensor with a value, got {_fmt(x)}")
        if x.requires_grad and torch.is_grad_enabled():
            raise TypeError(f"`{name}` is read as a number, and a tensor that requires grad would lose its gradient; "
                            f"pass a number or a detached tensor, got {_fmt(x)} with requires_grad=True")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"`{name}` must be a real number or None, got {type_name(x)}: {x!r:.80}")
    return float(x)


_F32_MAX = torch.finfo(torch.float32).max  # the kernels take scale and lower_bound as float32


def _scale(scale: Any, K: int) -> float:
    if scale is None:
        return K**-0.5
    scale = real_number("scale", scale)
    if not (math.isfinite(scale) and abs(scale) <= _F32_MAX):
        raise ValueError(f"`scale` must be finite (|scale| <= {_F32_MAX:.4g}, float32's range), got {scale}")
    return scale


def lower_bound_of(lower_bound: Any) -> float | None:
    """``lower_bound`` as a float (None stays None), checked: finite, negative, within float32."""
    if lower_bound is None:
        return None
    lower_bound = real_number("lower_bound", lower_bound)
    if not (math.isfinite(lower_bound) and -_F32_MAX <= lower_bound < 0):
        raise ValueError(f"`lower_bound` must be a finite negative number (>= {-_F32_MAX:.4g}, float32's range), "
                         f"got {lower_bound}")
    return lower_bound


def chunk_size_of(chunk_size: Any) -> int:
    """``chunk_size`` of the chunked operator: 32 or 64 (an int, NumPy's included)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or int(chunk_size) not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64, got {chunk_size!r}")
    return int(chunk_size)


def _gate_params(
    use_gate_in_kernel: bool, A_log: Any, dt_bias: Any, lower_bound: float | None, HV: int, K: int, ref: torch.Tensor,
    ref_name: str = "q", flag: str | None = "use_gate_in_kernel",
) -> GateMode:
    """The gate mode; ``ref`` (named ``ref_name`` in errors) gives the device; ``flag``: the
    caller's argument that turned the gate on, named in errors (None: the call is the gate)."""
    if not use_gate_in_kernel:
        return GateMode.PREGATED
    A_log = _tensor("A_log", A_log, optional=True)
    dt_bias = _tensor("dt_bias", dt_bias, optional=True)
    if A_log is None and lower_bound is None:
        when = f"`{flag}=True` and " if flag else ""
        raise ValueError(f"`A_log` must be given when {when}`lower_bound` is None, got A_log=None")
    if A_log is not None:
        _float_dtype("A_log", A_log)
        # [HV], or with unit dimensions around it as some checkpoints store it ([1, 1, HV, 1])
        if [d for d in A_log.shape if d != 1] != ([HV] if HV != 1 else []):
            raise ValueError(f"`A_log` must have shape [HV]=[{HV}], got shape {list(A_log.shape)}")
    if dt_bias is not None:
        _float_dtype("dt_bias", dt_bias)
        if tuple(dt_bias.shape) not in ((HV * K,), (HV, K)):  # a [K, HV] bias would be read transposed
            raise ValueError(f"`dt_bias` must have shape [HV*K]=[{HV * K}] (or [HV, K]), got shape {list(dt_bias.shape)}")
    _same_device(ref, ref_name, A_log=A_log, dt_bias=dt_bias)
    return GateMode.SOFTPLUS if lower_bound is None else GateMode.LOWER_BOUND


def cu_seqlens_checked(cu_seqlens: Any, cu_seqlens_cpu: Any, B: int, T: int, ref: torch.Tensor,
                       check_values: bool | None, ref_name: str = "q"):
    """Checks cu_seqlens (and its host copy ``cu_seqlens_cpu``, if given) of ``B`` x ``T`` tokens on
    the device of ``ref`` (``ref_name`` in errors); returns (N, checked host copy or None).
    check_values: True reads the values on every call (a device-to-host copy unless
    ``cu_seqlens_cpu`` vouches for them) and checks them (:func:`fastkda.seqlens.host_values`),
    None only where no device read is needed (cu_seqlens on the CPU, or ``cu_seqlens_cpu`` given),
    False never (shapes, dtypes and devices only)."""
    cu = _tensor("cu_seqlens", cu_seqlens)
    if B != 1:
        raise ValueError(f"`cu_seqlens` needs the batch flattened to 1 (inputs [1, total_T, ...]), got batch size {B}")
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(f"`cu_seqlens` must be a 1-D tensor [N+1], got shape {list(cu.shape)}")
    if cu.dtype not in INDEX_DTYPES:
        raise ValueError(f"`cu_seqlens` must be int32 or int64, got {cu.dtype}")
    _same_device(ref, ref_name, cu_seqlens=cu)
    given = None
    if cu_seqlens_cpu is not None:
        given = _tensor("cu_seqlens_cpu", cu_seqlens_cpu)
        if given.device.type != "cpu" or given.shape != cu.shape or given.dtype not in INDEX_DTYPES:
            raise ValueError(f"`cu_seqlens_cpu` must be a CPU int tensor shaped like cu_seqlens {list(cu.shape)}, got {_fmt(given)}")
    if check_values is False or (check_values is None and cu.device.type != "cpu" and given is None):
        return cu.numel() - 1, None
    return cu.numel() - 1, host_values(cu, given, T)


def graph_chunk_slots(T: int, N: int, C: int) -> int:
    """``use_graph``: the chunk slots of a varlen call, fixed by the shapes alone: ceil(T / C) + N - 1,
    the most chunks any N sequences of at most T tokens in all can have (0 without tokens or sequences)."""
    return -(-T // C) + N - 1 if T > 0 and N > 0 else 0


def _core(q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_cpu, check_cu_values: bool):
    q = _tensor("q", q)
    k = _tensor("k", k)
    v = _tensor("v", v)
    g = _tensor("g", g)
    beta = _tensor("beta", beta)
    if q.ndim != 4:
        raise ValueError(f"`q` must be 4-D [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    _shape("k", k, (B, T, H, K), "[B, T, H, K]")
    if v.ndim != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"`v` must have shape [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(f"the value heads HV={HV} (v.shape[2]) must be a positive multiple of the q/k heads H={H} "
                         "(q.shape[2])")
    if K < 1 or K > MAX_K:
        raise ValueError(f"the key head dim K={K} must be in [1, {MAX_K}]")
    if V < 1:
        raise ValueError(f"the value head dim V={V} must be >= 1")
    _shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    _shape("beta", beta, (B, T, HV), "[B, T, HV]")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _float_dtype(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"`q`, `k`, `v` must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    _same_device(q, "q", k=k, v=v, g=g, beta=beta)
    scale = _scale(scale, K)
    N, cu_host = B, None
    if cu_seqlens is not None:
        N, cu_host = cu_seqlens_checked(cu_seqlens, cu_seqlens_cpu, B, T, q, check_cu_values)
    elif cu_seqlens_cpu is not None:
        raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
    return KDAShape(B, T, H, HV, K, V, N), scale, cu_host


# dtypes of the states the operators read: chunk_kda's float32; fused_recurrent_kda's (a serving
# engine's pool, cache dtype float32 or bfloat16) read into float32 arithmetic, written back rounded
STATE_DTYPES = {"chunk": (torch.float32,), "recurrent": (torch.float32, torch.bfloat16)}


def _state(name: str, h: torch.Tensor, lead: int | None, shape: KDAShape, state_v_first: bool, q: torch.Tensor,
           op: str):
    """A state tensor [lead, HV, K, V] (or [.., V, K]) of operator ``op`` ("chunk" or "recurrent");
    lead None accepts any slot count."""
    tail = (shape.HV, shape.V, shape.K) if state_v_first else (shape.HV, shape.K, shape.V)
    lead_name = "N" if lead is not None else "num_slots"
    layout = f"[{lead_name}, HV, V, K]" if state_v_first else f"[{lead_name}, HV, K, V]"
    if h.ndim != 4 or tuple(h.shape[1:]) != tail or (lead is not None and h.shape[0] != lead):
        exp = ", ".join(str(d) for d in (lead if lead is not None else lead_name, *tail))
        raise ValueError(f"`{name}` must have shape {layout}=[{exp}] (state_v_first={state_v_first}), got {list(h.shape)}")
    allowed = STATE_DTYPES[op]
    if h.dtype not in allowed and not (h.dtype == torch.float64 and q.dtype == torch.float64):
        what = ("float32" if len(allowed) == 1 else "float32 or bfloat16 (a bfloat16 pool is read into float32 "
                "arithmetic)")
        raise ValueError(f"`{name}` must be {what}, got {h.dtype}")
    _same_device(q, "q", **{name: h})


# fla.ops.kda's operators take and ignore any keyword; fastkda's take the other operator's keywords
# (an options dict shared by chunk_kda and fused_recurrent_kda) and fla's `head_first=False`, ignored
# where they mean nothing, refused where ignoring them would give wrong numbers, and warn once for any
# other keyword. name -> the values that mean nothing for the operator (None: any value).
_FOREIGN_KEYWORDS = {
    "chunk_kda": {"ssm_state_indices": (None,), "num_accepted_tokens": (None,), "inplace_final_state": (False,),
                  "raise_on_bad_index": None, "head_first": (False,)},
    "fused_recurrent_kda": {"safe_gate": None, "disable_recompute": None, "return_intermediate_states": (False,),
                            "cu_seqlens_cpu": None, "cp_context": (None,), "use_graph": None, "max_num_seqs": None,
                            "chunk_size": None, "head_first": (False,)},
}
_WARNED_KEYWORDS: set = set()
_WARNED_LOCK = threading.Lock()


def foreign_keywords(op: str, kwargs: dict) -> None:
    """Check the keywords of a call to ``op`` beyond its own parameters: the other operator's and
    fla's known ones pass where they mean nothing (a ``ValueError`` names one that would change the
    result), unknown ones are ignored with a warning, once per operator and name."""
    known = _FOREIGN_KEYWORDS[op]
    unknown = []
    for name, value in kwargs.items():
        if name not in known:
            unknown.append(name)
            continue
        neutral = known[name]
        if neutral is not None and not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            if name == "head_first":
                raise ValueError("`head_first=True` (the [B, H, T, K] layout) is not supported: pass [B, T, H, K] "
                                 f"tensors, got head_first={value!r}")
            raise ValueError(f"`{name}` is an argument of the other operator, not of {op}: got {name}={_fmt(value)}")
    with _WARNED_LOCK:
        new = [n for n in unknown if (op, n) not in _WARNED_KEYWORDS]
        _WARNED_KEYWORDS.update((op, n) for n in new)
    if new:
        warnings.warn(f"fastkda.{op}: ignoring unknown keyword arguments {sorted(new)}", stacklevel=3)


def state_layout(state_v_first, transpose_state_layout):
    """state_v_first, or fla-core's former name for it, ``transpose_state_layout`` (deprecated; the
    warning names the caller of the public operator)."""
    if transpose_state_layout is None:
        return state_v_first
    bool_of("transpose_state_layout", transpose_state_layout)
    if state_v_first:
        raise ValueError("pass `state_v_first` or the deprecated `transpose_state_layout`, not both")
    warnings.warn("`transpose_state_layout` is deprecated: it is `state_v_first`", DeprecationWarning, stacklevel=3)
    return transpose_state_layout


_AUTOCAST_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_qkv(q, k, v):
    """Under torch.autocast, q/k/v take the autocast dtype (like a matmul's operands); the op
    itself then runs with autocast off. Returns (q, k, v, context)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v, contextlib.nullcontext()
    dev = q.device.type
    try:
        enabled = torch.is_autocast_enabled(dev)
    except (TypeError, RuntimeError):  # device types without autocast
        enabled = False
    if not enabled:
        return q, k, v, contextlib.nullcontext()
    dt = torch.get_autocast_dtype(dev)
    q, k, v = (t.to(dt) if t.dtype in _AUTOCAST_CASTABLE else t for t in (q, k, v))
    return q, k, v, torch.autocast(dev, enabled=False)


@functools.lru_cache(maxsize=256)
def _overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether two elements of a tensor of this shape and stride share an address (dims ordered by
    stride, each stride must pass the extent of the smaller ones); cached: a decode step's pool
    comes back with the same layout every call."""
    dims = sorted((st, n) for n, st in zip(shape, stride) if n != 1)
    if any(n == 0 for _, n in dims):
        return False
    extent = 0
    for st, n in dims:
        if st <= extent:
            return True
        extent += st * (n - 1)
    return False


def check_writable(name: str, t: torch.Tensor) -> None:
    """ValueError unless the elements of ``t`` lie at distinct addresses, as a tensor written in
    place must."""
    if _overlapping(tuple(t.shape), t.stride()):
        raise ValueError(
            f"`{name}` is written in place (inplace_final_state=True) but elements of it overlap in memory "
            f"(shape {list(t.shape)}, stride {tuple(t.stride())}: an expanded or self-overlapping view); "
            f"pass a tensor that owns its elements (e.g. `{name}.clone()`)")


def _activation_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, use_gate_in_kernel=False):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` needs `use_beta_sigmoid_in_kernel=True` (beta becomes 2*sigmoid(beta)), got use_beta_sigmoid_in_kernel=False")
    if safe_gate:
        # a pre-gated g without lower_bound: the caller vouches that g lies in [-5, 0] (as fla-core)
        if lower_bound is None and use_gate_in_kernel:
            raise ValueError("`lower_bound` must be given, in [-5, 0), when `safe_gate=True` and `use_gate_in_kernel=True`, "
                             "got lower_bound=None")
        if lower_bound is not None and not (-5.0 <= lower_bound < 0.0):
            raise ValueError(f"`safe_gate=True` needs `lower_bound` in [-5, 0), got lower_bound={lower_bound}")


# ----------------------------------------------------------------------------------------------
# the three entry points


def chunk_options(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
    return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context, A_log, dt_bias, chunk_size,
    use_graph: bool = False, max_num_seqs: int | None = None, check_values: bool = True,
) -> tuple[KDAOptions, KDAInputs]:
    flags = dict(
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states, state_v_first=state_v_first, use_graph=use_graph,
    )
    for name, val in flags.items():
        bool_of(name, val)
    if max_num_seqs is not None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, numbers.Integral) or max_num_seqs < 0:
            raise ValueError(f"`max_num_seqs` must be None or a non-negative int, got {max_num_seqs!r}")
        max_num_seqs = int(max_num_seqs)
    chunk_size = chunk_size_of(chunk_size)
    if cp_context is not None:
        from .distributed.cp import CPContext

        if initial_state is not None:
            raise ValueError("`initial_state` cannot be used with `cp_context` (each rank's incoming state comes from the ranks before it)")
        if output_final_state:
            raise ValueError("`output_final_state=True` cannot be used with `cp_context`")
        if not isinstance(cp_context, CPContext):
            raise TypeError(f"`cp_context` must be a fastkda.distributed.CPContext, got {type(cp_context).__name__}")
        if cu_seqlens is not None:
            raise ValueError("with `cp_context`, pass the global `cu_seqlens` to the CPContext, not to chunk_kda")
        if return_intermediate_states:
            raise ValueError("`return_intermediate_states=True` cannot be used with `cp_context`")
        if use_graph:
            raise ValueError("`use_graph=True` cannot be used with `cp_context` (its ranks' boundaries are read on the host)")
        if not (isinstance(q, torch.Tensor) and q.ndim == 4 and q.shape[0] == 1 and q.shape[1] == cp_context.T_local):
            got = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"with `cp_context`, `q` must be this rank's shard [1, {cp_context.T_local}, H, K], got {got}")
    graph = use_graph and cu_seqlens is not None  # a dense batch needs no tables: use_graph changes nothing
    # with use_graph the boundaries change between replays: never read, and a host copy (checked as
    # one) is not used
    shape, scale, cu_host = _core(q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_cpu,
                                  check_cu_values=False if graph else check_values)
    if graph and max_num_seqs is not None and max_num_seqs != shape.N:
        raise ValueError(f"with `use_graph`, `cu_seqlens` must hold max_num_seqs + 1 = {max_num_seqs + 1} entries "
                         f"(pad it with empty sequences), got {shape.N + 1}")
    lower_bound = lower_bound_of(lower_bound)
    _activation_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, use_gate_in_kernel)
    gate = _gate_params(use_gate_in_kernel, A_log, dt_bias, lower_bound, shape.HV, shape.K, q)
    if initial_state is not None:
        _state("initial_state", _tensor("initial_state", initial_state), shape.N, shape, state_v_first, q, "chunk")
    if return_intermediate_states and not torch.is_inference_mode_enabled():
        raise ValueError("`return_intermediate_states=True` is for inference only: call it inside torch.inference_mode()")
    opts = KDAOptions(
        shape=shape, scale=scale, qk_l2norm=use_qk_l2norm_in_kernel, gate=gate,
        lower_bound=lower_bound, safe_gate=safe_gate, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, output_final_state=output_final_state, state_v_first=state_v_first,
        chunk_size=chunk_size, disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states, graph=graph,
    )
    inputs = KDAInputs(
        q, k, v, g, beta,
        A_log if gate is not GateMode.PREGATED else None,
        dt_bias if gate is not GateMode.PREGATED else None,
        initial_state, cu_seqlens, cu_host,
    )
    return opts, inputs


# Decoding calls repeat one layout step after step: the options of a checked call, by what its
# checks read (tensor shapes, dtypes, devices; the state's strides and whether it requires grad;
# the flags, scalars and check_values), so that a repeat skips them.
_RECURRENT_SEEN: dict = {}
_RECURRENT_SEEN_MAX = 256


def _recurrent_key(tensors: tuple, flags: tuple, scalars: tuple, cu_seqlens, initial_state,
                   check_values) -> tuple | None:
    """What the checks of a recurrent call read, or None when they read more (a value: a CPU
    cu_seqlens, a tensor scale) or raise on a type, which the full path then reports. Plain loops:
    a decode step pays for this on every call."""
    for f in flags:
        if f is not True and f is not False:
            return None
    for x in scalars:
        if x is not None and type(x) is not float and type(x) is not int:
            return None
    if cu_seqlens is not None and (type(cu_seqlens) is not torch.Tensor or cu_seqlens.device.type == "cpu"):
        return None
    key = [flags, scalars, check_values]
    for t in tensors:  # (shape, dtype, device) of each tensor; None for an absent one
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key += (t.shape, t.dtype, t.device)
        else:
            return None
    if initial_state is not None:  # (a tensor, one of `tensors`) its strides: whether a pool's elements overlap
        key += (initial_state.stride(), initial_state.requires_grad and torch.is_grad_enabled())
    return tuple(key)


def recurrent_options(
    q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
    ssm_state_indices, num_accepted_tokens, inplace_final_state, raise_on_bad_index: bool = False,
    check_values: bool = True,
) -> tuple[KDAOptions, KDAInputs]:
    key = _recurrent_key(
        (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens),
        (output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
         state_v_first, inplace_final_state, raise_on_bad_index), (scale, lower_bound), cu_seqlens, initial_state,
        check_values)
    opts = _RECURRENT_SEEN.get(key) if key is not None else None
    cu_host = None  # keyed calls have no host copy of cu_seqlens
    if opts is None:
        opts, cu_host = _recurrent_checked(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
            inplace_final_state=inplace_final_state, raise_on_bad_index=raise_on_bad_index, check_values=check_values)
        if key is not None:
            if len(_RECURRENT_SEEN) >= _RECURRENT_SEEN_MAX:
                _RECURRENT_SEEN.clear()
            _RECURRENT_SEEN[key] = opts
    pregated = opts.gate is GateMode.PREGATED
    inputs = KDAInputs(q, k, v, g, beta, None if pregated else A_log, None if pregated else dt_bias, initial_state,
                       cu_seqlens, cu_host, ssm_state_indices, num_accepted_tokens)
    return opts, inputs


def _recurrent_checked(
    q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
    ssm_state_indices, num_accepted_tokens, inplace_final_state, raise_on_bad_index, check_values,
) -> tuple[KDAOptions, torch.Tensor | None]:
    """(the options of a recurrent call after every check, the host copy of cu_seqlens)."""
    flags = dict(
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, inplace_final_state=inplace_final_state,
        raise_on_bad_index=raise_on_bad_index,
    )
    for name, val in flags.items():
        bool_of(name, val)
    # decoding must not synchronise with the host: cu_seqlens values on the device are the kernels' to check
    shape, scale, cu_host = _core(q, k, v, g, beta, scale, cu_seqlens, None, check_cu_values=None if check_values else False)
    if cu_seqlens is not None and shape.N == 0 and shape.T > 0:  # no sequence to check them on the device
        raise ValueError(f"`cu_seqlens` of no sequences ([0]) needs T = 0 tokens, got T={shape.T}")
    lower_bound = lower_bound_of(lower_bound)
    _activation_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound)
    gate = _gate_params(use_gate_in_kernel, A_log, dt_bias, lower_bound, shape.HV, shape.K, q)
    idx = _tensor("ssm_state_indices", ssm_state_indices, optional=True)
    acc = _tensor("num_accepted_tokens", num_accepted_tokens, optional=True)
    if idx is not None:
        if initial_state is None:
            raise ValueError("`ssm_state_indices` selects slots of a state pool passed as `initial_state`, got initial_state=None")
        if idx.dtype not in INDEX_DTYPES:
            raise ValueError(f"`ssm_state_indices` must be int32 or int64, got {idx.dtype}")
        if idx.ndim not in (1, 2) or idx.shape[0] != shape.N or (idx.ndim == 2 and idx.shape[1] < 1):
            raise ValueError(f"`ssm_state_indices` must have shape [N] or [N, 1 + num_draft] with N={shape.N} sequences, got {list(idx.shape)}")
        if idx.ndim == 2 and cu_seqlens is None and shape.T > idx.shape[1]:
            raise ValueError(f"`ssm_state_indices` has {idx.shape[1]} slots per sequence but each sequence has T={shape.T} tokens")
        _same_device(q, "q", ssm_state_indices=idx)
    if acc is not None:
        if idx is None or idx.ndim != 2:
            raise ValueError("`num_accepted_tokens` needs 2-D `ssm_state_indices` [N, 1 + num_draft] (speculative "
                             f"decoding), got ssm_state_indices={_fmt(idx)}")
        if acc.dtype not in INDEX_DTYPES or tuple(acc.shape) != (shape.N,):
            raise ValueError(f"`num_accepted_tokens` must be an int32/int64 tensor of shape [N]=[{shape.N}], got {_fmt(acc)}")
        _same_device(q, "q", num_accepted_tokens=acc)
    if idx is not None and idx.ndim == 2 and acc is None:
        raise ValueError("2-D `ssm_state_indices` (speculative decoding) needs `num_accepted_tokens` [N], got None")
    if initial_state is not None:
        h0 = _tensor("initial_state", initial_state)
        _state("initial_state", h0, None if idx is not None else shape.N, shape, state_v_first, q, "recurrent")
        if inplace_final_state and (h0.requires_grad and torch.is_grad_enabled()):
            raise ValueError("`inplace_final_state=True` writes into `initial_state`, which requires grad; detach it or disable grad")
        if inplace_final_state and check_values:  # (a compiled call checks when its op runs eagerly)
            check_writable("initial_state", h0)
    if inplace_final_state and initial_state is None:
        raise ValueError("`inplace_final_state=True` writes into `initial_state`, got initial_state=None")
    opts = KDAOptions(
        shape=shape, scale=scale, qk_l2norm=use_qk_l2norm_in_kernel, gate=gate,
        lower_bound=lower_bound, safe_gate=False, beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, output_final_state=output_final_state, state_v_first=state_v_first,
        pool=idx is not None, spec_decode=acc is not None, inplace_final_state=inplace_final_state,
        raise_on_bad_index=raise_on_bad_index,
    )
    return opts, cu_host


def gate_options(
    g, A_log, dt_bias, lower_bound, output_dtype, *, chunk_size=None, scale=None, cu_seqlens=None, need_time_axis=False
) -> tuple[GateOptions, torch.Tensor | None]:
    """(the options of a gate call, the checked host copy of cu_seqlens or None)."""
    g = _tensor("g", g)
    _float_dtype("g", g)
    if g.ndim < 2:
        raise ValueError(f"`g` must be [..., H, K], got shape {list(g.shape)}")
    if need_time_axis and g.ndim != 4:
        raise ValueError(f"`g` must be [B, T, H, K], got shape {list(g.shape)}")
    if not isinstance(output_dtype, torch.dtype) or output_dtype not in FLOAT_DTYPES:
        raise ValueError(f"`output_dtype` must be a floating torch.dtype, got {output_dtype!r}")
    H, K = g.shape[-2:]
    lower_bound = lower_bound_of(lower_bound)
    mode = _gate_params(True, A_log, dt_bias, lower_bound, H, K, g, "g", None)
    cu_host = None
    if chunk_size is not None or need_time_axis:  # kda_gate_chunk_cumsum: a chunk size, None included
        if (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1
                or chunk_size & (chunk_size - 1)):
            raise ValueError(f"`chunk_size` must be a positive power of two, got {chunk_size!r}")
        chunk_size = int(chunk_size)
        if scale is not None:
            scale = _scale(scale, K)
        if cu_seqlens is not None:
            _, cu_host = cu_seqlens_checked(cu_seqlens, None, g.shape[0], g.shape[1], g, True, "g")
    return GateOptions(mode, lower_bound, output_dtype, chunk_size, scale), cu_host
