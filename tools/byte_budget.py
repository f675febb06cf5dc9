"""The bytes each kernel launch of one chunk_kda call must move, and the time of that traffic at a
given bandwidth: the floor each kernel's measured time is set against (BENCHMARKS.md, "Where the
time goes").

    python tools/byte_budget.py [--case "B1 T8192 H64"] [--gate safe] [--backward] [--tbps 4.3]
                                [--sm-count 132]

It runs on the CPU at the case's full shape with the kernels not running
(``recorded_launches(run=False)``, Triton's interpreter mode so that CPU tensors pass): the call's
host code makes its plan, for a GPU of --sm-count SMs, and its allocations. Each launch's bytes are
its tensor arguments', whole tensors: each tensor it writes once, each one it reads once, one it
reads and writes twice (a kernel that writes part of a tensor, such as the lower blocks of X, is
counted for all of it). Which arguments a kernel reads and writes, under which of its flags, is
``IO`` below; tests/test_byte_budget.py checks it against the kernels themselves (every argument
poisoned in turn, under the interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_ops import case_named  # noqa: E402


def _when(flag: bool, *names: str) -> list[str]:
    return list(names) if flag else []


# kernel name -> flags -> (arguments read, arguments written); an argument in both is read and
# written; arguments passed as None (gate parameters a call has not) drop out
IO: dict[str, Callable[[dict], tuple[list[str], list[str]]]] = {
    "kda_fwd_gates_kernel": lambda f: (
        ["g", "A_log", "dt_bias", *_when(not f["WHOLE"] and f["L2NORM"], "q", "k")],
        ["gc", *_when(f["WHOLE"], "gl"), *_when(not f["WHOLE"], "ga", "rs"), *_when(f["EXACT_SUMS"], "gd", "gok")]),
    "kda_fwd_intra_chunk_kernel": lambda f: (
        ["q", "k", "gc", *_when(f["EXACT_SUMS"], "gd"), *_when(f["SELECT"] != 0 or f["EXACT_SUMS"], "gok")],
        ["Aqk", "ls", "rs"]),
    "kda_fwd_intra_kernel": lambda f: (["q", "k", "gc", "ga", "rs"], ["Aqk", "ls"]),
    "kda_fwd_inverse_kernel": lambda f: (
        ["beta", "ls", *_when(f["STORE_DECAY"], "gc")],
        ["xs", *_when(f["X_COPY"], "xh"), *_when(f["STORE_DECAY"], "gl")]),
    "kda_fwd_wu_kernel": lambda f: (
        ["q", "k", "beta", "gc", "rs", "xs", *_when(f["NSV"] > 0, "v"), *_when(not f["WHOLE"], "ga"),
         *_when(f["EXACT_SUMS"], "gd"), *_when(f["EXACT_SUMS"] and f["SPLIT"], "gok")],
        ["w", "qg", "kd", *_when(f["NSV"] > 0, "u")]),
    "kda_fwd_scan_kernel": lambda f: (
        ["w", "kd", "gl", *(["v", "beta", "xs"] if f["U_IN"] else ["u"]), *_when(f["STORE_O"], "qg", "Aqk"),
         *_when(f["USE_H0"], "h0")],
        [*_when(f["STORE_O"], "o"), *_when(f["STORE_HT"], "ht"), *_when(f["STORE_H"], "h"),
         *_when(f["STORE_VN"], "vn")]),
    "kda_fwd_output_kernel": lambda f: (["qg", "Aqk", "h", "vn"], ["o"]),
    "kda_fwd_segment_output_kernel": lambda f: (["o_ext", "s_in"], ["o"]),
    "kda_fwd_short_kernel": lambda f: (
        ["q", "k", "g", "A_log", "dt_bias", "beta", *_when(not f["FORM_U"], "v")],
        ["w", "qg", "kd", "Aqk", "gl", "xs" if f["FORM_U"] else "u"]),
    "kda_bwd_scan_kernel": lambda f: (
        ["qg", "w", "kd", "Aqk", "gl", "do", *_when(f["USE_DHT"], "dht")],
        ["dhs", "dvn", *_when(f["STORE_DH0"], "dh0")]),
    "kda_bwd_state_kernel": lambda f: (
        ["h", *(["dhs", "vn"] if f["FROM_DH"] else ["do", "dvn"])],
        ["s_dkd", "s_dgam"] if f["FROM_DH"] else ["s_dqg", "s_dw"]),
    "kda_bwd_v_kernel": lambda f: (
        ["v", "beta", "u", "vn", "do", "dvn", "xs"], ["s_dA", "s_dL", "s_db", "dv"]),
    "kda_bwd_k_kernel": lambda f: (
        ["k", "beta", "w", "gc", "ls", "xs", "rs", "s_dw", "s_dL", "s_db"], ["s_dw", "s_dL", "dbeta"]),
    "kda_bwd_gate_block_kernel": lambda f: (
        ["q", "k", "gc", "rs", "s_dqg", "s_dkd", "s_dw", "s_dA", "s_dL", *_when(f["EXACT_SUMS"], "gd"),
         *_when(f["SELECT"] != 0 or f["EXACT_SUMS"], "gok")],
        ["s_dqg", "s_dkd", "s_dw", "s_tot"]),
    "kda_bwd_dg_kernel": lambda f: (
        [*_when(f["GATE"] != 0, "g"), "A_log", "dt_bias", "gc", "s_dw", "s_tot", "s_dgam"],
        ["dg", "dA_part", "dbias_part"]),
    "kda_bwd_gate_kernel": lambda f: (
        ["q", "k", *_when(f["GATE"] != 0, "g"), "A_log", "dt_bias", "gc", "ga", "rs", "s_dqg", "s_dkd", "s_dw",
         "s_dA", "s_dL", "s_dgam"],
        ["s_dqg", "s_dkd", "s_yb", "s_B", "dg", "dA_part", "dbias_part"]),
    "kda_bwd_qk_kernel": lambda f: ([*_when(f["L2NORM"], "x"), "dxh"], ["dx"]),
}
TABLES = ("cu_seqlens", "chunk_indices", "chunk_offsets")  # read by every kernel that takes them


class Traffic(NamedTuple):
    """One launch's traffic: tensor arguments read and written (by name), bytes of each."""

    name: str
    reads: dict
    writes: dict

    @property
    def bytes(self) -> int:
        return sum(self.reads.values()) + sum(self.writes.values())


def traffic(entry) -> Traffic:
    """The traffic of one ``Launched`` record (``IO`` says which arguments it reads and writes)."""
    if entry.name not in IO:
        raise KeyError(f"byte_budget.IO: no entry for {entry.name}")
    flags = {n: v for n, v in entry.args.items() if not isinstance(v, torch.Tensor)}
    reads, writes = IO[entry.name](flags)
    unknown = sorted(set(reads + writes) - set(entry.args))
    if unknown:
        raise KeyError(f"byte_budget.IO[{entry.name}]: no arguments {unknown}")
    size = {n: t.numel() * t.element_size() for n, t in entry.args.items() if isinstance(t, torch.Tensor)}
    reads = [*reads, *(n for n in TABLES if n in size)]
    return Traffic(entry.name, {n: size[n] for n in reads if n in size}, {n: size[n] for n in writes if n in size})


def launches(case: str, gate: str | None, backward: bool, sm_count: int):
    """The launches of one forward (or forward and backward) of ``case``, kernels not run."""
    import fastkda
    from fastkda.backends.triton.common import recorded_launches
    from fastkda.backends.triton.plan import tuned

    x, kw = case_named(case).inputs(gate, device="cpu", grad=backward)
    with tuned(sm_count=sm_count), recorded_launches(run=False) as log:
        o, _ = fastkda.chunk_kda(**x, **kw)
        if backward:
            o.backward(torch.ones_like(o))
    return log


def table(log, tbps: float) -> str:
    """A markdown table: one row per launch, then the total."""
    rows = ["| kernel | reads | writes | MB | floor ms |", "|---|---|---|---:|---:|"]
    total = 0
    for t in map(traffic, log):
        total += t.bytes
        rows.append(f"| {t.name} | {', '.join(t.reads)} | {', '.join(t.writes)} | {t.bytes / 1e6:,.0f} "
                    f"| {t.bytes / tbps / 1e9:.3f} |")
    rows.append(f"| all | | | {total / 1e6:,.0f} | {total / tbps / 1e9:.3f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="B1 T8192 H64", help="a case of bench_ops' forward or backward suite")
    ap.add_argument("--gate", default=None, help="override the case's gate: safe, softplus or 'softplus init'")
    ap.add_argument("--backward", action="store_true", help="a training step: forward and backward")
    ap.add_argument("--tbps", type=float, default=4.3, help="bandwidth of the floor, TB/s")
    ap.add_argument("--sm-count", type=int, default=132, help="SMs of the GPU whose plan is made")
    a = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fastkda imports triton: CPU tensors pass
    os.environ.setdefault("FASTKDA_BACKEND", "triton")
    print(table(launches(a.case, a.gate, a.backward, a.sm_count), a.tbps))


if __name__ == "__main__":
    main()
