"""Allocation of kernel outputs. ``new_empty`` is ``torch.empty``, except inside ``poisoned()``
(this thread only), where floating tensors start as NaN and integer ones as -1: any element a
kernel forgets to write then fails a comparison (the test suite runs under it)."""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch

_poison = threading.local()


@contextlib.contextmanager
def poisoned(enabled: bool = True) -> Iterator[None]:
    prev = getattr(_poison, "on", False)
    _poison.on = enabled
    try:
        yield
    finally:
        _poison.on = prev


def new_empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if getattr(_poison, "on", False):
        t.fill_(math.nan if t.is_floating_point() else -1)
    return t
