"""The values of ``cu_seqlens`` on the host: read back from the device (:func:`host_seqlens`),
checked (:func:`check_seqlens`, :func:`host_values`), and what is derived from them (chunk tables)
kept by the values themselves (:func:`seqlens_derived`), so that a tensor whose values change,
however they were written, gets its new values' entry.

:func:`options.chunk_options <fastkda.options.chunk_options>` checks the ``cu_seqlens`` argument
(shape, dtype, device) and reads its values here; the backends lay out their chunks through
:func:`seqlens_derived`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch

DERIVED_ENTRIES = 32  # values-and-key pairs kept by seqlens_derived, least recently used first out

_DERIVED: OrderedDict = OrderedDict()
_DERIVED_LOCK = threading.Lock()
_MISSING = object()
_LOCAL = threading.local()  # no_device_reads: the depth of its blocks in this thread


def host_seqlens(cu: torch.Tensor) -> torch.Tensor:
    """The values of ``cu`` (cu_seqlens) as an int64 CPU tensor, a copy read on every call: a device
    tensor costs one small device-to-host copy, which waits for the work queued before it. Callers
    that must not wait pass ``cu_seqlens_cpu``."""
    if cu.device.type != "cpu" and getattr(_LOCAL, "forbidden", 0):
        raise RuntimeError(f"`cu_seqlens` on {cu.device} read back to the host inside seqlens.no_device_reads()")
    return cu.detach().to("cpu", torch.int64, copy=True)


@contextlib.contextmanager
def no_device_reads() -> Iterator[None]:
    """Inside the block, in this thread, reading the values of a ``cu_seqlens`` that is not on the
    CPU (:func:`host_seqlens`, one host synchronisation) raises ``RuntimeError``: a check that a
    step passes its boundaries on the host (``cu_seqlens_cpu``)."""
    _LOCAL.forbidden = getattr(_LOCAL, "forbidden", 0) + 1
    try:
        yield
    finally:
        _LOCAL.forbidden -= 1


def check_seqlens(vals: list, T: int, short_ok: bool = False) -> None:
    """The values of cu_seqlens: from 0, non-decreasing, to T (to at most T with ``short_ok``:
    ``use_graph``, whose tail rows may be unused)."""
    if vals[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {vals[:8]}")
    bad = next((i for i in range(1, len(vals)) if vals[i] < vals[i - 1]), None)
    if bad is not None:
        raise ValueError(f"`cu_seqlens` must be non-decreasing, got {vals[bad - 1]} then {vals[bad]} at index {bad}")
    if vals[-1] > T or (vals[-1] != T and not short_ok):
        raise ValueError(f"`cu_seqlens` must end at the total length T={T}{' or before' if short_ok else ''}, got {vals[-1]}")


def host_values(cu: torch.Tensor, given: torch.Tensor | None, T: int) -> torch.Tensor:
    """The checked values of ``cu`` (cu_seqlens, ``T`` tokens in all) as an int64 CPU tensor: read
    back (:func:`host_seqlens`), or a copy of ``given`` (cu_seqlens_cpu, already checked to be a
    CPU int tensor of cu's shape), which vouches for them: compared with ``cu`` only when that is on
    the CPU. A copy: a later write by the caller cannot change this call's boundaries (nor its
    backward's)."""
    if given is None:
        host = host_seqlens(cu)
    else:
        host = given.detach().to(torch.int64, copy=True)
        if cu.device.type == "cpu" and not torch.equal(host, cu.detach().to(torch.int64)):
            a, b = cu.tolist(), host.tolist()
            i = next(i for i in range(len(a)) if a[i] != b[i])
            raise ValueError(f"`cu_seqlens` and `cu_seqlens_cpu` must hold the same values, got cu_seqlens[{i}]={a[i]} "
                             f"and cu_seqlens_cpu[{i}]={b[i]} (cu_seqlens={a[:8]}, cu_seqlens_cpu={b[:8]})")
    check_seqlens(host.tolist(), T)
    return host


def seqlens_derived(host: torch.Tensor, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` for the values of ``host`` (a CPU copy of cu_seqlens) and ``key``, kept for the
    next call with the same values and key. Thread-safe; nothing is kept when ``make`` raises.
    ``make`` runs outside the lock (two threads may both make an entry; the first one stays)."""
    full = (tuple(host.tolist()), key)
    with _DERIVED_LOCK:
        hit = _DERIVED.get(full, _MISSING)
        if hit is not _MISSING:
            _DERIVED.move_to_end(full)
            return hit
    value = make()
    with _DERIVED_LOCK:
        value = _DERIVED.setdefault(full, value)
        _DERIVED.move_to_end(full)
        while len(_DERIVED) > DERIVED_ENTRIES:
            _DERIVED.popitem(last=False)
    return value


def clear_cache() -> None:
    """Drop every entry :func:`seqlens_derived` keeps (the next calls make them again)."""
    with _DERIVED_LOCK:
        _DERIVED.clear()


def cache_size() -> int:
    """The number of entries :func:`seqlens_derived` keeps now (at most ``DERIVED_ENTRIES``)."""
    with _DERIVED_LOCK:
        return len(_DERIVED)
