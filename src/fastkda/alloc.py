"""Allocation of kernel outputs. ``new_empty`` is ``torch.empty``, except inside ``poisoned()``
(this thread only), where floating tensors start as NaN and integer ones as -1: any element a
kernel forgets to write then fails a comparison (the test suite runs under it); or, with
``fill="bits"``, as random bytes (any float, infinities and NaNs included, any integer): what
reused memory may hold, for the reads that a NaN passes unnoticed (a maximum, a comparison)."""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch

_poison = threading.local()


FILLS = ("nan", "bits")


@contextlib.contextmanager
def poisoned(enabled: bool = True, fill: str = "nan") -> Iterator[None]:
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    prev = getattr(_poison, "on", False), getattr(_poison, "fill", "nan")
    _poison.on, _poison.fill = enabled, fill
    try:
        yield
    finally:
        _poison.on, _poison.fill = prev


def _random_bytes(t: torch.Tensor) -> None:
    """Fill a new (contiguous) tensor with random bytes from this thread's generator of its device."""
    gens = getattr(_poison, "generators", None)
    if gens is None:
        gens = _poison.generators = {}
    gen = gens.get(t.device)
    if gen is None:
        gen = gens[t.device] = torch.Generator(device=t.device).manual_seed(0x5EED)
    if t.dtype == torch.bool:
        t.random_(0, 2, generator=gen)
    elif t.numel() > 0:
        t.reshape(-1).view(torch.uint8).random_(0, 256, generator=gen)


def new_empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if getattr(_poison, "on", False):
        if _poison.fill == "bits":
            _random_bytes(t)
        else:
            t.fill_(math.nan if t.is_floating_point() else -1)
    return t
