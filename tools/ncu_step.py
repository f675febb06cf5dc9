"""One training step (or forward) of a benchmark case under Nsight Compute, and the report as a
table per kernel: time, occupancy, registers, spills, DRAM and L1 use.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \\
        python tools/ncu_step.py --case "B1 T8192 H64" --gate softplus > report.txt
    python tools/ncu_step.py --table report.txt

The step runs twice before the profiled one (compilation and autotuning stay out of the report);
only the third is profiled (cudaProfilerStart / Stop). Leave the clocks alone (--clock-control none).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

# report metric (as Nsight Compute prints it) -> column
COLUMNS = {"Duration": "time", "DRAM Throughput": "DRAM%", "L1/TEX Cache Throughput": "L1%",
           "Compute (SM) Throughput": "SM%", "Registers Per Thread": "regs", "Achieved Occupancy": "occ%",
           "Local Memory Spilling Requests": "spill req", "Warp Cycles Per Issued Instruction": "cyc/inst"}


def table(path: str) -> str:
    """The per-kernel table of an Nsight Compute text report."""
    text = open(path).read()
    parts = re.split(r"\n  (\w+) \((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)", text)
    rows = [f"| kernel | grid x block | {' | '.join(COLUMNS.values())} |", "|---|---|" + "---:|" * len(COLUMNS)]
    for i in range(1, len(parts) - 5, 6):
        name, gx, gy, gz, bx, body = parts[i:i + 6]
        cells = []
        for metric in COLUMNS:
            m = re.search(re.escape(metric) + r"\s+(\S+)\s+([\d,.]+)$", body, re.M) or \
                re.search(re.escape(metric) + r"\s+([\d,.]+)$", body, re.M)
            if not m:
                cells.append("-")
            elif metric == "Duration":
                cells.append(f"{m.group(2)} {m.group(1)}")
            else:
                cells.append(m.groups()[-1])
        rows.append(f"| {name} | {int(gx) * int(gy) * int(gz)} x {bx} | {' | '.join(cells)} |")
    return "\n".join(rows)


def step(case: str, gate: str | None, backward: bool):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from bench_ops import case_named

    import fastkda

    x, kw = case_named(case).inputs(gate, grad=backward)
    leaves = [*x.values(), kw["A_log"], kw["dt_bias"]]
    do = torch.randn_like(x["v"])

    def run():
        if backward:
            torch.autograd.grad(fastkda.chunk_kda(**x, **kw)[0], leaves, do)
        else:
            with torch.inference_mode():
                fastkda.chunk_kda(**x, **kw)

    run()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="B1 T8192 H64")
    ap.add_argument("--gate", default=None, help="override the case's gate: safe or softplus")
    ap.add_argument("--forward", action="store_true", help="the forward alone (inference mode)")
    ap.add_argument("--table", metavar="REPORT", help="print the table of a report instead")
    a = ap.parse_args()
    if a.table:
        print(table(a.table))
    else:
        step(a.case, a.gate, not a.forward)


if __name__ == "__main__":
    main()
