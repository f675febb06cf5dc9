"""Every address a kernel loads, stores or updates atomically under the Triton interpreter lies
inside one of its launch's tensor arguments (the view passed, not its storage): a kernel that
reads or writes past what it was given fails the test that ran it, whatever the mask was meant
to do. ``install()`` hooks the interpreter (Triton 3.6's ``GridExecutor`` and
``InterpreterBuilder``); ``take()`` returns and clears the violations seen since the last call."""

from __future__ import annotations

import threading

import numpy as np
import torch

_local = threading.local()  # the extents of the launch running in this thread
_lock = threading.Lock()
_seen: list[str] = []
_installed = False


def _extents(names, args_hst, kwargs_hst) -> list[tuple[str, int, int]]:
    """(name, first byte, one past the last byte) of each non-empty tensor argument."""
    out = []
    for name, a in [*zip(names, args_hst), *kwargs_hst.items()]:
        if isinstance(a, torch.Tensor) and a.numel() > 0:
            last = sum((n - 1) * s for n, s in zip(a.shape, a.stride()))
            out.append((name, a.data_ptr(), a.data_ptr() + (last + 1) * a.element_size()))
    return out


def _check(kind: str, ptrs: np.ndarray, mask: np.ndarray | None, nbytes: int) -> None:
    p = ptrs.astype(np.uint64).reshape(-1)
    if mask is not None:
        p = p[np.broadcast_to(mask.astype(bool), ptrs.shape).reshape(-1)]
    if p.size == 0:
        return
    extents = getattr(_local, "extents", [])
    inside = np.zeros(p.shape, dtype=bool)
    for _, lo, hi in extents:
        inside |= (p >= lo) & (p + nbytes <= hi)
    if inside.all():
        return
    bad = int(p[~inside][0])
    name, lo, hi = min(extents, key=lambda e: min(abs(bad - e[1]), abs(bad - e[2])), default=("?", bad, bad))
    where = f"byte {bad - lo} of `{name}` ({hi - lo} bytes)"
    with _lock:
        _seen.append(f"{getattr(_local, 'kernel', '?')}: {kind} of {int((~inside).sum())} elements outside its "
                     f"arguments, the first at {where}")


def install() -> None:
    """Hook the interpreter once (idempotent)."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter as interp

    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    init_args = executor._init_args_hst
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def size(ptrs):
        return np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _local.extents = _extents(self.arg_names, args_hst, kwargs_hst)
        _local.kernel = self.fn.__name__
        return args_hst, kwargs_hst

    def load_checked(self, ptrs, mask, other, *rest):
        _check("load", ptrs.data, mask.data, size(ptrs))
        return load(self, ptrs, mask, other, *rest)

    def store_checked(self, ptrs, value, mask, *rest):
        _check("store", ptrs.data, mask.data, size(ptrs))
        return store(self, ptrs, value, mask, *rest)

    def rmw_checked(self, op, ptr, val, mask, *rest):
        _check("atomic", ptr.data, mask.data, size(ptr))
        return rmw(self, op, ptr, val, mask, *rest)

    def cas_checked(self, ptr, cmp, val, *rest):
        _check("atomic", ptr.data, None, size(ptr))
        return cas(self, ptr, cmp, val, *rest)

    executor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    builder.create_atomic_rmw, builder.create_atomic_cas = rmw_checked, cas_checked
    _installed = True


def take() -> list[str]:
    """The violations since the last call (then none)."""
    with _lock:
        seen = _seen[:]
        _seen.clear()
    return seen
