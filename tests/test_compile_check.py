"""tools/compile_check.py, which ``./dev test`` runs after the CPU tier on the launches it recorded:
a variant the GPU compiler rejects fails the run, and --quiet prints only such variants; the test
suite's own probe kernels (tests/triton_probes.py) compile as the library's do."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(BK):
    return {"module": "fastkda.backends.triton.bwd_l2norm", "name": "kda_bwd_qk_kernel",
            "signature": {"x": "*fp32", "dxh": "*fp32", "dx": "*fp32", "rows": "i32"},
            "constexprs": {"H": 1, "G": 1, "K": 16, "BK": BK, "BR": 16, "L2NORM": True}, "options": {"num_warps": 4}}


PROBE = {"module": "triton_probes", "name": "exclusive_cumsum_kernel", "signature": {"x": "*fp32", "y": "*fp32"},
         "constexprs": {"N": 64, "M": 16}, "options": {}}


def test_compile_check_fails_on_a_variant_the_compiler_rejects(tmp_path):
    path = tmp_path / "launches.jsonl"
    # BK = 24: tl.arange takes powers of two only, which the interpreter does not check
    path.write_text("".join(json.dumps(r) + "\n" for r in (_record(16), _record(24), _record(16), PROBE)))
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"), str(path), "--quiet",
                          "--jobs", "1"], capture_output=True, text=True, env=env, timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 1, run.stdout + run.stderr
    assert lines[0] == "3 distinct kernel variants, compiling for sm_90"
    assert [ln.split()[0] for ln in lines[1:] if not ln.startswith(" ")] == ["FAIL", "2"], lines
    assert "BK=24" in lines[1] and lines[-1] == "2 compiled, 1 failed"
