"""Assertions shared by the tests."""

import math

import torch
from hypothesis import strategies as st

from fastkda.testing import (AXES, GATES, Case, gate_input_error, gate_param_scales, gate_slope, grow,  # noqa: F401
                             param_error, rel_rms, tolerance)

# the inputs of chunk_kda that take gradients, in the order the tests list them
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

# the option space (fastkda.testing.AXES) as hypothesis strategies (feature sizes chosen per test)
OPTION_SPACE = dict(
    gate=st.sampled_from(GATES),
    varlen=st.booleans(),
    gva=st.booleans(),
    beta_mode=st.sampled_from(["plain", "sigmoid", "neg"]),
    l2=st.booleans(),
    vfirst=st.booleans(),
    chunk=st.sampled_from([32, 64]),
    state=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)


def random_case(rng, max_len, gate, varlen, gva, beta_mode, l2, vfirst, chunk, state, dims, dtype) -> Case:
    """A Case at one point of OPTION_SPACE, with random lengths below max_len."""
    lens = tuple(int(t) for t in torch.randint(0, max_len, (3,), generator=rng)) if varlen else None
    return Case(
        T=int(torch.randint(1, max_len, (1,), generator=rng)), seqlens=lens, gate=gate, H=2 if gva else 1, HV=4 if gva else 1,
        K=dims[0], V=dims[1], beta_sigmoid=beta_mode != "plain", allow_neg_eigval=beta_mode == "neg", l2norm=l2,
        state_v_first=vfirst, chunk_size=chunk, initial_state=state, final_state=True, dtype=dtype,
    )


def check(name: str, actual, ref, tol: float):
    assert actual is not None, f"{name}: missing"
    err = rel_rms(actual, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3g} > {tol:.3g}"
    return err


def check_grads(got: dict, want: dict, x: dict, tol: float):
    """Every gradient against the reference: relative RMS; for dA_log / ddt_bias the error relative
    to the magnitude of their terms (gate_param_scales, param_error); for the raw gate input of an
    in-kernel activation the error in units of the activated gate's gradient (gate_input_error)."""
    slope = gate_slope(x)
    scales = gate_param_scales(x, want.get("g"), slope)
    for name, ref in want.items():
        if ref is None:  # the input plays no part (e.g. lower_bound only)
            assert got[name] is None or not got[name].any(), name
            continue
        assert got[name] is not None, f"d{name} missing"
        if name in scales:
            err = param_error(got[name], ref, scales[name])
            assert err <= tol, f"d{name}: error {err:.3g} of the summed term magnitudes > {tol:.3g}"
        elif name == "g" and slope is not None:
            err = gate_input_error(got[name], ref, slope)
            assert err <= tol, f"dg: error {err:.3g} in units of the activated gate's gradient > {tol:.3g}"
        else:
            check(f"d{name}", got[name], ref, tol)


def plain_options(x: dict, **changes):
    """(options, inputs) of chunk_kda on x's q, k, v, g, beta (and initial_state, if any) with every
    other option at its plain value (pre-gated, no final state, dense, chunk 64) or as ``changes``
    give it."""
    from fastkda.options import chunk_options

    kw = dict(scale=None, initial_state=x.get("initial_state"), output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, A_log=None, dt_bias=None, chunk_size=64)
    return chunk_options(*(x[k] for k in ("q", "k", "v", "g", "beta")), **{**kw, **changes})


def bounded(case):
    """The case with a bounded gate (safe_gate=True), the rest of its axes kept."""
    gate = "pregated_safe" if case.gate in ("pregated", "pregated_safe") else "safe"
    return case.replace(gate=gate, lower_bound=max(case.lower_bound, -5.0))


def launched(log: list, *names: str, grids: bool = False, options: tuple[str, ...] = ()) -> list:
    """The entries of a ``recorded_launches`` log for the kernels ``names``: each kernel's name (with
    ``grids``, its grid); with ``options`` (launch keywords such as "num_stages") each entry is (name
    or grid, {keyword: value})."""
    out = []
    for e in log:
        if e.name in names:
            entry = e.grid if grids else e.name
            out.append((entry, {o: e.options.get(o) for o in options}) if options else entry)
    return out


def stage1_of(log: list) -> dict:
    """The stage-1 tensors of the last chunk forward in a ``recorded_launches`` log: gc, ga, gd,
    gok (the gates kernel's arguments) and xs, xh (the inverse's)."""
    gates = [e for e in log if e.name == "kda_fwd_gates_kernel"]
    inverse = [e for e in log if e.name == "kda_fwd_inverse_kernel"]
    assert gates and inverse, "no chunk forward ran"
    return {**{n: gates[-1].args[n] for n in ("gc", "ga", "gd", "gok")},
            **{n: inverse[-1].args[n] for n in ("xs", "xh")}}


def scan_given_u(log: list) -> list:
    """For every forward scan in a ``recorded_launches`` log, whether stage 1 handed it u (False:
    the scan formed u itself)."""
    return [e.args["u"] is not None for e in log if e.name == "kda_fwd_scan_kernel"]


def tol_for(dtype: torch.dtype, backend: str = "torch") -> float:
    return tolerance(dtype, backend)


def finite(t):
    return t is not None and bool(torch.isfinite(t).all())


__all__ = ["OPTION_SPACE", "random_case", "check", "check_grads", "gate_param_scales", "param_error", "gate_slope", "gate_input_error", "tol_for", "bounded", "plain_options", "launched", "stage1_of", "scan_given_u", "finite", "forced_gates", "FORMS", "short_forms",
           "math"]


FORMS = {"small": 1, "huge": 0, "front": 0, "edge": 1, "near": 1, "pivots": None}  # pivots: 16-token chunks only


def forced_gates(x: dict, C: int, layout) -> set:
    """Raw gate inputs set chunk by chunk (cyclically): "small" (-30 and below: activated gates near
    0; the middle anchor), "huge" (30 and above; the levels: softplus gates of 30 exp(A_log) nats,
    8 tokens far past 2^96 in base 2 for A_log >= 0; lower-bound gates at their bound, past 2^96
    for bounds below -8.3 only), "front" (the first 4 tokens huge, the rest as drawn minus 1: cumulative sums of 10^2 to
    10^4 whose differences are of order one, where float32 differences of the sums lose precision;
    the levels) or "edge" (with a lower bound of -8: the first 8 tokens at the bound, the rest near 0,
    a middle-anchor exponent of 11.5 * 8 = 92 <= 96 in base 2 and differences of order one next to
    sums near 92; the middle anchor) or "near" (with a lower bound of -8: tokens 4..8 at the bound,
    the rest near 0: a middle-anchor exponent of 11.5 * 5 = 57.7; the middle anchor) or "pivots"
    (tokens 0 and 8 huge, the rest near 0: on 16-token chunks the short path's halves). Returns the
    forms of the chunks of at least 16 tokens (1: middle anchor, 0: levels; as the chunk-wide path's
    96 decides them; none for "pivots")."""
    g, T = x["g"], x["g"].shape[1]
    forms = set()
    with torch.no_grad():
        for c in range(-(-T // C)):
            t0, kind = c * C, layout[c % len(layout)]
            rows = slice(t0, t0 + C)
            if kind == "huge":
                g[:, rows] = 30.0 + g[:, rows].abs()
            elif kind == "small":
                g[:, rows] = -30.0 - g[:, rows].abs()
            elif kind == "near":
                g[:, rows] = -30.0 - g[:, rows].abs()
                g[:, t0 + 4:t0 + 9] = 30.0 + g[:, t0 + 4:t0 + 9].abs()
            elif kind == "front":
                g[:, t0 + 4:t0 + C] -= 1.0
                g[:, t0:t0 + 4] = 30.0 + g[:, t0:t0 + 4].abs()
            elif kind == "pivots":
                g[:, rows] = -30.0 - g[:, rows].abs()
                for t in (t0, t0 + 8):
                    g[:, t:t + 1] = 30.0 + g[:, t:t + 1].abs()
            else:  # edge
                g[:, t0 + 8:t0 + C] = -30.0 - g[:, t0 + 8:t0 + C].abs()
                g[:, t0:t0 + 8] = 30.0 + g[:, t0:t0 + 8].abs()
            if T - t0 >= 16 and FORMS[kind] is not None:
                forms.add(FORMS[kind])
    return forms


def short_forms(x: dict, span: float = 96.0) -> set:
    """The forms the short kernel's 16-token chunks of unbounded gates take ("anchor" or "halves"),
    decided from the activated gates in float64 as the kernel decides them in float32 (short.py;
    chunks per sequence, every value head): a check that a test's layout reaches the forms it means
    to, away from the bound where the two could differ."""
    from fastkda.naive import activate

    opts = {n: x[n] for n in ("use_gate_in_kernel", "A_log", "dt_bias", "lower_bound") if n in x}
    g = activate(x["q"], x["k"], x["v"], x["g"], x["beta"], **opts)[3] / math.log(2)  # [B, T, HV, K], base 2
    cu = x.get("cu_seqlens")
    seqs = ([(0, int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])] if cu is not None
            else [(b, 0, g.shape[1]) for b in range(g.shape[0])])
    i = torch.arange(16, device=g.device)[:, None, None]
    forms = set()
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, 16):
            c = torch.zeros(16, *g.shape[2:], dtype=g.dtype, device=g.device)
            c[:min(16, eos - t0)] = g[b, t0:min(t0 + 16, eos)]
            c = c.clamp(min=-16384.0)
            J = torch.where((i == 0) | (i == 8), 0.0, c).cumsum(0)
            m = J - J[8] - torch.where(i < 8, c[8], 0.0)
            for h in range(c.shape[1]):
                forms.add("anchor" if m[:, h].abs().max() <= span else "halves")
    return forms
