"""The benchmark scripts' BENCHMARKS.md renderers, on made-up results (their timing needs a GPU;
a renderer that breaks should not cost a GPU run to find out)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

ENV = "date 2026-01-01, device Test GPU, torch 0, python 3, triton 0"


@pytest.fixture
def sections():
    """The sections a renderer writes, by name (each test points its script's write_section here
    instead of BENCHMARKS.md)."""
    return {}


def test_bench_ops_render(tmp_path, sections, monkeypatch):
    import bench_ops

    monkeypatch.setattr(bench_ops, "write_section", lambda name, md, *a, **k: sections.__setitem__(name, md))
    lib = {"ms": 2.0, "first_s": 1.0, "peak_gib": 1.5, "err": 3e-3, "gbps": 300.0}
    res = {"env": ENV, "copy_tbps": 4.0, "fla_version": "0.6.0", "suites": {
        "forward": [{"case": "B1 T8192 H64", "fastkda": lib, "fla": {**lib, "ms": 1.0}},
                    {"case": "B1 T32768 H16", "fastkda": lib}],
        "compile": [{"case": "B1 T8192 H64", "fastkda": {"cold_s": 12.0}, "fla": {"cold_s": 30.5}},
                    {"case": "B1 T8192 H64 softplus", "fastkda": {"cold_s": 9.25}}],
        "backward": [{"case": "B1 T8192 H64 safe", "fastkda": {"ms_fwd_bwd": 10.0, "ms_bwd": 8.0, "first_s": 5.0,
                                                                 "peak_gib": 3.6},
                      "fla": {"ms_fwd_bwd": 8.0, "ms_bwd": 6.0, "first_s": 100.0, "peak_gib": 3.8}}],
        "decode": {"rows": [{"N": 256, "H": 32, "HV": 32, "K": 64,
                             "fastkda": {"ms": 0.5, "graph_ms": 0.4, "graph_tbps": 2.7, "host_us": None},
                             "fastkda bfloat16": {"ms": 0.3, "graph_ms": 0.2, "graph_tbps": 2.8, "host_us": None},
                             "fla": {"ms": 0.4, "graph_ms": 0.44, "graph_tbps": 2.4, "host_us": None}},
                            {"N": 1, "H": 32, "HV": 32,
                             "fastkda": {"ms": 0.01, "graph_ms": 0.008, "graph_tbps": 0.5, "host_us": 21.5},
                             "fastkda bfloat16": {"ms": 0.01, "graph_ms": None, "graph_tbps": None, "host_us": 22.0},
                             "fla": {"ms": 0.012, "graph_ms": 0.009, "graph_tbps": 0.4, "host_us": 30.25}}],
                   "launch_sweep": [{"BV": 16, "warps": 1, "stages": 1, "programs_per_sm": 32, "graph_ms": 0.36,
                                     "graph_tbps": 3.0, "err_vs_default": 0.0},
                                    {"BV": 32, "warps": 4, "stages": 2, "programs_per_sm": 10**6, "graph_ms": None,
                                     "graph_tbps": None, "err_vs_default": 1e-7},
                                    {"pool": "bfloat16", "BV": 32, "warps": 1, "graph_ms": 0.2, "err_vs_default": 0.0}],
                   "pool_error": {"float32": {"o": 1e-6, "state": 2e-6, "steps": 64},
                                  "bfloat16": {"o": 3e-3, "state": 4e-3, "steps": 64}}},
    }}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    bench_ops.render(str(path))
    bench_ops.render_backward(res)
    bench_ops.render_decode(res)
    assert "| B1 T8192 H64 | 2.000 | 1.000 | 0.50x |" in sections["gpu-forward"]
    assert "| B1 T32768 H16 | 2.000 | - | - |" in sections["gpu-forward"]
    assert "| B1 T8192 H64 | 12.0 / 30.5 |" in sections["gpu-forward"]
    assert "| B1 T8192 H64 softplus | 9.2 / - |" in sections["gpu-forward"]
    assert "| B1 T8192 H64 safe | 10.00 / 8.00 | 0.80x |" in sections["gpu-backward"]
    md = sections["gpu-decode"]
    assert ("| 256 | 32 / 32 | 64 | 0.4000 | 2.70 (68%) | 0.4400 | 1.10x | 0.5000 | 0.4000 | 0.2000 | 2.80 (70%) | 2.00x |"
            in md), md
    assert "| 1 | 32 / 32 | 128 | 0.0080 | 0.50 (12%) | 0.0090 | 1.12x | 0.0100 | 0.0120 | - | - | - |" in md, md
    assert "H=32: fastkda 21.5 us (bf16 pool 22.0 us), fla-core 30.2 us" in md, md
    assert "at N = 1 (calls issued back to back)" in md, md  # results without the method: one loop each
    assert "bfloat16 pool: outputs 3.0e-03, final states 4.0e-03" in md and "64 decode steps" in md
    assert "BV=16 1 warps, 32 programs per SM: 0.3600 ms (75%)" in md
    assert "BV=32 4 warps, 2 stages, one program per tile: - ms" in md
    assert "float32 pool (graph replays, % of copy bandwidth)" in md
    assert "bfloat16 pool (graph replays, % of copy bandwidth): BV=32 1 warps: 0.2000 ms." in md
    res["suites"]["decode"]["host_method"] = {"rounds": 7, "calls": 1000}
    bench_ops.render_decode(res)
    assert ("at N = 1 (7 rounds of 1000 calls issued back to back, the libraries taking turns round by round; "
            "the median round)" in sections["gpu-decode"]), sections["gpu-decode"]



def test_bench_ops_render_flashkda(tmp_path, sections, monkeypatch):
    """FlashKDA's columns appear where it was timed: its time and ratio, its error; '-' on the cases
    its kernel does not take. Likewise fastkda's chunk-wide path (--libs fastkda-chunk)."""
    import bench_ops

    monkeypatch.setattr(bench_ops, "write_section", lambda name, md, *a, **k: sections.__setitem__(name, md))
    lib = {"ms": 2.0, "first_s": 1.0, "peak_gib": 1.5, "err": 3e-3, "gbps": 300.0}
    res = {"env": ENV, "copy_tbps": 4.0, "fla_version": "0.6.0", "flashkda_version": "0.1.0", "suites": {
        "forward": [{"case": "B1 T8192 H64", "fastkda": lib, "fla": {**lib, "ms": 3.0},
                     "flashkda": {**lib, "ms": 1.0, "err": 5e-3}},
                    {"case": "B1 T8192 H64 softplus", "fastkda": lib, "fla": {**lib, "ms": 3.0}}]}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    bench_ops.render(str(path))
    md = sections["gpu-forward"]
    assert "fla-core 0.6.0, FlashKDA 0.1.0;" in md
    assert "| case | fastkda ms | fla ms | ratio | FlashKDA ms | ratio |" in md
    assert "| B1 T8192 H64 | 2.000 | 3.000 | 1.50x | 1.000 | 0.50x | 300 (0.150) |" in md, md
    assert "| 3.0e-03 / 3.0e-03 / 5.0e-03 |" in md
    assert "| B1 T8192 H64 softplus | 2.000 | 3.000 | 1.50x | - | - |" in md, md
    res["suites"]["forward"][0]["fastkda-chunk"] = {**lib, "ms": 2.5}  # fastkda's other path, where timed
    path.write_text(json.dumps(res))
    bench_ops.render(str(path))
    md = sections["gpu-forward"]
    assert "| case | fastkda ms | chunk-wide ms | fla ms | ratio | FlashKDA ms | ratio |" in md, md
    assert "| B1 T8192 H64 | 2.000 | 2.500 | 3.000 | 1.50x | 1.000 | 0.50x |" in md, md
    assert "| B1 T8192 H64 softplus | 2.000 | - | 3.000 | 1.50x | - | - |" in md, md
    import torch

    t = torch.empty(1, 8, 4, 128, dtype=torch.bfloat16, device="meta")
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert bench_ops.flashkda_takes({"q": t, "v": t}, dict(safe_gate=True, lower_bound=-5.0, **flags))
    assert not bench_ops.flashkda_takes({"q": t, "v": t.repeat(1, 1, 2, 1)}, dict(safe_gate=True, lower_bound=-5.0,
                                                                                 **flags))  # grouped value heads
    assert not bench_ops.flashkda_takes({"q": t, "v": t}, flags)  # the softplus gate

def test_bench_cp_render(tmp_path, sections, monkeypatch):
    import bench_cp

    monkeypatch.setattr(bench_cp, "write_section", lambda name, md, *a, **k: sections.__setitem__(name, md))
    rows1 = [{"T": 262144, "H": 32, "K": 128, "world": 1, "forward": {"ms": 40.0, "peak_gib": 20.0},
              "forward+backward": {"ms": 200.0, "peak_gib": 50.0}},
             {"T": 1048576, "H": 32, "K": 128, "world": 1, "forward": {"ms": 160.0, "peak_gib": 80.0},
              "forward+backward": {"error": "out of memory: CUDA out of memory"}}]
    rows2 = [{"T": 262144, "H": 32, "K": 128, "world": 2, "forward": {"ms": 25.0, "peak_gib": 10.0},
              "forward+backward": {"ms": 125.0, "peak_gib": 25.0}, "bytes_sent": 4 << 20, "bytes_received": 4 << 20}]
    paths = []
    for i, rows in enumerate((rows1, rows2)):
        paths.append(tmp_path / f"cp{i}.json")
        paths[-1].write_text(json.dumps({"env": ENV, "rows": rows}))
    bench_cp.write_section("gpu-cp", bench_cp.render([str(p) for p in paths]))
    md = sections["gpu-cp"]
    assert "| 262,144 | 32 | 2 | 25.00 | 1.60x | 125.00 | 1.60x | +25.0 GiB | 4 MiB / 4 MiB |" in md
    assert "| 1,048,576 | 32 | 1 | 160.00 | 1.00x | out of memory | - | - | - |" in md


def test_ncu_step_table(tmp_path):
    """tools/ncu_step.py's table of a Nsight Compute text report (the report's layout, cut down)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import ncu_step

    def kernel(name, grid, block, duration, unit, regs, spills):
        return f"""  {name} ({grid}, 64, 1)x({block}, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    DRAM Throughput                   %        19.62
    Duration                         {unit}       {duration}
    L1/TEX Cache Throughput           %        65.73
    Compute (SM) Throughput           %        31.74
    Section: Memory Workload Analysis
    Local Memory Spilling Requests                        {spills}
    Local Memory Spilling Request Overhead           %      no data
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle         6.16
    Section: Launch Statistics
    Registers Per Thread             register/thread             {regs}
    Section: Occupancy
    Achieved Occupancy                        %        12.31
"""
    report = tmp_path / "report.txt"
    report.write_text("==PROF== Connected to process 1\n" + kernel("kda_a_kernel", 256, 128, "726.72", "us", 255, "1,900,544")
                      + kernel("kda_b_kernel", 2, 256, "1.54", "ms", 168, 0) + "==PROF== Disconnected\n")
    rows = ncu_step.table(str(report)).splitlines()
    assert rows[0].startswith("| kernel | grid x block | time | DRAM% |")
    assert rows[2] == "| kda_a_kernel | 16384 x 128 | 726.72 us | 19.62 | 65.73 | 31.74 | 255 | 12.31 | 1,900,544 | 6.16 |"
    assert rows[3] == "| kda_b_kernel | 128 x 256 | 1.54 ms | 19.62 | 65.73 | 31.74 | 168 | 12.31 | 0 | 6.16 |"
    assert len(rows) == 4


def test_bench_ops_chunk_wide_lib(monkeypatch):
    """--libs fastkda-chunk times fastkda with its short path off, beside the plan's choice."""
    import bench_ops
    import torch
    from conftest import BACKENDS, DEVICE

    if "triton" not in BACKENDS:
        pytest.skip("no Triton")
    import fastkda
    from fastkda.backends.triton.common import recorded_launches
    from fastkda.backends.triton.plan import tuned
    from fastkda.testing import Case, make_inputs

    monkeypatch.setattr(bench_ops, "LIBS", ("fastkda", "fastkda-chunk"))
    impls = bench_ops._impls()
    x = make_inputs(Case(T=20, gate="safe"), device=DEVICE)
    with fastkda.use_backend("triton"), tuned(short_min_pairs=1), torch.no_grad(), recorded_launches() as log:
        impls["fastkda"](**x)
        impls["fastkda-chunk"](**x)
    names = [e.name for e in log]
    assert names.count("kda_fwd_short_kernel") == 1 and names.count("kda_fwd_gates_kernel") == 1, names


def test_sass_lines():
    """tools/sass_lines.py compiles a launch of a bench case for sm_90 offline and tables its
    instructions per source line (a process of its own: it compiles outside the interpreter)."""
    import subprocess

    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "sass_lines.py")
    out = subprocess.run([sys.executable, tool, "kda_fwd_scan_kernel", "--top", "5", "--warps", "8", "--set", "BV=32"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    head, *rows = out.stdout.strip().splitlines()
    assert head.startswith("kda_fwd_scan_kernel {'num_warps': 8") and "instructions per warp" in head and "REG:" in head
    assert len(rows) == 5 and all(r.split()[0].isdigit() for r in rows)
    assert any("scan.py:" in r or "tiles.py:" in r for r in rows)
