"""Helpers shared by the test suite and ``fastkda check``: random cases over the option space,
the float64 reference, relative RMS errors and NaN poisoning of freshly allocated outputs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .alloc import new_empty, poisoned
from .naive import naive_chunk_kda, naive_recurrent_kda

__all__ = [
    "Case", "AXES", "grow", "make_inputs", "reference", "rel_rms", "poisoned", "new_empty", "TOLERANCE", "tolerance",
    "gate_param_scales", "param_error", "gate_slope", "gate_input_error",
]

# poisoning: kernels allocate their outputs through fastkda.alloc.new_empty; under poisoned() those
# start as NaN (integers as -1), so any element a kernel forgets to write fails the comparison.


# ----------------------------------------------------------------------------------------------
# errors


def rel_rms(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """||actual - ref|| / ||ref|| in float64; inf if anything is not finite or shapes differ."""
    if actual.shape != ref.shape:
        return math.inf
    a, r = actual.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    den = r.norm().item()
    num = (a - r).norm().item()
    return num / den if den > 0 else num


# relative RMS limits per input dtype. The PyTorch backend computes in float32 (float64 for float64
# inputs); only the output is rounded to the input dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
# The Triton kernels also keep their intermediates (w, u, q e^G, k e^(G_last - G), Aqk) and the
# operands of the state products in the input dtype, as tensor-core kernels do: about 1% for
# bfloat16 on the GPU. The interpreter truncates float32 -> bfloat16 instead of rounding to
# nearest, which roughly doubles that on the CPU tier.
TRITON_TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def tolerance(dtype: torch.dtype, backend: str = "torch") -> float:
    """The relative RMS limit of ``backend`` for inputs of ``dtype``."""
    if backend != "triton":
        return TOLERANCE[dtype]
    from .platform import triton_interpret

    tol = TRITON_TOLERANCE[dtype]
    return tol * 2 if dtype == torch.bfloat16 and triton_interpret() else tol


# ----------------------------------------------------------------------------------------------
# cases

GATES = ("pregated", "pregated_safe", "softplus", "lowerbound", "lowerbound_noA", "safe")


@dataclass(frozen=True)
class Case:
    """One point of the option space (the axes of AXES)."""

    B: int = 1
    T: int = 100
    H: int = 2
    HV: int = 2
    K: int = 32
    V: int = 32
    dtype: torch.dtype = torch.float32
    seqlens: tuple[int, ...] | None = None  # varlen when set (B must be 1, T = sum)
    gate: str = "pregated"
    lower_bound: float = -5.0
    beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    l2norm: bool = False
    initial_state: bool = True
    final_state: bool = True
    state_v_first: bool = False
    chunk_size: int = 64
    scale: float | None = None
    gate_spread: float = 2.0  # std of the raw gate input (extremes: ~30)
    A_log_range: tuple[float, float] = (-1.0, 1.0)
    dt_bias: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        assert self.gate in GATES, self.gate
        if self.seqlens is not None:
            object.__setattr__(self, "T", sum(self.seqlens))
            object.__setattr__(self, "B", 1)

    @property
    def N(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        base = Case()
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if f.compare and getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(parts) or "default"


# ----------------------------------------------------------------------------------------------
# the option axes, as cases; each toggles one or two axes off the default

AXES = {
    "dense": Case(T=100),
    "varlen": Case(seqlens=(1, 64, 0, 63, 65, 7)),
    "gva": Case(T=80, H=2, HV=6),  # two q/k heads: a wrong head mapping shows (with one it cannot)
    "k_ne_v": Case(T=80, K=32, V=48),
    "k64_v16": Case(T=70, K=64, V=16, H=1, HV=1),
    "pregated_safe": Case(T=100, gate="pregated_safe"),
    "softplus": Case(T=100, gate="softplus"),
    "lowerbound": Case(T=100, gate="lowerbound", lower_bound=-2.0),
    "lowerbound_noA": Case(T=100, gate="lowerbound_noA"),
    "safe_lb-5": Case(T=100, gate="safe", lower_bound=-5.0),
    "safe_lb-0.1": Case(T=100, gate="safe", lower_bound=-0.1),
    "safe_no_dt_bias": Case(T=70, gate="safe", dt_bias=False),
    "beta_sigmoid": Case(T=80, beta_sigmoid=True),
    "neg_eigval": Case(T=80, beta_sigmoid=True, allow_neg_eigval=True),
    "l2norm": Case(T=80, l2norm=True),
    "no_states": Case(T=80, initial_state=False, final_state=False),
    "final_only": Case(T=80, initial_state=False),
    "state_v_first": Case(T=80, state_v_first=True),
    "chunk32": Case(T=100, chunk_size=32),
    "chunk32_varlen_safe": Case(seqlens=(33, 31, 1, 64), chunk_size=32, gate="safe"),
    "scale": Case(T=50, scale=0.7),
    "bf16": Case(T=100, dtype=torch.bfloat16, gate="safe", l2norm=True),
    "fp16": Case(T=100, dtype=torch.float16, gate="softplus", l2norm=True),
    "extreme_softplus": Case(T=100, gate="softplus", gate_spread=30.0, A_log_range=(-5.0, 5.0)),
    "extreme_lowerbound": Case(T=100, gate="lowerbound", lower_bound=-20.0, gate_spread=30.0, A_log_range=(-5.0, 5.0)),
    "extreme_safe": Case(T=100, gate="safe", lower_bound=-5.0, gate_spread=30.0, A_log_range=(-5.0, 5.0)),
    "deep_decay": Case(T=600, H=1, HV=1, gate="safe", lower_bound=-5.0, gate_spread=0.5, A_log_range=(3.0, 5.0)),
    "t_short": Case(T=1),
    "t_chunk_plus_one": Case(T=65),
}


def grow(case, gpu: bool):
    """GPU tier: the same axis at a real shape."""
    if not gpu:
        return case
    big = dict(K=128, V=128 if case.V == case.K else 64, H=case.H * 2, HV=case.HV * 2)
    if case.seqlens is not None:
        return case.replace(seqlens=tuple(s * 16 for s in case.seqlens), **big)
    return case.replace(T=max(case.T * 16, 2), B=2, **big)


def make_inputs(case: Case, device="cpu", requires_grad: bool = False, generator: torch.Generator | None = None):
    """Fresh random keyword arguments of ``chunk_kda`` / ``fused_recurrent_kda`` for ``case``."""
    c = case

    gen_device = "cpu" if generator is not None else device  # without a generator, draw where the data lives

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device=gen_device) * scale

    q = rnd(c.B, c.T, c.H, c.K)
    k = rnd(c.B, c.T, c.H, c.K)
    if not c.l2norm:  # the delta rule wants |k| ~ 1; the kernel normalises when asked
        k = F.normalize(k, dim=-1)
    v = rnd(c.B, c.T, c.HV, c.V)
    raw = rnd(c.B, c.T, c.HV, c.K, scale=c.gate_spread)
    kw: dict = {}
    if c.gate == "pregated":
        g = F.logsigmoid(raw)
    elif c.gate == "pregated_safe":
        g = c.lower_bound * torch.sigmoid(raw)
        kw.update(safe_gate=True, lower_bound=c.lower_bound)
    else:
        g = raw
        lo, hi = c.A_log_range
        A_log = torch.rand(c.HV, generator=generator, device=gen_device) * (hi - lo) + lo
        kw.update(use_gate_in_kernel=True, A_log=None if c.gate == "lowerbound_noA" else A_log)
        if c.dt_bias:
            kw["dt_bias"] = rnd(c.HV * c.K)
        if c.gate in ("lowerbound", "lowerbound_noA", "safe"):
            kw["lower_bound"] = c.lower_bound
        if c.gate == "safe":
            kw["safe_gate"] = True
    if c.beta_sigmoid:
        beta = rnd(c.B, c.T, c.HV)
        kw["use_beta_sigmoid_in_kernel"] = True
        kw["allow_neg_eigval"] = c.allow_neg_eigval
    else:
        beta = torch.rand(c.B, c.T, c.HV, generator=generator, device=gen_device)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta)
    tensors = {n: t.to(c.dtype if n in ("q", "k", "v") else (torch.float64 if c.dtype == torch.float64 else torch.float32))
               for n, t in tensors.items()}
    if c.dtype in (torch.bfloat16, torch.float16):  # gates and beta often arrive in the model dtype too
        tensors["beta"] = tensors["beta"].to(c.dtype)
    if c.initial_state:
        shape = (c.N, c.HV, c.V, c.K) if c.state_v_first else (c.N, c.HV, c.K, c.V)
        kw["initial_state"] = rnd(*shape, scale=0.5).to(torch.float64 if c.dtype == torch.float64 else torch.float32)
    if c.seqlens is not None:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(c.seqlens).cumsum(0).tolist()], dtype=torch.int32)
    kw.update(output_final_state=c.final_state, state_v_first=c.state_v_first, use_qk_l2norm_in_kernel=c.l2norm)
    if c.scale is not None:
        kw["scale"] = c.scale
    for key in ("A_log", "dt_bias"):
        if kw.get(key) is not None and c.dtype == torch.float64:
            kw[key] = kw[key].double()
    out = {**tensors, **kw}
    for name, t in out.items():
        if isinstance(t, torch.Tensor):
            t = t.to(device)
            if requires_grad and t.is_floating_point() and name != "cu_seqlens":
                t.requires_grad_(True)
            out[name] = t
    return out


_REF_KEYS = (
    "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log",
    "dt_bias", "lower_bound", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens",
)


def reference(inputs: dict, chunked: bool | None = None, chunk_size: int = 64, **extra):
    """The float64 reference for the keyword arguments of a call (``make_inputs`` output): the
    per-token recurrence, or (``chunked``) the chunked form, which the CPU tier checks against the
    per-token one to 1e-10 on every option. By default the per-token one on the CPU and the chunked
    one for GPU tensors, whose real shapes make a per-token loop (under autograd, too) slow."""
    if chunked is None:
        chunked = inputs["q"].is_cuda and not extra
    kw = {k: inputs[k] for k in _REF_KEYS if k in inputs}
    if kw.get("initial_state") is not None:
        kw["initial_state"] = kw["initial_state"].double()
    if kw.get("lower_bound") is not None and not kw.get("use_gate_in_kernel", False):
        kw.pop("lower_bound")  # pre-gated: lower_bound only states a promise
    args = [inputs[n].double() for n in ("q", "k", "v", "g", "beta")]
    for key in ("A_log", "dt_bias"):
        if kw.get(key) is not None:
            kw[key] = kw[key].double()
    if chunked:
        return naive_chunk_kda(*args, chunk_size=chunk_size, **kw, **extra)
    return naive_recurrent_kda(*args, **kw, **extra)


def gate_param_scales(x: dict, dg_raw, slope=None):
    """Sum of the error scales of every token's and channel's contribution to dA_log [HV] and
    ddt_bias [HV*K], from the float64 gradient of the raw gate input. These gradients are sums over
    all tokens whose terms largely cancel, so their honest error measure is relative to the sum of
    the magnitudes of the terms (each term carries its own rounding), not to the (small) result.
    A term is slope * dgate (times a factor of A_log's chain rule), and a kernel's rounding of dgate
    is of the size of dgate's typical magnitude D in that head (the RMS of ref / slope where
    |slope| > 2^-100, as in gate_input_error), not of the value at that token, which may be a small
    remainder of cancelling terms: the magnitude of a term is taken as |slope| D (|dg_raw| where
    |slope| <= SLOPE_FLOOR). ``slope``: gate_slope(x), if the caller has it."""
    if not x.get("use_gate_in_kernel") or dg_raw is None:
        return {}
    g = x["g"].detach().double()
    HV, K = g.shape[-2:]
    xg = g + (x["dt_bias"].detach().double().view(HV, K) if x.get("dt_bias") is not None else 0)
    slope = gate_slope(x) if slope is None else slope
    live, dgate = _dgate(dg_raw, slope)
    red = tuple(range(slope.dim() - 2))
    D = ((dgate**2).sum(red).sum(-1) / live.sum(red).sum(-1).clamp_min(1)).sqrt()  # per head   [HV]
    # the error scale of every term of dg; a term whose slope is at or below the floor has no dgate
    # to speak of: its own magnitude (the reference's term, dg_raw itself) stands in
    dx = torch.where(live, slope.abs() * D[:, None], dg_raw.detach().double().abs())
    out = {"dt_bias": dx.sum(red).reshape(-1)}
    if x.get("lower_bound") is not None:  # dA_log = sum dx * x
        out["A_log"] = (dx * xg.abs()).sum(red).sum(-1)
    else:  # softplus: dA_log = sum dg * y = sum dx * softplus(x) / sigmoid(x)
        ratio = torch.nn.functional.softplus(xg) / torch.sigmoid(xg)
        out["A_log"] = (dx * ratio).sum(red).sum(-1)
    return out


def param_error(got, ref, scale) -> float:
    """Norm of the error of a gate-parameter gradient over the norm of its term magnitudes."""
    return ((got.double() - ref.double()).norm() / scale.norm().clamp_min(1e-300)).item()


SLOPE_FLOOR = 2.0**-100  # slopes at or below it count as negligible (a margin above float32's 2^-126)


def _dgate(dg_raw, slope):
    """(mask of the elements with |slope| > SLOPE_FLOOR, dg_raw / slope there and 0 elsewhere), float64."""
    live = slope.abs() > SLOPE_FLOOR
    return live, torch.where(live, dg_raw.detach().double() / torch.where(live, slope, 1.0), 0.0)


def gate_slope(x: dict):
    """The float64 derivative of the in-kernel gate activation with respect to its raw input g,
    elementwise ([..., HV, K]); None when the gate is not activated in the kernel."""
    if not x.get("use_gate_in_kernel"):
        return None
    from .naive import naive_kda_gate, naive_kda_lowerbound_gate

    g = x["g"].detach().double().requires_grad_(True)
    A_log, dt_bias = (None if x.get(n) is None else x[n].detach().double() for n in ("A_log", "dt_bias"))
    with torch.enable_grad():
        if x.get("lower_bound") is None:
            act = naive_kda_gate(g, A_log, dt_bias, torch.float64)
        else:
            act = naive_kda_lowerbound_gate(g, A_log, dt_bias, x["lower_bound"], torch.float64)
        (slope,) = torch.autograd.grad(act.sum(), g)  # elementwise: the gradient of the sum is the slope
    return slope


def gate_input_error(got, ref, slope) -> float:
    """Error of the gradient of the raw gate input g, judged as the error of the gradient of the
    activated gate that it carries (dg = slope * dgate, elementwise): RMS((got - ref) / slope) over
    RMS(ref / slope), on the elements with |slope| > 2^-100 (far above float32's smallest normal
    2^-126: a margin for a kernel's rounding of a tiny slope). Elsewhere dg is below 2^-100 |dgate|,
    and an error there above 2^-90 RMS(dgate), or one not finite, counts as infinite. With
    exp(A_log) spanning decades, the slopes weight a few elements so heavily that the relative RMS
    of dg becomes the relative error of those few, which is ill-conditioned wherever the terms of
    their dgate cancel; in units of dgate every element counts alike, and a wrong slope still shows
    as an error of the size of dgate."""
    got, ref, slope = got.double(), ref.double(), slope.double()
    if not torch.isfinite(got).all():
        return float("inf")
    live, dgate = _dgate(ref, slope)
    if not live.any():
        return 0.0 if (got - ref).abs().max() <= 2.0**-90 else float("inf")
    dgate = dgate[live]
    d_rms = dgate.norm().item() / dgate.numel() ** 0.5
    if (~live).any() and (got - ref)[~live].abs().max().item() > 2.0**-90 * d_rms:
        return float("inf")
    return ((got[live] - ref[live]) / slope[live]).norm().item() / dgate.norm().clamp_min(1e-300).item()
