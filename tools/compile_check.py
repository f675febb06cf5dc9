"""Compile for a GPU, on a machine without one, every Triton kernel variant the CPU tier launched.

The interpreter runs kernels as Python, so it does not catch what only the GPU compiler rejects
(shapes a matrix product does not take, shared memory over the limit) nor register spills. Record
the launches of a CPU-tier run, then compile each distinct variant for the target and report its
registers, spill stack and shared memory:

    FASTKDA_RECORD_LAUNCHES=launches.jsonl ./dev test tests/test_backward.py -k triton
    python tools/compile_check.py launches.jsonl [--arch 90] [--jobs 2]

Exit status 1 when a variant fails to compile (or exceeds the shared memory of the target).
``./dev test`` runs it after the CPU tier on the launches of that run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

# the test suite's own probe kernels (tests/triton_probes.py) are recorded by module name too
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

SMEM_LIMIT = {90: 232448, 100: 232448, 80: 166912}  # bytes per block (opt-in maximum)
DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64",
          "torch.int32": "i32", "torch.int64": "i64", "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1"}


def _variants(path):
    seen = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            key = json.dumps([r["module"], r["name"], r["signature"], r["constexprs"], r["options"]], sort_keys=True)
            seen.setdefault(key, r)
    return list(seen.values())


def tool_path(name: str) -> str | None:
    """A CUDA binary tool (cuobjdump, nvdisasm): Triton's bundled one, else the PATH's."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else shutil.which(name)


def launch_record(fn, bound: dict, options: dict) -> dict:
    """A launch as this tool's record: the jitted kernel ``fn`` (compiled or interpreted), its
    arguments by name, its launch options (num_warps, num_stages, maxnreg)."""
    import torch

    notes = getattr(fn.fn, "__annotations__", {})
    sig, consts = {}, {}
    for name, a in bound.items():
        if "constexpr" in str(notes.get(name, "")):
            consts[name] = a if isinstance(a, (int, float, str, bool)) or a is None else f"tl:{a}"  # a tl.dtype
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + DTYPES[str(a.dtype)]
        elif a is None:
            consts[name] = None
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    return {"module": fn.fn.__module__, "name": fn.fn.__name__, "signature": sig, "constexprs": consts,
            "options": {k: options[k] for k in ("num_warps", "num_stages", "maxnreg") if k in options}}


def compile_record(r, arch, aligned: bool = False):
    """The compiled kernel of a record for sm_<arch> (raises what the compiler raises). ``aligned``:
    its pointers 16-byte aligned, as the GPU's launches of contiguous tensors specialise them."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(r["module"]), r["name"])
    consts = {}
    if r["constexprs"].get("EMU"):  # the interpreter's bf16 product emulation: off on a GPU (dot_config)
        r = {**r, "constexprs": {**r["constexprs"], "EMU": False}}
    for key in ("PREC", "U_PREC"):  # the same, as a precision (the plan's intra_prec, wu_prec, ...)
        if r["constexprs"].get(key) == "bf16_emulated":
            r = {**r, "constexprs": {**r["constexprs"], key: "bf16"}}
    for name, value in r["constexprs"].items():
        if isinstance(value, str) and value.startswith("tl:"):
            value = tl.dtype(value[3:])
        consts[(fn.arg_names.index(name),)] = value
    sig = {n: r["signature"].get(n, "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if aligned and t.startswith("*")}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                          options=r["options"])


def compile_one(r, arch):
    label = f"{r['name']} {r['options']} " + " ".join(f"{k}={v}" for k, v in sorted(r["constexprs"].items()))
    try:
        k = compile_record(r, arch)
    except Exception as e:  # the report is the point
        return False, f"FAIL {label}\n    {type(e).__name__}: {str(e).strip().splitlines()[-1][:400]}"
    usage = ""
    tool = tool_path("cuobjdump")
    if tool:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        usage = resources(out)
    smem = k.metadata.shared
    ok = smem <= SMEM_LIMIT.get(arch, 232448)
    return ok, f"{'ok  ' if ok else 'SMEM'} {usage} smem={smem} {label}"


def resources(res_usage: str) -> str:
    """'REG:n STACK:m' from cuobjdump -res-usage's output."""
    line = next((ln.strip() for ln in res_usage.splitlines() if "REG:" in ln), "")
    return " ".join(p for p in line.split() if p.startswith(("REG:", "STACK:")))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("launches")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quiet", action="store_true", help="print the failures and the count only")
    args = p.parse_args()
    variants = _variants(args.launches)
    print(f"{len(variants)} distinct kernel variants, compiling for sm_{args.arch}", flush=True)
    bad = 0
    with cf.ProcessPoolExecutor(args.jobs) as pool:
        for ok, line in pool.map(compile_one, variants, [args.arch] * len(variants)):
            bad += not ok
            if not (ok and args.quiet):
                print(line, flush=True)
    print(f"{len(variants) - bad} compiled, {bad} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
