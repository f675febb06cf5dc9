"""Packaging: the wheel that ``pip install .`` builds carries the runtime dependencies (NumPy for
the Triton interpreter among them), the MIT license and the ``fastkda`` command, and builds without
a license warning."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fastkda

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(src, dist, isolated=True):
    """``pip wheel`` of ``src`` into ``dist``: in an isolated build environment, or, where no package
    index answers (a machine without network), with this interpreter's setuptools if it meets
    pyproject.toml's build requirement; with neither, the test is skipped."""
    args = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(dist), str(src)]
    out = subprocess.run(args + ([] if isolated else ["--no-build-isolation"]), capture_output=True, text=True,
                         timeout=600)
    log = out.stdout + out.stderr
    if isolated and out.returncode != 0 and "No matching distribution found for setuptools" in log:
        try:
            import setuptools
        except ImportError:
            pytest.skip("no package index to fetch the build requirement from, and no setuptools here")
        least = int(re.search(r'"setuptools>=(\d+)', (ROOT / "pyproject.toml").read_text()).group(1))
        if int(setuptools.__version__.split(".")[0]) < least:
            pytest.skip(f"no package index, and setuptools {setuptools.__version__} here is older than {least}")
        return build_wheel(src, dist, isolated=False)
    return out, log


def test_wheel_metadata(tmp_path):
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out, log = build_wheel(src, tmp_path / "dist")
    assert out.returncode == 0, log[-4000:]
    assert not re.search(r"(?i)warning.*licen[cs]e|licen[cs]e.*deprecat", log), log[-4000:]
    (wheel,) = (tmp_path / "dist").glob("fastkda-*.whl")
    with zipfile.ZipFile(wheel) as z:
        info = f"fastkda-{fastkda.__version__}.dist-info"
        meta = z.read(f"{info}/METADATA").decode()
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    fields = [tuple(line.split(": ", 1)) for line in meta.split("\n\n")[0].splitlines() if ": " in line]
    requires = [v for k, v in fields if k == "Requires-Dist"]
    assert ("Version", fastkda.__version__) in fields
    assert ("License-Expression", "MIT") in fields and ("License-File", "LICENSE") in fields
    assert "torch>=2.5" in requires
    assert 'triton>=3.3; sys_platform == "linux"' in requires
    assert 'numpy<2.3; sys_platform == "linux"' in requires  # TRITON_INTERPRET=1 imports it
    assert {'matplotlib; extra == "bench"', 'tqdm; extra == "bench"'} <= set(requires)
    assert "fastkda = fastkda.cli:main" in entry_points
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n\nCopyright (c) the fastkda authors\n")


def test_dev_quick_selection_exists():
    """Every test that ``./dev quick`` names exists (a renamed one would make it fail to start)."""
    text = (ROOT / "dev").read_text()
    quick = re.search(r"^QUICK=\((.*?)\)$", text, re.S | re.M).group(1).split()
    names = [q.strip('"') for q in quick if q.startswith(("tests/", '"tests/'))]
    assert len(names) >= 8
    for name in names:
        path, _, func = name.partition("::")
        assert (ROOT / path).is_file(), name
        func = func.split("[")[0]
        assert not func or re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), name
