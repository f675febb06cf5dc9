"""The SASS instructions of one kernel launch, per source line, from an offline compile for an
NVIDIA GPU: where a kernel's instructions go, on a machine without one.

    python tools/sass_lines.py KERNEL [--case "B1 T8192 H64"] [--gate safe] [--backward] [--nth 0]
                               [--warps W] [--set NAME=VALUE ...] [--arch 90] [--top 30]

The launch is the --nth of KERNEL in one call of a bench_ops case, as tools/byte_budget.py makes
it (the call's host code at the full shape, its kernels not run): its argument types, constexprs
and launch options, with --warps and --set (a constexpr, as a Python literal) changed, and the
plan's interpreter-only forms (emulated bfloat16 products, the plain softplus twin) as the GPU's.
It is compiled as the GPU would launch it (pointers 16-byte aligned) and disassembled with the
line table (the nvdisasm and cuobjdump bundled with Triton). Printed: registers and spill stack, the
instruction count (static: a loop body counts once), and the source lines with the most
instructions, each with its commonest opcodes.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
from compile_check import compile_record, resources, tool_path  # noqa: E402


# the launch's record (compile_check's form), from a dry run of the call under the interpreter
_DRY_RUN = """
import json, sys
sys.path.insert(0, {tools!r})
import byte_budget
from compile_check import launch_record
from fastkda.backends.triton import kernels
log = [e for e in byte_budget.launches({case!r}, {gate!r}, {backward!r}, {sm_count!r}) if e.name == {kernel!r}]
if len(log) <= {nth}:
    raise SystemExit("{kernel}: " + str(len(log)) + " launches in this call")
print(json.dumps(launch_record(kernels()[{kernel!r}], log[{nth}].args, log[{nth}].options)))
"""


def record(kernel: str, case: str, gate: str | None, backward: bool, nth: int, sm_count: int) -> dict:
    """The --nth launch of ``kernel`` in the call, as compile_check's record (its types, constexprs
    and options), from a dry run in a child process under the interpreter."""
    code = _DRY_RUN.format(tools=TOOLS, case=case, gate=gate, backward=backward, sm_count=sm_count, kernel=kernel,
                           nth=nth)
    env = {**os.environ, "TRITON_INTERPRET": "1", "FASTKDA_BACKEND": "triton"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit((out.stderr.strip() or "the dry run failed").splitlines()[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def lines(r: dict, arch: int) -> tuple[str, collections.Counter, dict]:
    """(registers and stack, instructions per source location, opcodes per location) of the record."""
    kernel = compile_record(r, arch, aligned=True)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool_path("nvdisasm"), "-g", "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([tool_path("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = resources(res)
    count, ops, where = collections.Counter(), collections.defaultdict(collections.Counter), "?"
    for ln in sass.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", ln)
        if m:
            count[where] += 1
            ops[where][m.group(2).split(".")[0]] += 1
    return usage, count, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel")
    ap.add_argument("--case", default="B1 T8192 H64", help="a case of bench_ops' forward or backward suite")
    ap.add_argument("--gate", default=None, help="override the case's gate: safe, softplus or 'softplus init'")
    ap.add_argument("--backward", action="store_true", help="the launches of a training step")
    ap.add_argument("--nth", type=int, default=0, help="which launch of the kernel in the call")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a constexpr changed")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sm-count", type=int, default=132, help="SMs of the GPU whose plan is made")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    r = record(a.kernel, a.case, a.gate, a.backward, a.nth, a.sm_count)
    if r["constexprs"].get("FAST") == 1:  # the interpreter's plain softplus twin: the GPU's plan takes form 2
        r["constexprs"]["FAST"] = 2
    for item in a.set:
        name, _, value = item.partition("=")
        if name not in r["constexprs"]:
            raise SystemExit(f"--set {item}: {a.kernel} has no constexpr {name!r}")
        r["constexprs"][name] = ast.literal_eval(value)
    if a.warps:
        r["options"]["num_warps"] = a.warps
    usage, count, ops = lines(r, a.arch)
    print(f"{a.kernel} {r['options']} sm_{a.arch}: {sum(count.values())} instructions per warp (static), {usage}")
    text = {}
    for where, n in count.most_common(a.top):
        path, _, num = where.rpartition(":")
        if path not in text:
            text[path] = open(path).read().splitlines() if os.path.exists(path) else []
        src = text[path][int(num) - 1].strip()[:80] if text[path] and num.isdigit() else ""
        top = ", ".join(f"{k} {v}" for k, v in ops[where].most_common(3))
        print(f"{n:6d}  {os.path.basename(path)}:{num:<5s} {top:34s} | {src}")


if __name__ == "__main__":
    main()
