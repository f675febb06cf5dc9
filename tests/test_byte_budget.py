"""tools/byte_budget.py's table of which arguments each kernel reads and writes (``IO``), checked
against the kernels themselves: every launch of a call is run again from the arguments it started
with, once as it was (what changed is what it writes) and once with each argument poisoned (an
argument whose poison reaches what the launch writes is one it reads). The chunk tables, read by
every kernel that takes them, are not poisoned: they place the loads. An integer argument (a chunk's
form) the table lists need not show: flipping a form can change the outputs by less than their
rounding (the exact sums' float16 remainders in bfloat16 outputs)."""

import os
import sys

import pytest
import torch

from conftest import DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from byte_budget import IO, TABLES, traffic  # noqa: E402

CHUNK_MODULES = ("chunk_gates", "intra", "wy", "scan", "output", "short", "bwd_scan", "bwd_wy", "bwd_intra",
                 "bwd_l2norm")

# name: (input dtype, gate, training, options of the call (initial state and varlen: "state"; the first
# chunk's raw gates 8 higher, sums past the span of plain ones: "strong"), tuning, kernels it must launch and check)
CALLS = {
    "whole safe": (torch.bfloat16, "safe", True, {}, {}, {
        "kda_fwd_gates_kernel", "kda_fwd_intra_chunk_kernel", "kda_fwd_inverse_kernel", "kda_fwd_wu_kernel",
        "kda_fwd_scan_kernel", "kda_bwd_scan_kernel", "kda_bwd_state_kernel", "kda_bwd_v_kernel", "kda_bwd_k_kernel",
        "kda_bwd_gate_block_kernel", "kda_bwd_dg_kernel", "kda_bwd_qk_kernel"}),
    "whole softplus": (torch.bfloat16, "softplus", True, dict(strong=True), {}, {"kda_fwd_gates_kernel"}),
    "whole softplus unsplit": (torch.bfloat16, "softplus", True, {}, dict(split_unbounded=False),
                               {"kda_fwd_wu_kernel", "kda_bwd_gate_block_kernel"}),
    "pre-gated safe": (torch.bfloat16, "pregated", True, {}, {}, {"kda_fwd_gates_kernel", "kda_bwd_dg_kernel"}),
    "pre-gated block": (torch.float32, "pregated free", True, {}, {}, {"kda_fwd_gates_kernel", "kda_bwd_gate_kernel"}),
    "block float32": (torch.float32, "softplus", True, {}, {}, {"kda_fwd_intra_kernel", "kda_bwd_gate_kernel"}),
    "block no l2norm": (torch.float32, "softplus", True, dict(use_qk_l2norm_in_kernel=False), {},
                        {"kda_fwd_gates_kernel", "kda_bwd_qk_kernel"}),
    "state varlen": (torch.bfloat16, "safe", True, dict(state=True), {}, {"kda_bwd_scan_kernel"}),
    "short": (torch.bfloat16, "safe", False, {}, dict(short_min_pairs=1), {"kda_fwd_short_kernel"}),
    "short float16": (torch.float16, "softplus", False, {}, dict(short_min_pairs=1), {"kda_fwd_short_kernel"}),
    "split output": (torch.bfloat16, "safe", False, {}, dict(split_min_chunks=1, split_max_programs=1 << 20),
                     {"kda_fwd_output_kernel"}),
    "u in scan": (torch.bfloat16, "softplus", False, dict(state=True, strong=True), dict(u_in_scan=True),
                  {"kda_fwd_scan_kernel"}),
    "segments": (torch.bfloat16, "safe", False, {}, dict(segment_min_tokens=16, short_min_pairs=8),
                 {"kda_fwd_segment_output_kernel"}),
}


def kernels() -> dict:
    """The chunk path's jitted kernels by name."""
    from fastkda.backends.triton import kernels as all_kernels

    return {n: k for n, k in all_kernels().items() if k.fn.__module__.rsplit(".", 1)[-1] in CHUNK_MODULES}


def launches(dtype, gate, train, options, tuning, tune):
    """The launches of one call (with its backward when ``train``), each with its tensor arguments
    as they were when it started."""
    import fastkda
    from fastkda import use_backend
    from fastkda.backends.triton.common import recorded_launches

    tune(**tuning)
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K = 96, 1, 2, 32
    x = {n: torch.randn(1, T, h, K, generator=gen).to(DEVICE, dtype) for n, h in (("q", H), ("k", H), ("v", HV),
                                                                               ("g", HV))}
    x["beta"] = torch.randn(1, T, HV, generator=gen).to(DEVICE, dtype)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)
    if gate.startswith("pregated"):  # gates in [-5, 0), with ("pregated") or without the safe gate's promise
        x["g"] = -5 * torch.rand(1, T, HV, K, generator=gen).to(DEVICE, dtype)
        kw.update(safe_gate=gate == "pregated")
    else:
        kw.update(A_log=torch.empty(HV).uniform_(1, 16, generator=gen).log().to(DEVICE),
                  dt_bias=(torch.randn(HV * K, generator=gen) * 0.1).to(DEVICE), use_gate_in_kernel=True)
    if gate == "safe":
        kw.update(safe_gate=True, lower_bound=-5.0)
    if options.get("strong"):  # exact sums in the first chunk (plan.PLAIN_SUM_SPAN), plain ones in the second
        x["g"][:, :64] += 8
    if options.get("state"):
        kw["cu_seqlens"] = torch.tensor([0, 70, 96], dtype=torch.int32, device=DEVICE)
        kw["initial_state"] = torch.randn(2, HV, K, K, generator=gen).to(DEVICE)
    kw.update({n: v for n, v in options.items() if n not in ("state", "strong")})
    if train:
        for t in (*x.values(), *(kw[n] for n in ("A_log", "dt_bias", "initial_state") if n in kw)):
            t.requires_grad_(True)
    starts = []
    with use_backend("triton"), recorded_launches(lambda e: starts.append({n: v.detach().clone() for n, v in e.args.items()
                                                    if isinstance(v, torch.Tensor)})) as log:
        o, ht = fastkda.chunk_kda(**x, **kw)
        if train:
            (o.float().sum() + ht.sum()).backward()
    return list(zip(log, starts))


def _same(a, b):
    return torch.equal(torch.nan_to_num(a.float(), 1e30), torch.nan_to_num(b.float(), 1e30))


def observed(kernel, entry, start: dict) -> tuple[set, set]:
    """(arguments read, arguments written) of one launch, by running it again: floating-point ones
    poisoned with NaN, integer ones (but the chunk tables) with their lowest bit flipped (a chunk's form)."""
    tensors = {n: v for n, v in entry.args.items() if isinstance(v, torch.Tensor)}

    def rerun(poison=None):
        with torch.no_grad():
            for n, v in tensors.items():
                v.copy_(start[n])
            if poison is not None:
                x = tensors[poison]
                x.fill_(float("nan")) if x.is_floating_point() else x.bitwise_xor_(1)
            kernel[entry.grid](**entry.args, **entry.options)
        return {n: v.clone() for n, v in tensors.items()}

    after = rerun()
    changed = {n: ~((start[n] == after[n]) | (start[n].isnan() & after[n].isnan()) if start[n].is_floating_point()
                    else start[n] == after[n]) for n in tensors}
    written = {n for n, m in changed.items() if m.any()}
    read = set()
    for n in (n for n in tensors if n not in TABLES):
        out = rerun(poison=n)  # poison reaching the elements the launch writes
        if any(not _same(out[m][changed[m]], after[m][changed[m]]) for m in written):
            read.add(n)
    return read, written


@pytest.mark.parametrize("call", CALLS)
def test_kernel_io(call, tune):
    dtype, gate, train, options, tuning, must = CALLS[call]
    table = kernels()
    checked = set()
    for entry, start in launches(dtype, gate, train, options, tuning, tune):
        t = traffic(entry)
        read, written = observed(table[entry.name], entry, start)
        if written:  # a launch with nothing to do (a split pass no chunk took) shows nothing
            ints = {n for n, v in entry.args.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()}
            assert written == set(t.writes), entry.name
            assert read - ints == set(t.reads) - ints, entry.name
            assert read & ints <= set(t.reads), entry.name  # a flipped form may change nothing visible
            checked.add(entry.name)
    assert must <= checked


def test_every_kernel_checked():
    """Every kernel of the chunk path has an IO entry, and some call above launches it."""
    assert set(kernels()) == set(IO) == set().union(*(c[-1] for c in CALLS.values()))
