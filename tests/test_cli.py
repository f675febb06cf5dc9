"""The command line: fastkda check and fastkda bench end to end at tiny sizes, and what
``python -m fastkda`` answers to bad arguments (one line on stderr, exit code 2)."""

import os
import subprocess
import sys

import pytest
import torch

import fastkda
from fastkda import bench
from fastkda.cli import check_parser, main

TINY = ["--device", "cpu", "--seqlens", "32", "--heads", "1", "--dim", "16", "--repeats", "1"]


def fastkda_cmd(*args):
    """``python -m fastkda ARGS`` in a fresh process, without FASTKDA_BACKEND: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "FASTKDA_BACKEND"}
    out = subprocess.run([sys.executable, "-m", "fastkda", *args], capture_output=True, text=True, timeout=300,
                         env=env)
    return out.returncode, out.stdout, out.stderr


def fastkda_main(capsys, *args):
    """What ``python -m fastkda ARGS`` does, in this process (each new process spends seconds importing
    torch): (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_check_quick_passes(capsys):
    assert main(["check", "--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "all passed" in out and "chunk_kda bwd" in out and "fused_recurrent_kda" in out


def test_bench_writes_table_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FASTKDA_BACKEND", raising=False)  # the automatic choice is named in the table
    out = tmp_path / "bench"
    assert main(["bench", "--device", "cpu", "--seqlens", "32,64", "--heads", "1", "--dim", "16",
                 "--repeats", "1", "--backward", "--out", str(out)]) == 0
    md = (out / "bench.md").read_text()
    assert "| chunk | fastkda (torch) | 64 |" in md and "reference loop" in md and "forward+backward" in md
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_forced_backend_named(tmp_path, monkeypatch, capsys):
    """--backend forces fastkda's backend and the table names it; without it FASTKDA_BACKEND holds,
    and a forcing that names no backend is an error before any work."""
    args = ["bench", *TINY, "--ops", "recurrent"]
    assert main([*args, "--backend", "torch", "--out", str(tmp_path / "a")]) == 0
    assert "| recurrent | fastkda (torch) | 32 |" in (tmp_path / "a" / "bench.md").read_text()
    monkeypatch.setenv("FASTKDA_BACKEND", "nope")  # no --backend: the environment's forcing holds
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "b")]) == 2
    assert "FASTKDA_BACKEND='nope' is not a fastkda backend" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_bench_fastkda_failure_is_an_error(tmp_path, monkeypatch, capsys):
    """fastkda failing during the sweep (it is timed first) ends it with exit code 1."""
    from fastkda.backends import registry

    class Broken(registry.Backend):
        name, priority, ops = "broken-test", -1, ("chunk_kda", "fused_recurrent_kda")

        def verify(self, op, opts, inputs):
            return True, "always"

        def fused_recurrent_kda(self, opts, inputs):
            raise RuntimeError("out of memory")

    registry.register(Broken())
    try:
        monkeypatch.delenv("FASTKDA_BACKEND", raising=False)
        assert main(["bench", *TINY, "--ops", "recurrent", "--backend", "broken-test", "--out", str(tmp_path)]) == 1
    finally:
        registry.unregister("broken-test")
    err = capsys.readouterr().err
    assert "fastkda bench: error: fastkda (broken-test) recurrent T=32: RuntimeError: out of memory" in err
    assert not (tmp_path / "bench.md").exists()


def test_python_dash_m():
    """``python -m fastkda`` is the ``fastkda`` command: its help, --version, and an argument error's
    exit code."""
    rc, out, err = fastkda_cmd("--help")
    assert rc == 0 and out.startswith("usage: fastkda {check,bench}") and "--version" in out, err
    rc, out, err = fastkda_cmd("--version")
    assert rc == 0 and out.strip() == f"fastkda {fastkda.__version__}", err
    rc, out, err = fastkda_cmd("bench", "--seqlens", "abc")
    assert rc == 2 and err.strip() == ("fastkda bench: error: argument --seqlens: takes comma-separated positive "
                                       "integers such as 256,1024; got 'abc' (see fastkda bench --help)"), err


def test_help_is_plain_text(capsys):
    for cmd in ("check", "bench"):
        rc, out, err = fastkda_main(capsys, cmd, "--help")
        assert rc == 0 and out.startswith(f"usage: fastkda {cmd}"), err
        assert "``" not in out and ":func:" not in out and ":mod:" not in out, out
    for p in (check_parser(), bench.parser()):  # every option says what it does
        assert all(a.help for a in p._actions), [a.dest for a in p._actions if not a.help]


@pytest.mark.parametrize("args, message", [
    (["check", "--backend", "nope"], "argument --backend: 'nope' is not a fastkda backend; registered: "),
    (["check", "--device", "tpu:0"], "argument --device: 'tpu:0'"),
    (["bench", "--device", "cpu:x"], "argument --device: 'cpu:x' is not a device (cpu, cuda or cuda:N)"),
    (["bench", "--seqlens", "64,-1"], "argument --seqlens: takes comma-separated positive integers"),
    (["bench", "--ops", "chunk,decode"], "argument --ops: takes chunk and/or recurrent, comma-separated; "
                                         "got 'chunk,decode'"),
    (["bench", "--heads", "0"], "argument --heads: takes a positive integer; got '0'"),
    (["bench", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["nope"], "fastkda: error: unknown command 'nope'"),
], ids=["check-backend", "check-device", "bench-device", "bench-seqlens", "bench-ops", "bench-heads", "bench-dtype",
        "command"])
def test_argument_errors(capsys, args, message):
    """Bad arguments: one line on stderr naming the argument and its value, exit code 2."""
    rc, out, err = fastkda_main(capsys, *args)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_check_cuda_without_cuda(capsys):
    rc, out, err = fastkda_main(capsys, "check", "--device", "cuda")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fastkda check: error: argument --device: 'cuda': "), err


@pytest.mark.parametrize("cmd", ["check", "bench"])
def test_backend_that_cannot_run(capsys, monkeypatch, tmp_path, cmd):
    """A forced backend that cannot run here (Triton on CPU tensors without the interpreter) is an
    error before any work, outside any progress bar."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, out, err = fastkda_main(capsys, cmd, "--device", "cpu", "--backend", "triton",
                                *(["--out", str(tmp_path)] if cmd == "bench" else []))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and out == "", err
    assert err.startswith(f"fastkda {cmd}: error: --backend triton cannot run "), err
    assert "TRITON_INTERPRET=1" in err and not any(tmp_path.iterdir())


def test_bench_without_optional_dependencies(capsys, monkeypatch, tmp_path):
    """Without matplotlib and tqdm the table is written; the command says so before the sweep, and
    how to get the plot."""
    monkeypatch.delenv("FASTKDA_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, find_spec says None
    monkeypatch.setitem(sys.modules, "tqdm", None)
    rc, out, err = fastkda_main(capsys, "bench", *TINY, "--ops", "recurrent", "--out", str(tmp_path))
    assert rc == 0, err
    assert err.splitlines()[0] == ("fastkda bench: no plot, no progress bar: matplotlib and tqdm come with "
                                   "pip install 'fastkda[bench]'"), err
    assert "| recurrent | fastkda (torch) | 32 |" in (tmp_path / "bench.md").read_text()
    assert not (tmp_path / "bench.png").exists()
    assert "no plot without matplotlib: pip install 'fastkda[bench]'" in out.splitlines()[-1]
