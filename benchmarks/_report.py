"""Writing measured tables into BENCHMARKS.md between named markers."""

from __future__ import annotations

import datetime
import pathlib
import platform as _platform

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def environment(device: str) -> str:
    from fastkda import platform

    parts = [
        f"date {datetime.date.today().isoformat()}",
        f"device {platform.device_name(device)}",
        f"torch {torch.__version__}",
        f"python {_platform.python_version()}",
    ]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    if device == "cpu":
        parts.append(f"{torch.get_num_threads()} threads")
    return ", ".join(parts)


def write_section(name: str, markdown: str, path: pathlib.Path = ROOT / "BENCHMARKS.md") -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
