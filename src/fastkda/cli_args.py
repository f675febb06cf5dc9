"""Argument handling shared by the fastkda commands (``check`` in :mod:`fastkda.cli`, ``bench`` in
:mod:`fastkda.bench`): the parser whose errors are one line, the ``--device`` and ``--backend``
types, and why a forced backend cannot run here."""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

from .api import chunk_kda, explain, fused_recurrent_kda
from .backends import BackendUnavailableError, backends, use_backend


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``prog: error: message``, with exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def device_arg(value: str) -> str:
    """argparse type of --device: a device of this machine that fastkda runs on."""
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device (cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return value
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise argparse.ArgumentTypeError(f"{value!r}: this torch ({torch.__version__}) is a CPU-only build")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif dev.type == "xpu":
        count = torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0
    else:
        raise argparse.ArgumentTypeError(f"{value!r}: fastkda runs on cpu, cuda and xpu devices")
    if count == 0:
        raise argparse.ArgumentTypeError(f"{value!r}: no {dev.type} device is visible")
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{value!r}: {count} {dev.type} device(s) visible, numbered from 0")
    return value


def backend_arg(value: str) -> str:
    """argparse type of --backend: a registered backend's name."""
    names = [b.name for b in backends()]
    if value not in names:
        raise argparse.ArgumentTypeError(f"{value!r} is not a fastkda backend; registered: {', '.join(names)}")
    return value


def backend_error(forced: str | None, device: str, dtype: torch.dtype, grad: bool, H: int = 1,
                  K: int = 16) -> str | None:
    """Why the forced backend (``forced``, else FASTKDA_BACKEND) cannot run both operators on
    ``device`` for a call of ``dtype`` with H heads of dimension K = V and T = 16; None when it
    can or nothing is forced."""
    env = os.environ.get("FASTKDA_BACKEND")
    if not forced and env and env not in [b.name for b in backends()]:
        return f"FASTKDA_BACKEND={env!r} is not a fastkda backend; registered: {', '.join(b.name for b in backends())}"
    try:
        with use_backend(forced) if forced else contextlib.nullcontext():
            x = dict(q=torch.randn(1, 16, H, K), k=torch.randn(1, 16, H, K), v=torch.randn(1, 16, H, K),
                     g=-torch.rand(1, 16, H, K), beta=torch.rand(1, 16, H))
            x = {n: t.to(device=device, dtype=dtype if n in "qkv" else torch.float32) for n, t in x.items()}
            explain(fused_recurrent_kda, **x)
            explain(chunk_kda, **{n: t.requires_grad_(grad) for n, t in x.items()})
    except BackendUnavailableError as e:
        msg = str(e)
        if forced and msg.startswith(f"FASTKDA_BACKEND={forced} "):
            msg = f"--backend {forced} " + msg[len(f"FASTKDA_BACKEND={forced} "):]
        return f"{msg} (device {device})"
    return None
