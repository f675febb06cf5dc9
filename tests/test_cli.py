"""The command line: fastkda check and fastkda bench, end to end at tiny sizes."""

import pytest

from fastkda.cli import main


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


def test_bench_forced_backend_named(tmp_path, monkeypatch):
    """--backend forces fastkda's backend and the table names it; without it FASTKDA_BACKEND holds."""
    args = ["bench", "--device", "cpu", "--seqlens", "32", "--heads", "1", "--dim", "16", "--ops", "recurrent",
            "--repeats", "1"]
    assert main([*args, "--backend", "torch", "--out", str(tmp_path / "a")]) == 0
    assert "| recurrent | fastkda (torch) | 32 |" in (tmp_path / "a" / "bench.md").read_text()
    monkeypatch.setenv("FASTKDA_BACKEND", "nope")  # no --backend: the environment's forcing holds
    main([*args, "--out", str(tmp_path / "b")])
    assert (tmp_path / "b" / "bench.md").read_text().count("fastkda") == 1  # the fastkda row was reported, not timed
    with pytest.raises(SystemExit):
        main([*args, "--backend", "nope", "--out", str(tmp_path / "c")])


def test_unknown_command(capsys):
    assert main(["nope"]) == 2


def test_python_dash_m():
    """``python -m fastkda`` is the ``fastkda`` command."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fastkda", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: fastkda {check,bench}"), out.stderr
